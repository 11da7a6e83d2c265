"""The fast path (C++ modulo scheduling) against the exact Z3 model and the evaluator."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dags import core_graph, problems
from pyplan import _core
from pyplan.problem import Block, Problem
from pyplan.solver.exact import modulo_repetend


def as_problem(num_devices, blocks, edges, capacity):
    return Problem(name="random", description="", num_devices=num_devices,
                   memory_capacity=capacity, memory_is_size=False, num_micro_batches=8,
                   training=True,
                   blocks=tuple(Block(i, f"b{i}", "forward", t, m, tuple(d), f"b{i}")
                                for i, (t, m, d) in enumerate(blocks)),
                   edges=tuple(edges))


@settings(max_examples=120, deadline=None)
@given(problems(max_devices=4, max_blocks=8), st.integers(0, 3), st.integers(1, 4),
       st.sampled_from([None, 2, 4]))
def test_fast_path_is_sound_and_agrees_with_z3(problem, extra, max_nr, capacity):
    num_devices, blocks, edges = problem
    g = core_graph(*problem)
    period = g.load_bound() + extra
    rep, _ = _core.modulo_schedule(g, period, max_nr, -1 if capacity is None else capacity,
                                   50_000)
    exact = modulo_repetend(as_problem(num_devices, blocks, edges, capacity), period, max_nr)
    assert exact.status in ("sat", "unsat")
    if rep.feasible:
        # What the fast path returns is a real repetend within every limit...
        assert rep.period <= period and rep.num_micro_batches <= max_nr
        assert _core.memory_fits(rep, -1 if capacity is None else capacity)
        again = _core.evaluate_repetend(g, list(rep.indices), [list(o) for o in rep.orders])
        assert again.period == rep.period
        # ...so the exact model must agree that the period is feasible.
        assert exact.status == "sat"
    if exact.status == "sat":
        starts = list(exact.starts)
        z3_rep = _core.repetend_from_starts(g, starts, period)
        assert z3_rep.feasible and z3_rep.period <= period
        assert z3_rep.num_micro_batches <= max_nr
        assert _core.memory_fits(z3_rep, -1 if capacity is None else capacity)


def test_fast_path_finds_zero_bubble_at_scale():
    # V-shape with f=1, b=3 on 32 devices: period 4, one micro-batch entering per device.
    k = 32
    blocks = [(1, 1, [i]) for i in range(k)] + [(3, -1, [i]) for i in reversed(range(k))]
    edges = [(i, i + 1) for i in range(2 * k - 1)]
    graph = core_graph(k, blocks, edges)
    assert graph.load_bound() == 4
    rep, stats = _core.modulo_schedule(graph, 4, 2 * k, -1, 20_000)
    assert rep.feasible and rep.period == 4 and rep.num_micro_batches == k
    assert not stats.budget_exhausted
