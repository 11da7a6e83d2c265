"""A chain model without dropout (embedding, 8 residual MLP layers, head), so that another
runtime given the same weights, batches and schedule must reproduce pyplan's losses."""

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQUENCE, BATCH = 64, 32, 8, 16


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), \
            nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def model() -> nn.Module:
    return nn.Sequential(OrderedDict(
        embed=nn.Embedding(VOCAB, DIM),
        layers=nn.Sequential(*(Residual() for _ in range(8))),
        head=nn.Linear(DIM, VOCAB)))


def batch(step: int):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
