"""Checkpoints through torch.distributed.checkpoint (DCP): every rank writes the parameters,
buffers and optimizer state it holds, keyed by the model's own parameter names, so a
checkpoint saved under one plan loads under another plan of the same model (other stages,
another device count): DCP reads each rank's keys wherever they were written. The keys are
pyplan.mesh.state's (the engine's `Pipeline.state_dict`): a tied or replicated parameter is one
key written once; sharded chunks and flat shards load under a plan that shards them the same
way.

A checkpoint is one folder per step, `DIR/step-00000020`: DCP's files (a part per rank and
`.metadata`) and `pyplan.json` (the step, the plan's name and seal, the model, the optimizer and
its hyper-parameters, and what the trainer adds). It is written under a temporary name beside
the others and renamed once complete, so a save that fails, or a rank killed during it, leaves
every earlier checkpoint as it was. The record holds the sha256 of every file (each rank
hashes the parts it wrote); load and consolidate check them, so a flipped bit is refused,
naming the file.
Weights that are not finite are never saved. Loading takes the newest complete folder and
checks it against this run before any rank reads a tensor (every part present, whole and as
hashed, the same model's names and shapes, the same optimizer); the ranks agree on the verdict, so a damaged checkpoint
is one line on every rank (`CheckpointError`, exit 2) and none is left waiting in a collective.
Every rank takes part in every collective, one whose stage holds no trainable parameter (no
optimizer) included.

`consolidate` (one process, no torchrun) reads a checkpoint back into the whole model's
state dict, under the keys `model.state_dict()` has, for `load_state_dict(strict=True)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from pyplan.errors import PlanError, PyplanError
from pyplan.files import read_capped
from pyplan.run import arguments
from pyplan.run.data import describe
from pyplan.comm.devices import all_gather_objects
from pyplan.run.gradients import local
from pyplan.run.pipeline import Pipeline
from pyplan.mesh.state import SHARD, load_state_dict, state_dict
from pyplan.train.record import check_record

__all__ = ["CheckpointError", "Pending", "agree", "begin", "consolidate", "find", "finish",
           "load", "locate", "read_meta", "save", "verify"]

STEP = "step-{:08d}"
_STEP = re.compile(r"step-(\d{8,})")
_HIDDEN = re.compile(r"\.(step-\d{8,})\.(partial|replaced)")
META = "pyplan.json"
MAX_RECORD = 64 << 20  # bytes of pyplan.json read at most (a record is kilobytes)
FORMAT = 1


class CheckpointError(PlanError):
    """A checkpoint that cannot be written or used (exit 2). Raised on every rank at once: the
    ranks agree on it before any raises, so no rank waits for the others in a collective."""


# -- the folders

def find(directory: str | Path) -> Path | None:
    """The checkpoint `directory` names: itself when it is one, else its newest complete step
    folder (None when there is none)."""
    path = Path(directory)
    if (path / ".metadata").is_file():
        return path
    if not path.is_dir():
        return None
    steps = _steps(path)
    return steps[-1][1] if steps else None


def _steps(root: Path) -> list[tuple[int, Path]]:
    """The complete step folders in `root`, oldest first; a step a kill left only under its
    hidden names (between _complete's renames) counts by them, the new copy first."""
    found: dict[int, tuple[int, Path]] = {}
    for p in root.iterdir():
        hidden = _HIDDEN.fullmatch(p.name)
        m = _STEP.fullmatch(hidden.group(1) if hidden else p.name)
        if m and (p / META).is_file():
            rank = 0 if not hidden else 1 if hidden.group(2) == "partial" else 2
            step = int(m.group(1))
            if step not in found or rank < found[step][0]:
                found[step] = (rank, p)
    return sorted((step, p) for step, (_, p) in found.items())


def _recover(root: Path) -> None:
    """Put back in place a step a kill left under hidden names between _complete's renames:
    its new copy when complete (its record is written last), else the one it replaced."""
    for step, folder in _steps(root):
        final = root / STEP.format(step)
        if folder != final:
            folder.rename(final)
    for p in root.iterdir():
        if p.name.endswith(".replaced") and _HIDDEN.fullmatch(p.name):
            _discard(p)


def read_meta(folder: Path) -> dict:
    """pyplan.json of a checkpoint folder; CheckpointError when it is missing or damaged."""
    try:
        meta = json.loads(read_capped(folder / META, MAX_RECORD).decode())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: not a checkpoint written by pyplan (no {META})",
                              hint="give the directory --save wrote") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{folder / META} is damaged ({str(exc)[:200]})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder / META} is damaged (not pyplan's checkpoint record)")
    check_record(folder / META, meta, CheckpointError)
    return meta


def agree(fn):
    """fn() on every rank; when it fails on any rank, every rank raises the first failure
    (lowest rank), so that none goes on into a collective the others left."""
    try:
        result, failure = fn(), None
    except PyplanError as exc:
        result, failure = None, (exc.message, exc.hint)
    except OSError as exc:
        result, failure = None, (f"{exc.filename or 'checkpoint'}: {exc.strerror or exc}", None)
    found = next((f for f in all_gather_objects(failure) if f is not None), None)
    if found is not None:
        raise CheckpointError(found[0], hint=found[1])
    return result


def save(directory: str | Path, pipe, optimizer=None, *, step: int, scheduler=None,
         meta: dict | None = None, keep_last: int | None = None, fail: str | None = None) -> Path:
    """Write `directory`/step-NNNNNNNN (every rank calls it, with the same arguments): DCP into
    a temporary folder, then pyplan.json (with `meta` and the scheduler's state_dict), then the
    rename; with `keep_last`, remove all but the newest `keep_last` step folders. Returns the
    folder. `fail` ("raise" or "kill") is a testing aid: this rank fails after writing its part,
    before the checkpoint is complete."""
    pending = begin(directory, pipe, optimizer, step=step, scheduler=scheduler, meta=meta,
                    keep_last=keep_last, fail=fail)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(pending.state, storage_writer=pending.writer)
        failure = None
    except (CheckpointException, OSError) as exc:
        failure = pending.cannot(exc)
    return finish(pending, pipe, failure)


@dataclass
class Pending:
    """A checkpoint begun: its folders, its record so far, the state DCP writes and the
    writer (which hashes the files it wrote)."""

    root: Path
    partial: Path
    final: Path
    record: dict
    keep_last: int | None
    state: dict
    writer: _Writer

    def cannot(self, exc: BaseException) -> str:
        """What went wrong writing it, in one line."""
        why = _cause(exc) if isinstance(exc, CheckpointException) else \
            getattr(exc, "strerror", None) or str(exc)
        return f"cannot write the checkpoint of step {self.record['step']} in {self.root}: {why}"


def begin(directory: str | Path, pipe, optimizer=None, *, step: int, scheduler=None,
          meta: dict | None = None, keep_last: int | None = None,
          fail: str | None = None) -> Pending:
    """save's first half on every rank: the arguments, the record, the weights finite, the
    folder ready; what DCP then writes (the state as it is now) into the temporary folder."""
    what = "pyplan.runtime.save"
    _arguments(what, directory, pipe, optimizer, scheduler,
               arguments.whole(what, "step", step, 0),
               arguments.whole(what, "keep_last", keep_last, 1, none=True),
               arguments.instance(what, "meta", meta, dict, "a dict", none=True))
    root = Path(directory)
    final = root / STEP.format(step)
    partial = root / f".{final.name}.partial"
    described = all_gather_objects(_describe(optimizer))
    record = {"format": FORMAT, "step": step, "plan": pipe.problem.name,
              "plan_sha256": pipe.resolved.spec_sha256,
              "model": pipe.problem.model.builder if pipe.problem.model else None,
              "optimizer": next((d for d in described if d is not None), None),
              "world": pipe.world, "iterations": pipe.iteration + 1,
              "loss_scale": pipe.loss_scale, **(meta or {})}
    schedules = all_gather_objects(None if scheduler is None else scheduler.state_dict())
    if any(s is not None for s in schedules):
        record["scheduler"] = next(s for s in schedules if s is not None)
    agree(lambda: _serializable(record))
    agree(lambda: _finite(pipe, step))
    agree(lambda: _prepare(root, partial) if pipe.rank == 0 else None)
    return Pending(root, partial, final, record, keep_last, state_dict(pipe, optimizer),
                   _Writer(str(partial), fail=fail))


def finish(pending: Pending, pipe, failure: str | None) -> Path:
    """save's second half on every rank, once DCP has written (`failure`: this rank's, if
    any): on a failure anywhere the temporary folder goes and every rank raises it; else the
    record with every file's sha256 (each rank hashed the parts it wrote, rank 0 DCP's
    .metadata) and the rename."""
    root, partial = pending.root, pending.partial
    failure = next((f for f in all_gather_objects(failure) if f is not None), None)
    if failure is not None:
        agree(lambda: _discard(partial) if pipe.rank == 0 else None)
        kept = find(root)
        raise CheckpointError(failure, hint=f"{kept} is intact" if kept is not None else None)
    shares = all_gather_objects(agree(lambda: {**pending.writer.hashes, **(
        {".metadata": _sha256(partial / ".metadata")} if pipe.rank == 0 else {})}))
    record = {**pending.record,
              "sha256": {name: digest for share in shares for name, digest in share.items()}}
    return agree(lambda: _complete(root, partial, pending.final, record, pending.keep_last)
                 if pipe.rank == 0 else pending.final)


class _Writer(dcp.FileSystemWriter):
    """DCP's writer, which also hashes the files this rank wrote (`hashes`, by name), where it
    wrote them (in async_save's thread for an asynchronous save)."""

    def __init__(self, path: str, fail: str | None) -> None:
        super().__init__(path, sync_files=True, overwrite=True)
        self.fail = fail
        self.hashes: dict[str, str] = {}

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        prefix, folder = plan.storage_data.prefix, Path(self.path)
        self.hashes = {p.name: _sha256(p) for p in sorted(folder.iterdir())
                       if p.name.startswith(prefix) and p.is_file()}
        if self.fail is not None:
            if self.fail == "kill":
                time.sleep(0.5)  # as a save that takes a while: the others saw it start
                os.kill(os.getpid(), 9)
            raise OSError(5, "failing on purpose (--fail-at RANK:save)")
        return written


def _finite(pipe, step: int) -> None:
    """CheckpointError when a parameter of this rank holds inf or NaN: such weights are never
    written (the checkpoints before stay the newest)."""
    for name, param in pipe.named_parameters():
        if not bool(torch.isfinite(local(param.detach())).all()):  # this rank's part
            raise CheckpointError(f"not saving the checkpoint of step {step}: {name} holds "
                                  f"non-finite values (rank {pipe.rank})",
                                  hint="resume from the newest checkpoint with a lower --lr")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def verify(folder: Path, meta: dict, rank: int = 0, world: int = 1) -> None:
    """CheckpointError naming the first file of this rank's share (every world-th of the
    recorded ones) whose sha256 is not the one recorded at save (a checkpoint written before
    pyplan recorded them has none to check)."""
    recorded = meta.get("sha256") or {}
    for name in sorted(recorded)[rank::world]:
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"the checkpoint {folder} is damaged: its part {name} is "
                                  "missing", hint=_earlier(folder))
        if _sha256(path) != recorded[name]:
            raise CheckpointError(f"the checkpoint {folder} is damaged: its part {name} does not "
                                  "match the sha256 recorded when it was saved",
                                  hint=_earlier(folder))


