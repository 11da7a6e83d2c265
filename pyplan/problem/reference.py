"""Plain-Python reference implementations of the C++ core, written for obviousness, not speed.

They are the oracle of the differential tests (tests/test_core_*.py) and the baseline of
benchmarks/core.py. Each function mirrors one in csrc/core and takes plain data:
``blocks`` is a list of (time, memory, devices) tuples, ``edges`` a list of (from, to) pairs
or (from, to, transfer time) triples, ``rules`` a list of (before, before_shift, after, after_shift, min_m) tuples.
"""

from __future__ import annotations

import itertools
import math

__all__ = [
    "critical_path", "device_loads", "enumerate_repetends", "evaluate", "evaluate_repetend",
    "extend", "find_cycle", "head_idle", "heads", "list_schedule_phase", "load_bound", "longest_paths",
    "makespan_bound", "memory_time", "period_bound", "periodic_orders", "repetend_bound", "tails",
    "topological_order",
]


def _succ(k, edges):
    out = [[] for _ in range(k)]
    for a, b, _ in _triples(edges):
        out[a].append(b)
    return out


def _triples(edges):
    """Edges as (from, to, transfer time)."""
    return [(e[0], e[1], e[2] if len(e) > 2 else 0) for e in edges]


def topological_order(k, edges):
    """Kahn's algorithm taking the smallest ready index first; [] when there is a cycle."""
    indegree = [0] * k
    for _, b, _ in _triples(edges):
        indegree[b] += 1
    done, order = set(), []
    while len(order) < k:
        ready = [b for b in range(k) if b not in done and indegree[b] == 0]
        if not ready:
            return []
        b = min(ready)
        done.add(b)
        order.append(b)
        for a, c, _ in _triples(edges):
            if a == b:
                indegree[c] -= 1
    return order


def find_cycle(k, edges):
    """Some dependency cycle as a list of blocks, or [] when the graph is acyclic."""
    succ = _succ(k, edges)
    for start in range(k):
        # Depth-first search for a path back to `start`.
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in succ[node]:
                if nxt == start:
                    return path
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return []


def device_loads(num_devices, blocks):
    loads = [0] * num_devices
    for time, _, devices in blocks:
        for d in devices:
            loads[d] += time
    return loads


def load_bound(num_devices, blocks):
    return max(device_loads(num_devices, blocks))


def heads(blocks, edges):
    k = len(blocks)
    head = [0] * k
    for b in topological_order(k, edges):
        for a, c, delay in _triples(edges):
            if a == b:
                head[c] = max(head[c], head[b] + blocks[b][0] + delay)
    return head


def tails(blocks, edges):
    k = len(blocks)
    tail = [0] * k
    for b in reversed(topological_order(k, edges)):
        for a, c, delay in _triples(edges):
            if a == b:
                tail[b] = max(tail[b], delay + blocks[c][0] + tail[c])
    return tail


def critical_path(blocks, edges):
    head = heads(blocks, edges)
    return max(head[b] + blocks[b][0] for b in range(len(blocks)))


def _idle_before_fed(blocks, edges, d):
    """Least idle time of device d before it first runs a block fed from another device, and
    which blocks on d are so fed. Until then d can only run blocks all of whose ancestors are
    on d; while a chain of other devices' blocks that conflict with all of those runs, d waits,
    and during transfers too when it has no such blocks at all."""
    k = len(blocks)
    on = [d in blocks[b][2] for b in range(k)]
    preds = [[a for a, c, _ in _triples(edges) if c == b] for b in range(k)]
    delay = {(a, c): t for a, c, t in _triples(edges)}
    order = topological_order(k, edges)
    closed, fed, after_fed = [False] * k, [False] * k, [False] * k
    for b in order:
        if on[b]:
            closed[b] = all(closed[p] for p in preds[b])
            fed[b] = any(not on[p] for p in preds[b])
        after_fed[b] = any(fed[p] or after_fed[p] for p in preds[b])
    free = [e for e in range(k) if closed[e]]

    def arrival(b):
        return max([chain[p] + (delay[(p, b)] if not free else 0)
                    for p in preds[b] if not on[p]], default=0)

    chain = [0] * k
    for b in order:
        if not on[b]:
            waits = all(_shares(blocks, b, e) for e in free)
            chain[b] = (blocks[b][0] if waits else 0) + arrival(b)
    firsts = [b for b in range(k) if fed[b] and not after_fed[b]]
    idle = min((arrival(b) for b in firsts), default=0)
    return idle, fed


