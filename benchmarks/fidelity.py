"""What runs is what was planned: Pfeife's cost-model protocol (its Table 5: predicted beside
measured, each setting run side by side) for pyplan. Each model is partitioned, solved and run
on 2 ranks (a core each: no oversubscription) as a user would (`pyplan partition`, `solve`,
`run --json`); printed per plan: the predicted and the measured iteration (median of the timed
iterations) and their ratio, and per rank the measured / planned peak memory (the run's census
of live tensor bytes), the same for what lies beyond the static memory (activations, their
gradients and temporaries: "live") and whether the static memory (parameters, gradients,
optimizer state) is exact; then the worst ratios of the models pyplan was tuned on ("seen")
and of the others ("unseen").

    python benchmarks/fidelity.py [--iterations 12] [--only NAME] [--seed 2026] [--unseen 8]

Seen models (benchmarks/fidelity_models.py): an MLP of uneven layers, Hugging Face GPT-2 (tied
embeddings) and Llama as they come (cut in their own forward), each as planned and with
`--recompute always`, and the MLP with a split backward (zero bubble). Unseen: `--unseen`
models drawn from `--seed` (plain MLPs of 4-16 layers of widths 64-2,048 with GELU, ReLU, SiLU
or Tanh, a residual MLP, a Llama; each with recompute never, always or auto drawn too). The
seed is fixed so runs compare; nothing is tuned to it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PYPLAN = str(Path(sys.executable).with_name("pyplan"))

CASES = {  # name: (factory, partition options, run options)
    "mlp": ("fidelity_models:mlp", ["--data", "fidelity_models:mlp_batch"], []),
    "mlp-recompute": ("fidelity_models:mlp", ["--data", "fidelity_models:mlp_batch",
                                              "--recompute", "always"], []),
    "mlp-adamw": ("fidelity_models:mlp", ["--data", "fidelity_models:mlp_batch",
                                          "--optimizer", "adamw"], ["--optimizer", "adamw"]),
    "mlp-split": ("fidelity_models:mlp", ["--data", "fidelity_models:mlp_batch",
                                          "--split-backward"], []),
    "gpt2": ("fidelity_models:gpt2", [], []),
    "gpt2-recompute": ("fidelity_models:gpt2", ["--recompute", "always"], []),
    "llama": ("fidelity_models:llama", [], []),
    "llama-recompute": ("fidelity_models:llama", ["--recompute", "always"], []),
}


def run(*args, cwd) -> subprocess.CompletedProcess:
    done = subprocess.run([PYPLAN, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise SystemExit(f"pyplan {' '.join(map(str, args))} failed:\n{done.stderr[-3000:]}")
    return done


def case(name: str, iterations: int, folder: Path) -> dict:
    factory, partition, options = CASES[name]
    module = factory.partition(":")[0]
    data = [] if "--data" in partition else ["--data", f"{module}:batch"]
    run("partition", factory, *data, "--loss", f"{module}:loss", "--devices", 2,
        "--micro-batches", 8, *partition, "-o", f"{name}.yaml", cwd=folder)
    run("solve", f"{name}.yaml", "--quiet", cwd=folder)
    done = run("run", f"{name}.resolved.yaml", "--nproc-per-node", 2, "--iterations",
               iterations, "--json", *options, cwd=folder)
    return json.loads(done.stdout.strip().splitlines()[-1])


def off(ratio: float) -> float:
    """How far a ratio is from 1, either way (0.8 and 1.25 are as far)."""
    return abs(math.log(ratio))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--seed", type=int, default=2026, help="draws the unseen models")
    parser.add_argument("--unseen", type=int, default=8, help="unseen models (at least 2)")
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="run only these plans (seen names, or unseen-I)")
    args = parser.parse_args()
    os.environ.update(FIDELITY_SEED=str(args.seed), FIDELITY_UNSEEN=str(args.unseen))
    sys.path.insert(0, str(ROOT))
    import fidelity_models

    seen = list(CASES)
    unseen = []
    for i in range(max(args.unseen, 2)):
        spec = fidelity_models.drawn(i, max(args.unseen, 2))
        name = f"unseen-{i}"
        CASES[name] = (f"fidelity_models:drawn_model_{i}",
                       ["--data", f"fidelity_models:drawn_batch_{i}", "--recompute",
                        spec["recompute"]], [])
        unseen.append(name)
        print(f"{name}: {fidelity_models.describe(spec)}, recompute {spec['recompute']}")
    chosen = args.only or seen + unseen
    unknown = [n for n in chosen if n not in CASES]
    if unknown:
        parser.error(f"--only: no plan {unknown[0]} (plans: {', '.join(CASES)})")
    print(f"2 ranks on {os.cpu_count()} cores, seed {args.seed}; load average (1 min) before "
          "each plan in [ ]")
    print(f"{'plan':16} {'predicted':>10} {'measured':>10} {'ratio':>6}   per rank: peak "
          "measured / planned (ratio), live ratio, static")
    worst: dict[str, dict[str, tuple[float, str]]] = {"seen": {}, "unseen": {}}

    def note(group: str, what: str, ratio: float, name: str) -> None:
        if what not in worst[group] or off(ratio) > off(worst[group][what][0]):
            worst[group][what] = (ratio, name)

    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            load = os.getloadavg()[0]
            report = case(name, args.iterations, Path(tmp))
            group = "unseen" if name in unseen else "seen"
            predicted, measured = report["predicted_seconds"], report["median_seconds"]
            ratio = measured / predicted
            note(group, "time", ratio, name)
            memory = []
            for rank in report["rank_memory"]:
                peak = rank["peak_bytes"] / rank["planned_peak_bytes"]
                live = (rank["peak_bytes"] - rank["static_bytes"]) / max(
                    rank["planned_peak_bytes"] - rank["planned_static_bytes"], 1)
                note(group, "peak memory", peak, name)
                note(group, "live memory", live, name)
                static = "exact" if rank["static_bytes"] == rank["planned_static_bytes"] else \
                    f"{rank['static_bytes'] / rank['planned_static_bytes']:.3f}"
                memory.append(f"{rank['peak_bytes'] / 2**20:.1f} / "
                              f"{rank['planned_peak_bytes'] / 2**20:.1f} MiB ({peak:.2f}), "
                              f"live {live:.2f}, static {static}")
            print(f"{name:16} {predicted * 1e3:8.1f} ms {measured * 1e3:8.1f} ms {ratio:6.2f}   "
                  + "   ".join(memory) + f"  [{load:.1f}]", flush=True)
    for group, found in worst.items():
        if found:
            print(f"worst, {group}: " + "; ".join(f"{what} {ratio:.2f} ({name})"
                                                 for what, (ratio, name) in found.items()))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
