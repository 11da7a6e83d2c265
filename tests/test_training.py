"""Training with pyplan beyond one run: checkpoints through torch.distributed.checkpoint that
resume to exactly the losses of an uninterrupted run, load under another plan of the same model
(other stages, another device count), and consolidate into the model's own state dict; clipping
on blocks that span devices. (The Pipeline API in a user's own loop, as
docs/training-loop.md shows it, runs in tests/test_docs.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyplan.runtime import torch

pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parent / "models"
ROOT = Path(__file__).resolve().parent.parent
PYPLAN = str(Path(sys.executable).with_name("pyplan"))

UNITS = [["model.embed_tokens"], ["model.layers.0"], ["model.layers.1"], ["model.layers.2"],
         ["model.layers.3"], ["model.norm", "lm_head"]]


def _plan(name: str, stages: list[list[str]]) -> str:
    """A plan of the tiny Llama (tests/models/hf.py) cut in its own forward."""
    blocks = "\n".join(f"  - {{name: stage{s}, devices: [{s}], time: 2, memory: 1}}"
                       for s in range(len(stages)))
    lists = "\n".join(f"    stage{s}: {json.dumps(units)}" for s, units in enumerate(stages))
    return (f"pyplan: 1\nname: {name}\ndevices: {len(stages)}\nmicro_batches: 4\n"
            f"training: {{backward: {{time_ratio: 2}}}}\nblocks:\n{blocks}\n"
            f"model:\n  module: hf:llama\n  cut: forward\n  stages:\n{lists}\n"
            f"  data: hf:batch\n  loss: hf:loss\n")


@pytest.mark.torchrun
def test_checkpoints_resume_exactly_reshard_and_consolidate(tmp_path):
    shutil.copy(MODELS / "hf.py", tmp_path / "hf.py")
    four = [UNITS[0] + UNITS[1], UNITS[2], UNITS[3], UNITS[4] + UNITS[5]]
    two = [UNITS[0] + UNITS[1] + UNITS[2], UNITS[3] + UNITS[4] + UNITS[5]]
    for name, stages in (("four", four), ("two", two)):
        (tmp_path / f"{name}.yaml").write_text(_plan(name, stages))

    def pyplan(*args):
        result = subprocess.run([PYPLAN, *map(str, args)], capture_output=True, text=True,
                                cwd=tmp_path, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    def run(plan, ranks, *args):
        out = pyplan("run", f"{plan}.resolved.yaml", "--nproc-per-node", ranks, "--device",
                     "cpu", "--optimizer", "adamw", "--lr", "0.003", "--json", *args)
        return json.loads(out.splitlines()[-1])

    pyplan("solve", "four.yaml", "--quiet")
    pyplan("solve", "two.yaml", "--quiet")
    # An uninterrupted run of 6 steps that saves at step 3 (and 6), and a run resumed at 3.
    whole = run("four", 4, "--iterations", 6, "--save", "ck", "--save-every", 3)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000003",
                                                                    "step-00000006"]
    resumed = run("four", 4, "--iterations", 3, "--resume", "ck/step-00000003")
    assert resumed["first_iteration"] == 3
    assert resumed["losses"] == whole["losses"][3:]  # exactly: same data, state and order
    # Another plan of the same model (2 stages on 2 ranks): the checkpoint loads and trains on
    # as the model in one process does from step 0 (no dropout: the cut does not matter).
    other = run("two", 2, "--iterations", 2, "--resume", "ck/step-00000003", "--check")
    assert other["check"]["ok"], other["check"]
    assert other["losses"][0] == pytest.approx(resumed["losses"][0], abs=1e-5)

    pyplan("consolidate", "four.resolved.yaml", "ck/step-00000003", "-o", "model.pt")
    sys.path.insert(0, str(tmp_path))
    try:
        import hf
        from pyplan.run.binding import Model, make_batch

        torch.manual_seed(1)
        model = hf.llama()
        model.load_state_dict(torch.load(tmp_path / "model.pt"), strict=True)
        inputs, labels = make_batch(Model(None, hf.batch, hf.loss), 3, 0, torch.device("cpu"))
        with torch.no_grad():
            loss = hf.loss(model(inputs).logits, labels)
    finally:
        sys.path.remove(str(tmp_path))
    assert float(loss) == pytest.approx(resumed["losses"][0], abs=1e-5)


@pytest.mark.torchrun
def test_clipping_on_blocks_that_span_devices():
    """The GPT M-shape: a vocabulary-parallel embedding and head on all 4 ranks. The global
    gradient norm counts each sharded chunk once and each replicated parameter once, so the
    clipped steps are those of the model in one process. SGD, whose step is proportional to
    the clipped gradient, so a wrong norm shows in the losses (AdamW's step hardly depends on
    it; tied GPT-2 in the M-shape runs AdamW with clipping in test_mshape.py)."""
    result = subprocess.run([PYPLAN, "run", str(ROOT / "plans" / "gpt-mshape.resolved.yaml"),
                             "--nproc-per-node", "4", "--device", "cpu", "--optimizer", "sgd",
                             "--lr", "0.5", "--clip-grad-norm", "0.5", "--iterations", "4",
                             "--check", "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["check"]["ok"], report["check"]
    assert all(norm > 0.5 for norm in report["grad_norms"]), report  # clipping did act


@pytest.mark.torchrun
def test_an_inference_plan_runs_forward_only_and_its_losses_are_one_process_forwards(tmp_path):
    """task: inference with a model: run steps the forward schedule alone, and --check judges
    every step's loss against the single-process forward of that step's batch (a parameter
    that moved would show in the next step's loss)."""
    shutil.copy(MODELS / "hf.py", tmp_path / "hf.py")
    two = [UNITS[0] + UNITS[1] + UNITS[2], UNITS[3] + UNITS[4] + UNITS[5]]
    text = _plan("forward", two).replace("training: {backward: {time_ratio: 2}}",
                                          "task: inference").replace("memory: 1", "memory: 0")
    (tmp_path / "forward.yaml").write_text(text)
    run = lambda *args: subprocess.run([PYPLAN, *map(str, args)], capture_output=True,  # noqa
                                       text=True, cwd=tmp_path, timeout=300)
    assert run("solve", "forward.yaml", "--quiet").returncode == 0
    result = run("run", "forward.resolved.yaml", "--nproc-per-node", 2, "--device", "cpu",
                 "--check", "--iterations", 3)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "micro-batches, forward only (an inference plan: no update)\n" in result.stdout
    assert "check: 3 forward-only steps: the losses match the single-process forwards'" in \
        result.stdout, result.stdout
