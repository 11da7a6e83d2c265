"""`pyplan run --check`: the same model, seed, batches, optimizer and clipping trained in one
process, as an oracle for the pipelined run. For each of the first N optimizer steps
(`--check-steps`, default 3) every parameter's gradient just before `optimizer.step()` (after
accumulation and clipping) and its value just after it are compared with the single-process
run's, every copy of a tied parameter included, with an error relative to the values (per
parameter: ||a - b|| / ||b||) and a tolerance scaled by the dtype; so are those steps' losses,
the persistent buffers each rank's stages hold after them (batch norms' running statistics;
not with data-parallel replicas) and the evaluations (Pfeife's equal-loss protocol, extended
to the whole state; nnScaler 7.1 checks new plans on a model shrunk to fit one device the
same way). Later steps' losses are
reported, not judged: two fp32 runs that sum in different orders drift apart over many steps.

The single-process model is the user's own: for a `module:` plan its whole forward (with the
random numbers reseeded where each block starts, as the pipeline does), so the check covers the
cut itself, ties included; for `blocks:` plans (no whole model exists) the blocks in
dependency order. `gathered` is the one place that reads a rank's whole parameters or
gradients (chunks of a multi-device block, a sharded mesh's flat shards).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pyplan.models import TRACED
from pyplan.models.forward import logits, whole_forward
from pyplan.problem import Problem
from pyplan.models.chunks import shard_dim
from pyplan.mesh.tensor import model_major
from pyplan.run.binding import (Model, block_inputs, block_seeds, build, build_whole,
                                forward_blocks, forward_seed, loss_function, make_batch,
                                seed_generators)
from pyplan.errors import RunError
from pyplan.run.data import split_batch
from pyplan.run.gradients import local
from pyplan.comm.values import concatenated
from pyplan.train.training import Training

__all__ = ["TOLERANCE", "Verdict", "compare", "gathered", "perturb", "reference_run"]

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 1e-2}
"""--check's default relative tolerance per --dtype, for losses and gradients."""
VALUES = 1e-3
"""The updated values are allowed max(tolerance, VALUES): an adaptive optimizer (AdamW) turns a
gradient element near its eps into a step of about lr whatever its last bits, and such elements
exist in real models (the key bias of attention has an exactly-zero gradient, so its elements
are rounding noise on both sides: 2e-4 apart after one step of a zero-initialised bias under
tensor parallelism). The gradients are the precise oracle; the values catch an optimizer
applied wrongly (another lr, decay or state), errors of a percent and more."""
_TINY = 1e-12


def gathered(pipe, what: str) -> dict[tuple[str, str], torch.Tensor]:
    """This rank's parameters ("values") or their gradients ("gradients", zeros where none),
    whole, on the CPU in fp32, keyed (the model's name, the block holding the copy): a data-
    or tensor-parallel DTensor gathered whole (every rank of its mesh calls this), a
    multi-device block's chunks gathered over the block's group and kept by its first rank;
    only the first data-parallel index keeps anything. Every rank calls it (collectives)."""
    if what == "buffers":
        return _buffers(pipe)
    if what not in ("values", "gradients"):
        raise ValueError(what)
    out = {}
    for b, module in pipe.modules.items():
        block = pipe.problem.blocks[b]
        for name, param in module.named_parameters():
            if what == "values":
                tensor = param.detach()
            else:
                tensor = torch.zeros_like(param) if param.grad is None else param.grad.detach()
            key = pipe.built.names.get(id(param), f"{block.name}.{name}")
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
                if key in pipe.packed:  # (in the model's own layout)
                    tensor = model_major(tensor, *pipe.packed[key])
            dim = shard_dim(param)
            if len(block.devices) > 1 and dim is not None:
                parts = [torch.empty_like(tensor) for _ in block.devices]
                dist.all_gather(parts, tensor.contiguous(), group=pipe.groups[b])
                tensor = torch.cat(parts, dim)
            if block.devices[0] == pipe.device_index and pipe.data_index == 0:
                out[(key, block.name)] = tensor.float().cpu().clone()
    return out


