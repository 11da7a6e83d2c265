"""A model whose layers are an nn.Sequential of nn.Sequentials (and one of an nn.ModuleList
holding nn.Sequentials), for plans whose hand-written stages name the outer children."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, BATCH = 16, 8


class Sequential(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                      for _ in range(8)])

    def forward(self, x):
        return self.layers(x)


class Listed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                     for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def sequential():
    return Sequential()


def listed():
    return Listed()


def batch(step: int):
    return torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)


def loss(output, targets):
    return F.mse_loss(output, targets)
