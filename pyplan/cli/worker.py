"""One worker of `pyplan run --nproc-per-node D` (pyplan.cli.launch): torch's launcher runs this
file (runpy) in a process forked from pyplan's forkserver, with the rank's torchrun environment.
The exit code is the process's: 0 returns (torch's launcher waits for the return value), any
other exits; the process then ends without Python's teardown (multiprocessing's os._exit), as
pyplan.comm.leave would."""

import sys

from pyplan.cli.launch import worker_environment
from pyplan.cli.main import catch_interrupts, main

worker_environment()
catch_interrupts()
code = main(sys.argv[1:])
if code:
    sys.exit(code)
