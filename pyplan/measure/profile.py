"""`pyplan profile` and `pyplan partition`'s measurements: what blocks (or a model's units)
cost on this machine, so a plan's `time:` and `memory:` come from measurements.

Times are medians of repeated runs after a warm-up, taken until they are stable: runs are added
(up to 8x the asked repeats) while the spread (interquartile range over the median) exceeds 10%;
a time still spread wider than that is flagged, and so is a machine whose load average exceeds
its cores before or after the measurements (another process competing for the cores makes
every time too long, evenly: a stable but wrong figure). On CUDA the times are CUDA events.

Per block (or unit): the median forward time, the median time of its backward (autograd for
exactly that block: the gradients of its inputs and parameters; the last one's from the loss),
the bytes autograd saves during its forward, not counting parameters (a plan's memory delta),
and its input and output bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import gc

import torch

from pyplan.lower import check_runnable
from pyplan.models import (CHAIN, FORWARD, TRACED, Cut, Unit, find_units, stage_modules,
                           traced)
from pyplan.models import chain
from pyplan.models.deferred import Deferred, eager, move
from pyplan.partition import UnitCost, weight_bytes
from pyplan.problem import Problem
from pyplan.run.binding import (Model, block_inputs, build, forward_blocks, loss_function,
                                make_batch)
from pyplan.run.data import split_batch, to_device
from pyplan.measure.census import storage_bytes
from pyplan.measure.limits import (DEFAULT_SECONDS, computing_in, guarded, in_compute_dtype,
                                   time_limit)
from pyplan.measure.measure import (BlockCost, Measured, Timer, block_arguments, busy,
                                    compute_threads, leaves, measure, memory_peaks,
                                    split_backward, unit_buffer_bytes, unit_parameters,
                                    update_ms)
from pyplan.measure.sharded import sharded_blocks
from pyplan.comm.values import flatten, nbytes, rebuild

__all__ = ["BlockCost", "Measured", "profile_blocks", "profile_units"]


def profile_blocks(problem: Problem, model: Model, *, seed: int = 0, repeats: int = 5,
                   device: torch.device | None = None, measured: Measured | None = None,
                   measure_collectives: bool = False, threads: int | None = None,
                   unit_seconds: float | None = DEFAULT_SECONDS,
                   dtype: torch.dtype | None = None) -> list[BlockCost]:
    """Costs of every forward block, in plan order (the collectives of vocabulary-sharded
    blocks measured among local processes with `measure_collectives`, else modelled on the
    default link), computed with `threads` CPU threads (default: as each rank of a run),
    each block's measurement within `unit_seconds` of CPU time (pyplan.measure.limits), the
    forwards under autocast to `dtype` (as `pyplan run --dtype`)."""
    device = device or torch.device("cpu")
    with compute_threads(device, threads), computing_in(device, dtype):
        return _profile_blocks(problem, model, seed=seed, repeats=repeats, device=device,
                               measured=measured, measure_collectives=measure_collectives,
                               unit_seconds=unit_seconds)


def _profile_blocks(problem: Problem, model: Model, *, seed: int, repeats: int, device,
                    measured: Measured | None, measure_collectives: bool,
                    unit_seconds: float | None) -> list[BlockCost]:
    measured = measured if measured is not None else Measured()
    timer = Timer(device, repeats, measured)
    busy(measured)
    output_block = check_runnable(problem)
    forward = forward_blocks(problem)
    trains = problem.trained_layers
    preds = block_inputs(problem, forward)
    inputs, targets = make_batch(model, 0, seed, device)
    inputs = split_batch(inputs, problem.num_micro_batches)[0]
    targets = split_batch(targets, problem.num_micro_batches)[0]
    outputs: dict[int, object] = {}
    costs = {}
    for b in (b for b in problem.graph.topological_order() if b in forward):
        # Each block alone in memory (a model built on the meta device materialises only it).
        built = build(model, problem, seed=seed, device=device, only=[b])
        module, grad = built.modules[b], b in trains
        params = [p for p in module.parameters() if p.requires_grad]
        # The blocks' parameters fit the cache together if about this many do.
        timer.cold_for(len(forward) * sum(p.numel() * p.element_size() for p in params))
        args, wrt = block_arguments(b, preds, outputs, inputs, built.wants_inputs, grad)
        whole = (None,) if len(problem.blocks[b].devices) > 1 else ()
        loss_fn = in_compute_dtype(lambda out: loss_function(model)(out, targets, *whole)) \
            if b == output_block else None
        block = problem.blocks[b]
        what = f"block '{block.name}'"
        with time_limit(what, unit_seconds, "--block-time-limit"):
            forward_ms, backward_ms, saved, out = measure(timer, guarded(module, what), args,
                                                           wrt, params, loss_fn, what, grad)
        outputs[b] = _detached(out)
        sent = [a for a in args if a is not inputs] if preds[b] else [inputs]
        costs[b] = BlockCost(block.name, block.devices, forward_ms, backward_ms, saved,
                             sum(nbytes(a) for a in sent), nbytes(out))
        del built, module, params, out
    if getattr(model, "vocab", None) is not None:  # all-device blocks: one rank's share
        costs.update(sharded_blocks(problem, model, seed=seed, device=device, timer=timer,
                                    inputs=inputs, targets=targets, outputs=outputs,
                                    measure=measure_collectives))
    busy(measured)
    return [costs[b] for b in sorted(costs)]


def profile_units(model: torch.nn.Module | Deferred, inputs, targets, loss, *,
                  optimizer: str = "sgd", repeats: int = 5, device: torch.device | None = None,
                  progress=None, measured: Measured | None = None,
                  threads: int | None = None, split: bool = False,
                  unit_seconds: float | None = DEFAULT_SECONDS,
                  batch_bytes: int = 0,
                  dtype: torch.dtype | None = None) -> tuple[list[UnitCost], Cut]:
    """Costs of each unit of a model on one micro-batch, and how the model is cut (see
    pyplan.models): median forward and backward milliseconds (the backward of exactly that
    unit; the last unit's from the loss), the activation bytes autograd saves, and the weights'
    bytes with their gradients and the optimizer's state, computed with `threads` CPU threads
    (default: as each rank of a run); with `split`, the input and weight gradients' times
    apart (zero bubble). A deferred model (built on the meta device) is materialised one unit
    at a time, so the whole model is never in memory. Each unit's measurement is bounded by
    `unit_seconds` of CPU time (pyplan.measure.limits), and the user's forward failing is one
    error naming the unit. `batch_bytes`: the global batch's (inputs and targets), which the
    ranks of the stages that read the inputs or compute the loss hold. The forwards run under
    autocast to `dtype` (as `pyplan run --dtype`)."""
    device = device or torch.device("cpu")
    with compute_threads(device, threads), computing_in(device, dtype):
        return _profile_units(model, inputs, targets, loss, optimizer=optimizer,
                              repeats=repeats, device=device, progress=progress,
                              measured=measured, split=split, unit_seconds=unit_seconds,
                              batch_bytes=batch_bytes)


def _profile_units(model, inputs, targets, loss, *, optimizer: str, repeats: int, device,
                   progress, measured: Measured | None, split: bool,
                   unit_seconds: float | None, batch_bytes: int) -> tuple[list[UnitCost], Cut]:
    deferred = model if isinstance(model, Deferred) else eager(model)
    measured = measured if measured is not None else Measured()
    timer = Timer(device, repeats, measured)
    busy(measured)
    whole = deferred.model
    with deferred.streaming(), time_limit("the model's forward", unit_seconds):
        cut, units = find_units(whole, inputs)
    timer.cold_for(sum(p.numel() * p.element_size() for p in whole.parameters()))
    inputs, targets = to_device(inputs, device), to_device(targets, device)
    # Traced on the meta device; each piece gets its values while it is measured.
    on_meta = cut.kind == TRACED and not deferred.eager
    names = {id(p): n for n, p in reversed(list(whole.named_parameters(remove_duplicate=False)))}
    own = [tuple(dict.fromkeys(names[id(p)] for p in unit_parameters(whole, unit)))
           for unit in units]
    meta = torch.device("meta")
    with time_limit("the model's forward", unit_seconds):  # (the tracer runs it)
        pieces = _pieces(whole, cut, units, to_device(inputs, meta), meta) if on_meta else \
            _pieces(whole, cut, units, inputs, device) if deferred.eager else None
    costs, value = [], None
    for k, unit in enumerate(units):
        undo = None
        if on_meta:
            undo = traced.materialize(pieces[k], deferred, device)
            traced.place(pieces[k], device)
        what = f"unit {unit.name}"
        with time_limit(what, unit_seconds):
            module = pieces[k] if pieces is not None else _piece(deferred, cut, units, k, device)
        params = [p for p in module.parameters() if p.requires_grad]
        if cut.kind == FORWARD:  # the stage module holds the whole model: the unit's own
            params = unit_parameters(module.model, unit)
        received, wrt = leaves(value, True)
        if cut.kind == FORWARD:
            args = [inputs] + ([] if received is None else [received])
        else:
            args = [inputs if received is None else received]
        last = k == len(units) - 1
        loss_fn = in_compute_dtype(lambda out: loss(out, targets)) if last else None
        with time_limit(what, unit_seconds):
            forward_ms, backward_ms, saved, out = measure(timer, guarded(module, what), args,
                                                           wrt, params, loss_fn, what)
            peaks = memory_peaks(guarded(module, what), args, wrt, params, loss_fn, device)
            update, step_bytes = update_ms(timer, params, optimizer, what)
            halves = split_backward(timer, guarded(module, what), args, wrt, params, loss_fn,
                                    what) if split else (None, 0.0, 0, 0)
        buffers = unit_buffer_bytes(module.model, unit) if cut.kind == FORWARD else \
            storage_bytes(module.buffers())
        costs.append(UnitCost(unit.name, forward_ms, backward_ms, saved,
                              weight_bytes(params, optimizer) + buffers,
                              nbytes(inputs if received is None else received), nbytes(out),
                              modules=unit.modules, parameters=own[k],
                              forward_peak_bytes=peaks.forward,
                              backward_peak_bytes=peaks.backward,
                              saved_input_bytes=peaks.saved_input,
                              saved_output_bytes=peaks.saved_output,
                              # The stages reading the inputs (every one, cut in the model's
                              # forward) or computing the loss hold the batch.
                              batch_bytes=batch_bytes if cut.kind == FORWARD or
                              k in (0, len(units) - 1) else 0,
                              update_ms=update, update_peak_bytes=step_bytes,
                              update_at_once=device.type == "cuda",
                              input_grad_ms=halves[0],
                              weight_grad_ms=halves[1], captured_bytes=halves[2],
                              released_bytes=halves[3]))
        value = _detached(out)
        if undo is not None:  # the piece's values go with it
            undo()
        del module, params, out
        gc.collect()  # the piece's modules hold cycles: its weights go now, not units later
        if progress is not None:
            progress(k + 1, len(units))
    if cut.kind == FORWARD and len(costs) > 1:
        # Every piece runs the model's forward up to the unit: what comes before the first
        # layer (the first unit's time) is in each; count it once, in the first unit.
        prefix = costs[0].forward_ms
        costs[1:] = [dataclasses.replace(c, forward_ms=max(c.forward_ms - prefix,
                                                           0.05 * c.forward_ms))
                     for c in costs[1:]]
    busy(measured)
    return costs, cut


def _detached(value):
    tensors, spec = flatten(value, "a unit")
    return rebuild([t.detach() for t in tensors], spec)


def _pieces(model, cut: Cut, units: list[Unit], inputs, device) -> list[torch.nn.Module]:
    """One module per unit of a model that has its weights: the unit (chain), torch's traced
    piece, or (forward) a stage of one copy of the model that holds every unit."""
    stages = [(unit.name, unit.modules) for unit in units]
    everything = list(range(len(units)))
    if cut.kind == CHAIN:
        return [chain.stage(model, (unit.name,), first=k == 0).to(device)
                for k, unit in enumerate(units)]
    held = copy.deepcopy(model) if cut.kind == FORWARD else model
    found = stage_modules(held, cut, stages, everything, device, inputs)
    return [found[s] for s in everything]


def _piece(deferred: Deferred, cut: Cut, units: list[Unit], k: int,
           device) -> torch.nn.Module:
    """Unit k of a deferred model, alone materialised: a copy of the unit (chain) or a stage of
    a copy of the model that holds only that unit's weights (forward)."""
    whole = deferred.model
    if cut.kind == CHAIN:
        piece = copy.deepcopy(whole.get_submodule(units[k].name))
        deferred.materialize(piece, device, prefix=f"{units[k].name}.")
        move(piece, device)
        return chain.stage(piece, ("",), first=True) if k == 0 else piece
    stages = [(unit.name, unit.modules) for unit in units]
    return stage_modules(copy.deepcopy(whole), cut, stages, [k], device,
                         materialize=lambda pruned: deferred.materialize(pruned, device))[k]


