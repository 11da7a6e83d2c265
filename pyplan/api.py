"""pyplan's Python API: load a plan, solve it, read resolved plans, compare templates.

    import pyplan
    plan = pyplan.load_plan("plans/gpt-mshape.yaml")          # or YAML text
    solution = pyplan.solve(plan, micro_batches=32, memory=6)
    print(solution.makespan, solution.status, solution.lower_bound)
    solution.write("gpt-mshape.resolved.yaml")

Errors are the CLI's: `pyplan.PlanError` (bad input, with file:line:col) and
`pyplan.InfeasibleError` (no schedule fits); both print as one line.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from pyplan.errors import InfeasibleError, PlanError
from pyplan.partition import (Partition, UnitCost, best_partitions, even_partitions,
                              plan_text)
from pyplan.problem import Problem, build_problem, load_problem
from pyplan.resolved import ResolvedPlan, write_resolved
from pyplan.resolved import load_resolved as _load_resolved
from pyplan.solver import Solution as _Solved
from pyplan.solver import solve as _solve
from pyplan.solver.templates import Baseline, baselines
from pyplan.spec import format_memory, parse_memory, spec_from_text
from pyplan.spec.plan import MAX_MICRO_BATCHES

__all__ = ["Baseline", "PartitionPlan", "Plan", "ResolvedPlan", "Solution", "load_plan",
           "load_resolved", "partition_plans", "solve", "templates", "with_overrides"]

UNITS_PER_STAGE = 100  # a partition plan's time unit: its slowest stage spans about this many

Plan = Problem
"""A validated plan: blocks of one micro-batch with shapes expanded and backward blocks
derived, their dependencies, devices, memory capacity, micro-batches and order rules."""


@dataclasses.dataclass(frozen=True)
class Solution(_Solved):
    """A solved plan: the schedule and what is proven about it."""

    @property
    def makespan(self) -> int:
        return self.schedule.makespan

    @property
    def peak_memory(self) -> tuple[int, ...]:
        """Per device, in the plan's memory unit (bytes for size plans)."""
        return self.schedule.peak_memory

    @property
    def recomputed(self) -> tuple[str, ...]:
        """The forward blocks whose activations are recomputed (`always`, and the `auto`
        blocks the solver chose)."""
        return self.schedule.problem.recomputed

    def write(self, path: str | os.PathLike) -> Path:
        """Write the resolved plan atomically (its `plan:` points at the plan file, relative to
        `path`, or is null for a plan given as text)."""
        return write_resolved(self, path)

    def to_json(self, output: str | None = None) -> dict:
        """The summary `pyplan solve --json` prints, as a dict."""
        schedule = self.schedule
        problem = schedule.problem
        rep = schedule.repetend
        repetend = None
        if rep is not None:
            start, end = schedule.repetend_window()
            repetend = {"micro_batches": rep.num_micro_batches, "period": rep.period,
                        "period_lower_bound": self.period_bound,
                        "bubble_rate": rep.bubble_rate, "count": schedule.repetend_count,
                        "start": start, "end": end}
        return {
            "plan": problem.source_path,
            "output": output,
            "status": self.status,
            "period_status": self.period_status,
            "origin": self.origin,
            "makespan": schedule.makespan,
            "gap": self.gap,
            "lower_bound": self.lower_bound,
            "bubble_rate": schedule.bubble_rate,
            "repetend": repetend,
            "peak_memory": list(schedule.peak_memory),
            "recomputed": list(problem.recomputed),
            "memory_capacity": problem.memory_capacity,
            "device_memory": list(problem.capacities) if problem.device_memory else None,
            "device_speed": list(problem.device_speed) or None,
            "devices": problem.num_devices,
            "micro_batches": problem.num_micro_batches,
            "search_seconds": self.search_seconds,
            "baselines": {name: ({"makespan": b.makespan, "bubble_rate": b.bubble_rate,
                                  "fits_memory": b.fits_memory} if b.applicable
                                 else "not applicable")
                          for name, b in self.baselines.items()},
            "notes": list(self.stats.notes),
        }


def load_plan(source: str | os.PathLike) -> Plan:
    """A plan from a file, or from YAML text (a string with a newline in it)."""
    if isinstance(source, str) and "\n" in source:
        return build_problem(spec_from_text(source))
    return load_problem(source)


def _plan(plan: Plan | str | os.PathLike) -> Plan:
    return plan if isinstance(plan, Problem) else load_plan(plan)


def with_overrides(plan: Plan, *, micro_batches: int | None = None,
                   memory: int | str | None = None, time_limit: float | None = None,
                   effort: float | None = None) -> Plan:
    """The plan with another number of micro-batches, memory capacity (in the plan's unit, or
    a size like "24GiB" for size plans; the same on every device), time limit or search effort
    (search.effort); PlanError for values that make no sense."""
    if micro_batches is not None and (isinstance(micro_batches, bool) or
                                      not isinstance(micro_batches, int) or
                                      not 1 <= micro_batches <= MAX_MICRO_BATCHES):
        raise PlanError(f"micro-batches must be an integer in 1 .. {MAX_MICRO_BATCHES}, got "
                        f"{micro_batches!r}")
    capacity = None
    if memory is not None:
        try:
            capacity, is_size = parse_memory(memory)
        except (TypeError, ValueError, OverflowError):
            raise PlanError(f"memory {memory!r} is not an amount",
                            hint="write an integer or a size like 32GiB") from None
        if capacity <= 0:
            raise PlanError("memory must be positive")
        if plan.memory_is_size != is_size and any(b.memory for b in plan.blocks):
            unit = "sizes like 32GiB" if plan.memory_is_size else "plain integers"
            raise PlanError(f"memory must use the plan's unit: {unit}")
    if time_limit is not None and not time_limit > 0:
        raise PlanError("the time limit must be positive (seconds)")
    if effort is not None and (isinstance(effort, bool) or
                               not isinstance(effort, (int, float)) or not 0 < effort <= 1000):
        raise PlanError(f"the effort must be a number in (0, 1000], got {effort!r}",
                        hint="1 is the default; 10 searches about ten times as long")
    return plan.with_overrides(micro_batches=micro_batches, memory=capacity,
                               time_limit=time_limit, effort=effort)


