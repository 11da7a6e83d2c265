"""Tensor parallelism inside a stage: torch's `parallelize_module` with column- and row-wise
sharded linear layers on the mesh's tp dim, from a plan of module paths -> style names.

The plan comes from the model itself where it has one: a Hugging Face model's config carries
`base_model_tp_plan` (its attention's q/k/v column-wise and output row-wise, its MLP's up and
gate column-wise and down row-wise), which pyplan reads as data and maps onto torch's styles;
a plan's `mesh.tensor_plan` adds to it or overrides it per module path (`*` matches one name).

Sequence parallelism (on with the tensor degree unless a plan says `mesh.sequence: false`;
Megatron-LM's --sequence-parallel, torchtitan's Llama layout) keeps the residual stream between
those regions in sequence slices: the layers' norms run on each tensor rank's slice (torch's
SequenceParallel, whose replicated weights get their gradients summed over the slices), the
first layer's input is cut into slices, an attention or MLP gathers its input's slices
(all-gather; backward, a reduce-scatter) and its row-wise output is reduce-scattered into
slices, and the final norm's output is gathered whole for the head. A stage hands each tensor
rank's slice (without it: each rank's whole copy) to its peer in the next stage, 1:1.

Randomness follows Megatron-LM's RNG tracker: between a column-wise layer and the row-wise one
that closes its region (attention's heads, the MLP's inner width) each tensor rank holds its
own part of the activations, and dropout there draws from a stream of its own, seeded from the
block's seed, the tensor rank and how many regions the block has opened; everywhere else
(whole activations) every tensor rank draws the same masks. With sequence parallelism a rank's
activations are its own from the layers' first norm to the final norm's gather (its heads or
its slice of the sequence), so that whole span is one region. A recomputed block reseeds the
same way, so its masks are its forward's.
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from pyplan.errors import PlanError, RunError
from pyplan.models.collectives import all_reduce_, summed_gradient
from pyplan.models.forward import hidden_position, decoder_layers
from pyplan.mesh.experts import (EXPERT_PARALLEL, EXPERTS, Experts, MoeBlock, check_experts,
                                 local_parameters)

__all__ = ["STYLES", "TensorRandom", "model_major", "packed_layouts", "parallelize",
           "rank_major", "sequence_modules", "sharded_parameters", "tensor_plan"]

_SUMMED = "replicated_with_grad_allreduce"
STYLES = ("colwise", "rowwise", "packed_colwise", "colwise_rep", "rowwise_rep",
          "colwise_gather_output", "embedding_rowwise", "replicate", EXPERTS, EXPERT_PARALLEL,
          _SUMMED)
"""The style names pyplan maps onto torch.distributed.tensor.parallel (Hugging Face's names;
a MoE layer's experts: pyplan.mesh.experts; `replicated_with_grad_allreduce`: a module whole on
every rank that runs on each rank's own part of the activations, Qwen3's q and k norms on its
heads, its weights' gradients summed over the tensor ranks).
`embedding_rowwise` keeps the embedding whole on every tensor rank, as `replicate` does:
torch's row-wise nn.Embedding leaves its weight's gradient replicated (whole on every rank)
where the weight is sharded, so clipping and FSDP would see it once per tensor rank."""
_WHOLE = ("replicate", "embedding_rowwise")
# Modules without a plan of their own, by class: GPT-2's attention packs q, k and v into one
# Conv1D (c_attn), which each tensor rank holds a part of each of (rank_major), its
# MLP two Conv1Ds; `split_size` (where c_attn's output is cut into q, k, v) is then a rank's.
_BY_CLASS = {"GPT2Attention": {"c_attn": "packed_colwise:3", "c_proj": "rowwise"},
             "GPT2MLP": {"c_fc": "colwise", "c_proj": "rowwise"}}
_RESIZED = {"GPT2Attention": ("split_size",)}


def _style(name: str, sequence: bool = False):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel(),
            "rowwise": RowwiseParallel(output_layouts=Shard(1)) if sequence else
            RowwiseParallel(),
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


def parallelize(root: nn.Module, plan: dict[str, str], mesh, *, where: str,
                sequence: bool = False) -> tuple[dict[str, str], Around | None]:
    """Apply `plan` to the modules of `root` its patterns match (modules a rank does not hold
    match nothing), with `sequence` parallelism around them; returns the sharded modules'
    paths and styles, and where sequence parallelism went. PlanError naming a module whose
    style pyplan does not know."""
    from torch.distributed.tensor.parallel import parallelize_module

    modules = dict(root.named_modules())
    chosen = _chosen(modules, plan)
    experts = {path: {name: style for pattern, style in plan.items()  # their parameters'
                      for name in modules[path]._parameters if _matches(pattern,
                                                                        f"{path}.{name}")}
               for path, style in chosen.items() if style in (EXPERTS, EXPERT_PARALLEL)}
    for path, style in sorted(chosen.items()):
        name, colon, parts = style.partition(":")
        if name not in STYLES or colon and not (name == "packed_colwise" and
                                                 parts.isdigit() and 1 <= int(parts) <= 64):
            raise PlanError(f"{where}: module {path} asks for tensor-parallel style {style!r}, "
                            "which pyplan does not run", hint="styles: " + ", ".join(STYLES) +
                            " (packed_colwise:N, N from 1 to 64 parts); give mesh.tensor_plan "
                            "for this module, or mesh.tensor: 1")
        module = modules[path]
        if style in (EXPERTS, EXPERT_PARALLEL):
            check_experts(module, experts[path], mesh.size(), path, where,
                          by_expert=style == EXPERT_PARALLEL)
        elif style not in _WHOLE + (_SUMMED,) and not _shardable(module, style):
            raise PlanError(f"{where}: module {path} is a {type(module).__name__}, which "
                            f"the {style} style does not shard",
                            hint="tensor parallelism shards nn.Linear and Conv1D layers (packed "
                            "ones too); give mesh.tensor_plan without it, or mesh.tensor: 1")
        elif style.startswith("packed") or type(module).__name__ == "Conv1D":
            _check_divides(module, style, mesh.size(), path, where)  # (pyplan's own layers:
            # torch's styles on nn.Linear shard an uneven width unevenly)
    sharded = {path: style for path, style in sorted(chosen.items()) if style not in _WHOLE}
    around = sequence_modules(root, sharded, where) if sequence and sharded else None
    if sharded:
        parallelize_module(root, mesh, {path: Experts(experts[path], sequence,
                                                      by_expert=s == EXPERT_PARALLEL)
                                        if s in (EXPERTS, EXPERT_PARALLEL)
                                        else _ReplicatedSummed() if s == _SUMMED
                                        else _style(s, sequence)
                                        if isinstance(modules[path], nn.Linear)
                                        and not s.startswith("packed") else _Local(s, sequence)
                                        for path, s in sharded.items()})
    if around is not None:
        _sequence_parallel(root, around, mesh)
    for path in {p.rpartition(".")[0] for p in sharded}:
        parent = modules.get(path)
        for attr in _RESIZED.get(type(parent).__name__, ()):
            setattr(parent, attr, getattr(parent, attr) // mesh.size())
    return sharded, around


def _matches(pattern: str, path: str) -> bool:
    """Whether a plan's module path pattern names `path` (`*` is one name, as in torch's and
    HF's plans)."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), path) is not None


def _chosen(modules: dict[str, nn.Module], plan: dict[str, str]) -> dict[str, str]:
    """The modules (path -> style) `plan`'s patterns match, of those holding parameters."""
    chosen: dict[str, str] = {}
    for pattern, style in plan.items():
        chosen.update((path, style) for path, module in modules.items()
                      if _matches(pattern, path) and _holds(module))  # (a stand-in holds none)
    return chosen


def sharded_parameters(root: nn.Module, plan: dict[str, str]) -> set[int]:
    """The parameters of `root` (their ids) that `parallelize` with `plan` splits over the
    tensor ranks, each rank holding 1/T of them: the sharded layers' weights and biases but a
    row-wise layer's bias (replicated: added once, after the sum), a MoE's experts (a slice of
    each, or E/T of them). Everything else stays whole on every tensor rank: the embedding
    (`embedding_rowwise`, `replicate`), the norms (`replicated_with_grad_allreduce` too), the
    router, the parameters no style names. What a tensor rank's weights cost (pyplan partition
    --tensor) counts these."""
    chosen = _chosen(dict(root.named_modules()), plan)
    return {id(p) for path, style in chosen.items() if style not in _WHOLE + (_SUMMED,)
            for name, p in root.get_submodule(path).named_parameters(recurse=False)
            if not (style.startswith("rowwise") and name == "bias")}


class Around(NamedTuple):
    """The modules sequence parallelism works on, of those this rank holds (module paths)."""

    norms: tuple[str, ...]
    """The norms on the residual stream: each layer's own, then the final one."""
    final: tuple[str, ...]
    """The final norm, whose output is gathered whole for the head."""
    first: str | None
    """The first layer, whose input is cut into sequence slices."""
    gathered: tuple[str, ...]
    """The attentions and MLPs, whose input slices are gathered."""
    moe: dict[str, str] | None = None
    """The MoE blocks (pyplan.mesh.experts.MoeBlock) and their routers (a child's name)."""


def _holds(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Norm") and _holds(module)


def sequence_modules(root: nn.Module, sharded: dict[str, str], where: str) -> Around:
    """Where sequence parallelism goes in a model cut at its decoder layers (Hugging Face's
    GPT-2, Llama, Mistral, Qwen2: a layer's norms are its children; its column-wise layers sit
    in an attention or MLP module): PlanError naming what does not fit."""
    layers_name = decoder_layers(root)
    hint = "give mesh.sequence: false (tensor parallelism without sequence parallelism)"
    if layers_name is None:
        raise PlanError(f"{where}: sequence parallelism needs a model of decoder layers (an "
                        f"nn.ModuleList); {type(root).__name__} has none", hint=hint)
    inside = f"{layers_name}."
    modules = dict(root.named_modules())
    moe = sorted({path.rpartition(".")[0] for path, style in sharded.items()
                  if path.startswith(inside) and style in (EXPERTS, EXPERT_PARALLEL)})
    routers: dict[str, str] = {}
    gathered = sorted({path.rpartition(".")[0] for path, style in sharded.items()
                       if path.startswith(inside) and not style.startswith("rowwise")} - set(moe))
    for path in moe:
        holding = [name for name, child in modules[path].named_children()
                   if any(_holds(m) for m in child.modules())]
        if len(holding) != 2 or any(p.startswith(f"{path}.") for p in gathered):
            raise PlanError(f"{where}: MoE block {path} holds {', '.join(holding)}: sequence "
                            "parallelism reduces a block of a router and its experts only "
                            "(not shared experts beside them)", hint=hint)
        if getattr(modules[path], "jitter_noise", 0):  # (Mixtral's router_jitter_noise)
            raise PlanError(f"{where}: MoE block {path} multiplies its input by random jitter, "
                            "which under sequence parallelism each tensor rank would draw "
                            "its own of, and route differently", hint=hint)
        routers[path] = next(name for name in holding if f"{path}.{name}" not in sharded)
    for path in gathered + moe:
        if path.count(".") == layers_name.count(".") + 1:
            raise PlanError(f"{where}: module {path} is a decoder layer whose column-wise "
                            "layers are its own children, not an attention's or MLP's, so "
                            "sequence parallelism has no module to gather their input at",
                            hint=hint)
    layers = [f"{layers_name}.{i}" for i in range(len(root.get_submodule(layers_name)))]
    norms = [f"{layer}.{name}" for layer in layers
             for name, child in modules[layer].named_children() if _is_norm(child)]
    final = [path for path, m in modules.items() if not path.startswith(inside)
             and _is_norm(m)]
    if len(final) > 1:
        raise PlanError(f"{where}: {type(root).__name__} has {len(final)} norms outside its "
                        f"layers ({', '.join(final)}); sequence parallelism gathers the "
                        "sequence after one, the final norm", hint=hint)
    held = [layer for layer in layers if any(_holds(m) for m in modules[layer].modules())]
    regions = set(gathered) | set(moe)
    for layer in held:
        if not any(n.startswith(f"{layer}.") for n in norms):
            raise PlanError(f"{where}: decoder layer {layer} has no norm of its own (a "
                            "child whose class ends in Norm) for sequence parallelism to run "
                            "on the sequence slices", hint=hint)
        whole = next((f"{layer}.{name}" for name, child in modules[layer].named_children()
                      if f"{layer}.{name}" not in regions and not _is_norm(child)
                      and any(_holds(m) for m in child.modules())), None)
        if whole is not None:  # (it would get the sequence slices where it needs the whole)
            raise PlanError(f"{where}: module {whole} has no tensor-parallel layers, so "
                            "sequence parallelism has no place to gather the sequence for it",
                            hint=hint + ", or a mesh.tensor_plan that shards it")
    first = layers[0] if layers and layers[0] in held else None
    return Around(tuple(norms + final), tuple(final), first, tuple(gathered), routers)


class _HiddenStates(ParallelStyle):
    """torch's PrepareModuleInput for a module's hidden states wherever its caller passes
    them (the first positional tensor, else the `hidden_states` keyword: HF's attentions take
    a keyword, its MLPs and GPT-2's attention a positional), the other inputs as they are."""

    def __init__(self, layout, desired, *, local: bool) -> None:
        super().__init__()
        from torch.distributed.tensor.parallel import PrepareModuleInput

        self.prepare = PrepareModuleInput(input_layouts=layout, desired_input_layouts=desired,
                                          use_local_output=local)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        layout, desired = self.prepare.input_layouts[0], self.prepare.desired_input_layouts[0]

        def hook(_module, args, kwargs):
            where = hidden_position(args, kwargs)
            if where is None:
                return None
            value = args[where] if isinstance(where, int) else kwargs[where]
            if layout != desired and getattr(desired, "dim", None) == 1 and \
                    value.shape[1] % device_mesh.size():
                raise RunError(f"sequence parallelism cuts the sequence into "
                               f"{device_mesh.size()} slices, but this micro-batch's has "
                               f"{value.shape[1]} positions", hint="use a sequence length "
                               "the tensor degree divides, or mesh.sequence: false")
            value = self.prepare._prepare_input_arg(value, device_mesh, layout, desired)
            if isinstance(where, int):
                return (*args[:where], value, *args[where + 1:]), kwargs
            return args, {**kwargs, where: value}
        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _sequence_parallel(root: nn.Module, around: Around, mesh) -> None:
    """torch's styles around the tensor-parallel regions (see the module's docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleOutput, SequenceParallel,
                                                   parallelize_module)

    plan = {path: SequenceParallel() for path in around.norms}
    plan.update((path, _HiddenStates(Shard(1), Replicate(), local=False))
                for path in around.gathered)
    plan.update((path, MoeBlock(router)) for path, router in (around.moe or {}).items())
    if around.first is not None:  # (a stage starting later receives slices)
        plan[around.first] = _HiddenStates(Replicate(), Shard(1), local=True)
    parallelize_module(root, mesh, plan)
    parallelize_module(root, mesh, {path: PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)
        for path in around.final})


def _check_divides(module: nn.Module, style: str, ranks: int, path: str, where: str) -> None:
    """PlanError unless the tensor ranks split the width `style` shards evenly (each part of a
    packed layer too): pyplan's rank-major layout of a packed or Conv1D layer needs it."""
    name, _, parts = style.partition(":")
    out_dim = 1 if type(module).__name__ == "Conv1D" else 0
    rowwise = name.startswith("rowwise")
    count = (int(parts) if parts else 2) if name == "packed_colwise" else 1
    size = module.weight.shape[1 - out_dim if rowwise else out_dim]
    if size % (count * ranks):
        what = "input" if rowwise else "output"
        each = f" in {count} packed parts" if count > 1 else ""
        raise PlanError(f"{where}: mesh.tensor {ranks} does not divide the {what} features "
                        f"({size}{each}) of module {path} ({style})",
                        hint="give mesh.tensor_plan another style for it, or a tensor degree "
                        "that divides its width")


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
    rank the same part of each of the N, laid out rank-major: see rank_major), which torch's
    styles do not shard."""

    def __init__(self, style: str, sequence: bool = False) -> None:
        super().__init__()
        name, _, parts = style.partition(":")
        self.rowwise, self.sequence = name == "rowwise", sequence
        self.parts = int(parts) if parts else (2 if name == "packed_colwise" else 1)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        conv = type(module).__name__ == "Conv1D"
        out_dim = 1 if conv else 0  # the weight's output features
        packed = {}
        for name, param in list(module.named_parameters(recurse=False)):
            dim, trained = (out_dim if name == "weight" else 0), param.requires_grad
            placement = Shard(dim)
            if self.rowwise:
                placement = Replicate() if name == "bias" else Shard(1 - out_dim)
            elif self.parts > 1:  # (see rank_major)
                packed[name] = (dim, self.parts, device_mesh.size())
                param = rank_major(param.detach(), *packed[name])
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement]), requires_grad=trained))
        module.packed_layout = packed
        module.forward = _local_forward(module, conv, self.rowwise, device_mesh,
                                        self.sequence)
        return module


class _ReplicatedSummed(ParallelStyle):
    """A module whole on every tensor rank (its weights replicated DTensors) run on each
    rank's own activations (its heads): its weights' gradients are each rank's part, a pending
    sum (Partial) that FSDP2's reduction or pyplan once per iteration completes, as for
    sequence parallelism's norms."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import Partial, Replicate, distribute_tensor

        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, device_mesh, [Replicate()]),
                requires_grad=param.requires_grad))
        original = module.forward

        def forward(*args, **kwargs):
            with local_parameters(module, [Partial()]):
                return original(*args, **kwargs)
        module.forward = forward
        return module


