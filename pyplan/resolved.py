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
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pyplan import __version__, _core
from pyplan._derived import compare_with_plan
from pyplan._seal import check_seal, seal_lines
from pyplan.constraints import RuleSyntaxError
from pyplan.errors import PlanError
from pyplan.fileio import read_capped, write_atomic
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
_LATEST = 2**62  # no start lies beyond (the core's times stay far inside int64)
_BLOCK_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.[bw])?")
_KINDS = ("forward", "backward", "weight", "other")
# Fields of a block, the model and the mesh: (type, low or the allowed strings, high).
_BLOCK = {"name": (str, (), 0), "kind": (str, _KINDS, 0), "time": (int, 1, MAX_TIME),
          "memory": (int, -MAX_MEMORY, MAX_MEMORY), "weights": (int, 0, MAX_MEMORY),
          "recompute": (str, ("never", "always", "auto"), 0),
          "recompute_memory": (int, 0, MAX_MEMORY), "recomputed": (bool, 0, 0),
          "rematerialised": (int, 0, MAX_MEMORY), "devices": (list, 0, 0)}
_MODEL = {"blocks": (str, (), 0), "module": (str, (), 0), "stages": (dict, 0, 0),
          "traced": (bool, 0, 0), "cut": (str, ("chain", "forward", "traced"), 0),
          "layer_returns": (str, ("tensor", "tuple"), 0), "ties": (list, 0, 0),
          "data": (str, (), 0), "loss": (str, (), 0), "path": (str, (), 0),
          "vocab_parallel": (dict, 0, 0)}
_MESH = {"data": (int, 1, MAX_DEVICES), "shard": (bool, 0, 0), "sync": (int, 0, MAX_TIME)}


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
            # (a plan is at most MAX_FILE_BYTES: read no more)
            digest = hashlib.sha256(read_capped(plan, MAX_FILE_BYTES + 1)).hexdigest()
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


def _float(x: float) -> str:
    """A float as YAML reads it back: repr, with a decimal point before an exponent (YAML 1.1
    reads 1e-300 as a string)."""
    text = repr(float(x))
    return text.replace("e", ".0e", 1) if "e" in text and "." not in text else text


_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./@-]*")
_STR = "tag:yaml.org,2002:str"


def _scalar(text: str) -> str:
    """A string as YAML reads it back: plain when it reads as itself (not as a number, true,
    null or a date), double-quoted otherwise."""
    if _PLAIN.fullmatch(text) and \
            yaml.SafeLoader.resolve(yaml.SafeLoader, yaml.ScalarNode, text, (True, False)) == _STR:
        return text
    return _quoted(text)


