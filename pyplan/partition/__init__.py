"""From measured unit costs to pipeline stages, and from stages to a plan (`pyplan partition`).

A model is a chain of units (its children, nn.Sequential / nn.ModuleList flattened). A
partition cuts the chain into contiguous stages: V-shape, stage s on device s; interleaved,
stage s on device s mod D (C chunks per device). It is chosen by exact dynamic programming over
the split points: the least bottleneck (the slowest stage's forward + backward time) such that
each stage fits in memory, counting its units' weights (parameters, gradients and optimizer
state) and the activations it holds at its peak (`Held`). Two counts of those activations give
the candidates: the micro-batches 1F1B keeps in flight (stage s of S: min(N, S - s)), which a
schedule at full throughput needs, and one micro-batch at a time, the least any schedule needs
and what `solve` checks before it searches (it then keeps fewer micro-batches in flight and
the schedule is longer). With recomputation the micro-batches waiting for their backward keep
only the stage's input. Interleaved, a device's memory is shared by its C stages as capacity /
C each, a conservative split. The least bottleneck does not always give the shortest schedule,
so the best few partitions of both kinds and the even splits people write by hand are all
solved and the shortest makespan wins: `solve` has the last word on what fits. Devices may
differ (mixed GPU types): a stage's capacity is its device's, and its time is the units' time
divided by its device's speed, so slower or smaller devices get fewer units.

Nothing here needs torch: the costs come from pyplan.measure.profile.
"""

from __future__ import annotations

import itertools
import json
import math
import textwrap
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyplan.planfile.types import LinkSpec

__all__ = ["MAX_ENUMERATED", "RECOMPUTE", "Held", "Partition", "UnitCost", "best_partitions",
           "candidates", "even_partitions", "host_capacity", "optimal_partition", "plan_text",
           "recompute_bytes", "smallest_capacity", "stage_activations", "stage_memory",
           "stage_workspace", "step_bytes", "ties", "weight_bytes"]

MAX_ENUMERATED = 20_000  # partitions: up to this many, every one is ranked (else the DP's alone)
# State tensors per parameter besides its gradient, by the names `pyplan run --optimizer`
# takes (pyplan.train.training.OPTIMIZERS): the optimizer is an input of the memory model.
OPTIMIZER_STATE = {"sgd": 0, "adamw": 2}


def weight_bytes(params: list, optimizer: str, *, tensor: int = 1,
                 sharded: Collection[int] = ()) -> int:
    """What `params` hold for the whole run: themselves, their gradients and the optimizer's
    state (AdamW: two moments each, and its step count, a 4-byte tensor per parameter); on one
    of `tensor` ranks, 1/tensor of each parameter whose id is in `sharded`."""
    size = sum(p.numel() * p.element_size() // (tensor if id(p) in sharded else 1)
               for p in params)
    return size * (2 + OPTIMIZER_STATE[optimizer]) + (4 * len(params) if optimizer == "adamw"
                                                      else 0)


@dataclass(frozen=True)
class UnitCost:
    """What one unit (a submodule) costs for one micro-batch."""

    name: str
    forward_ms: float
    backward_ms: float
    activation_bytes: int
    """Saved by autograd in the forward, held until the backward."""
    weight_bytes: int
    """Resident for the whole run: parameters, their gradients and the optimizer's state."""
    input_bytes: int = 0
    """Its input: what it keeps when recomputed."""
    output_bytes: int = 0
    """Its output: what goes to the next stage when it ends one."""
    modules: tuple[str, ...] = ()
    """The model's modules it holds (default: the one its name names)."""
    parameters: tuple[str, ...] = ()
    """The names of its parameters in the model (a parameter two units share, under one
    name): where stages share one, the plan records a tie."""
    forward_peak_bytes: int = 0
    """The most its forward allocates at once (what it keeps, its output, temporaries; not
    its input, which exists before)."""
    backward_peak_bytes: int = 0
    """The most its backward allocates at once beyond what its forward left, with the
    gradient it receives."""
    saved_input_bytes: int = 0
    """Of activation_bytes, its input's: the unit before may save the same tensor as its
    output (a ReLU's or Tanh's), which a stage holds once."""
    saved_output_bytes: int = 0
    """Of activation_bytes, its output's."""
    batch_bytes: int = 0
    """The global batch (inputs and targets) that a rank running a stage with this unit holds
    for the whole iteration: the data's, on the ranks that read the inputs or compute the
    loss."""
    update_ms: float = 0.0
    """The optimizer's step over its parameters (with their gradients zeroed for the next
    iteration), once per iteration."""
    update_peak_bytes: int = 0
    """The most that step allocates at once beyond the optimizer's state (AdamW's
    denominators): its temporaries."""
    update_at_once: bool = False
    """The step makes its temporaries for all the parameters at once (torch's foreach step,
    on a GPU), so a stage's add up; else one parameter at a time (on the CPU), the largest
    counts."""
    input_grad_ms: float | None = None
    """Split backward (zero bubble): the input gradients' time (B); None: not measured."""
    weight_grad_ms: float = 0.0
    """Split backward: the weight gradients' time (W)."""
    captured_bytes: int = 0
    """Split backward: the gradients B keeps for W."""
    released_bytes: int = 0
    """Split backward: what the graph above W's pieces saved (a loss's log-probabilities),
    freed once B is done with the unit's outputs. Only a stage's last unit's is freed: above
    the others sit the next units, which W's pieces keep."""

    @property
    def module_names(self) -> tuple[str, ...]:
        return self.modules or (self.name,)


