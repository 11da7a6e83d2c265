"""Schedule completion (Tessel IV-C): warmup and cooldown around the repeated repetend.

The periodic schedule (every repetition of the repetend, instances outside [0, N) dropped) is
always feasible and is the starting point. For the winning repetends only (lazy search), Z3
then finds time-optimal warmup (Eq. 5) and cooldown (Eq. 6) phases that meet the repetend as a
rigid periodic block (compaction at the boundaries, Fig. 6), under the memory the other phases
leave; the better composition wins, and its times are the earliest its orders allow. With fewer
micro-batches than the repetend spans there is no steady state: the whole problem is solved
time-optimally instead.
"""

from __future__ import annotations

from pyplan import _core
from pyplan.problem import Problem
from pyplan.schedule import Schedule, build_schedule, repetend_from_core
from pyplan.solver.budget import Budget
from pyplan.solver.exact import Anchor, time_optimal
from pyplan.spec.units import count

__all__ = ["EXACT_LIMIT", "PHASE_EFFORT", "WHOLE_LIMIT", "complete", "complete_whole",
           "exact_applies"]

EXACT_LIMIT = 160          # instances: above this the exact warmup/cooldown solve is skipped
WHOLE_LIMIT = 48           # instances: up to this the whole problem is also solved exactly
PHASE_EFFORT = 6_000_000   # Z3 resource units for one phase (about 0.4 s here)


def _split_periodic(problem: Problem, rep: _core.Repetend):
    """Warmup and cooldown (relative micro-batches) of the periodic schedule."""
    # The periodic order is the same in every repetition, so the phases of N micro-batches are
    # those of 2 N_R (cooldown shifted): no need to lay out all N.
    n = min(problem.num_micro_batches, 2 * rep.num_micro_batches)
    shift = n - rep.num_micro_batches
    full = _core.periodic_orders(problem.graph, rep, n)
    warmup = [[(b, m) for b, m in order if m < rep.indices[b]] for order in full]
    cooldown = [[(b, m - shift) for b, m in order if m > rep.indices[b] + shift]
                for order in full]
    return warmup, cooldown


def _warmup_anchor(problem: Problem, rep: _core.Repetend, instances) -> Anchor:
    blocks = problem.blocks
    T, n, a = rep.period, rep.indices, rep.offsets
    first = {d: min(a[b] for b in problem.graph.blocks_on(d))
             for d in range(problem.num_devices) if problem.graph.blocks_on(d)}
    members = set(instances)
    external: dict = {}
    for p, c in problem.edges:
        for (b, m) in instances:
            if b == p and (c, m) not in members:
                # (c, m) runs in repetition m - n[c] >= 0; b's output must have arrived
                due = (m - n[c]) * T + a[c] - problem.transfer.get((p, c), 0)
                external[(b, m)] = min(external.get((b, m), due), due)
    # R cannot be earlier than any device's warmup work, nor than any instance's own chain.
    head = problem.graph.heads()
    bound = 0
    for d, due in first.items():
        on = [(b, m) for b, m in instances if d in blocks[b].devices]
        if on:
            bound = max(bound, min(head[b] for b, _ in on) + sum(blocks[b].time for b, _ in on)
                        - due)
    for (b, _), due in external.items():
        bound = max(bound, head[b] + blocks[b].time - due)
    return Anchor("warmup", first, external, floor=bound)


def _cooldown_anchor(problem: Problem, rep: _core.Repetend, instances, last: int) -> Anchor:
    T, n, a = rep.period, rep.indices, rep.offsets
    time_of = [b.time for b in problem.blocks]
    end = {d: max(a[b] + time_of[b] for b in problem.graph.blocks_on(d))
           for d in range(problem.num_devices) if problem.graph.blocks_on(d)}
    members = set(instances)
    external: dict = {}
    for p, c in problem.edges:
        for (b, m) in instances:
            if b == c and (p, m) not in members:
                ready = (m - n[p] - last) * T + a[p] + time_of[p] + \
                    problem.transfer.get((p, c), 0)
                external[(b, m)] = max(external.get((b, m), ready), ready)
    # The end is no earlier than any device's cooldown work after its last repetition.
    tail = problem.graph.tails()
    floor = max(end.values(), default=0)
    for d, ready in end.items():
        on = [(b, m) for b, m in instances if d in problem.blocks[b].devices]
        if on:
            floor = max(floor, ready + sum(time_of[b] for b, _ in on)
                        + min(tail[b] for b, _ in on))
    for (b, _), ready in external.items():
        floor = max(floor, ready + time_of[b] + tail[b])
    return Anchor("cooldown", end, external, floor=floor)


