"""Tensor parallelism of a Mixture-of-Experts model's experts (pyplan.mesh.experts): where each
tensor rank's slice of every expert goes (one process, torch's fake process group standing in
for the other rank: placements and shapes, not values), the models it refuses in one line,
and tiny MoEs (4 experts, top 2) trained on 4 gloo ranks against single-process training
(`pyplan run --check`): Qwen3-MoE TP 2 x PP 2 sequence-parallel from `pyplan partition
--tensor 2`'s plan (its q and k norms' gradients summed over the tensor ranks), Qwen2-MoE
(shared experts beside the routed ones) TP 2 x PP 2 without sequence parallelism, Mixtral
TP 2 x FSDP 2 sequence-parallel, Mixtral's experts split whole over 2 tensor ranks
(moe_ep_experts); a Mixtral checkpoint saved at tensor 2 resumes exactly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = Path(__file__).resolve().parent / "models"
PYPLAN = str(Path(sys.executable).with_name("pyplan"))
TRAIN = ("--optimizer", "adamw", "--lr", "0.003", "--clip-grad-norm", "0.5", "--accumulate",
         "2", "--device", "cpu")
SIZES = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)

MOE = '''\
import hf

SIZES = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def mixtral():
    """4 experts of inner width 64, top 2; 4 heads over 2 key/value groups: all divide over
    2 tensor ranks."""
    return hf.build("mixtral", **SIZES)


def qwen2_moe():
    return hf.build("qwen2_moe", **SIZES)


def qwen3_moe():
    return hf.build("qwen3_moe", **SIZES)


def mixtral_odd():
    """experts of inner width 40, which 3 tensor ranks do not divide (its heads, key/value
    heads and width they do)"""
    return hf.build("mixtral", intermediate_size=40, hidden_size=48, num_attention_heads=6,
                    num_key_value_heads=3, head_dim=8)


batch = hf.batch
loss = hf.loss
'''


def _mixtral(**changes):
    from models import hf

    hf.transformers_quiet()
    return hf.build("mixtral", **{**SIZES, **changes})


@pytest.mark.parametrize("sequence", [False, True])
def test_each_tensor_rank_holds_its_slice_of_every_expert(fake_world, sequence):
    """gate_up_proj [experts, 2 x inner, hidden]: the same rows of the gate and of the up
    part (a strided shard), down_proj [experts, hidden, inner] its columns; the router whole;
    with sequence parallelism each MoE block gathers the sequence and reduce-scatters its
    output, so every layer hands on half of it."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from pyplan.mesh.tensor import parallelize, tensor_plan

    model = _mixtral()
    sharded, around = parallelize(model, tensor_plan(model), fake_world, where="plan",
                                  sequence=sequence)
    blocks = [f"model.layers.{i}.mlp" for i in range(4)]
    assert {p for p, s in sharded.items() if s == "moe_tp_experts"} == \
        {f"{b}.experts" for b in blocks}
    experts, router = model.model.layers[0].mlp.experts, model.model.layers[0].mlp.gate
    assert experts.gate_up_proj.placements == (_StridedShard(1, split_factor=2),)
    assert experts.gate_up_proj.to_local().shape == (4, 64, 32)
    assert experts.down_proj.placements == (Shard(2),)
    assert experts.down_proj.to_local().shape == (4, 32, 32)
    assert not isinstance(router.weight, DTensor)
    if not sequence:
        assert around is None
        return
    assert around.moe == {b: "gate" for b in blocks}
    assert around.gathered == tuple(f"model.layers.{i}.self_attn" for i in range(4))
    seen = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, a, out: seen.append(tuple(
            (out[0] if isinstance(out, tuple) else out).shape)))
    model(torch.randint(3, 128, (2, 16)))
    assert seen == [(2, 8, 32)] * 4


