"""The entry point: version, usage errors, and a reader that stops early."""

from __future__ import annotations

import subprocess
import sys

from conftest import PLANS
from pyplan import __version__


def test_version(capsys):
    from pyplan.cli import main

    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert capsys.readouterr().out.strip() == f"pyplan {__version__}"


def test_closed_pipe_stops_quietly(tmp_path):
    # `pyplan run --dry-run | head -1`: a long output whose reader goes away.
    proc = subprocess.Popen([sys.executable, "-m", "pyplan", "run",
                             str(PLANS / "gpt-mshape.resolved.yaml"), "--dry-run"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait() == 141
    assert err == ""
