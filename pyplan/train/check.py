"""`pyplan run --check`: the same model, seed, batches, optimizer and clipping trained in one
process, compared with the pipelined run. After the first iteration the loss and every
parameter's gradient must agree, and the losses of all iterations after that (Pfeife's
equal-loss protocol; nnScaler 7.1 checks new plans on a model shrunk to fit one device the same
way).

The single-process model is the user's own: for a `module:` plan its whole forward (with the
random numbers reseeded where each block starts, as the pipeline does), so the check covers the
cut itself, ties included; for `blocks:` plans (no whole model exists) the blocks in
dependency order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pyplan.models import FORWARD, TRACED
from pyplan.models.forward import logits, whole_forward
from pyplan.problem import Problem
from pyplan.models.chunks import shard_dim
from pyplan.run.binding import (Model, block_inputs, block_seeds, build, build_whole,
                                forward_blocks, forward_seed, loss_function, make_batch,
                                seed_generators)
from pyplan.run.data import split_batch
from pyplan.run.values import concatenated
from pyplan.train.training import Training

__all__ = ["Verdict", "compare", "full_gradients", "reference_run"]


def full_gradients(problem: Problem, modules: dict, groups: dict, rank: int,
                   names: dict[int, str]) -> dict:
    """This rank's part of the model's gradients, whole and under the model's names: a data-
    or tensor-parallel DTensor gathered whole (every rank of its mesh calls this), a
    multi-device block's chunks gathered over the block's group and kept by its first rank."""
    grads = {}
    for b, module in modules.items():
        block = problem.blocks[b]
        for name, param in module.named_parameters():
            grad = torch.zeros_like(param) if param.grad is None else param.grad.detach()
            if hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()
            dim = shard_dim(param)
            if len(block.devices) > 1 and dim is not None:
                parts = [torch.empty_like(grad) for _ in block.devices]
                dist.all_gather(parts, grad.contiguous(), group=groups[b])
                grad = torch.cat(parts, dim)
            if block.devices[0] == rank:
                key = names.get(id(param), f"{block.name}.{name}")
                grads[(key, block.name)] = grad.cpu().clone()
    return grads


def reference_run(model: Model, problem: Problem, output_block: int, *, seed: int,
                  history: list[dict], steps: range, device, micro_batches: int,
                  autocast: torch.dtype | None = None, evaluation=None
                  ) -> tuple[list[float], dict, list[tuple[int, float]]]:
    """Train the whole model in this process for steps 0 .. steps.stop - 1: (the loss of each
    step in `steps`, the gradients of the first global batch of them, by parameter name, the
    evaluations). `history` lists the settings in force from each step on (Training records
    with "step", "batches" and "steps", the schedule's length); a change is applied as a
    resumed run applies it (Training.switch). The forwards run micro-batch by micro-batch
    (`micro_batches` over the global batch: those of every data-parallel replica), the loss on
    the whole batch. `evaluation`: (every K steps, number of batches, micro-batches of a
    batch) for the mean loss over the data's eval split in eval mode."""
    forward = _forward(model, problem, output_block, seed=seed, device=device)
    params = forward.parameters
    training = Training.from_record(history[0])
    optimizer, scheduler = training.build(params, history[0]["steps"]) \
        if problem.training and params else (None, None)
    later = {segment["step"]: segment for segment in history[1:]}
    losses, first, evals, batch = [], {}, [], 0
    for step in range(steps.stop):
        if step in later:
            training = Training.from_record(later[step])
            if optimizer is not None:
                scheduler = training.switch(optimizer, later[step]["steps"], step)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(training.accumulate):
            loss = _loss(forward, model, problem, output_block, batch,
                         make_batch(model, batch, seed, device), micro_batches, autocast,
                         grad=optimizer is not None)
            total += float(loss.detach())
            batch += 1
            if optimizer is None:
                continue
            loss.backward()
            if step == steps.start and j == 0:
                first = {name: (torch.zeros_like(p) if p.grad is None else p.grad).detach()
                         .cpu().clone() for name, p in forward.named}
        if step in steps:
            losses.append(total / training.accumulate)
        if optimizer is not None:
            if training.accumulate > 1:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(1 / training.accumulate)
            training.clip(params)
            optimizer.step()
            scheduler.step()
        if evaluation is not None and step in steps and (step + 1) % evaluation[0] == 0:
            evals.append((step + 1, _evaluate(forward, model, problem, output_block, seed,
                                              device, autocast, evaluation)))
    return losses, first, evals


def _loss(forward, model, problem, output_block, batch, data, micro_batches, autocast,
          grad: bool):
    inputs, targets = data
    with torch.autocast(forward.device.type, dtype=autocast, enabled=autocast is not None):
        # Micro-batch by micro-batch, so that each forward draws the random numbers it
        # draws in the pipeline; the loss sees the whole batch, as in training without a
        # pipeline.
        results = [forward(batch, m, micro)
                   for m, micro in enumerate(split_batch(inputs, micro_batches))]
        whole = (None,) if len(problem.blocks[output_block].devices) > 1 else ()
        with torch.set_grad_enabled(grad):
            what = f"block '{problem.blocks[output_block].name}'" if forward.whole is None \
                else "the model"
            return loss_function(model)(concatenated(results, what), targets, *whole)


def _evaluate(forward, model, problem, output_block, seed, device, autocast,
              evaluation) -> float:
    _, count, micro_batches = evaluation
    forward.train(False)
    total = 0.0
    with torch.no_grad():
        for i in range(count):
            data = make_batch(model, i, seed, device, split="eval")
            total += float(_loss(forward, model, problem, output_block, i, data,
                                 micro_batches(data[0]), autocast, grad=False))
    forward.train(True)
    return total / count


class _forward:
    """The single-process model, one micro-batch at a time: the whole model's own forward
    (module: plans) or the blocks in dependency order (blocks: plans, traced cuts)."""

    def __init__(self, model: Model, problem: Problem, output_block: int, *, seed: int,
                 device) -> None:
        self.model, self.problem, self.output = model, problem, output_block
        self.device = device
        blocks = [b for b in problem.blocks if b.is_forward]
        self.seeds = dict(zip((b.index for b in blocks),
                              block_seeds(seed, [b.name for b in blocks])))
        self.trains = problem.trained_layers
        if model.whole is not None and model.cut.kind != TRACED:
            self.whole = build_whole(model, seed).to(device)
            self.named = list(self.whole.named_parameters())
            self._hooks()
        else:
            self.whole = None
            built = build(model, problem, seed=seed, device=device)
            self.modules = built.modules
            self.preds = block_inputs(problem, self.modules)
            self.order = [b for b in problem.graph.topological_order() if b in self.modules]
            names = built.names
            self.named = [(names.get(id(p), f"{problem.blocks[b].name}.{n}"), p)
                          for b, m in self.modules.items() for n, p in m.named_parameters()]
            self.named = list({id(p): (n, p) for n, p in self.named}.values())
        self.parameters = [p for _, p in self.named]

    def train(self, mode: bool) -> None:
        for module in [self.whole] if self.whole is not None else self.modules.values():
            module.train(mode)

    def _hooks(self) -> None:
        """Reseed where each block starts: its first module (the whole model's call for the
        first block of a forward cut, which starts before its first module runs)."""
        problem, model = self.problem, self.model
        for b in forward_blocks(problem):
            first = model.stages[problem.blocks[b].name][0]
            target = self.whole if (model.cut.kind == FORWARD and b == min(self.seeds)) \
                else self.whole.get_submodule(first)
            target.register_forward_pre_hook(lambda *_, b=b: self._reseed(b))

    def _reseed(self, b: int) -> None:
        seed_generators(forward_seed(self.seeds[b], self.step, self.micro_batch), self.device)

    def __call__(self, step: int, micro_batch: int, micro):
        self.step, self.micro_batch = step, micro_batch
        grad = bool(self.trains)
        if self.whole is not None:
            with torch.set_grad_enabled(grad):
                out = whole_forward(self.whole, micro) if self.model.cut.kind == FORWARD \
                    else self.whole(micro)
            return logits(out)
        outputs = {}
        for b in self.order:
            args = [outputs[p] for p in self.preds[b]] if self.preds[b] else [micro]
            self._reseed(b)
            with torch.set_grad_enabled(b in self.trains):
                outputs[b] = self.modules[b](*args)
        return outputs[self.output]


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str


def compare(losses: list[float], grads: dict, ref_losses: list[float], ref_grads: dict,
            tolerance: float, evals: list = (), ref_evals: list = ()) -> Verdict:
    """The loss of the first iteration, then every gradient in the model's order (every copy
    of a tied parameter), then the losses of the later iterations, then the evaluations: the
    first that differs by more than `tolerance` fails the check."""
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
    copies: dict[str, list] = {}
    for (name, block), grad in grads.items():
        copies.setdefault(name, []).append((block, grad))
    for name, want in ref_grads.items():
        got = copies.get(name)
        if not got:
            return Verdict(False, f"parameter {name} is missing in the pipelined model")
        for block, grad in got:
            where = f"{name}" if len(got) == 1 else f"{name} (the copy in block {block})"
            if grad.shape != want.shape:
                return Verdict(False, f"parameter {where} is shaped {tuple(grad.shape)} in the "
                               f"pipelined model, {tuple(want.shape)} in the single-process one")
            diff = float((grad - want).abs().max()) if want.numel() else 0.0
            if not diff <= tolerance:
                return Verdict(False, f"the gradient of {where} differs from the "
                               f"single-process run's by {diff:.3g} (tolerance {tolerance:g})")
            worst = max(worst, diff)
    for i in range(1, len(losses)):
        if (verdict := loss_differs(i)) is not None:
            return verdict
    for (step, got), (_, want) in zip(evals, ref_evals):
        if not abs(got - want) <= tolerance:
            return Verdict(False, f"the evaluation after step {step} is {got:.8g}, the "
                           f"single-process run's {want:.8g} (difference {abs(got - want):.3g}, "
                           f"tolerance {tolerance:g})")
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    grads_text = (f" and {len(ref_grads)} parameter gradients (max abs diff {worst:.1e})"
                  if ref_grads else "")
    evals_text = (f" and {len(evals)} evaluations (max abs diff "
                  f"{max(abs(a[1] - b[1]) for a, b in zip(evals, ref_evals)):.1e})"
                  if evals else "")
    return Verdict(True, f"the loss{grads_text} after iteration 0 and the losses of "
                   f"{len(losses)} iterations (max abs diff {loss_diff:.1e}){evals_text} match "
                   "the single-process run")
