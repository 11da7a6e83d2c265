"""Resolved plans: the compact, canonical, diffable output of `pyplan solve`.

A resolved plan records the blocks of one micro-batch and their dependencies, then the schedule
as each device's order, in three parts: warmup, one repetition of the repetend (repeated
N - N_R + 1 times, micro-batches and times advancing each time) and cooldown, whose micro-batches
count from the end (@-1 is the last). Every entry reads "block@micro-batch start". Orders are
the schedule; reading a resolved plan re-evaluates them in the core and checks the recorded
times, so hand edits that break the schedule are caught.

The writer is pyplan.resolved.writer, the reader pyplan.resolved.reader and the seal that
catches edits pyplan.resolved.seal; this module holds the plan as read and where it lives.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from pyplan import _core
from pyplan.resolved.derived import compare_with_plan
from pyplan.resolved.reader import Reader, check_recorded
from pyplan.resolved.writer import FORMAT, render_resolved, write_resolved
from pyplan.errors import PlanError
from pyplan.files import read_capped
from pyplan.problem.ir import Problem
from pyplan.problem.schedule import Schedule, build_schedule, repetend_from_core
from pyplan.planfile.source import MAX_FILE_BYTES

__all__ = ["FORMAT", "ResolvedPlan", "is_resolved", "load_resolved", "render_resolved",
           "resolved_path", "write_resolved"]

_RESOLVED = re.compile(rb"^pyplan_resolved:", re.MULTILINE)


def resolved_path(plan_path: str | Path) -> Path:
    """plans/x.yaml -> plans/x.resolved.yaml"""
    path = Path(plan_path)
    stem = path.name[:-5] if path.name.endswith(".yaml") else path.name
    return path.with_name(f"{stem}.resolved.yaml")


@dataclass(frozen=True)
class ResolvedPlan:
    path: str
    plan: str | None
    """The plan file, relative to the resolved plan."""
    spec_sha256: str
    problem: Problem
    schedule: Schedule
    status: str
    lower_bound: int
    period_bound: int
    baselines: dict = field(default_factory=dict)

    @property
    def plan_path(self) -> Path | None:
        return None if self.plan is None else Path(self.path).parent / self.plan

    def check_fresh(self) -> None:
        """Raise PlanError when the plan changed (or vanished) since it was solved."""
        plan = self.plan_path
        if plan is None:
            return
        try:
            # (a plan is at most MAX_FILE_BYTES: read no more)
            digest = hashlib.sha256(read_capped(plan, MAX_FILE_BYTES + 1)).hexdigest()
        except (OSError, ValueError):
            raise PlanError(f"the plan it was solved from, {plan}, cannot be read",
                            hint="keep the plan beside its resolved plan", file=self.path) \
                from None
        if digest != self.spec_sha256:
            raise PlanError(f"stale: {plan} changed since this plan was resolved",
                            hint=f"re-run pyplan solve {plan}", file=self.path)

    def expand(self, num_micro_batches: int) -> Schedule:
        """The same warmup, repetend and cooldown for another number of micro-batches."""
        rep = self.schedule.repetend
        if rep is None or num_micro_batches < rep.num_micro_batches:
            need = rep.num_micro_batches if rep else self.problem.num_micro_batches
            raise PlanError(f"this schedule extends to {need} or more micro-batches only",
                            hint="re-run pyplan solve --micro-batches N", file=self.path)
        problem = self.problem.with_overrides(micro_batches=num_micro_batches)
        return build_schedule(problem, self.schedule.warmup, rep, self.schedule.cooldown)


def is_resolved(path: str | Path) -> bool:
    """Whether the file is a resolved plan (unreadable files are left to the plan loader)."""
    try:
        # (the marker is near the top; never read a whole file)
        return _RESOLVED.search(read_capped(path, 4096)) is not None
    except (OSError, ValueError):
        return False


def load_resolved(path: str | Path) -> ResolvedPlan:
    """Read a resolved plan, rebuild and re-verify its schedule in the core."""
    reader = Reader(path)
    problem = reader.problem()
    n = problem.num_micro_batches
    doc = reader.doc
    plan = doc.get("plan")
    if plan is not None and (not isinstance(plan, str) or "\0" in plan or not plan):
        raise reader.fail(("plan",), "'plan' must be the plan file's path (or null)")
    if plan is not None:  # the plan file present and fresh: what it determines, compared
        fresh_plan = Path(str(path)).parent / plan
        try:
            fresh = hashlib.sha256(read_capped(fresh_plan, MAX_FILE_BYTES + 1)).hexdigest() \
                == problem.spec_sha256
        except (OSError, ValueError):
            fresh = False  # (check_fresh says so where it matters)
        if fresh:
            compare_with_plan(problem, fresh_plan, reader.source)
    rep_doc = doc.get("repetend")
    warmup = reader.entries(problem, "warmup", 0)
    repetend, cooldown = None, [[] for _ in range(problem.num_devices)]
    recorded = {(b, m): s for order in warmup for b, m, s in order}
    if rep_doc is not None:
        rep_orders = reader.entries(problem, "repetend", 0)
        indices = reader.get("indices", list, ("repetend",))
        if len(indices) != len(problem.blocks) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n
                for i in indices):
            raise reader.fail(("repetend", "indices"), "needs one index per block, each a "
                              f"micro-batch in 0 .. {n - 1}",
                              "the file was edited; re-run pyplan solve")
        nr = max(indices) + 1
        cooldown_abs = reader.entries(problem, "cooldown", n)
        cooldown = [[(b, m - (n - nr)) for b, m, _ in order] for order in cooldown_abs]
        recorded.update({(b, m): s for order in rep_orders for b, m, s in order})
        recorded.update({(b, m): s for order in cooldown_abs for b, m, s in order})
        try:
            core_rep = _core.evaluate_repetend(problem.graph, [int(i) for i in indices],
                                               [[b for b, _, _ in o] for o in rep_orders])
        except (ValueError, TypeError) as exc:
            raise reader.fail(("schedule", "repetend"), f"invalid repetend: {exc}") from None
        if not core_rep.feasible or core_rep.period != reader.get("period", int, ("repetend",)):
            raise reader.fail(("repetend", "period"), "the repetend does not run with this "
                              "period", "the file was edited; re-run pyplan solve")
        repetend = repetend_from_core(problem, core_rep)
    try:
        schedule = build_schedule(problem, [[(b, m) for b, m, _ in o] for o in warmup],
                                  repetend, cooldown)
    except (RuntimeError, ValueError, IndexError) as exc:
        raise reader.fail(("schedule",), f"the schedule does not run: {exc}",
                          "re-run pyplan solve") from None
    for (b, m), s in recorded.items():
        if schedule.start_of(b, m) != s:
            raise reader.fail(("schedule",), f"recorded start {s} of "
                              f"{problem.blocks[b].name}@{m} does not match its order "
                              f"({schedule.start_of(b, m)})",
                              "the file was edited; re-run pyplan solve")
    syncs = reader.get("gradient_syncs", dict) if "gradient_syncs" in doc else {}
    recorded_syncs = []
    for d, texts in syncs.items():
        if not isinstance(texts if texts is not None else [], list):
            raise reader.fail(("gradient_syncs", d), "gradient synchronisations are a list")
        recorded_syncs += [(d, *str(text).partition(" ")[::2]) for text in texts or []]
    computed = [(x.device, problem.blocks[x.layer].name, str(x.start)) for x in schedule.syncs]
    if recorded_syncs != computed:
        raise reader.fail(("gradient_syncs",), "the gradient synchronisations do not match the "
                          "schedule", "the file was edited; re-run pyplan solve")
    if schedule.makespan != doc.get("makespan"):
        raise reader.fail(("makespan",), "makespan does not match the schedule",
                          "the file was edited; re-run pyplan solve")
    status = reader.get("status", str)
    if status not in ("optimal", "feasible", "time_limit"):
        raise reader.fail(("status",), f"unknown status {status!r}",
                          "the file was edited; re-run pyplan solve")
    lower_bound = reader.get("lower_bound", int, low=0, high=schedule.makespan)
    period_bound = 0 if rep_doc is None else \
        reader.get("period_lower_bound", int, ("repetend",), low=0, high=repetend.period)
    check_recorded(reader, schedule)
    return ResolvedPlan(str(path), plan, problem.spec_sha256, problem, schedule, status,
                        lower_bound, period_bound, doc.get("baselines") or {})
