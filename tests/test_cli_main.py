"""The entry point: version, usage errors, and a reader that stops early."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

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


@pytest.mark.parametrize("delay", [0.3, 2.0])
def test_ctrl_c_during_a_solve_exits_130_and_writes_nothing(tmp_path, delay):
    # NN-shape, 6 micro-batches, memory 3, twenty times the default effort: many seconds of
    # Z3 work (enumeration, exact phases, windows, then the whole problem).
    out = tmp_path / "nn.resolved.yaml"
    process = subprocess.Popen([sys.executable, "-m", "pyplan", "solve",
                                str(PLANS / "tessel-nnshape.yaml"), "--micro-batches", "6",
                                "--memory", "3", "--effort", "20", "-o", str(out), "--quiet"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=tmp_path)
    time.sleep(delay)
    assert process.poll() is None, "the solve ended before the interrupt"
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=30)
    assert (process.returncode, stdout, stderr) == (130, "", "interrupted\n")
    assert not out.exists()
