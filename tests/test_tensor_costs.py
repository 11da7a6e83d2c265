"""A plan's costs under tensor parallelism: its blocks' costs say which tensor degree they are
one rank's of (`mesh.priced`, which `pyplan partition --tensor T` writes), and a mesh of
another degree is refused in one line rather than planned on a whole model's costs; a tensor
rank's weights count what `pyplan run` holds (its sharded layers' parts, everything else
whole)."""

from __future__ import annotations

import pytest

PLAN = """\
pyplan: 1
name: tp
devices: 2
micro_batches: 2
training:
  backward: {{time_ratio: 2}}
{mesh}
blocks:
  - {{name: a, devices: [0], time: 10, memory: 1KiB, weights: 4KiB, output: 1KiB}}
  - {{name: b, devices: [1], time: 10, memory: 1KiB, weights: 4KiB, after: [a]}}
"""


@pytest.mark.parametrize("mesh, key, message, hint", [
    ("mesh: {tensor: 2}", "tensor", "mesh.tensor is 2, but the blocks' costs are a whole "
     "model's", "re-run pyplan partition --tensor 2"),
    ("mesh: {tensor: 2, priced: 4}", "priced", "the blocks' costs are one of 4 tensor "
     "ranks' (mesh.priced), but mesh.tensor is 2", "re-run pyplan partition --tensor 2"),
    ("mesh: {data: 2, priced: 2}", "priced", "the blocks' costs are one of 2 tensor ranks' "
     "(mesh.priced), but mesh.tensor is 1", "re-run pyplan partition without --tensor"),
])
@pytest.mark.parametrize("command", ["validate", "solve"])
def test_a_mesh_on_costs_priced_for_another_tensor_degree_is_one_line(
        tmp_path, cli, command, mesh, key, message, hint):
    path = tmp_path / "tp.yaml"
    path.write_text(PLAN.format(mesh=mesh))
    code, out, err = cli(command, path)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    row = PLAN.splitlines().index("{mesh}") + 1
    column = mesh.index(f"{key}:") + len(key) + 3  # (the value's column, 1-based)
    assert lines[0] == f"{path}:{row}:{column}: error: " + lines[0].split(": error: ")[1]
    assert message in lines[0] and hint in err, err
    assert not (tmp_path / "tp.resolved.yaml").exists()


def test_costs_priced_for_the_mesh_solve(tmp_path, cli):
    path = tmp_path / "tp.yaml"
    path.write_text(PLAN.format(mesh="mesh: {tensor: 2, priced: 2}"))
    code, _, err = cli("solve", path, "--quiet")
    assert code == 0, err


def test_a_tensor_ranks_weights_are_what_pyplan_run_holds():
    """The parameters `pyplan run`'s tensor plan splits (pyplan.mesh.tensor.sharded_parameters)
    and a tensor rank's weights (parameters, gradients, AdamW's two moments and step counts):
    GPT-2's layers split but for their row-wise layers' biases and their norms; its
    embeddings, final norm and head (tied to the embedding) whole; Llama's head split, its
    embedding whole."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models import hf

    from pyplan.partition import weight_bytes
    from pyplan.mesh.tensor import sharded_parameters, tensor_plan

    model = hf.gpt2()
    sharded = sharded_parameters(model, tensor_plan(model))
    named = dict(model.named_parameters())
    split = {name for name, p in named.items() if id(p) in sharded}
    assert split == {f"transformer.h.{i}.{name}" for i in range(len(model.transformer.h))
                     for name in ("attn.c_attn.weight", "attn.c_attn.bias",
                                  "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_fc.bias",
                                  "mlp.c_proj.weight")}
    h = model.config.n_embd
    layer = list(model.transformer.h[0].parameters())
    # fp32: 4 bytes a value, x 4 (itself, its gradient, two moments), + 4 per tensor (step)
    whole = 3 * h * h + 3 * h + h * h + h + 4 * h * h + 4 * h + 4 * h * h + h + 4 * h
    rank = (3 * h * h + 3 * h) / 2 + h * h / 2 + h + (4 * h * h + 4 * h) / 2 + 4 * h * h / 2 \
        + h + 4 * h
    assert weight_bytes(layer, "adamw") == 16 * whole + 4 * len(layer)
    assert weight_bytes(layer, "adamw", tensor=2, sharded=sharded) == \
        16 * rank + 4 * len(layer)
    ends = [model.transformer.wte.weight, model.transformer.wpe.weight]
    assert weight_bytes(ends, "sgd", tensor=2, sharded=sharded) == weight_bytes(ends, "sgd")

    llama = hf.build("llama", num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    sharded = sharded_parameters(llama, tensor_plan(llama))
    assert id(llama.lm_head.weight) in sharded
    assert id(llama.model.embed_tokens.weight) not in sharded
    assert not any(id(p) in sharded for p in llama.model.norm.parameters())