@pytest.mark.parametrize("family, sequence, changes, message", [
    ("mixtral", False, dict(intermediate_size=33), "mesh.tensor 2 does not divide the "
     "experts' inner width (33) of model.layers.0.mlp.experts.gate_up_proj"),
    ("mixtral", False, dict(intermediate_size=36), "each of 2 tensor ranks would hold 18 of "
     "the experts' inner width of model.layers.0.mlp.experts.gate_up_proj, whose rows "
     "transformers' grouped_mm experts need in multiples of 16 bytes"),
    ("qwen2_moe", True, {}, "MoE block model.layers.0.mlp holds gate, experts, shared_expert, "
     "shared_expert_gate: sequence parallelism reduces a block of a router and its experts "
     "only"),
    ("mixtral", True, dict(router_jitter_noise=0.1), "MoE block model.layers.0.mlp "
     "multiplies its input by random jitter"),
])
def test_experts_the_tensor_ranks_cannot_share_are_one_line(fake_world, family, sequence,
                                                            changes, message):
    from models import hf

    from pyplan.errors import PlanError
    from pyplan.mesh.tensor import parallelize, tensor_plan

    hf.transformers_quiet()
    model = hf.build(family, **{**SIZES, **changes})
    with pytest.raises(PlanError) as raised:
        parallelize(model, tensor_plan(model), fake_world, where="plan", sequence=sequence)
    assert message in str(raised.value) and "\n" not in str(raised.value), raised.value
    assert raised.value.hint


