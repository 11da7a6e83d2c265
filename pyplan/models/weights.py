"""Pretrained weights read per stage from a Hugging Face / safetensors checkpoint folder
(`model.safetensors`, or shards listed in `model.safetensors.index.json`, as `save_pretrained`
writes them): every rank reads only its own tensors, each opened lazily with safetensors'
`safe_open`, under the model's own parameter names. Before anything is read, the checkpoint's
header (names, shapes, dtypes: no tensor data) is checked against the whole model, so a missing
or extra tensor, or one of another shape or dtype, is one line naming it on every rank.

A `transformers` model may keep some weights on disk in another layout than its parameters
(Qwen3-MoE and Mixtral: one tensor per expert on disk, the experts fused in the model;
OLMo-hybrid: renamed norms, a convolution split in three). The names are then mapped, and the
tensors converted, by the rules `from_pretrained` itself loads with (transformers'
`get_model_conversion_mapping` and `rename_source_key`, its `WeightConverter`s run on the
tensors a rank needs): a parameter is converted from its own checkpoint tensors alone, read
when the rank asks for it.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pyplan.errors import PlanError

__all__ = ["Checkpoint", "open_checkpoint"]

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_HINT = "model.weights names a folder written by save_pretrained (model.safetensors, or " \
        "model.safetensors.index.json and its shards)"


@dataclass
class _Source:
    """The checkpoint tensors one or more of the model's tensors come from: one read as it is
    (`converter` None), or several converted together (`targets`: the model's names it
    gives, the first the one transformers keys it by)."""

    targets: list[str]
    converter: object = None
    keys: list[tuple[str, str]] = field(default_factory=list)
    """(the converter's source pattern, the checkpoint's name), in transformers' order."""