def _quoted(text: str) -> str:
    """A double-quoted YAML string: JSON's escapes, and escapes for the characters YAML does
    not allow in a file or reads as line breaks (other controls, U+2028/9, surrogates of
    undecodable file names, the byte order mark, U+FFFE/F)."""
    out = []
    for ch in json.dumps(text, ensure_ascii=False):
        code = ord(ch)
        if 0x7F <= code <= 0x9F or 0xD800 <= code <= 0xDFFF or \
                code in (0x2028, 0x2029, 0xFEFF, 0xFFFE, 0xFFFF):
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


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
        f"plan: {_scalar(plan_rel)}" if plan_rel else "plan: null",
        f"spec_sha256: {problem.spec_sha256}",
        f"name: {_scalar(problem.name)}",
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
        lines.append(f"  - {{name: {_scalar(b.name)}, kind: {b.kind}, time: {b.time}, "
                     f"memory: {b.memory}{extra}, devices: {_flow(b.devices)}}}")
    lines.append("dependencies:" if problem.edges else "dependencies: []")
    for e in problem.edges:
        delay = problem.transfer.get(e)
        lines.append(f"  - [{_scalar(problem.blocks[e[0]].name)}, "
                     f"{_scalar(problem.blocks[e[1]].name)}"
                     + (f", {delay}]" if delay else "]"))
    if problem.rules:
        lines.append("order_rules:")
        for r in problem.rules:
            lines.append(f"  - {_quoted(r.text)}")
    if problem.model is not None:
        m = problem.model
        builder = (f"blocks: {_quoted(m.blocks)}" if m.blocks is not None else
                   f"module: {_quoted(m.module)}, stages: {{" +
                   ", ".join(f"{_scalar(name)}: [{', '.join(_quoted(u) for u in units)}]"
                             for name, units in m.stages) + "}"
                   + (f", cut: {m.cut}" if m.cut != "chain" else "")
                   + (f", layer_returns: {m.layer_returns}" if m.layer_returns != "tensor" else "")
                   + ("" if m.ties is None else ", ties: [" + ", ".join(
                       f"{{parameter: {_quoted(p)}, stages: [{', '.join(map(_scalar, st))}]}}"
                       for p, st in m.ties) + "]")
                   + ("" if m.vocab_parallel is None else
                      f", vocab_parallel: {{embedding: {_quoted(m.vocab_parallel[0])}, "
                      f"head: {_quoted(m.vocab_parallel[1])}}}"))
        lines.append(f"model: {{{builder}, data: {_quoted(m.data)}, loss: {_quoted(m.loss)}"
                     + (f", path: {_quoted(m.path)}" if m.path else "") + "}")
    if problem.time_unit_ms is not None:
        lines.append(f"time_unit_ms: {_float(problem.time_unit_ms)}")
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
    lines.append("baselines:" if solution.baselines else "baselines: {}")
    for name, base in solution.baselines.items():
        if not base.applicable:
            lines.append(f"  {name}: {_quoted(f'not applicable: {base.reason}')}")
            continue
        extra = "" if base.fits_memory else f", exceeds_memory: {max(base.peak_memory)}"
        lines.append(f"  {name}: {{makespan: {base.makespan}, bubble_rate: "
                     f"{_rate(base.bubble_rate)}{extra}}}")
    text = "\n".join(lines) + "\n"
    return text + "\n".join(seal_lines(text)) + "\n"


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
        try:
            plan_rel.encode("utf-8")
        except UnicodeEncodeError:  # bytes the file system could not decode
            raise PlanError(f"the path of the plan, {plan_rel!r}, is not UTF-8 text, so the "
                            "resolved plan cannot record it", hint="rename the plan file",
                            file=str(source)) from None
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
        if kind is float and (type(value) not in (int, float) or not math.isfinite(value)):
            raise self.fail(where + (key,), f"'{key}' must be a finite number")
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
        check_seal(self.source)  # (first: an edit is named for the field it changed)
        blocks, by_name = [], {}  # (indexed here for the dependencies; Problem keeps its own)
        num_devices = self.get("devices", int, low=1, high=MAX_DEVICES)
        for i, raw in enumerate(self.get("blocks", list)):
            self.typed(raw, ("blocks", i), _BLOCK, {"name", "kind", "time", "devices"})
            devices = tuple(raw["devices"])
            name, kind = raw["name"], raw["kind"]
            if not _BLOCK_NAME.fullmatch(name) or kind not in _KINDS or \
                    not all(type(d) is int for d in devices) or name in by_name:
                raise self.fail(("blocks", i), "malformed block",
                                "the file was edited; re-run pyplan solve")
            block = Block(i, name, kind, raw["time"], raw.get("memory", 0), devices,
                          layer_of(name, kind), raw.get("weights", 0),
                          recompute=raw.get("recompute", "never"),
                          recompute_memory=raw.get("recompute_memory", 0),
                          recomputed=raw.get("recomputed", False),
                          rematerialised=raw.get("rematerialised", 0))
            if not 1 <= block.time <= MAX_TIME or abs(block.memory) > MAX_MEMORY or \
                    not 0 <= block.weights <= MAX_MEMORY or \
                    block.recompute not in ("never", "always", "auto") or \
                    not 0 <= block.recompute_memory <= MAX_MEMORY or \
                    not 0 <= block.rematerialised <= MAX_MEMORY:
                raise self.fail(("blocks", i), f"block '{block.name}' has a time or memory "
                                "outside the supported ranges")
            if block.time <= 0 or not devices or len(set(devices)) != len(devices) or \
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
        texts = self.get("order_rules", list) if "order_rules" in self.doc else []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise self.fail(("order_rules", i), "an order rule must be a string")
            try:
                rules.append(resolve_rule(text, blocks, by_name, edges))
            except RuleSyntaxError as exc:
                raise self.fail(("order_rules", i), f"malformed order rule: {exc}") from None
        model = None
        if "model" in self.doc:
            raw = self.get("model", dict)
            self.typed(raw, ("model",), _MODEL, {"data", "loss"})
            stages = raw.get("stages", {})
            for name, units in stages.items():
                if not isinstance(units, list) or not units or \
                        not all(isinstance(x, str) and x for x in units):
                    raise self.fail(("model", "stages", name), "model stages must list "
                                    "submodule names")
            declared = [b.name for b in blocks if b.is_forward]
            if ("blocks" in raw) == ("module" in raw) or ("module" in raw) != bool(stages) or \
                    (("traced" in raw or "cut" in raw or "ties" in raw or
                      "vocab_parallel" in raw) and "blocks" in raw) or \
                    (stages and list(stages) != declared) or "\0" in raw.get("path", ""):
                raise self.fail(("model",), "the model must name blocks, or module and stages "
                                "of exactly the declared blocks",
                                "the file was edited; re-run pyplan solve")
            model = ModelSpec(blocks=raw.get("blocks"), module=raw.get("module"),
                              stages=tuple((k, tuple(v)) for k, v in stages.items()),
                              cut="traced" if raw.get("traced") else raw.get("cut", "chain"),
                              layer_returns=raw.get("layer_returns", "tensor"),
                              ties=_ties(raw.get("ties"), self),
                              vocab_parallel=_vocab(raw.get("vocab_parallel"), self),
                              data=raw["data"],
                              loss=raw["loss"], path=raw.get("path"))
        mesh = MeshSpec()
        if self.doc.get("mesh") is not None:
            self.typed(self.get("mesh", dict), ("mesh",), _MESH, set(_MESH))
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
        for key, values in (("task", ("training", "inference")),
                            ("memory_unit", ("bytes", "plan"))):
            if self.get(key, str) not in values:
                raise self.fail((key,), f"'{key}' must be one of {', '.join(values)}")
        device_memory, device_speed = self.devices(num_devices)
        problem = Problem(
            name=str(self.get("name", str)), description="", num_devices=num_devices,
            memory_capacity=memory,
            memory_is_size=self.doc["memory_unit"] == "bytes",
            num_micro_batches=self.get("micro_batches", int, low=1,
                                       high=MAX_MICRO_BATCHES),
            training=self.doc["task"] == "training", blocks=tuple(blocks),
            edges=tuple(edges), rules=tuple(rules),
            transfers=tuple(transfers), mesh=mesh, model=model,
            time_unit_ms=None if unit is None else float(unit),
            spec_sha256=str(self.get("spec_sha256", str)), source_path=self.path,
            device_memory=device_memory, device_speed=device_speed)
        overflow = problem.too_large() or (problem.memory_overflow() or (0, None))[1]
        if overflow is not None:
            raise self.fail(("blocks",), overflow)
        try:
            cycle = problem.graph.find_cycle()
        except (ValueError, IndexError) as exc:  # e.g. a block that depends on itself
            raise self.fail(("dependencies",), f"invalid dependencies: {exc}") from None
        if cycle:
            raise self.fail(("dependencies",), "the dependencies form a cycle")
        for d, net in enumerate(problem.graph.net_memory()):
            if net:
                raise self.fail(("blocks",), f"memory does not balance on device {d}: one "
                                f"micro-batch leaves {problem.show_memory(net)} allocated",
                                "the file was edited; re-run pyplan solve")
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

    def typed(self, raw, where: tuple, fields: dict, required: set) -> None:
        """raw is a mapping of the known fields, each of its type (and range), the required
        ones present."""
        if not isinstance(raw, dict):
            raise self.fail(where, f"{'.'.join(map(str, where))} must be a mapping")
        for key, value in raw.items():
            if key not in fields:
                raise self.fail(where + (key,), f"unknown field {key!r}",
                                "the file was edited; re-run pyplan solve")
            kind, low, high = fields[key]
            if type(value) is not kind or (kind is int and not low <= value <= high) or \
                    (kind is str and low and value not in low):
                shown = repr(value) if len(repr(value)) <= 40 else type(value).__name__
                raise self.fail(where + (key,), f"'{key}' cannot be {shown} here",
                                "the file was edited; re-run pyplan solve")
        for key in sorted(required - set(raw)):
            raise self.fail(where, f"missing '{key}'", "the file was edited; re-run pyplan solve")

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
                    entry = (problem.by_name[name], int(mb) + relative_to, int(start))
                except (ValueError, KeyError):
                    raise self.fail(where + (i,), f"malformed entry {text!r}",
                                    "entries read \"block@micro-batch start\"") from None
                if not 0 <= entry[1] < problem.num_micro_batches or not 0 <= entry[2] <= _LATEST:
                    raise self.fail(where + (i,), f"entry {text!r} names a micro-batch or a "
                                    "start outside the schedule",
                                    "the file was edited; re-run pyplan solve")
                order.append(entry)
            orders.append(order)
        for d in raw:
            if not (type(d) is int and 0 <= d < problem.num_devices):
                raise self.fail(("schedule", part, d), f"{part} lists device {d!r}, which the "
                                f"plan does not have", "the file was edited; re-run pyplan solve")
        return orders


