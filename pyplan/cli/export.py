"""`pyplan export PLAN|RESOLVED --format FORMAT -o FILE`: the schedule as a picture, a
Chrome/Perfetto trace or torch.distributed.pipelining's schedule CSV; the plan's layout as
torchtitan's configuration, Megatron-LM's layout string or its pretrain_gpt.py arguments."""

from __future__ import annotations

import argparse
import json
import sys

from pyplan.cli._schedule import load_plan, pick_schedule
from pyplan.errors import PlanError, did_you_mean
from pyplan.export import FORMATS as EXPORTS
from pyplan.export.chrome import schedule_trace
from pyplan.export.svg import render_svg
from pyplan.export.torch_csv import render_torch_csv, torch_stages
from pyplan.export.trainers import (MEGATRON_CORE, MEGATRON_LM, TORCHTITAN,
                                    megatron_arguments, megatron_layout,
                                    torchtitan_config)
from pyplan.options.outputs import check_outputs
from pyplan.files import write_atomic
from pyplan.problem.schedule import Schedule
from pyplan.planfile.units import count
from pyplan.solver.templates import template_schedule

__all__ = ["FORMATS", "add_arguments", "run"]


def _chrome(schedule: Schedule) -> str:
    return json.dumps(schedule_trace(schedule), separators=(",", ":")) + "\n"


FORMATS = {"svg": render_svg, "chrome": _chrome, "torch-csv": render_torch_csv}
# Formats of the plan's layout (no schedule needed): (export, the client it is for).
LAYOUTS = {"megatron-layout": (lambda problem, template: megatron_layout(problem),
                               f"megatron-core {MEGATRON_CORE}"),
           "megatron-args": (megatron_arguments, f"Megatron-LM {MEGATRON_LM}"),
           "torchtitan": (torchtitan_config, f"torchtitan {TORCHTITAN}")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="RESOLVED",
                        help="resolved plan (a plan is solved in memory first)")
    described = [f"{name} ({what})" for name, what in EXPORTS.items()]
    parser.add_argument("--format", required=True, metavar="FORMAT",
                        help=", ".join(described[:-1]) + " or " + described[-1])
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="file to write, '-' for standard output")
    parser.add_argument("--template", metavar="NAME",
                        help="export a hand-written schedule (gpipe, 1f1b, ...) on the plan's "
                             "placement instead (torchtitan, megatron-args: name it as the "
                             "schedule to run)")


def run(args: argparse.Namespace) -> int:
    render = FORMATS.get(args.format)
    if render is None and args.format not in LAYOUTS:
        names = [*FORMATS, *LAYOUTS]
        raise PlanError(f"unknown export format '{args.format}'",
                        hint=did_you_mean(args.format, names) or f"choose {', '.join(names)}")
    problem, resolved = load_plan(args.plan)
    if args.output != "-":
        check_outputs({"-o": (args.output, "file")},
                      [args.plan, resolved and resolved.plan_path])
    if args.format in LAYOUTS:
        export, client = LAYOUTS[args.format]
        if args.template is not None:
            template_schedule(problem, args.template)  # the template fits the plan
        text = export(problem, args.template)
        if args.output == "-":
            sys.stdout.write(text)
        else:
            write_atomic(args.output, text)
            print(f"wrote {args.output}: {args.format}, {problem.name}, for {client}")
        return 0
    if args.format == "torch-csv":
        torch_stages(problem)  # fail before solving when torch cannot run this placement
    schedule = pick_schedule(problem, resolved, args.template)
    text = render(schedule)
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    write_atomic(args.output, text)
    problem = schedule.problem
    what = (f"{count(problem.num_micro_batches, 'micro-batch')} on "
            f"{count(problem.num_devices, 'device')}")
    if args.format == "torch-csv":
        what += f" as {len(torch_stages(problem))} torch stages"
    print(f"wrote {args.output}: {args.format}, {what}, makespan {schedule.makespan}")
    return 0
