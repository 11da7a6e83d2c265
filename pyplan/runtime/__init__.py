"""Running resolved plans on real torch.distributed process groups: `Pipeline` is the engine
(a user's training loop drives it; `pyplan run` is a small trainer over it).

`save(DIR, pipe, optimizer, step=...)` and `load(DIR, pipe, optimizer)` write and read
checkpoints in step folders (pyplan.runtime.checkpoint), every rank calling them.

Everything under pyplan.runtime needs torch; the CLI imports it only when `pyplan run` runs, so
validate/solve/show/export work without torch. Model code marks sharded parameters of
multi-device blocks with `shard` (see the `model:` contract in schemas/plan.schema.json).
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    # torch warns at import when numpy is absent; nothing here needs numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from pyplan.models.chunks import shard  # noqa: E402
from pyplan.runtime.checkpoint import CheckpointError, load, save  # noqa: E402
from pyplan.runtime.pipeline import Pipeline  # noqa: E402

__all__ = ["CheckpointError", "Pipeline", "load", "save", "shard"]
