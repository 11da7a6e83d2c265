"""The problem IR: the blocks of ONE micro-batch with times, memory deltas and devices, their
dependency DAG, the number of micro-batches, memory capacity and order rules.

Plain, immutable data and what can be computed from it alone (bounds, capacities, copies with a
different number of micro-batches). pyplan.problem builds it from a plan; pyplan.resolved reads
it back from a resolved plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

from pyplan import _core
from pyplan.problem.constraints import RuleSyntaxError, parse_rule
from pyplan.errors import did_you_mean
from pyplan.planfile import MeshSpec, ModelSpec, SearchSpec, format_memory
from pyplan.planfile.plan import MAX_INSTANCES
from pyplan.planfile.units import MAX_MEMORY

__all__ = ["FORWARD", "BACKWARD", "WEIGHT", "OTHER", "Block", "OrderRule", "Problem",
           "RuleError", "is_gradient_kind", "layer_of", "reaches", "resolve_rule"]

FORWARD, BACKWARD, WEIGHT, OTHER = "forward", "backward", "weight", "other"


@dataclass(frozen=True)
class Block:
    """One block of a micro-batch."""

    index: int
    name: str
    """Unique name: the declared name, NAME.b / NAME.w for derived backward blocks."""
    kind: str
    """forward, backward (or input-gradient), weight (weight-gradient) or other."""
    time: int
    memory: int
    devices: tuple[int, ...]
    layer: str
    """The declared block this one derives from (its own name for declared blocks)."""
    weights: int = 0
    """Static memory on each of its devices for the whole run (declared blocks only)."""
    workspace: int = 0
    """Memory it needs while it or its backward runs, beyond what it holds (declared blocks
    only); the largest on a device is reserved there."""
    update: int = 0
    """Time of the optimizer's step over its parameters, after its last backward (declared
    blocks only): not scheduled, part of the predicted iteration."""
    recompute: str = "never"
    """Forward blocks with a derived backward: never, always or auto (the solver chooses)."""
    recompute_memory: int = 0
    """What the block keeps from its forward to its backward when recomputed."""
    recomputed: bool = False
    """Recomputation applied: memory is recompute_memory, the backward's time includes this
    forward's, and while the backward runs it holds `rematerialised` more."""
    rematerialised: int = 0

    @property
    def is_forward(self) -> bool:
        """A declared block (forward or other), not a derived backward or weight gradient."""
        return not is_gradient_kind(self.kind)


def is_gradient_kind(kind: str) -> bool:
    """Whether blocks of this kind compute gradients: backward (the input gradients, or the
    whole backward) or weight (the weight gradients of a split backward). The one place that
    says so; a Block asks through `is_forward`."""
    return kind in (BACKWARD, WEIGHT)


def layer_of(name: str, kind: str) -> str:
    """The declared block a block derives from: NAME for NAME.b and NAME.w."""
    return name.rsplit(".", 1)[0] if is_gradient_kind(kind) else name


@dataclass(frozen=True)
class OrderRule:
    """before[m + before_shift] finishes before after[m + after_shift] starts, for m >= min_m."""

    before: int
    before_shift: int
    after: int
    after_shift: int
    min_m: int
    text: str
    line: int = 0
    column: int = 0
    """Where the rule is written in the plan (0 when unknown)."""


