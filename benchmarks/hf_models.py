"""Hugging Face causal LMs as users build them (from a config, nothing downloaded).

`python benchmarks/hf_models.py` tries every family of tests/models/hf.py (ALL, tiny configs)
as a user would: partition -> solve -> run --check on 2 ranks, one row per family.

As a module: two of them sized for benchmarks/partition.py on 4 CPU ranks: GPT-2 (tied
embeddings, learned positions) and Llama (rotary embeddings, untied head), 8 layers of width 128 and a vocabulary of 8192, so the
embedding and head weigh more than a layer, as in real models. Llama keeps its config's default
head_dim (128: the value is not re-derived when hidden_size changes), so its 4 attention heads
project to 512 wide; the figures in docs/benchmarks.md were measured so. The configs come from
tests/models/hf.py's `config`, the tests' tiny models resized."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))

import hf  # noqa: E402  (tests/models/hf.py)

VOCAB, SEQUENCE, BATCH = 8192, 64, 16
SIZE = dict(num_hidden_layers=8, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=512, head_dim=128, vocab_size=VOCAB, n_layer=8, n_embd=128,
            n_head=4, max_position_embeddings=SEQUENCE, n_positions=SEQUENCE)


def gpt2():
    return hf.build("gpt2", **SIZE)


def llama():
    return hf.build("llama", **SIZE)


def batch(step: int):
    return hf.tokens(VOCAB, SEQUENCE, BATCH)


loss = hf.loss


def _try(family: str, folder: Path, devices: int, weights: bool) -> list[str]:
    """partition -> solve -> run --check of `family` (tiny) in `folder`: the table's cells."""
    import json
    import shutil
    import subprocess
    import time

    pyplan = str(Path(sys.executable).with_name("pyplan"))
    shutil.copy(Path(hf.__file__), folder / "hf.py")
    extra = []
    if weights:  # start from the checkpoint save_pretrained writes (the family's disk layout)
        hf.build(family).save_pretrained(folder / "saved")
        extra = ["--weights", "saved"]
    cells = []
    steps = (("partition", f"hf:{family}", "--data", "hf:batch", "--loss", "hf:loss",
              "--devices", str(devices), "--repeats", "1", "-o", "plan.yaml", *extra),
             ("solve", "plan.yaml", "--quiet"),
             ("run", "plan.resolved.yaml", "--nproc-per-node", str(devices), "--check",
              "--iterations", "2", "--json", "--device", "cpu"))
    for step in steps:
        started = time.perf_counter()
        done = subprocess.run([pyplan, *step], capture_output=True, text=True, cwd=folder,
                              timeout=1800)
        cells.append(f"{time.perf_counter() - started:.0f}")
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error:" in line]
            return cells + [f"{step[0]} failed: {(errors or ['?'])[-1][:110]}"]
    plan = (folder / "plan.yaml").read_text()
    cut = next((line.split(":", 1)[1].strip() for line in plan.splitlines()
                if line.strip().startswith("cut:")), "chain")
    returns = next((line.split(":", 1)[1].strip() for line in plan.splitlines()
                    if line.strip().startswith("layer_returns:")), "tensor")
    check = json.loads(done.stdout.strip().splitlines()[-1])["check"]
    return cells + [f"{'ok' if check['ok'] else 'CHECK FAILED'} (cut {cut}, layers return "
                    f"{returns})"]


def main(argv: list[str]) -> int:
    """Every family tried (tests/models/hf.py's ALL, tiny configs), as a user would: pyplan
    partition -> solve -> run --check on 2 ranks; the families whose checkpoints keep another
    layout than the model also from save_pretrained's folder (--weights). One row each."""
    import argparse
    import tempfile
    import warnings

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--families", help="comma-separated (default: every one tried)")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    hf.transformers_quiet()
    families = args.families.split(",") if args.families else list(hf.ALL)
    rows = [(family, False) for family in families] + \
        [(family, True) for family in ("qwen3_moe", "olmo_hybrid") if family in families]
    print(f"{'family':<28} {'partition s':>11} {'solve s':>7} {'run s':>5}  result", flush=True)
    failed = 0
    for family, weights in rows:
        with tempfile.TemporaryDirectory() as folder:
            cells = _try(family, Path(folder), args.devices, weights)
        cells += [""] * (4 - len(cells))
        failed += not cells[-1].startswith("ok")
        name = family + (" (--weights)" if weights else "")
        print(f"{name:<28} {cells[0]:>11} {cells[1]:>7} {cells[2]:>5}  {cells[3]}", flush=True)
    print(f"{len(rows) - failed} of {len(rows)} pass partition -> solve -> run --check on "
          f"{args.devices} ranks")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
