"""What the M-shape's vocabulary-sharded units cost on one of their ranks: the first unit (with
the token embedding) and the last (with the head, and the loss on sharded logits), each holding
1/devices of the vocabulary, for `pyplan partition --shape mshape|auto`; and for `pyplan
profile`, the all-device blocks of a plan that shards them (model.vocab_parallel).

The compute is measured in this one process, on the rank's own chunk, as pyplan run executes
it (pyplan.models.vocab), with torch's fake process group of `devices`
ranks standing in for the others: its collectives return at once. The collectives those units
issue are recorded (kind and bytes) while they run, then timed: measured, as pyplan run issues
them, among `devices` local processes (`measure`: what `pyplan partition` does, on a machine
like the one that will run), or on the plan's link (latency and bandwidth, topology.within_node:
the same model the plan uses for its transfers) as ring collectives: an all-reduce of S bytes
over D ranks is 2(D - 1) steps of S/D bytes.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from pyplan.errors import PlanError
from pyplan.lower import check_runnable
from pyplan.models import FORWARD, Cut, Unit, stage_modules
from pyplan.models.deferred import Deferred, eager
from pyplan.models.vocab import Vocab, parallel_loss, shard
from pyplan.partition import UnitCost, weight_bytes
from pyplan.run.binding import block_inputs, build, loss_function
from pyplan.measure.measure import (BlockCost, Measured, Timer, block_arguments, leaves,
                                    unit_parameters)
from pyplan.measure.measure import measure as measure_block
from pyplan.comm.values import nbytes
from pyplan.planfile.types import LinkSpec, TopologySpec

__all__ = ["Collective", "ShardedUnits", "collective_ms", "measure_collectives", "profile_sharded",
           "sharded_blocks"]

_STEPS = {"all_reduce": lambda d: 2 * (d - 1), "all_gather_into_tensor": lambda d: d - 1,
          "reduce_scatter_tensor": lambda d: d - 1, "broadcast": lambda d: d - 1}


@dataclass(frozen=True)
class Collective:
    kind: str
    """all_reduce, all_gather_into_tensor, reduce_scatter_tensor or broadcast."""
    bytes: int
    backward: bool


@dataclass(frozen=True)
class ShardedUnits:
    """The first and last unit as one rank of `devices` runs them, collectives included."""

    first: UnitCost
    last: UnitCost
    collectives: dict[str, tuple[Collective, ...]]
    """Unit name -> what it issues per micro-batch."""
    devices: int
    measured: bool
    """Whether the collectives' times were measured here (else modelled on a link)."""


def collective_ms(found: tuple[Collective, ...], devices: int, link: LinkSpec,
                  backward: bool, measured: dict[int, float] | None = None) -> float:
    """Milliseconds of the forward's (or backward's) collectives: an all-reduce of a size in
    `measured` (bytes -> ms) as measured, any other as rings on `link`."""
    total = 0.0
    for c in found:
        if c.backward != backward:
            continue
        if c.kind == "all_reduce" and measured and c.bytes in measured:
            total += measured[c.bytes]
        else:
            steps = _STEPS.get(c.kind, lambda d: 2 * (d - 1))(devices)
            total += steps * link.milliseconds(c.bytes / devices)
    return total


def measure_collectives(found, devices: int, device: torch.device) -> dict[int, float] | None:
    """bytes -> ms of each all-reduce in `found` (Collectives), measured among `devices` local
    processes (None where this machine cannot: fewer GPUs than devices)."""
    from pyplan.measure.links import measure_all_reduces

    sizes = sorted({c.bytes for c in found if c.kind == "all_reduce"})
    if not sizes:
        return {}
    times = measure_all_reduces(devices, sizes, device.type)
    return None if times is None else dict(zip(sizes, times))


def _with_collectives(cost, found, devices: int, link: LinkSpec, measured):
    return dataclasses.replace(
        cost, forward_ms=cost.forward_ms + collective_ms(found, devices, link, False, measured),
        backward_ms=None if cost.backward_ms is None else
        cost.backward_ms + collective_ms(found, devices, link, True, measured))