@dataclass(frozen=True)
class Problem:
    """Everything the search needs, and nothing about how the plan was written."""

    name: str
    description: str
    num_devices: int
    memory_capacity: int | None
    """The capacity of every device (None: unlimited); the plan's memory: where the devices
    differ (device_memory)."""
    memory_is_size: bool
    num_micro_batches: int
    training: bool
    blocks: tuple[Block, ...]
    edges: tuple[tuple[int, int], ...]
    rules: tuple[OrderRule, ...] = ()
    transfers: tuple[int, ...] = ()
    """Per edge, the time its data takes between devices (0 within one; empty: all 0)."""
    search: SearchSpec = SearchSpec()
    mesh: MeshSpec = MeshSpec()
    """Data-parallel replicas of this pipeline and their gradient synchronisation."""
    model: ModelSpec | None = None
    time_unit_ms: float | None = None
    """Milliseconds per time unit when the plan says (topology.time_unit_ms)."""
    spec_sha256: str = ""
    source_path: str = ""
    device_memory: tuple[int | None, ...] = ()
    """Each device's capacity where the devices differ (None: unlimited; empty: they all have
    memory_capacity)."""
    device_speed: tuple[float, ...] = ()
    """Each device's speed where some differs from 1 (empty: all 1). The blocks' times already
    include it: a block takes its time / speed on its slowest device."""
    by_name: dict[str, int] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {b.name: b.index for b in self.blocks})
        if not any(self.transfers):  # one form for "no transfers"
            object.__setattr__(self, "transfers", ())

    def block(self, name: str) -> Block:
        return self.blocks[self.by_name[name]]

    @cached_property
    def graph(self) -> _core.Graph:
        """The problem as the C++ core sees it."""
        return _core.Graph(
            self.num_devices,
            [_core.Block(b.name, b.time, b.memory, list(b.devices)) for b in self.blocks],
            list(self.edges),
            [_core.OrderRule(r.before, r.before_shift, r.after, r.after_shift, r.min_m)
             for r in self.rules], list(self.static_memory), list(self.transfers),
            [-1 if c is None else c for c in self.device_memory])

    @cached_property
    def free_graph(self) -> _core.Graph:
        """The graph without the devices' own capacities: for evaluations that report memory
        rather than enforce it (templates, a schedule given by hand). The same graph when the
        devices have one capacity (it goes to each evaluation, not into the graph)."""
        if not self.device_memory:
            return self.graph
        return dataclasses.replace(self, device_memory=()).graph

    @cached_property
    def static_memory(self) -> tuple[int, ...]:
        """Per device, the weights resident for the whole run, and room for the largest
        workspace of a block, with the activations its backward re-materialises when it is
        recomputed (one block runs at a time)."""
        out = [0] * self.num_devices
        room = [0] * self.num_devices
        for b in self.blocks:
            for d in b.devices:
                out[d] += b.weights
                room[d] = max(room[d], b.rematerialised + b.workspace)
        return tuple(w + r for w, r in zip(out, room))

    @cached_property
    def transfer(self) -> dict[tuple[int, int], int]:
        """The transfer time of each edge with one."""
        return {e: t for e, t in zip(self.edges, self.transfers) if t}

    def show_transfers(self) -> str:
        """The range of the transfer times in time units: "3", or "1..5"."""
        times = sorted(set(self.transfer.values()))
        return f"{times[0]}" if len(times) == 1 else f"{times[0]}..{times[-1]}"

    @property
    def recomputed(self) -> tuple[str, ...]:
        """Names of the forward blocks whose activations are recomputed."""
        return tuple(b.name for b in self.blocks if b.recomputed)

    def recompute_choices(self) -> tuple[int, ...]:
        """Forward blocks whose recomputation the solver decides (recompute: auto)."""
        return tuple(b.index for b in self.blocks if b.recompute == "auto" and not b.recomputed)

    def with_recompute(self, chosen, *, rerun: bool = True) -> Problem:
        """The problem with these forward blocks recomputed: each keeps only its
        recompute_memory; its backward first reruns it (the forward's time added) and
        re-materialises the rest of its activations while it runs. rerun=False leaves out
        those two costs: a relaxation no choice of recomputation beats (for lower bounds)."""
        blocks = list(self.blocks)
        for index in sorted(set(chosen)):
            fwd = blocks[index]
            if fwd.recomputed:
                continue
            extra = fwd.memory - fwd.recompute_memory
            back = blocks[self.by_name[f"{fwd.name}.b"]]
            blocks[index] = dataclasses.replace(fwd, memory=fwd.recompute_memory,
                                                recomputed=rerun,
                                                rematerialised=extra if rerun else 0)
            blocks[back.index] = dataclasses.replace(
                back, time=back.time + (fwd.time if rerun else 0), memory=back.memory + extra)
        return dataclasses.replace(self, blocks=tuple(blocks))

    def capacity_of(self, device: int) -> int | None:
        """A device's memory capacity (None: unlimited)."""
        return self.device_memory[device] if self.device_memory else self.memory_capacity

    @property
    def capacities(self) -> tuple[int | None, ...]:
        return tuple(self.capacity_of(d) for d in range(self.num_devices))

    @property
    def limited(self) -> bool:
        """Whether any device's memory is limited."""
        return any(c is not None for c in self.capacities)

    def fits(self, peaks) -> bool:
        """Whether per-device peaks stay within each device's capacity."""
        return all(c is None or p <= c for p, c in zip(peaks, self.capacities))

    def too_large(self) -> str | None:
        """Why the schedule would be too large to lay out (every block of every micro-batch
        has a start time: time and memory grow with their number), or None."""
        instances = len(self.blocks) * self.num_micro_batches
        if instances > MAX_INSTANCES:
            return (f"{len(self.blocks):,} blocks x {self.num_micro_batches:,} micro-batches "
                    f"make {instances:,} block instances, more than the supported "
                    f"{MAX_INSTANCES:,}")
        return None

    def memory_overflow(self) -> tuple[int, str] | None:
        """(device, why) when a device's memory could sum beyond what the core counts in
        int64: its weights, or its weights plus every micro-batch's allocations at once."""
        for d, (weights, worst) in enumerate(_memory_sums(self)):
            if weights > MAX_MEMORY:
                return d, (f"the weights on device {d} sum to {self.show_memory(weights)} "
                           f"({weights:,}), more than the supported 2^60")
            if worst > MAX_SUM:
                return d, (f"device {d} could hold {self.show_memory(worst)} ({worst:,}: its "
                           f"weights and {self.num_micro_batches:,} micro-batches' "
                           "allocations), more than the supported 2^62")
        return None

    def headroom(self, device: int) -> int | None:
        """What the capacity leaves for activations on a device after its weights."""
        capacity = self.capacity_of(device)
        if capacity is None:
            return None
        return capacity - self.static_memory[device]

    @property
    def capacity(self) -> int:
        """Memory capacity of every device for the core: -1 when unlimited, or when the devices
        differ (the core's graph holds each device's own)."""
        if self.device_memory or self.memory_capacity is None:
            return -1
        return self.memory_capacity

    def show_capacity(self) -> str:
        """The capacity for a summary: "8", "unlimited", or one per device "80GiB 40GiB"."""
        if not self.device_memory:
            return self.show_memory(self.memory_capacity)
        return " ".join(self.show_memory(c) for c in self.device_memory)

    def show_speeds(self) -> str | None:
        """Per-device speeds where they differ ("1 1 0.5 0.5"), else None."""
        return " ".join(f"{s:g}" for s in self.device_speed) if self.device_speed else None

    def device_loads(self) -> list[int]:
        return list(self.graph.device_loads())

    def load_bound(self) -> int:
        return self.graph.load_bound()

    def period_bound(self) -> int:
        """No repetend within the memory has a shorter period: the busiest device's load, and
        on each device the least memory-time of a micro-batch over its capacity."""
        return self.graph.period_bound(self.capacity)

    @property
    def sync_time(self) -> int:
        """Time of one stage's gradient synchronisation across data-parallel replicas on a
        device; 0 when there is nothing to synchronise (inference, or one replica)."""
        return self.mesh.sync if self.syncs_gradients else 0

    @property
    def syncs_gradients(self) -> bool:
        """A training plan with data-parallel replicas: each stage's gradients are synchronised."""
        return self.training and self.mesh.data_parallel > 1

    @cached_property
    def trained_layers(self) -> frozenset[int]:
        """The declared blocks that train: those a backward block derives from (their forward
        keeps autograd's graph for it)."""
        return frozenset(self.by_name[b.layer] for b in self.blocks if b.kind == BACKWARD)

    @cached_property
    def split_layers(self) -> frozenset[int]:
        """The declared blocks whose backward is split into B (input gradients) and a weight
        block W (weight gradients; zero-bubble schedules); empty when no backward is split."""
        return frozenset(self.by_name[b.layer] for b in self.blocks if b.kind == WEIGHT)

    def makespan_bound(self) -> int:
        """No schedule of the plan's micro-batches within its memory is shorter than this."""
        bound = self.graph.makespan_bound(self.num_micro_batches, self.capacity)
        if self.syncs_gradients:
            bound = max(bound, self._sync_bound())
        return bound

    def _sync_bound(self) -> int:
        """When the last gradient synchronisation can end at the earliest. On a device, a
        stage's synchronisation waits for the stage's last gradient block there (a stage
        spanning several devices: for the device's last block). Every block that leads to
        those runs n times on its device, one at a time, and the longest path from its end
        to such a gradient's end follows: per device, for each set of those blocks with heads
        and tails above thresholds, least head + n x their time + least tail, and where they
        are all of the device's blocks, n x its load + the idle time before it is first fed
        + least tail. The device's synchronisations then queue one after another, `sync`
        each."""
        blocks, n, sync = self.blocks, self.num_micro_batches, self.mesh.sync
        graph = self.graph
        head, order = graph.heads(), graph.topological_order()
        succ = [list(zip(graph.successors(b), self._delays_out(b))) for b in range(len(blocks))]
        layers_on = []
        for d in range(self.num_devices):
            layers: dict[int, list[int]] = {}
            for b in graph.blocks_on(d):
                if not blocks[b].is_forward:
                    layers.setdefault(self.by_name[blocks[b].layer], []).append(b)
            layers_on.append(layers)
        count = sum(map(len, layers_on))
        if count == 0:
            return 0
        loads = self.device_loads()
        if len(blocks) * count > 2_000_000:  # too many paths: each device's work alone
            return max(n * loads[d] + sync * len(layers) for d, layers in enumerate(layers_on)
                       if layers)
        idle: dict[int, int] = {}
        bound = 0
        for d, layers in enumerate(layers_on):
            on = graph.blocks_on(d)
            ready = []
            for layer, grads in sorted(layers.items()):
                if len(blocks[layer].devices) > 1:
                    grads = list(on)  # it waits for the device's last block
                # to_end[b]: the longest path from b's end to the end of one of `grads`.
                to_end: dict[int, int] = {g: 0 for g in grads}
                for b in reversed(order):
                    for c, delay in succ[b]:
                        if c in to_end:
                            to_end[b] = max(to_end.get(b, 0), delay + blocks[c].time + to_end[c])
                at = 0
                for e in range(self.num_devices):
                    jobs = [(head[b], blocks[b].time, to_end[b]) for b in graph.blocks_on(e)
                            if b in to_end]
                    if not jobs:
                        continue
                    at = max(at, _queue_bound(jobs, n))
                    if len(jobs) == len(graph.blocks_on(e)):
                        if e not in idle:
                            idle[e] = graph.head_idle(e)
                        at = max(at, n * loads[e] + idle[e] + min(q for _, _, q in jobs))
                ready.append(at)
            ready.sort()
            bound = max([bound] + [r + (len(ready) - j) * sync for j, r in enumerate(ready)])
        return bound

    def _delays_out(self, b: int) -> list[int]:
        """Transfer times of b's outgoing edges, aligned with graph.successors(b)."""
        transfer = self.transfer
        return [transfer.get((b, c), 0) for c in self.graph.successors(b)]

    def show_memory(self, amount: int | None) -> str:
        return format_memory(amount, self.memory_is_size)

    def with_overrides(self, *, micro_batches: int | None = None, memory: int | None = None,
                       time_limit: float | None = None, effort: float | None = None,
                       rules: bool = True) -> Problem:
        """A copy with the number of micro-batches, capacity or time limit replaced."""
        changes: dict = {}
        if micro_batches is not None:
            changes["num_micro_batches"] = micro_batches
        if memory is not None:  # the same on every device
            changes["memory_capacity"] = memory
            changes["device_memory"] = ()
        if time_limit is not None:
            changes["search"] = dataclasses.replace(self.search, time_limit=time_limit)
        if effort is not None:
            changes["search"] = dataclasses.replace(changes.get("search", self.search),
                                                    effort=float(effort))
        if not rules:
            changes["rules"] = ()
        return dataclasses.replace(self, **changes) if changes else self


