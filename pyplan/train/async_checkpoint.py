"""`pyplan run --save DIR --async-save`: checkpoints written while training goes on
(torch.distributed.checkpoint.async_save; torchtitan's checkpoint.async_mode = "async").

A save copies this rank's state to host memory (DCP's staging: the next optimizer step cannot
change what is written), then DCP writes it from a thread, its collectives on a gloo group of
their own (as async_save requires on CUDA, and so that they never interleave with the
training's). The checkpoint is the synchronous one's (pyplan.train.checkpoint's begin and
finish): written under the temporary name, each rank hashing the parts it wrote where it
wrote them; the record and the rename come only once every rank's write is done, seen at a
step's end, so an interrupted save leaves the checkpoints before it as they were. At most one
save is in flight: the next waits for it, and so do the run's last step and a stop (a
signal, --max-time) before the run exits.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from pyplan.comm.devices import all_gather_objects
from pyplan.train import checkpoint

__all__ = ["AsyncCheckpoints"]


class AsyncCheckpoints:
    def __init__(self, timeout: timedelta) -> None:
        """Every rank, at the same point (it creates a process group)."""
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.pending: tuple[checkpoint.Pending, Future] | None = None
        self.started = 0.0
        self.seconds = 0.0
        """The longest save so far, from its start to when it was seen complete (at most a
        step late): what --max-time keeps free for the save at a stop, which is waited for."""

    def start(self, directory: str | Path, pipe, optimizer, **save) -> None:
        """checkpoint.save's arguments: wait for the save in flight, if any, then start this
        one, which returns once the state is copied."""
        self.wait(pipe)
        self.started = time.monotonic()
        pending = checkpoint.begin(directory, pipe, optimizer, **save)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (DCP's experimental-feature warnings)
            started = dcp.async_save(pending.state, storage_writer=pending.writer,
                                     process_group=self.group)
        self.pending = (pending, getattr(started, "upload_completion", started))

    def poll(self, pipe, *, wait: bool = False) -> Path | None:
        """Every rank: the save in flight completed (renamed into place) when every rank has
        written its part, or with `wait` in any case; its folder then, else None."""
        if self.pending is None:
            return None
        if wait or all(all_gather_objects(self.pending[1].done())):
            return self.wait(pipe)
        return None

    def wait(self, pipe) -> Path | None:
        """Every rank: wait for the save in flight and complete it; its folder (None when
        there was none). CheckpointError on every rank when a rank could not write."""
        if self.pending is None:
            return None
        pending, written = self.pending
        self.pending = None
        try:
            written.result()
            failure = None
        except (CheckpointException, Exception) as exc:  # (DCP's is a BaseException)
            failure = pending.cannot(exc)
        folder = checkpoint.finish(pending, pipe, failure)
        self.seconds = max(self.seconds, time.monotonic() - self.started)
        return folder
