"""`pyplan solve PLAN`: search a schedule, write PLAN.resolved.yaml, print a summary."""

from __future__ import annotations

import argparse
import json

from pyplan.cli._progress import live_progress
from pyplan.errors import PlanError
from pyplan.problem import load_problem
from pyplan.resolved import resolved_path, write_resolved
from pyplan.solve import Solution, solve
from pyplan.spec import parse_memory

__all__ = ["add_arguments", "run", "summary_json", "summary_text"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="plan file (YAML)")
    parser.add_argument("-o", "--output", metavar="OUT",
                        help="resolved plan to write (default: PLAN with .resolved.yaml)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with the results instead of the summary")
    parser.add_argument("--quiet", action="store_true", help="print nothing on success")
    parser.add_argument("--micro-batches", type=int, metavar="N",
                        help="override the plan's micro_batches")
    parser.add_argument("--memory", metavar="M",
                        help="override the plan's per-device memory (integer or size like 32GiB)")
    parser.add_argument("--time-limit", type=float, metavar="S",
                        help="override search.time_limit (seconds)")


def _overrides(args: argparse.Namespace, problem):
    memory = None
    if args.memory is not None:
        try:
            memory, is_size = parse_memory(int(args.memory) if args.memory.lstrip("-").isdigit()
                                           else args.memory)
        except ValueError:
            raise PlanError(f"--memory {args.memory!r} is not an amount",
                            hint="write an integer or a size like 32GiB") from None
        if memory <= 0:
            raise PlanError("--memory must be positive")
        if problem.memory_is_size != is_size and any(b.memory for b in problem.blocks):
            unit = "sizes like 32GiB" if problem.memory_is_size else "plain integers"
            raise PlanError(f"--memory must use the plan's unit: {unit}")
    if args.micro_batches is not None and args.micro_batches < 1:
        raise PlanError("--micro-batches must be at least 1")
    if args.time_limit is not None and args.time_limit <= 0:
        raise PlanError("--time-limit must be positive")
    return problem.with_overrides(micro_batches=args.micro_batches, memory=memory,
                                  time_limit=args.time_limit)


def summary_json(solution: Solution, output: str | None) -> dict:
    schedule = solution.schedule
    problem = schedule.problem
    rep = schedule.repetend
    repetend = None
    if rep is not None:
        start, end = schedule.repetend_window()
        repetend = {"micro_batches": rep.num_micro_batches, "period": rep.period,
                    "period_lower_bound": solution.period_bound,
                    "bubble_rate": rep.bubble_rate, "count": schedule.repetend_count,
                    "start": start, "end": end}
    return {
        "plan": problem.source_path,
        "output": output,
        "status": solution.status,
        "period_status": solution.period_status,
        "origin": solution.origin,
        "makespan": schedule.makespan,
        "gap": solution.gap,
        "lower_bound": solution.lower_bound,
        "bubble_rate": schedule.bubble_rate,
        "repetend": repetend,
        "peak_memory": list(schedule.peak_memory),
        "memory_capacity": problem.memory_capacity,
        "devices": problem.num_devices,
        "micro_batches": problem.num_micro_batches,
        "search_seconds": solution.search_seconds,
        "baselines": {name: ({"makespan": b.makespan, "bubble_rate": b.bubble_rate,
                              "fits_memory": b.fits_memory} if b.applicable
                             else "not applicable")
                      for name, b in solution.baselines.items()},
        "notes": list(solution.stats.notes),
    }


def summary_text(solution: Solution, output: str | None) -> str:
    schedule = solution.schedule
    problem = schedule.problem
    rep = schedule.repetend
    show = problem.show_memory
    if solution.status == "optimal":
        proof = ("meets the lower bound" if schedule.makespan <= solution.lower_bound
                 else f"proven by Z3; lower bound {solution.lower_bound}")
        quality = f"optimal ({proof})"
    else:
        quality = (f"lower bound {solution.lower_bound}, gap {solution.gap:.1%}, not proven "
                   "optimal" + (" (time limit)" if solution.status == "time_limit" else ""))
    origin = "" if solution.origin == "search" else f" (the {solution.origin} template)"
    lines = [f"{problem.name}: {problem.num_micro_batches} micro-batches on "
             f"{problem.num_devices} devices: makespan {schedule.makespan}{origin}, {quality}; "
             f"bubble {schedule.bubble_rate:.1%}"]
    if rep is not None:
        start, end = schedule.repetend_window()
        period = ("proven minimal" if solution.period_status == "optimal"
                  else "not proven minimal")
        lines.append(f"  repetend: {rep.num_micro_batches} micro-batches, period {rep.period} "
                     f"(bound {solution.period_bound}, {period}), bubble {rep.bubble_rate:.1%}, "
                     f"repeated {schedule.repetend_count}x from t={start} to t={end}")
    elif solution.origin == "search":
        lines.append("  no repetend: the whole schedule was searched at once")
    lines.append("  peak memory: " + " ".join(show(x) for x in schedule.peak_memory)
                 + f" (capacity {show(problem.memory_capacity)})")
    for note in solution.stats.notes:
        lines.append(f"  {note}")
    lines.append(f"  searched in {solution.search_seconds:.2f} s"
                 + (f"; wrote {output}" if output else ""))
    lines.append("  baselines on the same placement:")
    for name, base in solution.baselines.items():
        if not base.applicable:
            lines.append(f"    {name:17} not applicable: {base.reason}")
            continue
        note = "" if base.fits_memory else \
            f"  exceeds memory (peak {show(max(base.peak_memory))})"
        lines.append(f"    {name:17} makespan {base.makespan:<6} bubble {base.bubble_rate:6.1%}"
                     f"{note}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    problem = _overrides(args, load_problem(args.plan))
    with live_progress(not (args.quiet or args.json)) as progress:
        solution = solve(problem, progress=progress)
    output = args.output or str(resolved_path(args.plan))
    write_resolved(solution, output)
    if args.json:
        print(json.dumps(summary_json(solution, output), sort_keys=True))
    elif not args.quiet:
        print(summary_text(solution, output))
    return 0
