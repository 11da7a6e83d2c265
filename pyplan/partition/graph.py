"""Graph pipelines (GraphPipe, Jeon et al. 2024): stages that form a DAG following a model's
branches, instead of one chain (`pyplan partition --shape graph`).

A model's units form a graph (`UnitGraph`: which units read which others' outputs, and which
read the model's inputs; pyplan.models.traced finds it with torch's tracer). The graph is
decomposed into series and parallel parts (`decompose`): a series cut between units in model
order is a narrow waist (everything crossing it leaves one unit, a fork, or enters one, a
join); between cuts, the weakly connected components are parallel branches; a part that is
neither stays a chain in model order. A dynamic programme over that tree (`partition_graph`)
asks, for a bottleneck T, the shallowest stage DAG with exactly one stage per device whose
stages each take at most T and fit the device's memory: a series part is cut into consecutive
runs (a run may hold whole parallel parts), each either one stage or a part given devices of
its own; a parallel part's branches go to disjoint devices (consecutive branches may share a
stage). Depth is the longest chain of stages, which sets the pipeline's warm-up and how many
micro-batches a stage holds in flight: a stage is counted as holding as many as there are
stages from it to the end (1F1B), as GraphPipe counts the source stage's in-flight
micro-batches from its successors'. A binary search finds the least T with a solution; the
partitions at it and at a few larger T (shallower ones) are the candidates that pyplan's
solver prices, as it prices chain partitions (pyplan.measure.placements).

Every stage is a run of consecutive units in one topological order, so stages are convex and
the stage graph has no cycle.

Nothing here needs torch.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from pyplan.partition import (UnitCost, model_tail, recompute_bytes, stage_activations,
                              stage_workspace)

__all__ = ["GraphPartition", "UnitGraph", "decompose", "graph_candidates", "graph_plan_text",
           "partition_graph"]

FACTORS = (1.0, 1.1, 1.25, 1.5, 2.0)  # bottlenecks tried beyond the least: shallower DAGs
_UNIT, _SERIES, _PARALLEL = "unit", "series", "parallel"


@dataclass(frozen=True)
class UnitGraph:
    """Which units read which: units in model (topological) order."""

    preds: tuple[tuple[int, ...], ...]
    """Per unit, the earlier units whose outputs it reads."""
    reads_input: tuple[bool, ...]
    """Per unit, whether it reads the model's inputs."""
    output_bytes: tuple[int, ...]
    """Per unit, the bytes of its own output (sent when a reader is on another stage)."""

    def __post_init__(self) -> None:
        n = len(self.preds)
        if len(self.reads_input) != n or len(self.output_bytes) != n:
            raise ValueError("preds, reads_input and output_bytes need one entry per unit")
        for k, ps in enumerate(self.preds):
            if any(not 0 <= p < k for p in ps):
                raise ValueError(f"unit {k} reads a unit that is not before it: {ps}")

    @property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.preds]
        for k, ps in enumerate(self.preds):
            for p in ps:
                out[p].append(k)
        return tuple(tuple(s) for s in out)

    @staticmethod
    def chain(units: Sequence[UnitCost]) -> UnitGraph:
        """The graph of a chain: each unit reads the one before."""
        return UnitGraph(tuple(() if k == 0 else (k - 1,) for k in range(len(units))),
                         tuple(k == 0 for k in range(len(units))),
                         tuple(u.output_bytes for u in units))


@dataclass(frozen=True)
class Node:
    """A part of the series-parallel decomposition: one unit, a series or parallel parts."""

    kind: str
    children: tuple[Node, ...] = ()
    unit: int = -1

    @property
    def units(self) -> tuple[int, ...]:
        if self.kind == _UNIT:
            return (self.unit,)
        return tuple(sorted(u for c in self.children for u in c.units))

    def branches(self) -> int:
        """The most parallel branches anywhere in it."""
        inner = max((c.branches() for c in self.children), default=1)
        return max(inner, len(self.children) if self.kind == _PARALLEL else 1)


