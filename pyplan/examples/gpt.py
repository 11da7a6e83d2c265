"""A small GPT on Tessel's M-shape: the vocabulary-parallel embedding and LM head run on all
devices, one transformer layer per device in between.

`model()` is the whole GPT as one module, from which `pyplan partition --shape mshape` writes
plans/gpt-mshape.yaml (sharding its embedding and head with torch's DTensor); `build` is the
same placement written by hand, block by block, with hand-written tensor-parallel layers:

model: {blocks: "pyplan.examples.gpt:build", data: "pyplan.examples.gpt:batch",
        loss: "pyplan.examples.gpt:loss"}
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pyplan.examples import _layers
from pyplan.examples._layers import (Layer, VocabParallelEmbedding, VocabParallelHead,
                                     vocab_parallel_cross_entropy)

__all__ = ["BATCH", "LAYERS", "SEQUENCE", "VOCAB", "batch", "build", "loss", "model"]

VOCAB, DIM, HEADS, SEQUENCE, BATCH, LAYERS = 64, 32, 2, 8, 16, 4


def model() -> nn.Module:
    """The whole GPT: embed (tokens and learned positions), layers.0 .. layers.3, head (final
    norm and the vocabulary projection)."""
    return nn.Sequential(OrderedDict(
        embed=_layers.Embed(VOCAB, DIM, SEQUENCE),
        layers=nn.Sequential(*(Layer(DIM, HEADS) for _ in range(LAYERS))),
        head=_layers.Head(DIM, VOCAB)))


class Embed(nn.Module):
    """Token ids (B, T) -> vocabulary-parallel token embedding + positions (replicated)."""

    def __init__(self, group) -> None:
        super().__init__()
        self.tokens = VocabParallelEmbedding(VOCAB, DIM, group)
        self.positions = nn.Parameter(torch.randn(SEQUENCE, DIM) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Head(nn.Module):
    """Final norm (replicated) and vocabulary-parallel LM head: (B, T, D) -> (B, T, VOCAB / ranks),
    the logits of this rank's slice of the vocabulary."""

    def __init__(self, group) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.logits = VocabParallelHead(DIM, VOCAB, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.norm(x))


def build(block: str, group) -> nn.Module:
    if block == "embed":
        return Embed(group)
    if block == "head":
        return Head(group)
    if block.startswith("stage"):
        return Layer(DIM, HEADS)
    raise ValueError(f"the gpt example has no block {block!r}")


def batch(step: int):
    """Random token sequences; the targets are the inputs shifted by one."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Cross-entropy of the head's vocabulary-sharded logits (whole logits when group is None)."""
    return vocab_parallel_cross_entropy(logits, targets, group)
