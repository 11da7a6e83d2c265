"""What benchmarks/gpu_check.py and its parts (gpu_check_parts.py) share: the folders, the
parts' time boxes, what the install carries, the log, the report's atomic write and a command
run under a time box."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
PARTS = ("install", "suite", "partition", "run")
# Seconds each part may take (its deadline counts from the start: what an earlier part leaves
# over goes to the later ones, and the whole stays within the sum).
BOXES = {"gpu": {"install": 80, "suite": 140, "partition": 90, "run": 140},
         # on the CPU the work is under a minute of CPU time; the boxes leave room for a
         # machine shared with other work (5x slower at a load of 10 on 2 cores)
         "cpu": {"install": 60, "suite": 120, "partition": 180, "run": 300}}
DEPENDENCIES = ("pyyaml", "jsonschema", "z3-solver", "rich")  # pyproject's, besides torch
TEST_TOOLS = ("pytest-xdist",)  # the suite's workers, GPU tests side by side on the one GPU
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
GPU_TESTS = ("tests/test_gpu.py", "tests/test_cuda_paths.py", "tests/test_gpu_review.py")
CARRY_LIMIT = 64 * 2**20  # what the device tool carries of ignored paths


class Log:
    """DIR/gpu_check.log: what ran, with its output, as it happened."""

    def __init__(self, path: Path, fresh: bool = False):
        self.path = path
        if fresh:
            path.write_text("")

    def write(self, text: str) -> None:
        with self.path.open("a") as f:
            f.write(text if text.endswith("\n") else text + "\n")


def _write_json(path: Path, data) -> None:
    """Atomically: a reader never sees half a report."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:  # every process of it has ended
        pass


def run_command(command: list[str], log: Log, timeout: float, *, env=None, cwd=ROOT,
                grace: float = 0.0) -> subprocess.CompletedProcess | None:
    """`command` in a session of its own, killed with all its children past `timeout`
    seconds (None then; with `grace`, interrupted that many seconds before, as Ctrl-C would:
    pytest then still writes its report); its output goes to the log."""
    log.write(f"$ {' '.join(map(str, command))}   (timeout {timeout:.0f} s)")
    started = time.monotonic()
    process = subprocess.Popen([str(c) for c in command], cwd=cwd, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        out, _ = process.communicate(timeout=max(timeout - grace, 1))
    except subprocess.TimeoutExpired:
        out = None
        if grace:
            _signal_group(process.pid, signal.SIGINT)
            try:
                out, _ = process.communicate(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(process.pid, signal.SIGKILL)  # (what an interrupt left running too)
        if out is None:
            out, _ = process.communicate()
        log.write(out or "")
        log.write(f"# killed after {time.monotonic() - started:.1f} s (time box)")
        return None
    log.write(out or "")
    log.write(f"# exit {process.returncode} after {time.monotonic() - started:.1f} s")
    return subprocess.CompletedProcess(command, process.returncode, out, "")
