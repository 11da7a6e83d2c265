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
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from pyplan.lower import check_runnable
from pyplan.models import CHAIN, FORWARD, TRACED, Cut, Unit, find_units, stage_modules
from pyplan.models.deferred import Deferred, eager, move
from pyplan.partition import OPTIMIZER_STATE, UnitCost
from pyplan.problem import BACKWARD, Problem
from pyplan.runtime.binding import (Model, block_inputs, build, loss_function, make_batch,
                                    split_batch, to_device)
from pyplan.runtime.values import flatten, nbytes, rebuild, saved_bytes

__all__ = ["BlockCost", "Measured", "profile_blocks", "profile_units"]

SPREAD = 0.10  # interquartile range / median above which more runs are taken
MORE = 8       # at most this many times the asked repeats


@dataclass(frozen=True)
class BlockCost:
    name: str
    devices: tuple[int, ...]
    forward_ms: float
    backward_ms: float | None
    """None for a block without a backward (inference, or a no-grad pass)."""
    activation_bytes: int
    input_bytes: int = 0
    """What it keeps when recomputed."""
    output_bytes: int = 0
    """What goes to its consumers on other devices (and its gradient back)."""


@dataclass
class Measured:
    """What the measurements noticed besides the figures."""

    spread: dict[str, float] = field(default_factory=dict)
    """What was timed -> the spread of its times, where they stayed over SPREAD."""
    load: float | None = None
    """The highest load average seen above the cores, if any."""

    @property
    def warnings(self) -> list[str]:
        """Lines for the user."""
        lines = []
        if self.spread:
            worst = max(self.spread, key=self.spread.get)
            lines.append(f"the times of {len(self.spread)} measurements spread more than "
                         f"{SPREAD:.0%} around their medians however often repeated (worst: "
                         f"{worst}, {self.spread[worst]:.0%}); the medians count")
        if self.load is not None:
            lines.append(f"the machine looks busy (load average {self.load:.1f} on "
                         f"{os.cpu_count() or 1} cores): other work competing for the cores "
                         "makes every time too long; measure again when it is idle")
        return lines


def _spread(samples: list[float]) -> float:
    if len(samples) < 4:
        return 0.0
    q = statistics.quantiles(samples, n=4)
    middle = statistics.median(samples)
    return (q[2] - q[0]) / middle if middle > 0 else 0.0