def _vocab(raw, reader) -> tuple[str, str] | None:
    """model.vocab_parallel of a resolved plan: (embedding, head) or None."""
    if raw is None:
        return None
    if not (isinstance(raw, dict) and set(raw) == {"embedding", "head"} and
            all(isinstance(raw[k], str) and raw[k] for k in ("embedding", "head"))):
        raise reader.fail(("model", "vocab_parallel"),
                          "model.vocab_parallel must name an embedding and a head")
    return raw["embedding"], raw["head"]


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
        # (the marker is near the top; never read a whole file)
        return _RESOLVED.search(read_capped(path, 4096)) is not None
    except (OSError, ValueError):
        return False


def _check_recorded(reader: _Reader, schedule: Schedule) -> None:
    """What the file records about the schedule is what the schedule gives."""
    def same(where: tuple, recorded, computed) -> None:
        if recorded != computed:
            raise reader.fail(where, f"'{where[-1]}' does not match the schedule "
                              f"({computed})", "the file was edited; re-run pyplan solve")

    def rate(where: tuple, computed: float) -> None:
        value = reader.get(where[-1], float, where[:-1])
        same(where, _rate(value), _rate(computed))

    same(("peak_memory",), reader.get("peak_memory", list), list(schedule.peak_memory))
    rate(("bubble_rate",), schedule.bubble_rate)
    rep = schedule.repetend
    if rep is not None:
        start, end = schedule.repetend_window()
        for key, computed in (("micro_batches", rep.num_micro_batches),
                              ("count", schedule.repetend_count), ("start", start),
                              ("end", end)):
            same(("repetend", key), reader.get(key, int, ("repetend",)), computed)
        rate(("repetend", "bubble_rate"), rep.bubble_rate)
        if reader.get("period_status", str, ("repetend",)) not in \
                ("optimal", "feasible", "time_limit"):
            raise reader.fail(("repetend", "period_status"), "unknown period status")
    origin = reader.get("origin", str)
    if not re.fullmatch(r"[a-z0-9-]+", origin):
        raise reader.fail(("origin",), f"unknown origin {origin!r}")
    for name, base in reader.get("baselines", dict).items():
        if not (isinstance(base, str) or isinstance(base, dict) and all(
                type(v) in (int, float) for v in base.values())):
            raise reader.fail(("baselines", name), "malformed baseline",
                              "the file was edited; re-run pyplan solve")


