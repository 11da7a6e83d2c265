"""`pyplan solve PLAN`: search a schedule, write PLAN.resolved.yaml, print a summary."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys

from pyplan.api import Solution, load_plan, solve
from pyplan.cli._progress import live_progress
from pyplan.options.outputs import check_outputs
from pyplan.resolved import resolved_path
from pyplan.planfile.units import count

__all__ = ["add_arguments", "run", "summary_text"]


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
                        help="override search.time_limit: a hard cap in seconds")
    parser.add_argument("--effort", type=float, metavar="E",
                        help="override search.effort: how long the search goes on without "
                             "progress, relative to the work done (default 1)")


def _memory_argument(text: str | None) -> int | str | None:
    """--memory as the API takes it: an integer, or a size string."""
    if text is not None and text.lstrip("-").isdigit():
        return int(text)
    return text


def summary_text(solution: Solution, output: str | None) -> str:
    schedule = solution.schedule
    problem = schedule.problem
    rep = schedule.repetend
    show = problem.show_memory
    if solution.status == "optimal":
        proof = ("meets the lower bound" if schedule.makespan <= solution.lower_bound
                 else f"no shorter schedule exists; lower bound {solution.lower_bound}")
        quality = f"optimal ({proof})"
    else:
        quality = (f"lower bound {solution.lower_bound}, gap {solution.gap:.1%}, not proven "
                   "optimal" + (" (time limit)" if solution.status == "time_limit" else ""))
    origin = "" if solution.origin == "search" else f" (the {solution.origin} template)"
    lines = [f"{problem.name}: {count(problem.num_micro_batches, 'micro-batch')} on "
             f"{count(problem.num_devices, 'device')}: makespan {schedule.makespan}{origin}, "
             f"{quality}; "
             f"bubble {schedule.bubble_rate:.1%}"]
    if rep is not None:
        start, end = schedule.repetend_window()
        period = ("proven minimal" if solution.period_status == "optimal"
                  else "not proven minimal")
        lines.append(f"  repetend: {count(rep.num_micro_batches, 'micro-batch')}, "
                     f"period {rep.period} "
                     f"(bound {solution.period_bound}, {period}), bubble {rep.bubble_rate:.1%}, "
                     f"repeated {schedule.repetend_count}x from t={start} to t={end}")
    elif solution.origin == "search":
        lines.append("  no repetend: the whole schedule was searched at once")
    lines.append("  peak memory: " + " ".join(show(x) for x in schedule.peak_memory)
                 + f" (capacity {problem.show_capacity()})")
    if problem.show_speeds():
        lines.append(f"  device speeds: {problem.show_speeds()} (block times divided by them)")
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


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C ends the solve even where it lands inside Z3's object finalisers (which would
    swallow the KeyboardInterrupt and let the solve finish): it is remembered and re-raised."""
    interrupted = []

    def on_interrupt(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    def unraisable(info):
        if not isinstance(info.exc_value, KeyboardInterrupt):
            default(info)

    default, sys.unraisablehook = sys.unraisablehook, unraisable
    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:  # the quiet hook stays: what follows is teardown
        raise KeyboardInterrupt
    sys.unraisablehook = default


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    output = args.output or str(resolved_path(args.plan))
    check_outputs({"-o": (output, "file")}, [args.plan])
    with _interruptible(), live_progress(not (args.quiet or args.json)) as progress:
        solution = solve(plan, micro_batches=args.micro_batches,
                         memory=_memory_argument(args.memory), time_limit=args.time_limit,
                         effort=args.effort,
                         progress=progress)
    solution.write(output)
    if args.json:
        print(json.dumps(solution.to_json(output), sort_keys=True))
    elif not args.quiet:
        print(summary_text(solution, output))
    return 0
