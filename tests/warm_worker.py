"""A worker of tests/warm_torchrun.py: runs the script given first, with the arguments after it,
as `python SCRIPT ARGS...` would, in a process forked from pyplan's forkserver."""

import os
import runpy
import sys

import pyplan.comm
from pyplan.cli.launch import worker_environment

worker_environment()
script = sys.argv[1]
sys.argv = sys.argv[1:]
# sys.path as `python SCRIPT` has it: the script's folder first, not the launcher's (tests/).
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(script)] + [p for p in sys.path if os.path.abspath(p) != here]
# A script's comm.leave(code) (os._exit: no teardown) would end this process before torch's
# launcher has its return value; exiting through SystemExit, the process still ends without
# teardown (multiprocessing ends it with os._exit).
pyplan.comm.leave = sys.exit
runpy.run_path(script, run_name="__main__")
