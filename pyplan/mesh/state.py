"""A rank's model and optimizer state, keyed by the model's own parameter names, for
torch.distributed.checkpoint (DCP): what `Pipeline.state_dict` / `load_state_dict` hand out and
take back, and what pyplan.train.checkpoint saves and loads in step folders.

A tied parameter, or a replicated one (data-parallel replicas, multi-device blocks), is one key;
a data- or tensor-parallel shard is a DTensor that DCP saves and reshards itself (save under one
mesh, load under another). The chunks of a sharded parameter of a hand-written multi-device
block are keyed as they are (`NAME.__shard<i>of<n>dim<d>`): they load under a plan that shards
them the same way.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from pyplan.models.chunks import shard_dim
from pyplan.mesh.tensor import model_major, rank_major
from pyplan.models.forward import _owner

__all__ = ["SHARD", "load_state_dict", "rank_view", "state_dict"]

SHARD = ".__shard{}of{}dim{}"
"""The suffix of a sharded parameter's chunk: the chunk's index, the chunks, the dimension."""


class _Named(nn.Module):
    """Parameters and buffers under given dotted names (the model's own), the same tensor
    objects the pipeline trains: what torch's state-dict helpers key the model and the
    optimizer state by."""

    def __init__(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]):
        super().__init__()
        for name, tensor in list(params.items()) + list(buffers.items()):
            holder = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in holder._modules:
                    holder.add_module(part, nn.Module())
                holder = holder._modules[part]
            if name in params:
                holder.register_parameter(leaf, tensor)
            else:
                holder.register_buffer(leaf, tensor)


def rank_view(pipe) -> _Named:
    """This rank's state under its keys: trainable and frozen parameters, persistent buffers."""
    block_of = {id(p): b for b, m in pipe.modules.items() for p in m.parameters()}
    named = list(pipe.named_parameters())
    seen = {id(p) for _, p in named}
    model_of = {}  # bf16 parameters: their fp32 masters stand for them
    if pipe.masters is not None:
        seen |= set(pipe.masters.of)
        model_of = {id(m): p for p, m in pipe.masters.pairs}
    for b, module in pipe.modules.items():  # frozen parameters: not trained, still the model's
        for n, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((pipe.built.names.get(id(p), f"{pipe.problem.blocks[b].name}.{n}"),
                              p))
    params = {}
    for name, param in named:
        model = model_of.get(id(param), param)
        block = block_of.get(id(model))
        if block is not None and len(pipe.problem.blocks[block].devices) > 1 and \
                shard_dim(model) is not None:
            devices = pipe.problem.blocks[block].devices
            name += SHARD.format(devices.index(pipe.device_index), len(devices),
                                  shard_dim(model))
        params[name] = param
    buffers = {}
    whole = pipe.built.whole
    if whole is not None:
        mine = _stages_here(pipe)
        # (a chain cut's stages are the whole model's own modules: only the rank's are its)
        held = {id(b) for module in pipe.modules.values() for b in module.buffers()}
        for name, buffer in whole.named_buffers():
            module = whole.get_submodule(name.rpartition(".")[0]) if "." in name else whole
            if name.rpartition(".")[2] not in module._non_persistent_buffers_set and \
                    _owner(name, mine[1]) in mine[0] and id(buffer) in held:
                buffers[name] = buffer
    else:
        for b, module in pipe.modules.items():
            for name, buffer in module.named_buffers():
                buffers[f"{pipe.problem.blocks[b].name}.{name}"] = buffer
    return _Named(params, buffers)


def _stages_here(pipe) -> tuple[set, dict]:
    """(the stages this rank runs, and None: modules no stage lists; the model's modules ->
    their stage) of a model cut in its own forward: a rank also runs the modules of earlier
    stages, with zeros for their weights, and so updates their batch norms' running
    statistics with what is not theirs (those are the other rank's to save)."""
    stages = [m for m in pipe.modules.values() if getattr(m, "owners", None) is not None]
    if not stages:
        return {None}, {}
    return {None} | {m.index for m in stages}, stages[0].owners


def _options() -> StateDictOptions:
    # Optimizer state and hyperparameters keyed by parameter name: every rank writes its own
    # keys (a list of parameter groups would be one key that DCP writes from one rank only).
    return StateDictOptions(full_state_dict=False, flatten_optimizer_state_dict=True)


def state_dict(pipe, optimizer=None) -> dict:
    """This rank's part of the model (and optimizer) state: {"model": ..., "optimizer": ...},
    keyed by the model's names, ready for torch.distributed.checkpoint.save/load."""
    view = rank_view(pipe)
    if not view.state_dict():  # a stage of parameter-free modules: nothing, but it takes part
        return {"model": {}, "optimizer": {}} if optimizer is not None else {"model": {}}
    with warnings.catch_warnings():  # DCP's notices about its own internals
        warnings.simplefilter("ignore")
        model, optim = get_state_dict(view, () if optimizer is None else optimizer,
                                      options=_options())
    model, optim = _model_layout(model, pipe.packed), _model_layout(optim, pipe.packed)
    return {"model": model, "optimizer": optim} if optimizer is not None else {"model": model}


def _packed(key: str, packed: dict) -> tuple[int, int, int] | None:
    """The layout of the packed parameter a model key (NAME) or flattened optimizer key
    (state.NAME.STATE) is of, else None."""
    if key.startswith("state."):
        key = key[len("state."):].rpartition(".")[0]
    return packed.get(key)


def _strided(value) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard)
                                              for p in value.placements)


def _model_layout(state: dict, packed: dict) -> dict:
    """A packed parameter (GPT-2's q, k, v under tensor parallelism, each rank's part of each
    contiguous: pyplan.mesh.tensor.rank_major) and its optimizer state whole, in the model's
    own layout; a strided shard (a MoE's gate_up_proj: torch's _StridedShard, whose chunks
    DCP's metadata cannot describe, one offset per dimension) whole too. Saved so, they load
    under any mesh (every rank's copy is the same: DCP writes it once). (An all-gather over
    its mesh, in the state's own order: the same on each of its ranks.)"""
    from torch.distributed.tensor import DTensor

    def whole(key, value):
        if isinstance(value, DTensor) and _packed(key, packed):
            return model_major(value.full_tensor(), *_packed(key, packed))
        return value.full_tensor() if _strided(value) else value
    return {key: whole(key, value) for key, value in state.items()}


def _placed(state: dict, like: dict, packed: dict) -> dict:
    """`state`'s whole tensors (_model_layout) cut back to this rank's shards, as `like`
    (this rank's own state) places them; no communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def placed(key, value):
        mine = like.get(key)
        if not isinstance(mine, DTensor) or isinstance(value, DTensor) or not (
                _packed(key, packed) or _strided(mine)):
            return value
        if _packed(key, packed):
            value = rank_major(value, *_packed(key, packed))
        return distribute_tensor(value, mine.device_mesh, mine.placements, src_data_rank=None)
    return {key: placed(key, value) for key, value in state.items()}


def load_state_dict(pipe, state: dict, optimizer=None) -> None:
    """Put a state `state_dict` returned (and DCP filled) into this rank's tensors."""
    view = rank_view(pipe)
    if not view.state_dict():
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optim = get_state_dict(view, () if optimizer is None else optimizer,
                                      options=_options())
        set_state_dict(view, () if optimizer is None else optimizer,
                       model_state_dict=_placed(state["model"], model, pipe.packed),
                       optim_state_dict=_placed(state.get("optimizer", {}), optim, pipe.packed)
                       if optimizer is not None else {}, options=_options())