def decompose(graph: UnitGraph) -> Node:
    """The series-parallel decomposition of the whole graph."""
    return _decompose(tuple(range(len(graph.preds))), graph, graph.succs)


def _decompose(part: tuple[int, ...], graph: UnitGraph, succs) -> Node:
    if len(part) == 1:
        return Node(_UNIT, unit=part[0])
    inside = set(part)
    cuts = [i for i in range(1, len(part)) if _series_cut(part, i, inside, graph, succs)]
    if cuts:
        children: list[Node] = []
        for a, b in zip([0, *cuts], [*cuts, len(part)]):
            child = _decompose(part[a:b], graph, succs)
            children += child.children if child.kind == _SERIES else [child]
        return Node(_SERIES, tuple(children))
    groups = _components(part, graph, inside)
    if len(groups) > 1:
        return Node(_PARALLEL, tuple(_decompose(g, graph, succs) for g in groups))
    # Neither: a chain in model order (any run of a topological order is a convex stage).
    return Node(_SERIES, tuple(Node(_UNIT, unit=k) for k in part))


def _series_cut(part, i, inside, graph: UnitGraph, succs) -> bool:
    """Whether the units before position i and those from it are in series: the later ones
    read nothing from outside the part, the earlier ones feed nothing outside it, and every
    edge between them leaves one unit (a fork) or enters one (a join)."""
    before, after = part[:i], part[i:]
    first = set(before)
    if any(graph.reads_input[k] or any(p not in inside for p in graph.preds[k])
           for k in after):
        return False
    if any(s not in inside for k in before for s in succs[k]):
        return False
    crossing = [(p, k) for k in after for p in graph.preds[k] if p in first]
    if not crossing:
        return False
    return len({p for p, _ in crossing}) == 1 or len({k for _, k in crossing}) == 1