def _buffers(pipe) -> dict[tuple[str, str], torch.Tensor]:
    """This rank's own persistent buffers (batch norms' running statistics: those of the
    stages it runs, as a checkpoint saves them), keyed (the model's name, ""), on the CPU in
    fp32; none with data-parallel replicas, whose statistics are each replica's own (no one
    process sees what one replica sees)."""
    from pyplan.mesh.state import rank_view

    if pipe.problem.mesh.data_parallel > 1 or pipe.data_index != 0:
        return {}
    return {(name, ""): buffer.detach().float().cpu().clone()
            for name, buffer in rank_view(pipe).named_buffers()}


def reference_run(model: Model, problem: Problem, output_block: int, *, seed: int,
                  history: list[dict], steps: range, device, micro_batches: int,
                  check_steps: int = 0, autocast: torch.dtype | None = None, evaluation=None,
                  anchors: list[dict] = ()
                  ) -> tuple[list[float], list[dict], list[tuple[int, float]]]:
    """Train the whole model in this process for steps 0 .. steps.stop - 1: (the loss of each
    step in `steps`; for the first `check_steps` of them {"gradients": ..., "values": ...} by
    parameter name, the gradients just before optimizer.step() and the values just after it;
    the evaluations). `history` lists the settings in force from each step on (Training
    records with "step", "batches" and "steps", the schedule's length); a change is applied as
    a resumed run applies it (Training.switch). The forwards run micro-batch by micro-batch
    (`micro_batches` over the global batch: those of every data-parallel replica), the loss on
    the whole batch. `evaluation`: (every K steps, number of batches, micro-batches of a
    batch) for the mean loss over the data's eval split in eval mode. `anchors`: the pipelined
    run's values (by name) after each checked step, which the parameters take after that step
    is recorded, so that each checked step starts where the pipelined one did: two runs that
    add in different orders drift apart, and an adaptive optimizer amplifies the drift."""
    forward = _forward(model, problem, output_block, seed=seed, device=device)
    params = forward.parameters
    training = Training.from_record(history[0])
    optimizer, scheduler = training.build(params, history[0]["steps"]) \
        if problem.training and params else (None, None)
    later = {segment["step"]: segment for segment in history[1:]}
    losses, snapshots, evals, batch = [], [], [], 0
    checked = range(steps.start, min(steps.start + check_steps, steps.stop))
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
        if step in steps:
            losses.append(total / training.accumulate)
        if optimizer is not None:
            if training.accumulate > 1:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(1 / training.accumulate)
            training.clip(params)
            if step in checked:
                snapshots.append({"gradients": _named(forward, gradients=True)})
            optimizer.step()
            if step in checked:
                snapshots[-1]["values"] = _named(forward, gradients=False)
                snapshots[-1]["buffers"] = forward.buffers()
                if len(anchors) >= len(snapshots):
                    _anchor(forward, anchors[len(snapshots) - 1])
            scheduler.step()
        if evaluation is not None and step in steps and (step + 1) % evaluation[0] == 0:
            evals.append((step + 1, _evaluate(forward, model, problem, output_block, seed,
                                              device, autocast, evaluation)))
    return losses, snapshots, evals


def _anchor(forward, values: dict[str, torch.Tensor]) -> None:
    """The parameters take `values` (by name; those it has)."""
    with torch.no_grad():
        for name, p in forward.named:
            if name in values:
                p.copy_(values[name].to(p.device, p.dtype))


def _named(forward, *, gradients: bool) -> dict[str, torch.Tensor]:
    return {name: (p.detach() if not gradients else torch.zeros_like(p) if p.grad is None
                   else p.grad.detach()).float().cpu().clone() for name, p in forward.named}


