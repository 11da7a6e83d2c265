"""`pyplan run --check`: the same model, seed and batches trained in one process, compared with
the pipelined run. After one iteration the loss and every parameter's gradient must agree, and
the losses of all iterations after that (Pfeife's equal-loss protocol; nnScaler 7.1 checks new
plans on a model shrunk to fit one device the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pyplan.problem import BACKWARD, Problem
from pyplan.runtime.binding import (
    Model,
    block_inputs,
    build_modules,
    forward_rng,
    make_batch,
    shard_dim,
    split_batch,
)

__all__ = ["Verdict", "compare", "full_gradients", "reference_run"]


def full_gradients(problem: Problem, modules: dict, groups: dict, rank: int) -> dict:
    """This rank's part of the model's gradients, whole: shards are gathered over their block's
    group; a multi-device block's gradients are kept by its first rank."""
    grads = {}
    for b, module in modules.items():
        block = problem.blocks[b]
        for name, param in module.named_parameters():
            grad = torch.zeros_like(param) if param.grad is None else param.grad.detach()
            dim = shard_dim(param)
            if len(block.devices) > 1 and dim is not None:
                parts = [torch.empty_like(grad) for _ in block.devices]
                dist.all_gather(parts, grad.contiguous(), group=groups[b])
                grad = torch.cat(parts, dim)
            if block.devices[0] == rank:
                grads[f"{block.name}.{name}"] = grad.cpu().clone()
    return grads


def reference_run(model: Model, problem: Problem, output_block: int, *, seed: int, lr: float,
                  iterations: int, device, micro_batches: int | None = None
                  ) -> tuple[list[float], dict]:
    """Train the whole model in this process: (loss per iteration, gradients after the first).
    The forwards run micro-batch by micro-batch (`micro_batches` over the global batch: those
    of every data-parallel replica), the loss on the whole batch."""
    micro_batches = micro_batches or problem.num_micro_batches
    modules = build_modules(model, problem, seed=seed, device=device)
    params = list({id(p): p for m in modules.values() for p in m.parameters()}.values())
    optimizer = torch.optim.SGD(params, lr=lr) if problem.training and params else None
    trains = {problem.by_name[b.layer] for b in problem.blocks if b.kind == BACKWARD}
    preds = block_inputs(problem, modules)
    order = [b for b in problem.graph.topological_order() if b in modules]
    losses, first = [], {}
    for step in range(iterations):
        inputs, targets = make_batch(model, step, seed, device)
        # Micro-batch by micro-batch, so that each forward draws the random numbers it draws in
        # the pipeline; the loss sees the whole batch, as in training without a pipeline.
        results = []
        for m, micro in enumerate(split_batch(inputs, micro_batches)):
            outputs = {}
            for b in order:
                args = [outputs[p] for p in preds[b]] if preds[b] else [micro]
                with torch.set_grad_enabled(b in trains), \
                        forward_rng(seed, step, problem.blocks[b].name, m, device):
                    outputs[b] = modules[b](*args)
            results.append(outputs[output_block])
        with torch.set_grad_enabled(output_block in trains):
            whole = (None,) if len(problem.blocks[output_block].devices) > 1 else ()
            loss = model.loss(torch.cat(results), targets, *whole)
        losses.append(float(loss.detach()))
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if step == 0:
                first = {f"{problem.blocks[b].name}.{name}":
                         (torch.zeros_like(p) if p.grad is None else p.grad).detach().cpu().clone()
                         for b, m in modules.items() for name, p in m.named_parameters()}
            optimizer.step()
    return losses, first


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str


def compare(losses: list[float], grads: dict, ref_losses: list[float], ref_grads: dict,
            tolerance: float) -> Verdict:
    """The loss of the first iteration, then every gradient in plan order, then the losses of
    the later iterations: the first that differs by more than `tolerance` fails the check."""
    def loss_differs(i: int) -> Verdict | None:
        diff = abs(losses[i] - ref_losses[i])
        if not diff <= tolerance:
            return Verdict(False, f"the loss of iteration {i} is {losses[i]:.8g}, the "
                           f"single-process run's {ref_losses[i]:.8g} (difference {diff:.3g}, "
                           f"tolerance {tolerance:g})")
        return None

    worst = 0.0
    if (verdict := loss_differs(0)) is not None:
        return verdict
    for name, want in ref_grads.items():
        got = grads.get(name)
        if got is None or got.shape != want.shape:
            shape = "missing" if got is None else f"shaped {tuple(got.shape)}"
            return Verdict(False, f"parameter {name} is {shape} in the pipelined model, "
                           f"{tuple(want.shape)} in the single-process one")
        diff = float((got - want).abs().max()) if want.numel() else 0.0
        if not diff <= tolerance:
            return Verdict(False, f"the gradient of {name} differs from the single-process "
                           f"run's by {diff:.3g} (tolerance {tolerance:g})")
        worst = max(worst, diff)
    for i in range(1, len(losses)):
        if (verdict := loss_differs(i)) is not None:
            return verdict
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    grads_text = (f" and {len(ref_grads)} parameter gradients (max abs diff {worst:.1e})"
                  if ref_grads else "")
    return Verdict(True, f"the loss{grads_text} after iteration 0 and the losses of "
                   f"{len(losses)} iterations (max abs diff {loss_diff:.1e}) match the "
                   "single-process run")
