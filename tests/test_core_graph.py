"""The C++ core's graph algorithms against the plain-Python reference on random DAGs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import core_graph, problems
from pyplan import _core
from pyplan.problem import reference as ref


@settings(max_examples=300, deadline=None)
@given(problems(transfers=True))
def test_topological_order_and_bounds_match_reference(problem):
    num_devices, blocks, edges = problem
    g = core_graph(*problem)
    assert g.topological_order() == ref.topological_order(len(blocks), edges)
    assert g.find_cycle() == []
    assert g.device_loads() == ref.device_loads(num_devices, blocks)
    assert g.load_bound() == ref.load_bound(num_devices, blocks)
    assert g.critical_path() == ref.critical_path(blocks, edges)
    assert g.heads() == ref.heads(blocks, edges)
    assert g.tails() == ref.tails(blocks, edges)
    for n in (1, 2, 7):
        assert g.makespan_bound(n) == ref.makespan_bound(num_devices, blocks, edges, n)
        for capacity in (0, 1, 3, 8):
            assert g.makespan_bound(n, capacity) == \
                ref.makespan_bound(num_devices, blocks, edges, n, capacity)
    for d in range(num_devices):
        assert g.memory_time(d) == ref.memory_time(blocks, edges, d)
        assert g.head_idle(d) == ref.head_idle(blocks, edges, d)
    for capacity in (-1, 1, 3, 8):
        assert g.period_bound(capacity) == \
            ref.period_bound(num_devices, blocks, edges, capacity)


@settings(max_examples=200, deadline=None)
@given(problems(transfers=True), st.data())
def test_per_device_capacity_and_weights_match_reference(problem, data):
    num_devices, blocks, edges = problem
    capacities = data.draw(st.lists(st.integers(-1, 9), min_size=num_devices,
                                    max_size=num_devices))
    static = data.draw(st.lists(st.integers(0, 2), min_size=num_devices, max_size=num_devices))
    g = _core.Graph(num_devices, core_graph(*problem).blocks, [tuple(e[:2]) for e in edges],
                    [], static, [e[2] for e in edges], capacities)
    assert list(g.capacity) == capacities
    for capacity in (-1, 2, 6):
        assert g.period_bound(capacity) == ref.period_bound(
            num_devices, blocks, edges, capacity, static, capacities)
        for n in (1, 3):
            assert g.makespan_bound(n, capacity) == ref.makespan_bound(
                num_devices, blocks, edges, n, capacity, static, capacities)


@settings(max_examples=60, deadline=None)
@given(problems(max_devices=3, max_blocks=9, transfers=True))
def test_memory_time_is_the_least_over_dependency_schedules(problem):
    """memory_time is the optimum of min sum(-memory_b x start_b) over starts that keep the
    dependencies (an LP Z3 solves exactly over the reals)."""
    import z3

    num_devices, blocks, edges = problem
    g = core_graph(*problem)
    for d in range(num_devices):
        on = [b for b in range(len(blocks)) if d in blocks[b][2] and blocks[b][1]]
        area = g.memory_time(d)
        if not on or area < 0:
            continue
        opt = z3.Optimize()
        start = [z3.Real(f"s{b}") for b in range(len(blocks))]
        for a, c, delay in edges:
            opt.add(start[c] >= start[a] + blocks[a][0] + delay)
        handle = opt.minimize(z3.Sum([-blocks[b][1] * start[b] for b in on]))
        assert opt.check() == z3.sat
        value = opt.lower(handle)
        assert z3.is_true(z3.simplify(value == z3.RealVal(area))), (value, area)


@settings(max_examples=300, deadline=None)
@given(problems(), st.data())
def test_cycle_detection_matches_reference(problem, data):
    num_devices, blocks, edges = problem
    k = len(blocks)
    extra = data.draw(st.lists(st.tuples(st.integers(0, k - 1), st.integers(0, k - 1))
                               .filter(lambda e: e[0] != e[1]), max_size=3))
    edges = sorted(set(edges) | set(extra))
    g = core_graph(num_devices, blocks, edges)
    cycle = g.find_cycle()
    assert bool(cycle) == bool(ref.find_cycle(k, edges))
    assert (g.topological_order() == []) == bool(cycle)
    if cycle:  # consecutive blocks are linked and the last links back to the first
        pairs = set(edges)
        assert all((a, b) in pairs for a, b in zip(cycle, cycle[1:] + cycle[:1]))
        with pytest.raises(ValueError, match="cycle"):
            g.critical_path()


def test_bad_graphs_raise_python_errors():
    with pytest.raises(IndexError, match="device 2 of 2"):
        _core.Graph(2, [_core.Block("a", 1, 0, [2])], [])
    with pytest.raises(ValueError, match=r"time outside 1 .. 2\^40"):
        _core.Graph(2, [_core.Block("a", 0, 0, [0])], [])
    with pytest.raises(IndexError, match="out of range"):
        _core.Graph(2, [_core.Block("a", 1, 0, [0])], [(0, 3)])
    with pytest.raises(ValueError, match="depends on itself"):
        _core.Graph(2, [_core.Block("a", 1, 0, [0])], [(0, 0)])
    with pytest.raises(ValueError, match="num_devices"):
        _core.Graph(0, [], [])