def _serializable(record: dict) -> None:
    try:
        json.dumps(record)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot record the checkpoint's meta data as JSON: {exc}",
                              hint="give save() meta of numbers, strings, lists and dicts") \
            from None


def _arguments(what: str, directory, pipe, optimizer, scheduler, *errors) -> None:
    """save's or load's arguments checked, the same CheckpointError on every rank (`pipe`
    must be a Pipeline to agree through)."""
    if not isinstance(pipe, Pipeline) or pipe.closed:
        raise CheckpointError(f"{what}: pipe is {describe(pipe)}, not an open "
                              "pyplan.runtime.Pipeline")
    problems = [*errors, arguments.instance(what, "directory", directory, (str, os.PathLike),
                                            "a folder's path"),
                arguments.optimizer(what, optimizer, 0)]
    if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
        problems.append(arguments.instance(what, "scheduler", scheduler, (), "a learning-rate "
                                           "scheduler"))

    def first() -> None:
        error = next((e for e in problems if e is not None), None)
        if error is not None:
            raise error
    agree(first)


def _describe(optimizer) -> dict | None:
    if optimizer is None:
        return None
    group = optimizer.param_groups[0]
    hyper = {k: v for k, v in group.items()
             if k not in ("params", "initial_lr") and isinstance(v, (int, float, bool, str))}
    return {"class": type(optimizer).__name__, "hyper": hyper}


