"""`pyplan run PLAN --check --iterations 1 --json` for each resolved plan given, one after
another in this process, on every rank of one torchrun (tests/warm_torchrun.py): the process
group is made once, and each run joins it, so many models are trained on several ranks against
one process each for the cost of one launch. Rank 0 prints `PLAN: exit CODE` after each run
(its --json report just before)."""

import os
import sys

from pyplan.cli.main import main
from pyplan.comm.devices import join_world

join_world("cpu")
for plan in sys.argv[1:]:
    code = main(["run", plan, "--check", "--iterations", "1", "--json", "--device", "cpu"])
    if os.environ["RANK"] == "0":
        print(f"{plan}: exit {code}", flush=True)
