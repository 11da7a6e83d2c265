"""Parameters of a multi-device block that hold this rank's chunk of a whole parameter
(hand-written tensor-parallel blocks, the M-shape's vocabulary-sharded embedding and head):
pyplan gathers their gradients for --check and never sums them over the block's ranks, as it
does a replicated parameter's."""

from __future__ import annotations

import torch

__all__ = ["SHARD_DIM", "shard", "shard_dim"]

SHARD_DIM = "pyplan_shard_dim"


def shard(param: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Mark `param` of a multi-device block as this rank's chunk of the whole parameter:
    torch.chunk(whole, group size, dim)[rank in group]. Unmarked parameters of such a block are
    replicated: pyplan sums their gradients over the block's ranks."""
    setattr(param, SHARD_DIM, dim)
    return param


def shard_dim(param: torch.Tensor) -> int | None:
    """The dimension along which `param` is this rank's chunk (None: replicated)."""
    return getattr(param, SHARD_DIM, None)
