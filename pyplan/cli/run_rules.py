"""`pyplan run`'s options that would do nothing in the combination given, refused (exit 2) in
one line before any worker starts, never silently ignored: one table, RULES, of functions
(args, the plan's facts) -> a message and a hint, or None.

An option counts as given when the command line or --config gives it (`given`); a rule about
the run's length applies only when the length is known before the ranks start: --steps N, or
--iterations N (default 1) on a fresh start (a resumed run's start is its checkpoint's).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from pyplan.cli.launch import LAUNCH_OPTIONS
from pyplan.errors import PlanError

__all__ = ["Facts", "RULES", "check_rules", "last_step"]


@dataclass(frozen=True)
class Facts:
    """What the rules may ask besides the options: known once the plan is lowered (None
    before)."""

    given: frozenset[str]
    """The dests of the options the command line or --config gives."""
    programs: list[int] | None = None
    """Each rank's number of instructions."""
    optimizer: str | None = None
    """The optimizer the run trains with (--optimizer, else the plan's, else sgd)."""
    training: bool = True
    """Whether the plan trains (False: a task: inference plan, forward only)."""


def last_step(args: argparse.Namespace) -> int | None:
    """The run's last step, when known before the ranks start."""
    if args.steps is not None:
        return args.steps
    if args.resume is None:
        return args.iterations or 1
    return None


Message = tuple[str, str] | None
LAUNCHING = tuple(o.replace("-", "_") for o in LAUNCH_OPTIONS)


def _lr_min_without_decay(args, facts: Facts) -> Message:
    if "lr_min" in facts.given and args.lr_schedule == "constant":
        return ("--lr-min is where a decay ends, and --lr-schedule is constant",
                "give --lr-schedule linear or cosine, or leave --lr-min out")
    return None


def _decay_after_the_run(args, facts: Facts) -> Message:
    last = last_step(args)
    if args.lr_schedule != "constant" and last is not None and args.lr_warmup >= last:
        return (f"--lr-schedule {args.lr_schedule} never starts: --lr-warmup {args.lr_warmup} "
                f"lasts the whole run ({last} steps)",
                "shorten --lr-warmup, or train longer")
    return None


def _needs(option: str, needed: str, is_on: Callable[[argparse.Namespace], bool]):
    """A rule: `option` does nothing unless `needed` is on."""
    dest, flag = option.replace("-", "_"), needed.split()[0]

    def rule(args, facts: Facts) -> Message:
        if dest in facts.given and not is_on(args):
            return f"--{option} does nothing without {needed}", f"give {flag}, or leave " \
                f"--{option} out"
    rule.__name__ = f"_{dest}_needs_{flag.strip('-').replace('-', '_')}"
    return rule


def _after_the_run(option: str, what: str):
    """A rule: every K steps, with K beyond the run's last step, never happens."""
    dest = option.replace("-", "_")

    def rule(args, facts: Facts) -> Message:
        every, last = getattr(args, dest), last_step(args)
        if every is not None and last is not None and every > last:
            return (f"--{option} {every} never {what}: the run ends at step {last}",
                    f"give --{option} {last} or less, or train longer")
    rule.__name__ = f"_{dest}_after_the_run"
    return rule


def _profile_steps_after_the_run(args, facts: Facts) -> Message:
    last = last_step(args)
    beyond = [s for s in args.profile_steps or () if last is not None and s > last]
    if beyond:
        return (f"--profile-steps: step {beyond[0]} is never profiled: the run ends at step "
                f"{last}", f"give steps up to {last}, or train longer")
    return None


def _launching_under_torchrun(args, facts: Facts) -> Message:
    given = [o for o in LAUNCHING if o in facts.given]
    if given and args.nproc_per_node is None:
        option = "--" + given[0].replace("_", "-")
        return (f"{option} is an option of pyplan run's launcher, which only --nproc-per-node "
                "starts", f"add --nproc-per-node D, or give {option} to torchrun")
    return None


def _rank_that_does_not_exist(args, facts: Facts) -> Message:
    if facts.programs is None:
        return None
    ranks = len(facts.programs)
    for option, value in (("--fail-at", args.fail_at), ("--perturb", args.perturb)):
        rank = (value or "").partition(":")[0]
        if rank.isdigit() and int(rank) >= ranks:
            return (f"{option} {value}: the plan has ranks 0 to {ranks - 1}, no rank {rank}",
                    f"name a rank below {ranks}")
    return None


def _instruction_that_does_not_exist(args, facts: Facts) -> Message:
    if facts.programs is None or args.fail_at is None:
        return None
    rank, _, rest = args.fail_at.partition(":")
    index = rest.partition(":")[0]
    if rank.isdigit() and index.isdigit() and int(rank) < len(facts.programs) and \
            int(index) >= facts.programs[int(rank)]:
        return (f"--fail-at {args.fail_at}: rank {rank} runs instructions 0 to "
                f"{facts.programs[int(rank)] - 1} an iteration, no instruction {index}",
                "pyplan run --dry-run lists each rank's")
    return None


UPDATING = ("optimizer", "lr", "weight_decay", "adam_betas", "adam_eps", "clip_grad_norm",
            "lr_warmup", "lr_schedule", "lr_min")
"""The options of the update, which a forward-only run does not make."""


def _update_without_training(args, facts: Facts) -> Message:
    given = [o for o in UPDATING if o in facts.given]
    if given and not facts.training:
        option = "--" + given[0].replace("_", "-")
        return (f"{option} does nothing on an inference plan, which runs forward only (no "
                "update)", f"leave {option} out, or run a task: training plan")
    return None


def _adam_options_without_adam(args, facts: Facts) -> Message:
    if facts.optimizer is None or facts.optimizer == "adamw":
        return None
    for dest in ("adam_betas", "adam_eps"):
        if dest in facts.given:
            option = "--" + dest.replace("_", "-")
            return (f"{option} is AdamW's, and the run trains with {facts.optimizer}",
                    f"add --optimizer adamw, or leave {option} out")
    return None


def _bf16_parameters_without_bf16(args, facts: Facts) -> Message:
    if args.params == "bf16" and args.dtype != "bf16":
        return (f"--params bf16 computes in bf16, and --dtype is {args.dtype}",
                "add --dtype bf16, or leave --params out")
    return None


RULES = (
    _lr_min_without_decay,
    _decay_after_the_run,
    _needs("eval-batches", "--eval-every K", lambda a: a.eval_every is not None),
    _after_the_run("eval-every", "evaluates"),
    _needs("tolerance", "--check", lambda a: a.check),
    _needs("check-steps", "--check", lambda a: a.check),
    _after_the_run("save-every", "saves before the end"),
    _needs("async-save", "--save DIR", lambda a: a.save is not None),
    _needs("profile-steps", "--profile DIR", lambda a: a.profile is not None),
    _profile_steps_after_the_run,
    _launching_under_torchrun,
    _rank_that_does_not_exist,
    _instruction_that_does_not_exist,
    _update_without_training,
    _adam_options_without_adam,
    _bf16_parameters_without_bf16,
)
"""Each option that would do nothing, and when."""


def check_rules(args: argparse.Namespace, facts: Facts) -> None:
    """PlanError for the first rule `args` meets."""
    for rule in RULES:
        found = rule(args, facts)
        if found is not None:
            raise PlanError(found[0], hint=found[1])
