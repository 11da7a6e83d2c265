"""Models at their real size: per-rank host memory and start-up of `pyplan run`, and
`pyplan partition`'s, against the whole model's size, for a Hugging Face Llama of a few GB on 4
ranks, built as pyplan builds it (each rank materialises its own stages: "stages") and as it
was built before (every process builds the whole model, $PYPLAN_BUILD=whole: "whole").

    python benchmarks/real_size.py [--layers 8] [--hidden 2048] [--only stages]

Printed per way of building: the model's size, partition's max RSS and wall time, and per
rank of one training step (SGD) its max RSS beside the host memory partition planned for it
(its tensors at their peak and what a process holds before the model) and the seconds it took
to build its stages. Partition is given the host memory of 4 ranks that each may hold half
the model (its share of parameters and gradients, with SGD) and 700 MB
(`--host-memory`): it cuts within that, time as the objective.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PYPLAN = str(Path(sys.executable).with_name("pyplan"))

MODEL = '''
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 32000


def model():
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", hidden_size={hidden}, intermediate_size={intermediate},
        num_hidden_layers={layers}, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=VOCAB, max_position_embeddings=64))


def batch(step):
    tokens = torch.randint(3, VOCAB, (4, 33))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
'''


# A fresh parent for each command, so the largest max RSS of its children is that command's.
_MEASURED = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
             "sys.exit(done.returncode)")


def timed(args, cwd, env) -> tuple[subprocess.CompletedProcess, float, int]:
    """(the finished process, its wall seconds, its largest max RSS in bytes)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _MEASURED, PYPLAN, *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=env)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"pyplan {' '.join(map(str, args))} failed:\n{done.stderr[-3000:]}")
    return done, seconds, int(done.stderr.strip().splitlines()[-1]) * 1024


def model_bytes(folder: str) -> int:
    """The parameters' bytes of big.py's model, counted on the meta device."""
    import torch

    sys.path.insert(0, folder)
    try:
        import big
        with torch.device("meta"):
            return sum(p.numel() * p.element_size() for p in big.model().parameters())
    finally:
        sys.path.remove(folder)
        sys.modules.pop("big", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--only", choices=("stages", "whole"))
    args = parser.parse_args()
    GiB = 2**30
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for build in [args.only] if args.only else ("stages", "whole"):
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "big.py").write_text(MODEL.format(
                hidden=args.hidden, intermediate=args.hidden * 11 // 4, layers=args.layers))
            env = {**os.environ, "PYPLAN_BUILD": build}
            size = model_bytes(tmp)
            budget = size // 2 + 700 * 10**6  # per rank
            done, partition_s, partition_rss = timed(
                ["partition", "big:model", "--data", "big:batch", "--loss", "big:loss",
                 "--devices", 4, "--micro-batches", 4, "--repeats", 1, "--host-memory",
                 f"{4 * budget}B", "-o", "big.yaml"], tmp, env)
            planned = [float(x) * GiB for x in re.findall(
                r"\d+: ([\d.]+) GiB", done.stdout.split("planned host memory per rank")[1]
                .splitlines()[0])]
            timed(["solve", "big.yaml", "--quiet"], tmp, env)
            done, run_s, _ = timed(["run", "big.resolved.yaml", "--nproc-per-node", 4,
                                    "--iterations", 1, "--json"], tmp, env)
            report = json.loads(done.stdout.strip().splitlines()[-1])
            ranks = report["rank_memory"]
            rss = [r["max_rss_bytes"] for r in ranks]
            print(f"{build:7} model {size / GiB:.2f} GiB; partition max RSS "
                  f"{partition_rss / GiB:.2f} GiB in {partition_s:.0f} s; run (1 step, 4 "
                  f"ranks, {run_s:.0f} s): max RSS / planned host memory per rank " +
                  " ".join(f"{m / GiB:.2f}/{p / GiB:.2f}" for m, p in zip(rss, planned)) +
                  f" GiB (ratios {min(m / p for m, p in zip(rss, planned)):.2f}-"
                  f"{max(m / p for m, p in zip(rss, planned)):.2f}); the largest "
                  f"{max(rss) / GiB:.2f} GiB against half the model + 700 MB "
                  f"{budget / GiB:.2f} GiB; building the stages " +
                  " ".join(f"{r['setup_seconds']:.1f}" for r in ranks) + " s", flush=True)


if __name__ == "__main__":
    main()
