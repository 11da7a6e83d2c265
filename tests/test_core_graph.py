"""The C++ core's graph algorithms against the plain-Python reference on random DAGs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import core_graph, problems
from pyplan import _core
from pyplan import reference as ref


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
