"""One worker of `pyplan run --nproc-per-node D` (pyplan.cli.launch): torch's launcher runs this
file (runpy) in a process forked from pyplan's forkserver, with the rank's torchrun environment.
The exit code is the process's: 0 returns (torch's launcher waits for the return value), any
other exits; the process then ends without Python's teardown (multiprocessing's os._exit), as
pyplan.runtime.comm.leave would."""

import os
import sys

from pyplan.cli.launch import SAFE_PATH_MARK
from pyplan.cli.main import main

if os.environ.pop(SAFE_PATH_MARK, None):  # set for the forkserver's start, not the user's
    os.environ.pop("PYTHONSAFEPATH", None)
# The working directory off sys.path (the launcher's, which multiprocessing gave this process),
# so that a source tree does not shadow what the forkserver imported.
sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
code = main(sys.argv[1:])
if code:
    sys.exit(code)
