"""The core's exhaustive search of a whole small problem (csrc/core/exhaustive.cpp) against Z3's
time-optimal model of the same problem: it finds a schedule at Z3's optimum, proves there is
none below it, and what it finds runs as found."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pyplan import _core
from pyplan.problem import load_problem
from pyplan.problem.schedule import build_schedule
from pyplan.solver.budget import Budget
from pyplan.solver.complete import search_whole
from pyplan.solver.exact import time_optimal
from test_bounds import fits, small_plans

PLANS = Path(__file__).resolve().parent.parent / "plans"


def within(problem, makespan: int, nodes: int = 10_000_000):
    head = [-1 if problem.headroom(d) is None else problem.headroom(d)
            for d in range(problem.num_devices)]
    return _core.schedule_within(problem.graph, problem.num_micro_batches, makespan, head,
                                 [b.is_forward for b in problem.blocks], problem.sync_time,
                                 nodes)


def z3_optimum(problem) -> int | None:
    everything = [(b.index, m) for m in range(problem.num_micro_batches) for b in problem.blocks]
    result = time_optimal(problem, everything, symmetry=True, budget=Budget(60))
    return result.value if result.status == "optimal" else None


def check_against_z3(problem) -> None:
    optimum = z3_optimum(problem)
    if optimum is None:
        return
    status, starts, _ = within(problem, optimum)
    assert status == "found"
    assert within(problem, optimum - 1)[0] == "none"
    # What it found keeps every constraint (the core evaluates its orders) and, without
    # data-parallel synchronisations (whose queueing Z3's objective leaves out), has that
    # makespan.
    k, n = len(problem.blocks), problem.num_micro_batches
    orders = [sorted(((b, m) for m in range(n) for b in range(k)
                      if d in problem.blocks[b].devices),
                     key=lambda x: starts[x[1] * k + x[0]]) for d in range(problem.num_devices)]
    schedule = build_schedule(problem, orders, None, ())
    if problem.sync_time == 0:
        assert schedule.makespan == optimum


@settings(max_examples=60, deadline=None)
@given(small_plans())
def test_exhaustive_search_agrees_with_z3(problem):
    assume(fits(problem))
    check_against_z3(problem)


@settings(max_examples=25, deadline=None)
@given(small_plans(sync=True))
def test_exhaustive_search_agrees_with_z3_with_synchronisations(problem):
    assume(fits(problem))
    check_against_z3(problem)


@pytest.mark.parametrize("name, n", [("tessel-xshape", 2), ("tessel-vshape", 3),
                                     ("tessel-kshape", 2), ("zero-bubble", 3),
                                     ("tessel-mshape", 2)])
def test_exhaustive_search_agrees_with_z3_on_the_papers_plans(name, n):
    problem = load_problem(PLANS / f"{name}.yaml").with_overrides(micro_batches=n)
    check_against_z3(problem)


def test_the_x_shape_at_tessels_setting_is_proven_without_z3():
    # 3 micro-batches, memory 4: the bound says 28, memory makes it 30 (Z3 agrees, slower).
    problem = load_problem(PLANS / "tessel-xshape.yaml").with_overrides(micro_batches=3,
                                                                       memory=4)
    assert problem.makespan_bound() == 28
    assert within(problem, 29)[0] == "none"
    assert within(problem, 30)[0] == "found"


def test_out_of_nodes_is_unknown_and_the_solver_goes_on_from_there():
    problem = load_problem(PLANS / "tessel-nnshape.yaml").with_overrides(micro_batches=3)
    status, _, nodes = within(problem, 35, nodes=1000)
    assert status == "unknown" and nodes == 1001
    gpipe = load_problem(PLANS / "tessel-nnshape.yaml").with_overrides(micro_batches=3)
    from pyplan.solver.templates import template_schedule

    start = template_schedule(gpipe, "gpipe")
    notes: list[str] = []
    schedule, proven = search_whole(problem, start, budget=Budget(), notes=notes)
    assert proven and schedule.makespan == 36  # (gpipe's: the search proves it optimal)
    assert notes == ["completion: an exhaustive search proved that no shorter schedule exists"]


def test_the_exhaustive_search_refuses_what_it_cannot_search():
    problem = load_problem(PLANS / "tessel-vshape.yaml")
    with pytest.raises(ValueError):  # one headroom per device
        _core.schedule_within(problem.graph, 2, 10, [-1], [True] * len(problem.blocks), 0, 10)
    with pytest.raises(ValueError):  # too many instances to recurse over
        within(problem.with_overrides(micro_batches=1024), 100)
    ruled = load_problem(PLANS / "alphafold2-3f1b.yaml")
    with pytest.raises(ValueError):  # order rules are Z3's
        within(ruled.with_overrides(micro_batches=1), 100)


def _random_schedule(problem, rng):
    """Some schedule of the problem: instances in a random order that keeps the dependencies
    and each block's micro-batch order, each as early as that order allows."""
    from pyplan.problem.schedule import schedule_from_orders

    blocks, n = problem.blocks, problem.num_micro_batches
    preds = {b.index: [a for a, c in problem.edges if c == b.index] for b in blocks}
    done: set = set()
    sequence = []
    while len(sequence) < n * len(blocks):
        ready = [(b.index, m) for m in range(n) for b in blocks if (b.index, m) not in done
                 and all((a, m) in done for a in preds[b.index])
                 and (m == 0 or (b.index, m - 1) in done)]
        pick = rng.choice(ready)
        done.add(pick)
        sequence.append(pick)
    orders = [[x for x in sequence if d in blocks[x[0]].devices]
              for d in range(problem.num_devices)]
    return schedule_from_orders(problem, orders, n).schedule