def _loss(forward, model, problem, output_block, batch, data, micro_batches, autocast,
          grad: bool):
    inputs, targets = data
    with torch.autocast(forward.device.type, dtype=autocast, enabled=autocast is not None):
        # Micro-batch by micro-batch, so that each forward draws the random numbers it
        # draws in the pipeline; the loss sees the whole batch, as in training without a
        # pipeline (so a loss that is not a mean over the samples fails the check), unless
        # the loss is over each micro-batch as a whole (`per_micro_batch`: a contrastive
        # loss over its pairs), whose mean over the micro-batches the pipeline trains.
        results = [forward(batch, m, micro)
                   for m, micro in enumerate(split_batch(inputs, micro_batches))]
        whole = (None,) if len(problem.blocks[output_block].devices) > 1 else ()
        with torch.set_grad_enabled(grad):
            if per_micro_batch(model.loss):
                loss = loss_function(model)
                return torch.stack([loss(out, part, *whole).float() for out, part in zip(
                    results, split_batch(targets, micro_batches))]).mean()
            what = f"block '{problem.blocks[output_block].name}'" if forward.whole is None \
                else "the model"
            return loss_function(model, _WHOLE)(concatenated(results, what), targets, *whole)


_WHOLE = "on the whole batch's output in --check's reference (its micro-batches' outputs " \
    "concatenated; a loss over each micro-batch as a whole, such as a contrastive loss over " \
    "its pairs, says so: loss.per_micro_batch = True)"


def per_micro_batch(loss) -> bool:
    """Whether the user's loss declares itself over each micro-batch as a whole
    (`loss.per_micro_batch = True`), not a mean over its samples."""
    return getattr(loss, "per_micro_batch", False) is True


def tokens_of(targets) -> int:
    """What an evaluation batch weighs in the mean over the split: its target tokens (integer
    targets, less those at -100, the ignore_index of torch's and Hugging Face's losses), else
    its samples."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(targets) if isinstance(t, torch.Tensor)]
    if not leaves:
        return 1
    first = leaves[0]
    if not first.is_floating_point() and first.dim() >= 1:
        return int((first != -100).sum())
    return int(first.shape[0]) if first.dim() else 1


def _evaluate(forward, model, problem, output_block, seed, device, autocast,
              evaluation) -> float:
    _, count, micro_batches = evaluation
    forward.train(False)
    total = weight = 0.0
    i = 0
    with torch.no_grad():
        while count is None or i < count:
            data = make_batch(model, i, seed, device, split="eval")
            if data is None:  # the end of the eval split
                break
            w = tokens_of(data[1])
            total += w * float(_loss(forward, model, problem, output_block, i, data,
                                     micro_batches(data[0]), autocast, grad=False))
            weight += w
            i += 1
    forward.train(True)
    return total / weight


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
            self.wants_inputs = built.wants_inputs
            self.preds = block_inputs(problem, self.modules)
            self.order = [b for b in problem.graph.topological_order() if b in self.modules]
            names = built.names
            self.named = [(names.get(id(p), f"{problem.blocks[b].name}.{n}"), p)
                          for b, m in self.modules.items() for n, p in m.named_parameters()]
            self.named = list({id(p): (n, p) for n, p in self.named}.values())
        self.parameters = [p for _, p in self.named]

    def buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers, by the names the pipelined run's checkpoints give them (the
        model's own; a block's module's under the block's name), on the CPU in fp32."""
        if self.whole is not None:
            named = [(n, b) for n, b in self.whole.named_buffers() if n.rpartition(".")[2] not
                     in self.whole.get_submodule(n.rpartition(".")[0])._non_persistent_buffers_set]
        else:
            named = [(f"{self.problem.blocks[b].name}.{n}", t) for b, m in self.modules.items()
                     for n, t in m.named_buffers()]
        return {n: t.detach().float().cpu().clone() for n, t in named}

    def train(self, mode: bool) -> None:
        for module in [self.whole] if self.whole is not None else self.modules.values():
            module.train(mode)

    def _hooks(self) -> None:
        """Reseed where each block starts: its first module (the whole model's call for the
        first block of a forward cut, which starts before its first module runs)."""
        problem, model = self.problem, self.model
        for b in forward_blocks(problem):
            first = model.stages[problem.blocks[b].name][0]
            # (the first block's starts with the model's call: a traced piece runs what the
            # model computes before its first module too)
            target = self.whole if b == min(self.seeds) else self.whole.get_submodule(first)
            target.register_forward_pre_hook(lambda *_, b=b: self._reseed(b))

    def _reseed(self, b: int) -> None:
        seed_generators(forward_seed(self.seeds[b], self.step, self.micro_batch), self.device)

    def __call__(self, step: int, micro_batch: int, micro):
        self.step, self.micro_batch = step, micro_batch
        grad = bool(self.trains)
        if self.whole is not None:
            with torch.set_grad_enabled(grad):
                out = whole_forward(self.whole, micro)
            return logits(out)
        outputs = {}
        for b in self.order:
            args = [outputs[p] for p in self.preds[b]]
            if not self.preds[b] or b in self.wants_inputs:  # (a graph pipeline's stage)
                args.insert(0, micro)
            self._reseed(b)
            with torch.set_grad_enabled(b in self.trains):
                outputs[b] = self.modules[b](*args)
        return outputs[self.output]


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str


