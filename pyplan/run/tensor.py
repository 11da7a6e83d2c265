"""Tensor parallelism inside a stage: torch's `parallelize_module` with column- and row-wise
sharded linear layers on the mesh's tp dim, from a plan of module paths -> style names.

The plan comes from the model itself where it has one: a Hugging Face model's config carries
`base_model_tp_plan` (its attention's q/k/v column-wise and output row-wise, its MLP's up and
gate column-wise and down row-wise), which pyplan reads as data and maps onto torch's styles;
a plan's `mesh.tensor_plan` adds to it or overrides it per module path (`*` matches one name).
Activations between those pairs stay whole on every tensor rank (no sequence parallelism), so
a stage hands each tensor rank's copy to its peer in the next stage, 1:1.
"""

from __future__ import annotations

import re

from torch import nn

from pyplan.errors import PlanError

__all__ = ["STYLES", "parallelize", "tensor_plan"]

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


def parallelize(root: nn.Module, plan: dict[str, str], mesh, *, where: str) -> list[str]:
    """Apply `plan` to the modules of `root` its patterns match (modules a rank does not hold
    match nothing); returns the paths sharded. PlanError naming a module whose style pyplan
    does not know."""
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
    styles = {path: _style(style) for path, style in chosen.items() if style not in _WHOLE}
    if styles:
        parallelize_module(root, mesh, styles)
    return sorted(styles)
