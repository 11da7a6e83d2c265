"""Sequence parallelism beside tensor parallelism (`mesh.tensor`, unless `mesh.sequence:
false`): where it goes in a Hugging Face model (one process, torch's fake process group
standing in for the other tensor rank: shapes, not values), what the plan's transfers cost,
and how a plan spells it. Its training against one process (`--check`) is in
tests/test_meshes.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pyplan.problem import build_problem
from pyplan.planfile import load_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))

PLAN = """\
pyplan: 1
name: sp
devices: 2
micro_batches: 2
training:
  backward: {{time_ratio: 2}}
topology: {{time_unit_ms: 1, within_node: {{bandwidth: 1MiB, latency_ms: 0}}}}
{mesh}
blocks:
  - {{name: a, devices: [0], time: 10, memory: 1KiB, output: 4MiB}}
  - {{name: b, devices: [1], time: 10, memory: 1KiB, after: [a]}}
"""


def _problem(tmp_path, mesh: str):
    path = tmp_path / "sp.yaml"
    path.write_text(PLAN.format(mesh=mesh))
    return build_problem(load_spec(path))


def test_each_tensor_rank_sends_its_own_slice_between_stages(tmp_path):
    """4 MiB at 1 MiB/s: 4000 ms whole; each of 2 tensor ranks sends its half of the sequence
    with sequence parallelism, its whole copy without."""
    whole = _problem(tmp_path, "mesh: {tensor: 2, priced: 2, sequence: false}").transfers
    sliced = _problem(tmp_path, "mesh: {tensor: 2, priced: 2}").transfers
    assert max(whole) == 4000 and max(sliced) == 2000
    assert max(_problem(tmp_path, "").transfers) == 4000
    assert _problem(tmp_path, "mesh: {tensor: 2, priced: 2}").mesh.sequence_parallel
    assert not _problem(tmp_path, "mesh: {sequence: true}").mesh.sequence_parallel


def test_a_sequence_key_that_is_not_a_boolean_is_one_line(tmp_path, cli):
    path = tmp_path / "sp.yaml"
    path.write_text(PLAN.format(mesh="mesh: {tensor: 2, priced: 2, sequence: 2}"))
    code, out, err = cli("validate", str(path))
    assert code == 2, err
    lines = err.strip().splitlines()
    line = PLAN.splitlines().index("{mesh}") + 1
    assert lines[0].startswith(f"{path}:{line}:") and "error:" in lines[0] and "sequence" in lines[0]


def test_sequence_false_survives_the_resolved_plan_and_show_says_which(tmp_path, cli):
    for mesh, shown in (("mesh: {tensor: 2, priced: 2}", True), ("mesh: {tensor: 2, priced: 2, sequence: false}",
                                                       False)):
        path = tmp_path / "sp.yaml"
        path.write_text(PLAN.format(mesh=mesh))
        code, _, err = cli("solve", str(path), "--quiet")
        assert code == 0, err
        code, out, err = cli("show", str(tmp_path / "sp.resolved.yaml"))
        assert code == 0, err
        assert ("sequence parallel" in out) is shown, out
        assert ("sequence: false" in (tmp_path / "sp.resolved.yaml").read_text()) is not shown


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2"])
def test_the_residual_stream_runs_in_sequence_slices(fake_world, family):
    """The first layer cuts the sequence in two, every layer hands on its rank's half, the
    norms hold replicated DTensor weights (their gradients summed over the slices), and the
    final norm's output is whole again for the head; without sequence parallelism every
    layer hands on the whole sequence."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from torch.distributed.tensor import DTensor, Replicate

    from models import hf

    from pyplan.mesh.tensor import parallelize, tensor_plan

    for sequence in (True, False):
        gpt2 = family == "gpt2"
        extra = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if gpt2 else \
            dict(num_attention_heads=4, num_key_value_heads=2)
        model = hf.build(family, **extra)
        base = model.transformer if gpt2 else model.model
        layers = base.h if gpt2 else base.layers
        seen = []
        for layer in layers:
            layer.register_forward_hook(lambda m, a, out: seen.append(tuple(
                (out[0] if isinstance(out, tuple) else out).shape)))
        model.lm_head.register_forward_pre_hook(lambda m, a: seen.append(
            ("head", type(a[0]), tuple(a[0].shape))))
        sharded, around = parallelize(model, tensor_plan(model), fake_world, where="plan",
                                      sequence=sequence)
        assert sharded
        tokens = torch.randint(0, hf.VOCAB, (2, hf.SEQUENCE))
        model(tokens)
        width = model.config.hidden_size
        part = hf.SEQUENCE // 2 if sequence else hf.SEQUENCE
        assert seen[:-1] == [(2, part, width)] * len(layers), seen
        assert seen[-1] == ("head", torch.Tensor, (2, hf.SEQUENCE, width))
        norm = (layers[0].ln_1 if gpt2 else layers[0].input_layernorm).weight
        assert isinstance(norm, DTensor) is sequence
        if sequence:
            assert norm.placements == (Replicate(),)
            assert around.first is not None and len(around.gathered) == 2 * len(layers)
        else:
            assert around is None