def relative_error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """||got - want|| / ||want|| in the 2-norm (want all zeros: the absolute difference), the
    denominator at least `floor`. A norm, not element by element: an adaptive optimizer's
    update of an element whose gradient is about its eps (AdamW: 1e-8) amplifies the last bit
    of that gradient a hundred thousand times, and such elements exist in any model; a wrong
    tensor shows in its norm."""
    if not want.numel():
        return 0.0
    return float(torch.linalg.vector_norm(got - want)) / \
        max(float(torch.linalg.vector_norm(want)), floor, _TINY)


_NOISE = 1e-4
"""A gradient below this fraction of the model's largest (in norm) is compared against that
floor: an exactly-zero gradient (the key bias of softmax attention, whose gradient cancels)
comes out as float32's rounding of much larger terms in both runs (a U-Net's: 3e-10 of the
largest), and two such noises differ by their own size. Any error above the tolerance times
this floor still fails (1e-9 of the largest gradient at the default tolerance): a wrong
gradient is about as large as the gradient itself."""


def _loss_error(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), _TINY)


def compare(losses: list[float], snapshots: list[dict], ref_losses: list[float],
            ref_snapshots: list[dict], tolerance: float, evals: list = (),
            ref_evals: list = (), first_step: int = 0, forward_only: bool = False) -> Verdict:
    """Step by step over the checked steps (`snapshots`: per step the pipelined run's
    gradients and values keyed (name, block), one entry per copy of a tied parameter;
    `ref_snapshots` the single-process run's, keyed by name): the loss, then the worst
    gradient, then the worst updated value; then the evaluations. The first step with an error
    above `tolerance` (relative: see relative_error) fails the check, naming the worst
    parameter of that step (and its copy); else the verdict says the worst of all. Steps are
    named 1-based (the step just completed), from `first_step` + 1. `forward_only` (an
    inference plan): no update, so nothing drifts: every step's loss is judged."""
    def loss_differs(i: int) -> Verdict | None:
        error = _loss_error(losses[i], ref_losses[i])
        if not error <= tolerance:
            return Verdict(False, f"the loss of step {first_step + i + 1} is {losses[i]:.8g}, "
                           f"the single-process run's {ref_losses[i]:.8g} (relative error "
                           f"{error:.3g}, tolerance {tolerance:g})")
        return None

    if forward_only:
        judged = min(len(losses), len(ref_losses))
        failed = next(filter(None, map(loss_differs, range(judged))), None)
        return failed or Verdict(True, f"{judged} forward-only steps: the losses match the "
                                 "single-process forwards' (largest relative error "
                                 f"{max(map(_loss_error, losses, ref_losses)):.1e}, "
                                 f"tolerance {tolerance:g})")
    worst = (0.0, None)  # (error, what)
    for i, (mine, ref) in enumerate(zip(snapshots, ref_snapshots)):
        step = first_step + i + 1
        failed = loss_differs(i)
        if failed:
            return failed
        for kind in ("gradients", "values"):
            errors = []
            floor = _NOISE * max((float(torch.linalg.vector_norm(w)) for w in ref[kind].values()),
                                 default=0.0) if kind == "gradients" else 0.0
            copies: dict[str, list] = {}
            for (name, block), tensor in mine[kind].items():
                copies.setdefault(name, []).append((block, tensor))
            for name, want in ref[kind].items():
                got = copies.get(name)
                if not got:
                    return Verdict(False, f"parameter {name} is missing in the pipelined model")
                for block, tensor in got:
                    where = name if len(got) == 1 else f"{name} (the copy in block {block})"
                    if tensor.shape != want.shape:
                        return Verdict(False, f"parameter {where} is shaped "
                                       f"{tuple(tensor.shape)} in the pipelined model, "
                                       f"{tuple(want.shape)} in the single-process one")
                    errors.append((relative_error(tensor, want, floor), where))
            if not errors:
                continue
            error, where = max(errors, key=lambda e: e[0])
            what = "gradient" if kind == "gradients" else "value after the update"
            allowed = max(tolerance, VALUES) if kind == "values" else tolerance
            if not error <= allowed:
                return Verdict(False, f"at step {step} the {what} of {where} differs from the "
                               f"single-process run's: relative error {error:.3g} (tolerance "
                               f"{allowed:g}; the worst of {len(errors)} parameters)")
            if error >= worst[0]:
                worst = (error, f"the {what} of {where} at step {step}")
        if mine.get("buffers"):  # (none with data-parallel replicas)
            failed = _buffers_differ(mine["buffers"], ref.get("buffers", {}), step, tolerance)
            if failed:
                return failed
    for (step, got), (_, want) in zip(evals, ref_evals):
        error = _loss_error(got, want)
        if not error <= tolerance:
            return Verdict(False, f"the evaluation after step {step} is {got:.8g}, the "
                           f"single-process run's {want:.8g} (relative error {error:.3g}, "
                           f"tolerance {tolerance:g})")
    checked = len(snapshots)
    count = len(ref_snapshots[0]["gradients"]) if ref_snapshots else 0
    text = f"{checked} steps: the loss"
    if count:
        text += (f", the gradients and the updated values of {count} parameters (worst: "
                 f"{worst[1]}, relative error {worst[0]:.1e})")
    text += (f" match the single-process run's (tolerance {tolerance:g}, the values "
             f"{max(tolerance, VALUES):g})")
    buffers = len(snapshots[0].get("buffers", ())) if snapshots else 0
    if buffers:
        text += f", and so do {buffers} buffers"
    if len(losses) > checked:
        later = max(_loss_error(a, b) for a, b in zip(losses, ref_losses))
        text += (f"; the losses of all {len(losses)} steps differ by at most {later:.1e} "
                 "(relative; reported, not judged)")
    if evals:
        text += (f"; {len(evals)} evaluations match (largest relative error "
                 f"{max(_loss_error(a[1], b[1]) for a, b in zip(evals, ref_evals)):.1e})")
    return Verdict(True, text)


