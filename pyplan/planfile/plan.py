"""Reading a plan document into the typed spec (pyplan.planfile.types, whose names are
importable from here too): format version, key and number checks, JSON Schema, then the typed
view.

Only checks that need nothing but the document itself live here (version, one memory unit,
blocks xor shape, training options only for training plans); checks that need the expanded
blocks (names, dependencies, devices, cycles, memory) belong to pyplan.problem.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from pyplan.errors import PlanError
from pyplan.planfile.schema import check_schema
from pyplan.planfile.source import Source, load_yaml, parse_yaml
from pyplan.planfile.types import (FORMAT_VERSION, BackwardOverride, BackwardSpec, BlockSpec,
                                   CostSpec, LinkSpec, MeshSpec, ModelSpec, OrderSpec, PlanSpec,
                                   SearchSpec, ShapeSpec, TopologySpec)
from pyplan.planfile.units import parse_memory

__all__ = ["check_document", "load_spec", "parse_spec", "spec_from_text"]


# Amounts a block holds (never frees): each is at least 0, used by the plan or not.
_HELD = {"weights": "weights are the static memory a block holds for the whole run",
         "workspace": "workspace is what a block needs while it runs, beyond what it holds",
         "recompute_memory": "recompute_memory is what a recomputed block keeps (its input)"}


class _Memory:
    """Parses every memory amount of a plan and enforces one unit per plan."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.first: tuple[tuple, bool] | None = None

    def __call__(self, value: Any, path: tuple) -> int:
        try:
            amount, is_size = parse_memory(value)
        except ValueError as exc:  # the schema admits the form; the amount is too large
            raise self.source.error(path, str(exc), "sizes go up to 2^60 bytes") from None
        key = next((k for k in reversed(path) if isinstance(k, str)), "")
        if amount < 0 and key in _HELD:
            raise self.source.error(path, f"{key} must not be negative, got {value}",
                                    _HELD[key])
        if amount != 0:
            if self.first is None:
                self.first = (path, is_size)
            elif self.first[1] != is_size:
                line, _ = self.source.locate(self.first[0])
                unit = "a size" if is_size else "a plain integer"
                raise self.source.error(
                    path, f"memory is {unit} here but not on line {line}",
                    "use one unit per plan: all sizes like \"2GiB\" or all integers")
        return amount

    @property
    def is_size(self) -> bool:
        return bool(self.first and self.first[1])


def _override(raw: Any, memory: _Memory, path: tuple) -> BackwardOverride:
    if raw is None:
        return BackwardOverride()
    if raw is False:
        return BackwardOverride(enabled=False)
    return BackwardOverride(
        time=raw.get("time"),
        memory=memory(raw["memory"], path + ("memory",)) if "memory" in raw else None,
        weight_time=raw.get("weight_time"),
        weight_memory=(memory(raw["weight_memory"], path + ("weight_memory",))
                       if "weight_memory" in raw else None))


def _check_units(source: Source, stages: dict) -> None:
    """Each submodule runs in one block, once: a unit named twice, or a unit and one of its
    own submodules (layers and layers.0), would run twice."""
    where: dict[str, tuple] = {}  # unit -> where it is first listed
    for name, units in stages.items():
        for i, unit in enumerate(units):
            path = ("model", "stages", name, i)
            if any(not part for part in unit.split(".")):
                raise source.error(path, f"'{unit}' is not a submodule name",
                                   "names are dotted paths as in named_modules(), e.g. "
                                   "layers.0")
            if unit in where:
                raise _overlap(source, stages, where[unit], path, "is listed again")
            where[unit] = path
    for unit, path in where.items():
        parts = unit.split(".")
        for k in range(1, len(parts)):
            parent = ".".join(parts[:k])
            if parent in where:
                first, second = sorted((where[parent], path), key=source.locate)
                raise _overlap(source, stages, first, second, "overlaps '{}' (one holds "
                               "the other)")


def _overlap(source: Source, stages: dict, first: tuple, second: tuple,
             what: str) -> PlanError:
    unit, other = stages[second[2]][second[3]], stages[first[2]][first[3]]
    return source.error(second, f"submodule '{unit}' {what.format(other)}: it is on line "
                        f"{source.locate(first)[0]} (block '{first[2]}')",
                        "list each submodule once, in one block")


