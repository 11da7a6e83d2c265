"""A tiny chain for the long-run tests: its middle stage [GELU, Tanh] holds no parameter (that
rank has no optimizer but takes part in every collective), dropout after the third layer,
an eval split of 3 batches (6, 6 and 2 samples: fewer micro-batches than training's 16; None
past them), and variants: `wide` has
other shapes, `other` names its modules differently, $LONGRUN_SLOW_FROM makes later batches
slow, $LONGRUN_NAN_AT (batch numbers, comma-separated) makes those batches NaN."""

import os
import time

import torch
from torch import nn

SLOW_FROM = int(os.environ.get("LONGRUN_SLOW_FROM", "-1"))
NAN_AT = {int(x) for x in os.environ.get("LONGRUN_NAN_AT", "").split(",") if x}


def model(width=16):
    return nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Tanh(), nn.Linear(width, width),
                         nn.Dropout(0.1), nn.Linear(width, 4))


def wide():
    return model(32)


def other():
    return nn.Sequential(nn.Identity(), *model())


def batch(step, split="train"):
    if 0 <= SLOW_FROM <= step and split == "train":
        time.sleep(1.0)
    if split == "eval" and step >= 3:
        return None
    size = (6 if step < 2 else 2) if split == "eval" else 16
    x = torch.randn(size, 8) + (1.0 if split == "eval" else 0.0)
    if step in NAN_AT and split == "train":
        x = x * float("nan")
    return x, x[:, :4].sin()


def train_only(step):
    return batch(step)


def loss(out, y):
    return torch.nn.functional.mse_loss(out, y)
