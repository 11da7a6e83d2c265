"""A plain MLP whose widths differ several-fold, with activations that save their outputs
(ReLU, Tanh: the next Linear saves the same tensor as its input) and one that saves its input
(GELU): the memory model counts each tensor once, and the backward's working set with the
activations of the layers below still held. Its children are the Linears and activations."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTHS, ROWS = [64, 512, 48, 768, 96, 384, 32, 640, 80, 1024, 128, 256], 64


def model() -> nn.Module:
    acts = [nn.ReLU, nn.Tanh, nn.GELU, nn.ReLU, nn.Tanh, nn.SiLU] * 2
    layers = []
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(acts):
            layers.append(acts[i]())
    return nn.Sequential(*layers)


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4 * ROWS, WIDTHS[0], generator=g), \
        torch.randn(4 * ROWS, WIDTHS[-1], generator=g)


def loss(out, targets):
    return F.mse_loss(out, targets)