def test_a_measured_unit_is_priced_per_tensor_rank_by_the_cost_model():
    """`pyplan partition --tensor`: a layer's activations shrink with the tensor degree, more
    with sequence parallelism (pyplan.cluster.memory's counts), its compute shrinks, and its
    forward carries the model's two collectives on the plan's link: all-reduces of the
    layer's activations (b s h, fp32) over 2 ranks, each (2 - 1) / 2 x 2 x bytes / bandwidth
    at no latency; its weights are the rank's the caller counts, its optimizer step over
    that share of them."""
    from pyplan.cluster.model import gpt
    from pyplan.cluster.ranks import rank_units
    from pyplan.partition import UnitCost
    from pyplan.planfile.types import LinkSpec

    model = gpt(2, 256, 8, vocab=1024, sequence=64)
    units = [UnitCost(name, 10.0, 20.0, 1 << 20, 1 << 20, input_bytes=1000,
                      forward_peak_bytes=2 << 20, update_ms=4.0)
             for name in ("embed", "h.0", "h.1", "head")]
    weights = [1 << 20, 1 << 19, 1 << 19, 3 << 18]  # (a rank's: the caller counts them)
    kinds = ["embedding", "layer", "layer", "head"]
    slow = LinkSpec(bandwidth=10**6, latency_ms=0)
    fast = LinkSpec(bandwidth=10**15, latency_ms=0)

    def priced(tensor, sequence_parallel, link):
        return rank_units(units, kinds, model, tensor=tensor,
                          sequence_parallel=sequence_parallel, micro_batch=2, sequence=64,
                          dtype="fp32", link=link, weights=weights)
    assert priced(1, True, slow) == units
    sp, tp = priced(2, True, fast)[1], priced(2, False, fast)[1]
    assert sp.activation_bytes < tp.activation_bytes < units[1].activation_bytes
    assert sp.input_bytes == 500 and tp.input_bytes == 1000
    assert sp.forward_ms < units[1].forward_ms
    assert [u.weight_bytes for u in priced(2, True, fast)] == weights
    assert [u.update_ms for u in priced(2, True, fast)] == [4.0, 2.0, 2.0, 3.0]
    collectives_ms = priced(2, True, slow)[1].forward_ms - sp.forward_ms
    assert collectives_ms == pytest.approx(2 * (2 * 64 * 256 * 4) / 10**6 * 1e3, rel=1e-3)


