"""`pyplan show PLAN|RESOLVED`: the schedule as a timeline in the terminal."""

from __future__ import annotations

import argparse
import shutil
import sys

from pyplan.api import with_overrides
from pyplan.cli._schedule import load_plan, pick_schedule
from pyplan.errors import PlanError
from pyplan.export.timeline import render_plain, render_rich, timeline

__all__ = ["add_arguments", "run"]

PIPED_WIDTH = 100  # fixed when not on a terminal, so saved output does not depend on one
MAX_WIDTH = 10_000  # wider is unreadable, and a line that never wraps elides nothing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN|RESOLVED",
                        help="resolved plan, or a plan (solved in memory first)")
    parser.add_argument("--template", metavar="NAME",
                        help="show a hand-written schedule (gpipe, 1f1b, ...) on the plan's "
                             "placement instead")
    parser.add_argument("--width", type=int, metavar="COLUMNS",
                        help=f"wrap at this width (default: the terminal's, {PIPED_WIDTH} when "
                             "piped)")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="colour the blocks (default: only on a terminal)")
    parser.add_argument("--full", action="store_true",
                        help="draw every step instead of eliding repeated steady-state periods")
    parser.add_argument("--micro-batches", type=int, metavar="N",
                        help="draw the schedule for N micro-batches (a resolved plan's extended "
                             "or shortened, a plan's solved for N)")


def run(args: argparse.Namespace) -> int:
    if args.width is not None and not 20 <= args.width <= MAX_WIDTH:
        raise PlanError(f"--width {args.width} is too " + ("narrow" if args.width < 20 else
                                                          "wide"),
                        hint=f"use 20 to {MAX_WIDTH:,} columns (--full draws every step)")
    problem, resolved = load_plan(args.plan)
    if args.micro_batches is None:
        schedule = pick_schedule(problem, resolved, args.template)
    elif resolved is not None and args.template is None:
        with_overrides(problem, micro_batches=args.micro_batches)  # (checks N)
        schedule = resolved.expand(args.micro_batches)
    else:
        problem = with_overrides(problem, micro_batches=args.micro_batches)
        schedule = pick_schedule(problem, None, args.template)
    tty = sys.stdout.isatty()
    width = args.width or (min(MAX_WIDTH, shutil.get_terminal_size((PIPED_WIDTH, 24)).columns)
                           if tty else PIPED_WIDTH)
    lines = timeline(schedule, width=width, compress=not args.full)
    if args.color == "always" or (args.color == "auto" and tty):
        from rich.console import Console

        console = Console(file=sys.stdout, force_terminal=True, highlight=False, soft_wrap=True,
                          color_system="standard" if args.color == "always" else "auto")
        console.print(render_rich(lines))
    else:
        sys.stdout.write(render_plain(lines))
    return 0