def _components(part, graph: UnitGraph, inside) -> list[tuple[int, ...]]:
    """The weakly connected components of the part, in model order of their first units."""
    parent = {k: k for k in part}

    def find(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k
    for k in part:
        for p in graph.preds[k]:
            if p in inside:
                parent[find(p)] = find(k)
    groups: dict[int, list[int]] = {}
    for k in part:
        groups.setdefault(find(k), []).append(k)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


@dataclass(frozen=True)
class GraphPartition:
    """Stages of units (each a run of one topological order) and the stages each reads."""

    stages: tuple[tuple[int, ...], ...]
    """Unit indices per stage; stages in topological order (of their first units)."""
    preds: tuple[tuple[int, ...], ...]
    """Per stage, the earlier stages whose outputs it reads."""
    bottleneck_ms: float
    memory: tuple[int, ...]
    depth: int
    """The longest chain of stages."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage(self, s: int) -> tuple[int, ...]:
        return self.stages[s]

    @property
    def bounds(self) -> tuple[int, ...]:
        """A key that orders partitions deterministically (as chains' bounds do)."""
        return tuple(k for stage in self.stages for k in (*stage, -1))


class _Search:
    """The dynamic programme for one bottleneck: the shallowest DAG of exactly d stages for
    each part, memoised on (part, devices, depth after it)."""

    def __init__(self, units, graph: UnitGraph, root: Node, limit: float, capacity,
                 micro_batches: int, alone: bool, recompute: str) -> None:
        self.units, self.graph, self.root, self.limit = units, graph, root, limit
        self.capacity, self.n, self.alone, self.recompute = capacity, micro_batches, alone, \
            recompute
        self.succs = graph.succs
        self.memo: dict = {}
        self.time: dict[int, float] = {}
        self.fits_memo: dict = {}

    def cost(self, node: Node) -> float:
        key = id(node)
        if key not in self.time:
            self.time[key] = sum(self.units[k].forward_ms + self.units[k].backward_ms
                                 for k in node.units)
        return self.time[key]

    def ordered(self, node: Node) -> tuple[Node, ...]:
        """A parallel part's branches, the costliest first: consecutive ones share a stage,
        and the cheapest last ones may join the stage after them."""
        key = ("order", id(node))
        if key not in self.memo:
            self.memo[key] = tuple(sorted(node.children,
                                          key=lambda c: (-self.cost(c), c.units[0])))
        return self.memo[key]

    def fits(self, members: tuple[int, ...], after: int) -> bool:
        if self.capacity is None:
            return True
        key = (members, after)
        if key not in self.fits_memo:
            count = 1 if self.alone else min(self.n, 1 + after)
            self.fits_memo[key] = stage_bytes(self.units, self.graph, self.succs, members,
                                              count, self.recompute) <= self.capacity
        return self.fits_memo[key]

    def solve(self, node: Node, d: int, after: int):
        """(depth, stages) of the shallowest DAG of exactly d stages for `node` with `after`
        stages behind it, or None."""
        key = (id(node), d, after if self.capacity is not None else 0)
        if key in self.memo:
            return self.memo[key]
        found = None
        if node.kind == _UNIT:
            if d == 1 and self.cost(node) <= self.limit and self.fits(node.units, after):
                found = (1, (node.units,))
        elif node.kind == _SERIES:
            found = self._series(node.children, 0, d, after)
        else:
            found = self._parallel(node, len(node.children), 0, d, after)
        self.memo[key] = found
        return found

    def _series(self, items: tuple[Node, ...], i: int, d: int, after: int):
        key = ("s", id(items), i, d, after if self.capacity is not None else 0)
        if key in self.memo:
            return self.memo[key]
        best = None
        if i == len(items):
            best = (0, ()) if d == 0 else None
        elif d > 0:
            total = 0.0
            for j in range(i, len(items)):  # items i..j as one stage
                total += self.cost(items[j])
                if total > self.limit:
                    break
                rest = self._series(items, j + 1, d - 1, after)
                if rest is None:
                    continue
                members = tuple(sorted(u for x in items[i:j + 1] for u in x.units))
                if self.fits(members, after + rest[0]):
                    best = _better(best, (1 + rest[0], ((members,) + rest[1])))
            if items[i].kind == _PARALLEL:  # its cheapest branches in the stage after it
                best = self._merged(items, i, d, after, best)
            if items[i].kind != _UNIT:  # item i with devices of its own
                for mine in range(2, d + 1):
                    rest = self._series(items, i + 1, d - mine, after)
                    if rest is None:
                        continue
                    sub = self.solve(items[i], mine, after + rest[0])
                    if sub is not None:
                        best = _better(best, (sub[0] + rest[0], sub[1] + rest[1]))
        self.memo[key] = best
        return best

    def _merged(self, items: tuple[Node, ...], i: int, d: int, after: int, best):
        """Options where the last g branches of parallel item i share one stage with items
        i+1..j (the join and what follows), the other branches on devices of their own."""
        branches = self.ordered(items[i])
        for g in range(1, len(branches)):
            mine = self.cost_of(branches[len(branches) - g:])
            if mine > self.limit:
                break
            total = mine
            for j in range(i + 1, len(items)):
                total += self.cost(items[j])
                if total > self.limit:
                    break
                for rest_devices in range(0, d - 1):
                    rest = self._series(items, j + 1, rest_devices, after)
                    if rest is None:
                        continue
                    members = tuple(sorted(
                        [u for x in branches[len(branches) - g:] for u in x.units] +
                        [u for x in items[i + 1:j + 1] for u in x.units]))
                    if not self.fits(members, after + rest[0]):
                        continue
                    others = self._parallel(items[i], len(branches) - g, 0,
                                            d - 1 - rest_devices, after + 1 + rest[0])
                    if others is not None:
                        best = _better(best, (others[0] + 1 + rest[0],
                                              others[1] + (members,) + rest[1]))
        return self._tail_merged(items, i, d, after, best)

    def _tail_merged(self, items: tuple[Node, ...], i: int, d: int, after: int, best):
        """Options where the cheapest branch of parallel item i ends in the stage after it:
        its last items with items i+1..j, its first ones on devices of their own beside the
        other branches."""
        branches = self.ordered(items[i])
        last = branches[-1]
        if last.kind != _SERIES:
            return best
        for q in range(1, len(last.children)):
            start = self.prefix(last, q)
            tail = self.cost_of(last.children[q:])
            total = tail
            for j in range(i + 1, len(items)):
                total += self.cost(items[j])
                if total > self.limit:
                    break
                members = tuple(sorted([u for x in last.children[q:] for u in x.units] +
                                       [u for x in items[i + 1:j + 1] for u in x.units]))
                for rest_devices in range(0, d - 2):
                    rest = self._series(items, j + 1, rest_devices, after)
                    if rest is None or not self.fits(members, after + rest[0]):
                        continue
                    behind = after + 1 + rest[0]
                    for own in range(1, d - 1 - rest_devices):
                        others = self._parallel(items[i], len(branches) - 1, 0,
                                                d - 1 - rest_devices - own, behind)
                        first = self.solve(start, own, behind) if others is not None else None
                        if first is not None:
                            best = _better(best, (max(others[0], first[0]) + 1 + rest[0],
                                                  others[1] + first[1] + (members,) + rest[1]))
        return best

    def prefix(self, node: Node, q: int) -> Node:
        """The series of node's first q items (one object per (node, q), for the memo)."""
        key = ("prefix", id(node), q)
        if key not in self.memo:
            self.memo[key] = node.children[0] if q == 1 else Node(_SERIES, node.children[:q])
        return self.memo[key]

    def cost_of(self, nodes) -> float:
        return sum(self.cost(x) for x in nodes)

    def _parallel(self, node: Node, end: int, i: int, d: int, after: int):
        """Branches i..end-1 of a parallel part (in `ordered` order) on d stages."""
        key = ("p", id(node), end, i, d, after if self.capacity is not None else 0)
        if key in self.memo:
            return self.memo[key]
        items = self.ordered(node)
        best = None
        if i == end:
            best = (0, ()) if d == 0 else None
        elif d > 0:
            total = 0.0
            for j in range(i, end):  # branches i..j together in one stage
                total += self.cost(items[j])
                if total > self.limit:
                    break
                rest = self._parallel(node, end, j + 1, d - 1, after)
                members = tuple(sorted(u for x in items[i:j + 1] for u in x.units))
                if rest is not None and self.fits(members, after):
                    best = _better(best, (max(1, rest[0]), ((members,) + rest[1])))
            for mine in range(2, d + 1):  # branch i on devices of its own
                rest = self._parallel(node, end, i + 1, d - mine, after)
                sub = self.solve(items[i], mine, after) if rest is not None else None
                if sub is not None:
                    best = _better(best, (max(sub[0], rest[0]), sub[1] + rest[1]))
        self.memo[key] = best
        return best


def _better(a, b):
    """The shallower; between equals, the first found (deterministic)."""
    return b if a is None or b[0] < a[0] else a


def stage_bytes(units: Sequence[UnitCost], graph: UnitGraph, succs, members: tuple[int, ...],
                count: int, recompute: str = "never") -> int:
    """What a stage of these units needs holding `count` micro-batches: its weights, their
    activations (the waiting ones only their input when recomputed) and its workspace, as
    pyplan.partition.stage_memory counts a chain's stage."""
    part = [units[k] for k in members]
    receives, sends = _crossing(graph, succs, members)
    activations = stage_activations(part)
    waiting = activations if recompute == "never" else recompute_bytes(part, receives)
    return sum(u.weight_bytes for u in part) + activations + (count - 1) * waiting + \
        stage_workspace(part, receives=receives, recompute=recompute, sends=sends)


def _crossing(graph: UnitGraph, succs, members) -> tuple[bool, bool]:
    inside = set(members)
    receives = any(p not in inside for k in members for p in graph.preds[k])
    sends = any(s not in inside for k in members for s in succs[k])
    return receives, sends


def _partition(units, graph: UnitGraph, stages, micro_batches: int, recompute: str,
               alone: bool) -> GraphPartition:
    owner = {k: s for s, st in enumerate(stages) for k in st}
    reads = [{owner[p] for k in st for p in graph.preds[k]} - {s} for s, st in enumerate(stages)]
    order, placed = [], set()  # topological, ties by first unit
    while len(order) < len(stages):
        ready = [s for s in range(len(stages)) if s not in placed and reads[s] <= placed]
        s = min(ready, key=lambda r: stages[r][0])
        order.append(s)
        placed.add(s)
    index = {s: i for i, s in enumerate(order)}
    preds = tuple(tuple(sorted(index[p] for p in reads[s])) for s in order)
    stages = tuple(stages[s] for s in order)
    depth = [1] * len(stages)  # stages from each to the end, itself included
    for s in reversed(range(len(stages))):
        for t in range(s + 1, len(stages)):
            if s in preds[t]:
                depth[s] = max(depth[s], 1 + depth[t])
    succs = graph.succs
    times = [sum(units[k].forward_ms + units[k].backward_ms for k in st) for st in stages]
    memory = tuple(stage_bytes(units, graph, succs, st, 1 if alone else
                               min(micro_batches, depth[s]), recompute)
                   for s, st in enumerate(stages))
    return GraphPartition(stages, preds, max(times), memory, max(depth))


def partition_graph(units: Sequence[UnitCost], graph: UnitGraph, devices: int, *,
                    micro_batches: int, capacity: int | None = None, recompute: str = "never",
                    alone: bool = False, limit: float | None = None
                    ) -> GraphPartition | None:
    """The shallowest stage DAG of `devices` stages (one per device) with the least bottleneck
    (binary search; or the shallowest within `limit` ms) whose stages fit `capacity` bytes
    (None: unlimited) holding the micro-batches their depth keeps in flight (`alone`: one);
    None when none fits."""
    if len(units) != len(graph.preds):
        raise ValueError("the graph needs one entry per unit")
    if not 1 <= devices <= len(units):
        return None
    root = decompose(graph)

    def search(t: float):
        return _Search(units, graph, root, t, capacity, micro_batches, alone,
                       recompute).solve(root, devices, 0)
    if limit is not None:
        found = search(limit)
    else:
        each = [u.forward_ms + u.backward_ms for u in units]
        low, high = max(max(each), sum(each) / devices), sum(each)
        found = search(high)
        if found is None:
            return None
        while high - low > 1e-3 * high:  # the least bottleneck with a solution
            middle = (low + high) / 2
            got = search(middle)
            if got is None:
                low = middle
            else:
                high, found = middle, got
    if found is None:
        return None
    return _partition(units, graph, found[1], micro_batches, recompute, alone)


def graph_candidates(units: Sequence[UnitCost], graph: UnitGraph, devices: int, *,
                     micro_batches: int, capacity: int | None = None,
                     recompute: str = "never") -> list[GraphPartition]:
    """The stage DAGs worth solving: the shallowest at the least bottleneck and at a few larger
    ones (FACTORS), with the in-flight micro-batches' activations counted and with one at a
    time (the least any schedule needs), distinct, in that order."""
    found: dict[tuple, GraphPartition] = {}
    for alone in (False, True):
        best = partition_graph(units, graph, devices, micro_batches=micro_batches,
                               capacity=capacity, recompute=recompute, alone=alone)
        if best is None:
            continue
        found.setdefault(best.stages, best)
        for factor in FACTORS[1:]:
            p = partition_graph(units, graph, devices, micro_batches=micro_batches,
                                capacity=capacity, recompute=recompute, alone=alone,
                                limit=best.bottleneck_ms * factor)
            if p is not None and p.depth < best.depth:
                found.setdefault(p.stages, p)
    return list(found.values())


def graph_plan_text(units: list[UnitCost], graph: UnitGraph, partition: GraphPartition, *,
                    name: str, devices: int, micro_batches: int, capacity: int | None,
                    factory: str, data: str, loss: str, path: str | None,
                    time_unit_ms: float, recompute: str = "never", weights: str | None = None,
                    link=None, optimizer: str | None = None) -> str:
    """A plan of the stage DAG: block stage{s} on device s, after the stages it reads, its
    output the bytes of its units' outputs that other stages read (each reader gets them all,
    pyplan run sends the stage's one output to every successor), the model cut by torch's
    tracer (model.cut: traced) with the stages' units."""
    succs = graph.succs
    about = (f"Written by pyplan partition from {factory}: {len(units)} units in "
             f"{partition.num_stages} stages (graph: a DAG of depth {partition.depth} following "
             f"the model's branches); times measured on this machine, one time unit = "
             f"{time_unit_ms:.4g} ms; block memory: the activations of one micro-batch; "
             "weights: parameters, gradients and optimizer state.")
    lines = ["pyplan: 1", f"name: {name}", "description: >"]
    lines += ["  " + line for line in textwrap.wrap(about, 94)]
    lines.append(f"devices: {devices}")
    if capacity is not None:
        lines.append(f"memory: {capacity}B")
    split = all(u.input_grad_ms is not None for u in units)
    lines += [f"micro_batches: {micro_batches}", "training:",
              "  backward: {time_ratio: 1" + (", weight_time_ratio: 1}" if split else "}"),
              f"  recompute: {recompute}",
              f"topology: {{time_unit_ms: {time_unit_ms:.6g}" + (
                  "" if link is None else f", within_node: {{bandwidth: {link.bandwidth}B, "
                  f"latency_ms: {link.latency_ms:.6g}}}") + "}", "blocks:"]
    names = tuple(f"stage{s}" for s in range(partition.num_stages))
    for s, members in enumerate(partition.stages):
        part = [units[k] for k in members]
        receives, sends = _crossing(graph, succs, members)
        inside = set(members)
        out = sum(graph.output_bytes[k] for k in members
                  if any(t not in inside for t in succs[k]))
        forward = max(1, round(sum(u.forward_ms for u in part) / time_unit_ms))
        backward = max(1, round(sum(u.backward_ms for u in part) / time_unit_ms))
        activations = stage_activations(part)
        if split:
            b = max(1, round(sum(u.input_grad_ms for u in part) / time_unit_ms))
            w = max(1, round(sum(u.weight_grad_ms for u in part) / time_unit_ms))
            held = sum(u.captured_bytes for u in part) - part[-1].released_bytes
            backward_costs = (f"time: {b}, weight_time: {w}, memory: {held}B, "
                              f"weight_memory: {-(activations + held)}B")
        else:
            backward_costs = f"time: {backward}"
        after = ", ".join(names[p] for p in partition.preds[s])
        update = round(sum(u.update_ms for u in part) / time_unit_ms)
        lines.append(
            f"  - {{name: {names[s]}, devices: [{s % devices}], after: [{after}], "
            f"time: {forward}, memory: {activations}B, "
            f"weights: {sum(u.weight_bytes for u in part)}B, "
            f"workspace: {stage_workspace(part, receives, recompute, sends=sends)}B, "
            f"update: {update}" + (f", output: {out}B" if sends else "") +
            f", recompute_memory: {recompute_bytes(part, receives)}B, "
            f"backward: {{{backward_costs}}}}}")
    lines += ["model:", f"  module: {factory}", "  stages:"]
    for s, members in enumerate(partition.stages):
        modules = ", ".join(json.dumps(m) for k in members for m in units[k].module_names)
        lines.append(f"    {names[s]}: [{modules}]")
    lines.append("  cut: traced")
    return model_tail(lines, units, partition, names, everywhere=(), weights=weights,
                      optimizer=optimizer, data=data, loss=loss, path=path)

