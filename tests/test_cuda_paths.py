"""The CUDA/NCCL review's findings (issue 34), each shown where a CPU can show it: collectives
entered on every rank whatever its stage holds, groups that name their backend, the GPU a rank
picks, fp16 steps that cannot move the optimizer after an overflow, the fused cross-entropy in
fp32 under autocast, shapes per micro-batch, gradients W must not alias, ties counted once, the
watchdog's start-up grace, DTensor parameters refused, autocast's weight casts kept for the
iteration. tests/test_gpu.py runs the rest on GPUs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pyplan.runtime import torch
from pyplan import comm
from pyplan.comm import devices
from pyplan.run.backward import backward_input, backward_weight
from warm_torchrun import torchrun

MODELS = Path(__file__).resolve().parent / "models"
PYPLAN = str(Path(sys.executable).with_name("pyplan"))

THREE = """\
pyplan: 1
name: {name}
devices: 3
memory: 6
micro_batches: 4
training: {{backward: {{time_ratio: 2{split}}}}}
blocks:
  - {{name: a, devices: [0], time: 1, memory: 1}}
  - {{name: b, devices: [1], time: 1, memory: 1}}
  - {{name: c, devices: [2], time: 1, memory: 1}}
model: {{blocks: "review:{build}", data: "review:batch", loss: "review:{loss}"}}
"""

TWO = """\
pyplan: 1
name: {name}
devices: 2
memory: 4
micro_batches: 4
training: {{backward: {{time_ratio: 2}}}}
blocks:
  - {{name: a, devices: [0], time: 1, memory: 1}}
  - {{name: b, devices: [{last}], time: 1, memory: 1}}
model: {{blocks: "review:{build}", data: "review:batch", loss: "review:{loss}"}}
"""


def _pyplan(tmp_path, *args, timeout=300):
    return subprocess.run([PYPLAN, *map(str, args)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=timeout)


def _solved(tmp_path, name: str, text: str) -> str:
    shutil.copy(MODELS / "review.py", tmp_path / "review.py")
    (tmp_path / f"{name}.yaml").write_text(text)
    result = _pyplan(tmp_path, "solve", f"{name}.yaml", "--quiet")
    assert result.returncode == 0, result.stderr
    return f"{name}.resolved.yaml"


def _torchrun(tmp_path, script: str, *args, nproc: int = 2, timeout=300):
    (tmp_path / "script.py").write_text(textwrap.dedent(script))
    return torchrun("script.py", *args, nproc=nproc, cwd=tmp_path, timeout=timeout)


# ---------------------------------------------------------------- 1: every rank, every collective

@pytest.mark.torchrun
@pytest.mark.parametrize("build", ["free", "frozen"])
def test_a_stage_without_trainable_parameters_clips_and_steps_with_the_others(tmp_path, build):
    """Its rank has no optimizer, yet enters clipping's all-reduce (it used to skip it, and the
    other ranks waited there forever)."""
    plan = _solved(tmp_path, build, THREE.format(name=build, split="", build=build,
                                                 loss="loss"))
    result = _pyplan(tmp_path, "run", plan, "--nproc-per-node", 3, "--optimizer", "adamw",
                     "--clip-grad-norm", "1.0", "--check", "--iterations", 3, "--json",
                     "--device", "cpu", "--fault-timeout", 30)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["check"]["ok"], report["check"]
    assert len(report["grad_norms"]) == 3


# ---------------------------------------------------------------- 2: a caller's one-sided group

def test_backend_sides_are_read_from_the_group_configuration():
    assert devices._sides("cuda:nccl") == {"cuda": "nccl"}  # init_process_group("nccl")
    assert "cpu" not in devices._sides("cuda:nccl")
    assert devices._sides("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert devices.device_backend(torch.device("cpu")) == "gloo"
    assert devices.device_backend(torch.device("cuda", 0)) == "nccl"


CALLERS_GROUP = """\
    import sys

    import torch
    import torch.distributed as dist

    from pyplan.runtime import Pipeline
    from pyplan.comm.devices import all_gather_objects

    dist.init_process_group("cpu:gloo")  # the caller's group, with one side only
    pipe = Pipeline(sys.argv[1])
    import review
    for step in range(2):
        inputs, targets = review.batch(step)
        loss = pipe.step(inputs, targets)
    groups = {dist.get_backend_config(g) for g in [pipe.comm.cpu_group, *pipe.comm.links.values()]}
    words = ["rank", pipe.rank, sorted(groups), all_gather_objects(pipe.rank), float(loss)]
    sys.stdout.write(" ".join(map(str, words)) + "\\n")  # one write: ranks share the pipe
    pipe.close()
    dist.destroy_process_group()
