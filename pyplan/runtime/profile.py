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

from pyplan.lower import check_runnable
from pyplan.problem import BACKWARD, Problem
from pyplan.runtime.binding import (
    Model,
    block_inputs,
    build_modules,
    make_batch,
    split_batch,
)

__all__ = ["BlockCost", "profile_blocks"]


@dataclass(frozen=True)
class BlockCost:
    name: str
    devices: tuple[int, ...]
    forward_ms: float
    backward_ms: float | None
    """None for a block without a backward (inference, or a no-grad pass)."""
    activation_bytes: int


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
        costs[b] = BlockCost(block.name, block.devices, forward_ms, backward_ms, saved)
    return [costs[b] for b in sorted(costs)]
