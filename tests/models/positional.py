"""A model that is not a chain of its children (learned positions are added in its forward),
for `pyplan partition` through torch's pipeline tracer: embedding, residual MLP layers, head."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQUENCE, BATCH = 512, 32, 8, 16


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), \
            nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Parameter(torch.randn(SEQUENCE, DIM) * 0.02)
        self.layers = nn.ModuleList(Residual() for _ in range(6))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model() -> nn.Module:
    return Model()


def batch(step: int):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
