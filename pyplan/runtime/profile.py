"""`pyplan profile`: measure what a plan's blocks cost on this machine, so the plan's `time:` and
`memory:` can come from measurements instead of guesses.

Every forward block is built whole in one process (as the --check reference does) and fed one
micro-batch of the plan's data. Per block: the median forward time, the median time of its
backward (autograd for exactly that block: gradients of its inputs and its parameters), and
the activation memory its backward needs: the bytes autograd saves during its forward, not
counting parameters (a plan's memory delta for the block).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from pyplan.errors import PlanError
from pyplan.lower import check_runnable
from pyplan.partition import OPTIMIZER_STATE, UnitCost
from pyplan.problem import BACKWARD, Problem
from pyplan.runtime.binding import (
    Model,
    block_inputs,
    build_modules,
    make_batch,
    split_batch,
    traced_stages,
)

__all__ = ["BlockCost", "chain_units", "profile_blocks", "profile_units"]


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


def _timed(fn, device, repeats: int) -> tuple[float, object]:
    """Median milliseconds of `repeats` calls after one warm-up call, and the last result."""
    result = fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), result


def _bytes(value) -> int:
    """Bytes of the tensors in a value (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        value = list(value.values())
    return sum(map(_bytes, value)) if isinstance(value, (list, tuple)) else 0


def _saved_bytes(fn, params) -> int:
    """Bytes autograd saves for backward while fn runs, each tensor once, parameters (and views
    of them) excluded. Tensor sizes, not storages: a micro-batch is a view of the whole batch."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() not in skip:
            seen[(t.data_ptr(), tuple(t.shape), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def profile_blocks(problem: Problem, model: Model, *, seed: int = 0, repeats: int = 5,
                   device: torch.device | None = None) -> list[BlockCost]:
    """Costs of every forward block, in plan order."""
    device = device or torch.device("cpu")
    output_block = check_runnable(problem)
    modules = build_modules(model, problem, seed=seed, device=device)
    trains = {problem.by_name[b.layer] for b in problem.blocks if b.kind == BACKWARD}
    preds = block_inputs(problem, modules)
    inputs, targets = make_batch(model, 0, seed, device)
    inputs = split_batch(inputs, problem.num_micro_batches)[0]
    targets = split_batch(targets, problem.num_micro_batches)[0]
    outputs: dict[int, torch.Tensor] = {}
    costs = {}
    for b in (b for b in problem.graph.topological_order() if b in modules):
        module, grad = modules[b], b in trains
        params = [p for p in module.parameters() if p.requires_grad]
        # Inputs from other blocks are leaves here, so the backward stops at this block.
        args = [outputs[p].detach().requires_grad_(grad and outputs[p].is_floating_point())
                for p in preds[b]] if preds[b] else [inputs]
        with torch.set_grad_enabled(grad):
            forward_ms, out = _timed(lambda: module(*args), device, repeats)
            saved = _saved_bytes(lambda: module(*args), params) if grad else 0
        outputs[b] = out
        backward_ms = None
        if grad:
            wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + params

            def backward():
                with torch.enable_grad():
                    result = module(*args)
                    if b == output_block:
                        whole = (None,) if len(problem.blocks[b].devices) > 1 else ()
                        result, seed_grad = model.loss(result, targets, *whole), None
                    else:
                        seed_grad = torch.ones_like(result)
                # Only the backward is timed: the forward above is the same work measured before.
                start = time.perf_counter()
                torch.autograd.grad(result, wrt, seed_grad, allow_unused=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                return (time.perf_counter() - start) * 1e3

            samples = [backward() for _ in range(repeats + 1)][1:]
            backward_ms = statistics.median(samples)
        block = problem.blocks[b]
        costs[b] = BlockCost(block.name, block.devices, forward_ms, backward_ms, saved,
                             sum(_bytes(a) for a in args), _bytes(out))
    return [costs[b] for b in sorted(costs)]


def chain_units(model: torch.nn.Module, prefix: str = "") -> list[str]:
    """The model's split units: its children in order, nn.Sequential and nn.ModuleList
    flattened (so layers.0 .. layers.31 are units)."""
    units = []
    for name, child in model.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, (torch.nn.Sequential, torch.nn.ModuleList)):
            units += chain_units(child, f"{path}.")
        else:
            units.append(path)
    return units


def _is_chain(model: torch.nn.Module, units: list[str], inputs) -> bool:
    """Whether the units run one after another compute what the model computes (in eval mode,
    without dropout)."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole = model(inputs)
            x = inputs
            for unit in units:
                x = model.get_submodule(unit)(x)
    except Exception:  # children that cannot even run in a row: not a chain
        return False
    finally:
        model.train(was)
    return isinstance(whole, torch.Tensor) and isinstance(x, torch.Tensor) and \
        whole.shape == x.shape and bool(torch.allclose(whole, x, atol=1e-5))


def profile_units(model: torch.nn.Module, inputs, targets, loss, *, optimizer: str = "sgd",
                  repeats: int = 5, device: torch.device | None = None,
                  progress=None) -> tuple[list[UnitCost], bool]:
    """Costs of each unit of a model on one micro-batch: median forward and backward
    milliseconds (the backward of exactly that unit: gradients of its input and parameters;
    the last unit's from the loss), the activation bytes autograd saves, and the weights'
    bytes with their gradients and the optimizer's state; and whether the model had to be
    traced: when its forward is not its units one after another, torch's pipeline tracer cuts
    it before every unit and the pieces are measured instead."""
    device = device or torch.device("cpu")
    units = chain_units(model)
    if not units:
        raise PlanError("the model has no children to split into stages")
    traced = not _is_chain(model, units, inputs)
    pieces = traced_stages(model, units, inputs) if traced else \
        [model.get_submodule(unit) for unit in units]
    costs, x = [], inputs
    for k, unit in enumerate(units):
        module = pieces[k]
        params = [p for p in module.parameters() if p.requires_grad]
        arg = x.detach().requires_grad_(x.is_floating_point())
        forward_ms, out = _timed(lambda: module(arg), device, repeats)
        saved = _saved_bytes(lambda: module(arg), params)
        wrt = ([arg] if arg.requires_grad else []) + params
        last = k == len(units) - 1

        def backward():
            result = module(arg)
            root = loss(result, targets) if last else result
            seed = None if last else torch.ones_like(result)
            start = time.perf_counter()
            if wrt and root.requires_grad:
                torch.autograd.grad(root, wrt, seed, allow_unused=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return (time.perf_counter() - start) * 1e3

        backward_ms = statistics.median([backward() for _ in range(repeats + 1)][1:])
        size = sum(p.numel() * p.element_size() for p in params)
        costs.append(UnitCost(unit, forward_ms, backward_ms, saved,
                              size * (2 + OPTIMIZER_STATE[optimizer]), _bytes(arg), _bytes(out)))
        x = out.detach()
        if progress is not None:
            progress(k + 1, len(units))
    return costs, traced
