"""`pyplan partition FACTORY --data DATA --loss LOSS --devices D -o PLAN`: from a PyTorch model
to a solved plan. Profile the model's units on one micro-batch, cut them into stages by exact
dynamic programming (least bottleneck within the memory), solve the best few partitions and
write the plan of the one with the shortest makespan."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from pyplan.options.numbers import SEED, whole
from pyplan.cli._torch import require_torch
from pyplan.cli.profile import MAX_REPEATS, add_time_limit, check_time_limit
from pyplan.cli.run import DTYPES
from pyplan.errors import PlanError
from pyplan.files import write_atomic
from pyplan.options.choices import optimizer
from pyplan.planfile import parse_memory
from pyplan.planfile.plan import MAX_DEVICES, MAX_MICRO_BATCHES

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", metavar="FACTORY",
                        help="pkg.mod:fn returning the whole nn.Module (its children, "
                        "nn.Sequential / nn.ModuleList flattened, are the units)")
    parser.add_argument("--data", required=True, metavar="PKG.MOD:FN",
                        help="fn(step) -> (inputs, targets), the global batch")
    parser.add_argument("--loss", required=True, metavar="PKG.MOD:FN",
                        help="fn(output, targets) -> a scalar mean loss")
    parser.add_argument("--devices", type=whole(1, MAX_DEVICES), required=True, metavar="D",
                        help="devices (pipeline ranks) to cut the model for")
    parser.add_argument("--shape", choices=("vshape", "interleaved", "mshape", "graph", "auto"),
                        default=None,
                        help="vshape: stage s on device s; interleaved: stage s on device s "
                        "mod D, --chunks stages per device; mshape: the token embedding and "
                        "the head on all devices, sharded over the vocabulary, one stage per "
                        "device between them; graph: stages forming a DAG that follows the "
                        "model's parallel branches, one per device; auto: solve every placement "
                        "that applies and write the shortest (default: vshape, or graph when "
                        "the model has parallel branches and its makespan is shorter)")
    parser.add_argument("--chunks", type=whole(1, MAX_DEVICES), metavar="C",
                        help="stages per device with --shape interleaved (default 2)")
    parser.add_argument("--micro-batches", type=whole(1, MAX_MICRO_BATCHES), metavar="N",
                        help="micro-batches per iteration (default 2 x stages)")
    parser.add_argument("--memory", metavar="SIZE", help="memory per device, e.g. 24GiB, or "
                        "one per device, e.g. 80GiB,80GiB,40GiB,40GiB (default: unlimited)")
    parser.add_argument("--host-memory", metavar="SIZE", help="the host memory of the machine "
                        "the CPU ranks share, e.g. 16GiB: each of the --devices ranks gets its "
                        "share, less what a process holds before the model (Python, torch), "
                        "for its stages' parameters, gradients, optimizer state and activations "
                        "(default: unlimited; partition warns past this machine's)")
    parser.add_argument("--speeds", metavar="S,S,...", help="each device's speed relative to "
                        "the one measuring, e.g. 1,1,0.5,0.5 (mixed GPU types: slower devices "
                        "get fewer units)")
    parser.add_argument("--recompute", choices=("never", "always", "auto"), default="never",
                        help="activation recomputation written to the plan (training.recompute; "
                        "auto: pyplan solve chooses per stage); default never")
    parser.add_argument("--optimizer", type=optimizer, default="sgd", metavar="{sgd,adamw}",
                        help="sgd (default) or adamw, the optimizer pyplan run will train with "
                        "(its --optimizer): its "
                        "state counts in the weights' memory, its step's temporaries and time "
                        "are measured")
    parser.add_argument("--repeats", type=whole(1, MAX_REPEATS), default=5, metavar="K",
                        help="timed runs per unit and direction; the median counts")
    add_time_limit(parser, "unit")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of weights and data")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="measure the units on this device (cuda: the first GPU, timed "
                        "with CUDA events)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="measure the forwards under autocast to this dtype, as pyplan run "
                        "--dtype runs them (default fp32)")
    parser.add_argument("--split-backward", action="store_true",
                        help="measure each unit's input and weight gradients apart and write "
                        "a split backward (zero bubble: the plan's blocks get B and W)")
    parser.add_argument("--links", action="store_true",
                        help="measure the link between two processes on this machine (as "
                        "profile --links) and time the stages' outputs on it (default: on "
                        "--device cpu pyplan's CPU-class gloo link, on cuda a GPU node's)")
    parser.add_argument("--weights", metavar="DIR",
                        help="a safetensors checkpoint folder (save_pretrained) the parameters "
                        "start from: measured with them, and named in the plan (model.weights)")
    parser.add_argument("--tensor", type=whole(1, 1024), default=1, metavar="T",
                        help="plan a mesh of T tensor-parallel GPUs per device (mesh.tensor, "
                        "sequence-parallel): each unit priced as one of T ranks runs it, with "
                        "pyplan plan's cost model (a Hugging Face model)")
    parser.add_argument("--no-sequence-parallel", action="store_true",
                        help="with --tensor: keep the activations between the tensor-parallel "
                        "regions whole (mesh.sequence: false)")
    parser.add_argument("-o", "--output", required=True, metavar="PLAN",
                        help="where to write the plan (then pyplan solve PLAN)")


def _options(args: argparse.Namespace):
    """(stages, micro-batches, memory in bytes: one amount or one per device, speeds)."""
    if args.tensor > 1 and args.shape is None:
        args.shape = "vshape"
    if args.chunks is not None and args.shape not in ("interleaved", "auto"):
        raise PlanError(f"--chunks does nothing with --shape {args.shape or 'vshape'}",
                        hint="give --shape interleaved (or auto), or leave --chunks out")
    if args.no_sequence_parallel and args.tensor == 1:
        raise PlanError("--no-sequence-parallel does nothing without --tensor",
                        hint="give --tensor T, or leave --no-sequence-parallel out")
    if args.tensor > 1 and args.shape not in ("vshape", "interleaved"):
        raise PlanError(f"--tensor does not combine with --shape {args.shape} (its blocks on "
                        "every device)", hint="give --shape vshape or interleaved")
    args.chunks = 2 if args.chunks is None else args.chunks
    check_time_limit(args.unit_time_limit, "--unit-time-limit")
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
    if args.shape in ("mshape", "graph", "auto") and (isinstance(memory, list) or speeds):
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


def _size(text: str, option: str = "--memory") -> int:
    try:
        amount, is_size = parse_memory(text)
    except ValueError as exc:
        raise PlanError(f"{option}: {exc}") from None
    if not is_size or amount <= 0:
        raise PlanError(f"{option} must be a positive size such as 24GiB")
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
    host = None if args.host_memory is None else _size(args.host_memory, "--host-memory")
    require_torch("partition")
    from pyplan.measure.limits import users_code
    from pyplan.measure.partitioner import partition_model

    out = Path(args.output)
    with users_code("partition"):
        found = _measured(lambda progress: partition_model(
            args.factory, args.data, args.loss, devices=args.devices, output=out,
            shape=args.shape, chunks=args.chunks, micro_batches=n, memory=memory,
            speeds=speeds, recompute=args.recompute, optimizer=args.optimizer,
            split_backward=args.split_backward, weights=args.weights, repeats=args.repeats,
            dtype=args.dtype, seed=args.seed, device=args.device, links=args.links,
            progress=progress, unit_seconds=args.unit_time_limit, host_memory=host,
            tensor=args.tensor, sequence_parallel=not args.no_sequence_parallel))
    units, plans = found.units, found.plans
    how = {"chain": "", "traced": "cut by torch's pipeline tracer, ",
           "forward": "cut in the model's own forward, "}[found.cut.kind]
    if found.tried:
        _print_placements(found, args, n, f"{how}measured")
        print(f"  chosen: {found.why}")
        print(f"{found.tried[0].label}: the best partitions and even splits, solved:")
    else:
        print(f"{args.factory}: {len(units)} units ({how}measured), {stages} stages "
              f"({found.shape}), {n} micro-batches; the best partitions and even splits, "
              "solved:")
    for line in found.about_sharded:
        print(line)
    for plan in sorted(plans, key=lambda c: c.partition.bottleneck_ms):
        p = plan.partition
        cut_text = _stages_text(units, p)
        print(f"  bottleneck {p.bottleneck_ms:8.2f} ms  makespan {plan.makespan_ms:9.2f} ms "
              f"({plan.solution.status})  {cut_text}")
    for line in found.warnings:
        print(f"warning: {line}", file=sys.stderr)
    if found.sharded is not None:
        print(f"  sharded over the vocabulary on all {args.devices} devices: "
              f"{found.sharded.vocab[0]} (block embed) and {found.sharded.vocab[1]} (block head)")
    if found.link is not None:
        print(f"  link between two processes here, measured: "
              f"{found.link.bandwidth / 1e9:.2f} GB/s, latency {found.link.latency_ms:.3f} ms "
              "(topology.within_node)")
    for parameter, holders in found.ties:
        print(f"  tied: {parameter} is held by {', '.join(holders)}; pyplan run sums its "
              "gradients over the copies (one all-reduce per iteration, after the backward)")
    if found.host:
        print("  planned host memory per rank (its tensors at their peak and "
              f"{found.baseline / 2**30:.2f} GiB of Python and torch): " + "  ".join(
                  f"{r}: {b / 2**30:.2f} GiB" for r, b in enumerate(found.host)))
    write_atomic(out, plans[0].text)
    print(f"wrote {out}: the partition with the shortest makespan; next: pyplan solve {out}")
    return 0


def _stages_text(units, p) -> str:
    """A partition's stages: first..last unit of each run; a DAG's with what each reads."""
    if not hasattr(p, "preds"):
        return " | ".join(f"{units[p.bounds[s]].name}..{units[p.bounds[s + 1] - 1].name}"
                          for s in range(p.num_stages))
    out = []
    for s, members in enumerate(p.stages):
        runs, start = [], members[0]
        for a, b in zip(members, members[1:] + (None,)):
            if b != a + 1:
                runs.append(units[start].name if a == start else
                            f"{units[start].name}..{units[a].name}")
                start = b
        reads = f" <- {','.join(map(str, p.preds[s]))}" if p.preds[s] else ""
        out.append(f"{s}: {' + '.join(runs)}{reads}")
    return f"depth {p.depth}: " + " | ".join(out)


def _print_placements(found, args, n: int, how: str) -> None:
    """--shape auto: every placement solved, the shortest first."""
    tried = found.tried
    best = tried[0]
    shared = best.cores is not None
    print(f"{args.factory}: {len(found.units)} units ({how}), {args.devices} devices, "
          f"{n} micro-batches; placements solved with the measured costs (predicted makespan"
          + (f"; the {args.devices} ranks share {best.cores} CPU cores here, so an iteration "
             f"takes at least its compute / {best.cores}" if shared else "") + "):")
    for p in tried:
        if p.best is None:
            print(f"  {p.label:24} not applicable: {p.reason}")
            continue
        ratio = p.expected_ms / best.expected_ms
        mark = "  <- the shortest: written" if p is best else f"  {ratio:.2f}x as long"
        bound = f", at least {p.busy_ms / p.cores:9.2f} ms on {p.cores} cores" if shared else ""
        print(f"  {p.label:24} {p.best.makespan_ms:9.2f} ms ({p.best.solution.status}){bound}"
              f"{mark}")


def _measured(partition):
    """partition(progress) with a progress bar on a terminal (rich), quietly otherwise."""
    if not sys.stderr.isatty():
        return partition(None)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("profiling units", total=None)
        return partition(lambda done, total: bar.update(task, completed=done, total=total))
