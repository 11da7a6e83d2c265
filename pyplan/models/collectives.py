"""The all-reduces of multi-device blocks, fast on gloo too.

gloo's all-reduce is a ring: 2(D - 1) steps, each waiting for a neighbour to be scheduled. On a
CPU machine with more ranks than cores that costs milliseconds even for a few bytes (measured
here: 4 ranks on 2 cores, 1-64 KiB: 3-6 ms, against 0.5-0.8 ms for the star below). So on gloo,
up to STAR_BYTES, the group's first rank gathers the others' tensors, reduces them and sends the
result back (two rounds of point-to-point messages on the group's own communicator); larger
tensors, and every other backend (NCCL), use the backend's all-reduce.

`all_sum` and `summed_gradient` are the differentiable forms pyplan's contract for a
multi-device block needs (its output gradient may arrive split among its ranks, so what is
summed forward is summed backward too); `Star` routes the all-reduces DTensor issues (torch's
functional collectives, e.g. under loss_parallel) through the same path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["STAR_BYTES", "Star", "all_reduce_", "all_sum", "summed_gradient"]

STAR_BYTES = 256 << 10  # 4 gloo ranks on 2 cores: the star wins at 1 MiB too, loses at 4 MiB

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce_(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """x reduced over `group` in place ("sum", "max" or "min"); returns x."""
    if dist.get_backend(group) != "gloo" or x.numel() * x.element_size() > STAR_BYTES \
            or not x.is_contiguous():
        dist.all_reduce(x, op=_OPS[op], group=group)
        return x
    ranks = dist.get_process_group_ranks(group)
    if dist.get_rank() != ranks[0]:
        dist.send(x, ranks[0], group=group)
        dist.recv(x, ranks[0], group=group)
        return x
    parts = [torch.empty_like(x) for _ in ranks[1:]]
    for work in [dist.irecv(part, r, group=group) for part, r in zip(parts, ranks[1:])]:
        work.wait()
    for part in parts:
        if op == "sum":
            x.add_(part)
        elif op == "max":
            torch.maximum(x, part, out=x)
        else:
            torch.minimum(x, part, out=x)
    for work in [dist.isend(x, r, group=group) for r in ranks[1:]]:
        work.wait()
    return x


class _Sum(torch.autograd.Function):
    """Summed over the group forward, and its gradient summed backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


class _SummedGradient(torch.autograd.Function):
    """x itself; backward, the gradient summed over the group (a split gradient made whole)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


def all_sum(x: torch.Tensor, group) -> torch.Tensor:
    """x summed over `group` (x itself with group None), differentiably."""
    return x if group is None else _Sum.apply(x, group)


def summed_gradient(x: torch.Tensor, group) -> torch.Tensor:
    return _SummedGradient.apply(x, group)


class Star(TorchDispatchMode):
    """While active, torch's functional all-reduces (what DTensor issues) on gloo groups run as
    `all_reduce_`; their results are ready at once, so the matching waits return them as they
    are."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # a DTensor op: let it desugar into plain ones, seen here
        kwargs = kwargs or {}
        if func is torch.ops._c10d_functional.all_reduce.default:
            x, op, name = args
            group = dist.distributed_c10d._resolve_process_group(name)
            if dist.get_backend(group) == "gloo" and op in _OPS:
                return all_reduce_(x.contiguous().clone(), group, op)
        return func(*args, **kwargs)
