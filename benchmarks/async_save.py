"""What a checkpoint every step costs the training loop, with `pyplan run --async-save`
(torch.distributed.checkpoint.async_save: the state copied to host memory, written from a
thread while the next steps run) vs the synchronous save, on 2 CPU gloo ranks:

    python benchmarks/async_save.py [--rounds 3] [--steps 6] [--width 1024] [--rows 512]

Three runs of the same plan per round, in turn (reversed on odd rounds): without --save,
with `--save DIR --save-every 1`, and with `--async-save` added. The model is a chain of
`width` x `width` Linear layers, 4 per stage, trained with AdamW (a checkpoint holds the
parameters and two moments: 2 x 4 x 3 x width^2 x 4 bytes, 100 MB at width 1024). A run's
time is the wall time of its training loop (the sum of its logged steps' times plus the gaps
between them: from the first step's start to the last's end, read from --log's timestamps);
each save mode's cost is its excess over the run without saves, per step. Prints each round's
figures and the median ratio async/sync of that cost (below 1: the asynchronous save costs the
loop less).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PYPLAN = str(Path(sys.executable).with_name("pyplan"))

MODEL = '''\
import os

import torch
from torch import nn

WIDTH = int(os.environ["BENCH_WIDTH"])
ROWS = int(os.environ["BENCH_ROWS"])


def model():
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)])


def batch(step, split="train"):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS, WIDTH, generator=generator)
    return x, x.tanh()


def loss(out, y):
    return torch.nn.functional.mse_loss(out, y)
'''

PLAN = """\
pyplan: 1
name: wide
devices: 2
micro_batches: 4
training: {backward: {time_ratio: 2}}
blocks:
  - {name: stage0, devices: [0], time: 1, memory: 1}
  - {name: stage1, devices: [1], time: 1, memory: 1}
model:
  module: wide:model
  stages:
    stage0: ["0", "1", "2", "3"]
    stage1: ["4", "5", "6", "7"]
  data: wide:batch
  loss: wide:loss
"""


def loop_seconds(folder: Path, mode: str, steps: int, env: dict) -> float:
    """The wall time of one run's training loop, from its --log (each entry's time is written
    as the step ends; the first step's own time is added back)."""
    log = folder / f"{mode}.jsonl"
    log.unlink(missing_ok=True)
    extra = {"none": [], "sync": ["--save", "ck-sync", "--save-every", "1", "--overwrite"],
             "async": ["--save", "ck-async", "--save-every", "1", "--overwrite",
                       "--async-save"]}[mode]
    for name in ("ck-sync", "ck-async"):
        shutil.rmtree(folder / name, ignore_errors=True)
    stamps = []
    with subprocess.Popen([PYPLAN, "run", "wide.resolved.yaml", "--nproc-per-node", "2",
                           "--device", "cpu", "--optimizer", "adamw", "--iterations",
                           str(steps), "--log", str(log), *extra], cwd=folder, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True) as process:
        seen = 0
        while process.poll() is None:  # each step's end, as its line is appended
            lines = log.read_text().splitlines() if log.exists() else []
            for line in lines[seen:]:
                entry = json.loads(line)
                if "loss" in entry:
                    stamps.append((time.perf_counter(), entry["seconds"]))
            seen = len(lines)
            time.sleep(0.02)  # (the ranks' cores are the benchmark's)
        err = process.stderr.read()
    if process.returncode != 0:
        raise SystemExit(f"{mode}: pyplan run failed:\n{err[-2000:]}")
    lines = log.read_text().splitlines()
    for line in lines[seen:]:
        entry = json.loads(line)
        if "loss" in entry:
            stamps.append((time.perf_counter(), entry["seconds"]))
    if len(stamps) != steps:
        raise SystemExit(f"{mode}: {len(stamps)} steps logged, not {steps}")
    # The last step's save (waited for in both modes) ends the run: not the loop's.
    return stamps[-1][0] - stamps[0][0] + stamps[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=512, help="a batch's rows (its compute)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="pyplan-async-save-"))
    try:
        (folder / "wide.py").write_text(MODEL)
        (folder / "wide.yaml").write_text(PLAN)
        subprocess.run([PYPLAN, "solve", "wide.yaml", "--quiet"], cwd=folder, check=True)
        env = {**os.environ, "BENCH_WIDTH": str(args.width), "BENCH_ROWS": str(args.rows)}
        megabytes = 2 * 4 * 3 * args.width ** 2 * 4 / 1e6
        print(f"2 CPU gloo ranks, {args.steps} steps, a checkpoint of {megabytes:.0f} MB "
              f"every step, {args.rounds} rounds")
        ratios = []
        for round_ in range(args.rounds):
            modes = ["none", "sync", "async"]
            if round_ % 2:
                modes.reverse()
            seconds = {mode: loop_seconds(folder, mode, args.steps, env) for mode in modes}
            # Each save mode's cost per step: its loop's time beyond the loop without saves,
            # over the steps whose saves fall inside the loop (all but the last).
            cost = {m: (seconds[m] - seconds["none"]) / (args.steps - 1)
                    for m in ("sync", "async")}
            ratio = cost["async"] / cost["sync"] if cost["sync"] > 0 else float("nan")
            ratios.append(ratio)
            print(f"round {round_}: loop {seconds['none']:.2f} s without saves, "
                  f"{seconds['sync']:.2f} s sync, {seconds['async']:.2f} s async; cost per "
                  f"step: sync {cost['sync'] * 1e3:.0f} ms, async {cost['async'] * 1e3:.0f} ms"
                  f" (async/sync {ratio:.2f})")
        print(f"async/sync save cost per step: median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