def _queue_bound(jobs: list[tuple[int, int, int]], n: int) -> int:
    """Jobs (head, time, tail), n instances each, one at a time on one machine: the latest
    end plus tail cannot be earlier than least head + n x total time + least tail of any set
    of them with heads and tails above thresholds."""
    best = 0
    by_tail = sorted(jobs, key=lambda j: -j[2])
    for floor in {h for h, _, _ in jobs}:
        load, least = 0, None
        for h, t, q in by_tail:
            if h >= floor:
                load += t
                least = h if least is None else min(least, h)
                best = max(best, least + n * load + q)
    return best


MAX_SUM = 2**62  # a device's memory at any time, weights included, in the core's int64


def _memory_sums(problem: Problem) -> list[tuple[int, int]]:
    """Per device: its weights and the most it could hold (weights, re-materialised room and
    every micro-batch's allocations)."""
    weights = [0] * problem.num_devices
    allocated = [0] * problem.num_devices
    for b in problem.blocks:
        for d in b.devices:
            weights[d] += b.weights
            allocated[d] += max(0, b.memory) + b.rematerialised + b.workspace
    return [(w, w + problem.num_micro_batches * a) for w, a in zip(weights, allocated)]


class RuleError(RuleSyntaxError):
    """A well-formed order rule that does not fit the blocks (unknown name, contradiction)."""