def load_resolved(path: str | Path) -> ResolvedPlan:
    """Read a resolved plan, rebuild and re-verify its schedule in the core."""
    reader = _Reader(path)
    problem = reader.problem()
    n = problem.num_micro_batches
    doc = reader.doc
    plan = doc.get("plan")
    if plan is not None and (not isinstance(plan, str) or "\0" in plan or not plan):
        raise reader.fail(("plan",), "'plan' must be the plan file's path (or null)")
    if plan is not None:  # the plan file present and fresh: what it determines, compared
        fresh_plan = Path(str(path)).parent / plan
        try:
            fresh = hashlib.sha256(read_capped(fresh_plan, MAX_FILE_BYTES + 1)).hexdigest() \
                == problem.spec_sha256
        except (OSError, ValueError):
            fresh = False  # (check_fresh says so where it matters)
        if fresh:
            compare_with_plan(problem, fresh_plan, reader.source)
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
    syncs = reader.get("gradient_syncs", dict) if "gradient_syncs" in doc else {}
    recorded_syncs = []
    for d, texts in syncs.items():
        if not isinstance(texts if texts is not None else [], list):
            raise reader.fail(("gradient_syncs", d), "gradient synchronisations are a list")
        recorded_syncs += [(d, *str(text).partition(" ")[::2]) for text in texts or []]
    computed = [(x.device, problem.blocks[x.layer].name, str(x.start)) for x in schedule.syncs]
    if recorded_syncs != computed:
        raise reader.fail(("gradient_syncs",), "the gradient synchronisations do not match the "
                          "schedule", "the file was edited; re-run pyplan solve")
    if schedule.makespan != doc.get("makespan"):
        raise reader.fail(("makespan",), "makespan does not match the schedule",
                          "the file was edited; re-run pyplan solve")
    status = reader.get("status", str)
    if status not in ("optimal", "feasible", "time_limit"):
        raise reader.fail(("status",), f"unknown status {status!r}",
                          "the file was edited; re-run pyplan solve")
    lower_bound = reader.get("lower_bound", int, low=0, high=schedule.makespan)
    period_bound = 0 if rep_doc is None else \
        reader.get("period_lower_bound", int, ("repetend",), low=0, high=repetend.period)
    _check_recorded(reader, schedule)
    return ResolvedPlan(str(path), plan, problem.spec_sha256, problem, schedule, status,
                        lower_bound, period_bound, doc.get("baselines") or {})
