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
import math
import os
import re
from pathlib import Path

from pyplan.errors import InfeasibleError, PlanError
from pyplan.lower.runnable import check_model
from pyplan.partition import Partition, UnitCost, candidates, plan_text, smallest_capacity
from pyplan.problem import Problem, build_problem, load_problem
from pyplan.resolved import ResolvedPlan, write_resolved
from pyplan.resolved import load_resolved as _load_resolved
from pyplan.solver import Solution as _Solved
from pyplan.solver import solve as _solve
from pyplan.solver.templates import Baseline, baselines
from pyplan.planfile import format_memory, load_yaml, parse_memory, spec_from_text
from pyplan.planfile.plan import MAX_DEVICES, MAX_MICRO_BATCHES
from pyplan.planfile.types import LAYER_RETURNS, LinkSpec
from pyplan.planfile.units import MAX_MEMORY

__all__ = ["Baseline", "PartitionPlan", "Plan", "ResolvedPlan", "Solution", "load_plan",
           "load_resolved", "partition_plans", "solve", "templates", "with_overrides"]

MAX_TIME_LIMIT = 1e6  # seconds: as milliseconds, within Z3's timeout (an unsigned int); the
# plan schema's search.time_limit has the same maximum
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
    return load_problem(_path(source, "load_plan takes a file name or YAML text"))


def _path(source, what: str) -> str | os.PathLike:
    """A file name as given, or PlanError (an integer would be taken for a file descriptor)."""
    if not isinstance(source, (str, os.PathLike)):
        raise PlanError(f"{what}, not {type(source).__name__}")
    return source


def _plan(plan: Plan | str | os.PathLike) -> Plan:
    return plan if isinstance(plan, Problem) else load_plan(plan)


