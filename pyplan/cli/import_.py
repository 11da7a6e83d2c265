"""`pyplan import torch-csv FILE --plan PLAN`: evaluate another tool's schedule with pyplan's
cost model (the plan's block times and memory, the core's evaluation), beside a searched one."""

from __future__ import annotations

import argparse
import json

from pyplan.cli._schedule import load_plan
from pyplan.errors import PlanError, did_you_mean
from pyplan.export.torch_csv import read_torch_csv, torch_stages
from pyplan.problem.schedule import Evaluated, schedule_from_orders

__all__ = ["FORMATS", "add_arguments", "run", "summary_json", "summary_text"]

FORMATS = ("torch-csv",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("format", metavar="FORMAT",
                        help="torch-csv: a torch.distributed.pipelining schedule CSV")
    parser.add_argument("file", metavar="FILE", help="the schedule to read")
    parser.add_argument("--plan", required=True, metavar="PLAN",
                        help="plan or resolved plan giving the blocks' costs and memory; a "
                             "resolved plan's schedule is compared too")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with the results instead of the summary")


def _compare(resolved, n: int):
    """The resolved plan's schedule at the imported number of micro-batches, or None."""
    if resolved is None:
        return None
    if n == resolved.problem.num_micro_batches:
        return resolved.schedule
    try:
        return resolved.expand(n)
    except PlanError:
        return None


def summary_json(args, result: Evaluated, searched) -> dict:
    schedule = result.schedule
    problem = schedule.problem
    return {
        "file": args.file,
        "plan": args.plan,
        "micro_batches": problem.num_micro_batches,
        "stages": len(torch_stages(problem)),
        "makespan": schedule.makespan,
        "bubble_rate": schedule.bubble_rate,
        "peak_memory": list(schedule.peak_memory),
        "memory_capacity": problem.memory_capacity,
        "fits_memory": result.fits_memory,
        "follows_order_rules": result.follows_rules,
        "searched": None if searched is None else {
            "makespan": searched.makespan, "bubble_rate": searched.bubble_rate,
            "peak_memory": list(searched.peak_memory)},
    }


def summary_text(args, result: Evaluated, searched, resolved) -> str:
    schedule = result.schedule
    problem = schedule.problem
    show = problem.show_memory
    lines = [f"{args.file}: {problem.num_micro_batches} micro-batches on {problem.num_devices} "
             f"devices as {len(torch_stages(problem))} torch stages, costs from {problem.name}: "
             f"makespan {schedule.makespan}, bubble {schedule.bubble_rate:.1%}"]
    capacity = "" if not problem.limited else f" (capacity {problem.show_capacity()})"
    lines.append("  peak memory: " + " ".join(show(x) for x in schedule.peak_memory) + capacity)
    if not result.fits_memory:
        worst = max(range(problem.num_devices), key=lambda d: schedule.peak_memory[d])
        lines.append(f"  exceeds the memory capacity: device {worst} reaches "
                     f"{show(schedule.peak_memory[worst])}")
    if result.follows_rules is not None:
        lines.append("  follows the plan's order rules" if result.follows_rules else
                     "  breaks the plan's order rules (evaluated as written)")
    if searched is not None:
        lines.append(f"  searched schedule ({resolved.path}): makespan {searched.makespan}, "
                     f"bubble {searched.bubble_rate:.1%}; this one takes "
                     f"{schedule.makespan / searched.makespan:.2f}x as long")
    elif resolved is not None:
        lines.append(f"  the searched schedule ({resolved.path}) does not extend to "
                     f"{problem.num_micro_batches} micro-batches")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise PlanError(f"unknown import format '{args.format}'",
                        hint=did_you_mean(args.format, FORMATS) or "the format is torch-csv")
    problem, resolved = load_plan(args.plan)
    imported = read_torch_csv(args.file, problem)
    result = schedule_from_orders(problem, imported.orders, imported.num_micro_batches,
                                  file=args.file, where=imported.where)
    searched = _compare(resolved, imported.num_micro_batches)
    if args.json:
        print(json.dumps(summary_json(args, result, searched), sort_keys=True))
    else:
        print(summary_text(args, result, searched, resolved))
    return 0
