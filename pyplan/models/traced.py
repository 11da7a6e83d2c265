"""The traced cut: torch.distributed.pipelining's tracer (torch.export) splits the model before
each stage's first unit, for models whose forward is not a chain of their children and has no
list of layers (learned positions added in forward, say)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from pyplan.errors import PlanError

__all__ = ["pieces"]


def pieces(model: nn.Module, starts: list[str], inputs) -> list[nn.Module]:
    """The model cut by torch's tracer before each name in `starts` (after the first): one
    module per stage, each taking and returning one value."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        with warnings.catch_warnings():  # torch.export's own deprecation notices, not ours
            warnings.simplefilter("ignore", FutureWarning)
            pipe = pipeline(model, mb_args=(inputs,),
                            split_spec={name: SplitPoint.BEGINNING for name in starts[1:]})
    except Exception as exc:  # the tracer's limits: name them in one line
        raise PlanError(f"torch's pipeline tracer cannot cut the model: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                        hint="make the model's forward its children in order, or call a list "
                             "of layers (model.layers) between embeddings and a head") from None
    if pipe.num_stages != len(starts):
        raise PlanError(f"torch's pipeline tracer cut the model into {pipe.num_stages} stages, "
                        f"not {len(starts)}", hint="split points must be submodules the "
                        "forward runs once, in order")
    return [pipe.get_stage_module(s) for s in range(pipe.num_stages)]
