"""Resolved plans: the compact, canonical, diffable output of `pyplan solve`.

A resolved plan records the blocks of one micro-batch and their dependencies, then the schedule
as each device's order, in three parts: warmup, one repetition of the repetend (repeated
N - N_R + 1 times, micro-batches and times advancing each time) and cooldown, whose micro-batches
count from the end (@-1 is the last). Every entry reads "block@micro-batch start". Orders are
the schedule; reading a resolved plan re-evaluates them in the core and checks the recorded
times, so hand edits that break the schedule are caught.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pyplan import __version__, _core
from pyplan.constraints import RuleSyntaxError
from pyplan.errors import PlanError
from pyplan.fileio import write_atomic
from pyplan.problem import Block, Problem, layer_of, resolve_rule
from pyplan.schedule import Schedule, build_schedule, repetend_from_core
from pyplan.spec import MeshSpec, ModelSpec, load_yaml
from pyplan.spec.plan import MAX_DEVICES, MAX_MICRO_BATCHES, MAX_TIME
from pyplan.spec.source import MAX_FILE_BYTES
from pyplan.spec.units import MAX_MEMORY

if TYPE_CHECKING:
    from pyplan.solver import Solution

__all__ = ["FORMAT", "ResolvedPlan", "is_resolved", "load_resolved", "render_resolved",
           "resolved_path", "write_resolved"]

FORMAT = 1
_RESOLVED = re.compile(rb"^pyplan_resolved:", re.MULTILINE)


def resolved_path(plan_path: str | Path) -> Path:
    """plans/x.yaml -> plans/x.resolved.yaml"""
    path = Path(plan_path)
    stem = path.name[:-5] if path.name.endswith(".yaml") else path.name
    return path.with_name(f"{stem}.resolved.yaml")


@dataclass(frozen=True)
class ResolvedPlan:
    path: str
    plan: str | None
    """The plan file, relative to the resolved plan."""
    spec_sha256: str
    problem: Problem
    schedule: Schedule
    status: str
    lower_bound: int
    period_bound: int
    baselines: dict = field(default_factory=dict)

    @property
    def plan_path(self) -> Path | None:
        return None if self.plan is None else Path(self.path).parent / self.plan

    def check_fresh(self) -> None:
        """Raise PlanError when the plan changed (or vanished) since it was solved."""
        plan = self.plan_path
        if plan is None:
            return
        try:
            with open(plan, "rb") as handle:  # a plan is at most MAX_FILE_BYTES: read no more
                digest = hashlib.sha256(handle.read(MAX_FILE_BYTES + 1)).hexdigest()
        except (OSError, ValueError):
            raise PlanError(f"the plan it was solved from, {plan}, cannot be read",
                            hint="keep the plan beside its resolved plan", file=self.path) \
                from None
        if digest != self.spec_sha256:
            raise PlanError(f"stale: {plan} changed since this plan was resolved",
                            hint=f"re-run pyplan solve {plan}", file=self.path)

    def expand(self, num_micro_batches: int) -> Schedule:
        """The same warmup, repetend and cooldown for another number of micro-batches."""
        rep = self.schedule.repetend
        if rep is None or num_micro_batches < rep.num_micro_batches:
            need = rep.num_micro_batches if rep else self.problem.num_micro_batches
            raise PlanError(f"this schedule extends to {need} or more micro-batches only",
                            hint="re-run pyplan solve --micro-batches N", file=self.path)
        problem = self.problem.with_overrides(micro_batches=num_micro_batches)
        return build_schedule(problem, self.schedule.warmup, rep, self.schedule.cooldown)


# ---------------------------------------------------------------- writing

def _flow(items) -> str:
    return "[" + ", ".join(str(x) for x in items) + "]"


def _entry(problem: Problem, schedule: Schedule, block: int, mb: int, shown_mb: int) -> str:
    return f"{problem.blocks[block].name}@{shown_mb} {schedule.start_of(block, mb)}"


def _rate(x: float) -> str:
    return f"{x:.4f}"


def render_resolved(solution: Solution, plan_rel: str | None) -> str:
    """The resolved plan text for a Solution (deterministic: same solution, same bytes)."""
    schedule: Schedule = solution.schedule
    problem = schedule.problem
    n = problem.num_micro_batches
    rep = schedule.repetend
    lines = [
        f"# Resolved by pyplan {__version__} from {plan_rel or 'a plan'}; do not edit, re-run "
        "`pyplan solve`.",
        "# Entries are \"block@micro-batch start\": each device runs its entries in order, each",
        "# block as early as its inputs, devices and order allow.",
        f"pyplan_resolved: {FORMAT}",
        f"plan: {plan_rel}" if plan_rel else "plan: null",
        f"spec_sha256: {problem.spec_sha256}",
        f"name: {problem.name}",
        f"task: {'training' if problem.training else 'inference'}",
        f"devices: {problem.num_devices}",
        f"micro_batches: {n}",
        f"memory: {'null' if problem.memory_capacity is None else problem.memory_capacity}",
        f"memory_unit: {'bytes' if problem.memory_is_size else 'plan'}",
    ]
    if problem.device_memory:  # devices that differ (the block times include their speeds)
        lines.append("device_memory: [" + ", ".join("null" if c is None else str(c)
                                                    for c in problem.device_memory) + "]")
    if problem.device_speed:
        lines.append("device_speed: [" + ", ".join(repr(s) for s in problem.device_speed) + "]")
    lines += [
        "blocks:",
    ]
    for b in problem.blocks:
        extra = f", weights: {b.weights}" if b.weights else ""
        if b.recompute != "never":  # times and memory below already include the choice
            extra += (f", recompute: {b.recompute}, recompute_memory: {b.recompute_memory}, "
                      f"recomputed: {'true' if b.recomputed else 'false'}")
            extra += f", rematerialised: {b.rematerialised}" if b.recomputed else ""
        lines.append(f"  - {{name: {b.name}, kind: {b.kind}, time: {b.time}, "
                     f"memory: {b.memory}{extra}, devices: {_flow(b.devices)}}}")
    lines.append("dependencies:")
    for e in problem.edges:
        delay = problem.transfer.get(e)
        lines.append(f"  - [{problem.blocks[e[0]].name}, {problem.blocks[e[1]].name}"
                     + (f", {delay}]" if delay else "]"))
    if problem.rules:
        lines.append("order_rules:")
        for r in problem.rules:
            lines.append(f"  - \"{r.text}\"")
    if problem.model is not None:
        m = problem.model
        builder = (f"blocks: \"{m.blocks}\"" if m.blocks is not None else
                   f"module: \"{m.module}\", stages: {{" +
                   ", ".join(f"{name}: [{', '.join(json.dumps(u) for u in units)}]"
                             for name, units in m.stages) + "}"
                   + (f", cut: {m.cut}" if m.cut != "chain" else "")
                   + (f", layer_returns: {m.layer_returns}" if m.layer_returns != "tensor" else "")
                   + ("" if m.ties is None else ", ties: [" + ", ".join(
                       f"{{parameter: {json.dumps(p)}, stages: [{', '.join(s)}]}}"
                       for p, s in m.ties) + "]"))
        lines.append(f"model: {{{builder}, data: \"{m.data}\", loss: \"{m.loss}\""
                     + (f", path: \"{m.path}\"" if m.path else "") + "}")
    if problem.time_unit_ms is not None:
        lines.append(f"time_unit_ms: {problem.time_unit_ms!r}")
    if problem.mesh.data > 1:
        mesh = problem.mesh
        lines.append(f"mesh: {{data: {mesh.data}, shard: {'true' if mesh.shard else 'false'}, "
                     f"sync: {mesh.sync}}}")
    lines += [
        f"status: {solution.status}",
        f"origin: {solution.origin}",
        f"makespan: {schedule.makespan}",
        f"lower_bound: {solution.lower_bound}",
        f"bubble_rate: {_rate(schedule.bubble_rate)}",
        f"peak_memory: {_flow(schedule.peak_memory)}",
    ]
    if rep is None:
        lines.append("repetend: null")
    else:
        start, end = schedule.repetend_window()
        lines += [
            "repetend:",
            f"  micro_batches: {rep.num_micro_batches}",
            f"  period: {rep.period}",
            f"  period_lower_bound: {solution.period_bound}",
            f"  period_status: {solution.period_status}",
            f"  bubble_rate: {_rate(rep.bubble_rate)}",
            f"  indices: {_flow(rep.indices)}",
            f"  count: {schedule.repetend_count}",
            f"  start: {start}",
            f"  end: {end}",
        ]
    lines.append("schedule:")
    shift = n - (rep.num_micro_batches if rep else 0)
    parts = [("warmup", schedule.warmup, 0)]
    if rep is not None:
        parts.append(("repetend", tuple(tuple((b, rep.indices[b]) for b in order)
                                        for order in rep.orders), 0))
        parts.append(("cooldown", schedule.cooldown, shift))
    for title, orders, offset in parts:
        lines.append(f"  {title}:")
        for d, order in enumerate(orders):
            if not order:
                lines.append(f"    {d}: []")
                continue
            lines.append(f"    {d}:")
            for b, m in order:
                shown = m - n + offset if title == "cooldown" else m
                lines.append(f"      - {_entry(problem, schedule, b, m + offset, shown)}")
    if schedule.syncs:
        lines.append("gradient_syncs:  # \"stage start\" per device, in order")
        for d in range(problem.num_devices):
            lines.append(f"  {d}:")
            lines += [f"    - {problem.blocks[x.layer].name} {x.start}"
                      for x in schedule.syncs if x.device == d]
    lines.append("baselines:")
    for name, base in solution.baselines.items():
        if not base.applicable:
            lines.append(f"  {name}: \"not applicable: {base.reason}\"")
            continue
        extra = "" if base.fits_memory else f", exceeds_memory: {max(base.peak_memory)}"
        lines.append(f"  {name}: {{makespan: {base.makespan}, bubble_rate: "
                     f"{_rate(base.bubble_rate)}{extra}}}")
    return "\n".join(lines) + "\n"


def write_resolved(solution: Solution, out_path: str | Path) -> Path:
    """Write atomically; the plan path inside is relative to the output file."""
    out = Path(out_path)
    source = solution.schedule.problem.source_path
    plan_rel = None
    if source and Path(source).is_file():  # a plan given as text has no file to point at
        try:
            plan_rel = Path(os.path.relpath(Path(source).resolve(),
                                            out.resolve().parent)).as_posix()
        except ValueError:
            plan_rel = Path(source).resolve().as_posix()
    write_atomic(out, render_resolved(solution, plan_rel))
    return out


# ---------------------------------------------------------------- reading

class _Reader:
    def __init__(self, path: str | Path) -> None:
        self.source = load_yaml(path)
        self.path = str(path)
        self.doc = self.source.data

    def fail(self, where, message, hint=None) -> PlanError:
        return self.source.error(where, message, hint)

    def get(self, key, kind, where=(), low: int | None = None, high: int | None = None):
        """doc[where...][key], of the given type (and for integers within low .. high)."""
        node = self.doc
        for part in where:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or key not in node:
            raise self.fail(where, f"missing '{key}'",
                            "this does not look like a resolved plan; re-run pyplan solve")
        value = node[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.fail(where + (key,), f"'{key}' must be an integer")
        if kind is int and not (low if low is not None else value) <= value <= \
                (high if high is not None else value):
            raise self.fail(where + (key,), f"'{key}' must lie in {low} .. {high}",
                            "the file was edited; re-run pyplan solve")
        if kind is str and not isinstance(value, str):
            raise self.fail(where + (key,), f"'{key}' must be a string")
        if kind is list and not isinstance(value, list):
            raise self.fail(where + (key,), f"'{key}' must be a list")
        if kind is bool and not isinstance(value, bool):
            raise self.fail(where + (key,), f"'{key}' must be true or false")
        if kind is dict and not isinstance(value, dict):
            raise self.fail(where + (key,), f"'{key}' must be a mapping")
        return value

    def problem(self) -> Problem:
        if not isinstance(self.doc, dict) or self.doc.get("pyplan_resolved") != FORMAT:
            raise self.fail((), "not a resolved plan (pyplan_resolved: 1 missing)",
                            "pass the .resolved.yaml written by pyplan solve")
        blocks, by_name = [], {}  # (indexed here for the dependencies; Problem keeps its own)
        num_devices = self.get("devices", int, low=1, high=MAX_DEVICES)
        for i, raw in enumerate(self.get("blocks", list)):
            try:
                devices = tuple(int(d) for d in raw["devices"])
                name, kind = str(raw["name"]), str(raw["kind"])
                block = Block(i, name, kind, int(raw["time"]), int(raw["memory"]), devices,
                              layer_of(name, kind), int(raw.get("weights", 0)),
                              recompute=str(raw.get("recompute", "never")),
                              recompute_memory=int(raw.get("recompute_memory", 0)),
                              recomputed=raw.get("recomputed") is True,
                              rematerialised=int(raw.get("rematerialised", 0)))
            except (KeyError, TypeError, ValueError, OverflowError):
                raise self.fail(("blocks", i), "malformed block") from None
            if not 1 <= block.time <= MAX_TIME or abs(block.memory) > MAX_MEMORY or \
                    not 0 <= block.weights <= MAX_MEMORY or \
                    block.recompute not in ("never", "always", "auto") or \
                    not 0 <= block.recompute_memory <= MAX_MEMORY or \
                    not 0 <= block.rematerialised <= MAX_MEMORY:
                raise self.fail(("blocks", i), f"block '{block.name}' has a time or memory "
                                "outside the supported ranges")
            if block.time <= 0 or not devices or \
                    any(not 0 <= d < num_devices for d in devices):
                raise self.fail(("blocks", i), f"block '{block.name}' is invalid")
            by_name[block.name] = i
            blocks.append(block)
        edges, transfers = [], []
        for i, pair in enumerate(self.get("dependencies", list)):
            if not (isinstance(pair, list) and len(pair) in (2, 3) and
                    all(p in by_name for p in pair[:2]) and
                    (len(pair) == 2 or type(pair[2]) is int and 0 < pair[2] <= MAX_TIME)):
                raise self.fail(("dependencies", i), "malformed dependency",
                                "dependencies read [from, to] or [from, to, transfer time]")
            edges.append((by_name[pair[0]], by_name[pair[1]]))
            transfers.append(pair[2] if len(pair) == 3 else 0)
        rules = []
        for i, text in enumerate(self.doc.get("order_rules") or []):
            try:
                rules.append(resolve_rule(str(text), blocks, by_name, edges))
            except RuleSyntaxError as exc:
                raise self.fail(("order_rules", i), f"malformed order rule: {exc}") from None
        model = None
        if isinstance(self.doc.get("model"), dict):
            raw = self.doc["model"]
            path = raw.get("path")
            stages = raw.get("stages") if isinstance(raw.get("stages"), dict) else {}
            if any(not isinstance(u, list) or not all(isinstance(x, str) for x in u)
                   for u in stages.values()):
                raise self.fail(("model", "stages"), "model stages must list submodule names")
            model = ModelSpec(blocks=None if raw.get("blocks") is None else str(raw["blocks"]),
                              module=None if raw.get("module") is None else str(raw["module"]),
                              stages=tuple((str(k), tuple(v)) for k, v in stages.items()),
                              cut="traced" if raw.get("traced") is True else
                              str(raw.get("cut", "chain")),
                              layer_returns=str(raw.get("layer_returns", "tensor")),
                              ties=_ties(raw.get("ties"), self),
                              data=str(raw.get("data")), loss=str(raw.get("loss")),
                              path=path if isinstance(path, str) and "\0" not in path else None)
            if model.builder is None:
                raise self.fail(("model",), "the model names neither blocks nor module")
        mesh = MeshSpec()
        if self.doc.get("mesh") is not None:
            mesh = MeshSpec(data=self.get("data", int, ("mesh",), low=1,
                                          high=MAX_DEVICES // num_devices),
                            shard=self.get("shard", bool, ("mesh",)),
                            sync=self.get("sync", int, ("mesh",), low=0, high=MAX_TIME))
        unit = self.doc.get("time_unit_ms")
        if unit is not None and (type(unit) not in (int, float) or not 0 < unit <= 1e6):
            raise self.fail(("time_unit_ms",), "'time_unit_ms' must be a positive number",
                            "the file was edited; re-run pyplan solve")
        memory = None
        if self.doc.get("memory") is not None:
            memory = self.get("memory", int, low=1, high=MAX_MEMORY)
        device_memory, device_speed = self.devices(num_devices)
        problem = Problem(
            name=str(self.get("name", str)), description="", num_devices=num_devices,
            memory_capacity=memory,
            memory_is_size=self.doc.get("memory_unit") == "bytes",
            num_micro_batches=self.get("micro_batches", int, low=1,
                                       high=MAX_MICRO_BATCHES),
            training=self.doc.get("task") != "inference", blocks=tuple(blocks),
            edges=tuple(edges), rules=tuple(rules),
            transfers=tuple(transfers), mesh=mesh, model=model,
            time_unit_ms=None if unit is None else float(unit),
            spec_sha256=str(self.get("spec_sha256", str)), source_path=self.path,
            device_memory=device_memory, device_speed=device_speed)
        try:
            cycle = problem.graph.find_cycle()
        except (ValueError, IndexError) as exc:  # e.g. a block that depends on itself
            raise self.fail(("dependencies",), f"invalid dependencies: {exc}") from None
        if cycle:
            raise self.fail(("dependencies",), "the dependencies form a cycle")
        return problem

    def devices(self, num_devices: int) -> tuple[tuple, tuple]:
        """device_memory and device_speed, when the devices differ: one capacity (or null)
        and one positive speed per device."""
        memory, speed = self.doc.get("device_memory"), self.doc.get("device_speed")
        if memory is not None and not (
                isinstance(memory, list) and len(memory) == num_devices and
                all(c is None or type(c) is int and 1 <= c <= MAX_MEMORY for c in memory)):
            raise self.fail(("device_memory",), "'device_memory' needs one capacity (or null) "
                            "per device", "the file was edited; re-run pyplan solve")
        if speed is not None and not (
                isinstance(speed, list) and len(speed) == num_devices and
                all(type(s) in (int, float) and 0 < s <= 1000 for s in speed)):
            raise self.fail(("device_speed",), "'device_speed' needs one speed in (0, 1000] "
                            "per device", "the file was edited; re-run pyplan solve")
        return tuple(memory or ()), tuple(float(s) for s in speed or ())

    def entries(self, problem: Problem, part: str, relative_to: int):
        """Per-device [(block, mb, start)] of a schedule part; cooldown mbs count from the end."""
        raw = self.get(part, dict, ("schedule",))
        orders = []
        for d in range(problem.num_devices):
            items = raw.get(d, [])
            where = ("schedule", part, d)
            if not isinstance(items, list):
                raise self.fail(where, f"device {d} of {part} must be a list")
            order = []
            for i, text in enumerate(items):
                try:
                    head, start = str(text).split(" ")
                    name, mb = head.rsplit("@", 1)
                    order.append((problem.by_name[name], int(mb) + relative_to, int(start)))
                except (ValueError, KeyError):
                    raise self.fail(where + (i,), f"malformed entry {text!r}",
                                    "entries read \"block@micro-batch start\"") from None
            orders.append(order)
        return orders


def _ties(raw, reader: _Reader):
    """model.ties of a resolved plan: [{parameter, stages}] as render_resolved writes it."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(
            isinstance(t, dict) and isinstance(t.get("parameter"), str) and
            isinstance(t.get("stages"), list) and all(isinstance(x, str) for x in t["stages"])
            for t in raw):
        raise reader.fail(("model", "ties"), "model ties must list {parameter, stages}")
    return tuple((t["parameter"], tuple(t["stages"])) for t in raw)


