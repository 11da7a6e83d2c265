"""Transfers and recomputation in the cost model: the closed form of a chain, sizes timed on the
topology, the search with transfers never behind the same search blind to them, recompute auto
never behind never or always, the choices recorded in the resolved plan and applied by the
runtime, and the plan errors of both fields."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from conftest import PLANS, solved
from pyplan.cli import main
from pyplan.errors import InfeasibleError, PlanError
from pyplan.problem import build_problem, load_problem
from pyplan.resolved.seal import reseal
from pyplan.resolved import load_resolved, write_resolved
from pyplan.problem.schedule import schedule_from_orders
from pyplan.solver import solve
from pyplan.planfile import spec_from_text


def vshape(devices: int, *, stage: str, memory: int | None = None, micro_batches: int = 1,
           extra: str = "") -> str:
    return (f"pyplan: 1\nname: v\ndevices: {devices}\nmicro_batches: {micro_batches}\n"
            + (f"memory: {memory}\n" if memory is not None else "")
            + f"training: {{backward: {{time_ratio: 2}}}}\n{extra}"
            + f"shape: {{kind: vshape, stage: {{{stage}}}}}\n")


def problem_of(text: str):
    return build_problem(spec_from_text(text))


# ---------------------------------------------------------------- transfers

@pytest.mark.parametrize("devices", [1, 2, 3, 5])
@pytest.mark.parametrize("transfer", [1, 4])
def test_a_chain_pays_each_transfer_once_each_way(devices, transfer):
    forward = 2
    problem = problem_of(vshape(devices, stage=f"time: {forward}, transfer: {transfer}"))
    solution = solve(problem)
    compute = devices * forward * 3  # forward and a backward twice as long on every stage
    assert solution.schedule.makespan == compute + 2 * (devices - 1) * transfer
    assert solution.lower_bound == solution.schedule.makespan
    assert solution.status == "optimal"


def test_output_sizes_are_timed_on_the_links_of_the_topology():
    problem = problem_of(vshape(8, stage="time: 6, output: 64MiB",
                                extra="topology: {devices_per_node: 4, time_unit_ms: 1}\n"))
    within = round(0.01 + 64 * 2**20 / 100e9 * 1e3)   # the documented defaults
    across = round(0.02 + 64 * 2**20 / 12.5e9 * 1e3)
    assert (within, across) == (1, 5)
    by_name = {(problem.blocks[a].name, problem.blocks[c].name): t
               for (a, c), t in zip(problem.edges, problem.transfers)}
    assert by_name[("stage3", "stage4")] == by_name[("stage4.b", "stage3.b")] == across
    assert by_name[("stage0", "stage1")] == by_name[("stage7.b", "stage6.b")] == within
    assert by_name[("stage7", "stage7.b")] == 0  # the same device
    slower = problem_of(vshape(8, stage="time: 6, output: 64MiB", extra=(
        "topology: {devices_per_node: 4, time_unit_ms: 0.5, across_nodes: "
        "{bandwidth: 1GB, latency_ms: 1}}\n")))
    assert max(slower.transfers) == round((1 + 64 * 2**20 / 1e9 * 1e3) / 0.5)


def test_a_block_on_several_devices_sends_only_to_devices_it_lacks():
    problem = problem_of(
        "pyplan: 1\nname: m\ndevices: 2\nmicro_batches: 2\ntraining: {backward: {}}\nblocks:\n"
        "  - {name: a, devices: all, time: 1, transfer: 3}\n"
        "  - {name: b, devices: [1], time: 1, transfer: 2}\n"
        "  - {name: c, devices: all, time: 1}\n")
    by_name = {(problem.blocks[a].name, problem.blocks[c].name): t
               for (a, c), t in zip(problem.edges, problem.transfers)}
    assert by_name[("a", "b")] == 0           # b's device holds a's output
    assert by_name[("b", "c")] == 2           # c also runs on device 0
    assert by_name[("c.b", "b.b")] == 0       # the gradient of b's output: on device 1 too
    assert by_name[("b.b", "a.b")] == 3       # the gradient of a's output, to device 0


@pytest.mark.parametrize("plan", ["transformer-2node", "tessel-vshape"])
def test_the_search_with_transfers_never_loses_to_the_search_blind_to_them(plan):
    problem = load_problem(PLANS / f"{plan}.yaml")
    if plan == "tessel-vshape":  # give the paper's plan transfers
        problem = dataclasses.replace(problem, transfers=tuple(
            2 if problem.blocks[a].devices != problem.blocks[c].devices else 0
            for a, c in problem.edges))
    aware = solve(problem).schedule.makespan
    blind = solve(dataclasses.replace(problem, transfers=())).schedule
    timed = schedule_from_orders(problem, blind.orders, problem.num_micro_batches)
    assert aware <= timed.schedule.makespan
    if plan == "transformer-2node":  # the slow inter-node hop is hidden only when planned for
        assert timed.schedule.makespan >= 1.1 * aware


def test_resolved_plans_record_transfers_and_reject_edited_ones(tmp_path):
    source = tmp_path / "v.yaml"
    source.write_text(vshape(3, stage="time: 2, transfer: 3", micro_batches=4))
    solution = solve(load_problem(source))
    out = write_resolved(solution, tmp_path / "v.resolved.yaml")
    text = out.read_text()
    assert "  - [stage0, stage1, 3]\n" in text
    loaded = load_resolved(out)
    assert loaded.problem.transfers == solution.schedule.problem.transfers
    assert loaded.schedule.makespan == solution.schedule.makespan
    out.write_text(text.replace("[stage0, stage1, 3]", "[stage0, stage1, 1]"))
    with pytest.raises(PlanError, match="'dependencies' is not as pyplan wrote it"):
        load_resolved(out)
    # Edited with a seal made to match (the plan file beside it is gone): still refused.
    (tmp_path / "v.yaml").unlink()
    out.write_text(reseal(text.replace("[stage0, stage1, 3]", "[stage0, stage1, 1]")))
    with pytest.raises(PlanError, match="does not match its order"):
        load_resolved(out)
    out.write_text(reseal(text.replace("[stage0, stage1, 3]", "[stage0, stage1, -3]")))
    with pytest.raises(PlanError, match="malformed dependency"):
        load_resolved(out)


def test_chrome_export_draws_each_transfer(tmp_path):
    source = tmp_path / "v.yaml"
    source.write_text(vshape(3, stage="time: 2, transfer: 3", micro_batches=2))
    assert main(["solve", str(source), "--quiet"]) == 0
    trace = tmp_path / "v.json"
    assert main(["export", str(tmp_path / "v.resolved.yaml"), "--format", "chrome", "-o",
                 str(trace)]) == 0
    import json
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("cat") == "transfer"]
    # 2 micro-batches x 4 cross-device edges, each a slice and a flow start and end
    assert sorted(e["ph"] for e in events).count("X") == 8
    assert {e["dur"] for e in events if e["ph"] == "X"} == {3}
    assert sum(e["ph"] == "s" for e in events) == sum(e["ph"] == "f" for e in events) == 8


def test_show_marks_the_idle_time_spent_waiting_for_data(cli, tmp_path):
    source = tmp_path / "v.yaml"
    source.write_text(vshape(2, stage="time: 2, transfer: 2"))
    assert cli("solve", source, "--quiet")[0] == 0
    code, out, _ = cli("show", tmp_path / "v.resolved.yaml")
    assert code == 0
    assert "d0   F0-............>>>B0====\n" in out   # the gradient on its way back
    assert "d1   ...>>>F0-B0====.........\n" in out   # the activation on its way
    assert "> idle while data is on its way: a transfer takes 2 time units" in out


# ---------------------------------------------------------------- recomputation

def test_recompute_moves_the_forward_into_the_backward():
    base = problem_of(vshape(2, stage="time: 2, memory: 5, recompute_memory: 1"))
    s0 = base.by_name["stage0"]
    done = base.with_recompute([s0])
    fwd, back = done.block("stage0"), done.block("stage0.b")
    assert (fwd.memory, fwd.recomputed, fwd.rematerialised) == (1, True, 4)
    assert (back.time, back.memory) == (4 + 2, -1)
    assert done.static_memory == (4, 0)  # room for re-materialising, on its device
    assert done.block("stage1") == base.block("stage1")
    assert done.recomputed == ("stage0",)


def _solved(text: str, mode: str):
    try:
        return solve(problem_of(text.replace("recompute: auto", f"recompute: {mode}")))
    except InfeasibleError:
        return None


@pytest.mark.parametrize("memory", [6, 8, 10, 14, 40])
def test_recompute_auto_never_loses_to_never_or_always(memory):
    text = vshape(4, memory=memory, micro_batches=8,
                  stage="time: 2, memory: 4, recompute_memory: 1",
                  extra="").replace("training: {backward: {time_ratio: 2}}",
                                    "training: {backward: {time_ratio: 2}, recompute: auto}")
    auto, never, always = (_solved(text, m) for m in ("auto", "never", "always"))
    assert auto is not None and always is not None
    assert auto.schedule.makespan <= always.schedule.makespan
    if never is not None:
        assert auto.schedule.makespan <= never.schedule.makespan
    # "optimal" only against a bound that holds for every choice
    relaxed = problem_of(text).with_recompute(range(4), rerun=False).makespan_bound()
    assert auto.lower_bound == relaxed <= auto.schedule.makespan
    assert (auto.status == "optimal") == (auto.schedule.makespan <= relaxed)


def test_the_memory_tight_gpt_plan_needs_some_recomputation():
    schedule = solved("gpt24-recompute")
    assert 0 < len(schedule.problem.recomputed) < 4
    text = (PLANS / "gpt24-recompute.yaml").read_text()
    never, always = (_solved(text, m) for m in ("never", "always"))
    assert schedule.makespan < never.schedule.makespan
    assert schedule.makespan < always.schedule.makespan


def test_resolved_plans_record_the_recompute_choice(tmp_path):
    source = tmp_path / "r.yaml"
    source.write_text(vshape(4, memory=10, micro_batches=8,
                             stage="time: 2, memory: 4, recompute_memory: 1, recompute: auto"))
    solution = solve(load_problem(source))
    out = write_resolved(solution, tmp_path / "r.resolved.yaml")
    loaded = load_resolved(out).problem
    assert loaded.recomputed == solution.schedule.problem.recomputed
    assert loaded.blocks == solution.schedule.problem.blocks
    assert loaded.static_memory == solution.schedule.problem.static_memory


@pytest.mark.parametrize("entry, message", [
    ("{name: a, kind: other, devices: [0], time: 1, recompute: always}",
     "block 'a' has no derived backward to recompute it in"),
    ("{name: a, devices: [0], time: 1, memory: 2, recompute: auto, recompute_memory: 3}",
     "block 'a' keeps 3 when recomputed, but holds only 2"),
    ("{name: a, devices: [0], time: 1, output: 64}", "output"),
])
def test_bad_recompute_and_output_fields_are_plan_errors(entry, message):
    with pytest.raises(PlanError, match=message) as info:
        problem_of("pyplan: 1\nname: e\ndevices: 1\nmicro_batches: 1\nblocks:\n"
                   f"  - {entry}\n")
    assert info.value.line == 6


COUNTING = """\
import torch
from torch import nn