def _transfer_or_output(source: Source, raw: dict, path: tuple) -> None:
    """A block's transfer is a time or its output a size the topology times, not both."""
    if "transfer" in raw and "output" in raw:
        raise source.error(path + ("output",), "a block gives its transfer time or its output "
                           "size, not both", "remove output: or transfer:", key=True)


def _cost(raw: dict | None, memory: _Memory, size, path: tuple) -> CostSpec:
    raw = raw or {}
    _transfer_or_output(memory.source, raw, path)

    def amounts(key: str) -> int | tuple[int, ...]:
        value = raw.get(key, 0)
        if isinstance(value, list):
            return tuple(memory(v, path + (key, i)) for i, v in enumerate(value))
        return memory(value, path + (key,))

    time = raw.get("time", 1)
    transfer = raw.get("transfer")
    output = raw.get("output")
    return CostSpec(time=tuple(time) if isinstance(time, list) else time,
                    memory=amounts("memory"), weights=amounts("weights"),
                    transfer=tuple(transfer) if isinstance(transfer, list) else transfer,
                    output=None if output is None else
                    tuple(size(v, path + ("output", i)) for i, v in enumerate(output))
                    if isinstance(output, list) else size(output, path + ("output",)),
                    recompute=raw.get("recompute"),
                    recompute_memory=amounts("recompute_memory"),
                    backward=_override(raw.get("backward"), memory, path + ("backward",)),
                    path=path)


# Limits the schema states too (schemas/plan.schema.json); resolved plans and the API use these.
MAX_DEVICES = 4096
MAX_WORLD = 1_048_576  # GPUs of a mesh: the pipeline's devices x data x tensor (Llama 3: 16,384)
MAX_MICRO_BATCHES = 100_000
MAX_TIME = 1_000_000
MAX_SHIFT = 1_000_000  # order rule shifts, conditions and loop values
MAX_RULES = 100_000  # order rules a plan may expand to (templated rules included)
MAX_INSTANCES = 1_000_000  # blocks x micro-batches: block instances a schedule times (about
# 300-600 bytes each while solving: 1 GiB)


_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _loop_values(source: Source, raw: Any, path: tuple) -> tuple[int, ...]:
    if isinstance(raw, list):
        values = tuple(raw)
    else:
        lo, hi = (int(x) for x in raw.split(".."))
        if hi < lo:
            raise source.error(path, f"empty range {raw!r}", "write low..high with low <= high")
        if hi - lo >= MAX_RULES:
            raise source.error(path, f"the range {raw!r} has more than {MAX_RULES:,} values",
                               "a loop gives one rule per value")
        values = tuple(range(lo, hi + 1))
    if any(abs(v) > MAX_SHIFT for v in values):
        raise source.error(path, f"loop values must lie within -{MAX_SHIFT} .. {MAX_SHIFT}")
    return values


def _size(source: Source):
    """Parses sizes that are not memory (outputs, bandwidths): bytes, whatever the plan's unit."""
    def parse(value: Any, path: tuple) -> int:
        try:
            return parse_memory(value)[0]
        except ValueError as exc:
            raise source.error(path, str(exc), "sizes go up to 2^60 bytes") from None
    return parse


def _topology(source: Source, raw: dict | None, size) -> TopologySpec:
    if raw is None:
        return TopologySpec()
    default = TopologySpec()
    links = {}
    for key in ("within_node", "across_nodes"):
        given, base = raw.get(key, {}), getattr(default, key)
        bandwidth = size(given["bandwidth"], ("topology", key, "bandwidth")) \
            if "bandwidth" in given else base.bandwidth
        if bandwidth <= 0:
            raise source.error(("topology", key, "bandwidth"), "bandwidth must be positive")
        links[key] = LinkSpec(bandwidth=bandwidth,
                              latency_ms=float(given.get("latency_ms", base.latency_ms)))
    return TopologySpec(devices_per_node=raw.get("devices_per_node"),
                        time_unit_ms=float(raw["time_unit_ms"]) if "time_unit_ms" in raw
                        else None,
                        **links)


