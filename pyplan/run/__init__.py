"""The engine that runs one rank's program, over pyplan.comm (values between ranks, devices,
transfers) and pyplan.mesh (parallelism inside a stage): data (batches), user_calls (the user's
function running now) -> binding (the plan's model: section, a rank's blocks, seeds) -> backward
(whole, or split into B and W) -> gradients (sums over a block's ranks, ties and replicas;
sharded data parallelism), steps (a program compiled into steps over slots), arguments (the
API's argument checks) -> executor (one rank's iteration) -> pipeline (`Pipeline`, the engine).

Nothing here imports pyplan.measure, pyplan.train or pyplan.runtime (tests/test_layers.py).
Importing this package imports torch, without the warning torch gives at import when numpy is
absent (pyplan.comm holds that import).
"""

from __future__ import annotations

import pyplan.comm  # noqa: F401 - torch, without its warning about a missing numpy

__all__: list[str] = []
