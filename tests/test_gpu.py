"""pyplan run on GPUs over NCCL (skipped without them; on one GPU, as benchmarks/gpu_check.py
runs them, the cases of one rank run with both stages on it, the rest need 2 GPUs or more, NCCL
refusing two ranks on one): the same --check as on CPU for 1F1B, a
split backward (zero bubble), blocks on several devices, data x pipeline parallelism, bf16 and
a Hugging Face model, with every host-GPU synchronisation inside an iteration's steps raising
(torch.cuda.set_sync_debug_mode, PYPLAN_CHECK_SYNC=1) and a short collective timeout. Profiling
with CUDA events and the NCCL link measurement run too. The CUDA side of issue 34's review
(tests/test_cuda_paths.py shows the rest on CPU): a caller's NCCL-only group, one GPU visible
per process, sends never waited for, one communicator per direction, int16 over NCCL, fp16
overflow, the fused loss in fp32 under CUDA autocast, clipping and the optimizer's step without
a host synchronisation, a stage without parameters. Issue 47's flags: --compile inductor,
--params bf16, --profile with CUDA kernels, --async-save."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pyplan.runtime import torch

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
MODELS = Path(__file__).resolve().parent / "models"
PYPLAN = str(Path(sys.executable).with_name("pyplan"))

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 1, reason="needs a GPU (2 or more for some cases)")
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one)")
# One GPU: the two stages both on it, one rank (benchmarks/gpu_check.py runs there).
RANKS = min(GPUS, 2)

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


def _run(tmp_path, resolved, ranks: int, *extra, check_sync: bool = True) -> dict:
    env = {**os.environ, "PYPLAN_CHECK_SYNC": "1" if check_sync else "0",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
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


def _on_the_gpus(text: str) -> str:
    """TWO_STAGES as this machine runs it: on one GPU both stages on device 0 (interleaved,
    two chunks), one rank."""
    if RANKS == 2:
        return text
    return text.replace("devices: 2", "devices: 1").replace(
        "shape: {kind: vshape,", "shape: {kind: interleaved, chunks: 2,")


def _solved(tmp_path, name: str, text: str) -> Path:
    plan = tmp_path / f"{name}.yaml"
    plan.write_text(text)
    assert subprocess.run([PYPLAN, "solve", str(plan), "--quiet"]).returncode == 0
    return tmp_path / f"{name}.resolved.yaml"


@pytest.mark.parametrize("split", ["", ", weight_time_ratio: 1"], ids=["1f1b", "zero-bubble"])
def test_the_gpus_train_as_one_process_does(tmp_path, split):
    resolved = _solved(tmp_path, "two", _on_the_gpus(TWO_STAGES.format(name="two", split=split)))
    _run(tmp_path, resolved, RANKS)


def test_bf16_under_autocast_matches_within_its_tolerance(tmp_path):
    resolved = _solved(tmp_path, "bf16",
                       _on_the_gpus(TWO_STAGES.format(name="bf16", split="")))
    report = _run(tmp_path, resolved, RANKS, "--dtype", "bf16")
    assert report["dtype"] == "bf16"


def test_run_compiles_blocks_with_inductor_on_gpus(tmp_path):
    """--compile inductor: steps 1, 3 and 4 run the compiled blocks (step 2, the census's,
    runs eagerly); inductor's first call compiles, which may synchronise: no sync check
    here."""
    resolved = _solved(tmp_path, "compiled",
                       _on_the_gpus(TWO_STAGES.format(name="compiled", split="")))
    report = _run(tmp_path, resolved, RANKS, "--compile", "inductor", "--iterations", "4",
                  "--check-steps", "4", check_sync=False)
    assert report["compile"] == "inductor"
    assert all(r["compiled_graphs"] > 0 for r in report["rank_memory"]), report["rank_memory"]


def test_run_trains_bf16_parameters_through_fp32_masters_on_gpus(tmp_path):
    resolved = _solved(tmp_path, "masters",
                       _on_the_gpus(TWO_STAGES.format(name="masters", split="")))
    report = _run(tmp_path, resolved, RANKS, "--dtype", "bf16", "--params", "bf16")
    assert (report["dtype"], report["params"]) == ("bf16", "bf16")


def test_profile_records_the_cuda_kernels_and_the_blocks(tmp_path):
    resolved = _solved(tmp_path, "profiled",
                       _on_the_gpus(TWO_STAGES.format(name="profiled", split="")))
    _run(tmp_path, resolved, RANKS, "--profile", "prof", check_sync=False)  # (the profiler syncs)
    for rank in range(RANKS):
        trace = json.loads((tmp_path / "prof" / f"rank{rank}-step3.json").read_text())
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        assert any(e.get("cat") == "kernel" for e in events), "no CUDA kernel in the trace"
        blocks = {e["name"] for e in events if "@" in e["name"] and " " not in e["name"]}
        assert {name.split("@")[1] for name in blocks} == {"0", "1", "2", "3"}, blocks


def test_async_saves_on_gpus_resume_as_synchronous_ones(tmp_path):
    """--async-save on CUDA: the state is staged to host memory, DCP writes it over the gloo
    group beside NCCL; the run resumed from it continues with the synchronous run's losses."""
    resolved = _solved(tmp_path, "saved",
                       _on_the_gpus(TWO_STAGES.format(name="saved", split="")))
    sync = _run(tmp_path, resolved, RANKS, "--save", "sync", "--save-every", "1")
    saved = _run(tmp_path, resolved, RANKS, "--save", "async", "--save-every", "1", "--async-save")
    assert saved["losses"] == sync["losses"] and saved["checkpoint"] == "async/step-00000003"
    assert sorted(p.name for p in (tmp_path / "async").iterdir()) == \
        [f"step-0000000{s}" for s in (1, 2, 3)]
    resumed = _run(tmp_path, resolved, RANKS, "--resume", "async/step-00000001", "--iterations",
                   "2")
    assert resumed["losses"] == sync["losses"][1:]


