"""`pyplan validate PLAN...`: check plans and resolved plans; one summary line per valid file,
errors on stderr. A resolved plan is re-evaluated in the core and checked against its plan."""

from __future__ import annotations

import argparse
import sys

from pyplan.lower.runnable import check_model
from pyplan.errors import EXIT_BAD_INPUT, PlanError
from pyplan.problem import Problem, load_problem
from pyplan.resolved import is_resolved, load_resolved
from pyplan.planfile.units import count

__all__ = ["add_arguments", "run", "summary"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plans", nargs="+", metavar="PLAN", help="plan files (YAML)")


def summary(problem: Problem) -> str:
    kinds: dict[str, int] = {}
    for block in problem.blocks:
        kinds[block.kind] = kinds.get(block.kind, 0) + 1
    parts = ", ".join(f"{n} {k}" for k, n in kinds.items())
    loads = " ".join(str(x) for x in problem.device_loads())
    task = "training" if problem.training else "inference"
    rules = f", {len(problem.rules)} order rules" if problem.rules else ""
    mesh = problem.mesh
    replicas = "".join(f" x {n} {what}" for n, what in (
        (mesh.replicas, "data-parallel replicas"), (mesh.shards, "shards"),
        (mesh.tensor, "tensor ranks")) if n > 1)
    speeds = f", speeds [{problem.show_speeds()}]" if problem.show_speeds() else ""
    resident = " ".join(map(problem.show_memory, problem.static_memory))
    weights = f", weights per device [{resident}]" if any(problem.static_memory) else ""
    costs = ""
    if problem.transfer:
        costs += (f", transfers on {len(problem.transfer)} dependencies "
                  f"({problem.show_transfers()} units)")
    modes = [b.recompute for b in problem.blocks if b.recompute != "never"]
    for mode in ("always", "auto"):
        costs += f", recompute {mode} on {count(modes.count(mode), 'block')}" \
            if mode in modes else ""
    return (f"{problem.name}: {task}, {count(len(problem.blocks), 'block')} ({parts}) on "
            f"{count(problem.num_devices, 'device')}{replicas}, "
            f"{count(problem.num_micro_batches, 'micro-batch')}, "
            f"memory {problem.show_capacity()}{speeds}{weights}{rules}{costs}; "
            f"load per device [{loads}], repetend period >= {problem.load_bound()}")


def run(args: argparse.Namespace) -> int:
    status = 0
    for path in args.plans:
        try:
            if is_resolved(path):
                resolved = load_resolved(path)
                resolved.check_fresh()
                line = (f"resolved plan of {resolved.problem.name}, makespan "
                        f"{resolved.schedule.makespan} ({resolved.status}), verified and fresh")
            else:
                problem = load_problem(path)
                check_model(problem)
                line = summary(problem)
        except PlanError as exc:
            sys.stderr.write(exc.report())
            status = EXIT_BAD_INPUT
            continue
        print(f"{path}: ok: {line}")
    return status
