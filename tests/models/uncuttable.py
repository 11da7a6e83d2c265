"""Models pyplan partition must refuse in one line, not cut into a plan that pyplan run then
refuses: `Rooted`, whose root module owns a parameter its forward uses in two places, and which
has no list of layers (so only the traced cut would apply, whose tracer would copy the
parameter into two stages, their gradients summed by nothing); `Branchy`,
which calls its layers out of order and branches on a tensor's value (so neither its own
forward nor torch's tracer can be cut)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQUENCE, BATCH = 64, 16, 8, 8


class Rooted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, x):
        h = self.embed(x) * self.scale
        h = torch.tanh(self.a(h)) + h
        return self.head(torch.tanh(self.b(h)) * self.scale)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(4))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for layer in reversed(self.layers):
            h = torch.tanh(layer(h)) if h.sum() > 0 else layer(h)
        return self.head(h)


def rooted():
    return Rooted()


def branchy():
    return Branchy()


def batch(step):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
