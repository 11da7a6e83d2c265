"""Multi-branch models for graph pipelines (tests/test_graph.py): `uno`, CANDLE-Uno's shape
(parallel branches of Linear + ReLU reading their slices of the input, concatenated, a
head), and `forked`, a stem whose output every branch reads (a stage with several
successors), two branches' last layers tied to one weight (a tie across stages)."""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, FEATURES, WIDTH, BRANCHES = 16, 6, 8, 4


def _branch(width: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*[m for i in range(layers) for m in (
        nn.Linear(FEATURES if i == 0 else width, width), nn.ReLU())])


class Uno(nn.Module):
    def __init__(self, branches: int = BRANCHES, layers: int = 2) -> None:
        super().__init__()
        self.branches = nn.ModuleList(_branch(WIDTH, layers) for _ in range(branches))
        self.head = nn.Sequential(nn.Linear(branches * WIDTH, WIDTH), nn.ReLU(),
                                  nn.Linear(WIDTH, 1))

    def forward(self, x):
        return self.head(torch.cat([b(x[:, i]) for i, b in enumerate(self.branches)], dim=-1))


class Forked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(FEATURES, FEATURES)
        self.branches = nn.ModuleList(_branch(WIDTH, 2) for _ in range(3))
        self.branches[2][2].weight = self.branches[1][2].weight  # a tie across stages
        self.head = nn.Linear(3 * WIDTH, 1)

    def forward(self, x):
        h = torch.tanh(self.stem(x[:, 0]))
        return self.head(torch.cat([b(h) for b in self.branches], dim=-1))


def uno():
    return Uno()


def forked():
    return Forked()


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, BRANCHES, FEATURES, generator=g), torch.randn(BATCH, 1,
                                                                             generator=g)


def loss(out, targets):
    return F.mse_loss(out, targets)
