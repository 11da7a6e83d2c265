"""What a command reads or must keep, and the one check of its outputs against them: every
output flag of every command (run's --log, --trace, --tensorboard and --save, consolidate -o,
export -o, ...) goes through check_outputs before the command starts, so no output lands on
the plan, the model's code, its pretrained weights or a checkpoint (pyplan.files's
check_not_input compares inodes, after links)."""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
import sys
from pathlib import Path

from pyplan.errors import PlanError
from pyplan.files import check_not_input, hold_lock, read_capped

__all__ = ["check_outputs", "check_resume", "check_save", "check_save_folder", "checkpoint_reads",
           "lock_save", "model_reads", "newest_step"]

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
            if a.resolve() == b.resolve() or \
                    (a.exists() and b.exists() and os.path.samefile(a, b)):
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
    try:
        if (path / ".metadata").is_file() or (path / META).is_file():
            return [path]
        return sorted(p for p in path.iterdir() if p.name.startswith("step-") and p.is_dir())
    except (OSError, ValueError):  # not a folder, or a name no file can have
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
        except (OSError, ValueError, AttributeError, RecursionError):
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
    if "\0" in str(path):
        return  # check_outputs names it
    for folder in [path, *path.resolve().parents]:
        if folder.exists():
            if not folder.is_dir():
                raise PlanError(f"--save {path}: {folder} exists and is not a directory",
                                hint="choose another folder for the checkpoints")
            return


_STEP = re.compile(r"step-(\d{8,})")  # pyplan.train.checkpoint's step folders


def newest_step(folder: str | Path) -> Path | None:
    """The newest complete step folder in `folder` (pyplan.train.checkpoint.find's choice),
    without torch; None when there is none."""
    try:
        steps = sorted((int(m.group(1)), p) for p in Path(folder).iterdir()
                       if (m := _STEP.fullmatch(p.name)) and (p / META).is_file())
    except OSError:
        return None
    return steps[-1][1] if steps else None


def check_save_folder(save: str | None, resume: str | None, overwrite: bool,
                      model: str | None) -> None:
    """--save DIR holds one timeline of checkpoints: a run saving into a DIR that holds some
    continues from its newest (--resume auto, or --resume naming it). Any other start (afresh,
    from another folder, from an older step of DIR) would mix two timelines, and another
    model's or plan's checkpoints would be replaced: refused unless --overwrite, which lets
    this run's saves replace them (each save removes the steps after its own)."""
    newest = None if save is None or overwrite else newest_step(save)
    if newest is None or resume == "auto":
        return
    if resume is not None:
        given = Path(resume)
        start = given if (given / ".metadata").is_file() or (given / META).is_file() \
            else newest_step(given)
        if start is not None and os.path.samefile(start, newest):
            return
    try:
        saved = json.loads(read_capped(newest / META, 1 << 20)).get("model")
    except (OSError, ValueError, AttributeError):
        saved = None
    whose = f" of another model ({saved})" if isinstance(saved, str) and model is not None \
        and saved != model else ""
    how = "starts afresh" if resume is None else f"starts from {resume}"
    raise PlanError(f"--save {save}: holds checkpoints{whose} up to {newest.name}, and this "
                    f"run {how}, not from its newest", hint="continue them with --resume "
                    "auto, save into another folder, or give --overwrite to let this run's "
                    "checkpoints replace them")


LOCKED = "PYPLAN_SAVE_LOCKED"  # the --save folder a launcher holds locked for its workers


def lock_save(save: str | None) -> None:
    """One run writes into a --save folder at a time: the process that starts the run (pyplan
    run's launcher, else rank 0 under torchrun) locks it until it exits; a second run saving
    there is refused in one line before it starts. The workers a launcher starts inherit the
    lock (LOCKED names the folder)."""
    if save is None or os.environ.get("RANK", "0") != "0":
        return
    real = os.path.realpath(save)
    if os.environ.get(LOCKED) == real:
        return
    hold_lock(save, f"--save {save}")
    if "RANK" not in os.environ:  # the launcher: its workers inherit the lock
        os.environ[LOCKED] = real