class _Record(TorchDispatchMode):
    """Records the collectives dispatched while it is active: DTensor's (torch's functional
    collectives) and pyplan.models.collectives' all-reduces (c10d's in-place one)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # a DTensor op: let it desugar into what it communicates
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.namespace == "c10d" and name == "allreduce_":
            name, args = "all_reduce", args[0]
        elif func.namespace != "_c10d_functional":
            return out
        if name in _STEPS:
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            size = 0 if tensor is None else tensor.numel() * tensor.element_size()
            if name == "all_gather_into_tensor":
                size *= dist.get_world_size()
            self.found.append((name, size))
        return out


def _collectives(module, args, loss_fn) -> tuple[Collective, ...]:
    """One forward and backward of `module`, recording what it communicates."""
    with _Record() as forward:
        out = module(*args)
        roots = [loss_fn(out)] if loss_fn is not None else \
            [t for t in (out if isinstance(out, tuple) else (out,))
             if isinstance(t, torch.Tensor) and t.requires_grad]
    with _Record() as backward:
        if roots and roots[0].requires_grad:
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
    return tuple(Collective(k, b, False) for k, b in forward.found) + \
        tuple(Collective(k, b, True) for k, b in backward.found)


def profile_sharded(model: torch.nn.Module, inputs, targets, loss, *, cut: Cut,
                    units: list[Unit], costs: list[UnitCost], vocab: Vocab, devices: int,
                    optimizer: str = "sgd", repeats: int = 5, device: torch.device | None = None,
                    measured: Measured | None = None,
                    link: LinkSpec = TopologySpec().within_node,
                    measure: bool = False) -> ShardedUnits:
    """Per-rank costs of the first and last units with the vocabulary sharded over `devices`
    (`costs`: the units measured whole, by pyplan.measure.profile.profile_units), their
    collectives measured among local processes (`measure`) or timed on `link`."""
    device = device or torch.device("cpu")
    measured = measured if measured is not None else Measured()
    if dist.is_initialized():
        raise PlanError("pyplan partition measures sharded units in a process group of its own",
                        hint="run pyplan partition outside torchrun")
    dist.init_process_group("fake", rank=0, world_size=devices)
    try:
        ends, found = _profile(model, inputs, targets, loss, cut, units, costs, vocab, devices,
                               optimizer, Timer(device, repeats, measured), device)
    finally:
        dist.destroy_process_group()
    times = measure_collectives([c for f in found.values() for c in f], devices, device) \
        if measure else None
    first, last = (_with_collectives(cost, found[unit.name], devices, link, times)
                   for cost, unit in zip(ends, (units[0], units[-1])))
    return ShardedUnits(first, last, found, devices, times is not None)


def _profile(model, inputs, targets, loss, cut, units, costs, vocab, devices, optimizer,
             timer, device):
    """The first and last units' costs, collectives left out, and what each issues. Of a
    deferred model only those two units are materialised; the ones between run streamed."""
    deferred = model if isinstance(model, Deferred) else eager(model)
    held = copy.deepcopy(deferred.model)
    stages = [(unit.name, unit.modules) for unit in units]
    everything = list(range(len(units)))
    ends = tuple(f"{m}." for unit in (units[0], units[-1]) for m in unit.modules)
    deferred.materialize(held, device, names=lambda name: name.startswith(ends))
    pieces = stage_modules(held, cut, stages, everything, device, inputs)
    first = pieces[0]
    shard(held, vocab, dist.group.WORLD, device,
          active=(lambda: first.running) if cut.kind == FORWARD else None)
    sharded_loss = parallel_loss(loss)
    last_k = len(units) - 1

    def args_of(k: int, received):
        if cut.kind == FORWARD:
            return [inputs] + ([] if received is None else [received])
        return [inputs if received is None else received]

    value = None
    with torch.no_grad(), deferred.streaming():  # the last unit's input, as the pieces
        for k in range(last_k):                    # before it hand it on
            value = pieces[k](*args_of(k, value))
    out_costs, found = [], {}
    for k, received_value in ((0, None), (last_k, value)):
        unit, module = units[k], pieces[k]
        params = unit_parameters(module.model, unit) if cut.kind == FORWARD else \
            [p for p in module.parameters() if p.requires_grad]
        received, wrt = leaves(received_value, True)
        args = args_of(k, received)
        loss_fn = (lambda out: sharded_loss(out, targets, dist.group.WORLD)) \
            if k == last_k else None
        forward_ms, backward_ms, saved, out = measure_block(timer, module, args, wrt, params,
                                                       loss_fn, f"unit {unit.name} (sharded)")
        found[unit.name] = _collectives(module, args, loss_fn)
        for p in params:
            p.grad = None
        whole = costs[k]
        if cut.kind == FORWARD and k > 0:  # the model's forward up to the unit, counted once
            forward_ms = max(forward_ms - costs[0].forward_ms, 0.05 * forward_ms)
        out_costs.append(dataclasses.replace(
            whole, forward_ms=forward_ms, backward_ms=backward_ms, activation_bytes=saved,
            weight_bytes=weight_bytes(params, optimizer)))
        del out
    return out_costs, found


def sharded_blocks(problem, model, *, seed: int, device: torch.device, timer: Timer, inputs,
                   targets, outputs: dict, link: LinkSpec = TopologySpec().within_node,
                   measure: bool = False) -> dict[int, "BlockCost"]:
    """`pyplan profile` of a plan whose all-device blocks shard the vocabulary
    (model.vocab_parallel): those blocks as their first rank runs them, built as pyplan run
    builds that rank's blocks, beside a fake process group of their devices, their
    collectives measured among local processes (`measure`) or timed on `link`. `outputs`:
    every block's output, measured whole (what the sharded blocks receive)."""

    multi = [b for b in problem.blocks if b.is_forward and len(b.devices) > 1]
    if not multi or len({b.devices for b in multi}) > 1 or dist.is_initialized():
        return {}
    devices = multi[0].devices
    costs, found = {}, {}
    dist.init_process_group("fake", rank=0, world_size=len(devices))
    try:
        groups = {b.index: dist.group.WORLD for b in problem.blocks if len(b.devices) > 1}
        built = build(model, problem, seed=seed, device=device, rank=devices[0], groups=groups)
        preds = block_inputs(problem, built.modules)
        trains = problem.trained_layers
        output_block = check_runnable(problem)
        for block in multi:
            b, module, grad = block.index, built.modules[block.index], block.index in trains
            params = [p for p in module.parameters() if p.requires_grad]
            args, wrt = block_arguments(b, preds, outputs, inputs, built.wants_inputs, grad)
            loss_fn = (lambda out: loss_function(model)(out, targets, dist.group.WORLD)) \
                if b == output_block else None
            forward_ms, backward_ms, saved, out = measure_block(
                timer, module, args, wrt, params, loss_fn, f"block '{block.name}' (sharded)",
                grad)
            found[b] = _collectives(module, args, loss_fn) if grad else ()
            sent = [a for a in args if a is not inputs] if preds[b] else [inputs]
            costs[b] = BlockCost(block.name, block.devices, forward_ms, backward_ms, saved,
                                 sum(nbytes(a) for a in sent), nbytes(outputs[b]))
    finally:
        dist.destroy_process_group()
    times = measure_collectives([c for f in found.values() for c in f], len(devices), device) \
        if measure else None
    return {b: _with_collectives(cost, found[b], len(devices), link, times)
            for b, cost in costs.items()}