def _prepare(root: Path, partial: Path) -> None:
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"--save {root}: exists and is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    _recover(root)
    _discard(partial)  # what a killed save left


def _discard(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def _complete(root: Path, partial: Path, final: Path, record: dict,
              keep_last: int | None) -> Path:
    with open(partial / META, "w") as handle:
        json.dump(record, handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    old = root / f".{final.name}.replaced"
    if final.exists():  # saved again (resumed from an earlier step): replaced once complete
        _discard(old)
        final.rename(old)
    partial.rename(final)
    _sync_dir(root)
    _discard(old)
    steps = _steps(root)
    newer = [folder for step, folder in steps if step > record["step"]]
    kept = [folder for step, folder in steps if step <= record["step"]]
    # One timeline per folder: the steps after this one are another's (a run resumed from an
    # earlier step, allowed to replace them: pyplan run --overwrite), and go.
    for folder in newer + (kept[:-keep_last] if keep_last is not None else []):
        shutil.rmtree(folder)
    return final


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cause(exc: CheckpointException) -> str:
    """The first rank's exception inside DCP's, in one line."""
    for rank, (inner, _) in sorted(exc.failures.items()):
        if isinstance(inner, OSError) and inner.strerror:
            return f"rank {rank}: {inner.strerror}" + \
                (f" ({inner.filename})" if inner.filename else "")
        first = str(inner).splitlines()[0].split(". ")[0] if str(inner) else ""
        return f"rank {rank}: {type(inner).__name__}: {first[:160]}"
    return "unknown failure"


def load(directory: str | Path, pipe, optimizer=None, *, scheduler=None) -> dict:
    """Load this rank's part of the newest complete checkpoint in `directory` (every rank calls
    it) into the pipeline's parameters and buffers and, given them, the optimizer (its state
    and the hyper-parameters it was saved with, as torch's load_state_dict does) and the
    scheduler; returns its record (pyplan.json: "step", "optimizer", the meta given to save),
    with "path"."""
    _arguments("pyplan.runtime.load", directory, pipe, optimizer, scheduler)
    folder = agree(lambda: locate(directory))
    meta = agree(lambda: read_meta(folder))
    stored = agree(lambda: _check_files(folder))
    agree(lambda: verify(folder, meta, pipe.rank, pipe.world))
    state = state_dict(pipe, optimizer)
    mine = sorted(state["model"])
    everyone = all_gather_objects(mine)
    builder = pipe.problem.model.builder if pipe.problem.model is not None else None
    agree(lambda: _check_model(folder, meta, stored, state["model"],
                               {k for keys in everyone for k in keys}, builder))
    has = all_gather_objects(_describe(optimizer))
    agree(lambda: _check_optimizer(folder, meta, stored, state.get("optimizer"),
                                     next((h for h in has if h is not None), None)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(folder))
        failure = None
    except CheckpointException as exc:
        failure = f"cannot read the checkpoint {folder}, its data is damaged: {_cause(exc)}"
    agree(lambda: _raise(failure))
    load_state_dict(pipe, state, optimizer)
    # The plan iterations done (dropout's random numbers follow them) and fp16's loss scale.
    pipe.iteration = int(meta.get("iterations", 0)) - 1
    pipe.loss_scale = float(meta.get("loss_scale", pipe.loss_scale))
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    return {**meta, "path": str(folder)}


def newest(directory) -> tuple[Path, dict] | None:
    """(folder, record) of the newest complete checkpoint in `directory`, None if none
    (`pyplan run --resume auto`)."""
    folder = find(directory)
    return None if folder is None else (folder, read_meta(folder))


def named(directory) -> tuple[Path, dict]:
    """(folder, record) of the checkpoint `directory` names (`--resume DIR`)."""
    folder = locate(directory)
    return folder, read_meta(folder)


def resumable(folder: Path, meta: dict, seed: int, optimizer: str) -> None:
    """`pyplan run --resume`: a checkpoint of another seed or optimizer (its record's
    "training") is refused before anything loads."""
    saved = meta.get("training") or {}
    if meta.get("seed") is not None and meta["seed"] != seed:
        raise CheckpointError(f"the checkpoint {folder} was trained with --seed "
                              f"{meta['seed']}, not {seed}",
                              hint=f"resume with --seed {meta['seed']}")
    if saved.get("optimizer") not in (None, optimizer):
        raise CheckpointError(f"the checkpoint {folder} holds {saved['optimizer']}'s state, and "
                              f"this run's optimizer is {optimizer}",
                              hint=f"resume with --optimizer {saved['optimizer']}")


def _raise(failure: str | None) -> None:
    if failure is not None:
        raise CheckpointError(failure)


def locate(directory) -> Path:
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint (a file, not a directory)",
                              hint="give the directory --save wrote")
    folder = find(path)
    if folder is None:
        what = "does not exist" if not path.exists() else "holds no complete checkpoint"
        raise CheckpointError(f"{directory} {what}", hint="give the directory --save wrote")
    return folder


def _check_files(folder: Path):
    """DCP's metadata, after checking that every file it points into is there and long
    enough (a missing or truncated part is named before any rank reads)."""
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any failure to read it is a damaged file
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"{folder / '.metadata'} is damaged ({type(exc).__name__}: "
                              f"{first})") from None
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"the checkpoint {folder} is damaged: its part {name} is "
                                  "missing", hint=_earlier(folder)) from None
        if size < end:
            raise CheckpointError(f"the checkpoint {folder} is damaged: its part {name} is "
                                  f"truncated ({size} of {end} bytes)", hint=_earlier(folder))
    return metadata.state_dict_metadata


