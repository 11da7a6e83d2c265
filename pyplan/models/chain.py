"""The chain cut: a model whose forward is its children run one after another."""

from __future__ import annotations

import torch
from torch import nn

from pyplan.errors import TimeLimitError
from pyplan.models.calls import call, call_model

__all__ = ["is_chain", "stage", "units"]


def units(model: nn.Module, prefix: str = "") -> list[str]:
    """The model's children in order, nn.Sequential and nn.ModuleList flattened (so layers.0 ..
    layers.31 are units)."""
    found = []
    for name, child in model.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            found += units(child, f"{path}.")
        else:
            found.append(path)
    return found


def is_chain(model: nn.Module, names: list[str], inputs) -> bool:
    """Whether the units run one after another compute what the model computes (in eval mode,
    without dropout)."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole = call_model(model, inputs)
            x = call(model.get_submodule(names[0]), inputs)
            for name in names[1:]:
                x = model.get_submodule(name)(x)
    except TimeLimitError:  # (measured under pyplan.measure.limits: not this code's to keep)
        raise
    except Exception:  # children that cannot even run in a row: not a chain
        return False
    finally:
        model.train(was)
    return isinstance(whole, torch.Tensor) and isinstance(x, torch.Tensor) and \
        whole.shape == x.shape and bool(torch.allclose(whole, x, atol=1e-5))


def stage(model: nn.Module, names: tuple[str, ...], first: bool = False) -> nn.Module:
    """A stage's units of the model, run one after another; the `first` stage's first unit
    takes the micro-batch's inputs as the model does (pyplan.models.calls)."""
    parts = [model.get_submodule(name) for name in names]
    if first:
        return _First(*parts)
    return parts[0] if len(parts) == 1 else nn.Sequential(*parts)


class _First(nn.Sequential):
    """The first stage: its first unit called on the micro-batch's inputs (keywords of a
    dict, a tuple's positional arguments, a tensor), the others on what the one before
    returns."""

    def forward(self, inputs):
        parts = list(self)
        x = call(parts[0], inputs)
        for part in parts[1:]:
            x = part(x)
        return x
