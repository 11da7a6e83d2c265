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


def test_closed_pipe_stops_quietly(tmp_path, monkeypatch, capsys):
    # `pyplan validate ... | head -0`: the reader is gone when pyplan writes. (Simulated: this
    # sandbox does not reliably report EPIPE to a writer whose reader exited.)
    from pyplan.cli import main

    spare = open(tmp_path / "stdout", "w")  # a real descriptor for the redirect to devnull

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            return spare.fileno()

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["validate", str(PLANS / "tessel-vshape.yaml")]) == 141
    spare.close()
    assert capsys.readouterr().err == ""


def test_missing_compiled_core_is_one_line(tmp_path):
    # As in a source tree without a build: pyplan._core cannot be imported.
    code = ("import sys; sys.modules['pyplan._core'] = None; from pyplan.cli.main import main; "
            "sys.exit(main(['validate', 'x.yaml']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: pyplan's compiled core (pyplan._core) cannot be "
                                    "imported from ")
    assert result.stderr.count("\n") == 1 and "hint: in a source tree" in result.stderr