def is_resolved(path: str | Path) -> bool:
    """Whether the file is a resolved plan (unreadable files are left to the plan loader)."""
    try:
        with open(path, "rb") as handle:  # the marker is near the top; never read a whole file
            return _RESOLVED.search(handle.read(4096)) is not None
    except (OSError, ValueError):
        return False


def load_resolved(path: str | Path) -> ResolvedPlan:
    """Read a resolved plan, rebuild and re-verify its schedule in the core."""
    reader = _Reader(path)
    problem = reader.problem()
    n = problem.num_micro_batches
    doc = reader.doc
    rep_doc = doc.get("repetend")
    warmup = reader.entries(problem, "warmup", 0)
    repetend, cooldown = None, [[] for _ in range(problem.num_devices)]
    recorded = {(b, m): s for order in warmup for b, m, s in order}
    if rep_doc is not None:
        rep_orders = reader.entries(problem, "repetend", 0)
        indices = reader.get("indices", list, ("repetend",))
        if len(indices) != len(problem.blocks) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n
                for i in indices):
            raise reader.fail(("repetend", "indices"), "needs one index per block, each a "
                              f"micro-batch in 0 .. {n - 1}",
                              "the file was edited; re-run pyplan solve")
        nr = max(indices) + 1
        cooldown_abs = reader.entries(problem, "cooldown", n)
        cooldown = [[(b, m - (n - nr)) for b, m, _ in order] for order in cooldown_abs]
        recorded.update({(b, m): s for order in rep_orders for b, m, s in order})
        recorded.update({(b, m): s for order in cooldown_abs for b, m, s in order})
        try:
            core_rep = _core.evaluate_repetend(problem.graph, [int(i) for i in indices],
                                               [[b for b, _, _ in o] for o in rep_orders])
        except (ValueError, TypeError) as exc:
            raise reader.fail(("schedule", "repetend"), f"invalid repetend: {exc}") from None
        if not core_rep.feasible or core_rep.period != reader.get("period", int, ("repetend",)):
            raise reader.fail(("repetend", "period"), "the repetend does not run with this "
                              "period", "the file was edited; re-run pyplan solve")
        repetend = repetend_from_core(problem, core_rep)
    try:
        schedule = build_schedule(problem, [[(b, m) for b, m, _ in o] for o in warmup],
                                  repetend, cooldown)
    except (RuntimeError, ValueError, IndexError) as exc:
        raise reader.fail(("schedule",), f"the schedule does not run: {exc}",
                          "re-run pyplan solve") from None
    for (b, m), s in recorded.items():
        if schedule.start_of(b, m) != s:
            raise reader.fail(("schedule",), f"recorded start {s} of "
                              f"{problem.blocks[b].name}@{m} does not match its order "
                              f"({schedule.start_of(b, m)})",
                              "the file was edited; re-run pyplan solve")
    syncs = doc.get("gradient_syncs") or {}
    recorded_syncs = []
    for d in range(problem.num_devices) if isinstance(syncs, dict) else ():
        for text in syncs.get(d) or []:
            name, _, start = str(text).partition(" ")
            recorded_syncs.append((d, name, start))
    computed = [(x.device, problem.blocks[x.layer].name, str(x.start)) for x in schedule.syncs]
    if recorded_syncs != computed:
        raise reader.fail(("gradient_syncs",), "the gradient synchronisations do not match the "
                          "schedule", "the file was edited; re-run pyplan solve")
    if schedule.makespan != doc.get("makespan"):
        raise reader.fail(("makespan",), "makespan does not match the schedule",
                          "the file was edited; re-run pyplan solve")
    plan = doc.get("plan")
    if plan is not None and (not isinstance(plan, str) or "\0" in plan or not plan):
        raise reader.fail(("plan",), "'plan' must be the plan file's path (or null)")
    status = reader.get("status", str)
    if status not in ("optimal", "feasible", "time_limit"):
        raise reader.fail(("status",), f"unknown status {status!r}",
                          "the file was edited; re-run pyplan solve")
    lower_bound = reader.get("lower_bound", int, low=0, high=schedule.makespan)
    period_bound = 0 if rep_doc is None else \
        reader.get("period_lower_bound", int, ("repetend",), low=0, high=repetend.period)
    return ResolvedPlan(str(path), plan, problem.spec_sha256, problem, schedule, status,
                        lower_bound, period_bound, doc.get("baselines") or {})
