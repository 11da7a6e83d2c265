"""Repetend search: Tessel's Algorithm 1 with a modulo-scheduling fast path and exact Z3 checks.

1. Bounds: the period cannot beat the busiest device's load (lower bound); memory caps how many
   micro-batches a repetend may span (max in-flight).
2. Fast path (C++): a modulo schedule at the lower bound, then the next periods, as early as
   possible; usually zero-bubble at once, even at 32 devices.
3. Tessel enumeration (C++): index assignments for N_R = 1, 2, ... pruned by dependencies
   (Property 4.2), order rules, entry memory and a per-candidate period bound, each
   list-scheduled and evaluated exactly; candidates that cannot beat the best are skipped.
4. Exact (Z3): is a shorter period feasible? The lower bound first, then bisection; all unsat
   proves the best optimal among repetends of at most max N_R micro-batches.
5. A pool of repetends with that period (modulo schedules for every N_R limit, the best Tessel
   candidates of each N_R) is ranked by the makespan of its periodic schedule; completion
   (pyplan.solver.complete) picks among the best of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

from pyplan import _core
from pyplan.errors import InfeasibleError
from pyplan.problem import Problem
from pyplan.solver.budget import Budget, Clock
from pyplan.solver.exact import modulo_repetend

__all__ = ["Progress", "RepetendSearch", "SearchStats", "candidate_pool", "evaluation_work",
           "max_repetend_micro_batches", "pool_steps", "repetend_key", "search_repetend"]

MODULO_BUDGET = 20_000        # DFS placements per period in the fast path
MODULO_WORK = 4_000_000       # and elementary steps (packing checks): about 40 ms here
MODULO_MAX_PERIOD = 65_536    # the fast path's reservation table has one cell per time step
MODULO_TOTAL = 500_000        # DFS placements over all periods (then enumeration takes over)
ENUMERATION_BUDGET = 200_000  # Tessel candidates per N_R while searching the period
POOL_WORK = 30_000_000        # instance evaluations for ranking pool candidates (about 1 s)
POOL_STEPS = (0, POOL_WORK // 30, POOL_WORK // 3, POOL_WORK)  # grown until the bound is met
POOL_SIZE = 4                 # repetends of the best period that completion tries


class Progress(Protocol):
    """Where a long search is (the CLI draws it on the terminal)."""

    def update(self, *, phase: str, n_r: int | None = None, candidates: int = 0,
               best: int | None = None, bound: int | None = None) -> None: ...


@dataclass
class SearchStats:
    """What the search did (deterministic counts; times go to search_seconds)."""

    modulo_nodes: int = 0
    candidates: int = 0
    z3_checks: int = 0
    work: int = 0
    """Effort units the solve spent (Budget.charge): the same on every machine."""
    notes: list[str] = field(default_factory=list)


@dataclass
class RepetendSearch:
    repetend: _core.Repetend
    lower_bound: int
    proven_optimal: bool
    timed_out: bool
    stalled: int = 0
    """Work units the search for a shorter period spent without progress before the effort
    ended it (0: it was not ended so)."""


def max_repetend_micro_batches(problem: Problem) -> int:
    """How many micro-batches a repetend may span: the plan's limit, else a little more than
    the most micro-batches one block's memory can keep in flight on its device while the
    device's other blocks hold one micro-batch each (Tessel's CalMaxInflight, for devices
    with several stages: the first stage of a wave or an X-shape holds many, the last few),
    not more than the plan's micro-batches or the span of an order rule."""
    limit = problem.search.max_repetend_micro_batches
    if limit is None:
        limit = 2 * problem.num_devices + 2
        if problem.limited:
            held = [0] * problem.num_devices
            for b in problem.blocks:
                for d in b.devices:
                    held[d] += max(0, b.memory)
            fits = [(max(0, problem.headroom(d)) - held[d] + b.memory) // b.memory
                    for b in problem.blocks if b.memory > 0 for d in b.devices
                    if problem.headroom(d) is not None]
            if fits:
                # A repetend spans a little more than what is in flight on the busiest device
                # (a deferred weight-gradient block, say), hence the margin.
                limit = max(1, max(fits)) + 2
    # More than the plan's micro-batches only where an order rule links micro-batches that far
    # apart: the periodic order, cut to the micro-batches that exist, still keeps it.
    span = max((abs(r.before_shift - r.after_shift) + 1 for r in problem.rules), default=1)
    return max(1, min(limit, max(problem.num_micro_batches, span)))


def _better(a: _core.Repetend | None, b: _core.Repetend) -> bool:
    """Is b better than a: shorter period, then fewer micro-batches."""
    if not b.feasible:
        return False
    if a is None or not a.feasible:
        return True
    return (b.period, b.num_micro_batches) < (a.period, a.num_micro_batches)


# Work of the core's searches in effort units (one instance evaluation, about 50 ns here).
MODULO_STEPS_PER_UNIT = 3     # the modulo DFS's elementary steps take 5-40 ns each here


