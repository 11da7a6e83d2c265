"""The third CUDA/NCCL review's findings (issue 47), each shown where a CPU can show it: the GPU a
rank takes without LOCAL_RANK, the rendezvous traffic of choosing the device, why --device auto
runs on the CPU. tests/test_gpu.py runs the CUDA side."""

from __future__ import annotations

import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest

from pyplan.errors import RunError
from pyplan.runtime import torch
from pyplan.comm import devices
from pyplan.comm import Sends
from pyplan.comm.devices import Choice, Seen, agree, choose
from warm_torchrun import torchrun

FOUR = tuple(f"GPU-{i}" for i in range(4))
MODELS = Path(__file__).resolve().parent / "models"
PYPLAN = str(Path(sys.executable).with_name("pyplan"))

PAIR = """\
pyplan: 1
name: {name}
devices: 2
memory: 8
micro_batches: 4
training: {{backward: {{time_ratio: 2{split}}}}}
blocks:
  - {{name: a, devices: [0], time: 1, memory: 1}}
  - {{name: b, devices: [1], time: 1, memory: 1}}
model: {{blocks: "gpu_review:{build}", data: "gpu_review:batch", loss: "gpu_review:{loss}"}}
"""


def _pyplan(tmp_path, *args, env=None, timeout=300):
    return subprocess.run([PYPLAN, *map(str, args)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=timeout, env={**os.environ, **(env or {})})


def _solved(tmp_path, name: str, build: str, loss: str = "loss", split: str = "") -> str:
    shutil.copy(MODELS / "gpu_review.py", tmp_path / "gpu_review.py")
    (tmp_path / f"{name}.yaml").write_text(PAIR.format(name=name, build=build, loss=loss,
                                                       split=split))
    result = _pyplan(tmp_path, "solve", f"{name}.yaml", "--quiet")
    assert result.returncode == 0, result.stderr
    return f"{name}.resolved.yaml"


# ---------------------------------------------------------------- 1: no LOCAL_RANK

def test_without_local_rank_a_rank_takes_its_position_among_its_hosts_ranks():
    """mpirun or a Python launcher sets no LOCAL_RANK: every rank used to take GPU 0 (and the
    world fell back to the CPU, or NCCL failed on a caller's group)."""
    hosts = ["a", "b", "a", "b", "a", "b", "a", "b"]  # ranks interleaved over two hosts
    seen = [Seen(host, FOUR, None) for host in hosts]
    assert choose("auto", seen) == Choice(True, (0, 0, 1, 1, 2, 2, 3, 3))
    # LOCAL_RANK, where a launcher sets it, wins.
    assert choose("auto", [Seen("a", FOUR, 3), Seen("a", FOUR, 2)]).gpus == (3, 2)
    # More ranks on a host than GPUs: two would share one.
    with pytest.raises(RunError, match=r"ranks 0 and 4 would share one GPU \(a/GPU-0\)"):
        choose("cuda", [Seen("a", FOUR, None) for _ in range(5)])


CALLERS_GROUP = """\
    import os
    import sys

    import torch
    import torch.distributed as dist

    from pyplan.errors import RunError
    from pyplan.comm import devices

    dist.init_process_group("gloo")
    del os.environ["LOCAL_RANK"]  # as mpirun or a Python launcher
    # A node of two GPUs, seen through the caller's NCCL group (faked: the CPU has neither).
    dist.get_backend_config = lambda group=None: "cpu:gloo,cuda:nccl"
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    uuids = sys.argv[1].split(",")
    torch.cuda.device_count = lambda: len(uuids)

    class Properties:
        def __init__(self, index):
            self.uuid = uuids[index]

    torch.cuda.get_device_properties = Properties
    try:
        found = str(devices._device_of_group("auto"))
    except RunError as exc:
        found = str(exc)
    sys.stdout.write(f"rank {dist.get_rank()}: {found}\\n")
    dist.destroy_process_group()
"""


@pytest.mark.torchrun
def test_a_callers_group_without_local_rank_gives_each_rank_its_own_gpu(tmp_path):
    (tmp_path / "script.py").write_text(textwrap.dedent(CALLERS_GROUP))
    result = torchrun("script.py", "GPU-a,GPU-b", nproc=2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(result.stdout.splitlines()) == ["rank 0: cuda:0", "rank 1: cuda:1"]
    # One GPU on the node for both ranks: refused in one line, before NCCL fails obscurely.
    result = torchrun("script.py", "GPU-a", nproc=2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    host = socket.gethostname()
    expected = (f"error: the process group's backend is cpu:gloo,cuda:nccl, but ranks 0 and 1 "
                f"would share one GPU ({host}/GPU-a) (hint: start one process per GPU, or "
                "create the group with init_process_group(..., device_id=torch.device('cuda', "
                "i)))")
    assert sorted(result.stdout.splitlines()) == [f"rank {r}: {expected}" for r in (0, 1)]


# ---------------------------------------------------------------- 10: --device auto says why

@pytest.mark.parametrize("cuda, visible, warned, nvidia, expected", [
    ("12.4", "", [], True, "CUDA_VISIBLE_DEVICES='' hides every GPU"),
    ("12.4", None, ["CUDA initialization: The NVIDIA driver on your system is too old "
                    "(found version 11040).\nPlease update"], True,
     "CUDA initialization: The NVIDIA driver on your system is too old (found version 11040)."),
    ("12.4", "3", [], True, "torch finds no GPU among CUDA_VISIBLE_DEVICES='3'"),
    (None, None, [], True, f"torch {torch.__version__} is built without CUDA"),
    (None, None, [], False, ""),  # a machine without CUDA: nothing to say
    ("12.4", None, [], False, ""),
], ids=["hidden", "driver", "not-visible", "cpu-build", "no-cuda", "cuda-build-no-gpu"])
def test_why_a_rank_has_no_gpu(monkeypatch, cuda, visible, warned, nvidia, expected):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(devices.Path, "exists", lambda self: nvidia)
    assert devices._why_no_gpu(warned) == expected


def test_seen_here_reads_torchs_warning_when_cuda_fails(monkeypatch):
    def failing() -> bool:
        warnings.warn("CUDA initialization: Found no NVIDIA driver on your system.")
        return False

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", failing)
    monkeypatch.setenv("LOCAL_RANK", "2")
    seen = devices.seen_here()
    assert (seen.gpus, seen.local_rank, seen.why_none) == \
        ((), 2, "CUDA initialization: Found no NVIDIA driver on your system.")


def test_auto_on_the_cpu_says_which_rank_and_why():
    driver = "CUDA initialization: The NVIDIA driver on your system is too old"
    seen = [Seen("a", ("GPU-0",), 0), Seen("a", (), 1, driver), Seen("b", (), 0, driver)]
    assert choose("auto", seen).why_cpu == f"rank 1 has no GPU: {driver} (2 of 3 ranks have none)"
    assert choose("auto", [Seen("a", FOUR, 0), Seen("a", (), 1)]).why_cpu == "rank 1 has no GPU"
    assert choose("auto", [Seen("a", (), 0), Seen("b", (), 0)]).why_cpu == ""  # no CUDA at all


# ---------------------------------------------------------------- 11: O(ranks) store traffic

class CountingStore:
    """A store shared by threads, counting what each key is read and written."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.reads: collections.Counter = collections.Counter()
        self.writes: collections.Counter = collections.Counter()
        self.requests = 0
        self.changed = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self.changed:
            self.requests += 1
            self.writes[key] += 1
            self.values[key] = value
            self.changed.notify_all()

    def wait(self, keys: list[str]) -> None:
        with self.changed:
            self.requests += 1
            assert self.changed.wait_for(lambda: all(k in self.values for k in keys), 30)

    def get(self, key: str) -> str:
        self.wait([key])
        with self.changed:
            self.reads[key] += 1
            return self.values[key]

    def multi_get(self, keys: list[str]) -> list[str]:
        with self.changed:
            self.requests += 1
            self.reads.update(keys)
            return [self.values[k] for k in keys]


@pytest.mark.parametrize("request_", ["auto", "cuda", "cpu"])
def test_choosing_the_device_reads_each_key_once(request_, capsys):
    """Every rank used to read every rank's key: world^2 reads (a million at a thousand
    ranks). Now each of the 2 x world - 1 keys is written and read once."""
    world = 64
    store = CountingStore()
    found: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            found[r] = agree(store, r, world, request_, Seen(f"node{r // 8}", FOUR[:2], r % 8))
        except RunError as exc:
            found[r] = str(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = 2 * world - 1
    assert len(store.writes) == len(store.reads) == keys
    assert set(store.writes.values()) == set(store.reads.values()) == {1}
    assert store.requests <= 3 * world + 1  # O(world) requests too (rank 0: one multi_get)
    # 8 ranks per node, 2 GPUs each: ranks 0 and 2 would share GPU 0 of node0.
    share = "ranks 0 and 2 would share one GPU (node0/GPU-0)"
    if request_ == "cuda":
        assert set(found.values()) == {f"error: --device cuda, but {share} (hint: start at most "
                                       "one process per GPU on each node, or use --device cpu)"}
    else:
        assert set(found.values()) == {None}
    err = capsys.readouterr().err
    assert err == (f"warning: --device auto runs on the CPU: {share}\n"
                   if request_ == "auto" else "")


def test_repeated_joins_agree_under_keys_of_their_own():
    assert next(devices._JOINED) != next(devices._JOINED)


def test_seen_round_trips_through_the_store():
    seen = Seen("host-1", FOUR, None, "CUDA_VISIBLE_DEVICES='' hides every GPU")
    assert Seen.read(seen.text().encode()) == seen



# ---------------------------------------------------------------- 2: a send's buffer lifetime

class Work:
    """A send's Work: complete once `done` is set (NCCL: its CUDA event has fired)."""

    def __init__(self) -> None:
        self.done = False
        self.waits = 0

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.waits += 1
        self.done = True


def test_an_nccl_send_keeps_its_tensor_until_its_work_completes():
    """It used to be dropped when the rank heard back from the peer, or at the iteration's end,
    whether or not NCCL's stream had finished reading it."""
    sends = Sends(lambda work: work.wait())
    works = [Work(), Work()]
    for seq, work in enumerate(works):
        sends.add(work, torch.zeros(4), peer=1, seq=seq, polled=True)
    sends.heard_from(1, 5)  # the peer sent something after both: not a reason to let go
    sends.finish()          # nor the iteration's end
    assert [x.work for x in sends.sent] == works and sends.bytes == 32
    works[0].done = True
    sends.poll()            # released once complete, not waited for
    assert [x.work for x in sends.sent] == works[1:] and sends.bytes == 16
    assert [w.waits for w in works] == [0, 0]
    sends.close()           # the stream waits for what is left, then it goes
    assert sends.sent == [] and sends.bytes == 0 and works[1].waits == 1


def test_a_gloo_send_is_completed_once_the_peer_has_posted_its_receive():
    sends = Sends(lambda work: work.wait())
    early, late = Work(), Work()
    sends.add(early, torch.zeros(2), peer=1, seq=0, polled=False)
    sends.add(late, torch.zeros(2), peer=1, seq=7, polled=False)
    sends.heard_from(1, 3)  # the peer sent at 3: it has posted the receive of the send at 0
    assert (early.waits, late.waits) == (1, 0) and [x.work for x in sends.sent] == [late]
    sends.finish()
    assert late.waits == 1 and sends.sent == []


# ---------------------------------------------------------------- 3: a Function, split

@pytest.mark.torchrun
def test_a_custom_function_under_the_split_backward_runs_its_backward_once(tmp_path):
    """Zero bubble's B and W each used to run the Function's backward (it computes both
    gradients at once): twice the work; now once per micro-batch, and --check agrees."""
    plan = _solved(tmp_path, "custom", "custom", split=", weight_time_ratio: 1")
    counts = tmp_path / "counts"
    result = _pyplan(tmp_path, "run", plan, "--nproc-per-node", 2, "--iterations", 2,
                     "--check", "--json", env={"GPU_REVIEW_COUNTS": str(counts)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1])["check"]["ok"]
    assert len(Path(f"{counts}1").read_text().splitlines()) == 2 * 4  # iterations x micro-batches


# ---------------------------------------------------------------- 5: autocast's weight copies

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocasts_weight_copies_are_not_a_micro_batchs_activations(dtype):
    """Linear, ReLU, Linear, ReLU saves its input and the two ReLU outputs: in fp32 3 x 8 x 256
    floats, under autocast the same in half the bytes. autocast's 16-bit copies of the weights
    (saved for the backward too, but cast once per iteration) used to count as well: 2 x 128
    KiB on top, 22x the activations."""
    from pyplan.comm.values import saved_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU())
    x = torch.randn(8, 256).requires_grad_()
    with saved_bytes(list(model.parameters())) as full:
        model(x.view_as(x))
    with torch.autocast("cpu", dtype=dtype), saved_bytes(list(model.parameters())) as low:
        model(x.view_as(x))
    assert full.bytes == 3 * 8 * 256 * 4
    assert low.bytes == full.bytes // 2


# ---------------------------------------------------------------- 6: the backward's seed

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_backward_of_a_loss_starts_in_fp32(dtype):
    """As GradScaler's fp32 scale: the seed (the micro-batch's share times fp16's scale) used
    to be made in the loss's dtype; 2**16 is inf in fp16."""
    from pyplan.run.executor import loss_seed

    x = torch.randn(4, 3).to(dtype).requires_grad_()
    loss = (x * x).mean()  # mean is no fp32 operation of autocast's: the loss stays in dtype
    (root,), (seed,) = loss_seed(loss, 2.0 ** 16 / 4)
    assert root.dtype == seed.dtype == torch.float32 and float(seed) == 2.0 ** 14
    torch.autograd.backward([root], [seed])
    expected = (2 * x.detach().float() / x.numel() * 2.0 ** 14).to(dtype)
    torch.testing.assert_close(x.grad, expected)


# ---------------------------------------------------------------- 7: a tensor on another device

def test_a_tensor_on_another_device_than_the_ranks_is_named_with_its_block():
    from pyplan.errors import UserCodeError
    from pyplan.comm import on_device

    on_device([torch.zeros(2)], torch.device("cpu"), "block 'a' (micro-batch 0)")
    with pytest.raises(UserCodeError) as caught:
        on_device([torch.zeros(2)], torch.device("cuda", 0), "block 'a' (micro-batch 0)")
    assert str(caught.value) == (
        "error: block 'a' (micro-batch 0) returned a tensor on cpu, but this rank computes on "
        "cuda:0 (hint: create tensors on the input's device (x.device), and leave no .cpu() or "
        ".to(...) in the block's output)")


@pytest.mark.torchrun
def test_a_block_returning_a_tensor_elsewhere_fails_in_one_line_naming_it(tmp_path):
    """On a GPU a .cpu() left in a block (tests/test_gpu.py); here a tensor on the meta device:
    it used to end in a bare TransferError from the send."""
    plan = _solved(tmp_path, "meta", "on_meta")
    result = _pyplan(tmp_path, "run", plan, "--nproc-per-node", 2)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "block 'a' (micro-batch 0) returned a tensor on meta, but this rank computes on " \
        "cpu" in result.stderr, result.stderr[-3000:]


# ---------------------------------------------------------------- 9: tensor-parallel boundaries

def test_tensor_parallel_boundaries_pair_each_tensor_rank_with_its_counterpart():
    """Nothing goes through a stage's first tensor rank: each tensor rank t of a stage sends its
    (replicated) boundary to tensor rank t of the next, over a channel of its own (on NCCL, a
    communicator per direction), for every data index."""
    from pyplan.lower import channels, lower
    from pyplan.planfile import spec_from_text
    from pyplan.problem import build_problem
    from pyplan.solver import solve

    problem = build_problem(spec_from_text(
        "pyplan: 1\nname: tp\ndevices: 3\nmemory: 4\nmicro_batches: 4\n"
        "mesh: {tensor: 2, priced: 2, data: 2}\ntraining: {backward: {time_ratio: 2}}\n"
        "shape: {kind: vshape, stage: {time: 1, memory: 1}}\n"))
    used = channels(lower(problem, solve(problem).schedule))
    coords = problem.mesh.coords
    pairs = {(coords(src), coords(dst), kind) for src, dst, kind in used}
    expected = {((d, i, t), (d + step, i, t), kind) for i in range(2) for t in range(2)
                for d, step, kind in ((0, 1, "activation"), (1, 1, "activation"),
                                      (1, -1, "gradient"), (2, -1, "gradient"))}
    assert pairs == expected and len(used) == len(expected) == 16


# ---------------------------------------------------------------- what GPU users expect

PROFILED = """\
    import sys

    import torch

    import gpu_review
    from pyplan.runtime import Pipeline

    pipe = Pipeline(sys.argv[1], device="cpu", compile=sys.argv[2] or None)
    inputs, targets = gpu_review.batch(0)
    pipe.step(inputs, targets)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.step(inputs, targets)
    names = sorted({e.name for e in prof.events() if "@" in e.name and " " not in e.name})
    sys.stdout.write(f"rank {pipe.rank} {' '.join(names)}\\n")
    pipe.close()
"""


@pytest.mark.torchrun
def test_each_block_is_a_named_range_in_torch_profilers_trace(tmp_path):
    """(On CUDA also an NVTX range, profiler or not: tests/test_gpu.py.)"""
    plan = _solved(tmp_path, "named", "two", split=", weight_time_ratio: 1")
    (tmp_path / "script.py").write_text(textwrap.dedent(PROFILED))
    result = torchrun("script.py", plan, "", nproc=2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    blocks = {0: ("a", "a.b", "a.w"), 1: ("b", "b.b", "b.w")}
    assert lines == [f"rank {r} " + " ".join(sorted(f"{name}@{m}" for name in blocks[r]
                                                     for m in range(4))) for r in (0, 1)]


COMPILED = """\
    import sys

    import torch

    import torch.distributed as dist

    import gpu_review
    from pyplan.runtime import Pipeline

    dist.init_process_group("gloo")  # (one world for both pipelines)
    found = {}
    for backend in (None, "aot_eager"):
        pipe = Pipeline(sys.argv[1], device="cpu", compile=backend)
        inputs, targets = gpu_review.batch(0)
        loss = pipe.step(inputs, targets)
        found[backend] = [float(loss)] + [p.grad.clone() for p in pipe.parameters()]
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        rank = pipe.rank
        pipe.close()
    same = all(torch.allclose(a, b, atol=1e-6) if isinstance(a, torch.Tensor) else
               abs(a - b) < 1e-6 for a, b in zip(found[None], found["aot_eager"]))
    sys.stdout.write(f"rank {rank} {same} graphs {graphs > 0}\\n")
"""


@pytest.mark.torchrun
def test_compiled_blocks_train_as_eager_ones_with_the_split_backward(tmp_path):
    """Pipeline(compile=BACKEND): torch.compile per block (aot_eager here: the CPU's inductor
    build takes minutes on a busy machine); the custom Function's block runs under the split
    backward too."""
    plan = _solved(tmp_path, "compiled", "custom", split=", weight_time_ratio: 1")
    (tmp_path / "script.py").write_text(textwrap.dedent(COMPILED))
    result = torchrun("script.py", plan, nproc=2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} True graphs True" for r in (0, 1)], lines


MASTERS = """\
    import sys

    import torch
    import torch.distributed as dist

    import gpu_review
    from pyplan.runtime import Pipeline

    dist.init_process_group("gloo")  # (one world for both pipelines)
    losses, kinds = {}, {}
    for params in ("fp32", "bf16"):
        pipe = Pipeline(sys.argv[1], device="cpu", dtype="bf16", params=params)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        losses[params] = []
        for step in range(4):
            inputs, targets = gpu_review.batch(step)
            optimizer.zero_grad()
            losses[params].append(float(pipe.step(inputs, targets)))
            pipe.clip_grad_norm_(1.0)
            pipe.step_optimizer(optimizer)
        held = [p for m in pipe.modules.values() for p in m.parameters()]
        kinds[params] = (sorted({str(p.dtype) for p in held}),
                         sorted({str(p.dtype) for p in pipe.parameters()}),
                         sorted({str(t.dtype) for t in pipe.state_dict()["model"].values()}))
        if params == "bf16":  # the blocks hold the masters rounded to bf16
            rounded = all(torch.equal(p, pipe.masters.of[id(p)].to(torch.bfloat16))
                          for p in held)
        rank = pipe.rank
        pipe.close()
    close = max(abs(a - b) for a, b in zip(losses["fp32"], losses["bf16"])) < 5e-2
    moved = losses["bf16"][-1] < losses["bf16"][0]
    sys.stdout.write(f"rank {rank} {kinds['fp32']} {kinds['bf16']} {rounded} {close} "
                     f"{moved}\\n")
"""


@pytest.mark.torchrun
def test_bf16_parameters_train_through_fp32_masters(tmp_path):
    """Pipeline(params="bf16"): the blocks hold bf16 parameters, the optimizer, clipping and
    the state dict fp32 masters (Megatron-LM's --bf16); the losses follow fp32 parameters
    under bf16 autocast within bf16's tolerance."""
    plan = _solved(tmp_path, "masters", "two")
    (tmp_path / "script.py").write_text(textwrap.dedent(MASTERS))
    result = torchrun("script.py", plan, nproc=2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    fp32, bf16 = "['torch.float32']", "['torch.bfloat16']"
    assert lines == [f"rank {r} ({fp32}, {fp32}, {fp32}) ({bf16}, {fp32}, {fp32}) True True "
                     "True" for r in (0, 1)], lines


# ---------------------------------------------------------------- 4: profile in the run's dtype

@pytest.mark.parametrize("dtype, width", [("fp32", 4), ("bf16", 2), ("fp16", 2)])
def test_profile_measures_in_the_runs_dtype(tmp_path, dtype, width):
    """`pyplan profile --dtype` runs the forwards under autocast as `pyplan run --dtype` does:
    block a (a Linear on 8 rows of 16) saves its input as autocast casts it, 8 x 16 x 2 bytes
    in bf16 and fp16 (it measured fp32's 4 bytes per number whatever the run's dtype)."""
    shutil.copy(MODELS / "gpu_review.py", tmp_path / "gpu_review.py")
    (tmp_path / "pair.yaml").write_text(PAIR.format(name="pair", build="two", loss="loss",
                                                    split=""))
    result = _pyplan(tmp_path, "profile", "pair.yaml", "--dtype", dtype, "--json",
                     "--repeats", 1)
    assert result.returncode == 0, result.stderr
    blocks = {b["name"]: b for b in json.loads(result.stdout)["blocks"]}
    assert blocks["a"]["activation_bytes"] == 8 * 16 * width
