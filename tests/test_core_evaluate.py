"""Schedule evaluation: C++ core vs the Python reference, and the papers' closed forms."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import core_graph, order_rules, problems
from pyplan import _core
from pyplan.problem import reference as ref


def random_orders(rng, num_devices, blocks, edges, n, scramble):
    """Per-device orders from a random topological order of all instances; optionally with one
    device's order shuffled (which may deadlock)."""
    k = len(blocks)
    preds = {(b, m): [(e[0], m) for e in edges if e[1] == b] for b in range(k) for m in range(n)}
    done, seq = set(), []
    pending = list(preds)
    while pending:
        ready = [i for i in pending if all(p in done for p in preds[i])]
        pick = rng.choice(ready)
        pending.remove(pick)
        done.add(pick)
        seq.append(pick)
    orders = [[i for i in seq if d in blocks[i[0]][2]] for d in range(num_devices)]
    if scramble:
        d = rng.randrange(num_devices)
        rng.shuffle(orders[d])
    return orders


def compare(g, problem, orders, capacity, rules=(), static=None):
    num_devices, blocks, edges = problem
    got = _core.evaluate(g, orders, memory_capacity=capacity)
    want = ref.evaluate(num_devices, blocks, edges, orders, capacity=capacity, rules=rules,
                        static_memory=static)
    assert got.ok == want["ok"], (got.reason, want)
    if got.ok:
        assert got.makespan == want["makespan"]
        assert list(got.busy) == want["busy"]
        assert list(got.peak_memory) == want["peak_memory"]
        assert got.bubble_rate == pytest.approx(want["bubble_rate"])
        k = len(blocks)
        for (b, m), s in want["start"].items():
            assert got.start[m * k + b] == s
    else:
        assert got.reason.startswith("deadlock") or "memory would reach" in got.reason


@settings(max_examples=300, deadline=None)
@given(problems(max_blocks=24, transfers=True), st.integers(1, 4),
       st.randoms(use_true_random=False), st.booleans(), st.integers(-1, 6))
def test_evaluation_matches_reference(problem, n, rng, scramble, capacity):
    g = core_graph(*problem)
    orders = random_orders(rng, *problem, n, scramble)
    compare(g, problem, orders, capacity)


@settings(max_examples=200, deadline=None)
@given(problems(max_blocks=16, transfers=True), st.integers(1, 4),
       st.randoms(use_true_random=False), st.integers(-1, 6), st.data())
def test_each_devices_own_capacity_matches_reference(problem, n, rng, capacity, data):
    num_devices, blocks, edges = problem
    capacities = data.draw(st.lists(st.integers(-1, 6), min_size=num_devices,
                                    max_size=num_devices))
    g = _core.Graph(num_devices, core_graph(*problem).blocks, [tuple(e[:2]) for e in edges],
                    [], [], [e[2] for e in edges], capacities)
    orders = random_orders(rng, *problem, n, False)
    got = _core.evaluate(g, orders, memory_capacity=capacity)
    want = ref.evaluate(num_devices, blocks, edges, orders, capacity=capacity,
                        capacities=capacities)
    assert got.ok == want["ok"], (got.reason, want)
    if got.ok:
        assert list(got.peak_memory) == want["peak_memory"]
        limits = [min([c for c in (capacity, own) if c >= 0], default=None)
                  for own in capacities]
        assert all(c is None or p <= c for p, c in zip(got.peak_memory, limits))


@settings(max_examples=150, deadline=None)
@given(problems(max_blocks=12), st.integers(1, 3), st.randoms(use_true_random=False),
       st.integers(-1, 8), st.data())
def test_static_memory_counts_in_every_peak_and_capacity_check(problem, n, rng, capacity, data):
    num_devices, blocks, edges = problem
    static = data.draw(st.lists(st.integers(0, 4), min_size=num_devices, max_size=num_devices))
    g = _core.Graph(num_devices, [_core.Block(f"b{i}", t, m, list(d))
                                  for i, (t, m, d) in enumerate(blocks)],
                    list(edges), [], static)
    compare(g, problem, random_orders(rng, *problem, n, False), capacity, static=static)


@settings(max_examples=150, deadline=None)
@given(problems(max_blocks=8, multi_device=False), st.integers(1, 4),
       st.randoms(use_true_random=False), st.data())
def test_evaluation_with_order_rules_matches_reference(problem, n, rng, data):
    num_devices, blocks, edges = problem
    k = len(blocks)
    rules = data.draw(order_rules(k, max_size=3))
    g = core_graph(num_devices, blocks, edges, rules)
    orders = random_orders(rng, *problem, n, scramble=False)
    compare(g, problem, orders, -1, rules)


def vshape(p, f=1, b=1, mem=1):
    blocks = [(f, mem, [i]) for i in range(p)] + [(b, -mem, [i]) for i in reversed(range(p))]
    edges = [(i, i + 1) for i in range(2 * p - 1)]
    return p, blocks, edges


