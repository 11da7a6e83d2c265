"""Options that name one of a few things, spelt the same in every command: `--optimizer` of
`pyplan partition` (the state it counts) and of `pyplan run` (what it trains with)."""

from __future__ import annotations

from pyplan.errors import PlanError, did_you_mean

__all__ = ["OPTIMIZERS", "optimizer"]

OPTIMIZERS = ("sgd", "adamw")
"""torch.optim.SGD and torch.optim.AdamW (pyplan.train.training builds them)."""


def optimizer(text: str) -> str:
    """The argparse type of --optimizer: one of OPTIMIZERS, else PlanError with a hint."""
    if text in OPTIMIZERS:
        return text
    if text.lower() in ("adam", "torch.optim.adam", "adamw"):
        hint = "adamw: torch.optim.AdamW, Adam with decoupled weight decay (--weight-decay 0 " \
               "makes it Adam); pyplan has no other Adam"
    else:
        hint = did_you_mean(text, OPTIMIZERS) or "sgd or adamw"
    raise PlanError(f"--optimizer {text!r} is not one of {', '.join(OPTIMIZERS)}", hint=hint)