"""


@pytest.mark.torchrun
def test_a_callers_group_with_one_side_carries_pyplans_transfers(tmp_path):
    """pyplan's groups name their backend (on a GPU: NCCL for tensors, gloo for headers and
    reports), whatever the caller's default group has: an NCCL-only group has no CPU side
    for the headers (tests/test_gpu.py runs that case)."""
    plan = _solved(tmp_path, "two", TWO.format(name="two", last=1, build="two", loss="loss"))
    result = _torchrun(tmp_path, CALLERS_GROUP, plan)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    # Named "gloo" (both sides), not inherited from the caller's "cpu:gloo".
    assert [line.split(" [", 1)[1].split("] ")[0] for line in lines] == \
        ["'cpu:gloo,cuda:gloo'"] * 2, result.stdout
    assert all("[0, 1]" in line for line in lines)


# ---------------------------------------------------------------- 3: the GPU a rank takes

@pytest.mark.parametrize("visible, local, expected", [
    (0, 0, None), (1, 0, 0), (1, 3, 0), (4, 3, 3), (4, 5, 1), (2, 3, 1)],
    ids=["none", "one-visible", "one-visible-rank3", "four", "oversubscribed", "two"])
def test_a_rank_uses_local_rank_modulo_the_gpus_it_sees(visible, local, expected):
    """SLURM --gpus-per-task=1 and a pod per GPU show each process one GPU: that is its own
    (it used to count as none when LOCAL_RANK >= 1, and the world fell back to the CPU)."""
    gpus = tuple(f"GPU-{i}" for i in range(visible))
    choice = devices.choose("auto", [devices.Seen("node", gpus, local)])
    assert choice.gpus == (expected,) and choice.cuda == (expected is not None)


def test_ranks_that_would_share_a_gpu_do_not_count_as_having_their_own():
    """Eight processes on a node with four visible GPUs: ranks 0 and 4 would share GPU 0."""
    four = tuple(f"GPU-{i}" for i in range(4))
    seen = [devices.Seen("node", four, local) for local in range(8)]
    assert devices.choose("auto", seen) == devices.Choice(
        False, (None,) * 8, "ranks 0 and 4 would share one GPU (node/GPU-0)")
    assert devices.choose("auto", seen[:4]).gpus == (0, 1, 2, 3)
    # One GPU visible to each process, each a different one (their UUIDs differ).
    one_each = [devices.Seen("node", (f"GPU-{r}",), r) for r in range(4)]
    assert devices.choose("cuda", one_each).gpus == (0, 0, 0, 0)


# ---------------------------------------------------------------- 6: fp16 overflow

OVERFLOW = """\
    import sys

    import torch

    import review
    from pyplan.runtime import Pipeline

    pipe = Pipeline(sys.argv[1], device="cpu", dtype="fp16")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in pipe.parameters()]
    inputs, targets = review.batch(0)
    pipe.step(inputs, targets)
    overflow, scale = pipe.overflow, pipe.loss_scale
    stepped = pipe.step_optimizer(optimizer)
    optimizer.step()  # even called directly: no gradient is left to apply
    moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, pipe.parameters()))
    words = ["rank", pipe.rank, overflow, scale, stepped, moved, optimizer.state == {}]
    sys.stdout.write(" ".join(map(str, words)) + "\\n")  # one write: ranks share the pipe
    pipe.close()
"""


@pytest.mark.torchrun
def test_an_overflowed_fp16_step_cannot_move_the_optimizer(tmp_path):
    plan = _solved(tmp_path, "over", TWO.format(name="over", last=1, build="two",
                                                loss="overflowing_loss"))
    result = _torchrun(tmp_path, OVERFLOW, plan)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0 True 32768.0 False False True",
                     "rank 1 True 32768.0 False False True"], result.stdout


# ---------------------------------------------------------------- 7: the loss in fp32

FUSED_LOSS = """\
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from pyplan.models.vocab import parallel_loss

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = dist.new_group([0])
    torch.manual_seed(0)
    logits = (torch.randn(64, 50) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 50, (64,))

    def loss(output, targets):
        return F.cross_entropy(output.reshape(-1, 50), targets.reshape(-1))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = loss(logits, targets)
        ours = parallel_loss(loss)(logits, targets, group)
    print(theirs.dtype, ours.dtype, float((theirs - ours).abs()))
    dist.destroy_process_group()
