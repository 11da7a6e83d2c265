"""A small two-branch text/vision model for plans/flava-kshape.yaml (Tessel's K-shape, after
Flava): the text branch runs on devices 0-1 (left0, left1), the vision branch on devices 2-3
(right0, right1), and a tensor-parallel cross encoder on all devices joins them.

model: {blocks: "pyplan.examples.flava:build", data: "pyplan.examples.flava:batch",
        loss: "pyplan.examples.flava:loss"}
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyplan.examples._layers import ColumnParallelLinear, Layer, RowParallelLinear

__all__ = ["BATCH", "batch", "build", "loss"]

VOCAB, DIM, HEADS, WORDS, PATCHES, PATCH, CLASSES, BATCH = 64, 32, 2, 8, 4, 12, 10, 16


class Text(nn.Module):
    """inputs["text"] (B, WORDS) token ids -> embedding + one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Parameter(torch.randn(WORDS, DIM) * 0.02)
        self.layer = Layer(DIM, HEADS, causal=False)

    def forward(self, inputs: dict) -> torch.Tensor:
        return self.layer(self.embed(inputs["text"]) + self.positions)


class Vision(nn.Module):
    """inputs["image"] (B, PATCHES, PATCH) pixels -> patch projection + one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Linear(PATCH, DIM)
        self.positions = nn.Parameter(torch.randn(PATCHES, DIM) * 0.02)
        self.layer = Layer(DIM, HEADS, causal=False)

    def forward(self, inputs: dict) -> torch.Tensor:
        return self.layer(self.patches(inputs["image"]) + self.positions)


class Pool(nn.Module):
    """One more layer, then the mean over the sequence: (B, T, D) -> (B, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = Layer(DIM, HEADS, causal=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).mean(dim=1)


class Cross(nn.Module):
    """Both branches' features -> tensor-parallel MLP (residual) -> class logits."""

    def __init__(self, group) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(2 * DIM)
        self.up = ColumnParallelLinear(2 * DIM, 8 * DIM, group)
        self.down = RowParallelLinear(8 * DIM, 2 * DIM, group)
        self.classify = nn.Linear(2 * DIM, CLASSES)

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        h = torch.cat([text, image], dim=-1)
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return self.classify(h)


def build(block: str, group) -> nn.Module:
    parts = {"left0": Text, "left1": Pool, "right0": Vision, "right1": Pool}
    if block in parts:
        return parts[block]()
    if block == "cross":
        return Cross(group)
    raise ValueError(f"the flava example has no block {block!r}")


def batch(step: int):
    inputs = {"text": torch.randint(0, VOCAB, (BATCH, WORDS)),
              "image": torch.randn(BATCH, PATCHES, PATCH)}
    return inputs, torch.randint(0, CLASSES, (BATCH,))


def loss(logits: torch.Tensor, labels: torch.Tensor, group=None) -> torch.Tensor:
    """The cross encoder's logits are the same on all its ranks: the group is not needed."""
    return F.cross_entropy(logits, labels)
