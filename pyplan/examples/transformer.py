"""An 8-layer transformer language model for plans/transformer-vshape.yaml (the classic
V-shape, 1F1B): `build` splits it into 4 stages of 2 layers, `build_interleaved` into 8 stages
of 1 layer (two per device, for interleaved schedules), `build_two` into 2 stages of 4 layers
(a pipeline replicated for data parallelism). The first stage embeds, the last one
normalises and predicts the next token. `model` is the whole model as one chain of units, for
`pyplan partition`:

    pyplan partition pyplan.examples.transformer:model --data pyplan.examples.transformer:batch \
        --loss pyplan.examples.transformer:loss --devices 4 --micro-batches 8 -o mine.yaml

cuts it into the stages of plans/transformer-vshape.yaml (two layers each), with this machine's
costs.

model: {blocks: "pyplan.examples.transformer:build",
        data: "pyplan.examples.transformer:batch", loss: "pyplan.examples.transformer:loss"}
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from pyplan.examples._layers import Embed, Head, Layer

__all__ = ["BATCH", "LAYERS", "batch", "build", "build_interleaved", "build_two", "loss",
           "model", "stage"]

VOCAB, DIM, HEADS, SEQUENCE, BATCH, LAYERS = 64, 32, 2, 8, 16, 8


def stage(index: int, count: int) -> nn.Sequential:
    """Stage `index` of `count`: its layers, after the embedding on the first stage and before
    the head on the last, as a chain of units."""
    parts: OrderedDict[str, nn.Module] = OrderedDict()
    if index == 0:
        parts["embed"] = Embed(VOCAB, DIM, SEQUENCE)
    parts["layers"] = nn.Sequential(*(Layer(DIM, HEADS) for _ in range(LAYERS // count)))
    if index == count - 1:
        parts["head"] = Head(DIM, VOCAB)
    return nn.Sequential(parts)


def model() -> nn.Module:
    """The whole model for `pyplan partition`: embed, layers.0 .. layers.7, head."""
    return stage(0, 1)


def _stage(block: str, count: int) -> nn.Module:
    index = int(block[len("stage"):]) if block.startswith("stage") and \
        block[len("stage"):].isdigit() else -1
    if not 0 <= index < count:
        raise ValueError(f"the transformer example split into {count} stages has no block "
                         f"{block!r}")
    return stage(index, count)


def build(block: str, group) -> nn.Module:
    """Four stages of two layers: stage0..stage3."""
    return _stage(block, 4)


def build_two(block: str, group) -> nn.Module:
    """Two stages of four layers: stage0, stage1 (plans/transformer-vshape-dp2.yaml)."""
    return _stage(block, 2)


def build_interleaved(block: str, group) -> nn.Module:
    """Eight stages of one layer: stage0..stage7."""
    return _stage(block, 8)


def batch(step: int):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
