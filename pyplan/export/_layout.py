"""What the pictures share: time step, chunks per device, repetitions and memory curves."""

from __future__ import annotations

from functools import reduce
from math import gcd

from pyplan.problem import FORWARD, Problem
from pyplan.problem.schedule import Schedule

__all__ = ["device_chunks", "memory_steps", "repetitions", "time_step"]


def time_step(problem: Problem) -> int:
    """The gcd of the block times (and of the synchronisation time): every start and end is a
    multiple of it."""
    return reduce(gcd, [b.time for b in problem.blocks] + [problem.sync_time])


def device_chunks(problem: Problem) -> dict[tuple[int, int], int]:
    """(device, block) -> the rank of the block's layer among the single-device forward layers
    on that device: 0 everywhere except where a device holds several stages (interleaved)."""
    chunk = {}
    for d in range(problem.num_devices):
        layers = [b.name for b in problem.blocks if b.kind == FORWARD and b.devices == (d,)]
        for b in problem.blocks:
            if d in b.devices:
                chunk[(d, b.index)] = layers.index(b.layer) if b.layer in layers else 0
    return chunk


def repetitions(schedule: Schedule) -> list[tuple[int, int]]:
    """(start, end) of every repetition of the repetend, in order; [] without a repetend."""
    rep = schedule.repetend
    if rep is None:
        return []
    spans = []
    for j in range(schedule.repetend_count):
        instances = [(b, rep.indices[b] + j) for b in range(len(rep.indices))]
        spans.append((min(schedule.start_of(b, m) for b, m in instances),
                      max(schedule.end_of(b, m) for b, m in instances)))
    return spans


def memory_steps(schedule: Schedule, device: int) -> list[tuple[int, int]]:
    """(time, memory from then on) for a device, starting at its weights (static memory) at 0.
    Memory changes only when a block starts: the running sum of block memory in the device's
    order."""
    blocks = schedule.problem.blocks
    level = schedule.problem.static_memory[device]
    steps = [(0, level)]
    for b, _, start, _ in schedule.entries(device):
        if blocks[b].memory:
            level += blocks[b].memory
            if steps[-1][0] == start:
                steps[-1] = (start, level)
            else:
                steps.append((start, level))
    return steps
