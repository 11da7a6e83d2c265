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
