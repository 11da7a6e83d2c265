"""Tensor parallelism of a Mixture-of-Experts layer's experts (Hugging Face's `moe_tp_experts`).

transformers keeps a MoE layer's experts in one module of fused 3-D parameters: `gate_up_proj`
[experts, 2 * inner, hidden] (each expert's gate rows, then its up rows) and `down_proj`
[experts, hidden, inner]; its config's `base_model_tp_plan` names the module `moe_tp_experts`
and the parameters `packed_colwise` and `rowwise`. Each tensor rank holds every expert's
1/T of the inner width: of `gate_up_proj` the same rows of the gate and of the up part
(torch's _StridedShard), of `down_proj` the matching columns.
The experts' own forward runs on those local parts, so each rank's output is a partial sum
(a DTensor Partial) that torch redistributes: summed whole (all-reduce), or with sequence
parallelism reduce-scattered into sequence slices at the MoE block's output, as torch's
RowwiseParallel does for an MLP.

`moe_ep_experts` (given in a plan's mesh.tensor_plan) splits the experts themselves over the
tensor ranks instead (expert parallelism over the tensor group): each rank holds E/T whole
experts (Shard(0)) and runs the tokens routed to them, every token reaching every rank as the
tensor ranks hold it (whole, or with sequence parallelism all-gathered at the MoE block:
Megatron-LM's all-gather token dispatcher, not an all-to-all); transformers' kernels skip the
tokens of other ranks' experts (their expert-parallel sentinels), and the partial outputs are
summed as above.

The router (the block's `gate`) stays whole on every rank and routes the whole input: every
rank picks the same experts for a token. The routing weights' gradient each rank computes a
part of (its slice of every expert) is summed over the tensor ranks, so the router's weight
gets the whole gradient on every rank, as a replicated parameter should. So is the experts'
input's; with sequence parallelism it is left partial instead, and the gradient of the block's
gathered input reduce-scattered into slices, as torch's styles do for an MLP: the router's
part of it, whole on every rank, then counts on the first tensor rank only.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from pyplan.errors import PlanError
from pyplan.models.collectives import summed_gradient
from pyplan.models.forward import hidden_position

__all__ = ["EXPERTS", "EXPERT_PARALLEL", "Experts", "MoeBlock", "check_experts",
           "local_parameters"]

EXPERTS = "moe_tp_experts"
"""The style of a MoE layer's experts module (Hugging Face's name)."""
EXPERT_PARALLEL = "moe_ep_experts"
"""The style that splits the experts over the tensor ranks (pyplan's name)."""
_PARAMETER_STYLES = ("packed_colwise", "colwise", "rowwise")
_HINT = "give mesh.tensor_plan without the experts (or mesh.tensor: 1)"


def check_experts(module: nn.Module, styles: dict[str, str], tensor: int, path: str,
                  where: str, by_expert: bool = False) -> None:
    """PlanError naming what of the experts module at `path` does not shard as `styles` (its
    parameters' styles) ask over `tensor` ranks (`by_expert`: whole experts over them)."""
    kind = type(module).__name__
    if not hasattr(module, "is_concatenated"):  # (set by transformers' experts decorator)
        raise PlanError(f"{where}: module {path} ({kind}) is not transformers' fused experts "
                        f"(use_experts_implementation), which the "
                        f"{EXPERT_PARALLEL if by_expert else EXPERTS} style shards", hint=_HINT)
    if by_expert:
        count = getattr(module, "num_experts", None)
        if not isinstance(count, int) or count % tensor:
            raise PlanError(f"{where}: mesh.tensor {tensor} does not divide the {count} "
                            f"experts of {path} ({EXPERT_PARALLEL})",
                            hint="use a tensor degree that divides the experts, or "
                            f"{EXPERTS}")
        return
    for flag, wanted in (("is_transposed", False), ("has_bias", False)):
        if getattr(module, flag, wanted) != wanted:
            raise PlanError(f"{where}: experts module {path} ({kind}) has {flag}="
                            f"{not wanted}, which pyplan's tensor parallelism does not shard",
                            hint=_HINT)
    grouped = getattr(getattr(module, "config", None), "_experts_implementation",
                      None) == "grouped_mm"
    for name, param in module.named_parameters(recurse=False):
        style = styles.get(name)
        if style not in _PARAMETER_STYLES:
            raise PlanError(f"{where}: experts module {path} has parameter {name} "
                            + ("without a tensor-parallel style" if style is None else
                               f"of style {style!r}, which pyplan does not run for experts"),
                            hint="the plan gives each of the experts' parameters one of "
                            + ", ".join(_PARAMETER_STYLES) + "; " + _HINT)
        if param.dim() != 3:
            raise PlanError(f"{where}: experts parameter {path}.{name} has {param.dim()} "
                            "dimensions, not 3 ([experts, out, in])", hint=_HINT)
        if style == "packed_colwise" and not getattr(module, "is_concatenated", True):
            raise PlanError(f"{where}: experts module {path} interleaves its gate and up "
                            "rows, which packed_colwise does not cut", hint=_HINT)
        dim, parts = (2, 1) if style == "rowwise" else (1, 2 if style == "packed_colwise"
                                                        else 1)
        if param.shape[dim] % (tensor * parts):
            raise PlanError(f"{where}: mesh.tensor {tensor} does not divide the experts' "
                            f"inner width ({param.shape[dim] // parts}) of {path}.{name}",
                            hint="use a tensor degree that divides the experts' "
                            "intermediate size")
        inner = param.shape[dim] // parts // tensor
        if grouped and inner * param.element_size() % 16:  # (torch._grouped_mm's strides)
            raise PlanError(f"{where}: each of {tensor} tensor ranks would hold {inner} of the "
                            f"experts' inner width of {path}.{name}, whose rows transformers' "
                            "grouped_mm experts need in multiples of 16 bytes",
                            hint="use a tensor degree that leaves each rank such a width, or "
                            "build the model with experts_implementation=\"eager\"")


class Experts(ParallelStyle):
    """Each tensor rank's slice of every expert (see the module's docstring); `styles`: the
    experts' parameters' styles; `sequence`: the MoE block around them (MoeBlock)
    reduce-scatters their input's gradient and their output into sequence slices (else the
    experts sum both whole)."""

    def __init__(self, styles: dict[str, str], sequence: bool = False,
                 by_expert: bool = False) -> None:
        super().__init__()
        self.styles, self.sequence, self.by_expert = styles, sequence, by_expert

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import (DTensor, Partial, Replicate, Shard,
                                              distribute_tensor)
        from torch.distributed.tensor.placement_types import _StridedShard

        for name, param in list(module.named_parameters(recurse=False)):
            style = "by_expert" if self.by_expert else self.styles[name]
            placement = Shard(0) if style == "by_expert" else Shard(2) if style == "rowwise" \
                else Shard(1) if style == "colwise" \
                else _StridedShard(1, split_factor=2)  # the same rows of gate and of up
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement]),
                requires_grad=param.requires_grad))
        original, group, sequence = module.forward, device_mesh.get_group(), self.sequence
        owned = None
        if self.by_expert:  # (transformers' kernels skip ids from num_experts on)
            owned = module.num_experts // device_mesh.size()
            first = device_mesh.get_local_rank() * owned
            module.num_experts, module._is_expert_parallel = owned, True

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            if not sequence:
                hidden_states = summed_gradient(hidden_states, group)
            top_k_weights = summed_gradient(top_k_weights, group)
            if owned is not None:  # this rank's experts' ids, the others' the sentinel
                local = top_k_index - first
                mine = (local >= 0) & (local < owned)
                top_k_index = torch.where(mine, local, owned)
                top_k_weights = top_k_weights * mine
            with local_parameters(module):
                out = original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
            if sequence:
                return out
            return DTensor.from_local(out, device_mesh, [Partial()], run_check=False
                                      ).redistribute(device_mesh, [Replicate()]).to_local()
        module.forward = forward
        return module


