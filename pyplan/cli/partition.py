"""`pyplan partition FACTORY --data DATA --loss LOSS --devices D -o PLAN`: from a PyTorch model
to a solved plan. Profile the model's units on one micro-batch, cut them into stages by exact
dynamic programming (least bottleneck within the memory), solve the best few partitions and
write the plan of the one with the shortest makespan."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from pyplan.api import partition_plans
from pyplan.cli._torch import require_torch
from pyplan.cli.profile import MAX_REPEATS
from pyplan.errors import PlanError
from pyplan.fileio import write_atomic
from pyplan.partition import OPTIMIZER_STATE, ties
from pyplan.spec import parse_memory
from pyplan.spec.plan import MAX_DEVICES, MAX_MICRO_BATCHES

__all__ = ["add_arguments", "run"]

SOLVE_SECONDS = 10.0  # per candidate partition
AUTO_SOLVE_SECONDS, AUTO_KEEP = 5.0, 2  # --shape auto: per candidate, best partitions kept


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", metavar="FACTORY",
                        help="pkg.mod:fn returning the whole nn.Module (its children, "
                        "nn.Sequential / nn.ModuleList flattened, are the units)")
    parser.add_argument("--data", required=True, metavar="PKG.MOD:FN",
                        help="fn(step) -> (inputs, targets), the global batch")
    parser.add_argument("--loss", required=True, metavar="PKG.MOD:FN",
                        help="fn(output, targets) -> a scalar mean loss")
    parser.add_argument("--devices", type=int, required=True, metavar="D")
    parser.add_argument("--shape", choices=("vshape", "interleaved", "mshape", "auto"),
                        default="vshape",
                        help="vshape: stage s on device s; interleaved: stage s on device s "
                        "mod D, --chunks stages per device; mshape: the token embedding and "
                        "the head on all devices, sharded over the vocabulary, one stage per "
                        "device between them; auto: solve every placement that applies and "
                        "write the shortest")
    parser.add_argument("--chunks", type=int, default=2, metavar="C",
                        help="stages per device with --shape interleaved (default 2)")
    parser.add_argument("--micro-batches", type=int, metavar="N",
                        help="micro-batches per iteration (default 2 x stages)")
    parser.add_argument("--memory", metavar="SIZE", help="memory per device, e.g. 24GiB, or "
                        "one per device, e.g. 80GiB,80GiB,40GiB,40GiB (default: unlimited)")
    parser.add_argument("--speeds", metavar="S,S,...", help="each device's speed relative to "
                        "the one measuring, e.g. 1,1,0.5,0.5 (mixed GPU types: slower devices "
                        "get fewer units)")
    parser.add_argument("--recompute", choices=("never", "always", "auto"), default="never",
                        help="activation recomputation written to the plan (training.recompute; "
                        "auto: pyplan solve chooses per stage); default never")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATE), default="sgd",
                        help="optimizer whose state counts in the weights' memory")
    parser.add_argument("--repeats", type=int, default=5, metavar="K",
                        help="timed runs per unit and direction; the median counts")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="measure the units on this device (cuda: the first GPU, timed "
                        "with CUDA events)")
    parser.add_argument("-o", "--output", required=True, metavar="PLAN",
                        help="where to write the plan (then pyplan solve PLAN)")


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


def _options(args: argparse.Namespace):
    """(stages, micro-batches, memory in bytes: one amount or one per device, speeds)."""
    if not 1 <= args.devices <= MAX_DEVICES:
        raise PlanError(f"--devices must lie in 1 .. {MAX_DEVICES}")
    if args.chunks < 1 or not 1 <= args.repeats <= MAX_REPEATS:
        raise PlanError(f"--chunks must be at least 1 and --repeats lie in 1 .. {MAX_REPEATS}")
    stages = args.devices * (args.chunks if args.shape == "interleaved" else 1)
    n = args.micro_batches if args.micro_batches is not None else 2 * stages
    if args.shape == "mshape":
        stages += 2  # the sharded first and last units are blocks of their own
    if not 1 <= n <= MAX_MICRO_BATCHES:
        raise PlanError(f"--micro-batches must lie in 1 .. {MAX_MICRO_BATCHES}")
    memory = None
    if args.memory is not None:
        memory = [_size(text) for text in _per_device(args.memory, "--memory", args.devices)]
        memory = memory[0] if len(memory) == 1 else memory
    speeds = None
    if args.speeds is not None:
        speeds = [_speed(text) for text in _per_device(args.speeds, "--speeds", args.devices)]
        speeds = speeds * args.devices if len(speeds) == 1 else speeds
    if args.shape in ("mshape", "auto") and (isinstance(memory, list) or speeds):
        raise PlanError(f"--shape {args.shape} takes one --memory for every device and no "
                        "--speeds (its sharded units run on all devices alike)",
                        hint="use --shape vshape or interleaved")
    return stages, n, memory, speeds


def _per_device(text: str, option: str, devices: int) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if len(items) not in (1, devices):
        raise PlanError(f"{option} gives {len(items)} values for {devices} devices",
                        hint="give one for every device, or one for all")
    return items


def _size(text: str) -> int:
    try:
        amount, is_size = parse_memory(text)
    except ValueError as exc:
        raise PlanError(f"--memory: {exc}") from None
    if not is_size or amount <= 0:
        raise PlanError("--memory must be a positive size such as 24GiB")
    return amount


def _speed(text: str) -> float:
    try:
        speed = float(text)
    except ValueError:
        speed = math.nan
    if not 1e-3 <= speed <= 1e3:  # also refuses nan
        raise PlanError(f"--speeds: {text!r} is not a speed in 0.001 .. 1000",
                        hint="a device's speed relative to the one measuring, e.g. 0.5")
    return speed


def run(args: argparse.Namespace) -> int:
    stages, n, memory, speeds = _options(args)
    require_torch("partition")
    import torch

    from pyplan.models import Unit, everywhere
    from pyplan.runtime.binding import (Model, defer_whole, import_function, loss_function,
                                        make_batch)
    from pyplan.runtime.data import batches_from, split_batch
    from pyplan.runtime.profile import Measured, profile_units

    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # FACTORY is imported like `python -c` would
    here = "run from the folder that holds the model's package"
    factory = import_function(args.factory, "FACTORY", hint=here)
    data = import_function(args.data, "--data", hint=here,
                           check=lambda found: batches_from(found) is not None)
    loss = import_function(args.loss, "--loss", hint=here)
    user = Model(None, data, loss, whole=factory,
                 names={"module": "FACTORY", "data": "--data", "loss": "--loss"})
    deferred = defer_whole(user, args.seed)
    model = deferred.model
    inputs, targets = make_batch(user, 0, args.seed, torch.device("cpu"))
    inputs, targets = split_batch(inputs, n)[0], split_batch(targets, n)[0]
    measured = Measured()
    units, cut = _profile(profile_units, deferred, inputs, targets, loss_function(user), args,
                          measured)
    if len(units) < stages and args.shape != "auto":
        raise PlanError(f"{args.factory} has {len(units)} units "
                        f"({', '.join(u.name for u in units)}), fewer than the {stages} stages "
                        "asked for", hint="use fewer --devices (or --chunks)")
    out = Path(args.output)
    root = _package_root(sys.modules[args.factory.partition(":")[0]])
    path = None if root is None else os.path.relpath(root, out.resolve().parent)
    chunks = args.chunks if args.shape == "interleaved" else 1
    shared = everywhere(model, [Unit(u.name, u.module_names) for u in units]) \
        if cut.kind == "forward" else ()
    options = dict(name=out.name.split(".")[0], factory=args.factory, data=args.data,
                   loss=args.loss, micro_batches=n, memory=memory, path=path,
                   time_limit=SOLVE_SECONDS, source=str(out), cut=cut.kind,
                   layer_returns="tuple" if cut.tuples else "tensor", everywhere=shared,
                   recompute=args.recompute)
    how = {"chain": "", "traced": "cut by torch's pipeline tracer, ",
           "forward": "cut in the model's own forward, "}[cut.kind]
    sharded, why, about = None, None, []
    if args.shape in ("mshape", "auto"):
        try:
            sharded, why, about = _sharded(deferred, inputs, targets, loss, user, cut, units,
                                           args, measured)
        except PlanError as exc:  # auto: the other placements still apply
            if args.shape == "mshape":
                raise
            why = exc.message
        if sharded is None and args.shape == "mshape":
            raise PlanError(f"--shape mshape: {why}", hint="use --shape vshape or interleaved")
    if args.shape == "auto":
        plans, shape = _auto(units, sharded, why, args, options, f"{how}measured", _cores())
    elif args.shape == "mshape":
        from pyplan.placements import mshape_plans

        plans, shape = mshape_plans(units, sharded, devices=args.devices, **options), "mshape"
    else:
        plans, shape = partition_plans(units, devices=args.devices, chunks=chunks,
                                       speeds=speeds, **options), args.shape
    if args.shape != "auto":
        print(f"{args.factory}: {len(units)} units ({how}measured), {stages} stages "
              f"({shape}), {n} micro-batches; the best partitions and even splits, solved:")
    for line in about if shape == "mshape" else ():
        print(line)
    for plan in sorted(plans, key=lambda c: c.partition.bottleneck_ms):
        p = plan.partition
        cut_text = " | ".join(f"{units[p.bounds[s]].name}..{units[p.bounds[s + 1] - 1].name}"
                              for s in range(p.num_stages))
        print(f"  bottleneck {p.bottleneck_ms:8.2f} ms  makespan {plan.makespan_ms:9.2f} ms "
              f"({plan.solution.status})  {cut_text}")
    warnings = measured.warnings
    cores = _cores()
    if args.device == "cpu" and args.devices > cores:
        warnings.append(
            f"{args.devices} devices, {cores} CPU cores here: pyplan run on this machine shares "
            "the cores among its ranks, so its iterations take longer than predicted (the "
            "prediction gives every device a core), most for placements that keep every "
            "device busy at once (the M-shape)")
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    names = None
    if shape == "mshape":
        names = ("embed", *(f"stage{s}" for s in range(args.devices)), "head")
        print(f"  sharded over the vocabulary on all {args.devices} devices: "
              f"{sharded.vocab[0]} (block embed) and {sharded.vocab[1]} (block head)")
    for parameter, holders in ties(units, plans[0].partition, shared, names):
        print(f"  tied: {parameter} is held by {', '.join(holders)}; pyplan run sums its "
              "gradients over the copies (one all-reduce per iteration, after the backward; "
              "not in the predicted makespan)")
    write_atomic(out, plans[0].text)
    print(f"wrote {out}: the partition with the shortest makespan; next: pyplan solve {out}")
    return 0


def _sharded(deferred, inputs, targets, loss, user, cut, units, args, measured):
    """(the M-shape's sharded first and last units, None, lines about their costs) or (None,
    why the model has none, [])."""
    import torch

    from pyplan.models import FORWARD, TRACED
    from pyplan.models.forward import logits, whole_forward
    from pyplan.models.vocab import check_divisible, find
    from pyplan.placements import Sharded
    from pyplan.runtime.binding import loss_function
    from pyplan.runtime.sharded import profile_sharded

    if cut.kind == TRACED:
        return None, "the model is cut by torch's tracer, whose pieces cannot be sharded", []
    if len(units) < args.devices + 2:
        return None, (f"{args.devices} stages between the first and last units need "
                      f"{args.devices + 2} units, the model has {len(units)}"), []
    from pyplan.models import Unit

    found_units = [Unit(u.name, u.module_names) for u in units]
    model = deferred.model
    with torch.no_grad(), deferred.streaming():
        was = model.training
        model.eval()
        try:
            out = logits(whole_forward(model, inputs) if cut.kind == FORWARD else model(inputs))
        finally:
            model.train(was)
        vocab = find(model, inputs, found_units[0].modules, found_units[-1].modules, out)
    if vocab is None:
        return None, ("the first unit has no token embedding, or the last no head over the "
                      "vocabulary of the model's output"), []
    check_divisible(vocab, args.devices)
    result = profile_sharded(deferred, inputs, targets,
                             loss_function(user), cut=cut,
                             units=found_units, costs=units, vocab=vocab, devices=args.devices,
                             optimizer=args.optimizer, repeats=args.repeats,
                             device=torch.device("cuda", 0) if args.device == "cuda" else
                             torch.device("cpu"), measured=measured, measure=True)
    where = f"measured among {args.devices} local processes" if result.measured else \
        "on the default link: too few GPUs here to measure them"
    lines = []
    for unit, whole in ((result.first, units[0]), (result.last, units[-1])):
        comm = result.collectives[unit.name]
        lines.append(f"  {unit.name}: per rank of {args.devices}, {unit.forward_ms:.2f} + "
                     f"{unit.backward_ms:.2f} ms with {len(comm)} collectives "
                     f"({sum(c.bytes for c in comm):,} bytes, {where}); whole: "
                     f"{whole.forward_ms:.2f} + {whole.backward_ms:.2f} ms")
    return Sharded(result.first, result.last, (vocab.embedding, vocab.head)), None, lines


def _auto(units, sharded, why, args, options, how, cores):
    """Every placement that applies, solved; prints them and returns the shortest's plans."""
    from pyplan.errors import InfeasibleError
    from pyplan.placements import CHUNKS, placements

    shapes = ("vshape", *(f"interleaved-{c}" for c in CHUNKS), "mshape")
    # Five placements to solve: fewer candidates each, and less time per candidate.
    tried = placements(units, devices=args.devices, shapes=shapes, sharded=sharded,
                       why_not_mshape=why, cores=cores if args.device == "cpu" else None,
                       **{**options, "keep": AUTO_KEEP, "time_limit": AUTO_SOLVE_SECONDS})
    best = tried[0]
    if best.best is None:
        raise InfeasibleError("no placement fits: " + "; ".join(
            f"{p.label}: {p.reason}" for p in tried), hint="give more memory or devices")
    shared = best.cores is not None
    print(f"{args.factory}: {len(units)} units ({how}), {args.devices} devices, "
          f"{options['micro_batches']} micro-batches; placements solved with the measured costs "
          "(predicted makespan" + (f"; the {args.devices} ranks share {best.cores} CPU cores "
                                   "here, so an iteration takes at least its compute / "
                                   f"{best.cores}" if shared else "") + "):")
    for p in tried:
        if p.best is None:
            print(f"  {p.label:24} not applicable: {p.reason}")
            continue
        ratio = p.expected_ms / best.expected_ms
        mark = "  <- the shortest: written" if p is best else f"  {ratio:.2f}x as long"
        bound = f", at least {p.busy_ms / p.cores:9.2f} ms on {p.cores} cores" if shared else ""
        print(f"  {p.label:24} {p.best.makespan_ms:9.2f} ms ({p.best.solution.status}){bound}"
              f"{mark}")
    print(f"{best.label}: the best partitions and even splits, solved:")
    return list(best.plans), best.shape


def _cores() -> int:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _profile(profile_units, model, inputs, targets, loss, args, measured):
    """Profile with a progress bar on a terminal (rich), quietly otherwise."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device cuda, but torch sees no GPU", hint="measure with --device cpu")
    options = dict(optimizer=args.optimizer, repeats=args.repeats, measured=measured,
                   device=torch.device("cuda", 0) if args.device == "cuda" else
                   torch.device("cpu"))
    if not sys.stderr.isatty():
        return profile_units(model, inputs, targets, loss, **options)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("profiling units", total=None)
        return profile_units(model, inputs, targets, loss, **options,
                             progress=lambda done, total: bar.update(task, completed=done,
                                                                     total=total))
