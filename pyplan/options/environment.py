"""The environment variables pyplan reads: one table, checked by pyplan.cli.main before a command
runs (for `pyplan run`: before any worker starts, and again in each rank), like the options. A
variable that is unset or empty is not checked; one outside its rule is refused in one line that
names it, exit 2:

    error: $PYPLAN_DEVICE 'gpu' is not one of auto, cpu, cuda (hint: the device of every rank)

tests/test_run_options.py reads pyplan's source for every variable it reads and checks that
this table has it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pyplan.options.numbers import Number, whole
from pyplan.errors import PlanError

__all__ = ["ENVIRONMENT", "Words", "Variable", "check_environment"]

RUN, MEASURE = ("run",), ("run", "profile", "partition")


class Words:
    """A rule: one of these texts."""

    def __init__(self, *words: str) -> None:
        self.words = words

    def describe(self) -> str:
        return "one of " + ", ".join(self.words)

    def value(self, text: str) -> str:
        if text.strip() not in self.words:
            raise ValueError(text)
        return text.strip()


@dataclass(frozen=True)
class Variable:
    rule: Number | Words | None
    """What its value may be (None: any text, such as a path)."""
    meaning: str
    commands: tuple[str, ...] | None = None
    """The commands that read it (None: every command)."""


ENVIRONMENT = {
    "PYPLAN_DEVICE": Variable(Words("auto", "cpu", "cuda"), "the device of every rank when "
                              "--device is not given", RUN),
    "PYPLAN_BUILD": Variable(Words("whole"), "whole: every rank builds the whole model (to "
                             "compare)", RUN),
    "PYPLAN_CHECK_SYNC": Variable(Words("0", "1"), "1: check CUDA streams' synchronisation",
                                  RUN),
    "PYPLAN_CACHE_DIR": Variable(None, "the cache of validated plans (empty: none)"),
    "XDG_CACHE_HOME": Variable(None, "the cache's parent when $PYPLAN_CACHE_DIR is not set"),
    "OMP_NUM_THREADS": Variable(whole(1, 4096), "CPU threads of each process", MEASURE),
    "CUDA_VISIBLE_DEVICES": Variable(None, "CUDA's: the GPUs a process sees; read only to say "
                                     "why --device auto chose the CPU", RUN),
    "PYTHONSAFEPATH": Variable(None, "Python's: pyplan run's launcher sets it for its "
                               "forkserver alone when it is not set"),
    # torchrun's, set for each worker; checked when a worker's are there (RANK)
    "RANK": Variable(whole(0, 10**6 - 1), "this process's rank (torchrun sets it)", RUN),
    "WORLD_SIZE": Variable(whole(1, 10**6), "the number of ranks (torchrun sets it)", RUN),
    "LOCAL_RANK": Variable(whole(0, 10**6 - 1), "the rank on this machine (torchrun sets it)",
                           RUN),
    "LOCAL_WORLD_SIZE": Variable(whole(1, 10**6), "ranks on this machine (torchrun sets it)",
                                 RUN),
    "MASTER_ADDR": Variable(None, "where the ranks meet (torchrun sets it)", RUN),
    "MASTER_PORT": Variable(whole(1, 65535), "the port they meet at (torchrun sets it)", RUN),
    "TORCHELASTIC_USE_AGENT_STORE": Variable(Words("True", "False"), "whether torchrun's "
                                             "agent hosts the store (torchrun sets it)", RUN),
}
"""Each variable pyplan reads: its rule, what it does, and who reads it."""


def check_environment(command: str, environ=os.environ) -> None:
    """PlanError for the first variable `command` reads whose value breaks its rule, or for
    torchrun's ranks that do not fit their world."""
    values = {}
    for name, variable in ENVIRONMENT.items():
        text = environ.get(name, "")
        if variable.rule is None or not text.strip() or \
                (variable.commands is not None and command not in variable.commands):
            continue
        try:
            values[name] = variable.rule.value(text)
        except (ValueError, OverflowError):
            shown = text if len(text) <= 40 else text[:37] + "..."
            raise PlanError(f"${name} {shown!r} is not {variable.rule.describe()}",
                            hint=variable.meaning) from None
    for rank, world in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank in values and world in values and values[rank] >= values[world]:
            raise PlanError(f"${rank} {values[rank]} is not a rank of ${world} "
                            f"{values[world]} (0 to {values[world] - 1})",
                            hint="launch the ranks with torchrun or pyplan run "
                            "--nproc-per-node, which set them")