@dataclass(frozen=True)
class Partition:
    bounds: tuple[int, ...]
    """Stage s runs units bounds[s] .. bounds[s + 1] - 1 (bounds[0] = 0, bounds[-1] = units)."""
    bottleneck_ms: float
    memory: tuple[int, ...]
    """Bytes each stage needs: its weights and its in-flight activations."""

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def stage(self, s: int) -> range:
        return range(self.bounds[s], self.bounds[s + 1])


def _in_flight(stage: int, num_stages: int, micro_batches: int) -> int:
    return max(1, min(micro_batches, num_stages - stage))


RECOMPUTE = ("never", "always", "auto")


@dataclass(frozen=True)
class Held:
    """Which activations a stage is counted as holding at its peak."""

    alone: bool = False
    """One micro-batch at a time (the least any schedule needs); else the micro-batches 1F1B
    keeps in flight."""
    recompute: str = "never"
    """never; always: the micro-batches waiting for their backward keep only the stage's
    input, and the one in its backward holds all its activations again (its workspace is the
    recomputed backward's); auto: the solver decides per stage, so the waiting micro-batches
    are counted as keeping their input and the workspace has room for either backward."""


def _shared(before: UnitCost, unit: UnitCost) -> int:
    """The bytes two consecutive units both save: the one tensor between them."""
    return min(before.saved_output_bytes, unit.saved_input_bytes)


def stage_activations(part: Sequence[UnitCost]) -> int:
    """What a stage's forward keeps for its backward (block `memory:`): what its units save,
    a tensor two of them save once."""
    return sum(u.activation_bytes for u in part) - sum(
        _shared(a, b) for a, b in zip(part, part[1:]))


def recompute_bytes(part: Sequence[UnitCost], receives: bool = True) -> int:
    """What a stage keeps of a micro-batch it recomputes (block `recompute_memory:`): its
    received input, never more than it saves; nothing for a first stage, whose input is a
    view of the batch (held anyway)."""
    return min(part[0].input_bytes, stage_activations(part)) if receives else 0