def _devices(source: Source, doc: dict, memory: _Memory):
    """devices: and memory: as (capacity, number of devices, per-device capacities, speeds).
    Per-device values come from a devices: list ({memory, speed} each; a missing memory is
    memory:'s) or a memory: list; where every device has the same capacity or speed they
    collapse to the plain form, so equal devices written either way are the same plan."""
    raw = doc["devices"]
    entries = raw if isinstance(raw, list) else None
    num_devices = len(entries) if entries is not None else raw
    capacity, capacities = None, None
    given = doc.get("memory")
    if isinstance(given, list):
        if len(given) != num_devices:
            raise source.error(("memory",), f"memory lists {len(given)} capacities for "
                               f"{num_devices} devices", "give one capacity per device")
        if entries is not None and any("memory" in e for e in entries):
            first = next(i for i, e in enumerate(entries) if "memory" in e)
            raise source.error(("devices", first, "memory"), "memory is given both here and "
                               "as a memory: list", "give each device's memory in one place")
        capacities = [memory(v, ("memory", i)) for i, v in enumerate(given)]
        where = [("memory", i) for i in range(num_devices)]
    else:
        if given is not None:
            capacity = memory(given, ("memory",))
        capacities = [capacity] * num_devices
        where = [("memory",)] * num_devices
        for i, entry in enumerate(entries or []):
            if "memory" in entry:
                capacities[i] = memory(entry["memory"], ("devices", i, "memory"))
                where[i] = ("devices", i, "memory")
    for amount, path in zip(capacities, where):
        if amount is not None and amount <= 0:
            raise source.error(path, f"memory capacity must be positive, got {amount}",
                               "omit memory: for unlimited memory")
    speeds = [float(e.get("speed", 1.0)) for e in entries or []]
    for i, speed in enumerate(speeds):
        if not math.isfinite(speed):
            raise source.error(("devices", i, "speed"), f"speed must be a finite number, got "
                               f"{speed}", "1 is the device block times were measured on")
    if len(set(capacities)) == 1:
        capacity, capacities = capacities[0], []
    return (capacity, num_devices, tuple(capacities),
            tuple(speeds) if any(s != 1.0 for s in speeds) else ())