def head_idle(blocks, edges, d):
    """Idle time device d cannot avoid before it first runs a block fed by another device."""
    return _idle_before_fed(blocks, edges, d)[0]


def _memory_bound(blocks, edges, d, n, capacity, head, tail):
    """When every freeing block on d depends on every allocating one, each micro-batch holds
    all it allocates for at least the shortest allocation-to-free path, and only
    capacity // that many micro-batches can at once."""
    on = [b for b in range(len(blocks)) if d in blocks[b][2]]
    alloc = [b for b in on if blocks[b][1] > 0]
    frees = [b for b in on if blocks[b][1] < 0]
    held = sum(blocks[b][1] for b in alloc)
    if held <= 0 or not frees or capacity < held:
        return 0
    order = topological_order(len(blocks), edges)
    shortest = math.inf
    for a in alloc:
        dist = {a: 0}
        for b in order:
            if b in dist:
                for x, c, delay in _triples(edges):
                    if x == b:
                        dist[c] = max(dist.get(c, 0), dist[b] + blocks[b][0] + delay)
        if any(f not in dist for f in frees):
            return 0
        shortest = min(shortest, min(dist[f] for f in frees))
    lanes = capacity // held
    return -(-n * shortest // lanes) + min(head[a] for a in alloc) + \
        min(blocks[f][0] + tail[f] for f in frees)


def _room(d, capacity, capacities):
    """A device's capacity under one for all devices and its own (-1: unlimited)."""
    own = capacities[d] if capacities else -1
    limits = [c for c in (capacity, own) if c is not None and c >= 0]
    return min(limits) if limits else -1


def _starts_after(blocks, edges, a):
    """Longest path from the start of block a to the start of each block it reaches."""
    dist = {a: 0}
    for b in topological_order(len(blocks), edges):
        if b in dist:
            for x, c, delay in _triples(edges):
                if x == b:
                    dist[c] = max(dist.get(c, 0), dist[b] + blocks[b][0] + delay)
    return dist


def memory_time(blocks, edges, d):
    """Least memory x time one micro-batch holds on device d under the dependencies alone:
    the largest sum of amount x path length over ways of sending each allocation on d to frees
    on d that depend on it (successive longest augmenting paths over a residual network), or
    -1 when some free cannot be so matched or the device keeps memory."""
    on = [b for b in range(len(blocks)) if d in blocks[b][2]]
    alloc = [b for b in on if blocks[b][1] > 0]
    frees = [b for b in on if blocks[b][1] < 0]
    held = sum(blocks[b][1] for b in alloc)
    if held == 0 or held != -sum(blocks[b][1] for b in frees) or held > 2 ** 60:
        return -1
    gain = {}
    for a in alloc:
        dist = _starts_after(blocks, edges, a)
        for f in frees:
            if f in dist:
                gain[(("a", a), ("f", f))] = dist[f]
    # Residual network: source -> allocation -> free -> sink; reverse arcs give flow back.
    cap, value = {}, {}
    for a in alloc:
        cap[("s", ("a", a))] = blocks[a][1]
    for f in frees:
        cap[(("f", f), "t")] = -blocks[f][1]
    for (u, v), g in gain.items():
        cap[(u, v)] = math.inf
        value[(u, v)] = g
    flow = {arc: 0 for arc in cap}
    total, sent = 0, 0
    while sent < held:
        # Longest path from s to t in the residual network (Bellman-Ford; no positive cycles).
        best, via = {"s": 0}, {}
        for _ in range(len(cap) + 2):
            for (u, v), c in cap.items():
                g = value.get((u, v), 0)
                if u in best and flow[(u, v)] < c and best[u] + g > best.get(v, -math.inf):
                    best[v], via[v] = best[u] + g, (u, v, 1)
                if v in best and flow[(u, v)] > 0 and best[v] - g > best.get(u, -math.inf):
                    best[u], via[u] = best[v] - g, (u, v, -1)
        if "t" not in best:
            return -1
        path, node = [], "t"
        while node != "s":
            u, v, sign = via[node]
            path.append((u, v, sign))
            node = u if sign == 1 else v
        push = min([held - sent] + [cap[(u, v)] - flow[(u, v)] if sign == 1 else flow[(u, v)]
                                    for u, v, sign in path])
        for u, v, sign in path:
            flow[(u, v)] += sign * push
        total += push * best["t"]
        sent += push
    return total


def period_bound(num_devices, blocks, edges, capacity=-1, static_memory=None,
                 capacities=None):
    """The busiest device's load, and memory-time / room on every limited device."""
    bound = load_bound(num_devices, blocks)
    for d in range(num_devices):
        room = _room(d, capacity, capacities)
        if room < 0:
            continue
        room -= (static_memory or [0] * num_devices)[d]
        area = memory_time(blocks, edges, d)
        if area > 0 and room > 0:
            bound = max(bound, -(-area // room))
    return bound


def makespan_bound(num_devices, blocks, edges, n, capacity=-1, static_memory=None,
                   capacities=None):
    if n <= 0:
        return 0
    k = len(blocks)
    static = static_memory or [0] * num_devices
    head, tail = heads(blocks, edges), tails(blocks, edges)
    loads = device_loads(num_devices, blocks)
    bound = critical_path(blocks, edges)
    reverse = [(c, a, t) for a, c, t in _triples(edges)]
    for d in range(num_devices):
        on = [b for b in range(k) if d in blocks[b][2]]
        if not on:
            continue
        bound = max(bound, min(head[b] for b in on) + n * loads[d] + min(tail[b] for b in on))
        if len(on) <= 512:  # every subset with heads and tails above thresholds
            for low_head in {head[b] for b in on}:
                for low_tail in {tail[b] for b in on}:
                    chosen = [b for b in on if head[b] >= low_head and tail[b] >= low_tail]
                    if chosen:
                        bound = max(bound, min(head[b] for b in chosen)
                                    + n * sum(blocks[b][0] for b in chosen)
                                    + min(tail[b] for b in chosen))
        idle_head, fed = _idle_before_fed(blocks, edges, d)
        idle_tail, feeds = _idle_before_fed(blocks, reverse, d)
        # The two idle stretches are disjoint when some fed block precedes a feeding one.
        reach = [feeds[b] for b in range(k)]
        for b in reversed(topological_order(k, edges)):
            reach[b] = reach[b] or any(reach[c] for a, c, _ in _triples(edges) if a == b)
        disjoint = any(fed[b] and reach[b] for b in range(k))
        idle = idle_head + idle_tail if disjoint else max(idle_head, idle_tail)
        bound = max(bound, n * loads[d] + idle)
        room = _room(d, capacity, capacities)
        if room < 0:
            continue
        bound = max(bound, _memory_bound(blocks, edges, d, n, room - static[d], head, tail))
        area = memory_time(blocks, edges, d)
        if area > 0 and room - static[d] > 0:
            first = min(head[b] for b in on if blocks[b][1] > 0)
            last = min(blocks[b][0] + tail[b] for b in on if blocks[b][1] < 0)
            bound = max(bound, first + -(-n * area // (room - static[d])) + last)
    return bound


def evaluate(num_devices, blocks, edges, orders, *, capacity=-1, initial_memory=None,
             rules=(), complete=0, static_memory=None, capacities=None):
    """Run per-device orders of (block, micro-batch) as early as possible.

    Returns a dict with ok, makespan, start {(block, mb): time}, busy, peak_memory, bubble_rate.
    A block starts when it heads the queue of every device it uses and its dependencies (and
    order rules) have finished; starting it adds its memory to each of its devices, whose
    memory starts at its static memory (weights) plus the initial memory; it may not exceed
    `capacity`, nor the device's own in `capacities` (-1 or None: unlimited).
    """
    scheduled = {inst for order in orders for inst in order}
    for b in range(len(blocks)):
        for m in range(complete):
            if (b, m) not in scheduled:
                raise ValueError(f"block {b} of micro-batch {m} is not scheduled")
    preds = {inst: [] for inst in scheduled}  # (instance, transfer time)
    for (b, m) in scheduled:
        for a, c, delay in _triples(edges):
            if c == b and (a, m) in scheduled:
                preds[(b, m)].append(((a, m), delay))
        for before, bshift, after, ashift, min_m in rules:
            if after == b:
                base = m - ashift
                other = (before, base + bshift)
                if base >= min_m and other in scheduled and other != (b, m):
                    preds[(b, m)].append((other, 0))
    memory = [a + b for a, b in zip(initial_memory or [0] * num_devices,
                                    static_memory or [0] * num_devices)]
    peak = list(memory)
    position = [0] * num_devices
    free = [0] * num_devices
    end, start = {}, {}
    progress = True
    while progress:
        progress = False
        for d in range(num_devices):
            if position[d] >= len(orders[d]):
                continue
            inst = orders[d][position[d]]
            b = inst[0]
            time, mem, devices = blocks[b]
            at_head = all(position[e] < len(orders[e]) and orders[e][position[e]] == inst
                          for e in devices)
            if not at_head or any(p not in end for p, _ in preds[inst]):
                continue
            for e in devices:
                memory[e] += mem
                room = _room(e, capacity, capacities)
                if room >= 0 and memory[e] > room:
                    return {"ok": False, "reason": "memory"}
                peak[e] = max(peak[e], memory[e])
            s = max([free[e] for e in devices] + [end[p] + t for p, t in preds[inst]])
            start[inst] = s
            end[inst] = s + time
            for e in devices:
                free[e] = s + time
                position[e] += 1
            progress = True
    if len(end) != len(scheduled):
        return {"ok": False, "reason": "deadlock"}
    makespan = max(end.values(), default=0)
    busy = [sum(blocks[b][0] for b, _ in orders[d]) for d in range(num_devices)]
    bubble = 1 - sum(busy) / (num_devices * makespan) if makespan else 0.0
    return {"ok": True, "makespan": makespan, "start": start, "busy": busy,
            "peak_memory": peak, "bubble_rate": bubble}


# ---------------------------------------------------------------- repetends

def longest_paths(blocks, edges):
    """dist[i][j]: longest start-to-start dependency path from i to j, -1 if none."""
    k = len(blocks)
    order = topological_order(k, edges)
    dist = [[-1] * k for _ in range(k)]
    for src in range(k):
        dist[src][src] = 0
        for b in order:
            if dist[src][b] < 0:
                continue
            for a, c, delay in _triples(edges):
                if a == b:
                    dist[src][c] = max(dist[src][c], dist[src][b] + blocks[b][0] + delay)
    return dist


def _shares(blocks, i, j):
    return bool(set(blocks[i][2]) & set(blocks[j][2]))


def repetend_bound(num_devices, blocks, edges, indices):
    longest = longest_paths(blocks, edges)
    bound = load_bound(num_devices, blocks)
    for i in range(len(blocks)):
        for j in range(len(blocks)):
            if i != j and longest[i][j] >= 0 and _shares(blocks, i, j):
                bound = max(bound, math.ceil((longest[i][j] + blocks[j][0]) /
                                             (indices[i] - indices[j] + 1)))
    return bound


def enumerate_repetends(num_devices, blocks, edges, num_mb, *, capacity=-1, period_below=0,
                        rules=()):
    """All index assignments the core enumerates, by brute force over [0, num_mb)^K."""
    k = len(blocks)
    out = []
    for n in itertools.product(range(num_mb), repeat=k):
        if min(n) != 0 or max(n) != num_mb - 1:
            continue
        if any(n[b] > n[a] for a, b, _ in _triples(edges)):
            continue
        if any(n[after] - n[before] > ashift - bshift
               for before, bshift, after, ashift, _ in rules):
            continue
        if capacity >= 0 and any(
                sum(blocks[b][1] * n[b] for b in range(k) if d in blocks[b][2]) > capacity
                for d in range(num_devices)):
            continue
        if period_below > 0 and repetend_bound(num_devices, blocks, edges, n) >= period_below:
            continue
        out.append(list(n))
    return out


def _no_positive_cycle(k, cons, period):
    """Bellman-Ford longest paths for a_to - a_from >= w - h * period; None on a positive cycle."""
    dist = [0] * k
    for _ in range(k + 1):
        changed = False
        for a, b, w, h in cons:
            if dist[a] + w - h * period > dist[b]:
                dist[b] = dist[a] + w - h * period
                changed = True
        if not changed:
            return dist
    return None


def evaluate_repetend(num_devices, blocks, edges, indices, orders, *, rules=(), min_period=0):
    """Least integer period of repeating `orders` with micro-batch `indices`, by trying periods
    upward. Returns None when the order contradicts the dependencies, else a dict."""
    k = len(blocks)
    n = indices
    cons = [(a, b, blocks[a][0] + delay, n[a] - n[b]) for a, b, delay in _triples(edges)]
    for before, bshift, after, ashift, _ in rules:
        h = (ashift - bshift) - n[after] + n[before]
        if h < 0:
            return None
        cons.append((before, after, blocks[before][0], h))
    for order in orders:
        for x, y in zip(order, order[1:]):
            cons.append((x, y, blocks[x][0], 0))
        if order:
            cons.append((order[-1], order[0], blocks[order[-1]][0], 1))
    total = sum(t for t, _, _ in blocks) + sum(delay for _, _, delay in _triples(edges))
    if _no_positive_cycle(k, cons, max(total, min_period, 1)) is None:
        return None
    period = max(min_period, load_bound(num_devices, blocks), 1)
    while _no_positive_cycle(k, cons, period) is None:
        period += 1
    dist = _no_positive_cycle(k, cons, period)
    base = min(dist)
    offsets = [x - base for x in dist]
    peak, entry = [], []
    for order in orders:
        e = sum(blocks[b][1] * n[b] for b in order)
        running, best = e, e
        for b in order:
            running += blocks[b][1]
            best = max(best, running)
        entry.append(e)
        peak.append(best)
    return {"period": period, "offsets": offsets, "entry_memory": entry, "peak_memory": peak}


def periodic_orders(indices, orders, n):
    """Orders of the periodic schedule of a repetend for n micro-batches."""
    nr = max(indices) + 1
    return [[(b, j + indices[b]) for j in range(-(nr - 1), n) for b in order
             if 0 <= j + indices[b] < n] for order in orders]


def extend(warmup, indices, orders, cooldown, n):
    """Warmup, the repetend repeated n - N_R + 1 times, then cooldown shifted to the end."""
    nr = max(indices) + 1
    shift = n - nr
    return [list(warmup[d]) + [(b, j + indices[b]) for j in range(shift + 1) for b in orders[d]]
            + [(b, m + shift) for b, m in cooldown[d]] for d in range(len(orders))]


def list_schedule_phase(num_devices, blocks, edges, phase, start, free, n, *, rules=(),
                        reverse=False):
    """Non-delay list scheduling of `phase` against a fixed rest (start[(block, mb)]) and
    per-device free times: repeatedly run the instance that can start earliest (ties: longer
    path ahead, then smaller micro-batch, then block). reverse schedules backward in time
    (an instance must end before its successors start; free[d] is minus the time the device
    turns busy). Returns per-device orders in forward time."""
    inside = set(phase)
    time = [b[0] for b in blocks]
    ahead = heads(blocks, edges) if reverse else tails(blocks, edges)

    def done(b, m):
        return -start[(b, m)] if reverse else start[(b, m)] + time[b]

    def firsts(b, m):
        """(block, mb, delay) that must be done before (b, m) may start (reversed: after)."""
        out = [(c if reverse else a, m, delay) for a, c, delay in _triples(edges)
               if (a if reverse else c) == b]
        for before, bshift, after, ashift, min_m in rules:
            own, other = (before, after) if reverse else (after, before)
            own_shift, other_shift = (bshift, ashift) if reverse else (ashift, bshift)
            if own == b and m - own_shift >= min_m:
                out.append((other, m - own_shift + other_shift, 0))
        return [(x, y, d) for x, y, d in out if 0 <= y < n and (x, y) != (b, m)]

    free = list(free)
    begin, end = {}, {}
    while True:
        options = []
        for x in phase:
            if x in begin:
                continue
            needed = firsts(*x)
            if any((y, m) in inside and (y, m) not in end for y, m, _ in needed):
                continue
            at = max([end[(y, m)] + d if (y, m) in inside else done(y, m) + d
                      for y, m, d in needed] + [free[d] for d in blocks[x[0]][2]]
                     + [-(1 << 62)])  # (the core's "no constraint")
            options.append((at, -ahead[x[0]], -x[1] if reverse else x[1], x[0], x))
        if not options:
            break
        at, _, _, b, x = min(options)
        begin[x], end[x] = at, at + time[b]
        for d in blocks[b][2]:
            free[d] = end[x]
    ordered = sorted(begin, key=lambda x: (begin[x], x[1], x[0]), reverse=reverse)
    return [[x for x in ordered if d in blocks[x[0]][2]] for d in range(num_devices)]
