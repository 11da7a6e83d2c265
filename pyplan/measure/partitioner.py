"""`pyplan.partition_model`: from a PyTorch model to solved plans, the library call behind
`pyplan partition`. The model is built on the meta device (pyplan.models.deferred) and its
units measured one at a time on one micro-batch of the data, as each rank of a run computes
(one CPU thread; pyplan.measure.profile); the units are cut into stages by exact dynamic
programming (pyplan.partition), the best few partitions and the even splits are solved, and
the plans come back shortest first. With `shape="mshape"` or `"auto"`, the embedding and head
are also measured sharded over the vocabulary (pyplan.measure.sharded) and, for auto, every
placement that applies is solved (pyplan.measure.placements).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pyplan.api import PartitionPlan, partition_plans
from pyplan.errors import InfeasibleError, PlanError, TimeLimitError, describe_exception
from pyplan.files import check_not_input
from pyplan.models import FORWARD, TRACED, Cut, Unit, everywhere
from pyplan.partition import OPTIMIZER_STATE, UnitCost, host_capacity, ties
from pyplan.planfile.types import CPU_LINK, LinkSpec, TopologySpec
from pyplan.measure.placements import (CHUNKS, Placement, Sharded, graph_plans, mshape_plans,
                                      placements)
from pyplan.partition.graph import UnitGraph, decompose
from pyplan.run.binding import Model, defer_whole, import_function, loss_function, make_batch
from pyplan.measure.census import storage_bytes
from pyplan.run.data import batches_from, split_batch, to_device
from pyplan.run.pipeline import DTYPES
from pyplan.measure.limits import DEFAULT_SECONDS, time_limit
from pyplan.measure.links import measure_link
from pyplan.measure.measure import Measured, host_bytes, rss_bytes

__all__ = ["SHAPES", "Partitioned", "partition_model"]

SHAPES = ("vshape", "interleaved", "mshape", "graph", "auto")
SOLVE_SECONDS = 10.0  # per candidate partition
AUTO_SOLVE_SECONDS, AUTO_KEEP = 5.0, 2  # shape auto: per candidate, best partitions kept


@dataclass(frozen=True)
class Partitioned:
    """What partition_model found."""

    plans: list[PartitionPlan]
    """The placement chosen: its best partitions and even splits, solved, shortest first
    (plans[0].text is the plan to write)."""
    shape: str
    units: list[UnitCost]
    cut: Cut
    tried: list[Placement] = field(default_factory=list)
    """shape auto (or the default on a model with branches): every placement solved (or why
    it does not apply), shortest first."""
    sharded: Sharded | None = None
    """The vocabulary-sharded first and last units (M-shape), when measured."""
    about_sharded: list[str] = field(default_factory=list)
    """Lines on the sharded units' costs."""
    warnings: list[str] = field(default_factory=list)
    ties: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    """(parameter, the blocks holding it) of plans[0]."""
    host: list[int] = field(default_factory=list)
    """On the CPU, each rank's planned host memory: its device's peak in plans[0] and the
    process's own (`baseline`)."""
    baseline: int = 0
    """What a process held before the model was built: Python, torch and the model's code."""
    link: LinkSpec | None = None
    """The link between two devices the plans time transfers on, when measured (links=True)."""
    why: str = ""
    """Why the shape written was chosen (auto, the default on a model with branches)."""


def _module_files(*found) -> list[str]:
    """The source files of the user's modules (named as pkg.mod:fn, or the functions'
    own): an output onto one of them would overwrite the model's code."""
    names = [f.partition(":")[0] if isinstance(f, str) else getattr(f, "__module__", None)
             for f in found]
    modules = [sys.modules.get(name) for name in names if name]
    return [m.__file__ for m in modules if getattr(m, "__file__", None)]