def _earlier(folder: Path) -> str:
    """A hint naming the newest complete checkpoint before `folder`, if there is one."""
    step = _STEP.fullmatch(folder.name)
    earlier = sorted((int(m.group(1)), p) for p in folder.parent.iterdir()
                     if (m := _STEP.fullmatch(p.name)) and (p / META).is_file() and step
                     and int(m.group(1)) < int(step.group(1))) if step else []
    return f"resume from {earlier[-1][1]}" if earlier else "resume from an earlier checkpoint"


def _check_model(folder: Path, meta: dict, stored: dict, mine: dict, everyone: set,
                 builder: str | None) -> None:
    hint = "resume with a plan of the model it was saved from (sharded blocks and sharded " \
           "meshes need the same sharding)"
    for key, tensor in mine.items():
        entry = stored.get(f"model.{key}")
        if entry is None or not hasattr(entry, "size"):
            other = f" (saved from {meta['model']})" \
                if meta.get("model") not in (None, builder) else ""
            raise CheckpointError(f"the checkpoint {folder}{other} has no {key!r}", hint=hint)
        if tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(f"{key} is shaped {tuple(entry.size)} in the checkpoint "
                                  f"{folder}, {tuple(tensor.shape)} in this model", hint=hint)
        if entry.properties.dtype != tensor.dtype:
            raise CheckpointError(f"{key} is {entry.properties.dtype} in the checkpoint "
                                  f"{folder}, {tensor.dtype} in this model", hint=hint)
    _refuse_extra(folder, sorted(k[len("model."):] for k in stored
                                 if k.startswith("model.") and k[len("model."):] not in everyone),
                  hint)