def modulo_work(mstats) -> int:
    """Effort units of a modulo search: its elementary steps (placements, packing, exact
    evaluations)."""
    return mstats.work // MODULO_STEPS_PER_UNIT


def evaluation_work(problem: Problem) -> int:
    """A Tessel candidate list-scheduled and evaluated exactly: Bellman-Ford passes over the
    blocks and their edges for each probe of a bisection over the period, about
    k (k + edges) log2(total time) / 11 units (4.5 ns each here, 3-5.4 over V, X, M, NN,
    interleaved and wave placements)."""
    k = len(problem.blocks)
    total = sum(b.time for b in problem.blocks) + sum(problem.transfers)
    return max(1, k * (k + len(problem.edges)) * max(1, total.bit_length()) // 11)


def _visit_work(problem: Problem) -> int:
    """A node of Tessel's enumeration: its prefix checks are about k / 8 units."""
    return 1 + len(problem.blocks) // 8


def search_repetend(problem: Problem, *, budget: Budget, exact: bool, stats: SearchStats,
                    progress: Progress | None = None, thorough: bool = True,
                    fast=None, clock: Clock | None = None) -> RepetendSearch:
    """The repetend with the least period found; `thorough=False` stops after the fast path
    when it finds any (the caller already holds an optimal schedule). `fast(search)` is told
    what the fast path found before a longer search for a shorter period starts (the caller
    completes it into an incumbent, so that the effort has work to compare with); when it
    answers True (that completion meets the makespan's lower bound) the search ends. Beyond the
    fast path, the search goes on while the budget's effort allows: every shorter period, and
    every period Z3 rules out, is progress. `clock` counts Z3's part as the proof's."""
    graph = problem.graph
    capacity = problem.capacity
    bound = problem.period_bound()  # the load, and memory-time over the capacity
    max_nr = max_repetend_micro_batches(problem)

    def report(phase: str, n_r=None):
        if progress is not None:
            progress.update(phase=phase, n_r=n_r, candidates=stats.candidates,
                            best=best.period if best is not None else None, bound=bound)

    best: _core.Repetend | None = None
    # One micro-batch at a time always works if one micro-batch fits: the fallback.
    sequential = _core.list_schedule_repetend(graph, [0] * len(problem.blocks))
    budget.charge(evaluation_work(problem))
    if sequential.feasible and _core.memory_fits(graph, sequential, capacity):
        best = sequential
    report("fast path")
    max_period = best.period - 1 if best is not None else bound * 4
    max_period = min(max_period, MODULO_MAX_PERIOD)  # long block times: enumeration instead
    # Starts lie within max_nr periods, so the longest start-to-start path must fit in them.
    first = max(bound, max(graph.heads()) // max_nr + 1)
    for period in range(first, max_period + 1):
        if budget.expired() or stats.modulo_nodes > MODULO_TOTAL:
            break
        rep, mstats = _core.modulo_schedule(graph, period, max_nr, capacity, MODULO_BUDGET,
                                            budget.remaining(), budget.units(MODULO_WORK))
        stats.modulo_nodes += mstats.nodes
        budget.charge(modulo_work(mstats))
        if _better(best, rep):
            best = rep
            break
    timed_out = False
    if best is not None and best.period > bound and thorough and fast is not None:
        thorough = not fast(RepetendSearch(best, bound, False, False))
    budget.progress()  # (what follows must pay for itself)
    if best is None or (best.period > bound and thorough):
        work = evaluation_work(problem)
        for nr in range(1, max_nr + 1):
            if budget.expired():
                timed_out = budget.timed_out()
                break
            # Without any repetend yet the enumeration goes on: the search needs one.
            left = budget.effort.left() if budget.effort is not None and best is not None \
                else None
            if left is not None and left <= 0:
                break
            report("enumeration", nr)
            limit = budget.units(ENUMERATION_BUDGET)
            if left is not None:
                limit = min(limit, max(1, left // work))
            rep, estats = _core.search_repetends(graph, nr, capacity,
                                                 best.period if best else 0, bound,
                                                 limit, budget.remaining())
            stats.candidates += estats.enumerated
            budget.charge(estats.visited_nodes * _visit_work(problem) + estats.evaluated * work)
            if _better(best, rep):
                best = rep
                budget.progress()
            if best is not None and best.period <= bound:
                break
    if best is None and not exact:
        raise InfeasibleError("no schedule satisfies the memory capacity and order rules",
                              hint="raise memory:, relax constraints: or enable search.exact")
    proven = best is not None and best.period <= bound
    if not proven and exact and thorough and not timed_out and \
            (best is None or not budget.stalled):
        with clock("proof") if clock is not None else contextlib.nullcontext():
            proven, timed_out, found = _exact_period(problem, best, bound, max_nr, budget,
                                                     stats, report)
        if found is not None:
            best = found
    if best is None:
        raise InfeasibleError("no schedule satisfies the memory capacity and order rules",
                              hint="raise memory: or relax constraints:")
    stalled = 0
    if not proven and not timed_out and budget.stalled:
        stalled = budget.effort.work - budget.effort.mark
    return RepetendSearch(best, bound, proven, timed_out, stalled)


def _exact_period(problem: Problem, best: _core.Repetend | None, bound: int, max_nr: int,
                  budget: Budget, stats: SearchStats, report):
    """Z3: the lower bound first, then bisection below the best period. Each answer is
    progress (a shorter period, or a period ruled out); an answer Z3 cannot give within the
    effort left ends the proof without a time-limit status."""
    graph = problem.graph
    lo = bound
    hi = (best.period - 1) if best is not None else bound * 4
    found = None
    proven = True
    first = True
    while lo <= hi:
        period = lo if first else (lo + hi) // 2
        first = False
        report(f"exact period {period}")
        stats.z3_checks += 1
        result = modulo_repetend(problem, period, max_nr, budget=budget)
        if result.status == "sat":
            rep = _core.repetend_from_starts(graph, list(result.starts), period)
            if rep.feasible and _core.memory_fits(graph, rep, problem.capacity) and \
                    _better(found or best, rep):
                found = rep
            hi = rep.period - 1
            budget.progress()
        elif result.status == "unsat":
            lo = period + 1
            budget.progress()
        else:
            return False, budget.timed_out(), found
    return proven, False, found


def candidate_pool(problem: Problem, best: _core.Repetend, *, budget: Budget,
                   stats: SearchStats, keep: int = POOL_SIZE, work: int = POOL_WORK,
                   modulo: bool = True) -> list[_core.Repetend]:
    """Repetends with the best period, ranked by the makespan of their periodic schedule for the
    plan's micro-batches (then fewer micro-batches): `best`, modulo schedules with every N_R
    limit (unless `modulo` is False) and, with `work` > 0 instance evaluations to spend, the
    best Tessel candidates of each N_R. Completion picks among them."""
    graph, capacity = problem.graph, problem.capacity
    n = problem.num_micro_batches
    period = best.period
    max_nr = max_repetend_micro_batches(problem)
    pool = {repetend_key(best): best}
    for nr in range(1, max_nr + 1 if modulo and period <= MODULO_MAX_PERIOD else 1):
        if budget.expired():
            break
        rep, mstats = _core.modulo_schedule(graph, period, nr, capacity, MODULO_BUDGET,
                                            budget.remaining(), budget.units(MODULO_WORK))
        stats.modulo_nodes += mstats.nodes
        budget.charge(modulo_work(mstats))
        if rep.feasible and rep.period <= period:
            pool.setdefault(repetend_key(rep), rep)
    # Ranking evaluates each candidate's whole periodic schedule: a fixed amount of work shared
    # by the N_R values keeps the pool (and so the result) the same on every run.
    per_limit = _per_limit(problem, work)
    for nr in range(1, min(max_nr, n) + 1) if per_limit > 0 else ():
        if budget.expired():
            break
        ranked, estats = _core.rank_repetends(graph, nr, capacity, period, n, keep,
                                              per_limit, budget.remaining())
        stats.candidates += estats.enumerated
        # (each candidate within the period is also laid out for n micro-batches)
        budget.charge(estats.visited_nodes * _visit_work(problem) + estats.evaluated *
                      (evaluation_work(problem) + len(problem.blocks) * n))
        for rep in ranked:
            pool.setdefault(repetend_key(rep), rep)

    def rank(rep):
        makespan = _core.periodic_makespan(graph, rep, n, capacity)
        budget.charge(len(problem.blocks) * n)
        return (makespan if makespan >= 0 else float("inf"), rep.num_micro_batches,
                sum(rep.peak_memory))

    return sorted(pool.values(), key=rank)[:keep]


def _per_limit(problem: Problem, work: int) -> int:
    """Tessel candidates ranked for each N_R limit with `work` instance evaluations (each
    candidate's periodic schedule has blocks x micro-batches instances)."""
    limits = min(max_repetend_micro_batches(problem), problem.num_micro_batches)
    return work // (len(problem.blocks) * problem.num_micro_batches * limits)


def pool_steps(problem: Problem) -> list[int]:
    """The work of each step by which the pool grows: POOL_STEPS, less those that would rank
    no more candidates than the step before (at scale, where one periodic schedule takes
    more than a step's work, none)."""
    steps = [POOL_STEPS[0]]
    for work in POOL_STEPS[1:]:
        if _per_limit(problem, work) > _per_limit(problem, steps[-1]):
            steps.append(work)
    return steps


def repetend_key(rep: _core.Repetend):
    """What makes two repetends the same: indices and orders."""
    return tuple(rep.indices), tuple(tuple(o) for o in rep.orders)
