"""Meshes on torch's libraries against the hand-written code they replaced, side by side in one
run on 4 CPU ranks (gloo): the same Llama (from transformers, 8 layers of width 256), partitioned
into 2 stages, with 2 data-parallel ranks per stage.

1. Peak memory per rank (the run's census of live tensor bytes) with the parameters, gradients
   and AdamW's state sharded over the 2 data ranks: the hand-written ZeRO (`mesh.shard`, pyplan
   at commit OLD, run from a git worktree of it) against FSDP2 (`fully_shard`, this checkout).
2. Data 2 x PP 2 (gradients all-reduced): the iteration's median time and the time the ranks
   spend in the SYNC instructions (from `--trace`), hand-written all-reduce against FSDP2.
3. `--check` (single-process training, AdamW, clipping, accumulation) of every layout:
   TP 2 x PP 2 (sequence-parallel), FSDP 2 x PP 2, data 2 x PP 2, HSDP 2 x 2 and TP 2 x
   FSDP 2.
4. TP 2 x PP 2 with sequence parallelism (`mesh: {tensor: 2}`) against without it
   (`sequence: false`): each one's `--check` and peak memory per rank (the census's live
   tensor bytes, the iteration's activations on top of the weights: sequence parallelism
   holds the norms' and residuals' in slices).

    python benchmarks/meshes.py [--iterations 8] [--old REV] [--only sequence]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD = "ca094a5"  # the last commit with the hand-written all-reduce and ZeRO
PYTHON = sys.executable
TRAIN = ("--optimizer", "adamw", "--device", "cpu")

MODEL = '''\
import sys
sys.path.insert(0, {tests!r})
import hf


def llama():
    return hf.build("llama", num_hidden_layers=8, hidden_size=256, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=32, intermediate_size=1024,
                    vocab_size=4096)


def batch(step):
    return hf.tokens(4096, 64, 16)


loss = hf.loss
'''


# An editable install of this checkout answers `import pyplan` before PYTHONPATH does; the
# earlier commit's interpreters (the launcher, its fork server, the workers) drop its finder.
SITECUSTOMIZE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if not type(f).__module__.startswith("_editable_skbc")]
"""