class Checkpoint:
    """The tensors of a safetensors checkpoint, read when asked for under the model's names
    (after `check`; the checkpoint's own names before)."""

    def __init__(self, folder: Path, files: dict[str, Path], where: str) -> None:
        self.folder, self.files, self.where = folder, files, where
        self._open: dict[Path, object] = {}
        self.read: list[str] = []
        """The checkpoint's names of the tensors read so far (what this process took from the
        files)."""
        self.provides: dict[str, _Source] = {name: _Source([name], keys=[("", name)])
                                             for name in files}
        """The model's name of every tensor the checkpoint gives -> where it comes from."""
        self._model = None
        self._expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._converted: dict[str, torch.Tensor] = {}

    def _handle(self, path: Path):
        from safetensors import safe_open

        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="pt")
            except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's
                raise PlanError(f"{self.where}: cannot read {path}: {_first_line(exc)}",
                                hint=_HINT) from None
        return self._open[path]

    def header(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """name -> (shape, dtype) of every tensor, from the files' headers alone."""
        found = {}
        held: dict[Path, set[str]] = {}
        for name, path in self.files.items():
            if path not in held:
                held[path] = set(self._handle(path).keys())
            if name not in held[path]:  # the index names a shard that lacks the tensor
                raise PlanError(f"{self.where}: {self.folder / INDEX} lists tensor {name} in "
                                f"{path.name}, which lacks it", hint=_HINT)
            piece = self._handle(path).get_slice(name)
            found[name] = (tuple(piece.get_shape()), _DTYPES.get(piece.get_dtype()))
        return found

    def _read(self, key: str) -> torch.Tensor:
        path = self.files[key]
        try:
            value = self._handle(path).get_tensor(key)
        except Exception as exc:  # noqa: BLE001 - a truncated or damaged shard
            raise PlanError(f"{self.where}: cannot read tensor {key} from {path.name}: "
                            f"{_first_line(exc)}", hint=_HINT) from None
        self.read.append(key)
        return value

    def tensor(self, name: str) -> torch.Tensor:
        """The model's tensor `name` (a name `provides` has), read from the files, converted
        to the model's layout where the checkpoint keeps it in another."""
        source = self.provides[name]
        if source.converter is None:
            return self._read(source.keys[0][1])
        if name not in self._converted:
            self._converted.update(self._convert(source))
        return self._converted.pop(name)

    def _convert(self, source: _Source) -> dict[str, torch.Tensor]:
        """transformers' conversion of `source`'s tensors (read now) into the model's."""
        converter = copy.deepcopy(source.converter)
        for pattern, key in source.keys:
            converter.add_tensor(source.targets[0], key, pattern, lambda key=key: self._read(key))
        shown = ", ".join(key for _, key in source.keys[:2]) + (", ..." if len(source.keys) > 2
                                                               else "")
        try:
            found = converter.convert(source.targets[0], model=self._model,
                                      config=getattr(self._model, "config", None))
        except PlanError:
            raise
        except Exception as exc:  # noqa: BLE001 - tensors that do not fit the conversion
            raise PlanError(f"{self.where}: cannot convert {shown} to the model's "
                            f"{source.targets[0]}: {_first_line(exc)}",
                            hint="the checkpoint is of another configuration of the model")
        out = {}
        for name, value in found.items():
            value = value[0] if isinstance(value, list) else value
            want = self._expected.get(name, (None,))[0]
            if name not in source.targets or tuple(value.shape) != want:
                raise PlanError(f"{self.where}: {shown} converted to the model's {name} are "
                                f"shaped {list(value.shape)}, the model's is "
                                f"{list(want) if want is not None else 'absent'}",
                                hint="the checkpoint is of another configuration of the model")
            out[name] = value
        return out

    def check(self, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
              aliases: dict[str, str], optional: set[str], model=None) -> None:
        """Every tensor of the model (`expected`: name -> shape, dtype; a tied parameter under
        any one of its names, `aliases`: name -> the first) is in the checkpoint with its shape
        and dtype, and the checkpoint holds nothing else (`optional`: buffers it may lack).
        `model`: a `transformers` model whose checkpoints may keep weights in another layout
        (its names mapped and its tensors converted as `from_pretrained` does)."""
        header = self.header()
        self._model, self._expected = model, expected
        self.provides = _layout(model, header, expected, self.where)
        have = {aliases.get(n, n) for n in self.provides}
        for name, (shape, dtype) in expected.items():
            first = aliases.get(name, name)
            if first not in have and name not in optional:
                raise PlanError(f"{self.where}: the checkpoint has no tensor {name}",
                                hint="the checkpoint is of another model (or another "
                                "configuration of it)")
            source = self.provides.get(name)
            for _, key in source.keys if source is not None else ():
                stored = f"tensor {key}" + (f" (the model's {name})" if key != name else "")
                if source.converter is None and header[key][0] != shape:
                    raise PlanError(f"{self.where}: {stored} is shaped {list(header[key][0])} "
                                    f"in the checkpoint, {list(shape)} in the model",
                                    hint="the checkpoint is of another configuration of the "
                                    "model")
                if header[key][1] != dtype:
                    raise PlanError(f"{self.where}: {stored} is {_dtype(header[key][1])} in "
                                    f"the checkpoint, {_dtype(dtype)} in the model",
                                    hint="build the model in the checkpoint's dtype (e.g. "
                                    "torch_dtype= in from_config) or convert the checkpoint")


def _layout(model, header: dict, expected: dict, where: str) -> dict[str, _Source]:
    """The model's name of each tensor the checkpoint gives -> its source: the checkpoint's
    names mapped by transformers' loading rules for `model` (none for another model: the
    names are the model's own). PlanError for a checkpoint tensor the model has no place for."""
    rules = _loading_rules(model)
    sources: dict[str, _Source] = {}
    found: dict[str, _Source] = {}
    for key in sorted(header, key=rules.order if rules else None):
        name, pattern = rules.rename(key, expected) if rules else (key, None)
        if name not in expected:
            read_as = f" (read as {name})" if name != key else ""
            raise PlanError(f"{where}: the checkpoint has a tensor {key}{read_as} that the "
                            "model does not", hint="the checkpoint is of another model (or "
                            "another configuration of it)")
        if pattern is None:
            source = _Source([name], keys=[("", key)])
        else:
            source = sources.get(name)
            if source is None:
                converter = rules.converters[pattern]
                first = converter.target_patterns[0]
                source = sources[name] = _Source([name.replace(first, target) for target in
                                                  converter.target_patterns], converter)
            source.keys.append((pattern, key))
        for target in source.targets:
            if found.setdefault(target, source) is not source:
                raise PlanError(f"{where}: the checkpoint has two tensors for the model's "
                                f"{target}: {found[target].keys[0][1]} and {key}",
                                hint="the checkpoint is of another model")
    return found


@dataclass
class _Rules:
    """transformers' rules for loading a model's checkpoint (what from_pretrained applies)."""

    renamings: list
    converters: dict[str, object]
    """A converter's source pattern -> the converter."""
    rename_key: object
    order: object
    prefix: str

    def rename(self, key: str, expected: dict) -> tuple[str, str | None]:
        """(the model's name for checkpoint tensor `key`, the converter pattern it matched or
        None), as from_pretrained renames it."""
        converters = list(dict.fromkeys(self.converters.values()))
        name, pattern = self.rename_key(key, self.renamings, converters, self.prefix, expected)
        if name not in expected and key in expected:  # from_pretrained's own fallback
            name, pattern = self.rename_key(key, [], [], self.prefix, expected)
        return name, pattern


def _loading_rules(model) -> _Rules | None:
    """The loading rules of a `transformers` model (None for another model, or a transformers
    without them)."""
    if model is None or "transformers" not in sys.modules:
        return None
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     dot_natural_key, rename_source_key)
    except ImportError:  # a transformers before its conversion mappings: names as they are
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    transforms = get_model_conversion_mapping(model)
    return _Rules([t for t in transforms if isinstance(t, WeightRenaming)],
                  {p: t for t in transforms if isinstance(t, WeightConverter)
                   for p in t.source_patterns}, rename_source_key, dot_natural_key,
                  model.base_model_prefix)


def open_checkpoint(path: str | os.PathLike, where: str = "model.weights") -> Checkpoint:
    """The checkpoint in folder `path` (or the one file it names); PlanError naming what is
    wrong otherwise."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        folder, single = path.parent, path
    elif path.is_dir():
        folder, single = path, path / SINGLE
    else:
        raise PlanError(f"{where}: {path} is not a folder or a .safetensors file", hint=_HINT)
    index = folder / INDEX
    if path.is_dir() and index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
            files = {name: folder / file for name, file in mapping.items()}
            if not all(isinstance(f, str) for f in mapping.values()):
                raise TypeError("file names must be strings")
        except Exception as exc:  # noqa: BLE001 - a damaged index
            raise PlanError(f"{where}: cannot read {index}: {_first_line(exc)}",
                            hint=_HINT) from None
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise PlanError(f"{where}: {index.name} lists {file.name}, which is missing",
                                hint=_HINT)
        return Checkpoint(folder, files, where)
    if not single.is_file():
        raise PlanError(f"{where}: {folder} has neither {SINGLE} nor {INDEX}", hint=_HINT)
    probe = Checkpoint(folder, {}, where)
    checkpoint = Checkpoint(folder, dict.fromkeys(probe._handle(single).keys(), single), where)
    checkpoint._open = probe._open
    return checkpoint


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "of an unknown dtype"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
