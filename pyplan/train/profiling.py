"""`pyplan run --profile DIR [--profile-steps N,...]`: torch.profiler around chosen optimizer
steps (default: the run's last, as --trace), one Chrome trace per rank and step,
`DIR/rank{R}-step{S}.json` (chrome://tracing, Perfetto, TensorBoard's profiler plugin), CUDA
kernels too on a GPU. The engine names every block instance (`stage0@3`, `stage0.b@3` for a
split backward's B, `.w` its W) and transfer as a record_function range (pyplan.run.executor),
so the trace shows the schedule as it ran. Each file is written beside its final name and
renamed into place, so a run stopped while one is written leaves none half-written.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch

from pyplan.errors import PlanError, RunError

__all__ = ["StepProfiler", "trace_name"]


def trace_name(rank: int, step: int) -> str:
    """The file of `rank`'s trace of step `step` (1-based, as the log names steps)."""
    return f"rank{rank}-step{step}.json"


class StepProfiler:
    def __init__(self, folder: str | Path, steps: tuple[int, ...] | None, first: int,
                 last: int, rank: int, device: torch.device) -> None:
        """Profile `steps` (None: `last`) of the run's steps `first` .. `last` on this rank,
        into `folder`; PlanError for a step the run does not train (a resumed run's are known
        only now)."""
        outside = [s for s in steps or () if not first <= s <= last]
        if outside:
            raise PlanError(f"--profile-steps: step {outside[0]} is never profiled: the run "
                            f"trains steps {first} to {last}",
                            hint=f"give steps from {first} to {last}")
        self.folder, self.rank = Path(folder), rank
        self.steps = frozenset(steps) if steps else frozenset({last})
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)

    @contextlib.contextmanager
    def step(self, step: int):
        """A context around step `step` (1-based), which profiles it when chosen."""
        if step not in self.steps:
            yield
            return
        with torch.profiler.profile(activities=self.activities) as profile:
            yield
        self.write(profile, self.folder / trace_name(self.rank, step))

    def write(self, profile, path: Path) -> None:
        """The Chrome trace to a hidden file beside `path`, flushed, then renamed over it."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
        except OSError as exc:
            raise RunError(f"--profile {self.folder}: cannot write {path.name}: "
                           f"{exc.strerror or exc}") from None
        try:
            profile.export_chrome_trace(tmp)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise RunError(f"--profile {self.folder}: cannot write {path.name}: "
                           f"{exc.strerror or exc}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
