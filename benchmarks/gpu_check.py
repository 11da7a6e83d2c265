"""Everything that needs a GPU, in one command that fits a lent GPU's minutes (issue 61).

    python benchmarks/gpu_check.py --out DIR [--wheels DIR] [--parts install,suite,...]
    python benchmarks/gpu_check.py --out DIR --cpu      # no GPU: the same parts, tiny models
    python benchmarks/gpu_check.py --fetch-wheels       # here, with a network: fill wheels/

writes DIR/report.json (rewritten after every part, so a run cut short still says what it
found) and DIR/gpu_check.log (every command and its output). Four parts, each a process of its
own under a time box, so that one that hangs or runs out of memory costs only its own box; a
part's box is its deadline from the start (what an earlier part left over goes to the next),
so the whole stays within the boxes' sum (7.5 minutes on a GPU):

1. install: a virtualenv over this Python's packages (its torch untouched), pyplan's
   dependencies from the wheels folder (--wheels, default wheels/ at the repository root,
   which --fetch-wheels fills for Python 3.12 on manylinux), then `pip install --no-deps
   --no-build-isolation .`; on the CPU a dry run that the folder resolves for that machine.
2. suite: the GPU tests (tests/test_gpu.py, tests/test_cuda_paths.py, tests/test_gpu_review.py)
   in one pytest process; their counts and what failed or skipped, and why.
3. partition: `pyplan partition --device cuda --dtype bf16 --split-backward` (the API it
   runs) of a Llama-style model of real width and a GPT-2-style one (gpu_check_models.py):
   each unit's measured forward, input- and weight-gradient time and activation bytes beside
   what `pyplan plan`'s cost model predicts for that unit on benchmarks/h200.yaml, and a
   profiled iteration's kernel time by part (GEMMs, attention, element-wise) against the
   model's parts.
4. run: `pyplan partition` (the command) of a smaller GPT-2-style model into two stages on one
   device, solved, then `pyplan run` on one GPU: --check with --profile (the blocks' ranges in
   the CUDA trace) and --async-save, --resume from its first checkpoint (the same losses),
   --compile inductor, --params bf16; each run's peak memory against the plan's and its time
   against the predicted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_common import (BOXES, CARRY_LIMIT, DEPENDENCIES, HERE, PARTS,
                             PLATFORMS, ROOT, TEST_TOOLS, Log, _write_json, run_command)


# ---------------------------------------------------------------- the parent: parts in turn

def child_env(args, python: str) -> dict:
    env = {**os.environ, "GPU_CHECK_SIZE": "cpu" if args.cpu else "gpu",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])
    env.pop("PYPLAN_DEVICE", None)
    return env


def check(args) -> dict:
    out = Path(args.out).resolve()
    (out / "parts").mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu_check.log", fresh=True)
    mode = "cpu" if args.cpu else "gpu"
    boxes = BOXES[mode]
    report = {"mode": mode, "python": sys.version.split()[0], "parts": {},
              "boxes_seconds": {p: boxes[p] for p in args.parts}}
    started = time.monotonic()
    python = sys.executable
    deadline = started
    for part in args.parts:
        deadline += boxes[part]
        left = deadline - time.monotonic()
        t0 = time.monotonic()
        result_path = out / "parts" / f"{part}.json"
        result_path.unlink(missing_ok=True)
        command = [python, __file__, "--part", part, "--out", out, "--wheels", args.wheels,
                   "--seconds", f"{left:.0f}"] + (["--cpu"] if args.cpu else [])
        done = run_command(command, log, left, env=child_env(args, python))
        if result_path.exists():  # (a part cut short leaves what it found so far)
            result = json.loads(result_path.read_text())
        elif done is None:
            result = {"status": "failed", "reason": f"timed out after its {left:.0f} s box"}
        else:
            tail = [line for line in (done.stdout or "").splitlines() if line.strip()]
            result = {"status": "failed", "reason": f"exit {done.returncode}: " +
                      (tail[-1] if tail else "no output")}
        result["seconds"] = round(time.monotonic() - t0, 1)
        report["parts"][part] = result
        if part == "install" and result["status"] == "passed" and result.get("python"):
            python = result["python"]  # the later parts run in the new virtualenv
        report["wall_seconds"] = round(time.monotonic() - started, 1)
        _write_json(out / "report.json", report)
        print(f"{part:10} {result['status']:8} {result['seconds']:6.1f} s  "
              f"{result.get('reason', '')}", flush=True)
    statuses = [r["status"] for r in report["parts"].values()]
    report["ok"] = "failed" not in statuses
    report["wall_seconds"] = round(time.monotonic() - started, 1)
    _write_json(out / "report.json", report)
    print(f"report: {out / 'report.json'} ({report['wall_seconds']} s); log: {log.path}")
    return report


# ---------------------------------------------------------------- wheels

def fetch_wheels(wheels: Path) -> int:
    """Here, with a network: pyplan's dependencies (not torch) as wheels for Python 3.12 on
    x86-64 manylinux, what the GPU machine lacks; pip picks the newest platform tag a package
    has of the three."""
    wheels.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--python-version", "3.12",
               "--only-binary=:all:", "--implementation", "cp", "-d", str(wheels)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    result = subprocess.run(command + list(DEPENDENCIES + TEST_TOOLS))
    if result.returncode:
        return result.returncode
    files = sorted(p for p in wheels.iterdir() if p.suffix == ".whl")
    total = sum(p.stat().st_size for p in files)
    for p in files:
        print(f"  {p.stat().st_size / 2**20:7.2f} MiB  {p.name}")
    print(f"{wheels}: {len(files)} wheels, {total / 2**20:.1f} MiB "
          f"({'within' if total <= CARRY_LIMIT else 'OVER'} the device tool's 64 MiB carry)")
    return 0 if total <= CARRY_LIMIT else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the folder of report.json and gpu_check.log")
    parser.add_argument("--cpu", action="store_true",
                        help="run on the CPU with tiny models (no GPU here): the same report")
    parser.add_argument("--wheels", default=str(ROOT / "wheels"),
                        help="the folder of the dependencies' wheels (default wheels/)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (default all)")
    parser.add_argument("--fetch-wheels", action="store_true",
                        help="download the wheels the GPU machine needs into --wheels")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # a child's part
    parser.add_argument("--seconds", type=float, default=60, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(Path(args.wheels))
    if not args.out:
        parser.error("--out DIR is required")
    if args.part:
        import gpu_check_parts

        out = Path(args.out)
        try:
            result = gpu_check_parts.PARTS[args.part](args, out)
        except Exception as exc:  # a part's own failure, said in one line  # noqa: BLE001
            import traceback

            traceback.print_exc()
            result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:500]}
        _write_json(out / "parts" / f"{args.part}.json", result)
        return 0
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)} (of {', '.join(PARTS)})")
    if not args.cpu:
        probe = subprocess.run([sys.executable, "-c", "import torch; print(int("
                                "torch.cuda.is_available()))"], capture_output=True, text=True)
        if probe.stdout.strip() != "1":
            parser.error("torch sees no GPU here: give --cpu to run what the CPU can")
    return 0 if check(args)["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main())