def solve(plan: Plan | str | os.PathLike, *, micro_batches: int | None = None,
          memory: int | str | None = None, time_limit: float | None = None,
          effort: float | None = None, progress=None) -> Solution:
    """Search a schedule: never longer than a template that fits, `status == "optimal"` only
    when proven. Overrides as in `with_overrides`. Raises PlanError for bad input and
    InfeasibleError when nothing fits."""
    problem = with_overrides(_plan(plan), micro_batches=micro_batches, memory=memory,
                             time_limit=time_limit, effort=effort)
    found = _solve(problem, progress=progress)
    return Solution(**{f.name: getattr(found, f.name) for f in dataclasses.fields(found)})


def load_resolved(path: str | os.PathLike) -> ResolvedPlan:
    """Read a resolved plan; its schedule is re-evaluated in the core and checked against the
    recorded times (PlanError if the file was edited or does not run)."""
    return _load_resolved(path)


def templates(plan: Plan | str | os.PathLike) -> dict[str, Baseline]:
    """Every hand-written schedule on the plan's placement, evaluated: makespan, bubble rate,
    peak memory and whether it fits, or why it does not apply."""
    return baselines(_plan(plan))


@dataclasses.dataclass(frozen=True)
class PartitionPlan:
    """A candidate partition, its plan text and its solved schedule."""

    partition: Partition
    text: str
    solution: Solution
    makespan_ms: float


def partition_plans(units: list[UnitCost], *, devices: int, name: str, factory: str,
                    data: str, loss: str, micro_batches: int, chunks: int = 1,
                    memory: int | list[int | None] | None = None,
                    speeds: list[float] | None = None, path: str | None = None,
                    keep: int = 3, time_limit: float = 10.0, source: str = "<partition>",
                    cut: str = "chain", layer_returns: str = "tensor",
                    everywhere: tuple[str, ...] = (),
                    recompute: str = "never") -> list[PartitionPlan]:
    """Plans for the best `keep` partitions of measured units into devices x chunks stages
    (stage s on device s mod devices; chunks > 1: interleaved) and for the even splits, each
    solved, shortest makespan first (ties: least bottleneck). `memory` is bytes per device,
    or a list with each device's (mixed GPU types); `speeds` each device's speed relative to
    the one the units were measured on (a stage's time is divided by its device's). Both go
    into the plans (devices: [{memory, speed}, ...]). InfeasibleError when no partition fits
    the memory (without recomputation). `recompute` goes to the plans' training.recompute."""
    stages = devices * chunks
    per_device = memory if isinstance(memory, list) else [memory] * devices
    if len(per_device) != devices or (speeds is not None and len(speeds) != devices):
        raise PlanError(f"memory and speeds need one value per device ({devices})")
    if speeds is not None and not all(isinstance(s, (int, float)) and 0 < s <= 1000
                                      for s in speeds):
        raise PlanError("device speeds must be numbers in (0, 1000]")
    # Interleaved: a device's memory is shared by its stages, a share each.
    share = [None if per_device[s % devices] is None else per_device[s % devices] // chunks
             for s in range(stages)]
    stage_speeds = None if speeds is None else [speeds[s % devices] for s in range(stages)]
    candidates = best_partitions(units, stages, micro_batches=micro_batches, capacity=share,
                                 keep=keep, speeds=stage_speeds)
    # The hand-written even splits are incumbents: the result is never longer than they are.
    candidates += [p for p in even_partitions(units, stages, micro_batches=micro_batches,
                                              capacity=share, speeds=stage_speeds)
                   if p.bounds not in {c.bounds for c in candidates}]
    if not candidates:
        shown = " ".join(format_memory(m, True) for m in per_device) \
            if isinstance(memory, list) else format_memory(memory, True)
        raise InfeasibleError(f"no partition of {len(units)} units into {stages} stages fits "
                              f"{shown} per device",
                              hint="give more memory or devices, or fewer micro-batches")
    unit_ms = max(c.bottleneck_ms for c in candidates) / UNITS_PER_STAGE
    shape = "vshape" if chunks == 1 else f"interleaved, {chunks} chunks"
    out = []
    for p in candidates:
        text = plan_text(units, p, name=name, devices=devices, micro_batches=micro_batches,
                         capacity=memory, factory=factory, data=data, loss=loss, path=path,
                         time_unit_ms=unit_ms, shape=shape, cut=cut,
                         layer_returns=layer_returns, everywhere=everywhere,
                         recompute=recompute, speeds=speeds)
        solved = solve(build_problem(spec_from_text(text, source)), time_limit=time_limit)
        out.append(PartitionPlan(p, text, solved, solved.schedule.makespan * unit_ms))
    return sorted(out, key=lambda c: (c.makespan_ms, c.partition.bottleneck_ms,
                                      c.partition.bounds))
