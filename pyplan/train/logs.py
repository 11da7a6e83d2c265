"""What rank 0 says while `pyplan run` trains, as it happens: a line per step on stdout (unless
--json), a JSON object per line in `--log FILE` (appended, flushed per line, so a crash loses
nothing logged before it) and, with `--tensorboard DIR`, scalars through
torch.utils.tensorboard's SummaryWriter."""

from __future__ import annotations

import json
import math
import sys

from pyplan.errors import PlanError
from pyplan.files import write_atomic

__all__ = ["Log", "summary_writer", "tensorboard_writer"]


def summary_writer():
    """torch.utils.tensorboard's SummaryWriter class, or a PlanError saying what to install
    (`pyplan run --tensorboard` asks before it starts any worker)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise PlanError("--tensorboard needs the tensorboard package, which is not installed",
                        hint="pip install tensorboard, or log JSON lines with --log FILE") \
            from None
    return SummaryWriter


def tensorboard_writer(directory: str):
    """torch.utils.tensorboard's SummaryWriter on `directory`, or a PlanError saying what to
    install."""
    return summary_writer()(directory)


class Log:
    def __init__(self, *, lines: bool, path: str | None, tensorboard: str | None,
                 after: int = 0) -> None:
        """`after`: the step a resumed run starts after; what an earlier run logged past it
        (it went on beyond its last checkpoint) is dropped, so no step is logged twice."""
        self.lines = lines
        if path and after is not None:
            _drop_after(path, after)
        self.file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        self.board = summary_writer()(tensorboard, purge_step=after + 1) \
            if tensorboard else None

    def say(self, text: str) -> None:
        if self.lines:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def step(self, record: dict, line: str) -> None:
        """One optimizer step: `record` has step, loss, lr, seconds and the optional
        grad_norm, samples_per_second, tokens_per_second, peak_activation_bytes,
        cuda_max_allocated."""
        self._write(record)  # first: whoever reads the line finds the record already there
        self.say(line)
        if self.board is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_second", "samples_per_second"):
                if record.get(key) is not None:
                    self.board.add_scalar(f"train/{key}", record[key], record["step"])
            self.board.flush()

    def evaluation(self, step: int, loss: float, line: str) -> None:
        self._write({"step": step, "eval_loss": loss})
        self.say(line)
        if self.board is not None:
            self.board.add_scalar("eval/loss", loss, step)
            self.board.flush()

    def _write(self, record: dict) -> None:
        if self.file is not None:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                     for k, v in record.items()}
            self.file.write(json.dumps(clean, sort_keys=True) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()


def _drop_after(path: str, step: int) -> None:
    """Rewrite the JSON lines at `path` without the records of steps after `step` (atomically;
    nothing to do when there are none). A line that is not JSON (a crash mid-write) goes too."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and \
                record["step"] > step:
            continue
        kept.append(line)
    if kept != lines:
        write_atomic(path, "".join(x + "\n" for x in kept).encode())