"""


def test_the_fused_vocabulary_parallel_loss_is_fp32_under_autocast(tmp_path):
    """The user's F.cross_entropy upcasts bf16 logits under autocast; the fused loss that
    replaces it on vocabulary-sharded logits does too (in bf16 it is off by about 1e-2)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "fused.py").write_text(textwrap.dedent(FUSED_LOSS).replace("{port}", str(port)))
    result = subprocess.run([sys.executable, "fused.py"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs, ours, difference = result.stdout.split()
    assert theirs == ours == "torch.float32"
    assert float(difference) < 1e-5


# ---------------------------------------------------------------- 8: shapes and dtypes

@pytest.mark.torchrun
def test_a_shape_that_changes_inside_an_iteration_is_refused_naming_the_micro_batch(tmp_path):
    plan = _solved(tmp_path, "drop", TWO.format(name="drop", last=1, build="dropping",
                                                loss="mean_loss"))
    result = _pyplan(tmp_path, "run", plan, "--nproc-per-node", 2, "--device", "cpu",
                     "--fault-timeout", 10)
    assert result.returncode == 2  # the user's block: bad input, on every rank
    assert "error: rank 0 failed at instruction" in result.stderr, result.stderr[-3000:]
    assert ("returned a tensor float32 (" in result.stderr and
            "but block 'a' (micro-batch 0) returned a tensor float32 (" in result.stderr and
            "in this iteration: between stages, structures and shapes may change from one "
            "iteration to the next, not between the micro-batches of one" in result.stderr), \
        result.stderr


@pytest.mark.torchrun
def test_an_int16_tensor_crosses_stages(tmp_path):
    """NCCL has no int16: it travels as its bytes (on gloo too, one path)."""
    plan = _solved(tmp_path, "coded", TWO.format(name="coded", last=1, build="coded",
                                                 loss="loss"))
    result = _pyplan(tmp_path, "run", plan, "--nproc-per-node", 2, "--device", "cpu",
                     "--check", "--iterations", 2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "match the single-process run" in result.stdout


# ---------------------------------------------------------------- 9: aliasing and ties

def test_w_does_not_leave_a_weight_gradient_aliasing_what_b_handed_on():
    """y = x + p: B hands on the output's gradient as x's; W must not store that very tensor
    as p.grad, which the next micro-batches' W add to while it may still be being sent."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    sent = []
    for _ in range(2):
        x = torch.randn(4, 3).requires_grad_()
        grad = torch.randn(4, 3)
        (gx,), work = backward_input([x + p], [grad], [x], [p])
        sent.append((gx, gx.clone()))
        backward_weight(work)
    assert all(torch.equal(gx, copy) for gx, copy in sent)  # untouched by the second W
    assert torch.equal(p.grad, sent[0][1] + sent[1][1])


@pytest.mark.torchrun
def test_an_input_a_stage_hands_on_unchanged_is_not_freed_before_it_is_sent(tmp_path):
    """b returns its second input as it came (a skip connection past it): that tensor's memory
    must outlive b's forward, as b sends it on (freed there, the send read freed memory)."""
    plan = _solved(tmp_path, "relay", THREE.format(name="relay", split="", build="relay",
                                                   loss="loss"))
    result = _pyplan(tmp_path, "run", plan, "--nproc-per-node", 3, "--check", "--iterations",
                     2, "--device", "cpu", "--fault-timeout", 30)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "match the single-process run" in result.stdout


TIED = """\
pyplan: 1
name: tied
devices: 2
memory: 6
micro_batches: 4
training: {backward: {time_ratio: 2}}
blocks:
  - {name: s0, devices: [0, 1], time: 1, memory: 1}
  - {name: s1, devices: [1], time: 1, memory: 1}
model:
  module: review:tied
  stages:
    s0: [embed, layers.0]
    s1: [layers.1, layers.2, head]
  data: review:tokens
  loss: review:token_loss
"""


@pytest.mark.torchrun
def test_a_tie_held_by_a_block_on_two_devices_is_summed_once(tmp_path):
    """The embedding (in a block on devices 0 and 1) and the head (device 1) share a weight:
    its gradient is each block's once, not the two-device block's twice."""
    plan = _solved(tmp_path, "tied", TIED)
    result = _pyplan(tmp_path, "run", plan, "--nproc-per-node", 2, "--device", "cpu",
                     "--check", "--iterations", 3, "--clip-grad-norm", "0.5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "match the single-process run" in result.stdout
    assert "tied parameters (gradients summed over their copies): embed.weight" in result.stdout


# ---------------------------------------------------------------- 10: start-up grace

WATCHDOG = """\
    import os
    import sys
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from pyplan.train.faults import Watchdog

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True,
                          timeout=timedelta(seconds=30))
    startup = float(sys.argv[2])
    dog = Watchdog(0, 2, 1.0, lambda: (-1, 0), lambda r, i, x: "set-up", startup=startup)
    time.sleep(3)  # rank 1 still builds its stages: not heard from for 3 timeouts
    print("alive", flush=True)
    peer = dist.PrefixStore("pyplan/", store)
    for beat in range(1, 11):
        peer.set("hb/1", f"{beat} -1 0 R")
        time.sleep(0.2)
    print("heard", flush=True)
    time.sleep(4)  # rank 1 stops: dead after the timeout
    print("never", flush=True)
"""


def test_a_rank_still_building_its_stages_is_not_declared_dead(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "dog.py").write_text(textwrap.dedent(WATCHDOG))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "dog.py", str(port), "60"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=120)
    assert result.stdout.split() == ["alive", "heard"], (result.stdout, result.stderr)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: rank 0 stops: rank 1 stopped responding for 1 s "
                                     "(its process is stopped or hangs, or its host is "
                                     "lost); last seen at set-up")
    assert time.monotonic() - started < 60
    # A rank never heard from is dead once the grace is over.
    result = subprocess.run([sys.executable, "dog.py", str(port), "2"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=120)
    assert result.stdout == "" and result.returncode == 1
    assert result.stderr.strip() == ("error: rank 0 stops: rank 1 did not start within 2 s "
                                     "(its process died or hangs while building its stages)")


# ---------------------------------------------------------------- 11: DTensor parameters

@pytest.mark.torchrun
def test_dtensor_parameters_are_refused_in_one_line(tmp_path):
    text = TWO.format(name="tp", last="0, 1", build="dtensor", loss="loss")
    plan = _solved(tmp_path, "tp", text)
    result = _pyplan(tmp_path, "run", plan, "--nproc-per-node", 2, "--device", "cpu")
    assert result.returncode == 2, result.stderr[-3000:]  # every worker's: bad input
    line = ("error: block 'b': parameter weight is a DTensor (parallelize_module?); pyplan "
            "handles a block's parameters as plain tensors (hint: keep this rank's chunk as a "
            "plain parameter marked with pyplan.runtime.shard(param, dim))")
    assert result.stderr.splitlines().count(line) == 2, result.stderr[-3000:]  # each rank's
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- 12: casts and norms

CASTS = """\
    import sys

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import review
    from pyplan.runtime import Pipeline

    pipe = Pipeline(sys.argv[1], device="cpu", dtype="bf16")
    params = {id(p) for p in pipe.parameters()}

    class Casts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_to_copy" and id(args[0]) in params:
                Casts.count += 1
            return func(*args, **(kwargs or {}))

    inputs, targets = review.batch(0)
    with Casts():
        pipe.step(inputs, targets)
        pipe.step(inputs, targets)
    print("casts", Casts.count, "parameters", len(params))
    pipe.close()
"""


@pytest.mark.slow
@pytest.mark.torchrun
def test_autocast_casts_each_weight_once_per_iteration_not_per_micro_batch(tmp_path):
    text = TWO.format(name="one", last=0, build="two", loss="loss").replace(
        "devices: 2", "devices: 1")
    plan = _solved(tmp_path, "one", text)
    result = _torchrun(tmp_path, CASTS, plan, nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    words = result.stdout.split()
    casts, params = int(words[words.index("casts") + 1]), int(words[-1])
    assert casts == 2 * params  # two iterations of 4 micro-batches: each weight once in each
