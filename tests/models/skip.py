"""A model that is neither a chain of its children nor a list of layers: the output of its
first unit skips ahead to the third (a long residual). torch's pipeline tracer cuts it, so the
pieces hand on two tensors at the cut after `a` and after `b` (the hidden states and the
skipped one)."""

import torch
import torch.nn.functional as F
from torch import nn

DIM, BATCH = 16, 16


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.c, self.d = nn.Linear(DIM, DIM), nn.Linear(DIM, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        y = torch.tanh(self.b(self.drop(h)))
        y = torch.tanh(self.c(y)) + h
        return self.d(y)


def model() -> nn.Module:
    return Skip()


def batch(step: int):
    return torch.randn(BATCH, DIM), torch.randint(0, 4, (BATCH,))


def loss(logits, targets):
    return F.cross_entropy(logits, targets)