def test_qwen3s_head_norms_are_replicated_with_their_gradients_summed(fake_world):
    """Qwen3(-MoE)'s q and k norms run on each rank's heads: their weights are replicated
    DTensors whose gradients are each rank's part (replicated_with_grad_allreduce); its
    experts are sharded as Mixtral's."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    from models import hf

    from pyplan.mesh.tensor import parallelize, tensor_plan

    hf.transformers_quiet()
    model = hf.build("qwen3_moe", **SIZES)
    sharded, _ = parallelize(model, tensor_plan(model), fake_world, where="plan")
    attention = model.model.layers[0].self_attn
    assert sharded["model.layers.0.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    for norm in (attention.q_norm, attention.k_norm):
        assert isinstance(norm.weight, DTensor) and norm.weight.placements == (Replicate(),)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.placements == (_StridedShard(1, split_factor=2),)
    model(torch.randint(3, 128, (2, 16)))


def test_expert_parallelism_gives_each_tensor_rank_whole_experts(fake_world):
    """moe_ep_experts: each of 2 tensor ranks holds 2 of the 4 experts whole (Shard(0)) and
    routes the others' tokens to transformers' expert-parallel sentinel; 3 experts do not
    split over 2 ranks."""
    from torch.distributed.tensor import Shard

    from pyplan.errors import PlanError
    from pyplan.mesh.tensor import parallelize, tensor_plan

    ep = {"model.layers.*.mlp.experts": "moe_ep_experts"}
    model = _mixtral()
    sharded, around = parallelize(model, tensor_plan(model, ep), fake_world, where="plan",
                                  sequence=True)
    experts = model.model.layers[0].mlp.experts
    assert sharded["model.layers.0.mlp.experts"] == "moe_ep_experts"
    assert experts.gate_up_proj.placements == experts.down_proj.placements == (Shard(0),)
    assert experts.gate_up_proj.to_local().shape == (2, 128, 32)
    assert experts.num_experts == 2 and experts._is_expert_parallel
    assert around.moe["model.layers.0.mlp"] == "gate"
    model(torch.randint(3, 128, (2, 16)))
    odd = _mixtral(num_local_experts=3, num_experts=3)  # (the second an alias of the first)
    with pytest.raises(PlanError) as raised:
        parallelize(odd, tensor_plan(odd, ep), fake_world, where="plan")
    assert "mesh.tensor 2 does not divide the 3 experts of model.layers.0.mlp.experts" in \
        str(raised.value)


def test_a_module_that_is_not_transformers_fused_experts_is_refused(fake_world):
    from torch import nn

    from pyplan.errors import PlanError
    from pyplan.mesh.tensor import parallelize

    model = nn.Module()
    model.experts = nn.Linear(8, 8)
    with pytest.raises(PlanError) as raised:
        parallelize(model, {"experts": "moe_tp_experts"}, fake_world, where="plan")
    assert "module experts (Linear) is not transformers' fused experts" in str(raised.value)


def _pyplan(cwd, *args, timeout=300):
    return subprocess.run([PYPLAN, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory):
    """Qwen3-MoE on 2 devices, Qwen2-MoE on 2 devices (without sequence parallelism) and
    Mixtral on 1 device priced per tensor rank (--tensor 2); the odd-width one on 1 device."""
    folder = tmp_path_factory.mktemp("experts")
    shutil.copy(MODELS / "hf.py", folder / "hf.py")
    (folder / "moe.py").write_text(MOE)
    for name, factory, devices, extra in (("q3-tp", "qwen3_moe", 2, ("--tensor", "2")),
                                          ("q2-tp", "qwen2_moe", 2,
                                           ("--tensor", "2", "--no-sequence-parallel")),
                                          ("mix1-tp", "mixtral", 1, ("--tensor", "2")),
                                          ("odd1", "mixtral_odd", 1, ())):
        made = _pyplan(folder, "partition", f"moe:{factory}", "--data", "moe:batch",
                       "--loss", "moe:loss", "--devices", devices, "--repeats", "1",
                       "-o", f"{name}.yaml", *extra)
        assert made.returncode == 0, made.stderr
    return folder


def _meshed(folder: Path, plan: str, mesh: str | None, name: str) -> str:
    text = (folder / f"{plan}.yaml").read_text()
    if mesh is not None:  # (in place of the plan's own)
        text = "".join(line for line in text.splitlines(keepends=True)
                       if not line.startswith("mesh:"))
        text = text.replace("\ntraining:", f"\nmesh: {mesh}\ntraining:")
    (folder / f"{name}.yaml").write_text(text)
    solved = _pyplan(folder, "solve", f"{name}.yaml", "--quiet")
    assert solved.returncode == 0, solved.stderr
    return f"{name}.resolved.yaml"


def _run(folder: Path, resolved: str, ranks: int, *extra):
    return _pyplan(folder, "run", resolved, "--nproc-per-node", ranks, "--json", *extra)


@pytest.mark.torchrun
@pytest.mark.parametrize("plan, mesh", [
    ("q3-tp", None),                                     # TP 2 x PP 2, sequence-parallel
    ("q2-tp", None),                                     # TP 2 x PP 2, shared experts
    ("mix1-tp", "{tensor: 2, priced: 2, data: 2, shard: true}"),  # TP 2 x FSDP 2
    ("mix1-tp", "{tensor: 2, priced: 2, "
                "tensor_plan: {'model.layers.*.mlp.experts': moe_ep_experts}}"),
])
def test_tensor_parallel_experts_train_the_single_process_model(partitioned, plan, mesh):
    if plan == "q3-tp":
        assert "\nmesh: {tensor: 2, priced: 2}\n" in (partitioned / f"{plan}.yaml").read_text()
    name = f"{plan}-" + "".join(c for c in mesh or "" if c.isalnum())
    ranks = 2 if plan == "mix1-tp" and "data" not in mesh else 4  # (EP 2: one stage)
    done = _run(partitioned, _meshed(partitioned, plan, mesh, name), ranks, "--iterations", 3,
                "--check", *TRAIN)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["check"]["ok"], report["check"]


@pytest.mark.slow
@pytest.mark.torchrun
def test_tensor_parallel_experts_save_and_resume_exactly(partitioned):
    """gate_up_proj's strided shards are checkpointed whole (pyplan.mesh.state), cut back on
    load: 2 steps saved and 2 resumed at tensor 2 (2 ranks) are an uninterrupted run's 4."""
    resolved = _meshed(partitioned, "mix1-tp", None, "mix1-saved")

    def losses(*extra):
        done = _run(partitioned, resolved, 2, "--optimizer", "adamw", "--device", "cpu",
                    *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])["losses"]
    whole = losses("--iterations", 4)
    assert losses("--iterations", 2, "--save", "moe-ck") == whole[:2]
    assert losses("--iterations", 2, "--resume", "moe-ck") == whole[2:]


@pytest.mark.torchrun
def test_experts_a_tensor_degree_does_not_divide_are_one_line(partitioned):
    # (priced written by hand: the refusal is run's, the costs do not matter here)
    resolved = _meshed(partitioned, "odd1", "{tensor: 3, priced: 3}", "odd1-tp")
    done = _run(partitioned, resolved, 3, "--device", "cpu")
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors and all("mesh.tensor 3 does not divide the experts' inner width (40)" in line
                          for line in errors), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
