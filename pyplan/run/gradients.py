"""Gradients between ranks: one flat tensor per collective, the executor's REDUCE and SYNC
(Reductions; SYNC is FSDP2's, pyplan.mesh) and what the Pipeline does with the gradients
around an iteration (PipelineGradients: ties, accumulation, fp16, clipping). Gradients may be
DTensors (FSDP2's shards): what crosses ranks here is each rank's local part.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from pyplan.errors import RunError
from pyplan.lower import REDUCE
from pyplan.models.chunks import shard_dim
from pyplan.models.collectives import all_reduce_
from pyplan.run.binding import Built
from pyplan.comm import transfer_error
from pyplan.run.data import describe
from pyplan.comm.devices import device_backend

__all__ = ["MasterWeights", "PipelineGradients", "Reductions", "Slots", "flat_gradients",
           "local", "norm_argument", "padded", "set_gradients", "unflatten_into"]


def tensor_sharded(p: torch.Tensor) -> bool:
    """Whether each tensor-parallel rank holds its own part of `p` (a DTensor sharded on the
    mesh's tp dim); else every tensor rank holds the same."""
    mesh = getattr(p, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    # (not is_shard(): torch's _StridedShard, a MoE's packed gate and up, is no Shard)
    return "tp" in names and not p.placements[names.index("tp")].is_replicate()


def local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's part on this rank (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def flat_gradients(params: list[torch.Tensor]) -> torch.Tensor:
    """The parameters' gradients (zeros where none) in one flat tensor: one collective each."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return torch.cat([p.grad.reshape(-1) for p in params])


def padded(flat: torch.Tensor, parts: int) -> torch.Tensor:
    """`flat` with zeros at the end, so that it splits into `parts` equal parts."""
    return torch.nn.functional.pad(flat, (0, -len(flat) % parts))


def unflatten_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of `flat` into the tensors (the inverse of flattening them)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def set_gradients(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    unflatten_into([p.grad for p in params], flat)


class Slots:
    """Where each block's trainable parameters live (owner module, attribute name), resolved
    to the objects there now: FSDP swaps the objects (sharded between iterations, unsharded
    while one runs), not the places."""

    def __init__(self, modules: dict[int, nn.Module]) -> None:
        self.slots = {}
        for b, module in modules.items():
            mine = []
            for name, p in module.named_parameters():
                if p.requires_grad:
                    path, _, attr = name.rpartition(".")
                    mine.append((module.get_submodule(path) if path else module, attr))
            self.slots[b] = mine

    def __getitem__(self, block: int) -> list[torch.Tensor]:
        return [owner._parameters[attr] for owner, attr in self.slots[block]]

    def items(self):
        return ((b, self[b]) for b in self.slots)


class Reductions:
    """The REDUCE and SYNC instructions of a rank's program (pyplan.lower), for the executor:
    REDUCE sums the gradients of a multi-device block's replicated parameters over the block's
    ranks; SYNC reduces a stage's gradients across the data-parallel ranks (FSDP2, pyplan.run.
    mesh.DataParallel: reduce-scatter, all-reduce across replicas) and `finish` waits for them
    all."""

    def __init__(self, program, params: Slots, groups: dict, *, data_parallel=None,
                 tied=frozenset(), sync_at_end: bool = False) -> None:
        self.program, self.params, self.groups = program, params, groups
        self.distributed: list | None = None  # the DTensor parameters, once finish() looks
        self.data_parallel = data_parallel
        self.tied = tied
        """ids of tied parameters whose gradients the tie's all-reduce sums over every rank
        holding them (REDUCE leaves them alone, or a multi-device holder counts its ranks')."""
        self.sync_at_end, self.deferred = sync_at_end, []
        self.reduced = self._reduced()

    def _reduced(self) -> dict[int, list[tuple[nn.Module, str]]]:
        """block -> the replicated parameters its REDUCE sums over the block's ranks: each at
        the last REDUCE of a block holding it (blocks on the same devices may share one, a
        tie), none that a tie's all-reduce sums anyway."""
        last = {}
        for ins in self.program:
            if ins.op == REDUCE:
                last.update(((id(o), a), ins.block) for o, a in self.params.slots[ins.block])
        return {b: [(o, a) for o, a in self.params.slots[b] if last[(id(o), a)] == b
                    and shard_dim(o._parameters[a]) is None
                    and id(o._parameters[a]) not in self.tied]
                for b in set(last.values())}

    def reduced_params(self, block: int) -> list[torch.Tensor]:
        return [o._parameters[a] for o, a in self.reduced.get(block, ())]

    def reduce(self, block: int) -> None:
        """A REDUCE: sum the block's replicated parameters' gradients over its ranks."""
        params = self.reduced_params(block)
        if not params:
            return
        flat = flat_gradients(params)
        try:
            all_reduce_(flat, self.groups[block])
        except RuntimeError as exc:
            raise transfer_error(exc) from exc
        set_gradients(params, flat)

    def sync(self, block: int) -> None:
        """A SYNC: reduce the stage's gradients across the data-parallel ranks now, or with
        sync_at_end, when the iteration's blocks are done (in finish)."""
        if self.data_parallel is None:
            return
        if self.sync_at_end:
            self.deferred.append(block)
            return
        try:
            self.data_parallel.reduce(block)
        except RuntimeError as exc:
            raise transfer_error(exc) from exc

    def finish(self) -> None:
        """Wait for the synchronisations: every gradient averaged over the data-parallel ranks
        into its (sharded) parameter's .grad. Without data parallelism, a gradient DTensor
        left as a pending sum over the tensor ranks (Partial: sequence parallelism's norms,
        each rank's from its slice) is summed now, once per iteration (FSDP2 sums them in its
        reduction)."""
        if self.data_parallel is None:
            from torch.distributed.tensor import DTensor, Replicate

            if self.distributed is None:  # (found once: the parameters do not change)
                self.distributed = [p for _, params in self.params.items() for p in params
                                    if isinstance(p, DTensor)]
            for p in self.distributed:
                grad = p.grad
                if grad is not None and any(x.is_partial() for x in grad.placements):
                    p.grad = grad.redistribute(placements=[
                        Replicate() if x.is_partial() else x for x in grad.placements])
            return
        try:
            for block in self.deferred:
                self.data_parallel.reduce(block)
            self.data_parallel.finish()
        except RuntimeError as exc:
            raise transfer_error(exc) from exc
        self.deferred = []


class MasterWeights:
    """bf16 parameters trained through fp32 master copies (Megatron-LM's --bf16): the blocks
    compute with the bf16 parameters, whose gradients (accumulated over a step's micro-batches
    in bf16) are added into the masters' fp32 gradients after each step; the optimizer, clipping
    and checkpoints see the masters, whose values go back into the bf16 parameters after each
    optimizer step. Make it from the fp32 parameters before they are cast (`cast`)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.pairs = [(p, nn.Parameter(p.detach().clone().float())) for p in params]
        self.of = {id(p): m for p, m in self.pairs}
        """id of a bf16 parameter -> its master."""

    def cast(self) -> None:
        for p, _ in self.pairs:
            p.data = p.data.to(torch.bfloat16)

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient that counts for a block's parameter: its master's."""
        master = self.of.get(id(p))
        return p.grad if master is None else master.grad

    def gather(self) -> None:
        """After a step: each parameter's gradient (this step's) added to its master's."""
        for p, master in self.pairs:
            if p.grad is not None:
                grad = p.grad.float()
                master.grad = grad if master.grad is None else master.grad.add_(grad)

    def release(self) -> None:
        """Before a step: its micro-batches' gradients start from none (the earlier steps'
        are in the masters)."""
        for p, _ in self.pairs:
            p.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """The masters' values into the bf16 parameters (after the optimizer, or a load)."""
        for p, master in self.pairs:
            local(p).copy_(local(master))


class PipelineGradients:
    """What `Pipeline` does with the gradients around the schedule's iteration (a base class of
    pyplan.run.pipeline.Pipeline, whose attributes these methods read: problem, rank, data_index,
    device, ties, executor, shards, ...): the ties' groups and sums, the accumulation of
    several steps, fp16's unscaling, and clipping over the whole model."""

    def _tie_groups(self, built: Built) -> list[tuple[str, torch.Tensor, object]]:
        """(name, parameter, group of the ranks holding a copy) for each tie this rank holds
        a copy of, in the same order on every rank."""
        problem = self.problem
        by_name = {name: p for b, m in self.modules.items() for p in m.parameters()
                   for name in [built.names.get(id(p))] if name is not None}
        mine = []
        for tie in built.ties:
            holders = sorted({problem.by_name[s] for s in tie.stages})
            if len({problem.blocks[b].devices for b in holders}) == 1:
                # Blocks on the same devices (the M-shape's embedding and head): each rank
                # holds one object for all of them, its gradients already added up there
                # (different chunks of a vocabulary-sharded weight, which must not be summed).
                continue
            mesh = problem.mesh
            devices = sorted({d for b in holders for d in problem.blocks[b].devices})
            if len(devices) < 2:
                continue
            groups = {(i, t): self._group([mesh.rank(d, i, t) for d in devices],
                                          device_backend(self.device))
                      for i in range(mesh.data_parallel) for t in range(mesh.tensor)}
            if self.device_index in devices:
                mine.append((tie.parameter, by_name[tie.parameter],
                             groups[(self.data_index, self.tensor_index)]))
        return mine

    def _before_accumulating(self) -> None:
        """Make the step's sums and unscaling apply to this step's gradient only, when .grad
        already holds earlier steps' (accumulation). After a step each copy of a tied
        parameter holds the sum over its copies, and each rank of a multi-device block the sum
        of a replicated parameter over the block's ranks: summing those again would count the
        earlier steps once per copy. So the sum stays on the one rank that keeps it (the one
        clip_grad_norm_ counts) and the others start from zero. fp16: the kept gradient is
        scaled back up (a power of two: exact) so that the step's unscale divides it once.
        bf16 parameters: their gradients start from none, the earlier steps' in the masters."""
        if self.masters is not None:
            self.masters.release()
        for _, param, group in self.ties:
            if param.grad is not None and dist.get_process_group_ranks(group)[0] != self.rank:
                param.grad.zero_()
        reductions = self.executor.reductions
        for block in reductions.reduced:
            if self.problem.blocks[block].devices[0] != self.device_index:
                for p in reductions.reduced_params(block):
                    if p.grad is not None:
                        p.grad.zero_()
        if self.dtype == "fp16":
            grads = [local(p.grad) for p in self.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.loss_scale)

    def _sum_ties(self) -> None:
        for _, param, group in self.ties:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            try:
                dist.all_reduce(local(param.grad), group=group)
            except RuntimeError as exc:
                raise transfer_error(exc) from exc

    def _unscale(self, loss: torch.Tensor | None, norm: bool = False) -> None:
        """Every gradient divided by the loss scale (fp16; 1 otherwise) and checked for
        inf/NaN at once (torch's foreach kernel, as GradScaler), with this rank's loss; the
        verdicts of every rank all-reduced in one collective (a rank without parameters too)
        and read once, after the iteration. With `norm`, the gradients' 2-norm over the whole
        model travels in the same collective (`step_norm`; inf or NaN with a non-finite
        gradient): a training loop that logs or clips by it needs no second one.
        After a non-finite gradient or loss anywhere,
        `overflow` is True, `nonfinite` lists (rank, gradients?, loss?) of the ranks that saw
        one, no gradient is left (torch.optim skips p.grad None) and step_optimizer skips the
        step; fp16 also halves its scale (and doubles it after 2000 clean steps)."""
        params = [p for p in self.parameters() if p.grad is not None]
        found = torch.zeros((), device=self.device)
        inverse = torch.full((), 1.0 / self.loss_scale, device=self.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(local(p.grad))
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
        # Each rank writes only its own two flags: summed, they are every rank's verdicts.
        flags = torch.zeros(2 * self.world + 1, device=self.device)
        flags[2 * self.rank] = found
        if loss is not None:
            flags[2 * self.rank + 1] = (~torch.isfinite(loss.detach().float())).any()
        if norm:
            flags[-1] = self._local_norm(2.0) ** 2
        dist.all_reduce(flags)
        self.step_norm = flags[-1] ** 0.5 if norm else None
        seen = flags.tolist()
        self.nonfinite = [(r, bool(seen[2 * r]), bool(seen[2 * r + 1]))
                          for r in range(self.world) if seen[2 * r] or seen[2 * r + 1]]
        self.overflow = bool(self.nonfinite)
        self._overflowed |= self.overflow
        fp16 = self.dtype == "fp16"
        if self.overflow:  # nothing for an optimizer to apply: torch.optim skips p.grad None
            if fp16:
                self.loss_scale /= 2
                self._clean_steps = 0
            for p in params:
                p.grad = None
        elif fp16:
            self._clean_steps += 1
            if self._clean_steps == 2000:
                self.loss_scale *= 2
                self._clean_steps = 0

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that the norm over the whole model (all stages, every
        parameter once) is at most max_norm; returns that norm before clipping, on every rank,
        as a tensor on the device (reading it synchronises the host: not needed to step).
        The same as torch.nn.utils.clip_grad_norm_ on the model in one process; every rank
        must call it (an all-reduce), whatever its stages hold. max_norm is positive and
        finite, norm_type positive (inf: the largest absolute value)."""
        self._open("clip_grad_norm_")
        try:  # every rank raises the same error, none waits in the all-reduce
            max_norm, norm_type = norm_argument("max_norm", max_norm), \
                norm_argument("norm_type", norm_type)
            if max_norm == math.inf:
                raise RunError("Pipeline.clip_grad_norm_: max_norm inf clips nothing",
                               hint="give a positive, finite max_norm")
            error = None
        except RunError as exc:
            error = exc
        self._agreed(error)
        total = self._norm(norm_type)
        self.clip_grads_with_norm_(max_norm, total)
        return total

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The gradients' norm over the whole model (every parameter once), on every rank, as
        a tensor on the device; every rank must call it (an all-reduce)."""
        try:
            norm_type, error = norm_argument("norm_type", norm_type, "grad_norm"), None
        except RunError as exc:
            error = exc
        self._agreed(error)
        return self._norm(norm_type)

    def clip_grads_with_norm_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """Scale every gradient by max_norm / total_norm when that is below 1, as
        torch.nn.utils.clip_grads_with_norm_: clipping by a norm already known (`step_norm`),
        on this rank alone (no collective)."""
        self._open("clip_grads_with_norm_")
        max_norm = norm_argument("max_norm", max_norm, "clip_grads_with_norm_")
        if not isinstance(total_norm, torch.Tensor) or total_norm.numel() != 1:
            raise RunError(f"Pipeline.clip_grads_with_norm_: got {describe(total_norm)} for "
                           "total_norm, not a one-element tensor",
                           hint="pass pipe.step_norm after pipe.step(..., grad_norm=True)")
        # (torch's clip_grads_with_norm_, on the local parts: a DTensor shard and the plain
        # coefficient do not mix)
        grads = [local(p.grad) for p in self.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))

    def _local_norm(self, norm_type: float) -> torch.Tensor:
        """The norm of the gradients this rank counts (`_counted_gradients`), on the device."""
        counted = self._counted_gradients()
        return torch.nn.utils.get_total_norm(counted, norm_type).float().to(self.device) \
            if counted else torch.zeros((), device=self.device)

    def _norm(self, norm_type: float) -> torch.Tensor:
        total = self._local_norm(norm_type)
        if norm_type == math.inf:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        else:
            total = total ** norm_type
            dist.all_reduce(total)
            total = total ** (1.0 / norm_type)
        return total

    def _counted_gradients(self) -> list[torch.Tensor]:
        """Each gradient of the model once over the world, as this rank's local parts: the
        first replica's (every shard of it); a tied parameter's on the lowest rank holding it;
        a replicated parameter of a multi-device block on the block's first rank; every
        rank's chunk of a sharded one; one not sharded over the tensor ranks on the first."""
        if self.data_index // self.problem.mesh.shards != 0:
            return []
        tied_here = {id(param): group for _, param, group in self.ties}
        seen, out = set(), []
        for b, module in self.modules.items():
            block = self.problem.blocks[b]
            for p in module.parameters():
                if id(p) in seen or self._grad(p) is None or not p.requires_grad:
                    continue
                seen.add(id(p))
                if id(p) in tied_here and dist.get_process_group_ranks(tied_here[id(p)])[0] \
                        != self.rank:
                    continue
                if len(block.devices) > 1 and shard_dim(p) is None and \
                        block.devices[0] != self.device_index:
                    continue
                if self.tensor_index != 0 and not tensor_sharded(p):
                    continue  # (the same on every tensor rank)
                out.append(local(self._grad(p)))
        return out

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        return p.grad if self.masters is None else self.masters.grad(p)


def norm_argument(name: str, value, method: str = "clip_grad_norm_") -> float:
    """A clip_grad_norm_ (or grad_norm) argument as a float: positive (not NaN), else
    RunError."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not number > 0:  # also NaN
        raise RunError(f"Pipeline.{method}: {name} {value!r} is not a positive number",
                       hint="max_norm: the largest norm allowed, e.g. 1.0; norm_type: 2.0 "
                            "(default), 1.0 or inf")
    return number