def stage_workspace(part: Sequence[UnitCost], receives: bool = True,
                    recompute: str = "never", sends: bool = False) -> int:
    """What a stage of these units needs while it runs beyond what its plan holds (block
    `workspace:`). A device reserves its blocks' largest beside the most its micro-batches
    hold at once, and the plan adds a micro-batch's activations when its forward starts and
    frees them when its backward starts (pyplan.problem.ir); so the workspace is the stage's
    most at any moment of one micro-batch, less its activations:

    - in unit k's forward, the units before it keep theirs, its input is alive (received, or
      the output of the unit before unless that one saved it) and it allocates its forward's
      peak;
    - in unit k's backward, the units up to it still hold theirs (autograd frees a unit's
      saved tensors once past it) and it allocates its backward's peak, with the gradient it
      receives;
    - recomputed (`recompute` always), the plan adds back all but the kept input when the
      backward starts; the backward reruns the forward (its peaks as above) and then runs as
      above, the input held throughout (beside the activations, unless the first unit saves
      it); the forward without autograd holds the input and one unit's peak;
    - `recompute` auto: room for either;
    - a transfer lives until the peer has it, while the next blocks run: the output sent on
      (`sends`, unless the last unit saves it) and the input's gradient sent back
      (`receives`), one of each;
    - the optimizer's step, after the last backward, makes its temporaries (`step_bytes`)
      where the micro-batches' activations are gone;
    - and a stage holding a unit with `batch_bytes` holds the data's global batch
      throughout."""
    total = stage_activations(part)
    first = part[0].input_bytes if receives else 0
    unsaved = first - min(first, part[0].saved_input_bytes)  # the input beside what is saved
    forward = backward = rerun = plain = 0
    below = 0  # what the units before k save
    for k, unit in enumerate(part):
        arg = first if k == 0 else part[k - 1].output_bytes - part[k - 1].saved_output_bytes
        now = below + arg + unit.forward_peak_bytes
        forward = max(forward, now)
        rerun = max(rerun, now + (unsaved if k else 0))
        plain = max(plain, arg + unit.forward_peak_bytes + (first if k else 0))
        below += unit.activation_bytes - (_shared(part[k - 1], unit) if k else 0)
        backward = max(backward, below + unit.backward_peak_bytes)
    never = max(forward, backward) - total
    always = max(plain, rerun, backward + unsaved) - total
    room = {"never": never, "always": always, "auto": max(never, always)}[recompute]
    room += first + (part[-1].output_bytes - part[-1].saved_output_bytes if sends else 0)
    # The step runs when no micro-batch holds anything, and a device's peak counts at least
    # one micro-batch's activations beside the workspace: room for the step beyond them.
    return max(room, step_bytes(part) - total, 0) + max(u.batch_bytes for u in part)


def step_bytes(part: Sequence[UnitCost]) -> int:
    """The optimizer step's temporaries for a stage: after the last backward, when no
    micro-batch holds anything."""
    if any(u.update_at_once for u in part):
        return sum(u.update_peak_bytes for u in part)
    return max(u.update_peak_bytes for u in part)


def stage_memory(units: list[UnitCost], first: int, last: int, stage: int, num_stages: int,
                 micro_batches: int, held: Held = Held()) -> int:
    """Bytes stage `stage` needs for units first .. last - 1: weights, the activations
    `held` counts and its workspace."""
    part = units[first:last]
    activations = stage_activations(part)
    count = 1 if held.alone else _in_flight(stage, num_stages, micro_batches)
    waiting = activations if held.recompute == "never" else recompute_bytes(part, first > 0)
    return sum(u.weight_bytes for u in part) + activations + (count - 1) * waiting + \
        stage_workspace(part, receives=first > 0, recompute=held.recompute,
                        sends=last < len(units))


