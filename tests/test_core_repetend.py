"""Repetends: enumeration, steady-state evaluation and extension against the Python reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import core_graph, order_rules, problems
from pyplan import _core
from pyplan.problem import reference as ref
from test_core_evaluate import vshape


@settings(max_examples=200, deadline=None)
@given(problems(max_devices=4, max_blocks=6), st.integers(1, 3), st.integers(-1, 4),
       st.integers(0, 12), st.data())
def test_enumeration_matches_brute_force(problem, num_mb, capacity, period_below, data):
    num_devices, blocks, edges = problem
    k = len(blocks)
    rules = data.draw(order_rules(k, max_size=2, max_min_m=0))
    g = core_graph(num_devices, blocks, edges, rules)
    got = sorted(_core.RepetendEnumerator(g, num_mb, capacity, period_below))
    want = sorted(ref.enumerate_repetends(num_devices, blocks, edges, num_mb, capacity=capacity,
                                          period_below=period_below, rules=rules))
    assert got == want


@st.composite
def repetend_cases(draw):
    num_devices, blocks, edges = draw(problems(max_devices=8, max_blocks=24, transfers=True))
    k = len(blocks)
    order = core_graph(num_devices, blocks, edges).topological_order()
    indices = [0] * k
    for b in order:  # monotone along dependencies: n_to <= n_from
        limit = min([indices[e[0]] for e in edges if e[1] == b], default=3)
        indices[b] = draw(st.integers(0, limit))
    low = min(indices)
    indices = [n - low for n in indices]
    orders = [draw(st.permutations([b for b in range(k) if d in blocks[b][2]]))
              for d in range(num_devices)]
    return (num_devices, blocks, edges), indices, [list(o) for o in orders]


@settings(max_examples=300, deadline=None)
@given(repetend_cases())
def test_steady_state_evaluation_matches_reference(case):
    problem, indices, orders = case
    g = core_graph(*problem)
    got = _core.evaluate_repetend(g, indices, orders)
    want = ref.evaluate_repetend(*problem, indices, orders)
    assert got.feasible == (want is not None)
    if want:
        assert got.period == want["period"]
        assert list(got.offsets) == want["offsets"]
        assert list(got.entry_memory) == want["entry_memory"]
        assert list(got.peak_memory) == want["peak_memory"]
        assert all(e + w == got.period for e, w in zip(got.execution, got.wait))


@settings(max_examples=200, deadline=None)
@given(repetend_cases(), st.integers(1, 6))
def test_periodic_schedule_is_feasible_and_bounded(case, n):
    """Extending a repetend and evaluating it as early as possible never exceeds the periodic
    schedule's times, nor the repetend's steady-state memory."""
    problem, indices, _ = case
    num_devices, blocks, edges = problem
    g = core_graph(*problem)
    rep = _core.list_schedule_repetend(g, indices)
    assert rep.feasible
    assert rep.period == _core.evaluate_repetend(g, indices, rep.orders).period
    orders = _core.periodic_orders(g, rep, n)
    assert orders == [[tuple(x) for x in o] for o in ref.periodic_orders(indices, rep.orders, n)]
    ev = _core.evaluate(g, orders, complete_micro_batches=n)
    assert ev.ok, ev.reason
    nr = rep.num_micro_batches
    periodic_end = max((m - indices[b] + nr - 1) * rep.period + rep.offsets[b] + blocks[b][0]
                       for b in range(len(blocks)) for m in range(n))
    assert ev.makespan <= periodic_end
    assert all(p <= q for p, q in zip(ev.peak_memory, rep.peak_memory))


def test_extend_matches_reference_and_periodic_orders():
    g = core_graph(*vshape(4, b=3))
    rep = _core.list_schedule_repetend(g, [3, 3, 3, 3, 3, 1, 1, 0])
    warm = [[(b, m) for b, m in o] for o in _core.periodic_orders(g, rep, 4)]
    # Warmup and cooldown as the periodic schedule's partial iterations.
    nr = rep.num_micro_batches
    full = _core.periodic_orders(g, rep, 10)
    warmup = [[(b, m) for b, m in o if m < rep.indices[b]] for o in full]
    cooldown = [[(b, m - (10 - nr)) for b, m in o if m > rep.indices[b] + 10 - nr] for o in full]
    got = _core.extend(g, warmup, rep, cooldown, 10).tolist()
    assert got == full
    assert got == [[tuple(x) for x in o] for o in ref.extend(warmup, rep.indices, rep.orders,
                                                             cooldown, 10)]
    assert warm  # four micro-batches are enough for one repetend
    with pytest.raises(ValueError, match="at least that many"):
        _core.extend(g, warmup, rep, cooldown, 2)


def test_warmup_and_cooldown_sets_follow_eq5_eq6():
    n = [3, 1, 0]
    assert sorted(_core.warmup_blocks(n)) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert sorted(_core.cooldown_blocks(n)) == [(1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]


def test_vshape_reaches_zero_bubble_at_four_micro_batches():
    """Tessel Fig. 11: V-shape (f=1, b=3) needs N_R >= 4 for a zero-bubble repetend."""
    g = core_graph(*vshape(4, b=3))
    periods = {}
    for nr in range(1, 6):
        best, stats = _core.search_repetends(g, nr)
        periods[nr] = best.period if best.feasible else None
        assert stats.enumerated >= 1
    assert periods[4] == 4 and periods[5] == 4
    assert all(periods[nr] > 4 for nr in (1, 2, 3))


def test_repetend_bound_explains_fig11():
    g = core_graph(*vshape(4, b=3))
    # f0 -> ... -> b0 on device 0: 13 steps between starts + 3; 16 / (n_f0 - n_b0 + 1).
    assert _core.repetend_bound(g, [3, 3, 3, 3, 3, 1, 1, 0]) == 4
    assert _core.repetend_bound(g, [2, 2, 2, 2, 2, 1, 1, 0]) == 6
    assert _core.repetend_bound(g, [0] * 8) == 16


def test_bad_repetend_input_raises():
    g = core_graph(*vshape(2))
    with pytest.raises(ValueError, match="must not increase along a dependency"):
        _core.evaluate_repetend(g, [0, 1, 1, 1], [[0, 3], [1, 2]])
    with pytest.raises(ValueError, match="must list exactly its blocks"):
        _core.evaluate_repetend(g, [1, 1, 0, 0], [[0], [1, 2]])
    with pytest.raises(ValueError, match="at least one micro-batch"):
        _core.RepetendEnumerator(g, 0)
    infeasible = _core.evaluate_repetend(g, [0, 0, 0, 0], [[3, 0], [1, 2]])
    assert not infeasible.feasible
