"""A 24-layer GPT written as a chain of units, as `pyplan partition` wants it: embedding (with
learned positions), 24 transformer layers, and the head (final norm and vocabulary projection).
Its forward is its children run one after another.

    pyplan partition pyplan.examples.gpt_chain:model --data pyplan.examples.gpt_chain:batch \\
        --loss pyplan.examples.gpt_chain:loss --devices 4 -o plans/gpt24.yaml
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from pyplan.examples._layers import Embed, Head, Layer

__all__ = ["BATCH", "LAYERS", "batch", "loss", "model"]

VOCAB, DIM, HEADS, SEQUENCE, BATCH, LAYERS = 4096, 64, 4, 16, 16, 24


def model() -> nn.Module:
    """embed, layers.0 .. layers.23, head."""
    return nn.Sequential(OrderedDict(
        embed=Embed(VOCAB, DIM, SEQUENCE),
        layers=nn.Sequential(*(Layer(DIM, HEADS) for _ in range(LAYERS))),
        head=Head(DIM, VOCAB)))


def batch(step: int):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