def partition_model(factory: str, data: str, loss: str, *, devices: int, output: str | Path,
                    shape: str | None = None, chunks: int = 2, micro_batches: int | None = None,
                    memory: int | list[int] | None = None, speeds: list[float] | None = None,
                    recompute: str = "never", optimizer: str = "sgd",
                    split_backward: bool = False, weights: str | Path | None = None,
                    repeats: int = 5, seed: int = 0, device: str = "cpu", dtype: str = "fp32",
                    links: bool = False,
                    progress=None, unit_seconds: float | None = DEFAULT_SECONDS,
                    host_memory: int | None = None, tensor: int = 1,
                    sequence_parallel: bool = True) -> Partitioned:
    """Plans for the model `factory` ("pkg.mod:fn" returning the whole nn.Module) trained on
    `data` ("pkg.mod:fn", batch(step) -> (inputs, targets), or a dataset or loader) with
    `loss` ("pkg.mod:fn", loss(output, targets)) over `devices` devices, for a plan to be
    written at `output` (its name; the folders it names are relative to it). `shape`:
    vshape, interleaved (`chunks` stages per device), mshape, graph (a stage DAG following the
    model's branches, pyplan.partition.graph), auto, or None: vshape, or graph when the model
    has parallel branches and its solved makespan is shorter. `memory`: bytes per
    device (or one per device), `speeds` each device's relative speed; `recompute`,
    `optimizer` (sgd or adamw, as pyplan run names them: the state its weights count and its
    step's time and temporaries), `split_backward` (zero bubble: input and weight gradients
    measured apart), `weights` (a safetensors checkpoint folder the parameters start from),
    `repeats` (timed runs per measurement), `device` (cpu, or cuda to measure on the first
    GPU), `links` (measure the link between two processes here, pyplan.measure.links, and time
    the stages' outputs on it; else on the CPU pyplan's CPU-class default, CPU_LINK, on a GPU a
    GPU node's default), `dtype` (fp32, or bf16 or fp16: the forwards under autocast, as
    `pyplan run --dtype` runs them). `progress(done, total)` is called as units are measured;
    `unit_seconds` bounds each unit's measurement (CPU seconds, pyplan.measure.limits).
    `host_memory`: the bytes of the machine the CPU ranks share (pyplan.partition.
    host_capacity); each rank's planned host memory is in Partitioned.host. `tensor` > 1:
    plans of mesh.tensor (with `sequence_parallel`, or mesh.sequence: false), each unit
    priced as one tensor rank runs it (pyplan.cluster.ranks).
    PlanError for bad arguments, a model that cannot be cut or an `output` that is one of the
    model's modules; InfeasibleError when nothing fits."""
    if shape is not None and shape not in SHAPES:
        raise PlanError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    if optimizer not in OPTIMIZER_STATE:  # (pyplan.options.choices: the CLI's same names)
        raise PlanError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE)}, got "
                        f"{optimizer!r}", hint="adamw: torch.optim.AdamW, Adam with decoupled "
                        "weight decay")
    stages = devices * (chunks if shape == "interleaved" else 1) + (2 if shape == "mshape"
                                                                     else 0)
    n = micro_batches if micro_batches is not None else 2 * devices * (
        chunks if shape == "interleaved" else 1)
    if device == "cuda" and not torch.cuda.is_available():
        raise PlanError("device cuda, but torch sees no GPU", hint="measure on the CPU")
    if dtype not in DTYPES:
        raise PlanError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    output = Path(output)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the factory is imported like `python -c` would
    here = "run from the folder that holds the model's package"
    user = Model(None, import_function(data, "data", hint=here,
                                       check=lambda found: batches_from(found) is not None),
                 import_function(loss, "loss", hint=here),
                 whole=import_function(factory, "factory", hint=here),
                 names={"module": "factory", "data": "data", "loss": "loss"},
                 weights=None if weights is None else Path(weights))
    check_not_input(output, *_module_files(factory, data, loss, user.whole, user.data,
                                           user.loss), weights, flag="-o")
    baseline = rss_bytes()  # a process with torch and the model's code, before the model
    deferred = defer_whole(user, seed)
    inputs, targets = make_batch(user, 0, seed, torch.device("cpu"))
    held = storage_bytes(torch.utils._pytree.tree_leaves((inputs, targets)))  # by some ranks
    inputs, targets = split_batch(inputs, n)[0], split_batch(targets, n)[0]
    measured = Measured()
    from pyplan.measure.profile import profile_units

    units, cut = profile_units(deferred, inputs, targets, loss_function(user),
                               optimizer=optimizer, repeats=repeats, device=where,
                               progress=progress, measured=measured, split=split_backward,
                               unit_seconds=unit_seconds, batch_bytes=held,
                               dtype=DTYPES[dtype])
    if len(units) < stages and shape != "auto":
        raise PlanError(f"{factory} has {len(units)} units "
                        f"({', '.join(u.name for u in units)}), fewer than the {stages} stages "
                        "asked for", hint="use fewer devices (or chunks)")
    mesh = None
    if tensor > 1:
        if shape not in ("vshape", "interleaved"):
            raise PlanError(f"tensor {tensor} with shape {shape}: the M-shape's blocks on "
                            "every device do not combine with tensor parallelism",
                            hint="use shape vshape or interleaved")
        with time_limit(f"the units priced per tensor rank ({len(units)} units)",
                        None if unit_seconds is None else unit_seconds * len(units)):
            units = _per_tensor_rank(units, deferred.model, cut, inputs, factory, tensor,
                                     sequence_parallel, dtype, _link(links, device), optimizer)
        mesh = f"{{tensor: {tensor}, priced: {tensor}" + \
            ("" if sequence_parallel else ", sequence: false") + "}"
    if host_memory is not None and device == "cpu":  # host memory is the device's
        memory = host_capacity(memory, host_memory, devices, baseline)
    shared = everywhere(deferred.model, [Unit(u.name, u.module_names) for u in units]) \
        if cut.kind == FORWARD else ()
    folder = output.resolve().parent
    root = _package_root(sys.modules[factory.partition(":")[0]])
    measured_link = _link(links, device) if links else None
    link = measured_link or (CPU_LINK if device == "cpu" else None)
    options = dict(link=link, optimizer=optimizer, name=output.name.split(".")[0],
                   factory=factory, data=data, loss=loss,
                   micro_batches=n, memory=memory, time_limit=SOLVE_SECONDS,
                   source=str(output), cut=cut.kind,
                   layer_returns=cut.layer_returns, everywhere=shared,
                   recompute=recompute,
                   path=None if root is None else os.path.relpath(root, folder),
                   weights=None if weights is None else os.path.relpath(Path(weights).resolve(),
                                                                        folder))
    sharded, why, about = None, None, []
    if shape in ("mshape", "auto"):
        try:
            with time_limit("the vocabulary-sharded units (the model's forward, the "
                            "embedding and the head)", None if unit_seconds is None else
                            3 * unit_seconds):
                sharded, why, about = _sharded(deferred, inputs, targets, user, cut, units,
                                               devices, optimizer, repeats, where, measured)
        except PlanError as exc:  # auto: the other placements still apply
            if shape == "mshape":
                raise
            why = exc.message
        if sharded is None and shape == "mshape":
            raise PlanError(f"shape mshape: {why}", hint="use vshape or interleaved")
    tried, names, why_chosen = [], None, ""
    graph, why_graph = None, None
    if shape in (None, "graph", "auto"):
        graph, why_graph = _unit_graph(deferred, cut, units, inputs, memory, speeds,
                                       unit_seconds)
        if shape == "graph" and graph is None:
            raise PlanError(f"shape graph: {why_graph}", hint="use --shape vshape")
    if shape is None and graph is not None:  # a model with branches: graph or chain
        tried = placements(units, devices=devices, shapes=("vshape", "graph"), sharded=None,
                           graph=graph, **options)
        if tried[0].best is None:
            raise InfeasibleError("no placement fits: " + "; ".join(
                f"{p.label}: {p.reason}" for p in tried), hint="give more memory or devices")
        plans, chosen = list(tried[0].plans), tried[0].shape
        why_chosen = _why(tried)
    elif shape is None:
        shape = "vshape"
    if shape == "auto":
        shapes = ("vshape", *(f"interleaved-{c}" for c in CHUNKS), "mshape", "graph")
        # Five placements to solve: fewer candidates each, and less time per candidate.
        tried = placements(units, devices=devices, shapes=shapes, sharded=sharded,
                           why_not_mshape=why, cores=_cores() if device == "cpu" else None,
                           graph=graph, why_not_graph=why_graph,
                           **{**options, "keep": AUTO_KEEP, "time_limit": AUTO_SOLVE_SECONDS})
        if tried[0].best is None:
            raise InfeasibleError("no placement fits: " + "; ".join(
                f"{p.label}: {p.reason}" for p in tried), hint="give more memory or devices")
        plans, chosen = list(tried[0].plans), tried[0].shape
        why_chosen = _why(tried)
    elif shape == "graph":
        plans, chosen = graph_plans(units, graph, devices=devices, **options), "graph"
    elif shape is None:
        pass  # chosen above
    elif shape == "mshape":
        plans, chosen = mshape_plans(units, sharded, devices=devices, **options), "mshape"
    else:
        plans = partition_plans(units, devices=devices, speeds=speeds,
                                chunks=chunks if shape == "interleaved" else 1, mesh=mesh,
                                **options)
        chosen = shape
    if chosen == "mshape":
        names = ("embed", *(f"stage{s}" for s in range(devices)), "head")
    warnings = measured.warnings
    cores = _cores()
    if device == "cpu" and devices > cores:
        warnings.append(
            f"{devices} devices, {cores} CPU cores here: pyplan run on this machine shares "
            "the cores among its ranks, so its iterations take longer than predicted (the "
            "prediction gives every device a core), most for placements that keep every "
            "device busy at once (the M-shape)")
    host = [peak + baseline for peak in plans[0].solution.schedule.peak_memory] \
        if device == "cpu" else []
    machine = host_bytes() // max(devices, 1)
    if host_memory is None and machine and host and max(host) > machine:
        warnings.append(f"a rank's planned host memory ({max(host) / 2**30:.2f} GiB, with "
                        f"{baseline / 2**30:.2f} GiB for Python and torch) exceeds this "
                        f"machine's share ({machine / 2**30:.2f} GiB for each of {devices} "
                        "ranks): give --host-memory to partition within it")
    return Partitioned(plans, chosen, units, cut, tried, sharded if chosen == "mshape" else None,
                       about if chosen == "mshape" else [], warnings,
                       ties(units, plans[0].partition, shared, names), host, baseline,
                       measured_link, why_chosen)


