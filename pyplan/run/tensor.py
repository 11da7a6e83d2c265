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

from pyplan.errors import PlanError

__all__ = ["STYLES", "TensorRandom", "parallelize", "tensor_plan"]

STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "colwise_gather_output",
          "embedding_rowwise", "replicate")
"""The style names pyplan maps onto torch.distributed.tensor.parallel (Hugging Face's names).
`embedding_rowwise` keeps the embedding whole on every tensor rank, as `replicate` does:
torch's row-wise nn.Embedding leaves its weight's gradient replicated (whole on every rank)
where the weight is sharded, so clipping and FSDP would see it once per tensor rank."""
_WHOLE = ("replicate", "embedding_rowwise")


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
        if style not in STYLES:
            raise PlanError(f"{where}: module {path} asks for tensor-parallel style {style!r}, "
                            "which pyplan does not run", hint="styles: " + ", ".join(STYLES) +
                            "; give mesh.tensor_plan for this module, or mesh.tensor: 1")
        module = modules[path]
        if style not in _WHOLE and not isinstance(module, nn.Linear):
            raise PlanError(f"{where}: module {path} is a {type(module).__name__}, which "
                            f"torch's {style} parallelism does not shard",
                            hint="tensor parallelism shards nn.Linear layers; give "
                            "mesh.tensor_plan without it, or mesh.tensor: 1")
    sharded = {path: style for path, style in sorted(chosen.items()) if style not in _WHOLE}
    if sharded:
        parallelize_module(root, mesh, {path: _style(s) for path, s in sharded.items()})
    return sharded


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
