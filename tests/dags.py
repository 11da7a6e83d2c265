"""Hypothesis strategies for random scheduling problems (blocks of one micro-batch + DAG)."""

from __future__ import annotations

from hypothesis import strategies as st

from pyplan import _core


@st.composite
def problems(draw, max_devices=8, max_blocks=24, multi_device=True, balanced_memory=True,
             transfers=False):
    """(num_devices, blocks, edges): blocks are (time, memory, devices) with a random DAG.

    Edges go from lower to higher index, so the graph is acyclic; with balanced_memory every
    device's memory deltas sum to zero (as pyplan requires of real plans). With transfers,
    edges are (from, to, transfer time) triples, the time often 0.
    """
    num_devices = draw(st.integers(1, max_devices))
    k = draw(st.integers(1, max_blocks))
    blocks = []
    for _ in range(k):
        time = draw(st.integers(1, 6))
        if multi_device and draw(st.integers(0, 5)) == 0:
            devices = sorted(draw(st.sets(st.integers(0, num_devices - 1), min_size=1)))
        else:
            devices = [draw(st.integers(0, num_devices - 1))]
        blocks.append([time, draw(st.integers(-3, 3)), devices])
    edges = set()
    for j in range(1, k):
        for i in draw(st.sets(st.integers(0, j - 1), max_size=3)):
            edges.add((i, j))
    if balanced_memory:
        for b in blocks:
            b[1] = 0
        # Pair blocks: +x on one and -x on a later one on the same devices, which depends on it
        # (memory is freed after it is allocated), keeps every device balanced.
        paired = set()
        for i in range(k):
            for j in range(i + 1, k):
                if blocks[i][2] == blocks[j][2] and not {i, j} & paired:
                    x = draw(st.integers(0, 3))
                    blocks[i][1], blocks[j][1] = x, -x
                    paired |= {i, j}
                    edges.add((i, j))
                    break
    edges = sorted(edges)
    if transfers:
        edges = [(a, c, draw(st.sampled_from([0, 0, 1, 2, 5]))) for a, c in edges]
    return num_devices, [tuple(b) for b in blocks], edges


def order_rules(k, max_size, max_min_m=2):
    """Random order rules (before, before_shift, after, after_shift, min_m) over k blocks."""
    return st.lists(st.tuples(st.integers(0, k - 1), st.integers(-1, 2), st.integers(0, k - 1),
                              st.integers(-1, 2), st.integers(0, max_min_m)),
                    max_size=max_size)


def core_graph(num_devices, blocks, edges, rules=()):
    return _core.Graph(num_devices,
                       [_core.Block(f"b{i}", t, m, list(d)) for i, (t, m, d) in enumerate(blocks)],
                       [tuple(e[:2]) for e in edges], [_core.OrderRule(*r) for r in rules], [],
                       [e[2] if len(e) > 2 else 0 for e in edges])