def _number(value, what: str, low: float, high: float, *, integer: bool = False):
    """value if it is a finite number (an integer when asked) in low .. high, else PlanError."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or \
            not (math.isfinite(value) and low <= value <= high):
        kind = "an integer" if integer else "a finite number"
        raise PlanError(f"{what} must be {kind} in {_show(low)} .. {_show(high)}, got "
                        f"{value!r}")
    return value


def _show(x: float) -> str:
    return f"{x}" if isinstance(x, int) else f"{x:g}"


def with_overrides(plan: Plan, *, micro_batches: int | None = None,
                   memory: int | str | None = None, time_limit: float | None = None,
                   effort: float | None = None) -> Plan:
    """The plan with another number of micro-batches, memory capacity (in the plan's unit, or
    a size like "24GiB" for size plans; the same on every device), time limit or search effort
    (search.effort); PlanError for values that make no sense."""
    if not isinstance(plan, Problem):
        raise PlanError(f"with_overrides takes a plan (from load_plan), not "
                        f"{type(plan).__name__}")
    if micro_batches is not None:
        _number(micro_batches, "micro-batches", 1, MAX_MICRO_BATCHES, integer=True)
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
    if time_limit is not None and (isinstance(time_limit, bool) or
                                   not isinstance(time_limit, (int, float)) or
                                   not 0 < time_limit <= MAX_TIME_LIMIT):
        raise PlanError(f"the time limit must be positive and finite (seconds), at most "
                        f"{MAX_TIME_LIMIT:g}, got {time_limit!r}",
                        hint="a longer one would overflow Z3's timeout")
    if effort is not None and (isinstance(effort, bool) or
                               not isinstance(effort, (int, float)) or not 0 < effort <= 1000):
        raise PlanError(f"the effort must be a number in (0, 1000], got {effort!r}",
                        hint="1 is the default; 10 searches about ten times as long")
    changed = plan.with_overrides(micro_batches=micro_batches, memory=capacity,
                                  time_limit=time_limit, effort=effort)
    overflow = changed.too_large() or (changed.memory_overflow() or (0, None))[1]
    if overflow is not None:
        raise PlanError(overflow, hint="fewer micro-batches")
    return changed


def solve(plan: Plan | str | os.PathLike, *, micro_batches: int | None = None,
          memory: int | str | None = None, time_limit: float | None = None,
          effort: float | None = None, progress=None) -> Solution:
    """Search a schedule: never longer than a template that fits, `status == "optimal"` only
    when proven. Overrides as in `with_overrides`. Raises PlanError for bad input and
    InfeasibleError when nothing fits."""
    problem = with_overrides(_plan(plan), micro_batches=micro_batches, memory=memory,
                             time_limit=time_limit, effort=effort)
    check_model(problem)
    try:
        found = _solve(problem, progress=progress)
    except InfeasibleError as exc:
        if exc.file is None and memory is None:
            _at_memory(exc, problem)
        raise
    return Solution(**{f.name: getattr(found, f.name) for f in dataclasses.fields(found)})


def _at_memory(error: InfeasibleError, problem: Problem) -> None:
    """Point a plan's infeasibility at its memory: line (the capacity it does not fit), when
    the plan file is there as it was read."""
    path = problem.source_path
    try:
        source = load_yaml(path) if path and Path(path).is_file() else None
    except PlanError:
        return
    if source is not None and source.sha256 == problem.spec_sha256 and \
            isinstance(source.data, dict) and "memory" in source.data:
        error.file = path
        error.line, error.column = source.locate(("memory",))


def load_resolved(path: str | os.PathLike) -> ResolvedPlan:
    """Read a resolved plan; its schedule is re-evaluated in the core and checked against the
    recorded times (PlanError if the file was edited or does not run)."""
    return _load_resolved(_path(path, "load_resolved takes a file name"))


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
                    recompute: str = "never", weights: str | None = None,
                    link: LinkSpec | None = None,
                    optimizer: str | None = None,
                    mesh: str | None = None) -> list[PartitionPlan]:
    """Plans for the best `keep` partitions of measured units into devices x chunks stages
    (stage s on device s mod devices; chunks > 1: interleaved) and for the even splits, each
    solved, shortest makespan first (ties: least bottleneck). `memory` is bytes per device,
    or a list with each device's (mixed GPU types); `speeds` each device's speed relative to
    the one the units were measured on (a stage's time is divided by its device's). Both go
    into the plans (devices: [{memory, speed}, ...]). `recompute` goes to the plans'
    training.recompute and widens what fits (pyplan.partition.candidates); `weights` (a
    checkpoint folder, relative to the plan) to model.weights; `link` (between two devices)
    times the stages' outputs (topology.within_node; None: a GPU node's default); `mesh` is
    the plans' mesh mapping (`{tensor: 2, priced: 2}`, units priced per tensor rank).
    InfeasibleError when no partition fits the memory even one micro-batch at a time (its
    hint: the smallest memory that does) or solve finds none feasible."""
    _check_partition_arguments(units, devices=devices, name=name, factory=factory, data=data,
                               loss=loss, micro_batches=micro_batches, chunks=chunks,
                               memory=memory, path=path, keep=keep, time_limit=time_limit,
                               source=source, cut=cut, layer_returns=layer_returns,
                               everywhere=everywhere, recompute=recompute, speeds=speeds,
                               weights=weights)
    if link is not None and not isinstance(link, LinkSpec):
        raise PlanError(f"link must be a pyplan.planfile.LinkSpec or None, not "
                        f"{type(link).__name__}")
    stages = devices * chunks
    per_device = memory if isinstance(memory, list) else [memory] * devices
    # Interleaved: a device's memory is shared by its stages, a share each.
    share = [None if per_device[s % devices] is None else per_device[s % devices] // chunks
             for s in range(stages)]
    stage_speeds = None if speeds is None else [speeds[s % devices] for s in range(stages)]
    found = candidates(units, stages, micro_batches=micro_batches, capacity=share, keep=keep,
                       speeds=stage_speeds, recompute=recompute)
    if not found:
        shown = " ".join(format_memory(m, True) for m in per_device) \
            if isinstance(memory, list) else format_memory(memory, True)
        least = smallest_capacity(units, stages, recompute) * chunks
        shared = f" (its {chunks} stages sharing it evenly)" if chunks > 1 else ""
        raise InfeasibleError(f"no partition of {len(units)} units into {stages} stages fits "
                              f"{shown} per device, even one micro-batch at a time",
                              hint=f"the smallest memory per device that admits a partition "
                              f"is {least}B ({format_memory(least, True)}){shared}; give that "
                              "much, or more devices")
    unit_ms = max(c.bottleneck_ms for c in found) / UNITS_PER_STAGE
    shape = "vshape" if chunks == 1 else f"interleaved, {chunks} chunks"
    texts = [(p, plan_text(units, p, name=name, devices=devices, micro_batches=micro_batches,
                           capacity=memory, factory=factory, data=data, loss=loss, path=path,
                           time_unit_ms=unit_ms, shape=shape, cut=cut,
                           layer_returns=layer_returns, everywhere=everywhere,
                           recompute=recompute, speeds=speeds, weights=weights, link=link,
                           optimizer=optimizer, mesh=mesh))
             for p in found]
    return solved_plans(texts, source=source, time_limit=time_limit, unit_ms=unit_ms)


def solved_plans(texts: list[tuple[Partition, str]], *, source: str, time_limit: float,
                 unit_ms: float) -> list[PartitionPlan]:
    """Each candidate's plan solved, shortest makespan first (ties: least bottleneck). solve
    decides what fits: a candidate it finds infeasible is dropped; when every one is, its
    error stands."""
    out, refused = [], None
    for p, text in texts:
        try:
            solved = solve(build_problem(spec_from_text(text, source)), time_limit=time_limit)
        except InfeasibleError as exc:
            refused = exc
            continue
        out.append(PartitionPlan(p, text, solved, solved.schedule.makespan * unit_ms))
    if not out:
        raise refused
    return sorted(out, key=lambda c: (c.makespan_ms, c.partition.bottleneck_ms,
                                      c.partition.bounds))


_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_IMPORT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*")


def _check_partition_arguments(units, *, devices, name, factory, data, loss, micro_batches,
                               chunks, memory, path, keep, time_limit, source, cut,
                               layer_returns, everywhere, recompute, speeds=None,
                               weights=None) -> None:
    """partition_plans' arguments, each checked before anything is built (PlanError)."""
    if not isinstance(units, (list, tuple)) or not units or \
            not all(isinstance(u, UnitCost) for u in units):
        raise PlanError("units must be a non-empty list of pyplan.partition.UnitCost")
    for i, u in enumerate(units):
        if not isinstance(u.name, str) or not u.name:
            raise PlanError(f"units[{i}].name must be a submodule name, got {u.name!r}")
        for field in ("forward_ms", "backward_ms"):
            _number(getattr(u, field), f"units[{i}].{field}", 0, 1e9)
        for field in ("activation_bytes", "weight_bytes", "input_bytes", "output_bytes"):
            _number(getattr(u, field), f"units[{i}].{field}", 0, MAX_MEMORY, integer=True)
    names: dict[str, int] = {}
    for i, u in enumerate(units):
        if u.name in names or any(not part for part in u.name.split(".")):
            raise PlanError(f"units[{i}].name {u.name!r} " + (
                f"repeats units[{names[u.name]}]" if u.name in names else
                "is not a dotted submodule name"))
        names[u.name] = i
    for field in ("activation_bytes", "weight_bytes"):
        total = sum(getattr(u, field) for u in units)
        if total > MAX_MEMORY:
            raise PlanError(f"the units' {field} sum to {total:,}, more than the supported 2^60")
    if not any(u.forward_ms + u.backward_ms > 0 for u in units):
        raise PlanError("every unit takes no time: nothing to balance",
                        hint="give the units' measured times")
    _number(devices, "devices", 1, MAX_DEVICES, integer=True)
    _number(chunks, "chunks", 1, 64, integer=True)
    if len(units) < devices * chunks:
        raise PlanError(f"{len(units)} units cannot fill {devices * chunks} stages "
                        f"({devices} devices x {chunks} chunks)",
                        hint="use fewer devices or chunks, or a model of more units")
    _number(micro_batches, "micro_batches", 1, MAX_MICRO_BATCHES, integer=True)
    _number(keep, "keep", 1, 100, integer=True)
    _number(time_limit, "time_limit", 1e-3, MAX_TIME_LIMIT)
    if isinstance(memory, list):  # devices that differ: one capacity (or None) each
        if len(memory) != devices:
            raise PlanError(f"memory lists {len(memory)} capacities for {devices} devices")
        for i, amount in enumerate(memory):
            if amount is not None:
                _number(amount, f"memory[{i}] (bytes)", 1, MAX_MEMORY, integer=True)
    elif memory is not None:
        _number(memory, "memory (bytes per device)", 1, MAX_MEMORY, integer=True)
    if speeds is not None:
        if not isinstance(speeds, (list, tuple)) or len(speeds) != devices:
            raise PlanError(f"speeds must list one speed per device ({devices})")
        for i, speed in enumerate(speeds):
            _number(speed, f"speeds[{i}]", 1e-9, 1000)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PlanError(f"name must use letters, digits, '_', '-' and '.', got {name!r}")
    for what, text in (("factory", factory), ("data", data), ("loss", loss)):
        if not isinstance(text, str) or not _IMPORT.fullmatch(text):
            raise PlanError(f"{what} must be an import path module.path:function, got {text!r}")
    if path is not None and (not isinstance(path, str) or "\0" in path):
        raise PlanError(f"path must be a directory name, got {path!r}")
    if weights is not None and (not isinstance(weights, str) or not weights or "\0" in weights):
        raise PlanError(f"weights must name a checkpoint folder, got {weights!r}")
    if not isinstance(source, str):
        raise PlanError("source must be a string")
    if cut not in ("chain", "forward", "traced") or layer_returns not in LAYER_RETURNS:
        raise PlanError(f"cut must be chain, forward or traced and layer_returns one of "
                        f"{', '.join(LAYER_RETURNS)}, got {cut!r} and {layer_returns!r}")
    if not isinstance(everywhere, (list, tuple)) or \
            not all(isinstance(x, str) and x for x in everywhere):
        raise PlanError("everywhere must list parameter names")
    if recompute not in ("never", "always", "auto"):
        raise PlanError(f"recompute must be never, always or auto, got {recompute!r}")