def _build(source: Source) -> PlanSpec:
    doc = source.data
    memory = _Memory(source)
    size = _size(source)
    task = doc.get("task", "training")
    if "blocks" in doc and "shape" in doc:
        raise source.error(("shape",), "a plan has either blocks or a shape, not both",
                           "remove shape: to list blocks by hand", key=True)
    if "blocks" not in doc and "shape" not in doc:
        raise source.error((), "the plan has neither blocks nor a shape",
                           "add blocks: (one micro-batch) or shape: {kind: vshape}")
    if task == "inference" and "training" in doc:
        raise source.error(("training",), "an inference plan has no training options",
                           "remove training: or set task: training", key=True)
    backward = None
    if "training" in doc and "backward" in doc["training"]:
        raw = doc["training"]["backward"]
        backward = BackwardSpec(time_ratio=float(raw.get("time_ratio", 2.0)),
                                weight_time_ratio=raw.get("weight_time_ratio"),
                                weight_memory_ratio=float(raw.get("weight_memory_ratio", 0.0)))
        if backward.weight_time_ratio is None and "weight_memory_ratio" in raw:
            raise source.error(("training", "backward", "weight_memory_ratio"),
                               "weight_memory_ratio needs a split backward",
                               "set weight_time_ratio too", key=True)
    capacity, num_devices, device_memory, device_speed = _devices(source, doc, memory)
    blocks = []
    for i, raw in enumerate(doc.get("blocks", [])):
        path = ("blocks", i)
        _transfer_or_output(source, raw, path)
        devices = raw["devices"]
        blocks.append(BlockSpec(
            name=raw["name"], kind=raw.get("kind", "forward"), time=raw["time"],
            memory=memory(raw.get("memory", 0), path + ("memory",)),
            weights=memory(raw.get("weights", 0), path + ("weights",)),
            workspace=memory(raw.get("workspace", 0), path + ("workspace",)),
            update=raw.get("update", 0),
            transfer=raw.get("transfer"),
            output=size(raw["output"], path + ("output",)) if "output" in raw else None,
            recompute=raw.get("recompute"),
            recompute_memory=memory(raw.get("recompute_memory", 0), path + ("recompute_memory",)),
            devices=None if devices == "all" else tuple(
                [devices] if isinstance(devices, int) else devices),
            after=tuple(raw["after"]) if "after" in raw else None,
            backward=_override(raw.get("backward"), memory, path + ("backward",)),
            path=path))
    shape = None
    if "shape" in doc:
        raw = doc["shape"]
        shape = ShapeSpec(kind=raw["kind"], stages=raw.get("stages"), chunks=raw.get("chunks"),
                          stage=_cost(raw.get("stage"), memory, size, ("shape", "stage")),
                          shared=_cost(raw.get("shared"), memory, size, ("shape", "shared")))
    order = []
    rules = 0
    for i, raw in enumerate(doc.get("constraints", {}).get("order", [])):
        path = ("constraints", "order", i)
        if isinstance(raw, str):
            order.append(OrderSpec(text=raw, path=path, text_path=path))
            rules += 1
        else:
            for name in raw["for"]:
                if not _VARIABLE.fullmatch(name) or name in ("D", "N", "m"):
                    raise source.error(path + ("for", name), f"'{name}' cannot be a loop "
                                       "variable", "name it like s or stage_1 (D, N and m are "
                                       "taken)", key=True)
            loop = {name: _loop_values(source, values, path + ("for", name))
                    for name, values in raw["for"].items()}
            rules += math.prod(len(values) for values in loop.values())
            if rules > MAX_RULES:
                raise source.error(path + ("for",), f"the order rules expand to more than "
                                   f"{MAX_RULES:,} rules", "loop over fewer values")
            order.append(OrderSpec(text=raw["rule"], loop=loop, path=path,
                                   text_path=path + ("rule",)))
    search_raw = doc.get("search", {})
    search = SearchSpec(max_repetend_micro_batches=search_raw.get("max_repetend_micro_batches"),
                        time_limit=search_raw.get("time_limit"),
                        exact=search_raw.get("exact", True),
                        effort=float(search_raw.get("effort", 1.0)))
    mesh_raw = doc.get("mesh", {})
    mesh = MeshSpec(data=mesh_raw.get("data", 1), shard=mesh_raw.get("shard", False),
                    sync=mesh_raw.get("sync", 0), tensor=mesh_raw.get("tensor", 1),
                    tensor_plan=tuple(sorted((mesh_raw.get("tensor_plan") or {}).items())),
                    sequence=mesh_raw.get("sequence", True), priced=mesh_raw.get("priced", 1))
    _check_priced(source, mesh)
    if mesh.world(num_devices) > MAX_WORLD:
        raise source.error(("mesh",), f"the mesh's {mesh.world(num_devices)} GPUs ({num_devices} "
                           f"devices x {mesh.data_parallel} data-parallel x {mesh.tensor} "
                           f"tensor) exceed {MAX_WORLD:,}", "use fewer replicas")
    model = None
    if "model" in doc:
        raw = doc["model"]
        for key in ("traced", "cut", "layer_returns", "ties", "vocab_parallel", "weights"):
            if key in raw and "blocks" in raw:
                raise source.error(("model", key), f"{key} applies to a model given as module "
                                   f"and stages, not to blocks", f"remove {key}:", key=True)
        _check_units(source, raw.get("stages") or {})
        for key in ("path", "weights"):
            if "\0" in raw.get(key, ""):
                raise source.error(("model", key), f"model.{key} contains a NUL character, "
                                   "which no file name can hold")
        model = ModelSpec(blocks=raw.get("blocks"), module=raw.get("module"),
                          stages=tuple((name, tuple(units))
                                       for name, units in (raw.get("stages") or {}).items()),
                          cut="traced" if raw.get("traced") else raw.get("cut", "chain"),
                          layer_returns=raw.get("layer_returns", "tensor"),
                          ties=None if "ties" not in raw else tuple(
                              (t["parameter"], tuple(t["stages"])) for t in raw["ties"]),
                          vocab_parallel=None if "vocab_parallel" not in raw else (
                              raw["vocab_parallel"]["embedding"], raw["vocab_parallel"]["head"]),
                          weights=raw.get("weights"), optimizer=raw.get("optimizer"),
                          data=raw["data"], loss=raw["loss"],
                          path=raw.get("path"))
    return PlanSpec(source=source, name=doc["name"], description=doc.get("description", ""),
                    num_devices=num_devices, memory_capacity=capacity,
                    device_memory=device_memory, device_speed=device_speed,
                    memory_is_size=memory.is_size, num_micro_batches=doc["micro_batches"],
                    task=task, backward=backward,
                    recompute=doc.get("training", {}).get("recompute", "never"),
                    topology=_topology(source, doc.get("topology"), size),
                    shape=shape, blocks=tuple(blocks),
                    order=tuple(order), search=search, mesh=mesh, model=model)


