"""A schedule: per-device orders of (block, micro-batch) and the as-early-as-possible times the
core computes for them, with its warmup / repetend / cooldown structure when it has one.

Orders are the schedule; times follow from them (every block starts as soon as its inputs,
its devices and the order allow), and memory on a device depends only on its order. With
data-parallel replicas (`mesh:`), each stage's gradient synchronisation follows too: it starts
after the stage's last gradient block on a device, beside the compute, and the makespan is
the end of the compute or of the last synchronisation, whichever is later.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from pyplan import _core
from pyplan.errors import PlanError
from pyplan.problem import Problem, reaches

__all__ = ["Evaluated", "Instance", "Repetend", "Schedule", "Sync", "build_schedule",
           "gradient_syncs", "repetend_from_core", "schedule_from_orders", "with_syncs"]

Instance = tuple[int, int]  # (block index, micro-batch)
DeviceOrders = tuple[tuple[Instance, ...], ...]
Orders = Sequence[Sequence[Instance]]  # per device, as given (lists or tuples)


@dataclass(frozen=True)
class Repetend:
    """One repetition of the steady state: block b processes micro-batch j + indices[b] in
    repetition j, each device runs its blocks in `orders[d]`, one repetition per period."""

    indices: tuple[int, ...]
    orders: tuple[tuple[int, ...], ...]
    period: int
    bubble_rate: float
    peak_memory: tuple[int, ...]

    @property
    def num_micro_batches(self) -> int:
        return max(self.indices) + 1

    def core(self, problem: Problem) -> _core.Repetend:
        return _core.evaluate_repetend(problem.graph, list(self.indices),
                                       [list(o) for o in self.orders])


def repetend_from_core(problem: Problem, rep: _core.Repetend) -> Repetend:
    return Repetend(tuple(rep.indices), tuple(tuple(o) for o in rep.orders), rep.period,
                    rep.bubble_rate(problem.graph), tuple(rep.peak_memory))


@dataclass(frozen=True)
class Sync:
    """One stage's gradient synchronisation across the data-parallel replicas, on one device."""

    device: int
    layer: int
    """The declared block whose parameters' gradients it carries."""
    start: int
    end: int


def gradient_syncs(problem: Problem, orders: Orders, start: Sequence[int]) -> tuple[Sync, ...]:
    """The synchronisations of a training plan with data-parallel replicas: on each device, one
    per stage, ready when the stage's last gradient block there (its weight gradient when split)
    ends (for a block on several devices, when the device's last block does), one after
    another on the device's communication stream, `mesh.sync` long each."""
    if not problem.syncs_gradients:
        return ()
    blocks, k = problem.blocks, len(problem.blocks)
    syncs = []
    for d, order in enumerate(orders):
        ready: dict[int, int] = {}
        for b, m in order:
            if not blocks[b].is_forward:
                layer = problem.by_name[blocks[b].layer]
                ready[layer] = max(ready.get(layer, 0), start[m * k + b] + blocks[b].time)
        # A block on several devices first sums its replicated gradients over them, after
        # the device's last block (the runtime's REDUCE): its sync waits for that.
        end = max((start[m * k + b] + blocks[b].time for b, m in order), default=0)
        for layer in ready:
            if len(blocks[layer].devices) > 1:
                ready[layer] = end
        free = 0
        for layer, at in sorted(ready.items(), key=lambda item: (item[1], item[0])):
            free = max(free, at) + problem.mesh.sync
            syncs.append(Sync(d, layer, free - problem.mesh.sync, free))
    return tuple(syncs)


@dataclass(frozen=True)
class Schedule:
    """A complete, verified schedule of all micro-batches."""

    problem: Problem
    warmup: DeviceOrders
    repetend: Repetend | None
    cooldown: DeviceOrders
    """Micro-batches relative to the last repetition: m stands for m + N - N_R."""
    orders: DeviceOrders
    start: tuple[int, ...]  # [mb * K + block]
    makespan: int
    busy: tuple[int, ...]
    peak_memory: tuple[int, ...]
    bubble_rate: float
    syncs: tuple[Sync, ...] = ()
    """Gradient synchronisations across data-parallel replicas (none without `mesh:`)."""

    @property
    def num_micro_batches(self) -> int:
        return self.problem.num_micro_batches

    @property
    def repetend_count(self) -> int:
        if self.repetend is None:
            return 0
        return self.num_micro_batches - self.repetend.num_micro_batches + 1

    def start_of(self, block: int, mb: int) -> int:
        return self.start[mb * len(self.problem.blocks) + block]

    def end_of(self, block: int, mb: int) -> int:
        return self.start_of(block, mb) + self.problem.blocks[block].time

    def iteration(self, *, synchronised: bool = False) -> int:
        """A training iteration: each device steps its optimizer over its blocks' parameters
        (their `update` times) once its last block and synchronisation end; `synchronised`
        (gradient clipping: a norm over every device first), after the makespan."""
        updates, ends = [0] * self.problem.num_devices, [0] * self.problem.num_devices
        for b in self.problem.blocks:
            for d in b.devices:
                updates[d] += b.update
        for d in range(self.problem.num_devices):
            ends[d] = max([e for _, _, _, e in self.entries(d)] +
                          [s.end for s in self.syncs if s.device == d])
        if synchronised:
            return self.makespan + max(updates)
        return max(self.makespan, *(e + u for e, u in zip(ends, updates)))

    def entries(self, device: int) -> list[tuple[int, int, int, int]]:
        """(block, micro-batch, start, end) of a device, in execution order."""
        return [(b, m, self.start_of(b, m), self.end_of(b, m)) for b, m in self.orders[device]]

    @cached_property
    def phase_of(self) -> dict[Instance, str]:
        """'warmup', 'repetend' or 'cooldown' for every instance."""
        phase = {}
        shift = self.num_micro_batches - (self.repetend.num_micro_batches
                                          if self.repetend else 0)
        for order in self.warmup:
            for inst in order:
                phase[inst] = "warmup"
        for order in self.cooldown:
            for b, m in order:
                phase[(b, m + shift)] = "cooldown"
        for order in self.orders:
            for inst in order:
                phase.setdefault(inst, "repetend")
        return phase

    def repetend_window(self) -> tuple[int, int] | None:
        """Start of the first repetition and end of the last, or None without a repetend."""
        if self.repetend is None:
            return None
        rep = self.repetend
        first = [(b, rep.indices[b]) for b in range(len(rep.indices))]
        last = [(b, rep.indices[b] + self.repetend_count - 1) for b in range(len(rep.indices))]
        return (min(self.start_of(b, m) for b, m in first),
                max(self.end_of(b, m) for b, m in last))


