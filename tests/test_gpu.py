"""pyplan run on GPUs over NCCL (skipped without them): the same --check as on CPU for 1F1B, a
split backward (zero bubble), blocks on several devices, data x pipeline parallelism, bf16 and
a Hugging Face model, with every host-GPU synchronisation inside an iteration's steps raising
(torch.cuda.set_sync_debug_mode, PYPLAN_CHECK_SYNC=1) and a short collective timeout. Profiling
with CUDA events and the NCCL link measurement run too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyplan.runtime import torch

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
MODELS = Path(__file__).resolve().parent / "models"
PYPLAN = str(Path(sys.executable).with_name("pyplan"))

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs (4 for some cases)")

TWO_STAGES = """\
pyplan: 1
name: {name}
devices: 2
memory: 4
micro_batches: 4
training:
  backward: {{time_ratio: 2{split}}}
shape: {{kind: vshape, stage: {{time: 2, memory: 1}}}}
model:
  blocks: pyplan.examples.transformer:build_two
  data: pyplan.examples.transformer:batch
  loss: pyplan.examples.transformer:loss
"""


def _run(tmp_path, resolved, ranks: int, *extra) -> dict:
    env = {**os.environ, "PYPLAN_CHECK_SYNC": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    result = subprocess.run([PYPLAN, "run", str(resolved), "--nproc-per-node", str(ranks),
                             "--device", "cuda", "--check", "--iterations", "3", "--json",
                             "--fault-timeout", "30", *extra],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["device"] == "cuda" and "nccl" in report["backend"], report
    assert report["check"]["ok"], report["check"]
    assert all(b > 0 for b in report["cuda_max_allocated"]), report
    return report


def _solved(tmp_path, name: str, text: str) -> Path:
    plan = tmp_path / f"{name}.yaml"
    plan.write_text(text)
    assert subprocess.run([PYPLAN, "solve", str(plan), "--quiet"]).returncode == 0
    return tmp_path / f"{name}.resolved.yaml"


@pytest.mark.parametrize("split", ["", ", weight_time_ratio: 1"], ids=["1f1b", "zero-bubble"])
def test_two_gpus_train_as_one_process_does(tmp_path, split):
    resolved = _solved(tmp_path, "two", TWO_STAGES.format(name="two", split=split))
    _run(tmp_path, resolved, 2)


def test_bf16_under_autocast_matches_within_its_tolerance(tmp_path):
    resolved = _solved(tmp_path, "bf16", TWO_STAGES.format(name="bf16", split=""))
    report = _run(tmp_path, resolved, 2, "--dtype", "bf16")
    assert report["dtype"] == "bf16"


def test_a_tied_hugging_face_model_on_gpus(tmp_path):
    pytest.importorskip("transformers")
    shutil.copy(MODELS / "hf.py", tmp_path / "hf.py")
    made = subprocess.run([PYPLAN, "partition", "hf:gpt2", "--data", "hf:batch", "--loss",
                           "hf:loss", "--devices", "2", "--device", "cuda", "-o", "gpt2.yaml"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert made.returncode == 0, made.stderr
    assert subprocess.run([PYPLAN, "solve", "gpt2.yaml", "--quiet"], cwd=tmp_path).returncode == 0
    report = _run(tmp_path, tmp_path / "gpt2.resolved.yaml", 2)
    assert report["ties"] == ["transformer.wte.weight"]


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("plan", ["gpt-mshape", "gpt-mshape-blocks",
                                  "transformer-vshape-dp2"])
def test_four_gpus_multi_device_blocks_and_data_parallelism(tmp_path, plan):
    shutil.copy(PLANS / f"{plan}.yaml", tmp_path / f"{plan}.yaml")
    shutil.copy(PLANS / f"{plan}.resolved.yaml", tmp_path / f"{plan}.resolved.yaml")
    _run(tmp_path, tmp_path / f"{plan}.resolved.yaml", 4)


def test_profile_and_links_on_the_gpu():
    result = subprocess.run([PYPLAN, "profile", str(PLANS / "transformer-vshape.yaml"),
                             "--device", "cuda", "--json", "--links"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert all(b["forward_ms"] > 0 and b["backward_ms"] > 0 for b in found["blocks"])
    assert found["link"]["bandwidth"] > 0
