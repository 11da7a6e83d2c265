"""Python started in the repository's root imports the source folder `pyplan/` first, which
has no compiled core after `pip install .`: it must borrow the installed one, so that the
guides' scripts and `python -m pyplan` work from the root as from any other folder."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_python_in_the_repository_root_imports_pyplan_with_its_core():
    script = ("import pyplan, pyplan._core\n"
              "from pyplan.api import solve\n"
              "print(solve('plans/zb-v.yaml').schedule.makespan)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0


def test_python_m_pyplan_in_the_repository_root_runs():
    done = subprocess.run([sys.executable, "-m", "pyplan", "validate", "plans/zb-v.yaml"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("plans/zb-v.yaml: ok")
