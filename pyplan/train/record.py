"""The checkpoint record (`pyplan.json`) checked field by field before anything uses it: a
damaged or hand-edited record (a list where a mapping belongs, a string for a number, null, a
negative step, a step of 10^12) is one line naming the file and the field (CheckpointError,
exit 2), never a Python exception from deep inside a resume, and no loop runs over a number it
holds that is out of range (a resume replays the learning-rate schedule up to its step)."""

from __future__ import annotations

import math
from pathlib import Path

from pyplan.errors import PlanError

__all__ = ["MAX_STEP", "check_record"]

MAX_STEP = 10**7
"""The largest step a checkpoint may record: a resume replays the schedule up to it (about a
microsecond a step), and no training run takes more optimizer steps."""
MAX_BATCHES = 10**9  # plan iterations consumed (steps x accumulate)


def _int(low: int, high: int):
    def check(value) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return "an integer"
        return None if low <= value <= high else f"an integer in {low:,} .. {high:,}"
    return check


def _number(positive: bool = False):
    def check(value) -> str | None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value) and (value > 0 if positive else value >= 0)
        return None if ok else ("a positive" if positive else "a non-negative") + \
            " finite number"
    return check


def _kind(*types, what: str):
    def check(value) -> str | None:
        return None if isinstance(value, types) and not isinstance(value, bool) else what
    return check


def _betas(value) -> str | None:
    ok = isinstance(value, list) and len(value) == 2 and \
        all(_number()(b) is None and b < 1 for b in value)
    return None if ok else "two numbers in [0, 1)"


def _or_null(rule):
    return lambda value: None if value is None else rule(value)


_TEXT = _kind(str, what="a string")
_MAPPING = _kind(dict, what="a mapping")
_TRAINING = {"optimizer": _TEXT, "lr": _number(positive=True), "weight_decay": _number(),
             "clip_grad_norm": _or_null(_number(positive=True)), "lr_warmup": _int(0, MAX_STEP),
             "lr_schedule": _TEXT, "lr_min": _number(), "accumulate": _int(1, 10**6),
             "steps": _int(0, MAX_STEP), "eps": _number(positive=True), "betas": _betas,
             "dtype": _TEXT, "params": _TEXT, "compile": _or_null(_TEXT)}
_FIELDS = {"step": _int(0, MAX_STEP), "batches": _int(0, MAX_BATCHES),
           "iterations": _int(0, MAX_BATCHES), "world": _int(1, 10**6),
           "loss_scale": _number(positive=True), "seed": _int(-2**63, 2**64),
           "plan": _TEXT, "plan_sha256": _TEXT, "model": _or_null(_TEXT),
           "optimizer": _or_null(_MAPPING),
           "scheduler": _MAPPING, "sha256": _MAPPING, "training": _MAPPING,
           "history": _kind(list, what="a list"), "config": _or_null(_MAPPING)}


def check_record(path: Path, meta: dict, error=PlanError) -> None:
    """`error` (one line, naming `path` and the field) at the first field of `meta` (a
    checkpoint's record, already a mapping) that is not what pyplan writes there."""
    def bad(field: str, value, wants: str) -> None:
        raise error(f"{path} is damaged: {field} is {_show(value)}, not {wants}",
                    hint="resume from another checkpoint (or repair the field)")

    def fields(record: dict, rules: dict, prefix: str = "") -> None:
        for name, rule in rules.items():
            if name not in record:
                continue
            wants = rule(record[name])
            if wants is not None:
                bad(prefix + name, record[name], wants)

    if "step" not in meta:
        bad("step", None, "an integer")
    fields(meta, _FIELDS)
    fields(meta.get("training") or {}, _TRAINING, "training.")
    optimizer = meta.get("optimizer")
    if optimizer is not None:
        fields(optimizer, {"class": _TEXT, "hyper": _MAPPING}, "optimizer.")
        if "class" not in optimizer:
            bad("optimizer.class", None, "a string")
    for name, digest in (meta.get("sha256") or {}).items():
        if not isinstance(digest, str) or "/" in name or name in ("", ".", ".."):
            bad(f"sha256[{name!r}]", digest, "a hex digest of a file in the checkpoint")
    for i, segment in enumerate(meta.get("history") or []):
        if not isinstance(segment, dict):
            bad(f"history[{i}]", segment, "a mapping")
        fields(segment, {"step": _int(0, MAX_STEP), "batches": _int(0, MAX_BATCHES),
                         **_TRAINING}, f"history[{i}].")
        if "step" not in segment:
            bad(f"history[{i}].step", None, "an integer")


def _show(value) -> str:
    text = "null" if value is None else repr(value)
    kind = type(value).__name__ if value is not None else ""
    return (text if len(text) <= 40 else text[:37] + "...") + \
        (f" (a {kind.replace('dict', 'mapping').replace('str', 'string')})"
         if kind in ("list", "dict", "str") else "")
