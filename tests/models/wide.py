"""Two blocks that hand on a wide activation (1 MiB per micro-batch), for measuring how much a
rank holds as the number of micro-batches grows; and a sequence length that changes with the
step, for shapes sent with every iteration."""

import torch
from torch import nn

ROWS, IN, WIDE = 64, 64, 4096  # rows per micro-batch; WIDE floats per row: 1 MiB out of `a`


def build(name, group):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, WIDE), nn.Tanh()) if name == "a" else nn.Linear(WIDE, 1)


def batch_for(micro_batches: int):
    def batch(step):
        return torch.randn(micro_batches * ROWS, IN), torch.randn(micro_batches * ROWS, 1)
    return batch


batch4, batch16 = batch_for(4), batch_for(16)


def loss(output, target):
    return ((output - target) ** 2).mean()


def growing(step):
    """Token batches whose sequence length grows with the step: 4, 6, 8 ..."""
    from pyplan.examples.transformer import VOCAB
    tokens = torch.randint(0, VOCAB, (16, 5 + 2 * step))
    return tokens[:, :-1], tokens[:, 1:]
