"""Tensor and data parallelism inside pipeline stages on torch's own libraries (DeviceMesh,
parallelize_module, FSDP2's fully_shard), each layout trained with AdamW, clipping and
accumulation against single-process training (`pyplan run --check`) on 4 gloo ranks:
TP 2 x PP 2 with a zero-bubble split backward (Llama; sequence-parallel, and without sequence
parallelism), TP 2 x PP 2 sequence-parallel (GPT-2, its planned static memory what each rank
holds), FSDP 2 x PP 2 with a tie across stages (GPT-2), HSDP 2 x 2 and TP 2 x FSDP 2 (Llama,
and GPT-2 with its packed q, k, v), each tensor-parallel plan priced per tensor rank by
`pyplan partition --tensor 2`; a checkpoint saved under one mesh resumes under another to the
same losses; bad meshes get one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import why_ranks_failed

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parent / "models"
PYPLAN = str(Path(sys.executable).with_name("pyplan"))
TRAIN = ("--optimizer", "adamw", "--lr", "0.003", "--clip-grad-norm", "0.5", "--accumulate",
         "2", "--device", "cpu")

MESHED = '''\
import hf


def llama():
    """4 heads over 2 key/value groups: both divide over 2 tensor ranks."""
    return hf.build("llama", num_attention_heads=4, num_key_value_heads=2, head_dim=8)


gpt2 = hf.gpt2


def gpt2_without_dropout():
    """(--check with tensor parallelism needs a model without dropout)"""
    return hf.build("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


batch = hf.batch
loss = hf.loss
'''


def _pyplan(cwd, *args, timeout=300):
    return subprocess.run([PYPLAN, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory):
    """Llama (2 stages, split backward; 1 stage) and GPT-2 (2 stages; 1 stage) partitioned
    once, whole and (-tp) priced per tensor rank of 2."""
    folder = tmp_path_factory.mktemp("meshes")
    shutil.copy(MODELS / "hf.py", folder / "hf.py")
    (folder / "meshed.py").write_text(MESHED)
    tp, adamw = ("--tensor", "2"), ("--optimizer", "adamw")
    for name, factory, devices, extra in (("llama2", "llama", 2, ("--split-backward",)),
                                          ("llama2-tp", "llama", 2, ("--split-backward", *tp)),
                                          ("llama2-tp-nosp", "llama", 2,
                                           ("--split-backward", *tp, "--no-sequence-parallel")),
                                          ("llama1", "llama", 1, ()),
                                          ("llama1-tp", "llama", 1, tp),
                                          ("gpt2", "gpt2", 2, ()),
                                          ("gpt2-nodrop", "gpt2_without_dropout", 2, ()),
                                          ("gpt2-tp", "gpt2_without_dropout", 2, (*tp, *adamw)),
                                          ("gpt2-tp1", "gpt2_without_dropout", 1,
                                           (*tp, *adamw))):
        made = _pyplan(folder, "partition", f"meshed:{factory}", "--data", "meshed:batch",
                       "--loss", "meshed:loss", "--devices", devices, "--repeats", "1",
                       "-o", f"{name}.yaml", *extra)
        assert made.returncode == 0, made.stderr
    return folder


def _meshed(folder: Path, plan: str, mesh: str | None, name: str) -> str:
    """`plan` solved as `name` with `mesh` in place of its own (None: its own)."""
    lines = (folder / f"{plan}.yaml").read_text().split("\n")
    if mesh is not None:
        lines = [line for line in lines if not line.startswith("mesh:")]
        lines.insert(lines.index("training:"), f"mesh: {mesh}")
    (folder / f"{name}.yaml").write_text("\n".join(lines))
    solved = _pyplan(folder, "solve", f"{name}.yaml", "--quiet")
    assert solved.returncode == 0, solved.stderr
    return f"{name}.resolved.yaml"


def _checked(folder: Path, resolved: str, *extra) -> dict:
    done = _pyplan(folder, "run", resolved, "--nproc-per-node", 4, "--iterations", 3,
                   "--check", "--json", *TRAIN, *extra)
    assert done.returncode == 0, why_ranks_failed(done.stderr)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["check"]["ok"], report["check"]
    return report


@pytest.mark.torchrun
def test_a_sharded_run_prints_no_warnings(tmp_path):
    """FSDP2 over a stage whose last module returns a view (a Linear on 3-D input): torch
    warns, per unit, that an in-place op on it would drop FSDP's pre-backward hook; the units'
    outputs are made tensors of their own first, so nothing is said and the gradients hold."""
    from conftest import PLANS

    text = (PLANS / "transformer-vshape-dp2.yaml").read_text()
    assert "mesh: {data: 2, sync: 3}" in text
    (tmp_path / "fsdp.yaml").write_text(text.replace("mesh: {data: 2, sync: 3}",
                                                     "mesh: {data: 2, shard: true, sync: 3}"))
    assert _pyplan(tmp_path, "solve", "fsdp.yaml", "--quiet").returncode == 0
    done = _pyplan(tmp_path, "run", "fsdp.resolved.yaml", "--nproc-per-node", 4,
                   "--iterations", 2, "--check", "--optimizer", "adamw", "--device", "cpu")
    assert done.returncode == 0, why_ranks_failed(done.stderr)
    assert "check: " in done.stdout
    assert "Warning" not in done.stderr, done.stderr[-3000:]


@pytest.mark.torchrun
@pytest.mark.parametrize("plan, mesh", [
    ("llama2-tp-nosp", None),                        # TP 2 x PP 2 without SP, zero bubble
    ("gpt2", "{data: 2, shard: true}"),              # FSDP 2 x PP 2, a tie across the stages
    ("llama1", "{data: 2, shard: 2}"),               # HSDP: 2 replicas of 2 shards
    ("llama1-tp", "{tensor: 2, priced: 2, data: 2, shard: true}"),  # TP 2 x FSDP 2
    ("gpt2-tp", None),                               # SP; GPT-2's packed q, k, v in Conv1D
])
def test_a_meshed_layout_trains_the_single_process_model(partitioned, plan, mesh):
    name = f"{plan}-" + "".join(c for c in mesh or "own" if c.isalnum())
    report = _checked(partitioned, _meshed(partitioned, plan, mesh, name))
    if plan == "gpt2":
        assert report["ties"] == ["transformer.wte.weight"]
    if plan == "gpt2-tp":  # (partitioned for AdamW, as it runs)
        # Each tensor rank's parameters, gradients and AdamW state as planned: its parts of
        # the sharded layers, the embedding, norms and tied head whole (to 0.1%: the stage
        # holding the tied head holds 8 bytes more than planned, without a mesh too).
        for rank in report["rank_memory"]:
            assert rank["static_bytes"] == pytest.approx(rank["planned_static_bytes"],
                                                         rel=1e-3), rank


@pytest.mark.torchrun
def test_a_plan_partition_prices_per_tensor_rank_trains_the_single_process_model(partitioned):
    """`pyplan partition --tensor 2` writes mesh: {tensor: 2, priced: 2} (sequence-parallel,
    its blocks one tensor rank's costs) with one
    tensor rank's costs: the activations its blocks hold are below the whole model's the same
    partition measured (pyplan.cluster.ranks); and TP 2 x PP 2 with a zero-bubble split
    backward, sequence-parallel, trains as one process does."""
    from pyplan.problem import load_problem

    text = (partitioned / "llama2-tp.yaml").read_text()
    assert "\nmesh: {tensor: 2, priced: 2}\n" in text
    held = {name: sum(b.memory for b in load_problem(partitioned / f"{name}.yaml").blocks
                      if b.is_forward) for name in ("llama2", "llama2-tp")}
    assert held["llama2-tp"] < 0.9 * held["llama2"], held
    assert _pyplan(partitioned, "solve", "llama2-tp.yaml", "--quiet").returncode == 0
    _checked(partitioned, "llama2-tp.resolved.yaml")


def _losses(folder: Path, resolved: str, iterations: int, *extra,
            ranks: int = 4) -> list[float]:
    """The losses of an AdamW run of `resolved` on `ranks` CPU ranks (its --json report)."""
    done = _pyplan(folder, "run", resolved, "--nproc-per-node", ranks, "--iterations",
                   iterations, "--json", "--optimizer", "adamw", "--device", "cpu", *extra)
    assert done.returncode == 0, why_ranks_failed(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])["losses"]


@pytest.mark.torchrun
def test_a_checkpoint_resumes_under_another_mesh_to_the_same_losses(partitioned):
    """Saved by 2 replicas (the gradients all-reduced), resumed by 2 FSDP shards: DCP reshards
    the parameters and AdamW's moments; the losses are an uninterrupted run's."""
    replicated = _meshed(partitioned, "gpt2", "{data: 2}", "gpt2-replicated")
    sharded = _meshed(partitioned, "gpt2", "{data: 1, shard: 2}", "gpt2-sharded")
    whole = _losses(partitioned, replicated, 4)
    first = _losses(partitioned, replicated, 2, "--save", "ck")
    second = _losses(partitioned, sharded, 2, "--resume", "ck")
    assert first + second == whole


@pytest.mark.torchrun
def test_packed_tensor_parallel_weights_save_and_resume_under_another_mesh(partitioned):
    """GPT-2's packed q, k, v (c_attn: each tensor rank holds its part of each, laid out
    rank-major, not the model's layout) are checkpointed whole in the model's layout: saved
    at tensor 2, resumed at tensor 2 exactly and at data 2 to the same losses (the replicas'
    all-reduce sums in another order)."""
    tensor = _meshed(partitioned, "gpt2-tp", None, "gpt2-tp-saved")
    data = _meshed(partitioned, "gpt2-nodrop", "{data: 2}", "gpt2-dp-resumed")
    whole = _losses(partitioned, tensor, 4)
    assert _losses(partitioned, tensor, 2, "--save", "tp-ck") == whole[:2]
    assert _losses(partitioned, tensor, 2, "--resume", "tp-ck") == whole[2:]
    assert _losses(partitioned, data, 2, "--resume", "tp-ck") == pytest.approx(whole[2:],
                                                                              rel=1e-6)


@pytest.mark.torchrun
def test_a_packed_layer_is_sharded_by_fsdp_too_and_resumes_under_another_mesh(partitioned):
    """TP 2 x FSDP 2 on GPT-2: FSDP2 shards its packed c_attn (the tensor ranks' parts laid
    out rank-major, a plain Shard FSDP can shard again) and trains as one process does; saved
    there, the run resumes at tensor 2 alone to the uninterrupted run's losses."""
    both = _meshed(partitioned, "gpt2-tp1", "{tensor: 2, priced: 2, data: 2, shard: true}",
                   "gpt2-tp-fsdp")
    tensor = _meshed(partitioned, "gpt2-tp1", None, "gpt2-tp-only")
    whole = _checked(partitioned, both, "--iterations", 4)["losses"]
    assert _losses(partitioned, both, 2, *TRAIN[2:-2], "--save", "fsdp-ck") == whole[:2]
    resumed = _losses(partitioned, tensor, 2, *TRAIN[2:-2], "--resume", "fsdp-ck", ranks=2)
    assert resumed == pytest.approx(whole[2:], rel=1e-6)


@pytest.mark.parametrize("mesh", ["{tensor: 2}", "{tensor: 4, priced: 2}"])
def test_a_tensor_degree_the_costs_were_not_priced_for_is_one_line(partitioned, mesh):
    """A mesh.tensor written onto a plan partitioned without --tensor (or another degree than
    it was priced for) would plan each tensor rank the whole model's (or another share's)
    time and memory: solve refuses it in one line, exit 2."""
    plan = "gpt2-nodrop" if "priced" not in mesh else "gpt2-tp"
    name = f"unpriced-{plan}-" + "".join(c for c in mesh if c.isalnum())
    lines = (partitioned / f"{plan}.yaml").read_text().split("\n")
    lines = [line for line in lines if not line.startswith("mesh:")]
    lines.insert(lines.index("training:"), f"mesh: {mesh}")
    (partitioned / f"{name}.yaml").write_text("\n".join(lines))
    done = _pyplan(partitioned, "solve", f"{name}.yaml", "--quiet")
    assert done.returncode == 2, done.stderr
    row = lines.index(f"mesh: {mesh}") + 1
    assert done.stderr.startswith(f"{name}.yaml:{row}:") and "error: " in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "re-run pyplan partition --tensor 4" in done.stderr if "4" in mesh else \
        "re-run pyplan partition --tensor 2" in done.stderr


@pytest.mark.torchrun
@pytest.mark.parametrize("plan, mesh, extra, message", [
    # (the plan's costs are no tensor rank's: priced written by hand, as this is about run)
    ("gpt2", "{tensor: 2, priced: 2}", ("--check",), "the model has dropout, whose masks "
                                                     "inside tensor-parallel regions are each "
                                                     "tensor rank's own"),
    ("llama1", "{tensor: 3, priced: 3}", (), "mesh.tensor 3 does not divide the model's "
                                             "num_attention_heads (4)"),
])
def test_a_mesh_the_model_cannot_take_is_one_line(partitioned, plan, mesh, extra, message):
    name = f"bad-{plan}-" + "".join(c for c in mesh if c.isalnum())
    resolved = _meshed(partitioned, plan, mesh, name)
    ranks = 4 if plan == "gpt2" else 3
    done = _pyplan(partitioned, "run", resolved, "--nproc-per-node", ranks, "--device", "cpu",
                   *extra)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")
              or ": error:" in line]
    assert errors and all(message in line for line in errors), done.stderr[-3000:]


