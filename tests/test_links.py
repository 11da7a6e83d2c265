"""The links a plan times its transfers on: `pyplan partition` on the CPU writes pyplan's
CPU-class gloo link (benchmarks/links.py measured it), or with --links the one it measures,
and `pyplan run` says when its prediction rests on one of pyplan's default links."""

from __future__ import annotations

import pytest

from pyplan.partition import Partition, UnitCost, plan_text
from pyplan.planfile import load_spec
from pyplan.planfile.types import CPU_LINK, LinkSpec, TopologySpec


def _plan(tmp_path, link: LinkSpec | None, unit_ms: float | None = 1.0):
    units = [UnitCost(f"u{i}", 1.0, 2.0, 100, 10, output_bytes=4 << 20) for i in range(4)]
    text = plan_text(units, Partition((0, 1, 2, 3, 4), 0.0, ()), name="p", devices=4,
                     micro_batches=8, capacity=None, factory="m:model", data="m:batch",
                     loss="m:loss", path=None, time_unit_ms=unit_ms or 1.0, shape="test",
                     link=link)
    if unit_ms is None:
        assert "topology: {time_unit_ms: 1}" in text
        text = text.replace("topology: {time_unit_ms: 1}", "topology: {}")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def test_a_plan_times_its_outputs_on_the_link_it_is_given(tmp_path):
    from pyplan.problem import load_problem

    gpu = load_problem(_plan(tmp_path, None))
    cpu = load_problem(_plan(tmp_path, CPU_LINK))
    assert load_spec(tmp_path / "p.yaml").topology.within_node == CPU_LINK
    # 4 MiB at 1.88 GB/s: 2.3 ms, where a GPU node's default link takes 0.05 ms
    assert max(cpu.transfers) == round(CPU_LINK.milliseconds(4 << 20)) == 2
    assert max(gpu.transfers or (0,)) == round(TopologySpec().within_node.milliseconds(4 << 20))


@pytest.mark.parametrize("link, said", [
    (None, "a GPU node's default link, not this CPU's"),
    (CPU_LINK, "pyplan's default CPU link (1.88 GB/s, 0.093 ms), not on one measured here"),
    (LinkSpec(bandwidth=3 * 10**9, latency_ms=0.07), None)])
def test_run_says_when_its_prediction_rests_on_a_default_link(link, said, tmp_path, cli):
    from pyplan.resolved import load_resolved
    from pyplan.train.report import link_note

    plan = _plan(tmp_path, link)
    assert cli("solve", plan, "--quiet")[0] == 0
    note = link_note(load_resolved(tmp_path / "p.resolved.yaml"), "cpu")
    if said is None:
        assert note is None
    else:
        assert said in note and "pyplan partition --links" in note


def test_no_note_without_a_predicted_time(tmp_path, cli):
    from pyplan.resolved import load_resolved
    from pyplan.train.report import link_note

    plan = _plan(tmp_path, None, unit_ms=None)
    assert cli("solve", plan, "--quiet")[0] == 0
    assert link_note(load_resolved(tmp_path / "p.resolved.yaml"), "cpu") is None


def test_partition_on_the_cpu_writes_the_cpu_link_or_the_one_it_measures(cli, tmp_path,
                                                                         monkeypatch):
    pytest.importorskip("torch")
    from pyplan.measure import partitioner

    args = ["partition", "pyplan.examples.transformer:model", "--data",
            "pyplan.examples.transformer:batch", "--loss", "pyplan.examples.transformer:loss",
            "--devices", "2", "--repeats", "1"]
    code, _, err = cli(*args, "-o", tmp_path / "default.yaml")
    assert code == 0, err
    assert load_spec(tmp_path / "default.yaml").topology.within_node == CPU_LINK
    asked = []
    monkeypatch.setattr(partitioner, "measure_link",  # (tests/test_mshape.py measures one)
                        lambda device: asked.append(device) or (3 * 10**9, 0.07, []))
    code, out, err = cli(*args, "--links", "-o", tmp_path / "measured.yaml")
    assert code == 0, err
    assert asked == ["cpu"]
    assert load_spec(tmp_path / "measured.yaml").topology.within_node == \
        LinkSpec(bandwidth=3 * 10**9, latency_ms=0.07)
    assert "link between two processes here, measured: 3.00 GB/s, latency 0.070 ms" in out
