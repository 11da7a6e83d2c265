"""A resolved plan against the plan it was solved from: everything the plan determines is
derived again and compared, so that a resolved plan whose plan file is present and fresh
cannot say anything else about the blocks, dependencies, transfers, order rules, recompute
modes, mesh, model or time unit (the seal covers the rest, and the plan file when it is gone).

What the solve may choose or override is taken from the resolved plan: the number of
micro-batches and the capacity (`--micro-batches`, `--memory`, which gives every device one
capacity, a plan's per-device memory too) and which `auto` blocks are
recomputed (each must be one the plan lets the solver choose, every `always` block among them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pyplan.problem import Problem, load_problem
from pyplan.planfile import MeshSpec
from pyplan.planfile.source import Source

__all__ = ["compare_with_plan"]

# Problem fields a resolved plan does not record (or may override); any other field, those
# added later included, must be what the plan gives.
_NOT_RECORDED = {"description", "search", "source_path", "spec_sha256", "by_name",
                 "num_micro_batches", "memory_capacity"}
# Where a Problem field sits in the resolved plan, for the error's position.
_FIELD = {"num_devices": "devices", "training": "task", "memory_is_size": "memory_unit",
          "edges": "dependencies", "transfers": "dependencies", "rules": "order_rules"}


def compare_with_plan(problem: Problem, plan: Path, source: Source) -> None:
    """PlanError at the resolved plan's field that the plan does not give."""
    hint = f"the file was edited; re-run pyplan solve {plan}"

    def fail(field: str, what: str):
        key = _FIELD.get(field, field)
        return source.error((key,) if key in source.data else (), f"'{key}' does not match "
                            f"the plan {plan}: {what}", hint, key=True)

    derived = load_problem(plan)
    if derived.mesh.data_parallel == 1 and derived.mesh.tensor == 1:  # (no mesh recorded)
        derived = dataclasses.replace(derived, mesh=MeshSpec())
    if [b.name for b in derived.blocks] != [b.name for b in problem.blocks]:
        raise fail("blocks", "other blocks")
    chosen = [b.index for b in problem.blocks if b.recomputed]
    for b in derived.blocks:
        if b.recomputed != (b.index in chosen) and (b.recomputed or b.recompute != "auto"):
            raise fail("blocks", f"'{b.name}' is recomputed {b.recompute}")
    derived = derived.with_recompute(chosen)
    for ours, theirs in zip(problem.blocks, derived.blocks):
        if theirs.recompute == "never":  # (what it would keep is not recorded: it never is)
            theirs = dataclasses.replace(theirs, recompute_memory=ours.recompute_memory)
        if ours != theirs:
            field = next(f.name for f in dataclasses.fields(ours)
                         if getattr(ours, f.name) != getattr(theirs, f.name))
            raise fail("blocks", f"'{ours.name}' has {field} {getattr(ours, field)!r}, the "
                       f"plan gives {getattr(theirs, field)!r}")
    if [r.text for r in problem.rules] != [r.text for r in derived.rules]:
        raise fail("rules", "other order rules")
    for f in dataclasses.fields(Problem):
        if f.name in _NOT_RECORDED or f.name in ("blocks", "rules"):
            continue
        ours, theirs = getattr(problem, f.name), getattr(derived, f.name)
        if f.name == "device_memory" and ours == ():  # `--memory`: one capacity for all
            continue
        if ours != theirs:
            what = repr(ours), repr(theirs)
            raise fail(f.name, f"{f.name} is {what[0]}, the plan gives {what[1]}"
                       if max(map(len, what)) <= 80 else f"other {f.name}")
