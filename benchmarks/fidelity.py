"""What runs is what was planned: Pfeife's cost-model protocol (its Table 5: predicted beside
measured, each setting run side by side) for pyplan. Each model is partitioned, solved and run
on 2 ranks (a core each: no oversubscription) as a user would (`pyplan partition`, `solve`,
`run --json`); printed per plan: the predicted and the measured iteration (median of the timed
iterations) and their ratio, and per rank the plan's and the measured peak memory (the run's
census of live tensor bytes) and static memory (parameters, gradients, optimizer state).

    python benchmarks/fidelity.py [--iterations 12] [--only NAME]

Models (benchmarks/fidelity_models.py): an MLP of uneven layers, Hugging Face GPT-2 (tied
embeddings) and Llama as they come (cut in their own forward), each as planned and with
`--recompute always`, and the MLP with a split backward (zero bubble).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
                                          "--optimizer", "adam"], ["--optimizer", "adamw"]),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--only", choices=sorted(CASES), action="append")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"2 ranks on {os.cpu_count()} cores, load average {load:.1f}"
          + (" (busy: times will be long)" if load > 0.5 else ""))
    print(f"{'plan':16} {'predicted':>10} {'measured':>10} {'ratio':>6}   memory per rank: "
          "measured / planned peak (ratio), static")
    worst_time, worst_memory = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or CASES:
            report = case(name, args.iterations, Path(tmp))
            predicted, measured = report["predicted_seconds"], report["median_seconds"]
            ratio = measured / predicted
            worst_time.append(ratio)
            memory = []
            for rank in report["rank_memory"]:
                share = rank["peak_bytes"] / rank["planned_peak_bytes"]
                worst_memory.append(share)
                memory.append(f"{rank['peak_bytes'] / 2**20:.1f} / "
                              f"{rank['planned_peak_bytes'] / 2**20:.1f} MiB ({share:.2f}), "
                              f"{rank['static_bytes'] / 2**20:.1f} / "
                              f"{rank['planned_static_bytes'] / 2**20:.1f}")
            print(f"{name:16} {predicted * 1e3:8.1f} ms {measured * 1e3:8.1f} ms {ratio:6.2f}   "
                  + "   ".join(memory), flush=True)
    print(f"time measured / predicted: median {statistics.median(worst_time):.2f}, range "
          f"{min(worst_time):.2f}-{max(worst_time):.2f}; peak memory measured / planned: "
          f"median {statistics.median(worst_memory):.2f}, range {min(worst_memory):.2f}-"
          f"{max(worst_memory):.2f}")


if __name__ == "__main__":
    main()