def exact_applies(problem: Problem, rep: _core.Repetend, budget: Budget) -> bool:
    """Whether Z3 could still improve the periodic completion of `rep` (else `complete` with
    exact=True gives the periodic one again)."""
    if problem.num_micro_batches < rep.num_micro_batches or budget.spent or budget.expired():
        return False
    indices = list(rep.indices)
    return max(len(_core.warmup_blocks(indices)), len(_core.cooldown_blocks(indices))) \
        <= EXACT_LIMIT


def complete(problem: Problem, rep: _core.Repetend, *, exact: bool, budget: Budget,
             notes: list[str], target: int = 0,
             periodic: Schedule | None = None) -> tuple[Schedule, bool]:
    """The best completion found, and whether Z3 stopped before proving its phases optimal.
    A periodic completion that already takes no more than `target` (the lower bound) is kept
    without asking Z3."""
    n = problem.num_micro_batches
    if n < rep.num_micro_batches:
        schedule = build_schedule(problem, _core.periodic_orders(problem.graph, rep, n), None, ())
        notes.append("completion: periodic order (no full repetend fits in "
                     f"{count(n, 'micro-batch')})")
        return schedule, False
    repetend = repetend_from_core(problem, rep)
    warmup, cooldown = _split_periodic(problem, rep)
    if periodic is None:  # (the caller may have laid it out already)
        periodic = build_schedule(problem, warmup, repetend, cooldown)
    warm = _core.warmup_blocks(list(rep.indices))
    last = n - rep.num_micro_batches
    cool = [(b, m + last) for b, m in _core.cooldown_blocks(list(rep.indices))]
    if periodic.makespan <= target:
        notes.append(f"completion: periodic warmup ({count(len(warm), 'block')}) and cooldown "
                     f"({count(len(cool), 'block')}) meet the lower bound")
        return periodic, False
    if not exact or max(len(warm), len(cool)) > EXACT_LIMIT or budget.spent or \
            budget.expired():
        reason = ("" if not exact else ", exact effort used up" if budget.spent else
                  ", the time limit ran out" if budget.expired() else
                  f", above the exact limit of {EXACT_LIMIT}")
        notes.append(f"completion: periodic warmup ({count(len(warm), 'block')}) and cooldown "
                     f"({count(len(cool), 'block')}){reason}")
        return periodic, False
    w = c = None
    cut = False
    if warm:
        result = time_optimal(problem, warm, anchor=_warmup_anchor(problem, rep, warm),
                              budget=budget.slice(PHASE_EFFORT))
        cut |= result.status in ("feasible", "unknown")
        w = result.orders if result.orders else None
    if cool:
        result = time_optimal(problem, cool, initial_memory=list(rep.entry_memory),
                              anchor=_cooldown_anchor(problem, rep, cool, last),
                              budget=budget.slice(PHASE_EFFORT))
        cut |= result.status in ("feasible", "unknown")
        c = [[(b, m - last) for b, m in order] for order in result.orders] \
            if result.orders else None
    best = periodic
    if w is not None or c is not None:
        try:
            candidate = build_schedule(problem, w if w is not None else warmup, repetend,
                                       c if c is not None else cooldown)
            if candidate.makespan < best.makespan:
                best = candidate
        except RuntimeError:
            pass  # an order rule ties a phase to the repetend: the periodic phases stay
    notes.append(f"completion: warmup ({count(len(warm), 'block')}) and cooldown "
                 f"({count(len(cool), 'block')}) "
                 + ("improved by Z3 within its effort, not proven optimal" if cut
                    else "time-optimal (Z3)"))
    return best, cut


def complete_whole(problem: Problem, best: Schedule, *, budget: Budget,
                   notes: list[str]) -> tuple[Schedule, bool]:
    """For small problems: the whole schedule time-optimal, if that beats `best`; and whether
    the schedule returned is proven optimal (Z3 found none shorter)."""
    n = problem.num_micro_batches
    if len(problem.blocks) * n > WHOLE_LIMIT or budget.spent:
        return best, False
    everything = [(b.index, m) for m in range(n) for b in problem.blocks]
    # Ordering each block's instances by micro-batch loses no schedule without order rules
    # (relabel the k-th instance in time as micro-batch k); a rule with a shift can need others.
    result = time_optimal(problem, everything, upper_bound=best.makespan,
                          lower_bound=problem.makespan_bound(), budget=budget,
                          symmetry=not problem.rules)
    if not result.orders:
        if result.status == "none":
            notes.append("completion: Z3 proved that no shorter schedule exists")
        return best, result.status == "none"
    schedule = build_schedule(problem, result.orders, None, ())
    # Z3's objective bounds the synchronisations' queueing from below: proven only if met.
    proven = result.status == "optimal" and schedule.makespan == result.value
    if schedule.makespan >= best.makespan:
        return best, False
    notes[:] = ["completion: whole schedule time-optimal (Z3), shorter than any repetend or "
                "template"
                if proven else
                "completion: whole schedule improved by Z3, not proven optimal"]
    return schedule, proven