def rank_major(tensor: torch.Tensor, dim: int, parts: int, ranks: int) -> torch.Tensor:
    """A packed parameter (`parts` matrices side by side along `dim`: GPT-2's q, k, v) laid
    out so that each of `ranks` tensor ranks' share of every part is contiguous, [q0 k0 v0 |
    q1 k1 v1] for [q0 q1 | k0 k1 | v0 v1]: a plain Shard(dim) then gives each rank its part of
    each (what torch's _StridedShard describes), and FSDP2 can shard that again, as it shards
    any tensor-parallel Shard (it cannot shard a _StridedShard's dim: its placement for the
    data ranks would have to nest two strides). What a packed parameter's DTensor holds whole
    is this layout; the model's own is model_major's (checkpoints, --check)."""
    n = tensor.shape[dim] // (parts * ranks)
    return tensor.unflatten(dim, (parts, ranks, n)).transpose(dim, dim + 1).flatten(dim, dim + 2)


def model_major(tensor: torch.Tensor, dim: int, parts: int, ranks: int) -> torch.Tensor:
    """rank_major undone: a packed parameter whole in the model's own layout."""
    n = tensor.shape[dim] // (parts * ranks)
    return tensor.unflatten(dim, (ranks, parts, n)).transpose(dim, dim + 1).flatten(dim, dim + 2)