def host_capacity(memory: Capacity, host: int, devices: int, baseline: int) -> Capacity:
    """Per device, the memory a CPU rank may hold in tensors when `devices` ranks share a
    machine's `host` bytes and each process needs `baseline` bytes besides (Python, torch,
    the model's code): the host's share less the baseline, or `memory` where that is less. On
    the CPU a stage's memory is host memory, so this bounds its parameters, gradients,
    optimizer state and activations together, and partition balances them against it."""
    share = max(host // max(devices, 1) - baseline, 1)
    if memory is None or isinstance(memory, int):
        return share if memory is None else min(memory, share)
    return [share if m is None else min(m, share) for m in memory]


def _time(units: list[UnitCost], first: int, last: int, speed: float = 1.0) -> float:
    return sum(u.forward_ms + u.backward_ms for u in units[first:last]) / speed


Capacity = int | None | Sequence[int | None]
"""Bytes per stage: one amount for every stage, or one per stage (None: unlimited)."""


def _per_stage(capacity: Capacity, num_stages: int) -> list[int | None]:
    if capacity is None or isinstance(capacity, int):
        return [capacity] * num_stages
    if len(capacity) != num_stages:
        raise ValueError(f"need one capacity per stage ({num_stages}), got {len(capacity)}")
    return list(capacity)


def _speeds(speeds: Sequence[float] | None, num_stages: int) -> list[float]:
    if speeds is None:
        return [1.0] * num_stages
    if len(speeds) != num_stages or not all(s > 0 for s in speeds):
        raise ValueError(f"need one positive speed per stage ({num_stages})")
    return [float(s) for s in speeds]


def _fits(partition: Partition, caps: list[int | None]) -> bool:
    return all(c is None or m <= c for m, c in zip(partition.memory, caps))


def optimal_partition(units: list[UnitCost], num_stages: int, *, micro_batches: int,
                      capacity: Capacity, speeds: Sequence[float] | None = None,
                      held: Held = Held()) -> Partition | None:
    """The partition with the least bottleneck whose stages fit `capacity` bytes each (or
    their own, per stage; None when none fits), a stage taking its units' time over its
    speed: exact dynamic programming over split points, O(stages x units^2)."""
    k = len(units)
    if num_stages > k:
        return None
    caps, speed = _per_stage(capacity, num_stages), _speeds(speeds, num_stages)
    prefix = [0.0]
    for u in units:
        prefix.append(prefix[-1] + u.forward_ms + u.backward_ms)
    inf = math.inf
    # best[s][j]: least bottleneck of stages 0..s-1 over units 0..j-1; cut[s][j]: where stage
    # s-1 starts in it.
    best = [[inf] * (k + 1) for _ in range(num_stages + 1)]
    cut = [[-1] * (k + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, k - (num_stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                if caps[s - 1] is not None and \
                        stage_memory(units, i, j, s - 1, num_stages, micro_batches,
                                     held) > caps[s - 1]:
                    continue
                value = max(best[s - 1][i], (prefix[j] - prefix[i]) / speed[s - 1])
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    if best[num_stages][k] == inf:
        return None
    bounds = [k]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return _partition(units, tuple(reversed(bounds)), micro_batches, speed, held)


def _partition(units: list[UnitCost], bounds: tuple[int, ...], micro_batches: int,
               speeds: Sequence[float] | None = None, held: Held = Held()) -> Partition:
    stages = len(bounds) - 1
    speed = _speeds(speeds, stages)
    return Partition(bounds, max(_time(units, bounds[s], bounds[s + 1], speed[s])
                                 for s in range(stages)),
                     tuple(stage_memory(units, bounds[s], bounds[s + 1], s, stages,
                                        micro_batches, held) for s in range(stages)))


def best_partitions(units: list[UnitCost], num_stages: int, *, micro_batches: int,
                    capacity: Capacity, keep: int = 3,
                    speeds: Sequence[float] | None = None, held: Held = Held()
                    ) -> list[Partition]:
    """The `keep` best partitions by bottleneck (then memory), every partition ranked when
    there are at most MAX_ENUMERATED, else the dynamic programme's optimum alone."""
    k = len(units)
    if num_stages > k:
        return []
    if math.comb(k - 1, num_stages - 1) > MAX_ENUMERATED:
        found = optimal_partition(units, num_stages, micro_batches=micro_batches,
                                  capacity=capacity, speeds=speeds, held=held)
        return [found] if found else []
    caps = _per_stage(capacity, num_stages)
    ranked = []
    for cuts in itertools.combinations(range(1, k), num_stages - 1):
        p = _partition(units, (0, *cuts, k), micro_batches, speeds, held)
        if _fits(p, caps):
            ranked.append(p)
    ranked.sort(key=lambda p: (p.bottleneck_ms, max(p.memory), p.bounds))
    return ranked[:keep]


def even_partitions(units: list[UnitCost], num_stages: int, *, micro_batches: int,
                    capacity: Capacity, speeds: Sequence[float] | None = None,
                    held: Held = Held()) -> list[Partition]:
    """The splits people write by hand, where they fit: the units evenly by count, and the
    layers evenly with the first unit (an embedding) on the first stage and the last (a head)
    on the last (Megatron-LM's default). The search's results are compared with them."""
    k = len(units)
    if num_stages > k:
        return []
    by_count = tuple(round(k * s / num_stages) for s in range(num_stages + 1))
    splits = [by_count]
    if k - 2 >= num_stages:
        layers = k - 2
        splits.append((0, *(1 + round(layers * s / num_stages) for s in range(1, num_stages)),
                       k))
    caps = _per_stage(capacity, num_stages)
    out = []
    for bounds in dict.fromkeys(splits):
        if all(bounds[s] < bounds[s + 1] for s in range(num_stages)):
            p = _partition(units, bounds, micro_batches, speeds, held)
            if _fits(p, caps):
                out.append(p)
    return out


def candidates(units: list[UnitCost], num_stages: int, *, micro_batches: int,
               capacity: Capacity, speeds: Sequence[float] | None = None,
               recompute: str = "never", keep: int = 3) -> list[Partition]:
    """The partitions worth solving: the best `keep` by bottleneck whose stages fit with 1F1B's
    micro-batches in flight, the best `keep` that fit one micro-batch at a time, and the even
    splits that fit at all. Empty only when no partition fits one micro-batch at a time, which
    no schedule can beat (solve refuses such a plan before it searches)."""
    options = dict(micro_batches=micro_batches, capacity=capacity, speeds=speeds)
    steady, alone = Held(recompute=recompute), Held(alone=True, recompute=recompute)
    found = best_partitions(units, num_stages, keep=keep, held=steady, **options) + \
        best_partitions(units, num_stages, keep=keep, held=alone, **options) + \
        even_partitions(units, num_stages, held=alone, **options)
    unique: dict[tuple[int, ...], Partition] = {}
    for p in found:
        unique.setdefault(p.bounds, p)
    return list(unique.values())


def smallest_capacity(units: list[UnitCost], num_stages: int,
                      recompute: str = "never") -> int | None:
    """The least memory per stage that admits some partition into `num_stages` stages (each
    stage's weights, one micro-batch's activations and its workspace; recomputation does not
    lower it much, the stage in its backward holds them all): exact minimax dynamic
    programming. None when there are fewer units than stages."""
    k = len(units)
    if not 1 <= num_stages <= k:
        return None
    alone = Held(alone=True, recompute=recompute)
    best = [[math.inf] * (k + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for j in range(s, k - (num_stages - s) + 1):
            best[s][j] = min(max(best[s - 1][i], stage_memory(units, i, j, s - 1, num_stages,
                                                              1, alone))
                             for i in range(s - 1, j))
    return int(best[num_stages][k])


def ties(units: list[UnitCost], partition: Partition,
         everywhere: tuple[str, ...] = (), names: tuple[str, ...] | None = None
         ) -> list[tuple[str, tuple[str, ...]]]:
    """(parameter, the stages holding it) for every parameter more than one stage holds: one
    used by units of two stages, or one every stage keeps (`everywhere`). Stage s is named
    names[s] (default stage{s})."""
    names = names or tuple(f"stage{s}" for s in range(partition.num_stages))
    holders: dict[str, list[str]] = {name: [] for name in everywhere}
    for s in range(partition.num_stages):
        for i in partition.stage(s):
            for name in units[i].parameters:
                stages = holders.setdefault(name, [])
                if names[s] not in stages:
                    stages.append(names[s])
    for name in everywhere:
        holders[name] = list(names)
    return sorted((name, tuple(stages)) for name, stages in holders.items() if len(stages) > 1)


def plan_text(units: list[UnitCost], partition: Partition, *, name: str, devices: int,
              micro_batches: int, capacity: int | None | Sequence[int | None], factory: str,
              data: str, loss: str, path: str | None, time_unit_ms: float, shape: str,
              cut: str = "chain", layer_returns: str = "tensor",
              everywhere: tuple[str, ...] = (), recompute: str = "never",
              speeds: Sequence[float] | None = None, names: tuple[str, ...] | None = None,
              placement: tuple[tuple[int, ...] | None, ...] | None = None,
              vocab: tuple[str, str] | None = None, weights: str | None = None,
              link: LinkSpec | None = None, optimizer: str | None = None,
              mesh: str | None = None) -> str:
    """A plan for `partition`: one block per stage (stage s on device s mod devices, or on
    placement[s], None for all devices; named names[s], default stage{s}) with the measured
    times in units of `time_unit_ms`, activation memory, weights, output (timed on `link`,
    written as topology.within_node; None: the default, a GPU node's) and recompute memory (the stage's input) in bytes, and a model: section naming each
    stage's submodules (and with `vocab`, the embedding and head its all-device blocks shard
    over the vocabulary: model.vocab_parallel; with `weights`, the checkpoint the parameters
    start from: model.weights). `capacity` per device (a list) or `speeds` write the devices
    one by one (devices: [{memory, speed}, ...]). Units measured with a split backward give
    each block its input and weight gradients apart (zero bubble): B keeps the graph and the
    gradients it captures until W frees them, as pyplan run's executor does. `mesh`: the
    plan's mesh mapping (`{tensor: 2, priced: 2}`: the units are one tensor rank's costs)."""
    names = names or tuple(f"stage{s}" for s in range(partition.num_stages))
    placement = placement or tuple((s % devices,) for s in range(partition.num_stages))
    about = (f"Written by pyplan partition from {factory}: {len(units)} units in "
             f"{partition.num_stages} stages ({shape}); times measured on this machine, one "
             f"time unit = {time_unit_ms:.4g} ms; block memory: the activations of one "
             "micro-batch; weights: parameters, gradients and optimizer state.")
    lines = ["pyplan: 1", f"name: {name}", "description: >"]
    lines += ["  " + line for line in textwrap.wrap(about, 94)]
    if capacity is None or isinstance(capacity, int):
        capacity = [capacity] * devices
    speeds = list(speeds) if speeds is not None else [1.0] * devices
    if len(set(capacity)) == 1 and all(s == 1 for s in speeds):
        lines.append(f"devices: {devices}")
        if capacity[0] is not None:
            lines.append(f"memory: {capacity[0]}B")
    else:  # devices that differ: one entry each
        lines.append("devices:")
        for c, s in zip(capacity, speeds):
            fields = ([] if c is None else [f"memory: {c}B"]) + \
                ([] if s == 1 else [f"speed: {s:.6g}"])
            lines.append(f"  - {{{', '.join(fields)}}}")
    split = all(u.input_grad_ms is not None for u in units)
    lines += [f"micro_batches: {micro_batches}"] + ([f"mesh: {mesh}"] if mesh else []) + [
              "training:",
              "  backward: {time_ratio: 1" + (", weight_time_ratio: 1}" if split else "}"),
              f"  recompute: {recompute}",
              f"topology: {{time_unit_ms: {time_unit_ms:.6g}" + (
                  "" if link is None else f", within_node: {{bandwidth: {link.bandwidth}B, "
                  f"latency_ms: {link.latency_ms:.6g}}}") + "}", "blocks:"]
    for s in range(partition.num_stages):
        part = [units[i] for i in partition.stage(s)]
        forward = max(1, round(sum(u.forward_ms for u in part) / time_unit_ms))
        backward = max(1, round(sum(u.backward_ms for u in part) / time_unit_ms))
        activations = stage_activations(part)
        receives = partition.stage(s).start > 0
        stage_weights = sum(u.weight_bytes for u in part)
        output = f", output: {part[-1].output_bytes}B" if s + 1 < partition.num_stages else ""
        where = "all" if placement[s] is None else f"[{', '.join(map(str, placement[s]))}]"
        workspace = stage_workspace(part, receives, recompute,
                                    sends=s + 1 < partition.num_stages)
        update = round(sum(u.update_ms for u in part) / time_unit_ms)
        if split:
            b = max(1, round(sum(u.input_grad_ms for u in part) / time_unit_ms))
            w = max(1, round(sum(u.weight_grad_ms for u in part) / time_unit_ms))
            held = sum(u.captured_bytes for u in part) - part[-1].released_bytes
            backward_costs = (f"time: {b}, weight_time: {w}, memory: {held}B, "
                              f"weight_memory: {-(activations + held)}B")
        else:
            backward_costs = f"time: {backward}"
        lines.append(f"  - {{name: {names[s]}, devices: {where}, time: {forward}, "
                     f"memory: {activations}B, weights: {stage_weights}B, "
                     f"workspace: {workspace}B, update: {update}{output}, "
                     f"recompute_memory: {recompute_bytes(part, receives)}B, "
                     f"backward: {{{backward_costs}}}}}")
    lines += ["model:", f"  module: {factory}", "  stages:"]
    for s in range(partition.num_stages):
        modules = ", ".join(json.dumps(m) for i in partition.stage(s)
                            for m in units[i].module_names)
        lines.append(f"    {names[s]}: [{modules}]")
    if cut != "chain":
        lines.append(f"  cut: {cut}")
    if layer_returns != "tensor":
        lines.append(f"  layer_returns: {layer_returns}")
    if vocab is not None:
        lines.append(f"  vocab_parallel: {{embedding: {json.dumps(vocab[0])}, "
                     f"head: {json.dumps(vocab[1])}}}")
    return model_tail(lines, units, partition, names, everywhere=everywhere, weights=weights,
                      optimizer=optimizer, data=data, loss=loss, path=path)


def model_tail(lines: list[str], units, partition, names, *, everywhere, weights, optimizer,
               data, loss, path) -> str:
    """The plan text ended by its model: section's last keys (ties, weights, optimizer, data,
    loss, path), as chain and graph plans write them."""
    found = ties(units, partition, everywhere, names)
    if found:
        lines.append("  ties:")
        lines += [f"    - {{parameter: {json.dumps(p)}, stages: [{', '.join(st)}]}}"
                  for p, st in found]
    if weights is not None:
        lines.append(f"  weights: {json.dumps(weights)}")
    if optimizer is not None:
        lines.append(f"  optimizer: {optimizer}")
    lines += [f"  data: {data}", f"  loss: {loss}"]
    if path is not None:
        lines.append(f"  path: {json.dumps(path)}")
    return "\n".join(lines) + "\n"