def _unit_graph(deferred, cut: Cut, units: list[UnitCost], inputs, memory, speeds,
                unit_seconds: float | None) -> tuple[UnitGraph | None, str | None]:
    """(the units' graph, None) for a model with parallel branches, else (None, why not)."""
    if cut.kind != TRACED:
        how = "in its own forward" if cut.kind == FORWARD else "as a chain"
        return None, f"the model is cut {how}: its units run one after another"
    if isinstance(memory, list) or speeds:
        return None, "it takes one memory for every device and no speeds"
    from pyplan.models.graph import unit_graph

    meta = not deferred.eager
    # A copy: torch's tracer wraps the forwards of the modules it splits at, for good.
    try:
        with deferred.streaming() if not meta else contextlib.nullcontext(), \
                time_limit("the model's graph of units (torch's tracer)", unit_seconds):
            preds, reads, sizes = unit_graph(copy.deepcopy(deferred.model),
                                             [u.name for u in units],
                                             to_device(inputs, torch.device("meta")) if meta
                                             else inputs)
    except (TimeLimitError, KeyboardInterrupt):
        raise
    except PlanError as exc:  # the tracer's limits: the graph does not apply
        return None, exc.message
    except Exception as exc:  # noqa: BLE001 - the pieces failed to run: no graph
        return None, f"its units' graph could not be followed ({describe_exception(exc)})"
    graph = UnitGraph(tuple(preds), tuple(reads), tuple(sizes))
    if decompose(graph).branches() < 2:
        return None, "the model's units have no parallel branches"
    return graph, None


