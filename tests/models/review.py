"""Small models for tests/test_cuda_paths.py: stages without trainable parameters, a value
with an int16 tensor, an output whose shape changes between micro-batches, a pass-through
`x + p` block, a tied model whose embedding block runs on two devices, DTensor parameters and
a loss that overflows fp16."""

from collections import OrderedDict

import torch
from torch import nn

ROWS, DIM, VOCAB = 8, 16, 32  # rows per micro-batch (4 micro-batches), width, vocabulary


def batch(step: int):
    return torch.randn(4 * ROWS, DIM), torch.randn(4 * ROWS, 1)


def loss(output, target):
    return ((output - target) ** 2).mean()


def two(name: str, group) -> nn.Module:
    """a, b: two Linear layers."""
    return nn.Linear(DIM, DIM if name == "a" else 1)


def free(name: str, group) -> nn.Module:
    """a, b, c: the middle stage has no parameters at all."""
    if name == "b":
        return nn.Sequential(nn.GELU(), nn.Tanh())
    return nn.Linear(DIM, DIM if name == "a" else 1)


def frozen(name: str, group) -> nn.Module:
    """a, b, c: the middle stage's parameters are frozen."""
    if name == "b":
        return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()).requires_grad_(False)
    return nn.Linear(DIM, DIM if name == "a" else 1)


class _Coded(nn.Module):
    """Hands on its hidden state with an int16 code of it (a dtype NCCL has no type for)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.linear(x)
        return {"hidden": h, "code": (h.detach() > 0).to(torch.int16)}


class _Decoded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, 1)

    def forward(self, value):
        return self.linear(value["hidden"] * value["code"].to(value["hidden"].dtype))


def coded(name: str, group) -> nn.Module:
    """a: an int16 tensor in its output; b: uses it."""
    return _Coded() if name == "a" else _Decoded()


class _Dropping(nn.Module):
    """Keeps the rows whose first feature is positive: a shape that varies with the data, as
    token dropping does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.linear(x)
        return h[h[:, 0] > 0]


def dropping(name: str, group) -> nn.Module:
    return _Dropping() if name == "a" else nn.Linear(DIM, 1)


def mean_loss(output, target):
    return output.pow(2).mean()


class _PassThrough(nn.Module):
    """x + p: the gradient of x and of p are the output's, the same tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(ROWS, DIM))

    def forward(self, x):
        return x + self.p


def pass_through(name: str, group) -> nn.Module:
    """a: a Linear; b: x + p (its input gradient goes back to a); c: the head."""
    if name == "b":
        return _PassThrough()
    return nn.Linear(DIM, DIM if name == "a" else 1)


def tied() -> nn.Module:
    """Embedding, two layers and a head whose weight is the embedding's."""
    model = nn.Sequential(OrderedDict(
        embed=nn.Embedding(VOCAB, DIM),
        layers=nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM)),
        head=nn.Linear(DIM, VOCAB, bias=False)))
    model.head.weight = model.embed.weight
    return model


def tokens(step: int):
    ids = torch.randint(0, VOCAB, (4 * ROWS, 5))
    return ids[:, :-1], ids[:, 1:]


def token_loss(logits, targets, group=None):
    """(A last block on several devices passes its group: its logits are whole on each.)"""
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def dtensor(name: str, group) -> nn.Module:
    """A block on two devices whose Linear torch's tensor parallelism shards (DTensors)."""
    if name == "a" or group is None:
        return nn.Linear(DIM, DIM if name == "a" else 2)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    return parallelize_module(nn.Linear(DIM, 2), DeviceMesh.from_group(group, "cpu"),
                              ColwiseParallel())


def overflowing_loss(output, target):
    """Large enough that, scaled by fp16's initial 2**16, its gradients overflow fp16."""
    return ((output - target) ** 2).mean() * 1e4


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.linear(x)
        return h, torch.tanh(h)


class _Relay(nn.Module):
    """Hands its second input on as it came (a skip connection past this stage); autograd
    saves neither input (a scale and a shift)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(DIM))

    def forward(self, value):
        h, skip = value
        return 2 * h + self.shift, skip


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, 1)

    def forward(self, value):
        h, skip = value
        return self.linear(h + skip)


def relay(name: str, group) -> nn.Module:
    """a, b, c: b hands a's second tensor on to c unchanged."""
    return {"a": _Split, "b": _Relay, "c": _Join}[name]()
