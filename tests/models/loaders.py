"""Data given as a torch.utils.data DataLoader (shuffled), a Dataset of whole batches, and a
function that notes which ranks call it, for a 3-stage chain of linear layers."""

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

WIDTH, BATCH = 8, 4
_samples = TensorDataset(torch.arange(40 * WIDTH, dtype=torch.float32).reshape(40, WIDTH) / 100,
                         torch.arange(40 * WIDTH, dtype=torch.float32).reshape(40, WIDTH) / 50)
loader = DataLoader(_samples, batch_size=BATCH, shuffle=True)


class Batches(Dataset):
    def __len__(self):
        return 3

    def __getitem__(self, i):
        x = torch.full((BATCH, WIDTH), float(i + 1))
        return x, -x


batches = Batches()


def model():
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def noted(step: int):
    """A batch function that leaves a file per rank that called it."""
    folder = os.environ.get("PYPLAN_TEST_NOTES")
    if folder:
        (Path(folder) / f"rank{os.environ.get('RANK', 'none')}").touch()
    return torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)


def loss(output, targets):
    return F.mse_loss(output, targets)