def pyplan(*args, cwd, source: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m pyplan` of the source tree `source` (a checkout's pyplan/ borrows the
    installed compiled core), in `cwd`."""
    path = f"{cwd}" if source == ROOT else f"{source}:{source / '.benchmark-site'}:{cwd}"
    done = subprocess.run([PYTHON, "-m", "pyplan", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=900,
                          env={**os.environ, "PYTHONPATH": path})
    if done.returncode != 0:
        raise SystemExit(f"pyplan {' '.join(map(str, args))} failed:\n{done.stderr[-3000:]}")
    return done


def meshed(folder: Path, mesh: str, name: str, source: Path = ROOT, plan: str = "llama"
           ) -> str:
    text = (folder / f"{plan}.yaml").read_text()
    if source != ROOT:  # (model.optimizer came later than the old commit: run's flag says it)
        text = "".join(line for line in text.splitlines(keepends=True)
                       if not line.startswith("  optimizer: "))
    text = "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith("mesh:"))  # (a tensor plan's own: replaced)
    (folder / f"{name}.yaml").write_text(text.replace("\ntraining:", f"\nmesh: {mesh}\ntraining:"))
    pyplan("solve", f"{name}.yaml", "--quiet", cwd=folder, source=source)
    return f"{name}.resolved.yaml"


def report(folder: Path, resolved: str, iterations: int, *extra, source: Path = ROOT) -> dict:
    done = pyplan("run", resolved, "--nproc-per-node", 4, "--iterations", iterations, "--json",
                  *TRAIN, *extra, cwd=folder, source=source)
    return json.loads(done.stdout.strip().splitlines()[-1])


def sync_seconds(trace: Path) -> float:
    """Seconds the ranks spend in SYNC instructions, per rank and iteration (the last
    iteration's trace)."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = [e["dur"] / 1e6 for e in events if e.get("ph") == "X" and
             str(e.get("name", "")).startswith("sync")]
    ranks = {e.get("pid") for e in events if e.get("ph") == "X"}
    return sum(spans) / max(len(ranks), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--old", default=OLD, help=f"the hand-written code's commit ({OLD})")
    parser.add_argument("--only", choices=("all", "sequence"), default="all",
                        help="sequence: part 4 alone (no worktree of the old commit)")
    args = parser.parse_args(argv)
    if args.only == "sequence":
        with tempfile.TemporaryDirectory(prefix="pyplan-meshes-") as tmp:
            folder = Path(tmp)
            _partitioned(folder)
            sequence(folder)
        return 0
    with tempfile.TemporaryDirectory(prefix="pyplan-meshes-") as tmp:
        folder, old = Path(tmp) / "work", Path(tmp) / "old"
        folder.mkdir()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old),
                        args.old], check=True, capture_output=True)
        (old / ".benchmark-site").mkdir()
        (old / ".benchmark-site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        from pyplan import _core  # the compiled core (csrc/ is the same at both commits)
        shutil.copy(_core.__file__, old / "pyplan")
        try:
            _partitioned(folder)
            compare(folder, old, args.iterations)
            checks(folder)
            sequence(folder)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                           capture_output=True)
    return 0


def _partitioned(folder: Path) -> None:
    """The Llama in 2 stages (llama.yaml) and, priced per tensor rank of 2 (`--tensor 2`:
    mesh.priced), llama-tp.yaml."""
    (folder / "model.py").write_text(MODEL.format(tests=str(ROOT / "tests" / "models")))
    for name, extra in (("llama", ()), ("llama-tp", ("--tensor", 2))):
        pyplan("partition", "model:llama", "--data", "model:batch", "--loss", "model:loss",
               "--devices", 2, "--repeats", 1, "--optimizer", "adamw", *extra,
               "-o", f"{name}.yaml", cwd=folder)


def _check_line(got: dict) -> str:
    return f"{'ok' if got['check']['ok'] else 'FAILED'}: {got['check']['message']}"


def sequence(folder: Path) -> None:
    print("4. TP 2 x PP 2, with and without sequence parallelism: --check (AdamW, clipping 0.5, "
          "accumulate 2, 3 steps) and peak per rank, MiB (live tensor bytes, the census)")
    peaks = {}
    # (The same stages both ways: llama-tp's, its costs priced with sequence parallelism.)
    for label, mesh in (("sequence-parallel", "{tensor: 2, priced: 2}"),
                        ("without", "{tensor: 2, priced: 2, sequence: false}")):
        name = "sp-" + "".join(c for c in mesh if c.isalnum())
        got = report(folder, meshed(folder, mesh, name, plan="llama-tp"), 3, "--check",
                     "--lr", "0.003", "--clip-grad-norm", "0.5", "--accumulate", "2")
        peaks[label] = [r["peak_bytes"] / 2**20 for r in got["rank_memory"]]
        print(f"   {label:<18} " + "  ".join(f"{x:7.1f}" for x in peaks[label]) +
              f"  |  {_check_line(got)}")
    a, b = peaks.values()
    print(f"   sequence-parallel / without, the largest rank: {max(a) / max(b):.2f}x; "
          f"rank by rank: " + " ".join(f"{x / y:.2f}x" for x, y in zip(a, b)))


def compare(folder: Path, old: Path, iterations: int) -> None:
    print("1. parameters, gradients and AdamW's state sharded over 2 data ranks, 2 stages: "
          "peak per rank, MiB: live tensor bytes (the census) | the process's max RSS")
    rows, rss = {}, {}
    for label, source in (("hand-written ZeRO", old), ("FSDP2", ROOT)):
        resolved = meshed(folder, "{data: 2, shard: true}", f"shard-{source.name}", source)
        ranks = report(folder, resolved, 3, source=source)["rank_memory"]
        rows[label] = [r["peak_bytes"] / 2**20 for r in ranks]
        rss[label] = [r["max_rss_bytes"] / 2**20 for r in ranks]
        print(f"   {label:<18} " + "  ".join(f"{x:7.1f}" for x in rows[label]) + "  |  " +
              "  ".join(f"{x:7.1f}" for x in rss[label]))
    for what, table in (("census", rows), ("max RSS", rss)):
        print(f"   FSDP2 / hand-written, the largest rank's {what}: "
              f"{max(table['FSDP2']) / max(table['hand-written ZeRO']):.2f}x")
    print("2. data 2 x PP 2, gradients all-reduced: iteration (median, s) and time in SYNC "
          "instructions per rank and iteration (s)")
    medians = {}
    for label, source in (("hand-written all-reduce", old), ("FSDP2 (HSDP, 1 shard)", ROOT)):
        resolved = meshed(folder, "{data: 2, sync: 3}", f"dp-{source.name}", source)
        trace = folder / f"trace-{source.name}.json"
        got = report(folder, resolved, iterations, "--trace", trace, source=source)
        times = got["iteration_seconds"][1:] or got["iteration_seconds"]
        medians[label] = statistics.median(times)
        print(f"   {label:<24} iteration {medians[label]:.4f}  sync {sync_seconds(trace):.4f}")
    a, b = medians.values()
    print(f"   FSDP2 / hand-written iteration: {b / a:.2f}x")


def checks(folder: Path) -> None:
    print("3. --check against single-process training (AdamW, clipping 0.5, accumulate 2, 3 "
          "steps)")
    for name, extra in (("one", ()), ("one-tp", ("--tensor", 2))):
        pyplan("partition", "model:llama", "--data", "model:batch", "--loss", "model:loss",
               "--devices", 1, "--repeats", 1, "--optimizer", "adamw", *extra,
               "-o", f"{name}.yaml", cwd=folder)
    for plan, mesh in (("llama-tp", "{tensor: 2, priced: 2}"), ("llama", "{data: 2, shard: true}"),
                       ("llama", "{data: 2}"), ("one", "{data: 2, shard: 2}"),
                       ("one-tp", "{tensor: 2, priced: 2, data: 2, shard: true}")):
        name = f"check-{plan}-" + "".join(c for c in mesh if c.isalnum())
        resolved = meshed(folder, mesh, name, plan=plan)
        got = report(folder, resolved, 3, "--check", "--lr", "0.003", "--clip-grad-norm",
                     "0.5", "--accumulate", "2")
        layout = ("PP 2 x " if plan.startswith("llama") else "PP 1 x ") + mesh
        print(f"   {layout:<42} {_check_line(got)}")


if __name__ == "__main__":
    if shutil.which("git") is None:
        raise SystemExit("benchmarks/meshes.py needs git (it runs the hand-written code from a "
                         "worktree of an earlier commit)")
    raise SystemExit(main())