def _buffers_differ(mine: dict, ref: dict, step: int, tolerance: float) -> Verdict | None:
    """The first of the pipelined run's buffers (batch norms' running statistics and counts,
    updated once by every micro-batch's forward) that differs from the single-process run's
    after step `step`."""
    for (name, _), tensor in sorted(mine.items()):
        want = ref.get(name)
        if want is None:
            return Verdict(False, f"buffer {name} of the pipelined model is not the "
                           "single-process model's")
        error = relative_error(tensor, want) if tensor.shape == want.shape else float("inf")
        if not error <= tolerance:
            what = f"is {float(tensor):g}, the single-process run's {float(want):g}" if \
                tensor.numel() == want.numel() == 1 else \
                f"differs from the single-process run's: relative error {error:.3g}"
            return Verdict(False, f"at step {step} buffer {name} {what} (tolerance "
                           f"{tolerance:g}; each micro-batch's forward updates it once)")
    return None


def perturb(pipe, name: str) -> None:
    """Testing aid (--perturb RANK:PARAMETER): add a small error (1e-3 of the gradient's norm,
    in its first element) to one parameter's gradient on this rank, just before the
    optimizer's step, as a wrong gradient computed by one stage would be: what --check must
    catch and name."""
    for key, param in pipe.named_parameters():
        if key == name and param.grad is not None:
            grad = local(param.grad)  # (a DTensor's part on this rank)
            grad.view(-1)[0] += 1e-3 * max(float(grad.norm()), 1e-6)
            return
    raise RunError(f"--perturb: rank {pipe.rank} holds no parameter {name!r} with a gradient",
                   hint="name one of the rank's parameters: " +
                   ", ".join(k for k, _ in pipe.named_parameters()[:5]))
