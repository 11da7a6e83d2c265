"""A small GPT for plans/gpt-mshape.yaml (Tessel's M-shape): the vocabulary-parallel embedding
and LM head run on all devices, one transformer layer per device in between.

model: {blocks: "pyplan.examples.gpt:build", data: "pyplan.examples.gpt:batch",
        loss: "pyplan.examples.gpt:loss"}
"""

from __future__ import annotations

import torch
from torch import nn

from pyplan.examples._layers import (Layer, VocabParallelEmbedding, VocabParallelHead,
                                     vocab_parallel_cross_entropy)

__all__ = ["BATCH", "SEQUENCE", "VOCAB", "batch", "build", "loss"]

VOCAB, DIM, HEADS, SEQUENCE, BATCH = 64, 32, 2, 8, 16


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