def resolve_rule(text: str, blocks, by_name: dict[str, int], edges) -> OrderRule:
    """An order rule over these blocks (for a plan and for a resolved plan alike): a
    RuleSyntaxError when malformed, a RuleError (with the offset of the problem) for unknown
    names and for a rule that contradicts a dependency."""
    parsed = parse_rule(text)
    indices = []
    for name, at in ((parsed.before, parsed.before_at), (parsed.after, parsed.after_at)):
        target = name[:-2] if name.endswith(".f") else name
        if target not in by_name or (name.endswith(".f") and
                                     blocks[by_name[target]].kind != FORWARD):
            names = list(by_name) + [f"{n}.f" for n, i in by_name.items()
                                     if blocks[i].kind == FORWARD]
            raise RuleError(f"order rule '{text}' names unknown block '{name}'", at,
                                  did_you_mean(name, names) or
                                  "use a block name, NAME.f, NAME.b or NAME.w")
        indices.append(by_name[target])
    before, after = indices
    if parsed.before_shift == parsed.after_shift and reaches(edges, after, before):
        names = (blocks[after].name, blocks[before].name)
        raise RuleError(
            f"order rule '{text}' contradicts the dependencies: {names[1]} depends on "
            f"{names[0]} within a micro-batch" if after != before else
            f"order rule '{text}' orders a block before itself", parsed.before_at,
            "swap the two sides or change a shift")
    return OrderRule(before, parsed.before_shift, after, parsed.after_shift, parsed.min_m, text)


def reaches(edges, source: int, target: int) -> bool:
    """Whether `target` is `source` or depends on it, directly or not."""
    successors: dict[int, list[int]] = {}
    for a, c in edges:
        successors.setdefault(a, []).append(c)
    seen, stack = {source}, [source]
    while stack:
        b = stack.pop()
        if b == target:
            return True
        for c in successors.get(b, ()):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return False
