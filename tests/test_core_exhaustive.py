"""The core's exhaustive search of a whole small problem (csrc/core/exhaustive.cpp) against Z3's
time-optimal model of the same problem: it finds a schedule at Z3's optimum, proves there is
none below it, and what it finds runs as found."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given, settings

from pyplan import _core
from pyplan.problem import load_problem
from pyplan.schedule import build_schedule
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