def one_f_one_b(p, n):
    orders = []
    for r in range(p):
        fwd, bwd = r, 2 * p - 1 - r
        warm = min(p - r - 1, n)
        order = [(fwd, m) for m in range(warm)]
        nf = warm
        for m in range(n):
            if nf < n:
                order.append((fwd, nf))
                nf += 1
            order.append((bwd, m))
        orders.append(order)
    return orders


def gpipe(p, n):
    return [[(r, m) for m in range(n)] + [(2 * p - 1 - r, m) for m in range(n)]
            for r in range(p)]


def test_1f1b_closed_form():
    # (m + p - 1)(F + B) steps; bubble (p - 1)/(m + p - 1); rank r holds p - r micro-batches.
    g = core_graph(*vshape(4))
    ev = _core.evaluate(g, one_f_one_b(4, 8), memory_capacity=4)
    assert ev.ok and ev.makespan == 22
    assert round(ev.bubble_rate, 3) == 0.273
    assert list(ev.peak_memory) == [4, 3, 2, 1]
    g8 = core_graph(*vshape(8))
    ev8 = _core.evaluate(g8, one_f_one_b(8, 32))
    assert ev8.makespan == (32 + 7) * 2 and round(ev8.bubble_rate, 3) == 0.179


def test_gpipe_same_makespan_all_in_flight():
    g = core_graph(*vshape(4))
    ev = _core.evaluate(g, gpipe(4, 8))
    assert ev.ok and ev.makespan == 22 and list(ev.peak_memory) == [8] * 4
    tight = _core.evaluate(g, gpipe(4, 8), memory_capacity=4)
    assert not tight.ok
    assert tight.reason == "b0@4 cannot start on device 0: memory would reach 5 > capacity 4"


def test_pfeife_critical_path_example():
    # Pfeife Fig. 2: v1 (15) on device 0, transfer (1) on the link, v2 (10) on device 1.
    g = _core.Graph(3, [_core.Block("v1", 15, 0, [0]), _core.Block("e12", 1, 0, [2]),
                        _core.Block("v2", 10, 0, [1])], [(0, 1), (1, 2)])
    orders = [[(0, 0), (0, 1)], [(2, 0), (2, 1)], [(1, 0), (1, 1)]]
    ev = _core.evaluate(g, orders)
    assert ev.start[1 * 3 + 2] == 31  # v2 of micro-batch 2 (index 1) starts at 31
    assert ev.makespan == 41


def test_multi_device_block_occupies_all_its_devices():
    g = _core.Graph(2, [_core.Block("a", 2, 0, [0]), _core.Block("tp", 3, 0, [0, 1]),
                        _core.Block("c", 1, 0, [1])], [])
    ev = _core.evaluate(g, [[(0, 0), (1, 0)], [(2, 0), (1, 0)]])
    assert ev.ok and ev.start[1] == 2 and ev.start[2] == 0 and ev.makespan == 5


def test_deadlock_names_the_cycle():
    g = core_graph(*vshape(2))
    # device 0 wants the backward of micro-batch 0 before any forward: it waits forever.
    orders = [[(3, 0), (0, 0)], [(1, 0), (2, 0)]]
    ev = _core.evaluate(g, orders)
    assert not ev.ok
    assert ev.reason == ("deadlock: b3@0 waits for b2@0 (dependency); b2@0 waits for b1@0 "
                         "(ahead of it on device 1); b1@0 waits for b0@0 (dependency); "
                         "b0@0 waits for b3@0 (ahead of it on device 0)")


@pytest.mark.parametrize("orders, error, match", [
    ([[(7, 0)], []], IndexError, "unknown block index 7"),
    ([[(0, -1)], []], IndexError, "negative micro-batch"),
    ([[(1, 0)], []], ValueError, r"b1@0 is scheduled on device 0 but placed elsewhere"),
    ([[(0, 0), (0, 0)], []], ValueError, "appears twice on device 0"),
    ([[(0, 0)]], ValueError, "expected orders for 2 devices"),
])
def test_malformed_orders_raise(orders, error, match):
    g = core_graph(2, [(1, 0, [0]), (1, 0, [1]), (1, 0, [0, 1])], [(0, 1)])
    with pytest.raises(error, match=match):
        _core.evaluate(g, orders)


def test_incomplete_schedule_rejected_when_required():
    g = core_graph(*vshape(2))
    with pytest.raises(ValueError, match="b3@1 is not scheduled|is not scheduled"):
        _core.evaluate(g, one_f_one_b(2, 1), complete_micro_batches=2)
    with pytest.raises(ValueError, match="missing on some of its 2 devices"):
        _core.evaluate(core_graph(2, [(1, 0, [0, 1])], []), [[(0, 0)], []])
