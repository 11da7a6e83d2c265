"""Checkpoints through torch.distributed.checkpoint (DCP): every rank writes the parameters,
buffers and optimizer state it holds, keyed by the model's own parameter names, so a
checkpoint saved under one plan loads under another plan of the same model (other stages,
another device count): DCP reads each rank's keys wherever they were written. A tied
parameter, or a replicated one (data-parallel replicas, multi-device blocks), is one key
written once. The chunks of a sharded parameter of a hand-written multi-device block, and the
flat shards of a sharded mesh, are saved as they are (`NAME.__shard<i>of<n>`,
`BLOCK.flat_shard.__replica<i>of<n>`): those load under a plan that shards them the same way.

`consolidate` (one process, no torchrun) reads a checkpoint back into the whole model's
state dict, under the keys `model.state_dict()` has, for `load_state_dict(strict=True)`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from pyplan.errors import PlanError, RunError
from pyplan.runtime.binding import shard_dim

__all__ = ["consolidate", "load", "save"]

_SHARD = ".__shard{}of{}dim{}"
_REPLICA = ".__replica{}of{}"


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


def _view(pipe) -> _Named:
    """This rank's state under its keys."""
    params = {}
    for name, param in pipe.named_parameters():
        block = _block_of(pipe, param)
        if block is not None and len(pipe.problem.blocks[block].devices) > 1 and \
                shard_dim(param) is not None:
            devices = pipe.problem.blocks[block].devices
            name += _SHARD.format(devices.index(pipe.device_index), len(devices),
                                  shard_dim(param))
        elif name.endswith(".flat_shard"):
            name += _REPLICA.format(pipe.replica, pipe.problem.mesh.data)
        params[name] = param
    buffers = {}
    whole = pipe.built.whole
    if whole is not None:
        for name, buffer in whole.named_buffers():
            module = whole.get_submodule(name.rpartition(".")[0]) if "." in name else whole
            if name.rpartition(".")[2] not in module._non_persistent_buffers_set:
                buffers[name] = buffer
    else:
        for b, module in pipe.modules.items():
            for name, buffer in module.named_buffers():
                buffers[f"{pipe.problem.blocks[b].name}.{name}"] = buffer
    return _Named(params, buffers)


def _block_of(pipe, param) -> int | None:
    for b, module in pipe.modules.items():
        if any(p is param for p in module.parameters()):
            return b
    return None


def _options() -> StateDictOptions:
    # Optimizer state and hyperparameters keyed by parameter name: every rank writes its own
    # keys (a list of parameter groups would be one key that DCP writes from one rank only).
    return StateDictOptions(full_state_dict=False, flatten_optimizer_state_dict=True)


def save(directory: str | Path, pipe, optimizer, scheduler, step: int) -> None:
    """Write this rank's part of the checkpoint (every rank calls it)."""
    view = _view(pipe)
    with warnings.catch_warnings():  # DCP's notices about its own internals
        warnings.simplefilter("ignore")
        model_state, optim_state = get_state_dict(view, optimizer, options=_options())
        meta = {"step": step, "seed": pipe.seed, "plan": pipe.problem.name,
                "plan_sha256": pipe.resolved.spec_sha256,
                "scheduler": scheduler.state_dict() if scheduler is not None else None}
        dcp.save({"model": model_state, "optimizer": optim_state, "meta": json.dumps(meta)},
                 checkpoint_id=str(directory))


def load(directory: str | Path, pipe, optimizer, scheduler) -> dict:
    """Load this rank's part; returns the checkpoint's meta (its step, seed, plan)."""
    path = Path(directory)
    if not (path / ".metadata").is_file():
        raise PlanError(f"--resume {directory}: not a checkpoint written by pyplan run --save "
                        "(no .metadata file)")
    view = _view(pipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_state, optim_state = get_state_dict(view, optimizer, options=_options())
        state = {"model": model_state, "optimizer": optim_state, "meta": ""}
        _check_keys(path, model_state)
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(view, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=_options())
    meta = json.loads(state["meta"])
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    return meta


def _check_keys(path: Path, model_state: dict) -> None:
    """RunError naming a key this rank needs that the checkpoint lacks (another model, or a
    sharding the checkpoint does not have)."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key in model_state:
        if f"model.{key}" not in stored:
            raise RunError(f"the checkpoint in {path} has no {key!r}",
                           hint="resume with a plan of the model it was saved from (sharded "
                                "blocks and sharded meshes need the same sharding)")


def consolidate(directory: str | Path, model: nn.Module, names: dict[int, str]) -> dict:
    """The whole model's state dict from a checkpoint: every key of model.state_dict(), a tied
    parameter under each of its names, sharded chunks joined."""
    path = Path(directory)
    if not (path / ".metadata").is_file():
        raise PlanError(f"{directory}: not a checkpoint written by pyplan run --save")
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    wanted = {}
    for key, meta in stored.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            wanted[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(wanted, checkpoint_id=str(path), no_dist=True)
    saved = {k[len("model."):]: v for k, v in wanted.items()}
    whole = {}
    for key in list(saved):
        base, marker, rest = key.partition(".__shard")
        if marker:
            count, dim = (int(x) for x in rest.partition("of")[2].split("dim"))
            whole[base] = torch.cat([saved[base + _SHARD.format(i, count, dim)]
                                     for i in range(count)], dim)
        elif ".__replica" not in key:
            whole[key] = saved[key]
    out = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for key, value in model.state_dict().items():
        name = names.get(id(params[key]), key) if key in params else key
        if name not in whole:
            raise RunError(f"the checkpoint in {directory} has no {name!r}",
                           hint="consolidate with a plan of the model it was saved from")
        if tuple(whole[name].shape) != tuple(value.shape):
            raise RunError(f"{name} is shaped {tuple(whole[name].shape)} in the checkpoint, "
                           f"{tuple(value.shape)} in the model")
        out[key] = whole[name].to(value.dtype)
    return out
