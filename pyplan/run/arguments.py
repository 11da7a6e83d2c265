"""The Pipeline API's arguments, checked as `pyplan run` checks its options: each check
returns the RunError a bad value deserves, or None, so that Pipeline can agree on it with the
other ranks first (pyplan.comm.devices.agree_on_error) and every rank raises the same error."""

from __future__ import annotations

from pyplan.errors import RunError
from pyplan.run.data import describe

__all__ = ["SEEDS", "flag", "instance", "optimizer", "optimizer_state", "seconds", "seed",
           "whole"]

SEEDS = range(2**63)
"""The seeds `pyplan run --seed` takes (torch.manual_seed takes no more)."""


def seed(value) -> RunError | None:
    if isinstance(value, bool) or not isinstance(value, int) or value not in SEEDS:
        return RunError(f"Pipeline: seed {value!r} is not an integer from 0 to 2**63 - 1",
                        hint="the same integer seed on every rank, e.g. seed=0")
    return None


def seconds(what: str, value) -> RunError | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 < value <= 1e6:  # NaN too
        return RunError(f"Pipeline: {what} {value!r} is not a number of seconds from 0 to 1e6")
    return None


def whole(what: str, name: str, value, low: int, high: int = 2**63 - 1,
          none: bool = False) -> RunError | None:
    """An integer from `low` to `high` (or None, with `none`)."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        top = "2**63 - 1" if high == 2**63 - 1 else str(high)
        return RunError(f"{what}: {name} {value!r} is not an integer from {low} to {top}")
    return None


def instance(what: str, name: str, value, kind: type | tuple, words: str,
             none: bool = False) -> RunError | None:
    """`value` of `kind` (or None, with `none`), else RunError saying it should be `words`."""
    if (value is None and none) or isinstance(value, kind):
        return None
    return RunError(f"{what}: {name} is {describe(value)}, not {words}")


def flag(what: str, name: str, value) -> RunError | None:
    if not isinstance(value, bool):
        return RunError(f"{what}: {name} {value!r} is not True or False")
    return None


def optimizer(what: str, value, parameters: int) -> RunError | None:
    """A torch.optim optimizer, or None on a rank with no trainable parameter."""
    if value is None:
        if parameters:
            return RunError(f"{what}: got None for the optimizer, but this rank holds "
                            f"{parameters} trainable parameters, which would not be updated",
                            hint="pass the optimizer built over pipe.parameters() on every "
                                 "rank where they are not empty")
        return None
    if not callable(getattr(value, "step", None)) or \
            not isinstance(getattr(value, "param_groups", None), list):
        return RunError(f"{what}: got {type(value).__name__}, not an optimizer (or "
                        "None on a rank whose stages train no parameter)")
    return None


def optimizer_state(what: str, state, value) -> RunError | None:
    """What `state_dict(optimizer)` returns for `value`: RunError if it is not a dict, or
    holds another optimizer type's settings (its param_groups' keys, flattened as
    "param_groups.PARAMETER.KEY", lack this type's defaults)."""
    if value is None:
        return None
    if not isinstance(state, dict):
        return RunError(f"{what}: got {describe(state)} for the optimizer state, not "
                        "the dict state_dict(optimizer) returns")
    if not state:
        return RunError(f"{what}: got no optimizer state to load into the "
                        f"{type(value).__name__}", hint="load a state_dict(optimizer) of the "
                        "same optimizer type, or leave the optimizer out")
    held = {k.rpartition(".")[2] for k in state if isinstance(k, str)
            and k.startswith("param_groups.")}
    missing = sorted(set(getattr(value, "defaults", {})) - held)
    if missing:
        extra = sorted(held - set(value.defaults) - {"params", "initial_lr", "no_decay"})
        return RunError(f"{what}: the optimizer state is another optimizer type's "
                        f"than {type(value).__name__}: it has no {', '.join(missing[:3])}" +
                        (f" (but {', '.join(extra[:3])})" if extra else ""),
                        hint="load a state_dict(optimizer) of the same optimizer type")
    return None
