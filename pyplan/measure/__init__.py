"""Profiling and measuring, above pyplan.run: limits (a measurement's CPU-time limit) -> measure
(a unit's times and memory) -> links (point-to-point and all-reduce times between processes) ->
sharded (the vocabulary-sharded units' costs) -> profile (a plan's blocks, a model's units) ->
partitioner (`pyplan.partition_model`: profile, cut, solve, write).

Imports pyplan.run and what is below it; never pyplan.train, pyplan.runtime or pyplan.cli
(tests/test_layers.py).
"""

from __future__ import annotations

import pyplan.comm  # noqa: F401 - torch, without its warning about a missing numpy

__all__: list[str] = []