@settings(max_examples=60, deadline=None)
@given(small_plans(), st.randoms())
def test_a_window_the_search_settles_is_one_z3_cannot_shorten(problem, rng):
    # The windows' large-neighbourhood search asks the core first: every device keeps the
    # schedule's order except among the window's instances. Where the core finds nothing
    # shorter, neither does Z3 on the same model, and the other way round.
    from pyplan.solver.complete import kept_pairs
    from pyplan.solver.exact import reoptimise

    assume(fits(problem) and not problem.rules)
    schedule = _random_schedule(problem, rng)
    instances = [(b.index, m) for m in range(problem.num_micro_batches) for b in problem.blocks]
    free = rng.sample(instances, rng.randrange(len(instances) + 1))
    head = [-1 if problem.headroom(d) is None else problem.headroom(d)
            for d in range(problem.num_devices)]
    status, _, _ = _core.schedule_within(
        problem.graph, problem.num_micro_batches, schedule.makespan - 1, head,
        [b.is_forward for b in problem.blocks], problem.sync_time, 10_000_000,
        kept_pairs(problem, schedule.orders, free))
    z3 = reoptimise(problem, schedule.orders, free, upper_bound=schedule.makespan,
                    budget=Budget(60))
    if z3.status in ("optimal", "none"):
        assert (status == "none") == (z3.status == "none")


@pytest.mark.parametrize("name", ["tessel-vshape", "tessel-xshape", "tessel-mshape",
                                  "tessel-kshape", "zero-bubble"])
def test_windows_of_random_schedules_of_the_papers_plans(name):
    import random

    from pyplan.solver.complete import kept_pairs
    from pyplan.solver.exact import reoptimise

    problem = load_problem(PLANS / f"{name}.yaml").with_overrides(micro_batches=3)
    rng = random.Random(name)
    outcomes = set()
    for _ in range(6):
        schedule = _random_schedule(problem, rng)
        instances = [(b.index, m) for m in range(3) for b in problem.blocks]
        free = rng.sample(instances, min(len(instances), 12))
        head = [-1 if problem.headroom(d) is None else problem.headroom(d)
                for d in range(problem.num_devices)]
        status, _, _ = _core.schedule_within(
            problem.graph, 3, schedule.makespan - 1, head,
            [b.is_forward for b in problem.blocks], problem.sync_time, 10_000_000,
            kept_pairs(problem, schedule.orders, free))
        z3 = reoptimise(problem, schedule.orders, free, upper_bound=schedule.makespan,
                        budget=Budget(60))
        if z3.status in ("optimal", "none"):
            assert (status == "none") == (z3.status == "none")
            outcomes.add(status)
    assert outcomes  # (Z3 answered at least once)