def build_schedule(problem: Problem, warmup: Orders, repetend: Repetend | None,
                   cooldown: Orders) -> Schedule:
    """Compose warmup + repetend x (N - N_R + 1) + cooldown, evaluate and verify it.

    Raises RuntimeError when the composition does not run (a bug, not a user error).
    """
    graph = problem.graph
    n = problem.num_micro_batches
    warmup = tuple(tuple(map(tuple, o)) for o in warmup)
    cooldown = tuple(tuple(map(tuple, o)) for o in cooldown)
    if repetend is None:
        orders, prepared = warmup, [list(o) for o in warmup]
    else:
        # (prepared: the core's copy, evaluated without converting the orders back)
        prepared = _core.extend(graph, [list(o) for o in warmup], repetend.core(problem),
                                [list(o) for o in cooldown], n)
        orders = tuple(map(tuple, prepared.tolist()))
    ev = _core.evaluate(graph, prepared, memory_capacity=problem.capacity,
                        complete_micro_batches=n)
    if not ev.ok:
        raise RuntimeError(f"composed schedule does not run: {ev.reason}")
    return _timed(problem, warmup, repetend, cooldown, orders, ev)


def with_syncs(problem: Problem, orders: Orders,
               ev: _core.Evaluation) -> tuple[tuple[Sync, ...], int, float]:
    """The gradient synchronisations of orders the core evaluated, and the makespan and bubble
    rate with them (they may end after the compute)."""
    if not problem.syncs_gradients:
        return (), ev.makespan, ev.bubble_rate  # (ev.start copies the whole vector: skip it)
    syncs = gradient_syncs(problem, orders, ev.start)
    makespan = max([ev.makespan] + [s.end for s in syncs])
    bubble_rate = ev.bubble_rate if makespan == ev.makespan else \
        1 - sum(ev.busy) / (problem.num_devices * makespan)
    return syncs, makespan, bubble_rate


def _timed(problem: Problem, warmup: DeviceOrders, repetend: Repetend | None,
           cooldown: DeviceOrders, orders: DeviceOrders, ev: _core.Evaluation) -> Schedule:
    syncs, makespan, bubble_rate = with_syncs(problem, orders, ev)
    return Schedule(problem, warmup, repetend, cooldown, orders, tuple(ev.start), makespan,
                    tuple(ev.busy), tuple(ev.peak_memory), bubble_rate, syncs)


@dataclass(frozen=True)
class Evaluated:
    """A schedule evaluated as given."""

    schedule: Schedule
    fits_memory: bool
    follows_rules: bool | None
    """None when the plan has no order rules."""


def _deadlock_position(problem: Problem, holds: list, where: dict[Instance, tuple[int, int]]
                       ) -> tuple[int, int]:
    """Where a deadlock's orders break: an action placed ahead of one it depends on (a certain
    mistake), else the first action in the cycle that holds a device."""
    holders = [(tuple(h), tuple(w)) for h, w in holds if tuple(h) in where]
    for (hb, hm), (wb, wm) in holders:
        if hm == wm and reaches(problem.edges, wb, hb):
            return where[(hb, hm)]
    return where[holders[0][0]] if holders else (1, 1)


def schedule_from_orders(problem: Problem, orders: Orders, num_micro_batches: int, *,
                         file: str | None = None,
                         where: dict[Instance, tuple[int, int]] | None = None) -> Evaluated:
    """Every block as early as its inputs, devices and the given orders allow (the core's
    evaluation). PlanError when the orders cannot run, at the (line, column) `where` gives for
    the action out of place; memory beyond capacity is reported."""
    problem = problem.with_overrides(micro_batches=num_micro_batches)
    graph, n = problem.graph, num_micro_batches
    lists = [list(order) for order in orders]
    ev = _core.evaluate(graph, lists, memory_capacity=problem.capacity,
                        complete_micro_batches=n, enforce_rules=False)
    fits = ev.ok
    if not ev.ok:  # over capacity or deadlocked: which one?
        ev = _core.evaluate(problem.free_graph, lists, complete_micro_batches=n,
                            enforce_rules=False)
        if not ev.ok:
            at = _deadlock_position(problem, ev.deadlock_holds, where or {})
            raise PlanError(f"the schedule cannot run: {ev.reason}",
                            hint="each rank's actions must follow the dependencies", file=file,
                            line=at[0], column=at[1])
    follows = None
    if problem.rules:  # rules that hold leave every start time where it was
        ruled = _core.evaluate(problem.free_graph, lists, complete_micro_batches=n)
        follows = ruled.ok and list(ruled.start) == list(ev.start)
    frozen = tuple(tuple(tuple(inst) for inst in order) for order in orders)
    schedule = _timed(problem, frozen, None, tuple(() for _ in orders), frozen, ev)
    return Evaluated(schedule, fits, follows)
