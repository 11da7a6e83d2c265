"""The runtime on CPU, for what can be checked without a GPU: device and backend chosen once
for the world, memory that follows the schedule (a rank holds the micro-batches in flight,
not the iteration's), shapes sent with every iteration, the Pipeline API in a user's loop."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyplan.errors import RunError
from pyplan.runtime import torch  # noqa: F401  (torch without its numpy warning)
from pyplan.comm.devices import choose_cuda
from warm_torchrun import torchrun

MODELS = Path(__file__).resolve().parent / "models"
ROOT = Path(__file__).resolve().parent.parent
PYPLAN = str(Path(sys.executable).with_name("pyplan"))


def test_the_world_runs_on_cuda_only_when_every_rank_has_a_gpu():
    gpus = [f"node/GPU-{r}" for r in range(4)]  # host/UUID of the GPU each rank would use
    assert choose_cuda("auto", gpus)
    assert not choose_cuda("auto", gpus[:3] + [None])  # no NCCL hang: all on CPU
    assert not choose_cuda("cpu", gpus[:2])
    assert choose_cuda("cuda", gpus[:2])
    with pytest.raises(RunError, match=r"--device cuda, but rank 2 has no GPU of its own "
                                       r"\(2 of 4 ranks have none\)"):
        choose_cuda("cuda", gpus[:2] + [None, None])
    # Two ranks on one GPU (more processes than GPUs): NCCL refuses them.
    assert not choose_cuda("auto", gpus[:2] + gpus[:2])
    with pytest.raises(RunError, match=r"ranks 0 and 2 would share one GPU \(node/GPU-0\)"):
        choose_cuda("cuda", gpus[:2] + gpus[:2])


@pytest.mark.torchrun
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_the_world_is_gone_after_destroy_even_once_dynamo_is_imported():
    # A group that outlives destroy_process_group is torn down with the interpreter, which now
    # and then aborts a finished run with SIGABRT. (A new interpreter, not warm_torchrun's
    # workers, which have imported torch._dynamo before anything.)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "1", str(MODELS / "world_teardown.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "threads none" in result.stdout, result.stdout


def _run(tmp_path, *args, timeout=300):
    return subprocess.run([PYPLAN, *map(str, args)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=timeout)


WIDE_PLAN = """\
pyplan: 1
name: wide{n}
devices: 2
memory: 4
micro_batches: {n}
training: {{backward: {{time_ratio: 2}}}}
blocks:
  - {{name: a, devices: [0], time: 1, memory: 1}}
  - {{name: b, devices: [1], time: 1, memory: 1}}
model: {{blocks: "wide:build", data: "wide:batch{n}", loss: "wide:loss"}}
"""


@pytest.mark.torchrun
def test_a_rank_holds_the_micro_batches_in_flight_not_the_iteration(tmp_path):
    """Each micro-batch hands on 1 MiB; within 4 units of memory the schedule keeps at most 4
    micro-batches in flight, and what the ranks hold does not grow from 4 to 16 micro-batches:
    sent tensors are released once sent, received ones after their last use."""
    shutil.copy(MODELS / "wide.py", tmp_path / "wide.py")
    peaks = {}
    for n in (4, 16):
        (tmp_path / f"wide{n}.yaml").write_text(WIDE_PLAN.format(n=n))
        assert _run(tmp_path, "solve", f"wide{n}.yaml", "--quiet").returncode == 0
        result = _run(tmp_path, "run", f"wide{n}.resolved.yaml", "--nproc-per-node", 2,
                      "--iterations", 2, "--json", "--device", "cpu")
        assert result.returncode == 0, result.stderr[-2000:]
        # The census of live tensor bytes: transfers too, which the executor's count of
        # activations leaves to the plan's workspace.
        peaks[n] = [r["peak_bytes"] - r["static_bytes"] for r in
                    json.loads(result.stdout.splitlines()[-1])["rank_memory"]]
    mib = 2 ** 20
    assert all(peak >= mib for peak in peaks[4]), peaks
    # 16 micro-batches' global batch is 0.2 MiB more than 4's.
    assert all(big <= small + mib // 2 for big, small in zip(peaks[16], peaks[4])), peaks
    assert max(peaks[16]) < 8 * mib, peaks  # 16 micro-batches would be 16+ MiB held


@pytest.mark.torchrun
def test_shapes_may_change_between_iterations(tmp_path):
    shutil.copy(MODELS / "wide.py", tmp_path / "wide.py")
    plan = (ROOT / "plans" / "transformer-vshape.yaml").read_text()
    plan = plan.replace("pyplan.examples.transformer:batch", "wide:growing")
    (tmp_path / "growing.yaml").write_text(plan)
    assert _run(tmp_path, "solve", "growing.yaml", "--quiet").returncode == 0
    result = _run(tmp_path, "run", "growing.resolved.yaml", "--nproc-per-node", 4, "--check",
                  "--iterations", 3, "--device", "cpu")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "match the single-process run" in result.stdout


OWN_LOSS = """\
import sys

import torch

import wide
from pyplan.runtime import Pipeline

pipe = Pipeline(sys.argv[1], device="cpu")
inputs, targets = wide.batch4(0)
shared = pipe.step(inputs, targets)
for p in pipe.parameters():
    p.grad = None
own = pipe.step(inputs, targets, share_loss=False)
# one write per line: print's text and newline are two, which the ranks' lines interleave
own = None if own is None else float(own)
sys.stdout.write(f"rank {pipe.rank} {float(shared)!r} {own!r}\\n")
sys.stdout.flush()
pipe.close()
"""


@pytest.mark.torchrun
def test_the_loss_is_shared_with_every_rank_unless_declined(tmp_path):
    """step() returns the global loss everywhere; share_loss=False skips that collective and
    only the rank computing the loss gets it (the same value), as torch's schedules do."""
    shutil.copy(MODELS / "wide.py", tmp_path / "wide.py")
    (tmp_path / "wide4.yaml").write_text(WIDE_PLAN.format(n=4))
    assert _run(tmp_path, "solve", "wide4.yaml", "--quiet").returncode == 0
    (tmp_path / "own.py").write_text(OWN_LOSS)
    result = torchrun("own.py", "wide4.resolved.yaml", nproc=2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line.split()[1:] for line in result.stdout.splitlines()
                   if line.startswith("rank "))
    (_, shared0, own0), (_, shared1, own1) = lines
    assert shared0 == shared1 and own0 == "None" and own1 == shared1 != "None"


TWO_STAGES = """\
pyplan: 1
name: two
devices: 2
memory: 4
micro_batches: 4
training:
  backward: {time_ratio: 2}
shape: {kind: vshape, stage: {time: 2, memory: 1}}
model:
  blocks: pyplan.examples.transformer:build_two
  data: pyplan.examples.transformer:batch
  loss: pyplan.examples.transformer:loss
"""


@pytest.mark.torchrun
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_reduced_precision_trains_as_one_process_does_within_its_tolerance(tmp_path, dtype):
    """Autocast on every block (and in the reference), activations sent in the reduced dtype;
    fp16 with dynamic loss scaling."""
    (tmp_path / "two.yaml").write_text(TWO_STAGES)
    assert _run(tmp_path, "solve", "two.yaml", "--quiet").returncode == 0
    result = _run(tmp_path, "run", "two.resolved.yaml", "--nproc-per-node", 2, "--check",
                  "--iterations", 2, "--dtype", dtype, "--json", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["dtype"] == dtype and report["check"]["ok"], report
