"""Running resolved plans on real torch.distributed process groups: `Pipeline` is the engine
(a user's training loop drives it; `pyplan run` is a small trainer over it).

`save(DIR, pipe, optimizer, step=...)` and `load(DIR, pipe, optimizer)` write and read
checkpoints in step folders (pyplan.train.checkpoint), every rank calling them.

This package is the public façade: the code lives in pyplan.run (the engine), pyplan.measure
(profiling) and pyplan.train (the training loop); docs/architecture.md draws the layers and
docs/changelog.md lists where each former pyplan.runtime module went.

Everything under pyplan.runtime needs torch; the CLI imports it only when `pyplan run` runs, so
validate/solve/show/export work without torch. Model code marks sharded parameters of
multi-device blocks with `shard` (see the `model:` contract in schemas/plan.schema.json).
"""

from __future__ import annotations

from pyplan.comm import torch  # noqa: F401 - torch, without its warning about a missing numpy
from pyplan.models.chunks import shard
from pyplan.run.pipeline import Pipeline
from pyplan.train.checkpoint import CheckpointError, load, save

__all__ = ["CheckpointError", "Pipeline", "load", "save", "shard"]