def parse_spec(source: Source) -> PlanSpec:
    """Check a loaded document (version, schema, document-level rules) and build the spec."""
    doc = source.data
    if not isinstance(doc, dict):
        raise source.error((), "a plan must be a mapping of keys to values",
                           "start from an example in plans/")
    version = doc.get("pyplan")
    if "pyplan" not in doc:
        raise source.error((), "missing the format version 'pyplan: 1'",
                           "add `pyplan: 1` as the first line")
    if isinstance(version, int) and not isinstance(version, bool) and version != FORMAT_VERSION:
        raise source.error(("pyplan",), f"unsupported plan format version {version}",
                           f"this pyplan reads version {FORMAT_VERSION}; upgrade pyplan or "
                           "convert the plan")
    check_document(source)
    check_schema(source)
    return _build(source)


def check_document(source: Source) -> None:
    """Every key of a plan (or a cluster file) is a name and every number finite: a key YAML
    reads as a number, true/false or null (`1:`, `yes:`), or a .nan or .inf (which JSON
    Schema's bounds let through), is refused where it is, before anything looks it up."""
    stack = [((), source.data)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            where = ".".join(str(p) for p in path) or "the plan"
            raise source.error(path, f"{where} must be a finite number, got {node}")
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(key, str):
                    shown = "true" if key is True else "false" if key is False else \
                        "null" if key is None else repr(key)
                    raise source.error(path + (key,), f"this key reads as {shown}, not as a "
                                       "name", "write it in quotes", key=True)
                stack.append((path + (key,), value))
        elif isinstance(node, list):
            stack.extend((path + (i,), item) for i, item in enumerate(node))


def load_spec(path: str | Path) -> PlanSpec:
    """Load and check a plan file."""
    return parse_spec(load_yaml(path))


def spec_from_text(text: str, name: str = "<plan>") -> PlanSpec:
    """Parse a plan from a string (tests, tools)."""
    return parse_spec(parse_yaml(text, name))


def _check_priced(source: Source, mesh: MeshSpec) -> None:
    """The blocks' costs are one tensor rank's of the mesh's degree (mesh.priced), or the
    plan is refused: nothing here can price them again (that needs the model's config and its
    measured units, which a plan does not carry)."""
    if mesh.priced == mesh.tensor:
        return
    hint = (f"re-run pyplan partition --tensor {mesh.tensor}, which prices each unit as one "
            "tensor rank runs it" if mesh.tensor > 1 else
            "re-run pyplan partition without --tensor")
    if mesh.priced == 1:
        raise source.error(("mesh", "tensor"), f"mesh.tensor is {mesh.tensor}, but the blocks' "
                           "costs are a whole model's (mesh.priced: 1, the default): each tensor "
                           "rank would be planned the time and memory of the whole",
                           hint + f"; for costs written as one of {mesh.tensor} tensor "
                           f"ranks', add priced: {mesh.tensor} to mesh")
    raise source.error(("mesh", "priced"), f"the blocks' costs are one of {mesh.priced} tensor "
                       f"ranks' (mesh.priced), but mesh.tensor is {mesh.tensor}", hint)
