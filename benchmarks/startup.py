"""`pyplan run` start-up, side by side: `pyplan run PLAN --nproc-per-node D`, whose workers are
forked from a forkserver that has imported torch and pyplan's runtime once, vs
`torchrun --nproc-per-node D --no-python pyplan run PLAN`, which starts every worker as a new
interpreter (as `pyplan run` itself did before). The plan is the example V-shape on 4 ranks,
one iteration (a few hundred ms of the whole).

    python benchmarks/startup.py [--rounds 5]

Each round runs both commands one after the other (in reverse order on odd rounds); printed:
the median over rounds of each one's CPU time (getrusage of the finished processes: the
launcher, the forkserver and every worker, whatever else the machine runs) and wall time, and
the median, minimum and maximum of the ratio within a round.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "plans" / "transformer-vshape.resolved.yaml"
PYPLAN = str(Path(sys.executable).with_name("pyplan"))
COMMANDS = {
    "pyplan run --nproc-per-node 4": [PYPLAN, "run", str(PLAN), "--nproc-per-node", "4"],
    "torchrun --no-python pyplan run": [sys.executable, "-m", "torch.distributed.run",
                                        "--standalone", "--nproc-per-node", "4", "--no-python",
                                        PYPLAN, "run", str(PLAN)],
}


def measure(command: list[str], folder: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one run of `command` and every process it started."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, cwd=folder)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in COMMANDS}
    with tempfile.TemporaryDirectory() as folder:  # outside the source tree
        for round_ in range(args.rounds):
            order = list(COMMANDS) if round_ % 2 == 0 else list(reversed(COMMANDS))
            for name in order:
                found[name].append(measure(COMMANDS[name], folder))
    print(f"pyplan run start-up: {PLAN.name}, 1 iteration on 4 ranks, median of {args.rounds} "
          f"rounds (load average {os.getloadavg()[0]:.1f} at the end)")
    for name, runs in found.items():
        print(f"  {name:34s} CPU {statistics.median(c for c, _ in runs):5.2f} s   "
              f"wall {statistics.median(w for _, w in runs):5.2f} s")
    fast, slow = found.values()
    for i, label in ((0, "CPU"), (1, "wall")):
        ratios = [s[i] / f[i] for f, s in zip(fast, slow)]
        print(f"  {label} torchrun / forkserver: {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