@contextlib.contextmanager
def local_parameters(module: nn.Module, grad_placements=None):
    """The module's DTensor parameters as their local tensors (differentiably; their
    gradients of `grad_placements`, by default their own) while its own forward runs:
    transformers' experts kernels index and multiply plain tensors."""
    held = dict(module._parameters)
    module._parameters.update((name, p.to_local(grad_placements=grad_placements))
                              for name, p in held.items() if p is not None)
    try:
        yield
    finally:
        module._parameters.update(held)


class MoeBlock(ParallelStyle):
    """With sequence parallelism, a MoE block of a `router` and experts (Experts): its input's
    sequence slices gathered into the whole plain tensor the router routes, that input's
    partial gradients reduce-scattered back into slices, the router's counted on the first
    tensor rank only; its output, each rank's partial sum of the experts, reduce-scattered
    into slices."""

    def __init__(self, router: str) -> None:
        super().__init__()
        self.router = router

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        first = device_mesh.get_local_rank() == 0

        def gather(value):
            if not isinstance(value, DTensor):
                value = DTensor.from_local(value, device_mesh, [Shard(1)], run_check=False)
            return value.redistribute(device_mesh, [Replicate()]).to_local(
                grad_placements=[Partial()])

        def scatter(_module, _args, out):
            return DTensor.from_local(out, device_mesh, [Partial()], run_check=False
                                      ).redistribute(device_mesh, [Shard(1)]).to_local()
        module.register_forward_pre_hook(_on_hidden(gather), with_kwargs=True)
        module.register_forward_hook(scatter)
        module.get_submodule(self.router).register_forward_pre_hook(
            _on_hidden(lambda x: _Once.apply(x, first)), with_kwargs=True)
        return module


def _on_hidden(change):
    """A forward pre-hook (with_kwargs) passing a module's hidden states through `change`."""
    def hook(_module, args, kwargs):
        where = hidden_position(args, kwargs)
        if where is None:
            return None
        if isinstance(where, int):
            return (*args[:where], change(args[where]), *args[where + 1:]), kwargs
        return args, {**kwargs, where: change(kwargs[where])}
    return hook


class _Once(torch.autograd.Function):
    """x itself; backward, its gradient on the first tensor rank and zeros on the others (a
    gradient every rank holds whole, counted once in a sum over the ranks)."""

    @staticmethod
    def forward(ctx, x, first):
        ctx.first = first
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.first else torch.zeros_like(grad)), None
