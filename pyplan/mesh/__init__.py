"""The plan's world as torch's DeviceMesh, and data parallelism over it with FSDP2.

The mesh has the dims (pp, dp_replicate, dp_shard, tp), pipeline outermost and tensor
parallelism innermost, as torchtitan names and orders them (MeshSpec.rank gives the same
order). Data parallelism is torch's `fully_shard` on the 2-D (dp_replicate, dp_shard) sub-mesh:
HSDP, which with one shard replicates (gradients all-reduced, as DDP) and with one replica
shards (FSDP, ZeRO-3).

Each stage's listed modules (a plan's `model.stages`, or a block module itself) become FSDP
units. A pipeline runs a stage's forward and backward once per micro-batch. Sharded (`shard`),
a unit is all-gathered for each of them and resharded after (FSDP's own default): the least
memory, two all-gathers per unit and micro-batch. Replicated only (one shard), resharding
would gather nothing, and with a split backward W runs apart from B, where no FSDP hook gathers
the parameters again: the units stay whole (torchtitan's choice under pipeline parallelism).
Either way gradients accumulate unsharded over the micro-batches (gradient sync off) and are
reduce-scattered (all-reduced across replicas) once, at the stage's SYNC right after its last
backward on this rank, as torch.distributed.pipelining does for its REDUCE_GRAD; the
iteration's end waits for them.
"""

from __future__ import annotations

import pyplan.comm  # noqa: F401 - torch, without its warning about a missing numpy
import torch
from torch import nn
from torch.utils._pytree import tree_map_only

__all__ = ["DataParallel", "world_mesh"]

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def world_mesh(problem, device: torch.device):
    """The plan's world as a DeviceMesh (every rank calls it: it creates each dim's groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = problem.mesh
    return init_device_mesh(device.type, (problem.num_devices, mesh.replicas, mesh.shards,
                                          mesh.tensor), mesh_dim_names=DIMS)


class DataParallel:
    """FSDP2 over this rank's stages. `units[block]`: the modules whose gradients the block's
    SYNC reduces, innermost first (a stage's layers, then the stage's own module); `shared`:
    modules several of this rank's stages hold (a model cut in its own forward keeps one
    pruned copy per rank), reduced at the iteration's end, after every stage's SYNC."""

    def __init__(self, units: dict[int, list[nn.Module]], shared: list[nn.Module], mesh,
                 compute_dtype, *, reshard: bool) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self._fully_shard = fully_shard
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
            if compute_dtype is not None else MixedPrecisionPolicy()
        dp = mesh["dp_replicate", "dp_shard"]
        # Modules sharing a parameter (a tie inside a rank: GPT-2's embedding and head) are
        # one unit, as FSDP requires; a unit several stages hold is reduced at the end.
        owners: list[tuple[int | None, nn.Module]] = []
        seen: set[int] = set()
        for block, modules in [*units.items(), (None, shared)]:
            for module in modules:
                if id(module) not in seen and any(p.requires_grad for p in module.parameters()):
                    seen.add(id(module))
                    owners.append((block, module))
        groups = _tied(owners)
        for _, module in owners:  # (before fully_shard: this hook runs before FSDP's)
            module.register_forward_hook(_not_views)
        self.units = {block: [] for block in units}
        self.shared = []
        for group in sorted(groups, key=lambda g: min(owners.index(x) for x in g)):
            group.sort(key=owners.index)
            modules = [m for _, m in group]
            fully_shard(modules if len(modules) > 1 else modules[0], mesh=dp,
                        reshard_after_forward=reshard, mp_policy=policy)
            blocks = {b for b, _ in group}
            target = self.units[blocks.pop()] if len(blocks) == 1 and None not in blocks \
                else self.shared
            target.append(modules[0])  # (a group's modules share one FSDP state)
        self.modules = [m for ms in self.units.values() for m in ms] + self.shared
        self.reshard = reshard
        self._arm()

    def _arm(self) -> None:
        """Gradients accumulate unsharded over the iteration's micro-batches."""
        for module in self.modules:
            module.set_requires_gradient_sync(False, recurse=False)
            module.set_reshard_after_backward(self.reshard, recurse=False)
            module.set_is_last_backward(False)

    def reduce(self, block: int) -> None:
        """The block's SYNC: reduce-scatter (and all-reduce across replicas) the gradients its
        units accumulated, averaged over the data-parallel ranks, into their sharded
        gradients, and reshard them."""
        self._reduce(self.units.get(block, ()))

    def _reduce(self, modules) -> None:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
            module.set_is_last_backward(True)
            for group in _param_groups(self._fully_shard.state(module)):
                group.post_backward()

    def finish(self) -> None:
        """The iteration's end: the shared modules reduced, every reduction done (and on the
        default stream), the units resharded, gradient sync off again."""
        self._reduce(self.shared)
        for module in self.modules:
            state = self._fully_shard.state(module)
            if state._is_root:
                state._root_post_backward_final_callback()
        self._arm()


def _param_groups(state) -> list:
    """An FSDP state's parameter groups: a list in torch 2.13 (`_fsdp_param_groups`), one
    group or None in torch 2.11 (`_fsdp_param_group`)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = state._fsdp_param_group
        groups = [] if group is None else [group]
    return groups


class _Same(torch.autograd.Function):
    """The identity, whose output shares the input's storage but is no view of it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _not_views(module: nn.Module, inputs, output):
    """A unit's outputs that are views (a Linear's on 3-D input is one) as tensors of their
    own, before FSDP registers its pre-backward hook on them: an in-place op on a view would
    drop that hook (torch warns of it for every such unit), one on this output keeps it. No
    copy is made."""
    if not torch.is_grad_enabled():
        return output
    return tree_map_only(torch.Tensor, lambda t: _Same.apply(t)
                         if t._base is not None and t.requires_grad else t, output)


def _tied(owners: list) -> list[list]:
    """(block, module) pairs grouped where their modules share a parameter; a module and one
    nested in it stay apart (the inner one's parameters are its own unit's)."""
    groups: list[list] = []
    for owner in owners:
        mine = {id(p) for p in owner[1].parameters()}
        merged = [g for g in groups if not any(_related(owner[1], m) for _, m in g)
                  and mine & {id(p) for _, m in g for p in m.parameters()}]
        rest = [g for g in groups if all(g is not m for m in merged)]
        groups = rest + [[owner] + [x for g in merged for x in g]]
    return groups


def _related(a: nn.Module, b: nn.Module) -> bool:
    return any(m is b for m in a.modules()) or any(m is a for m in b.modules())
