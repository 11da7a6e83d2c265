"""The training loop over pyplan.run's Pipeline: training (optimizers, learning-rate schedules),
checkpoint (step folders, atomic saves, `save`/`load`), logs, faults (the watchdog), check
(--check's single-process reference) -> report (the run's options and report) -> session (the
`pyplan run` trainer).

Imports pyplan.run and what is below it (not pyplan.measure, which it does not need); never
pyplan.runtime or pyplan.cli (tests/test_layers.py).
"""

from __future__ import annotations

import pyplan.comm  # noqa: F401 - torch, without its warning about a missing numpy

__all__: list[str] = []