CALLS = {}


class Counted(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.name, self.linear = name, nn.Linear(8, 8)

    def forward(self, x):
        CALLS[self.name] = CALLS.get(self.name, 0) + 1
        return torch.tanh(self.linear(x))


def build(block, group):
    return Counted(block)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def loss(out, target):
    return ((out - target) ** 2).mean()
"""

RECOMPUTED = """\
pyplan: 1
name: counted
devices: 1
micro_batches: 4
training:
  backward: {time_ratio: 2}
topology: {time_unit_ms: 0.5}
blocks:
  - {name: a, devices: [0], time: 1, memory: 2, recompute: always, recompute_memory: 1}
  - {name: b, devices: [0], time: 1, memory: 2}
  - {name: c, devices: [0], time: 1, memory: 2, recompute: always, recompute_memory: 1}
model: {blocks: "counting_model:build", data: "counting_model:batch",
        loss: "counting_model:loss", path: "."}
"""


@pytest.mark.parametrize("split", [False, True], ids=["whole-backward", "zero-bubble"])
def test_the_runtime_recomputes_exactly_the_recorded_blocks(tmp_path, monkeypatch, capfd,
                                                            split):
    """A recomputed block's forward runs twice per micro-batch: once without autograd, once
    when its backward starts; with the backward split into B and W, W reuses B's rerun."""
    from test_runtime import _free_port

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "counting_model.py").write_text(COUNTING)
    plan = tmp_path / "counted.yaml"
    plan.write_text(RECOMPUTED.replace("{time_ratio: 2}", "{time_ratio: 2, weight_time_ratio: 1}")
                    if split else RECOMPUTED)
    assert main(["solve", str(plan), "--quiet"]) == 0
    resolved = tmp_path / "counted.resolved.yaml"
    chosen = load_resolved(resolved).problem.recomputed
    assert chosen == ("a", "c")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "counting_model", raising=False)
    assert main(["run", str(resolved)]) == 0
    calls = sys.modules["counting_model"].CALLS
    assert calls == {name: 4 * (2 if name in chosen else 1) for name in "abc"}
    out = capfd.readouterr().out
    assert "recomputed in the backward (its forward rerun first): " + ", ".join(chosen) in out
    makespan = load_resolved(resolved).schedule.makespan
    ms = makespan * 0.5  # the plan's time unit, and no optimizer step times
    assert f"the plan predicts {ms:.1f} ms (the schedule's makespan {ms:.1f} ms" in out
    assert main(["run", str(resolved), "--check", "--iterations", "2"]) == 0
    assert "match the single-process run" in capfd.readouterr().out
