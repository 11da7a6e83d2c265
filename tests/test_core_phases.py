"""List scheduling of a warmup or cooldown (csrc/core/phases.cpp) vs the Python reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import core_graph, order_rules, problems
from pyplan import _core
from pyplan.problem import reference as ref


@settings(max_examples=150, deadline=None)
@given(problems(max_devices=4, max_blocks=8, transfers=True), st.integers(1, 5), st.randoms(),
       st.booleans(), st.data())
def test_phase_list_scheduling_matches_reference(problem, n, rng, reverse, data):
    num_devices, blocks, edges = problem
    k = len(blocks)
    rules = data.draw(order_rules(k, max_size=2))
    g = core_graph(num_devices, blocks, edges, rules)
    # The rest of the schedule: any start times; the phase: a random subset of instances.
    start = {(b, m): rng.randrange(-5, 60) for m in range(n) for b in range(k)}
    phase = [x for x in start if rng.random() < 0.5]
    free = [rng.choice([-(1 << 62), rng.randrange(-20, 40)]) for _ in range(num_devices)]
    flat = [start[(b, m)] for m in range(n) for b in range(k)]
    got = _core.list_schedule_phase(g, phase, flat, free, n, reverse)
    want = ref.list_schedule_phase(num_devices, blocks, edges, phase, start, free, n,
                                   rules=rules, reverse=reverse)
    assert [list(map(tuple, o)) for o in got] == want


def test_phase_list_scheduling_refuses_what_it_cannot_run():
    g = core_graph(2, [(1, 0, [0]), (2, 0, [1])], [(0, 1)])
    start = [0, 1, 3, 4]  # two micro-batches
    with pytest.raises(ValueError):
        _core.list_schedule_phase(g, [(0, 1)], start[:3], [0, 0], 2)  # a start is missing
    with pytest.raises(ValueError):
        _core.list_schedule_phase(g, [(0, 1)], start, [0], 2)  # a free time is missing
    with pytest.raises(IndexError):
        _core.list_schedule_phase(g, [(2, 0)], start, [0, 0], 2)  # no block 2
    with pytest.raises(IndexError):
        _core.list_schedule_phase(g, [(0, 2)], start, [0, 0], 2)  # no micro-batch 2
    with pytest.raises(ValueError):
        _core.list_schedule_phase(g, [(0, 1), (0, 1)], start, [0, 0], 2)
    with pytest.raises(ValueError):
        _core.list_schedule_phase(g, [(0, 1)], start, [(1 << 62) + 1, 0], 2)
    assert _core.list_schedule_phase(g, [(0, 1), (1, 1)], start, [1, 4], 2) == [[(0, 1)],
                                                                             [(1, 1)]]