def packed_layouts(places) -> dict[str, tuple[int, int, int]]:
    """The packed parameters' layouts by the model's names ((dim, parts, ranks) for
    rank_major): `places` lists (module, attribute, name) of the parameters."""
    return {name: owner.packed_layout[attr] for owner, attr, name in places
            if name is not None and attr in getattr(owner, "packed_layout", {})}


def _local_forward(module: nn.Module, conv: bool, rowwise: bool, mesh, sequence: bool):
    """Column-wise: the input whole (with sequence parallelism, the DTensor its module's
    input was gathered into, whose gradient each rank holds a part of: reduce-scattered);
    row-wise: the partial products summed (reduce-scattered into sequence slices, the bias's
    gradient then summed over the slices)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    group = mesh.get_group()

    def forward(x):
        weight = module.weight.to_local()
        bias = module.bias.to_local() if module.bias is not None else None
        if not rowwise:
            x = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) \
                else summed_gradient(x, group)
        out = x @ (weight if conv else weight.t())
        if rowwise and sequence:
            out = DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(
                mesh, [Shard(1)]).to_local()
            bias = None if bias is None else summed_gradient(bias, group)
        elif rowwise:
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

    def watch(self, root: nn.Module, plan: dict[str, str],
              around: Around | None = None) -> None:
        """A column-wise layer opens a region (after it runs), a row-wise one closes it; with
        sequence parallelism (`around`), a layer's norm opens it, the final norm closes it."""
        modules = dict(root.named_modules())
        if around is not None:
            for path in around.norms:
                (modules[path].register_forward_hook(self.leave) if path in around.final
                 else modules[path].register_forward_pre_hook(self.enter))
            return
        for path, style in plan.items():
            if style.startswith("colwise"):
                modules[path].register_forward_hook(self.enter)
            elif style.startswith("rowwise"):
                modules[path].register_forward_hook(self.leave)
