"""Tensor parallelism inside a stage: torch's `parallelize_module` with column- and row-wise
sharded linear layers on the mesh's tp dim, from a plan of module paths -> style names.

The plan comes from the model itself where it has one: a Hugging Face model's config carries
`base_model_tp_plan` (its attention's q/k/v column-wise and output row-wise, its MLP's up and
gate column-wise and down row-wise), which pyplan reads as data and maps onto torch's styles;
a plan's `mesh.tensor_plan` adds to it or overrides it per module path (`*` matches one name).
Activations between those pairs stay whole on every tensor rank (no sequence parallelism), so
a stage hands each tensor rank's copy to its peer in the next stage, 1:1.

Randomness follows Megatron-LM's RNG tracker: between a column-wise layer and the row-wise one
that closes its region (attention's heads, the MLP's inner width) each tensor rank holds its
own part of the activations, and dropout there draws from a stream of its own, seeded from the
block's seed, the tensor rank and how many regions the block has opened; everywhere else
(whole activations) every tensor rank draws the same masks. A recomputed block reseeds the same
way, so its masks are its forward's.
"""

from __future__ import annotations

import hashlib
import re

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from pyplan.errors import PlanError
from pyplan.models.collectives import all_reduce_, summed_gradient

__all__ = ["STYLES", "TensorRandom", "parallelize", "tensor_plan"]

STYLES = ("colwise", "rowwise", "packed_colwise", "colwise_rep", "rowwise_rep",
          "colwise_gather_output", "embedding_rowwise", "replicate")
"""The style names pyplan maps onto torch.distributed.tensor.parallel (Hugging Face's names).
`embedding_rowwise` keeps the embedding whole on every tensor rank, as `replicate` does:
torch's row-wise nn.Embedding leaves its weight's gradient replicated (whole on every rank)
where the weight is sharded, so clipping and FSDP would see it once per tensor rank."""
_WHOLE = ("replicate", "embedding_rowwise")
# Modules without a plan of their own, by class: GPT-2's attention packs q, k and v into one
# Conv1D (c_attn), which each tensor rank holds a third of each of (torch's _StridedShard), its
# MLP two Conv1Ds; `split_size` (where c_attn's output is cut into q, k, v) is then a rank's.
_BY_CLASS = {"GPT2Attention": {"c_attn": "packed_colwise:3", "c_proj": "rowwise"},
             "GPT2MLP": {"c_fc": "colwise", "c_proj": "rowwise"}}
_RESIZED = {"GPT2Attention": ("split_size",)}


def _style(name: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel(),
            "rowwise": RowwiseParallel(),
            "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
            "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
            "rowwise_rep": RowwiseParallel(input_layouts=Replicate())}[name]