def test_a_sequence_the_tensor_degree_does_not_divide_is_one_line(fake_world):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models import hf

    from pyplan.errors import RunError
    from pyplan.mesh.tensor import parallelize, tensor_plan

    model = hf.build("llama", num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    parallelize(model, tensor_plan(model), fake_world, where="plan", sequence=True)
    with pytest.raises(RunError) as raised:
        model(torch.randint(0, hf.VOCAB, (2, 15)))
    assert "cuts the sequence into 2 slices, but this micro-batch's has 15 positions" in \
        str(raised.value) and "\n" not in str(raised.value)


def test_a_model_sequence_parallelism_does_not_fit_is_one_line_naming_the_module():
    torch = pytest.importorskip("torch")
    from torch import nn

    from pyplan.errors import PlanError
    from pyplan.mesh.tensor import sequence_modules

    def layer(norm: bool) -> nn.Module:
        found = nn.Module()
        found.mlp = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
        if norm:
            found.norm = nn.LayerNorm(8)
        return found
    model = nn.Module()
    model.layers = nn.ModuleList([layer(True), layer(False)])
    plan = {f"layers.{i}.mlp.{j}": style for i in range(2)
            for j, style in (("0", "colwise"), ("1", "rowwise"))}
    with pytest.raises(PlanError) as raised:
        sequence_modules(model, plan, "plan.yaml")
    assert "decoder layer layers.1 has no norm of its own" in str(raised.value)
    assert raised.value.hint.startswith("give mesh.sequence: false")
    model.layers[1].norm = nn.LayerNorm(8)
    around = sequence_modules(model, plan, "plan.yaml")
    assert around.gathered == ("layers.0.mlp", "layers.1.mlp") and around.first == "layers.0"
    assert around.norms == ("layers.0.norm", "layers.1.norm") and around.final == ()


def test_under_sequence_parallelism_a_ranks_dropout_is_its_own_from_the_first_norm_on():
    """A rank's activations are its own (its slice, its heads) from a layer's first norm to
    the final norm, so dropout there draws each tensor rank's own masks (one region: the
    first norm opens it, the next ones are inside it); after the final norm's gather every
    rank draws the same; a rerun from the block's seed draws the same again."""
    torch = pytest.importorskip("torch")
    from torch import nn

    from pyplan.mesh.tensor import Around, TensorRandom

    def masks(tensor_index: int):
        model = nn.Sequential(nn.LayerNorm(64), nn.Dropout(0.5), nn.LayerNorm(64),
                              nn.Dropout(0.5), nn.LayerNorm(64), nn.Dropout(0.5))
        random = TensorRandom(tensor_index, torch.device("cpu"))
        random.watch(model, {}, Around(("0", "2", "4"), ("4",), None, ()))
        seen = []
        for k in (1, 3, 5):
            model[k].register_forward_hook(lambda m, i, o: seen.append(o != 0))
        torch.manual_seed(7)
        random.begin(7)
        with torch.no_grad():
            model(torch.arange(8 * 64.0).reshape(8, 64))
        return seen

    first, second, after = masks(0)
    other = masks(1)
    assert not torch.equal(first, other[0]) and not torch.equal(second, other[1])
    assert not torch.equal(first, second)        # one stream, two draws
    assert torch.equal(after, other[2])           # after the gather: the same on every rank
    assert all(torch.equal(a, b) for a, b in zip(masks(0), (first, second, after)))


def test_pyplan_plan_writes_whether_its_tensor_parallel_layout_is_sequence_parallel(
        tmp_path, cli):
    """A cluster plan's layout with tp and without sequence parallelism becomes `mesh:
    {..., tensor: 2, sequence: false}` (its activations whole on each tensor rank, as its
    costs counted them); with it, the default."""
    transformers = pytest.importorskip("transformers")
    transformers.AutoConfig.for_model(
        "llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, vocab_size=32000).save_pretrained(
        tmp_path / "llama")
    for flag, written in (("--sequence-parallel", False), ("--no-sequence-parallel", True)):
        out = tmp_path / f"{flag}.yaml"
        code, _, err = cli("plan", str(tmp_path / "llama" / "config.json"), "--cluster",
                           "dgx-h100", "--gpus", "8", "--tp", "2", "--pp", "2", "--dp", "2",
                           "--global-batch", "16", "--seq", "1024", flag, "-o", str(out))
        assert code == 0, err
        mesh = next(line for line in out.read_text().splitlines() if line.startswith("mesh:"))
        assert "tensor: 2" in mesh and ("sequence: false" in mesh) is written, mesh


def test_partition_tensor_on_a_model_it_cannot_price_is_one_line(tmp_path, cli):
    """`--tensor` prices a Hugging Face model's decoder layers; pyplan's example transformer
    (a chain of its own modules, no config) gets one line naming it, exit 2, nothing
    written."""
    pytest.importorskip("torch")
    out = tmp_path / "t.yaml"
    code, _, err = cli("partition", "pyplan.examples.transformer:model", "--data",
                       "pyplan.examples.transformer:batch", "--loss",
                       "pyplan.examples.transformer:loss", "--devices", "2", "--repeats", "1",
                       "--tensor", "2", "-o", str(out))
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "pyplan.examples.transformer:model: tensor parallelism is " \
        "priced from a Hugging Face model's config" in lines[0], err
    assert not out.exists()
