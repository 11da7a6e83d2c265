"""An 8-layer transformer language model for plans/transformer-vshape.yaml (the classic
V-shape, 1F1B): `build` splits it into 4 stages of 2 layers, `build_interleaved` into 8 stages
of 1 layer (two per device, for interleaved schedules), `build_two` into 2 stages of 4 layers
(a pipeline replicated for data parallelism). The first stage embeds, the last one
normalises and predicts the next token.

model: {blocks: "pyplan.examples.transformer:build",
        data: "pyplan.examples.transformer:batch", loss: "pyplan.examples.transformer:loss"}
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyplan.examples._layers import Layer

__all__ = ["BATCH", "LAYERS", "batch", "build", "build_interleaved", "build_two", "loss"]

VOCAB, DIM, HEADS, SEQUENCE, BATCH, LAYERS = 64, 32, 2, 8, 16, 8


class Stage(nn.Module):
    def __init__(self, index: int, count: int) -> None:
        super().__init__()
        self.first, self.last = index == 0, index == count - 1
        if self.first:
            self.embed = nn.Embedding(VOCAB, DIM)
            self.positions = nn.Parameter(torch.randn(SEQUENCE, DIM) * 0.02)
        self.layers = nn.Sequential(*(Layer(DIM, HEADS) for _ in range(LAYERS // count)))
        if self.last:
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x) + self.positions[: x.shape[1]]
        x = self.layers(x)
        return self.head(self.norm(x)) if self.last else x


def _stage(block: str, count: int) -> Stage:
    index = int(block[len("stage"):]) if block.startswith("stage") and \
        block[len("stage"):].isdigit() else -1
    if not 0 <= index < count:
        raise ValueError(f"the transformer example split into {count} stages has no block "
                         f"{block!r}")
    return Stage(index, count)


def build(block: str, group) -> nn.Module:
    """Four stages of two layers: stage0..stage3."""
    return _stage(block, 4)


def build_two(block: str, group) -> nn.Module:
    """Two stages of four layers: stage0, stage1 (plans/transformer-vshape-dp2.yaml)."""
    return _stage(block, 2)


def build_interleaved(block: str, group) -> nn.Module:
    """Eight stages of one layer: stage0..stage7."""
    return _stage(block, 8)


def batch(step: int):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