def test_a_tied_hugging_face_model_on_gpus(tmp_path):
    pytest.importorskip("transformers")
    shutil.copy(MODELS / "hf.py", tmp_path / "hf.py")
    one = ["--shape", "interleaved", "--chunks", "2"] if RANKS == 1 else []  # both on it
    made = subprocess.run([PYPLAN, "partition", "hf:gpt2", "--data", "hf:batch", "--loss",
                           "hf:loss", "--devices", str(RANKS), *one, "--device", "cuda", "-o",
                           "gpt2.yaml"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert made.returncode == 0, made.stderr
    assert subprocess.run([PYPLAN, "solve", "gpt2.yaml", "--quiet"], cwd=tmp_path).returncode == 0
    report = _run(tmp_path, tmp_path / "gpt2.resolved.yaml", RANKS)
    assert report["ties"] == ["transformer.wte.weight"]


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("plan", ["gpt-mshape", "gpt-mshape-blocks",
                                  "transformer-vshape-dp2"])
def test_four_gpus_multi_device_blocks_and_data_parallelism(tmp_path, plan):
    shutil.copy(PLANS / f"{plan}.yaml", tmp_path / f"{plan}.yaml")
    shutil.copy(PLANS / f"{plan}.resolved.yaml", tmp_path / f"{plan}.resolved.yaml")
    _run(tmp_path, tmp_path / f"{plan}.resolved.yaml", 4)


@pytest.mark.parametrize("links", [False, pytest.param(True, marks=two_gpus)],
                         ids=["blocks", "links"])
def test_profile_and_links_on_the_gpu(links):
    result = subprocess.run([PYPLAN, "profile", str(PLANS / "transformer-vshape.yaml"),
                             "--device", "cuda", "--json", *(["--links"] if links else [])],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert all(b["forward_ms"] > 0 and b["backward_ms"] > 0 for b in found["blocks"])
    assert not links or found["link"]["bandwidth"] > 0


# ---------------------------------------------------------------- issue 34's review, on GPUs

PAIR = """\
pyplan: 1
name: {name}
devices: 2
memory: 8
micro_batches: 4
training: {{backward: {{time_ratio: 2}}}}
blocks:
  - {{name: a, devices: [0], time: 1, memory: 1}}
  - {{name: b, devices: [1], time: 1, memory: 1}}
constraints:
  order:
    - "a.f[m+3] < a.b[m]"
model: {{blocks: "review:{build}", data: "review:batch", loss: "review:{loss}"}}
"""


def _review_plan(tmp_path, name: str, text: str) -> Path:
    shutil.copy(MODELS / "review.py", tmp_path / "review.py")
    return _solved(tmp_path, name, text)


def _torchrun_script(tmp_path, script: str, *args, nproc: int = 2, env=None):
    """The script on `nproc` ranks, choosing their device as a user's would (without the
    suite's PYPLAN_DEVICE=cpu, which would refuse a caller's NCCL-only group)."""
    (tmp_path / "script.py").write_text(textwrap.dedent(script))
    base = {k: v for k, v in os.environ.items() if k != "PYPLAN_DEVICE"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), "script.py", *map(str, args)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**base, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", **(env or {})})


NCCL_ONLY = """\
    import sys

    import torch
    import torch.distributed as dist

    import review
    from pyplan.runtime import Pipeline
    from pyplan.comm.devices import all_gather_objects

    waits = []

    class Watched:
        \"\"\"A send's transfer, noting a wait on a GPU tensor's send.\"\"\"

        def __init__(self, work, tensor):
            self.work, self.cuda = work, tensor.is_cuda

        def wait(self):
            waits.append(self.cuda)
            return self.work.wait()

        def is_completed(self):
            return self.work.is_completed()

    isend = dist.isend
    dist.isend = lambda tensor, *args, **kwargs: Watched(isend(tensor, *args, **kwargs), tensor)

    dist.init_process_group("nccl")  # the caller's group: no CPU side
    pipe = Pipeline(sys.argv[1])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    for step in range(3):
        inputs, targets = review.batch(step)
        optimizer.zero_grad()
        loss = pipe.step(inputs, targets)
        pipe.clip_grad_norm_(1.0)
        pipe.step_optimizer(optimizer)
    links = {id(g): g for g in pipe.comm.links.values()}
    configs = sorted({dist.get_backend_config(g) for g in links.values()})
    words = ["rank", pipe.rank, pipe.device.type, len(links), configs, sum(waits),
             all_gather_objects(pipe.rank), bool(torch.isfinite(loss))]
    sys.stdout.write(" ".join(map(str, words)) + "\\n")  # one write: ranks share the pipe
    pipe.close()
    dist.destroy_process_group()
"""


@two_gpus
def test_a_callers_nccl_only_group_and_sends_never_waited(tmp_path):
    """Headers and reports go over pyplan's own gloo group (the caller's has no CPU side);
    each direction between the two ranks has one NCCL communicator (2 in all); the GPipe
    order runs ahead without waiting for any send on the GPU (only polled)."""
    plan = _review_plan(tmp_path, "pair", PAIR.format(name="pair", build="two", loss="loss"))
    result = _torchrun_script(tmp_path, NCCL_ONLY, plan)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} cuda 2 ['cuda:nccl'] 0 [0, 1] True" for r in (0, 1)], lines


ONE_VISIBLE = """\
    import os
    import sys

    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]  # as SLURM --gpus-per-task=1

    from pyplan.cli import main

    raise SystemExit(main(["run", sys.argv[1], "--device", "cuda", "--check", "--iterations",
                           "2", "--json"]))
"""


@two_gpus
def test_each_process_seeing_one_gpu_runs_on_it(tmp_path):
    plan = _solved(tmp_path, "two", TWO_STAGES.format(name="two", split=""))
    result = _torchrun_script(tmp_path, ONE_VISIBLE, plan)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["device"] == "cuda" and report["check"]["ok"], report


@two_gpus
def test_an_int16_value_crosses_stages_over_nccl(tmp_path):
    plan = _review_plan(tmp_path, "coded", PAIR.format(name="coded", build="coded",
                                                        loss="loss"))
    _run(tmp_path, plan, 2)


@pytest.mark.skipif(GPUS < 3, reason="needs 3 GPUs")
def test_a_stage_without_parameters_clips_with_the_others_on_gpus(tmp_path):
    text = PAIR.format(name="free", build="free", loss="loss").replace(
        "devices: 2", "devices: 3").replace(
        "  - {name: b, devices: [1], time: 1, memory: 1}\n",
        "  - {name: b, devices: [1], time: 1, memory: 1}\n"
        "  - {name: c, devices: [2], time: 1, memory: 1}\n")
    plan = _review_plan(tmp_path, "free", text)
    report = _run(tmp_path, plan, 3, "--optimizer", "adamw", "--clip-grad-norm", "1.0")
    assert len(report["grad_norms"]) == 3


OVERFLOW_AND_SYNC = """\
    import sys

    import torch

    import review
    from pyplan.runtime import Pipeline

    pipe = Pipeline(sys.argv[1], device="cuda", dtype="fp16")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in pipe.parameters()]
    inputs, targets = review.batch(0)
    pipe.step(inputs, targets)
    overflowed, stepped = pipe.overflow, pipe.step_optimizer(optimizer)
    moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, pipe.parameters()))
    while pipe.overflow:  # the scale halves until the step fits fp16
        pipe.step(inputs, targets)
    sgd = torch.optim.SGD(pipe.parameters(), lr=0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # clipping and stepping: no host synchronisation
    norm = pipe.clip_grad_norm_(1.0)
    clean = pipe.step_optimizer(sgd)
    torch.cuda.set_sync_debug_mode("default")
    words = ["rank", pipe.rank, overflowed, stepped, moved, clean, bool(norm > 0)]
    sys.stdout.write(" ".join(map(str, words)) + "\\n")  # one write: ranks share the pipe
    pipe.close()
"""


@two_gpus
def test_fp16_overflow_skips_the_step_and_clipping_does_not_synchronise(tmp_path):
    plan = _review_plan(tmp_path, "over", PAIR.format(name="over", build="two",
                                                      loss="overflowing_loss"))
    result = _torchrun_script(tmp_path, OVERFLOW_AND_SYNC, plan)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} True False False True True" for r in (0, 1)], lines


FUSED_LOSS = """\
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from pyplan.models.vocab import parallel_loss

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = dist.new_group([0])
    torch.manual_seed(0)
    logits = (torch.randn(64, 50, device="cuda") * 4).to(torch.bfloat16)
    targets = torch.randint(0, 50, (64,), device="cuda")

    def loss(output, targets):
        return F.cross_entropy(output.reshape(-1, 50), targets.reshape(-1))

    with torch.autocast("cuda", dtype=torch.bfloat16):
        theirs = loss(logits, targets)
        ours = parallel_loss(loss)(logits, targets, group)
    print(theirs.dtype, ours.dtype, float((theirs - ours).abs()))
    dist.destroy_process_group()
"""


def test_the_fused_loss_is_fp32_under_cuda_autocast(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "fused.py").write_text(textwrap.dedent(FUSED_LOSS).replace("{port}", str(port)))
    result = subprocess.run([sys.executable, "fused.py"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs, ours, difference = result.stdout.split()
    assert theirs == ours == "torch.float32" and float(difference) < 1e-5


# ---------------------------------------------------------------- issue 47's review, on GPUs

SENDS_LIVE = """\
    import sys

    import torch

    import review
    from pyplan.runtime import Pipeline

    pipe = Pipeline(sys.argv[1], device="cuda")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    for step in range(3):
        inputs, targets = review.batch(step)
        optimizer.zero_grad()
        pipe.step(inputs, targets)
        pipe.step_optimizer(optimizer)
    # Every send still listed has not completed; once the GPU is idle, all have.
    pending = all(not x.work.is_completed() for x in pipe.comm.sends.sent)
    torch.cuda.synchronize()
    pipe.comm.sends.poll()
    words = ["rank", pipe.rank, pending, len(pipe.comm.sends.sent), pipe.comm.sending_bytes]
    sys.stdout.write(" ".join(map(str, words)) + "\\n")
    pipe.close()
"""


@two_gpus
def test_an_nccl_sends_tensor_lives_until_its_work_completes(tmp_path):
    plan = _review_plan(tmp_path, "sends", PAIR.format(name="sends", build="two", loss="loss"))
    result = _torchrun_script(tmp_path, SENDS_LIVE, plan)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} True 0 0" for r in (0, 1)], lines


def _review47_plan(tmp_path, name: str, build: str, loss: str = "loss") -> Path:
    shutil.copy(MODELS / "gpu_review.py", tmp_path / "gpu_review.py")
    text = PAIR.format(name=name, build=build, loss=loss).replace('"review:', '"gpu_review:')
    return _solved(tmp_path, name, text)


@two_gpus
def test_a_block_returning_a_cpu_tensor_is_named_with_the_device(tmp_path):
    plan = _review47_plan(tmp_path, "cpu_out", "on_the_cpu")
    result = subprocess.run([PYPLAN, "run", str(plan), "--nproc-per-node", "2", "--device",
                             "cuda"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "block 'a' (micro-batch 0) returned a tensor on cpu, but this rank computes on " \
        "cuda:0" in result.stderr, result.stderr[-3000:]


@two_gpus
def test_fp16_with_a_loss_left_in_fp16_checks(tmp_path):
    """The loss (a mean, which autocast leaves in fp16) is cast up; the backward starts in
    fp32 (issue 47, item 6)."""
    plan = _review47_plan(tmp_path, "half_loss", "two", loss="low_precision_loss")
    report = _run(tmp_path, plan, 2, "--dtype", "fp16")
    assert report["dtype"] == "fp16"


@two_gpus
def test_a_custom_function_split_on_gpus_runs_its_backward_once(tmp_path):
    plan = _review47_plan(tmp_path, "custom", "custom")
    text = plan.with_suffix("").with_suffix(".yaml")
    text.write_text(text.read_text().replace("time_ratio: 2}", "time_ratio: 2, "
                                             "weight_time_ratio: 1}"))
    plan = _solved(tmp_path, "custom", text.read_text())
    counts = tmp_path / "counts"
    os.environ["GPU_REVIEW_COUNTS"] = str(counts)
    try:
        _run(tmp_path, plan, 2)
    finally:
        del os.environ["GPU_REVIEW_COUNTS"]
    assert len(Path(f"{counts}1").read_text().splitlines()) == 3 * 4  # iterations x micro-batches


NO_LOCAL_RANK = """\
    import os
    import sys

    import torch
    import torch.distributed as dist

    import review
    from pyplan.runtime import Pipeline

    del os.environ["LOCAL_RANK"]  # as mpirun or a Python launcher
    dist.init_process_group("nccl")
    pipe = Pipeline(sys.argv[1])
    inputs, targets = review.batch(0)
    pipe.step(inputs, targets)
    sys.stdout.write(f"rank {pipe.rank} {pipe.device}\\n")
    pipe.close()
    dist.destroy_process_group()
"""


@two_gpus
def test_a_callers_nccl_group_without_local_rank_puts_each_rank_on_its_own_gpu(tmp_path):
    plan = _review_plan(tmp_path, "nolocal", PAIR.format(name="nolocal", build="two",
                                                         loss="loss"))
    result = _torchrun_script(tmp_path, NO_LOCAL_RANK, plan)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0 cuda:0", "rank 1 cuda:1"], lines


HIDDEN = """\
    import os
    import sys

    if os.environ["RANK"] == "1":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch looks at the GPUs

    from pyplan.cli import main

    raise SystemExit(main(["run", sys.argv[1], "--device", "auto", "--json"]))
"""


@two_gpus
def test_auto_on_the_cpu_says_which_rank_has_no_gpu_and_why(tmp_path):
    plan = _solved(tmp_path, "two", TWO_STAGES.format(name="two", split=""))
    result = _torchrun_script(tmp_path, HIDDEN, plan)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1])["device"] == "cpu"
    assert "warning: --device auto runs on the CPU: rank 1 has no GPU: " \
        "CUDA_VISIBLE_DEVICES='' hides every GPU" in result.stderr, result.stderr[-3000:]