class _Timer:
    def __init__(self, device, repeats: int, measured: Measured) -> None:
        self.device, self.repeats, self.measured = device, repeats, measured

    def now(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        if self.device.type == "cuda":
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def median(self, sample, what: str) -> float:
        """Median milliseconds of `sample()` (which times one run and returns ms), after one
        warm-up run, with runs added while they spread too widely."""
        sample()
        samples = [sample() for _ in range(self.repeats)]
        while _spread(samples) > SPREAD and len(samples) < MORE * self.repeats:
            samples.append(sample())
        spread = _spread(samples)
        if spread > SPREAD:
            self.measured.spread[what] = spread
        return statistics.median(samples)

    def call(self, fn, what: str) -> tuple[float, object]:
        """Median ms of fn() and its last result."""
        box = [None]

        def sample():
            start = self.now()
            box[0] = fn()
            return self.ms(start, self.now())
        return self.median(sample, what), box[0]


def _busy(measured: Measured) -> None:
    """Flag a machine whose load average exceeds its cores (before or after measuring)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return
    if load > (os.cpu_count() or 1) + 0.5:
        measured.load = max(load, measured.load or 0.0)


def block_arguments(b: int, preds: dict, outputs: dict, inputs, wants_inputs, grad: bool):
    """Block b's arguments from its predecessors' outputs (and the batch's inputs where it
    takes them), and the leaves to differentiate: inputs from other blocks are leaves here,
    so the backward stops at this block."""
    args, wrt = [], []
    for p in preds[b]:
        value, leaves = _leaves(outputs[p], grad)
        args.append(value)
        wrt += leaves
    if not preds[b] or b in wants_inputs:
        args.insert(0, inputs)
    return args, wrt


def _saved_bytes(fn, params) -> int:
    """Bytes autograd saves for backward while fn runs (pyplan.runtime.values.saved_bytes)."""
    with saved_bytes(params) as total:
        fn()
    return total[0]


def _leaves(value, grad: bool):
    """A value's tensors as fresh leaves (floating ones requiring grad when `grad`)."""
    if value is None:
        return None, []
    tensors, spec = flatten(value, "a block")
    fresh = [t.detach().requires_grad_(grad and t.is_floating_point()) for t in tensors]
    return rebuild(fresh, spec), [t for t in fresh if t.requires_grad]


def _roots(out, loss_fn):
    """What a backward starts from: the loss of the output, or each floating output tensor
    (with ones as its gradient)."""
    if loss_fn is not None:
        return [loss_fn(out)], None
    tensors, _ = flatten(out, "a block")
    roots = [t for t in tensors if t.is_floating_point() and t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def _measure(timer: _Timer, module, args: list, wrt_inputs: list, params: list, loss_fn,
             what: str, grad: bool = True) -> tuple[float, float | None, int, object]:
    """(forward ms, backward ms, saved bytes, output) of module(*args)."""
    with torch.set_grad_enabled(grad):
        forward_ms, out = timer.call(lambda: module(*args), f"{what} forward")
        saved = _saved_bytes(lambda: module(*args), params) if grad else 0
    if not grad:
        return forward_ms, None, saved, out
    wrt = wrt_inputs + params

    def backward():
        with torch.enable_grad():
            roots, seeds = _roots(module(*args), loss_fn)
        start = timer.now()
        if wrt and any(r.requires_grad for r in roots):
            torch.autograd.grad(roots, wrt, seeds, allow_unused=True)
        return timer.ms(start, timer.now())

    return forward_ms, timer.median(backward, f"{what} backward"), saved, out


def profile_blocks(problem: Problem, model: Model, *, seed: int = 0, repeats: int = 5,
                   device: torch.device | None = None, measured: Measured | None = None,
                   measure_collectives: bool = False) -> list[BlockCost]:
    """Costs of every forward block, in plan order (the collectives of vocabulary-sharded
    blocks measured among local processes with `measure_collectives`, else modelled on the
    default link)."""
    device = device or torch.device("cpu")
    measured = measured if measured is not None else Measured()
    timer = _Timer(device, repeats, measured)
    _busy(measured)
    output_block = check_runnable(problem)
    built = build(model, problem, seed=seed, device=device)
    modules = built.modules
    trains = {problem.by_name[b.layer] for b in problem.blocks if b.kind == BACKWARD}
    preds = block_inputs(problem, modules)
    inputs, targets = make_batch(model, 0, seed, device)
    inputs = split_batch(inputs, problem.num_micro_batches)[0]
    targets = split_batch(targets, problem.num_micro_batches)[0]
    outputs: dict[int, object] = {}
    costs = {}
    for b in (b for b in problem.graph.topological_order() if b in modules):
        module, grad = modules[b], b in trains
        params = [p for p in module.parameters() if p.requires_grad]
        args, wrt = block_arguments(b, preds, outputs, inputs, built.wants_inputs, grad)
        whole = (None,) if len(problem.blocks[b].devices) > 1 else ()
        loss_fn = (lambda out: loss_function(model)(out, targets, *whole)) \
            if b == output_block else None
        block = problem.blocks[b]
        forward_ms, backward_ms, saved, out = _measure(timer, module, args, wrt, params,
                                                       loss_fn, f"block '{block.name}'", grad)
        outputs[b] = out
        sent = [a for a in args if a is not inputs] if preds[b] else [inputs]
        costs[b] = BlockCost(block.name, block.devices, forward_ms, backward_ms, saved,
                             sum(nbytes(a) for a in sent), nbytes(out))
    if getattr(model, "vocab", None) is not None:  # all-device blocks: one rank's share
        from pyplan.runtime.sharded import sharded_blocks

        costs.update(sharded_blocks(problem, model, seed=seed, device=device, timer=timer,
                                    inputs=inputs, targets=targets, outputs=outputs,
                                    measure=measure_collectives))
    _busy(measured)
    return [costs[b] for b in sorted(costs)]


def profile_units(model: torch.nn.Module | Deferred, inputs, targets, loss, *,
                  optimizer: str = "sgd", repeats: int = 5, device: torch.device | None = None,
                  progress=None, measured: Measured | None = None
                  ) -> tuple[list[UnitCost], Cut]:
    """Costs of each unit of a model on one micro-batch, and how the model is cut (see
    pyplan.models): median forward and backward milliseconds (the backward of exactly that
    unit; the last unit's from the loss), the activation bytes autograd saves, and the weights'
    bytes with their gradients and the optimizer's state. A deferred model (built on the meta
    device) is materialised one unit at a time, so the whole model is never in memory."""
    deferred = model if isinstance(model, Deferred) else eager(model)
    device = device or torch.device("cpu")
    measured = measured if measured is not None else Measured()
    timer = _Timer(device, repeats, measured)
    _busy(measured)
    whole = deferred.model
    with deferred.streaming():
        cut, units = find_units(whole, inputs)
    if cut.kind == TRACED and not deferred.eager:  # torch's tracer needs the whole model
        deferred.materialize(whole, "cpu")
    inputs, targets = to_device(inputs, device), to_device(targets, device)
    names = {id(p): n for n, p in reversed(list(whole.named_parameters(remove_duplicate=False)))}
    own = [tuple(dict.fromkeys(names[id(p)] for p in _unit_parameters(whole, unit)))
           for unit in units]
    pieces = _pieces(whole, cut, units, inputs, device) \
        if deferred.eager or cut.kind == TRACED else None
    costs, value = [], None
    for k, unit in enumerate(units):
        module = pieces[k] if pieces is not None else _piece(deferred, cut, units, k, device)
        params = [p for p in module.parameters() if p.requires_grad]
        if cut.kind == FORWARD:  # the stage module holds the whole model: the unit's own
            params = _unit_parameters(module.model, unit)
        received, wrt = _leaves(value, True)
        if cut.kind == FORWARD:
            args = [inputs] + ([] if received is None else [received])
        else:
            args = [inputs if received is None else received]
        last = k == len(units) - 1
        loss_fn = (lambda out: loss(out, targets)) if last else None
        forward_ms, backward_ms, saved, out = _measure(timer, module, args, wrt, params,
                                                       loss_fn, f"unit {unit.name}")
        size = sum(p.numel() * p.element_size() for p in params)
        costs.append(UnitCost(unit.name, forward_ms, backward_ms, saved,
                              size * (2 + OPTIMIZER_STATE[optimizer]),
                              nbytes(inputs if received is None else received), nbytes(out),
                              modules=unit.modules, parameters=own[k]))
        value = _detached(out)
        del module, params, out
        if progress is not None:
            progress(k + 1, len(units))
    if cut.kind == FORWARD and len(costs) > 1:
        # Every piece runs the model's forward up to the unit: what comes before the first
        # layer (the first unit's time) is in each; count it once, in the first unit.
        prefix = costs[0].forward_ms
        costs[1:] = [dataclasses.replace(c, forward_ms=max(c.forward_ms - prefix,
                                                           0.05 * c.forward_ms))
                     for c in costs[1:]]
    _busy(measured)
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
        return [model.get_submodule(unit.name).to(device) for unit in units]
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
        return piece
    stages = [(unit.name, unit.modules) for unit in units]
    return stage_modules(copy.deepcopy(whole), cut, stages, [k], device,
                         materialize=lambda pruned: deferred.materialize(pruned, device))[k]


def _unit_parameters(model: torch.nn.Module, unit: Unit) -> list[torch.Tensor]:
    """The parameters of a unit's modules (each once)."""
    found = {}
    for name in unit.modules:
        for p in model.get_submodule(name).parameters():
            if p.requires_grad:
                found[id(p)] = p
    return list(found.values())
