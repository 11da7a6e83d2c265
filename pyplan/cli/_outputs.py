"""What a command reads or must keep, and the one check of its outputs against them: every
output flag of every command (run's --log, --trace, --tensorboard and --save, consolidate -o,
export -o, ...) goes through check_outputs before the command starts, so no output lands on
the plan, the model's code, its pretrained weights or a checkpoint (pyplan.fileio's
check_not_input compares inodes, after links)."""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
from pathlib import Path

from pyplan.errors import PlanError
from pyplan.fileio import check_not_input, read_capped

__all__ = ["check_outputs", "check_resume", "check_save", "checkpoint_reads", "model_reads"]

META = "pyplan.json"  # pyplan.train.checkpoint.META (tests/test_run_cli.py checks they agree)


def check_outputs(outputs: dict[str, tuple[str | Path | None, str]],
                  reads: list[str | Path | None]) -> None:
    """PlanError (one line, naming the flag) when an output (by flag: (path, kind), kinds as
    check_not_input's) would write over, or inside, one of `reads` (files, and folders kept
    whole), inside a checkpoint, or onto another output."""
    given = {flag: (path, kind) for flag, (path, kind) in outputs.items() if path is not None}
    for flag, (path, kind) in given.items():
        if path == "-":
            continue
        check_not_input(path, *reads, flag=flag, kind=kind)
        above = _checkpoints_above(path, include_self=kind != "file")
        if above:
            raise PlanError(f"{flag} {path}: refusing to write inside the checkpoint "
                            f"{above[0]}", hint="choose an output outside the checkpoints")
    flags = [f for f in given if given[f][0] != "-"]
    for i, first in enumerate(flags):
        for second in flags[i + 1:]:
            a, b = Path(given[first][0]), Path(given[second][0])
            if a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b)):
                raise PlanError(f"{first} and {second} both name {given[second][0]}",
                                hint="give them different files")


def _checkpoints_above(path: str | Path, include_self: bool = False) -> list[Path]:
    """The checkpoint folders (holding pyplan.json or DCP's .metadata) that `path` lies in."""
    real = Path(os.path.realpath(path))
    folders = ([real] if include_self else []) + list(real.parents)
    return [f for f in folders if (f / META).is_file() or (f / ".metadata").is_file()]


def checkpoint_reads(folder: str | Path | None) -> list[Path]:
    """The checkpoints in `folder` (a step folder, or --save's folder of step folders): each
    kept whole. Nothing is read from them here but their names."""
    if folder is None or str(folder) in ("", "auto"):
        return []
    path = Path(folder)
    if (path / ".metadata").is_file() or (path / META).is_file():
        return [path]
    try:
        return sorted(p for p in path.iterdir() if p.name.startswith("step-") and p.is_dir())
    except OSError:
        return []


def model_reads(model, plan_dir: Path) -> list[Path]:
    """The files of a plan's model: its modules' source files (found as Python would import
    them, with the plan's folder and model.path first on the path, without running them) and
    its pretrained weights (model.weights: the folder or file, and the shards an index
    names)."""
    if model is None:
        return []
    folders = [str((plan_dir / model.path).resolve())] if model.path else []
    folders += [str(plan_dir.resolve()), os.getcwd(), *sys.path]
    found: list[Path] = []
    for text in (model.module, model.blocks, model.data, model.loss):
        if isinstance(text, str):
            found += _module_files(text.partition(":")[0], folders)
    if model.weights:
        weights = plan_dir / model.weights
        found.append(weights)
        found += _shards(weights)
    return found


def _module_files(name: str, folders: list[str]) -> list[Path]:
    """The source files of module `name` and of the packages above it."""
    files, search = [], folders
    for part in name.split("."):
        try:
            spec = importlib.machinery.PathFinder.find_spec(part, search)
        except (ImportError, ValueError, OSError):
            return files
        if spec is None:
            return files
        if spec.has_location and spec.origin:
            files.append(Path(spec.origin))
        search = list(spec.submodule_search_locations or [])
    return files


def _shards(weights: Path) -> list[Path]:
    """The shard files the safetensors indexes in `weights` name (they may lie elsewhere)."""
    try:
        indexes = sorted(weights.glob("*.index.json")) if weights.is_dir() else []
    except OSError:
        return []
    shards = []
    for index in indexes:
        try:
            mapping = json.loads(read_capped(index, 64 << 20)).get("weight_map") or {}
        except (OSError, ValueError, AttributeError):
            continue  # the loader says what is wrong with it
        if isinstance(mapping, dict):
            shards += [weights / str(f) for f in sorted(set(map(str, mapping.values())))]
    return shards


def check_resume(path: Path) -> None:
    """A folder --save wrote (a step folder, or the folder of step folders), without torch;
    the ranks check the checkpoint itself before they load it."""
    if not path.is_dir():
        raise PlanError(f"--resume {path}: " + ("is not a directory" if path.exists() else
                                                 "does not exist"),
                        hint="give the directory --save wrote")
    if not (path / ".metadata").is_file() and \
            not any(p.name.startswith("step-") for p in path.iterdir()):
        raise PlanError(f"--resume {path}: holds no checkpoint written by pyplan run --save",
                        hint="give the directory --save wrote")


def check_save(path: Path) -> None:
    """--save DIR: a directory, or a path that can become one (no file in the way)."""
    for folder in [path, *path.resolve().parents]:
        if folder.exists():
            if not folder.is_dir():
                raise PlanError(f"--save {path}: {folder} exists and is not a directory",
                                hint="choose another folder for the checkpoints")
            return