def _refuse_extra(folder: Path, extra: list[str], hint: str) -> None:
    """CheckpointError when the checkpoint holds names (`extra`, sorted) this model lacks."""
    if extra:
        raise CheckpointError(f"the checkpoint {folder} holds {extra[0]!r}, which this model "
                              f"does not have ({len(extra)} such entries): another model's",
                              hint=hint)


def _check_optimizer(folder: Path, meta: dict, stored: dict, mine: dict | None,
                     wanted: dict | None) -> None:
    saved = meta.get("optimizer")
    if wanted is None:
        return
    if saved is None:
        raise CheckpointError(f"the checkpoint {folder} holds no optimizer state",
                              hint="load it without an optimizer")
    if saved["class"] != wanted["class"]:
        raise CheckpointError(f"the checkpoint {folder} holds {saved['class']}'s state, and "
                              f"this run's optimizer is {wanted['class']}",
                              hint=f"resume with the checkpoint's optimizer ({saved['class']})")
    for key in mine or {}:
        if f"optimizer.{key}" not in stored:
            raise CheckpointError(f"the checkpoint {folder} has no optimizer state {key!r}",
                                  hint="resume with the optimizer settings it was saved with")


# -- one process

def consolidate(directory: str | Path, model: nn.Module, names: dict[int, str]) -> dict:
    """The whole model's state dict from a checkpoint: every key of model.state_dict(), a tied
    parameter under each of its names, sharded chunks joined."""
    folder = locate(directory)
    meta = read_meta(folder)
    stored = _check_files(folder)
    verify(folder, meta)
    wanted = {}
    for key, meta in stored.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            wanted[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(wanted, checkpoint_id=str(folder), no_dist=True)
    except CheckpointException as exc:
        raise CheckpointError(f"cannot read the checkpoint {folder}, its data is damaged: "
                              f"{_cause(exc)}") from None
    saved = {k[len("model."):]: v for k, v in wanted.items()}
    whole = {}
    for key in list(saved):
        base, marker, rest = key.partition(".__shard")
        if marker:
            count, dim = (int(x) for x in rest.partition("of")[2].split("dim"))
            parts = [saved.get(base + SHARD.format(i, count, dim)) for i in range(count)]
            if any(p is None for p in parts):
                raise CheckpointError(f"the checkpoint {folder} lacks chunks of {base}")
            whole[base] = torch.cat(parts, dim)
        elif ".__replica" not in key:
            whole[key] = saved[key]
    out, used = {}, set()
    params = dict(model.named_parameters(remove_duplicate=False))
    hint = "consolidate with a plan of the model it was saved from"
    for key, value in model.state_dict().items():
        name = names.get(id(params[key]), key) if key in params else key
        if name not in whole:
            raise CheckpointError(f"the checkpoint {folder} has no {name!r}", hint=hint)
        if tuple(whole[name].shape) != tuple(value.shape):
            raise CheckpointError(f"{name} is shaped {tuple(whole[name].shape)} in the "
                                  f"checkpoint, {tuple(value.shape)} in the model", hint=hint)
        out[key] = whole[name].to(value.dtype)
        used.add(name)
    _refuse_extra(folder, sorted(set(whole) - used), hint)
    return out