def _why(tried: list[Placement]) -> str:
    """Why the first placement was written: its makespan (and depth) against the next."""
    best, other = tried[0], next((p for p in tried[1:] if p.best is not None), None)
    depth = getattr(best.best.partition, "depth", None)
    what = f"{best.label}" + (f" (a stage DAG of depth {depth} on "
                              f"{best.best.partition.num_stages} devices)" if depth else "")
    if other is None:
        return f"{what}: the only placement that fits"
    return (f"{what}: predicted makespan {best.expected_ms:.2f} ms, "
            f"{other.expected_ms / best.expected_ms:.2f}x shorter than {other.label}'s "
            f"{other.expected_ms:.2f} ms")


_LINKS: dict[tuple[bool, str], LinkSpec] = {}


def _link(measure: bool, device: str) -> LinkSpec:
    """The link between two devices: measured here (once per process), else the default."""
    if not measure:
        return CPU_LINK if device == "cpu" else TopologySpec().within_node
    if (measure, device) not in _LINKS:
        bandwidth, latency, _ = measure_link(device)
        _LINKS[(measure, device)] = LinkSpec(bandwidth=bandwidth, latency_ms=latency)
    return _LINKS[(measure, device)]


def _per_tensor_rank(units: list[UnitCost], model, cut: Cut, inputs, factory: str,
                     tensor: int, sequence_parallel: bool, dtype: str,
                     link: LinkSpec, optimizer: str) -> list[UnitCost]:
    """The units as one of `tensor` ranks runs them (pyplan.cluster.ranks): a Hugging Face
    model cut at its decoder layers, its micro-batch token ids (batch x sequence). A unit's
    weights are what a tensor rank of `pyplan run` holds of them: the parameters its tensor
    plan shards (pyplan.mesh.tensor.sharded_parameters) divided, the rest whole."""
    from pyplan.cluster.model import from_config
    from pyplan.cluster.ranks import rank_units
    from pyplan.measure.measure import unit_parameters
    from pyplan.models.forward import decoder_layers
    from pyplan.partition import weight_bytes
    from pyplan.mesh.tensor import sharded_parameters, tensor_plan

    config = getattr(model, "config", None)
    layers = decoder_layers(model) if cut.kind == FORWARD else None
    if config is None or not hasattr(config, "to_dict") or layers is None:
        raise PlanError(f"{factory}: tensor parallelism is priced from a Hugging Face model's "
                        "config, cut at its decoder layers, and this model is not one",
                        hint="partition it without --tensor")
    tokens = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise PlanError(f"{factory}: tensor parallelism is priced for token ids of shape "
                        "(batch, sequence), which the data's inputs are not",
                        hint="partition it without --tensor")
    kinds, seen = [], False
    for unit in units:
        inside = any(m.startswith(f"{layers}.") for m in unit.module_names)
        seen = seen or inside
        kinds.append("layer" if inside else "head" if seen else "embedding")
    shape = from_config(config.to_dict(), where=factory)
    sharded = sharded_parameters(model, tensor_plan(model))
    weights = []
    for unit in units:
        params = unit_parameters(model, Unit(unit.name, unit.module_names))
        weights.append(unit.weight_bytes - weight_bytes(params, optimizer) + weight_bytes(
            params, optimizer, tensor=tensor, sharded=sharded))
    return rank_units(units, kinds, shape, tensor=tensor, sequence_parallel=sequence_parallel,
                      micro_batch=tokens.shape[0], sequence=tokens.shape[1],
                      dtype=dtype, link=link, weights=weights)


