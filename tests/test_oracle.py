"""--check as an oracle, and the tied parameters it exists to guard: GPT-2 with its tied
embedding and head, trained with gradient accumulation (the bug of issue #42 summed the tied
copies' earlier gradients again at every accumulated step), with the zero-bubble split backward,
a tie across non-adjacent stages, data-parallel replicas and a user's own loop over Pipeline;
each compared, every parameter's gradient and updated value over several steps, with the model
in one process. An error injected into one parameter's gradient on one stage is caught and
named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyplan.runtime import torch  # noqa: F401  (torch without its numpy warning)
from warm_torchrun import torchrun

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
PYPLAN = str(Path(sys.executable).with_name("pyplan"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import training as bench  # noqa: E402  (benchmarks/training.py)

H = [f"transformer.h.{i}" for i in range(4)]
# Four stages on two devices (0, 1, 0, 1): the tie joins stage0 and stage3, not neighbours.
FOUR = """pyplan: 1
name: four
devices: 2
micro_batches: 4
training: {backward: {time_ratio: 2}}
blocks:
  - {name: stage0, devices: [0], time: 1, memory: 1}
  - {name: stage1, devices: [1], time: 1, memory: 1}
  - {name: stage2, devices: [0], time: 1, memory: 1}
  - {name: stage3, devices: [1], time: 1, memory: 1}
model:
  module: tied:gpt2
  cut: forward
  stages:
    stage0: ["transformer.wte", "transformer.wpe", "transformer.h.0"]
    stage1: ["transformer.h.1"]
    stage2: ["transformer.h.2"]
    stage3: ["transformer.h.3", "transformer.ln_f", "lm_head"]
  ties:
    - {parameter: "transformer.wte.weight", stages: [stage0, stage3]}
  data: tied:batch
  loss: tied:loss
"""


def _pyplan(folder, *args, code=0):
    result = subprocess.run([PYPLAN, *map(str, args)], capture_output=True, text=True,
                            cwd=folder, timeout=300)
    assert result.returncode == code, result.stderr[-3000:]
    return result


def _run(folder, plan, ranks, *args, code=0):
    result = _pyplan(folder, "run", plan, "--nproc-per-node", ranks, "--device", "cpu",
                     "--check", "--json", *args, code=code)
    return result, (json.loads(result.stdout.splitlines()[-1]) if code == 0 else None)


@pytest.mark.slow
@pytest.mark.torchrun
def test_tied_gpt2_with_accumulation_split_backward_and_a_distant_tie(tmp_path):
    bench.prepare(tmp_path)
    # Two stages, the backward split into B and W (zero bubble), AdamW with clipping,
    # accumulate 4: the gradients before and the values after each of 3 updates.
    _, report = _run(tmp_path, "tied.resolved.yaml", 2, "--optimizer", "adamw", "--lr", 1e-3,
                     "--clip-grad-norm", 0.5, "--accumulate", 4, "--iterations", 3)
    assert report["check"]["ok"] and report["ties"] == ["transformer.wte.weight"], report
    assert report["check"]["message"].startswith("3 steps: the loss, the gradients and the "
                                                 "updated values of 52 parameters")
    # The model FLOPs of a step (4 batches' forward and backward, the backward split in two)
    # are torch's FlopCounterMode's on the whole model; no peak is known on the CPU.
    sys.path.insert(0, str(tmp_path))
    try:
        import tied
        from torch.utils.flop_counter import FlopCounterMode

        inputs, labels = tied.batch(0)
        with FlopCounterMode(display=False) as counted:
            tied.loss(tied.gpt2()(inputs).logits, labels).backward()
    finally:
        sys.path.remove(str(tmp_path))
    assert report["model_flops"] == 4 * counted.get_total_flops() > 0, report
    assert report["peak_flops"] is None
    # The tie across stages 0 and 3 of four on two devices, accumulate 2, SGD.
    (tmp_path / "four.yaml").write_text(FOUR)
    _pyplan(tmp_path, "solve", "four.yaml", "--quiet")
    _, report = _run(tmp_path, "four.resolved.yaml", 2, "--lr", 0.5, "--accumulate", 2,
                     "--iterations", 2, "--check-steps", 2)
    assert report["check"]["ok"] and report["ties"] == ["transformer.wte.weight"], report
    # A gradient made wrong by 1e-3 of its norm in one element, on rank 1 only: named.
    result, _ = _run(tmp_path, "four.resolved.yaml", 2, "--lr", 0.5, "--accumulate", 2,
                     "--perturb", "1:transformer.h.1.mlp.c_fc.weight", code=1)
    assert ("error: check failed: at step 1 the gradient of transformer.h.1.mlp.c_fc.weight "
            "differs from the single-process run's: relative error 0.001 (tolerance 1e-05; "
            "the worst of 53 parameters)") in result.stderr, result.stderr[-3000:]


@pytest.mark.torchrun
def test_tied_gpt2_in_two_data_parallel_replicas(tmp_path):
    bench.prepare(tmp_path)
    text = bench.PLAN.replace("micro_batches: 4", "micro_batches: 2\nmesh: {data: 2}")
    (tmp_path / "dp.yaml").write_text(text.replace("name: tied", "name: dp"))
    _pyplan(tmp_path, "solve", "dp.yaml", "--quiet")
    _, report = _run(tmp_path, "dp.resolved.yaml", 4, "--optimizer", "adamw", "--lr", 1e-3,
                     "--accumulate", 2, "--iterations", 2)
    assert report["check"]["ok"] and report["ties"] == ["transformer.wte.weight"], report


LOOP = '''
import sys

import torch

from pyplan.runtime import Pipeline, save

pipe = Pipeline(sys.argv[1], device="cpu")
optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.0)
from pyplan.run.binding import make_batch
batch = 0
for step in range(3):
    optimizer.zero_grad()
    for k in range(4):                       # accumulate 4 global batches per step
        inputs, labels = make_batch(pipe.model, batch, 0, torch.device("cpu"))
        batch += 1
        pipe.step(inputs, labels, grad_norm=k == 3)
    for p in pipe.parameters():
        p.grad.div_(4)
    # The norm the last step found with its inf/NaN check, of the 4 steps' sum: the norm
    # grad_norm's own collective finds (tied copies counted once in both).
    assert torch.allclose(pipe.step_norm / 4, pipe.grad_norm(), rtol=1e-6), pipe.step_norm
    pipe.clip_grads_with_norm_(1e6, pipe.step_norm / 4)  # (far above it: changes nothing)
    pipe.step_optimizer(optimizer)
save("ck", pipe, optimizer, step=3)
pipe.close()
'''


@pytest.mark.torchrun
def test_a_users_loop_over_pipeline_accumulates_tied_gradients_exactly(tmp_path):
    bench.prepare(tmp_path)
    (tmp_path / "loop.py").write_text(LOOP)
    result = torchrun("loop.py", "tied.resolved.yaml", nproc=2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _pyplan(tmp_path, "consolidate", "tied.resolved.yaml", "ck", "-o", "model.pt")
    sys.path.insert(0, str(tmp_path))
    try:
        reference = bench.plain(tmp_path, 3, 4, 1e-3)
    finally:
        sys.path.remove(str(tmp_path))
    (norm, name), _ = bench.differences(torch.load(tmp_path / "model.pt"), reference)
    assert norm < 1e-4, (norm, name)
