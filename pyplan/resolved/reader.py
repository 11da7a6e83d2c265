"""Reading a resolved plan back: its seal checked first, then every field typed and bounded,
the problem rebuilt and checked (cycles, memory balance, sizes), the schedule's entries parsed
and what the file records about the schedule compared with what the schedule gives.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from pyplan.resolved.writer import FORMAT, format_rate
from pyplan.resolved.seal import check_seal
from pyplan.problem.constraints import RuleSyntaxError
from pyplan.errors import PlanError
from pyplan.problem.ir import Block, Problem, layer_of, resolve_rule
from pyplan.problem.schedule import Schedule
from pyplan.planfile import MeshSpec, ModelSpec, load_yaml
from pyplan.planfile.plan import MAX_DEVICES, MAX_MICRO_BATCHES, MAX_TIME, MAX_WORLD
from pyplan.planfile.types import LAYER_RETURNS
from pyplan.planfile.units import MAX_MEMORY

__all__ = ["Reader", "check_recorded"]

_LATEST = 2**62  # no start lies beyond (the core's times stay far inside int64)
_BLOCK_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.[bw])?")
_KINDS = ("forward", "backward", "weight", "other")
# Fields of a block, the model and the mesh: (type, low or the allowed strings, high).
_BLOCK = {"name": (str, (), 0), "kind": (str, _KINDS, 0), "time": (int, 1, MAX_TIME),
          "memory": (int, -MAX_MEMORY, MAX_MEMORY), "weights": (int, 0, MAX_MEMORY),
          "workspace": (int, 0, MAX_MEMORY), "update": (int, 0, MAX_TIME),
          "recompute": (str, ("never", "always", "auto"), 0),
          "recompute_memory": (int, 0, MAX_MEMORY), "recomputed": (bool, 0, 0),
          "rematerialised": (int, 0, MAX_MEMORY), "devices": (list, 0, 0)}
_MODEL = {"blocks": (str, (), 0), "module": (str, (), 0), "stages": (dict, 0, 0),
          "traced": (bool, 0, 0), "cut": (str, ("chain", "forward", "traced"), 0),
          "layer_returns": (str, LAYER_RETURNS, 0), "ties": (list, 0, 0),
          "data": (str, (), 0), "loss": (str, (), 0), "path": (str, (), 0),
          "vocab_parallel": (dict, 0, 0), "weights": (str, (), 0),
          "optimizer": (str, ("sgd", "adamw"), 0)}
_MESH = {"data": (int, 1, MAX_WORLD), "sync": (int, 0, MAX_TIME),
         "tensor": (int, 1, MAX_DEVICES), "sequence": (bool, 0, 1),
         "priced": (int, 1, MAX_DEVICES)}


class Reader:
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
                          workspace=raw.get("workspace", 0), update=raw.get("update", 0),
                          recompute=raw.get("recompute", "never"),
                          recompute_memory=raw.get("recompute_memory", 0),
                          recomputed=raw.get("recomputed", False),
                          rematerialised=raw.get("rematerialised", 0))
            if not 1 <= block.time <= MAX_TIME or abs(block.memory) > MAX_MEMORY or \
                    not 0 <= block.weights <= MAX_MEMORY or \
                    not 0 <= block.workspace <= MAX_MEMORY or \
                    not 0 <= block.update <= MAX_TIME or \
                    block.recompute not in ("never", "always", "auto") or \
                    not 0 <= block.recompute_memory <= MAX_MEMORY or \
                    not 0 <= block.rematerialised <= MAX_MEMORY:
                raise self.fail(("blocks", i), f"block '{block.name}' has a time or memory "
                                "outside the supported ranges")
            if block.time <= 0 or not devices or len(set(devices)) != len(devices) or \
                    any(not 0 <= d < num_devices for d in devices):
                raise self.fail(("blocks", i), f"block '{block.name}' is invalid")
            # A recomputed block keeps its recompute_memory and its backward re-materialises
            # the rest (Problem.with_recompute): the fields must say one story.
            if (block.recomputed and (block.memory != block.recompute_memory or
                                      block.recompute == "never" or not block.is_forward)) or \
                    (not block.recomputed and (block.rematerialised or
                                               block.recompute == "always" or
                                               block.recompute_memory > max(block.memory, 0))):
                raise self.fail(("blocks", i), f"block '{block.name}': its recompute fields "
                                "(recompute, recompute_memory, recomputed, rematerialised, "
                                "memory) do not agree", "the file was edited; re-run pyplan solve")
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
                      "vocab_parallel" in raw or "weights" in raw) and "blocks" in raw) or \
                    (stages and list(stages) != declared) or "\0" in raw.get("path", "") or \
                    "\0" in raw.get("weights", ""):
                raise self.fail(("model",), "the model must name blocks, or module and stages "
                                "of exactly the declared blocks",
                                "the file was edited; re-run pyplan solve")
            model = ModelSpec(blocks=raw.get("blocks"), module=raw.get("module"),
                              stages=tuple((k, tuple(v)) for k, v in stages.items()),
                              cut="traced" if raw.get("traced") else raw.get("cut", "chain"),
                              layer_returns=raw.get("layer_returns", "tensor"),
                              ties=_ties(raw.get("ties"), self),
                              vocab_parallel=_vocab(raw.get("vocab_parallel"), self),
                              weights=raw.get("weights"), optimizer=raw.get("optimizer"),
                              data=raw["data"],
                              loss=raw["loss"], path=raw.get("path"))
        mesh = MeshSpec()
        if self.doc.get("mesh") is not None:
            raw_mesh = dict(self.get("mesh", dict))
            shard = raw_mesh.pop("shard", None)
            tensor_plan = raw_mesh.pop("tensor_plan", {})
            if not isinstance(tensor_plan, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in tensor_plan.items()):
                raise self.fail(("mesh", "tensor_plan"), "'tensor_plan' must map module paths "
                                "to styles", "the file was edited; re-run pyplan solve")
            if not (type(shard) is bool or (type(shard) is int and 1 <= shard <= MAX_WORLD)):
                raise self.fail(("mesh", "shard"), f"'shard' cannot be {shard!r} here",
                                "the file was edited; re-run pyplan solve")
            self.typed(raw_mesh, ("mesh",), _MESH, set(_MESH) - {"tensor", "sequence",
                                                                  "priced"})
            mesh = MeshSpec(data=self.get("data", int, ("mesh",), low=1,
                                          high=MAX_WORLD // num_devices),
                            shard=shard,
                            sync=self.get("sync", int, ("mesh",), low=0, high=MAX_TIME),
                            tensor=self.doc["mesh"].get("tensor", 1),
                            tensor_plan=tuple(sorted(tensor_plan.items())),
                            sequence=self.doc["mesh"].get("sequence", True),
                            priced=self.doc["mesh"].get("priced", 1))
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


def _ties(raw, reader: Reader):
    """model.ties of a resolved plan: [{parameter, stages}] as render_resolved writes it."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(
            isinstance(t, dict) and isinstance(t.get("parameter"), str) and
            isinstance(t.get("stages"), list) and all(isinstance(x, str) for x in t["stages"])
            for t in raw):
        raise reader.fail(("model", "ties"), "model ties must list {parameter, stages}")
    return tuple((t["parameter"], tuple(t["stages"])) for t in raw)


def check_recorded(reader: Reader, schedule: Schedule) -> None:
    """What the file records about the schedule is what the schedule gives."""
    def same(where: tuple, recorded, computed) -> None:
        if recorded != computed:
            raise reader.fail(where, f"'{where[-1]}' does not match the schedule "
                              f"({computed})", "the file was edited; re-run pyplan solve")

    def rate(where: tuple, computed: float) -> None:
        value = reader.get(where[-1], float, where[:-1])
        same(where, format_rate(value), format_rate(computed))

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
        # A baseline that exceeds the capacity peaks above some device's: an edited (raised)
        # memory shows here even where the schedule still fits it.
        peak = base.get("exceeds_memory") if isinstance(base, dict) else None
        limits = [c for c in schedule.problem.capacities if c is not None]
        if peak is not None and (not limits or peak <= min(limits)):
            raise reader.fail(("memory",), f"'memory' does not match baseline {name}, which "
                              f"exceeds it with a peak of {peak}",
                              "the file was edited; re-run pyplan solve")