def _package_root(module) -> Path | None:
    """The folder the plan must put on sys.path to import `module`: the working directory when
    that is where it was found (else None: it is installed or on the path anyway)."""
    file = getattr(module, "__file__", None)
    if file is None or module.__name__.split(".")[0] == "pyplan":  # pyplan's own examples
        return None
    root = Path(file).resolve().parent
    for _ in module.__name__.split(".")[1:]:
        root = root.parent
    return root if root == Path.cwd().resolve() else None


def _cores() -> int:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _sharded(deferred, inputs, targets, user, cut, units, devices, optimizer, repeats, device,
             measured):
    """(the M-shape's sharded first and last units, None, lines about their costs) or (None,
    why the model has none, [])."""
    from pyplan.models.forward import logits, whole_forward
    from pyplan.models.vocab import check_divisible, find
    from pyplan.measure.sharded import profile_sharded

    if cut.kind == TRACED:
        return None, "the model is cut by torch's tracer, whose pieces cannot be sharded", []
    if len(units) < devices + 2:
        return None, (f"{devices} stages between the first and last units need "
                      f"{devices + 2} units, the model has {len(units)}"), []
    found_units = [Unit(u.name, u.module_names) for u in units]
    model = deferred.model
    with torch.no_grad(), deferred.streaming():
        was = model.training
        model.eval()
        try:
            out = logits(whole_forward(model, inputs))
        finally:
            model.train(was)
        vocab = find(model, inputs, found_units[0].modules, found_units[-1].modules, out)
    if vocab is None:
        return None, ("the first unit has no token embedding, or the last no head over the "
                      "vocabulary of the model's output"), []
    check_divisible(vocab, devices)
    result = profile_sharded(deferred, inputs, targets, loss_function(user), cut=cut,
                             units=found_units, costs=units, vocab=vocab, devices=devices,
                             optimizer=optimizer, repeats=repeats, device=device,
                             measured=measured, measure=True)
    where = f"measured among {devices} local processes" if result.measured else \
        "on the default link: too few GPUs here to measure them"
    lines = []
    for unit, whole in ((result.first, units[0]), (result.last, units[-1])):
        comm = result.collectives[unit.name]
        lines.append(f"  {unit.name}: per rank of {devices}, {unit.forward_ms:.2f} + "
                     f"{unit.backward_ms:.2f} ms with {len(comm)} collectives "
                     f"({sum(c.bytes for c in comm):,} bytes, {where}); whole: "
                     f"{whole.forward_ms:.2f} + {whole.backward_ms:.2f} ms")
    return Sharded(result.first, result.last, (vocab.embedding, vocab.head)), None, lines
