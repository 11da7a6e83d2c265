"""Small models for tests/test_gpu_review.py and tests/test_gpu.py (issue 47): a block whose
custom autograd.Function computes both gradients at once (its backward's runs counted, written
to $GPU_REVIEW_COUNTS + RANK), a block that returns its output on the CPU whatever the device, a loss
left in the compute dtype."""

import os

import torch
from torch import nn

ROWS, DIM = 8, 16  # rows per micro-batch (4 micro-batches), width


def batch(step: int):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(4 * ROWS, DIM, generator=generator), \
        torch.randn(4 * ROWS, 1, generator=generator)


def loss(output, target):
    return ((output - target) ** 2).mean()


def low_precision_loss(output, target):
    """A mean without a cast: under autocast it stays in the compute dtype (mean is not one of
    the operations autocast runs in fp32)."""
    return (output * output).mean()


class _Linear(torch.autograd.Function):
    """x @ w.T, both gradients computed at once; each backward appends a line to the file
    $GPU_REVIEW_COUNTS with this rank's number after it."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        path = os.environ.get("GPU_REVIEW_COUNTS")
        if path:
            with open(path + os.environ.get("RANK", ""), "a") as f:
                f.write("backward\n")
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM) / 4)

    def forward(self, x):
        return torch.tanh(_Linear.apply(x, self.w))


def custom(name: str, group) -> nn.Module:
    """a: a Linear; b: the custom Function, then the head."""
    if name == "a":
        return nn.Linear(DIM, DIM)
    return nn.Sequential(_Custom(), nn.Linear(DIM, 1))


class _Elsewhere(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.linear, self.device = nn.Linear(DIM, DIM), device

    def forward(self, x):
        return self.linear(x).to(self.device)


def on_the_cpu(name: str, group) -> nn.Module:
    """a: returns its output on the CPU (a .cpu() left in); b: the head."""
    return _Elsewhere("cpu") if name == "a" else nn.Linear(DIM, 1)


def on_meta(name: str, group) -> nn.Module:
    """a: returns its output on the meta device (on the CPU, another device than the rank's);
    b: the head."""
    return _Elsewhere("meta") if name == "a" else nn.Linear(DIM, 1)


def two(name: str, group) -> nn.Module:
    return nn.Linear(DIM, DIM if name == "a" else 1)
