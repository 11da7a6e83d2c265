"""`pyplan profile PLAN`: measure the plan's blocks on this machine and suggest their costs."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pyplan.options.numbers import SEED
from pyplan.cli._torch import require_torch
from pyplan.cli.run import DTYPES
from pyplan.errors import PlanError
from pyplan.problem import load_problem
from pyplan.planfile import format_memory
from pyplan.planfile.plan import MAX_TIME

__all__ = ["MAX_REPEATS", "TIME_LIMIT", "add_arguments", "add_time_limit", "check_time_limit",
           "run", "suggestions"]

MAX_REPEATS = 1000  # timed runs per measurement (8x that when they spread): bounded time
TIME_LIMIT = 300.0  # pyplan.measure.limits.DEFAULT_SECONDS, spelled here so that the CLI parses
#                    without importing torch (tests/test_run_cli.py checks they agree)
MAX_LIMIT = 1e6       # seconds: past this a limit is no bound (and past float's exact range)
MIN_UNIT_MS, MAX_UNIT_MS = 1e-6, 1e6  # topology.time_unit_ms's range (schemas/plan.schema.json)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="plan file with a model: section")
    parser.add_argument("--repeats", type=int, default=5, metavar="K",
                        help="timed runs per block and direction; the median counts (default 5)")
    parser.add_argument("--unit-ms", type=float, metavar="MS",
                        help="milliseconds per time unit of the suggested costs (default: the "
                        "fastest forward block)")
    add_time_limit(parser, "block")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of weights and data")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="measure on this device (cuda: the first GPU, timed with CUDA "
                        "events)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="measure the forwards under autocast to this dtype, as pyplan run "
                        "--dtype runs them (default fp32)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.add_argument("--links", action="store_true",
                        help="also measure the link between two processes on this machine "
                        "(ping-pong over gloo) and suggest topology.within_node, and the "
                        "all-reduces of vocabulary-sharded blocks among as many processes as "
                        "they have devices")


def suggestions(problem, costs, unit_ms: float) -> list[str]:
    """A `blocks:` snippet with measured costs: times in units of `unit_ms`, memory as sizes."""
    lines = ["blocks:"]
    previous = None
    for c in costs:
        index = problem.by_name[c.name]
        devices = "all" if len(c.devices) == problem.num_devices else \
            "[" + ", ".join(map(str, c.devices)) + "]"
        parents = [problem.blocks[a].name for a, b in problem.edges
                   if b == index and problem.blocks[a].is_forward]
        after = "" if parents == ([previous] if previous else []) else \
            ", after: [" + ", ".join(parents) + "]"
        previous = c.name
        entry = (f"  - {{name: {c.name}, devices: {devices}{after}, "
                 f"time: {max(1, round(c.forward_ms / unit_ms))}, "
                 f"memory: {format_memory(c.activation_bytes, True)}, "
                 f"output: {format_memory(c.output_bytes, True)}, "
                 f"recompute_memory: "
                 f"{format_memory(min(c.input_bytes, c.activation_bytes), True)}")
        if c.backward_ms is not None:
            entry += f", backward: {{time: {max(1, round(c.backward_ms / unit_ms))}}}"
        lines.append(entry + "}")
    return lines


def add_time_limit(parser: argparse.ArgumentParser, what: str) -> None:
    """--WHAT-time-limit S: the CPU seconds measuring one WHAT (a block, a unit) may take
    (`pyplan profile` and `pyplan partition`; check_time_limit checks it)."""
    parser.add_argument(f"--{what}-time-limit", type=float, default=TIME_LIMIT, metavar="S",
                        help=f"CPU seconds measuring one {what} may take (default "
                        f"{TIME_LIMIT:g}); a {what} computing nothing for S/30 s, at least "
                        "10 s (a sleep, a wait), is stopped too")


def check_time_limit(seconds: float, option: str) -> None:
    if not 0 < seconds <= MAX_LIMIT:  # also refuses nan
        raise PlanError(f"{option} must be a positive number of seconds up to {MAX_LIMIT:g}")


def _device(torch, name: str):
    """The device to measure on; PlanError when CUDA is asked for and there is none."""
    if name == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device cuda, but torch sees no GPU", hint="measure with --device cpu")
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.repeats <= MAX_REPEATS:
        raise PlanError(f"--repeats must lie in 1 .. {MAX_REPEATS}")
    if args.unit_ms is not None and not MIN_UNIT_MS <= args.unit_ms <= MAX_UNIT_MS:
        raise PlanError(f"--unit-ms must lie in {MIN_UNIT_MS:g} .. {MAX_UNIT_MS:g} "
                        "milliseconds (topology.time_unit_ms)")
    check_time_limit(args.block_time_limit, "--block-time-limit")
    problem = load_problem(args.plan)
    if problem.model is None:
        raise PlanError("the plan has no model: section, so there is nothing to measure",
                        hint="add model: {blocks: ..., data: ..., loss: ...}",
                        file=problem.source_path)
    require_torch("profile")
    from pyplan.run.binding import load_model  # torch only from here on
    from pyplan.measure.limits import users_code
    from pyplan.measure.profile import Measured, profile_blocks
    from pyplan.run.pipeline import DTYPES as COMPUTE

    import torch

    device = _device(torch, args.device)
    measured = Measured()
    with users_code("profile"):
        model = load_model(problem, Path(problem.source_path).resolve().parent)
        costs = profile_blocks(problem, model, seed=args.seed, repeats=args.repeats,
                               device=device, measured=measured,
                               measure_collectives=args.links,
                               unit_seconds=args.block_time_limit, dtype=COMPUTE[args.dtype])
    unit = args.unit_ms or max(MIN_UNIT_MS, min(c.forward_ms for c in costs))
    longest = max(max(c.forward_ms, c.backward_ms or 0.0) for c in costs)
    if longest / unit > MAX_TIME:  # the suggested times would be refused by the plan
        raise PlanError(f"a time unit of {unit:g} ms makes the longest block time "
                        f"({longest:g} ms) {longest / unit:,.0f} time units, more than the "
                        f"supported {MAX_TIME:,}",
                        hint=f"give --unit-ms {longest / MAX_TIME:.3g} or more")
    link = None
    if args.links:
        from pyplan.measure.links import measure_link
        link = measure_link(args.device)
    if args.json:
        extra = {} if link is None else {"link": {"bandwidth": link[0], "latency_ms": link[1]}}
        print(json.dumps({"unit_ms": unit, **extra, "warnings": measured.warnings, "blocks": [
            {"name": c.name, "devices": list(c.devices), "forward_ms": c.forward_ms,
             "backward_ms": c.backward_ms, "activation_bytes": c.activation_bytes,
             "input_bytes": c.input_bytes, "output_bytes": c.output_bytes}
            for c in costs]}, sort_keys=True))
        return 0
    print(f"{problem.name}: one micro-batch per block, median of {args.repeats} runs"
          + ("" if args.dtype == "fp32" else f", forwards in {args.dtype} (autocast)"))
    print(f"  {'block':16} {'devices':>8} {'forward ms':>11} {'backward ms':>12} "
          f"{'activations':>12}")
    for c in costs:
        back = "-" if c.backward_ms is None else f"{c.backward_ms:.3f}"
        print(f"  {c.name:16} {len(c.devices):>8} {c.forward_ms:>11.3f} {back:>12} "
              f"{format_memory(c.activation_bytes, True):>12}")
    ratios = [c.backward_ms / c.forward_ms for c in costs if c.backward_ms and c.forward_ms]
    if ratios:
        print(f"  backward / forward: median {statistics.median(ratios):.2f} "
              "(training.backward.time_ratio)")
    if any(len(c.devices) > 1 for c in costs) and model.vocab is not None:
        print("  blocks on several devices: one rank's share of the vocabulary "
              "(model.vocab_parallel), their collectives " +
              ("measured among local processes" if args.links else "timed on the default link"))
    elif any(len(c.devices) > 1 for c in costs):
        print("  blocks on several devices are measured whole on one device; spread over their "
              "devices they take less time and memory each, plus communication")
    for line in measured.warnings:
        print(f"  warning: {line}")
    print(f"suggested costs (1 time unit = {unit:.3f} ms; memory in bytes, so every memory "
          "value of the plan becomes a size):")
    print("\n".join("  " + line for line in suggestions(problem, costs, unit)))
    print(f"  topology: {{time_unit_ms: {unit:.6g}"
          + ("" if link is None else
             f", within_node: {{bandwidth: {format_memory(link[0], True)}, "
             f"latency_ms: {link[1]:.4g}}}") + "}")
    return 0