def tensor_plan(model: nn.Module, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """Module path pattern -> style: the model's own (a Hugging Face config's
    `base_model_tp_plan` under its base model's prefix, and its head's `_tp_plan`), then
    `overrides`."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if base and prefix and hasattr(model, prefix):
        plan.update((f"{prefix}.{k}", v) for k, v in base.items())
    elif base:
        plan.update(base)
    plan.update(getattr(model, "_tp_plan", None) or {})
    if not plan:
        for path, module in model.named_modules():
            for child, style in _BY_CLASS.get(type(module).__name__, {}).items():
                plan[f"{path}.{child}"] = style
    plan.update(overrides or {})
    return plan


def parallelize(root: nn.Module, plan: dict[str, str], mesh, *,
                where: str) -> dict[str, str]:
    """Apply `plan` to the modules of `root` its patterns match (modules a rank does not hold
    match nothing); returns the sharded modules' paths and styles. PlanError naming a module
    whose style pyplan does not know."""
    from torch.distributed.tensor.parallel import parallelize_module

    modules = dict(root.named_modules())
    chosen: dict[str, str] = {}
    for pattern, style in plan.items():  # `*` is one name, as in torch's and HF's plans
        match = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        chosen.update((path, style) for path, module in modules.items()
                      if match.fullmatch(path) and any(  # (a stand-in holds none)
                          p is not None for p in module._parameters.values()))
    for path, style in sorted(chosen.items()):
        if style.partition(":")[0] not in STYLES:
            raise PlanError(f"{where}: module {path} asks for tensor-parallel style {style!r}, "
                            "which pyplan does not run", hint="styles: " + ", ".join(STYLES) +
                            "; give mesh.tensor_plan for this module, or mesh.tensor: 1")
        module = modules[path]
        if style not in _WHOLE and not _shardable(module, style):
            raise PlanError(f"{where}: module {path} is a {type(module).__name__}, which "
                            f"the {style} style does not shard",
                            hint="tensor parallelism shards nn.Linear and Conv1D layers (packed "
                            "ones too); give mesh.tensor_plan without it, or mesh.tensor: 1")
    sharded = {path: style for path, style in sorted(chosen.items()) if style not in _WHOLE}
    if sharded:
        parallelize_module(root, mesh, {path: _style(s) if isinstance(modules[path], nn.Linear)
                                        and not s.startswith("packed") else _Local(s)
                                        for path, s in sharded.items()})
    for path in {p.rpartition(".")[0] for p in sharded}:
        parent = modules.get(path)
        for attr in _RESIZED.get(type(parent).__name__, ()):
            setattr(parent, attr, getattr(parent, attr) // mesh.size())
    return sharded


def _shardable(module: nn.Module, style: str) -> bool:
    conv = type(module).__name__ == "Conv1D"
    if style.startswith("packed"):
        return conv or isinstance(module, nn.Linear)
    return conv or isinstance(module, nn.Linear)


class _Local(ParallelStyle):
    """A layer computed on each tensor rank's own part of its weights (their DTensors' local
    tensors), the collectives at its edges written out: column-wise, each rank makes its part
    of the output and the input's gradient is summed over the ranks; row-wise, each rank's
    partial product is summed, then the bias added once. For GPT-2's Conv1D (weight: in x out)
    and packed layers (q, k, v or gate and up in one matrix: `packed_colwise:N` gives each
    rank the same part of each of the N, torch's _StridedShard), which torch's styles do not
    shard."""

    def __init__(self, style: str) -> None:
        super().__init__()
        name, _, parts = style.partition(":")
        self.rowwise = name == "rowwise"
        self.parts = int(parts) if parts else (2 if name == "packed_colwise" else 1)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        conv = type(module).__name__ == "Conv1D"
        out_dim = 1 if conv else 0  # the weight's output features
        for name, param in list(module.named_parameters(recurse=False)):
            dim = out_dim if name == "weight" else 0
            if self.rowwise:
                placement = Replicate() if name == "bias" else Shard(1 - out_dim)
            elif self.parts > 1:
                placement = _StridedShard(dim, split_factor=self.parts)
            else:
                placement = Shard(dim)
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement]),
                requires_grad=param.requires_grad))
        module.forward = _local_forward(module, conv, self.rowwise, device_mesh.get_group())
        return module


def _local_forward(module: nn.Module, conv: bool, rowwise: bool, group):
    def forward(x):
        weight = module.weight.to_local()
        bias = module.bias.to_local() if module.bias is not None else None
        if not rowwise:
            x = summed_gradient(x, group)
        out = x @ (weight if conv else weight.t())
        if rowwise:
            out = _Summed.apply(out, group)
        return out if bias is None else out + bias
    return forward


class _Summed(torch.autograd.Function):
    """Summed over the tensor ranks forward; backward, the (whole, identical) gradient as it
    is."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorRandom:
    """The tensor-parallel regions' random stream (see the module's docstring): `begin` at each
    block call (with the seed the executor gives the block), `watch` the sharded modules."""

    def __init__(self, tensor_index: int, device: torch.device) -> None:
        self.tensor_index, self.device = tensor_index, device
        self.seed, self.regions, self.saved = 0, 0, None

    def begin(self, seed: int) -> None:
        self.leave()
        self.seed, self.regions = seed, 0

    def enter(self, *_) -> None:
        if self.saved is not None:
            return
        cuda = self.device.type == "cuda"
        self.saved = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda
                      else None)
        self.regions += 1
        text = f"{self.seed}:tensor:{self.tensor_index}:{self.regions}".encode()
        seed = int.from_bytes(hashlib.sha256(text).digest()[:7], "big")
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)

    def leave(self, *_) -> None:
        if self.saved is None:
            return
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(self.saved[1], self.device)
        self.saved = None

    def watch(self, root: nn.Module, plan: dict[str, str]) -> None:
        """A column-wise layer opens a region (after it runs), a row-wise one closes it."""
        modules = dict(root.named_modules())
        for path, style in plan.items():
            if style.startswith("colwise"):
                modules[path].register_forward_hook(self.enter)
            elif style.startswith("rowwise"):
                modules[path].register_forward_hook(self.leave)
