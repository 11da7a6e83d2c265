"""For each resolved plan given: `pyplan run PLAN --check --iterations 3 --json` (the loss,
every gradient and every updated value of 3 optimizer steps against one process), one after
another in this process, on every rank of one torchrun (tests/warm_torchrun.py). A plan given
as `PLAN@SAVE` is also trained as a save and resume: 4 steps saved in SAVE-whole/, and 2 steps
saved in SAVE-half/, then resumed from there for 2 more saved in SAVE-resumed/. Rank 0 prints
`PLAN: exit CODE` after each run (a --check run's --json report just before)."""

import os
import sys

from pyplan.cli.main import main
from pyplan.comm.devices import join_world

join_world("cpu")
for given in sys.argv[1:]:
    plan, _, save = given.partition("@")
    runs = [["--check", "--iterations", "3", "--json"]]
    if save:
        runs += [["--iterations", "4", "--save", f"{save}-whole"],
                 ["--iterations", "2", "--save", f"{save}-half"],
                 ["--iterations", "2", "--resume", f"{save}-half", "--save",
                  f"{save}-resumed"]]
    for args in runs:
        code = main(["run", plan, *args, "--device", "cpu"])
        if os.environ["RANK"] == "0":
            print(f"{plan}: exit {code}", flush=True)
