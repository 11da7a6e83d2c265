"""Gradients between ranks: one flat tensor per collective, the executor's REDUCE and SYNC
(Reductions), sharded data parallelism's parts (Shards, mesh.shard) and what the Pipeline does
with the gradients around an iteration (PipelineGradients: ties, accumulation, fp16, clipping).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pyplan.errors import RunError
from pyplan.lower import REDUCE, SYNC
from pyplan.models.chunks import shard_dim
from pyplan.models.collectives import all_reduce_
from pyplan.run.binding import Built
from pyplan.run.comm import device_backend, transfer_error

__all__ = ["PipelineGradients", "Reductions", "Shards", "flat_gradients", "norm_argument",
           "padded", "set_gradients", "unflatten_into"]


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


class Reductions:
    """The REDUCE and SYNC instructions of a rank's program (pyplan.lower), for the executor:
    REDUCE sums the gradients of a multi-device block's replicated parameters over the block's
    ranks; SYNC starts a stage's gradient synchronisation across the data-parallel replicas
    (all-reduce, or reduce-scatter with mesh.shard) and `finish` waits for them all."""

    def __init__(self, program, params: dict[int, list[torch.Tensor]], groups: dict, mesh, *,
                 dp_group=None, tied=frozenset(), sync_at_end: bool = False) -> None:
        self.program, self.params, self.groups, self.mesh = program, params, groups, mesh
        self.dp_group = dp_group
        self.tied = tied
        """ids of tied parameters whose gradients the tie's all-reduce sums over every rank
        holding them (REDUCE leaves them alone, or a multi-device holder counts its ranks')."""
        self.syncing: list = []  # gradient synchronisations started, not yet finished
        self.sync_at_end, self.deferred = sync_at_end, []
        self.reduced = self._reduced()

    def _reduced(self) -> dict[int, list[torch.Tensor]]:
        """block -> the replicated parameters its REDUCE sums over the block's ranks: each at
        the last REDUCE of a block holding it (blocks on the same devices may share one, a
        tie), none that a tie's all-reduce sums anyway."""
        last = {}
        for ins in self.program:
            if ins.op == REDUCE:
                last.update((id(p), ins.block) for p in self.params[ins.block])
        return {b: [p for p in self.params[b] if last[id(p)] == b and shard_dim(p) is None
                    and id(p) not in self.tied] for b in set(last.values())}

    def reduce(self, block: int) -> None:
        """A REDUCE: sum the block's replicated parameters' gradients over its ranks."""
        params = self.reduced.get(block)
        if not params:
            return
        flat = flat_gradients(params)
        try:
            all_reduce_(flat, self.groups[block])
        except RuntimeError as exc:
            raise transfer_error(exc) from exc
        set_gradients(params, flat)

    def sync(self, block: int) -> None:
        """A SYNC: start the synchronisation of a stage's gradients across the replicas now, or
        with sync_at_end, when the iteration's blocks are done (in finish)."""
        if self.sync_at_end:
            self.deferred.append(block)
        else:
            self._start(block)

    def _start(self, block: int) -> None:
        """Start the synchronisation of a stage's gradients across the replicas, on its own
        (gloo or NCCL) stream: all-reduce, or reduce-scatter when sharded (mesh.shard)."""
        params = self.params[block]
        if not params:
            return
        flat = flat_gradients(params)
        replicas = self.mesh.data_parallel
        try:
            if self.mesh.shards > 1:
                flat = padded(flat, replicas)
                part = flat.new_empty(len(flat) // replicas)
                handle = dist.reduce_scatter_tensor(part, flat, group=self.dp_group,
                                                    async_op=True)
            else:
                part = None
                handle = dist.all_reduce(flat, group=self.dp_group, async_op=True)
        except RuntimeError as exc:
            raise transfer_error(exc) from exc
        self.syncing.append((block, handle, params, flat, part))

    def finish(self, *, whole: bool = False) -> dict[int, torch.Tensor]:
        """Wait for the synchronisations: all-reduced gradients, averaged, go back to the
        parameters; sharded, this replica's averaged part of each stage's flat gradient is
        returned (and with `whole`, the whole gradient is gathered back too)."""
        for block in self.deferred:
            self._start(block)
        self.deferred = []
        parts = {}
        replicas = self.mesh.data_parallel
        try:
            for block, handle, params, flat, part in self.syncing:
                handle.wait()
                if part is not None:
                    parts[block] = part.div_(replicas)
                    if not whole:
                        continue
                    dist.all_gather_into_tensor(flat, part, group=self.dp_group)
                else:
                    flat.div_(replicas)
                set_gradients(params, flat)
        except RuntimeError as exc:
            raise transfer_error(exc) from exc
        self.syncing = []
        return parts


class Shards:
    """Sharded data parallelism (mesh.shard, ZeRO): for each synchronised stage on this rank,
    the replica's part of its flattened parameters, a Parameter the user's optimizer updates;
    after the gradients are reduce-scattered into the parts, and before the next forward, the
    parts are all-gathered back into the stage's parameters."""

    def __init__(self, modules: dict, program, replica: int, replicas: int, group) -> None:
        self.group, self.stages = group, {}
        for ins in program:
            if ins.op != SYNC:
                continue
            params = [p for p in modules[ins.block].parameters() if p.requires_grad]
            if not params:
                continue
            flat = padded(torch.cat([p.detach().reshape(-1) for p in params]), replicas)
            size = len(flat) // replicas
            part = torch.nn.Parameter(flat[replica * size:(replica + 1) * size].clone())
            self.stages[ins.block] = (params, flat, part)

    def parts(self) -> list[torch.nn.Parameter]:
        return [part for _, _, part in self.stages.values()]

    def named_parts(self, problem) -> list[tuple[str, torch.nn.Parameter]]:
        return [(f"{problem.blocks[b].name}.flat_shard", part)
                for b, (_, _, part) in self.stages.items()]

    def take(self, grads: dict[int, torch.Tensor]) -> None:
        for block, (_, _, part) in self.stages.items():
            if part.grad is None:
                part.grad = grads[block].clone()
            else:
                part.grad += grads[block]

    def gather(self) -> None:
        """The updated parts back into the parameters, whose own gradients start afresh (the
        user's optimizer zeroes only the parts)."""
        for params, flat, part in self.stages.values():
            dist.all_gather_into_tensor(flat, part.detach(), group=self.group)
            unflatten_into(params, flat)
            for p in params:
                p.grad = None


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
        if mine and problem.mesh.shards > 1:
            raise RunError("tied parameters with a sharded data-parallel mesh (mesh.shard) are "
                           "not supported", hint="use mesh: {shard: false}")
        return mine

    def _before_accumulating(self) -> None:
        """Make the step's sums and unscaling apply to this step's gradient only, when .grad
        already holds earlier steps' (accumulation). After a step each copy of a tied
        parameter holds the sum over its copies, and each rank of a multi-device block the sum
        of a replicated parameter over the block's ranks: summing those again would count the
        earlier steps once per copy. So the sum stays on the one rank that keeps it (the one
        clip_grad_norm_ counts) and the others start from zero. fp16: the kept gradient is
        scaled back up (a power of two: exact) so that the step's unscale divides it once."""
        for _, param, group in self.ties:
            if param.grad is not None and dist.get_process_group_ranks(group)[0] != self.rank:
                param.grad.zero_()
        for block, params in self.executor.reductions.reduced.items():
            if self.problem.blocks[block].devices[0] != self.device_index:
                for p in params:
                    if p.grad is not None:
                        p.grad.zero_()
        if self.dtype == "fp16":
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.loss_scale)

    def _sum_ties(self) -> None:
        for _, param, group in self.ties:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            try:
                dist.all_reduce(param.grad, group=group)
            except RuntimeError as exc:
                raise transfer_error(exc) from exc

    def _unscale(self) -> None:
        """fp16: every gradient divided by the loss scale and checked for inf/NaN at once
        (torch's foreach kernel, as GradScaler), the verdict all-reduced over every rank (a
        rank without parameters too) and read once, after the iteration."""
        params = [p for p in self.parameters() if p.grad is not None]
        found = torch.zeros((), device=self.device)
        inverse = torch.full((), 1.0 / self.loss_scale, device=self.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self.overflow = bool(found)
        self._overflowed |= self.overflow
        if self.overflow:  # nothing for an optimizer to apply: torch.optim skips p.grad None
            self.loss_scale /= 2
            self._clean_steps = 0
            for p in params:
                p.grad = None
        else:
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
        max_norm, norm_type = norm_argument("max_norm", max_norm), \
            norm_argument("norm_type", norm_type)
        if max_norm == math.inf:
            raise RunError("Pipeline.clip_grad_norm_: max_norm inf clips nothing",
                           hint="give a positive, finite max_norm")
        local = self._counted_gradients()
        total = torch.nn.utils.get_total_norm(local, norm_type).float().to(self.device) \
            if local else torch.zeros((), device=self.device)
        if norm_type == math.inf:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        else:
            total = total ** norm_type
            dist.all_reduce(total)
            total = total ** (1.0 / norm_type)
        torch.nn.utils.clip_grads_with_norm_([p for p in self.parameters()
                                              if p.grad is not None], max_norm, total)
        return total

    def _counted_gradients(self) -> list[torch.Tensor]:
        """Each gradient of the model once over the world: replica 0's; a tied parameter's on
        the lowest rank holding it; a replicated parameter of a multi-device block on the
        block's first rank; every rank's chunk of a sharded one; with mesh.shard, every
        replica's own shard."""
        if self.shards is not None:
            return [p.grad for p in self.shards.parts() if p.grad is not None] + \
                ([p.grad for p in self._params if p.grad is not None]
                 if self.data_index == 0 else [])
        if self.data_index != 0:
            return []
        tied_here = {id(param): group for _, param, group in self.ties}
        seen, out = set(), []
        for b, module in self.modules.items():
            block = self.problem.blocks[b]
            for p in module.parameters():
                if id(p) in seen or p.grad is None or not p.requires_grad:
                    continue
                seen.add(id(p))
                if id(p) in tied_here and dist.get_process_group_ranks(tied_here[id(p)])[0] \
                        != self.rank:
                    continue
                if len(block.devices) > 1 and shard_dim(p) is None and \
                        block.devices[0] != self.device_index:
                    continue
                out.append(p.grad)
        return out


def norm_argument(name: str, value) -> float:
    """A clip_grad_norm_ argument as a float: positive (not NaN), else RunError."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not number > 0:  # also NaN
        raise RunError(f"Pipeline.clip_grad_norm_: {name} {value!r} is not a positive number",
                       hint="max_norm: the largest norm allowed, e.g. 1.0; norm_type: 2.0 "
                            "(default), 1.0 or inf")
    return number
