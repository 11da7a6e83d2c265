"""Pretrained weights read per stage from a Hugging Face / safetensors checkpoint folder
(`model.safetensors`, or shards listed in `model.safetensors.index.json`, as `save_pretrained`
writes them): every rank reads only its own tensors, each opened lazily with safetensors'
`safe_open`, under the model's own parameter names. Before anything is read, the checkpoint's
header (names, shapes, dtypes: no tensor data) is checked against the whole model, so a missing
or extra tensor, or one of another shape or dtype, is one line naming it on every rank.
"""

from __future__ import annotations

import json
import os
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


class Checkpoint:
    """The tensors of a safetensors checkpoint, by name, read when asked for."""

    def __init__(self, folder: Path, files: dict[str, Path], where: str) -> None:
        self.folder, self.files, self.where = folder, files, where
        self._open: dict[Path, object] = {}
        self.read: list[str] = []
        """The names of the tensors read so far (what this process took from the files)."""

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
        for name, path in self.files.items():
            piece = self._handle(path).get_slice(name)
            found[name] = (tuple(piece.get_shape()), _DTYPES.get(piece.get_dtype()))
        return found

    def tensor(self, name: str) -> torch.Tensor:
        path = self.files[name]
        try:
            value = self._handle(path).get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - a truncated or damaged shard
            raise PlanError(f"{self.where}: cannot read tensor {name} from {path.name}: "
                            f"{_first_line(exc)}", hint=_HINT) from None
        self.read.append(name)
        return value

    def check(self, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
              aliases: dict[str, str], optional: set[str]) -> None:
        """Every tensor of the model (`expected`: name -> shape, dtype; a tied parameter under
        any one of its names, `aliases`: name -> the first) is in the checkpoint with its shape
        and dtype, and the checkpoint holds nothing else (`optional`: buffers it may lack)."""
        header = self.header()
        for name in sorted(header):
            if name not in expected:
                raise PlanError(f"{self.where}: the checkpoint has a tensor {name} that the "
                                "model does not", hint="the checkpoint is of another model "
                                "(or another configuration of it)")
        have = {aliases.get(n, n) for n in header}
        for name, (shape, dtype) in expected.items():
            first = aliases.get(name, name)
            if first not in have and name not in optional:
                raise PlanError(f"{self.where}: the checkpoint has no tensor {name}",
                                hint="the checkpoint is of another model (or another "
                                "configuration of it)")
            if name in header and header[name][0] != shape:
                raise PlanError(f"{self.where}: tensor {name} is shaped "
                                f"{list(header[name][0])} in the checkpoint, {list(shape)} in "
                                "the model", hint="the checkpoint is of another configuration "
                                "of the model")
            if name in header and header[name][1] != dtype:
                raise PlanError(f"{self.where}: tensor {name} is "
                                f"{_dtype(header[name][1])} in the checkpoint, {_dtype(dtype)} "
                                "in the model", hint="build the model in the checkpoint's "
                                "dtype (e.g. torch_dtype= in from_config) or convert the "
                                "checkpoint")


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
    checkpoint = Checkpoint(folder, {}, where)
    checkpoint.files = {name: single for name in checkpoint._handle(single).keys()}
    return checkpoint


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "of an unknown dtype"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
