"""A chain model with unequal units for `pyplan partition`: a heavy embedding (many weights),
residual MLP layers of two widths, and a heavy head (most of the compute). Its children, with
`layers` flattened, are embed, layers.0 .. layers.5, head."""

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQUENCE, BATCH = 2048, 32, 8, 16


class Residual(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, hidden), \
            nn.Linear(hidden, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, x):
        return self.out(self.norm(x))


def model() -> nn.Module:
    widths = [4 * DIM, 4 * DIM, 16 * DIM, 16 * DIM, 4 * DIM, 4 * DIM]
    return nn.Sequential(OrderedDict(
        embed=nn.Embedding(VOCAB, DIM),
        layers=nn.Sequential(*(Residual(DIM, w) for w in widths)),
        head=Head()))


def batch(step: int):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