def test_dropout_in_a_tensor_parallel_region_draws_each_ranks_own_masks():
    """Between a column-wise layer and the row-wise one that closes its region, each tensor
    rank draws its own dropout masks; outside, every rank the same; a rerun from the block's
    seed (recomputation) draws the forward's masks again."""
    from torch import nn

    from pyplan.mesh.tensor import TensorRandom

    def masks(tensor_index: int, seed: int):
        model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 64),
                              nn.Dropout(0.5))
        for layer in (model[0], model[2]):
            nn.init.eye_(layer.weight)
            nn.init.zeros_(layer.bias)
        random = TensorRandom(tensor_index, torch.device("cpu"))
        random.watch(model, {"0": "colwise", "2": "rowwise"})
        seen = []
        model[1].register_forward_hook(lambda m, i, o: seen.append(o != 0))
        model[3].register_forward_hook(lambda m, i, o: seen.append(o != 0))
        torch.manual_seed(seed)
        random.begin(seed)
        with torch.no_grad():
            model(torch.ones(8, 64))
        return seen

    local0, shared0 = masks(0, 7)
    local1, shared1 = masks(1, 7)
    assert not torch.equal(local0, local1)        # each rank's own part: its own masks
    assert torch.equal(shared0[local0 & local1], shared1[local0 & local1])
    again = masks(0, 7)
    assert torch.equal(again[0], local0) and torch.equal(again[1], shared0)


def test_every_placement_a_tensor_plan_gives_counts_as_sharded_or_replicated():
    """clip_grad_norm_ counts a parameter on every tensor rank when each holds its own part:
    torch's Shard and its _StridedShard (which is no Shard), not a Replicate (counted
    once)."""
    from types import SimpleNamespace

    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    from pyplan.run.gradients import tensor_sharded

    def param(placement):
        mesh = SimpleNamespace(mesh_dim_names=("dp_shard", "tp"))
        return SimpleNamespace(device_mesh=mesh, placements=(Shard(0), placement))

    assert tensor_sharded(param(Shard(0))) and tensor_sharded(param(Shard(1)))
    assert tensor_sharded(param(_StridedShard(0, split_factor=3)))
    assert not tensor_sharded(param(Replicate())) and not tensor_sharded(torch.zeros(2))
