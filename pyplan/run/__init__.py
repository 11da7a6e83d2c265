"""The engine that runs one rank's program (the lowest layer of what needs torch): values and
data between blocks -> census (live tensor bytes) -> binding (the plan's model: section, a
rank's blocks, seeds) -> backward (whole, or split into B and W) -> devices (the device and
backends) -> comm (communicators, buffer lifetimes) -> gradients (sums over a block's ranks,
ties and replicas; sharded data parallelism), steps (a program compiled into steps over slots) -> executor (one rank's
iteration) -> state (the name-keyed state dicts) -> pipeline (`Pipeline`, the engine).

Nothing here imports pyplan.measure, pyplan.train or pyplan.runtime (tests/test_layers.py).
Importing this package imports torch, without the warning torch gives at import when numpy is
absent (pyplan.measure, pyplan.train and pyplan.runtime import torch through here).
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    # torch warns at import when numpy is absent; nothing here needs numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

__all__: list[str] = []
