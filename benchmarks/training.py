"""Pipelined training against plain single-process PyTorch, parameter by parameter: GPT-2 with
its tied input and output embeddings (tests/models/hf.py's tiny config, dropout off), cut in two
stages on 2 CPU ranks with the tie across them, AdamW and gradient accumulation over 4 global
batches per step, trained by `pyplan run` and consolidated; beside it the same model trained by
a plain PyTorch loop (`model(x)`, `loss / K`, `backward`, `AdamW.step`) from the same initial
weights on the same batches. Printed: the largest relative difference of a parameter,
||a - b|| / ||b||, and of a single element, |a - b| / max|b| (fp32: both should be <= 1e-4;
the accumulation bug of issue #42 made the tied gradient 4.23x too large at K = 4).

    python benchmarks/training.py [--steps 100] [--accumulate 4]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPLAN = str(Path(sys.executable).with_name("pyplan"))

MODEL = '''"""Tied GPT-2 without dropout: both runs draw no random numbers in the forward."""
from hf import batch, build, loss  # noqa: F401


def gpt2():
    return build("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
'''

PLAN = """pyplan: 1
name: tied
devices: 2
micro_batches: 4
training: {backward: {time_ratio: 1, weight_time_ratio: 1}}
blocks:
  - {name: stage0, devices: [0], time: 2, memory: 1}
  - {name: stage1, devices: [1], time: 2, memory: 1}
model:
  module: tied:gpt2
  cut: forward
  stages:
    stage0: ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1"]
    stage1: ["transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"]
  ties:
    - {parameter: "transformer.wte.weight", stages: [stage0, stage1]}
  data: tied:batch
  loss: tied:loss
"""


def prepare(folder: Path) -> Path:
    """folder/tied.resolved.yaml: the plan above, solved, with its model files beside it."""
    shutil.copy(ROOT / "tests" / "models" / "hf.py", folder / "hf.py")
    (folder / "tied.py").write_text(MODEL)
    (folder / "tied.yaml").write_text(PLAN)
    subprocess.run([PYPLAN, "solve", "tied.yaml", "--quiet"], cwd=folder, check=True,
                   timeout=120)
    return folder / "tied.resolved.yaml"


def plain(folder: Path, steps: int, accumulate: int, lr: float) -> dict:
    """The model trained by a plain PyTorch loop in this process: its state dict."""
    import torch

    from pyplan.resolved import load_resolved
    from pyplan.run.binding import build_whole, load_model, make_batch

    plan = load_resolved(folder / "tied.resolved.yaml")
    model = load_model(plan.problem, folder)
    gpt = build_whole(model, 0)  # the initial weights every rank gives its own stage
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=lr, weight_decay=0.0)
    batch = 0
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(accumulate):
            inputs, labels = make_batch(model, batch, 0, torch.device("cpu"))
            batch += 1
            (model.loss(gpt(inputs).logits, labels) / accumulate).backward()
        optimizer.step()
    return gpt.state_dict()


def differences(state: dict, reference: dict) -> tuple[tuple[float, str], tuple[float, str]]:
    """(largest ||a - b|| / ||b||, its parameter), (largest |a - b| / max|b|, its parameter)."""
    norms, elements = [], []
    for name, want in reference.items():
        got = state[name].to(want.dtype)
        norms.append((float((got - want).norm() / want.norm().clamp_min(1e-12)), name))
        elements.append((float((got - want).abs().max() / want.abs().max().clamp_min(1e-12)),
                         name))
    return max(norms), max(elements)


def pipelined(folder: Path, steps: int, accumulate: int, lr: float) -> dict:
    """The model trained by `pyplan run` on 2 ranks and consolidated: its state dict."""
    import torch

    run = [PYPLAN, "run", "tied.resolved.yaml", "--nproc-per-node", "2", "--device", "cpu",
           "--optimizer", "adamw", "--lr", str(lr), "--accumulate", str(accumulate),
           "--steps", str(steps), "--save", "ck", "--json"]
    subprocess.run(run, cwd=folder, check=True, capture_output=True, timeout=1800)
    subprocess.run([PYPLAN, "consolidate", "tied.resolved.yaml", "ck", "-o", "model.pt"],
                   cwd=folder, check=True, capture_output=True, timeout=300)
    return torch.load(folder / "model.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prepare(folder)
        sys.path.insert(0, str(folder))
        (norm, name), (element, where) = differences(
            pipelined(folder, args.steps, args.accumulate, args.lr),
            plain(folder, args.steps, args.accumulate, args.lr))
    print(f"tied GPT-2, 2 stages on 2 CPU ranks, AdamW lr {args.lr:g}, accumulate "
          f"{args.accumulate}, {args.steps} steps, fp32, against plain single-process PyTorch:")
    print(f"  largest relative difference of a parameter (||a-b||/||b||): {norm:.2e} ({name})")
    print(f"  largest relative difference of an element (|a-b|/max|b|):   {element:.2e} "
          f"({where})")


if __name__ == "__main__":
    main()
