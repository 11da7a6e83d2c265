"""Graph pipelines (issue #58): the units' graph, its series-parallel decomposition, the stage
DAG partitioner (pyplan.partition.graph), the traced graph stages against the whole model,
partition's default choice, the trainer exports' refusal, and one 4-rank run --check."""

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyplan.partition import UnitCost
from pyplan.partition.graph import (UnitGraph, decompose, graph_candidates, graph_plan_text,
                                    partition_graph, stage_bytes)

MODELS = Path(__file__).parent / "models"
PYPLAN = [sys.executable, "-m", "pyplan"]


def _uno(branches=7, layers=4, head=3, branch_ms=1.0, head_ms=0.3):
    """CANDLE-Uno's shape as unit costs: branches of `layers` units reading the input, a
    head of `head` units, its first reading every branch's last."""
    units, preds, reads, ends = [], [], [], []
    for b in range(branches):
        for i in range(layers):
            units.append(UnitCost(f"b{b}.{i}", branch_ms, 2 * branch_ms, 1000, 4000,
                                  input_bytes=100, output_bytes=100))
            preds.append(() if i == 0 else (len(units) - 2,))
            reads.append(i == 0)
        ends.append(len(units) - 1)
    for i in range(head):
        units.append(UnitCost(f"h{i}", head_ms, 2 * head_ms, 1000, 4000, input_bytes=100,
                              output_bytes=100))
        preds.append(tuple(ends) if i == 0 else (len(units) - 2,))
        reads.append(False)
    return units, UnitGraph(tuple(preds), tuple(reads), tuple(u.output_bytes for u in units))


def _check_dag(units, graph, p, devices):
    """Every unit in one stage, each stage convex, the stage graph acyclic in stage order,
    preds exactly the stages read, depth the longest chain."""
    assert p.num_stages == devices
    assert sorted(k for st in p.stages for k in st) == list(range(len(units)))
    owner = {k: s for s, st in enumerate(p.stages) for k in st}
    for s, st in enumerate(p.stages):
        read = {owner[q] for k in st for q in graph.preds[k]} - {s}
        assert tuple(sorted(read)) == p.preds[s] and all(q < s for q in read)
    longest = [1] * p.num_stages
    for s in range(p.num_stages):
        longest[s] = 1 + max((longest[q] for q in p.preds[s]), default=0)
    assert max(longest) == p.depth


def test_the_decomposition_finds_the_branches_and_the_join():
    units, graph = _uno()
    root = decompose(graph)
    assert root.kind == "series" and [c.kind for c in root.children] == [
        "parallel", "unit", "unit", "unit"]
    assert root.branches() == 7 and len(root.children[0].children) == 7
    chain = UnitGraph.chain(units)
    assert decompose(chain).branches() == 1


def test_a_fork_and_a_join_are_series_cuts():
    # stem -> three branches of two units -> join
    preds = [(), (0,), (1,), (0,), (3,), (0,), (5,), (2, 4, 6)]
    graph = UnitGraph(tuple(preds), (True,) + (False,) * 7, (1,) * 8)
    root = decompose(graph)
    assert [c.kind for c in root.children] == ["unit", "parallel", "unit"]
    assert [c.units for c in root.children[1].children] == [(1, 2), (3, 4), (5, 6)]


@pytest.mark.parametrize("devices", [2, 4, 8, 16])
def test_uno_stage_dags_are_shallow_convex_and_balanced(devices):
    units, graph = _uno()
    p = partition_graph(units, graph, devices, micro_batches=2 * devices)
    _check_dag(units, graph, p, devices)
    # Independent stages: more stages than the longest chain of them.
    assert p.depth < p.num_stages or devices == 2
    times = [sum(units[k].forward_ms + units[k].backward_ms for k in st) for st in p.stages]
    assert max(times) == pytest.approx(p.bottleneck_ms)
    if devices == 4:  # two branches (4 units of 3 ms) a stage, the seventh with the head
        assert p.depth == 2 and p.bottleneck_ms == pytest.approx(24.0, rel=2e-3)


def test_the_binary_search_finds_the_least_bottleneck_of_the_decomposition():
    """At the bottleneck found, no smaller one (down to the next stage time below) has a
    stage DAG of the decomposition's kind."""
    units, graph = _uno(branches=3, layers=2, head=2)
    for devices in (2, 3, 4, 5):
        p = partition_graph(units, graph, devices, micro_batches=4)
        _check_dag(units, graph, p, devices)
        below = partition_graph(units, graph, devices, micro_batches=4,
                                limit=p.bottleneck_ms * 0.98)
        assert below is None


def test_memory_bounds_the_stages_and_counts_the_in_flight_micro_batches():
    units, graph = _uno(branches=3, layers=2, head=2)
    free = partition_graph(units, graph, 4, micro_batches=8)
    tight = max(free.memory) - 1
    p = partition_graph(units, graph, 4, micro_batches=8, capacity=tight)
    assert p is None or max(p.memory) <= tight
    succs = graph.succs
    stage = free.stages[0]
    assert stage_bytes(units, graph, succs, stage, 3) > stage_bytes(units, graph, succs,
                                                                     stage, 1)


def test_candidates_are_distinct_and_the_plan_text_is_a_dag(tmp_path):
    from pyplan.api import load_plan

    units, graph = _uno()
    found = graph_candidates(units, graph, 4, micro_batches=8)
    assert found and len({p.stages for p in found}) == len(found)
    text = graph_plan_text(units, graph, found[0], name="uno", devices=4, micro_batches=8,
                           capacity=None, factory="m:f", data="m:d", loss="m:l", path=None,
                           time_unit_ms=0.1)
    assert "after: [stage0, stage1, stage2]" in text and "cut: traced" in text
    plan = load_plan(text)
    assert plan.num_devices == 4


def test_the_graph_plan_beats_the_best_chain_by_the_solved_makespan():
    """Efficiency (the blocks' time over devices x makespan) of the graph plan against the best
    V-shape, from the same unit costs and pyplan's solver."""
    from pyplan.measure.placements import placements

    units, graph = _uno()
    options = dict(name="uno", factory="m:f", data="m:d", loss="m:l", micro_batches=8,
                   cut="traced", time_limit=5.0)
    tried = placements(units, devices=4, shapes=("vshape", "graph"), sharded=None,
                       graph=graph, **options)
    by = {p.shape: p for p in tried}
    assert tried[0].shape == "graph"
    busy = by["graph"].busy_ms
    efficiency = {s: busy / (4 * by[s].best.makespan_ms) for s in by}
    assert efficiency["graph"] >= 1.15 * efficiency["vshape"], efficiency
    assert by["graph"].best.partition.depth == 2


def test_traced_graph_stages_compute_what_the_whole_model_computes():
    """The stages run in one process in plan order (the fork's output to three stages, a
    tied weight in two) give the model's output and gradients, the tie's summed."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(MODELS))
    try:
        import branches
    finally:
        sys.path.remove(str(MODELS))
    from pyplan.models import TRACED, Cut, stage_modules
    from pyplan.models.graph import unit_graph

    torch.manual_seed(0)
    model = branches.forked()
    x = branches.batch(0)[0][:4]
    names = ["stem"] + [f"branches.{b}.{i}" for b in range(3) for i in range(4)] + ["head"]
    preds, _, _ = unit_graph(copy.deepcopy(model), names, x)
    assert preds[5] == preds[9] == (1,) and preds[13] == (4, 8, 12)  # the fork, the join
    stages = [("s0", ("stem", "branches.0.0")), ("s1", tuple(names[5:9])),
              ("s2", tuple(names[9:13])), ("s3", ("branches.0.1", "branches.0.2",
                                                  "branches.0.3", "head"))]
    after = [[], [0], [0], [0, 1, 2]]
    built = stage_modules(copy.deepcopy(model), Cut(TRACED), stages, [0, 1, 2, 3], "cpu", x,
                          graph=after)
    outs = {}
    for s in range(4):
        args = [outs[p] for p in after[s]]
        if not after[s] or built[s].reads_input:
            args.insert(0, x)
        outs[s] = built[s](*args)
    want = model(x)
    assert torch.allclose(outs[3], want, atol=1e-6)
    outs[3].sum().backward()
    want.sum().backward()
    # Each of the model's parameters: its copies in the stages (found by value) have
    # gradients summing to its own (a tie's copies each get their part).
    mine = list({id(p): p for s in range(4) for p in built[s].parameters()}.values())
    for name, param in model.named_parameters():
        copies = [p for p in mine if p.shape == param.shape and torch.equal(p, param)]
        assert copies, name
        total = sum(p.grad for p in copies if p.grad is not None)
        assert torch.allclose(total, param.grad, atol=1e-6), name
    with pytest.raises(Exception, match="must come after exactly"):
        stage_modules(branches.forked(), Cut(TRACED), stages, [3], "cpu", x,
                      graph=[[], [0], [0], [1, 2]])


def test_partition_by_default_solves_graph_and_chain_of_a_branching_model_and_says_why(
        cli, tmp_path, monkeypatch):
    """Which wins depends on this machine's measurements (the graph beating the chain is
    tested above on fixed costs): the shorter is written, and the plan is a graph's or not."""
    shutil.copy(MODELS / "branches.py", tmp_path / "branches.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = cli("partition", "branches:uno", "--data", "branches:batch", "--loss",
                         "branches:loss", "--devices", "4", "--micro-batches", "8",
                         "--repeats", "1", "-o", "uno.yaml")
    assert code == 0, err
    ranked = re.findall(r"^  (graph|vshape) +([0-9.]+) ms", out, re.M)
    assert sorted(shape for shape, _ in ranked) == ["graph", "vshape"]
    assert float(ranked[0][1]) <= float(ranked[1][1])
    chosen = ranked[0][0]
    assert f"chosen: {chosen}" in out and f"shorter than {ranked[1][0]}'s" in out
    plan = (tmp_path / "uno.yaml").read_text()
    assert "cut: traced" in plan and (plan.count("after: []") >= 2) == (chosen == "graph")
    code, out, err = cli("partition", "branches:uno", "--data", "branches:batch", "--loss",
                         "branches:loss", "--devices", "4", "--micro-batches", "8",
                         "--repeats", "1", "--shape", "graph", "-o", "graph.yaml")
    assert code == 0, err
    code, out, err = cli("export", "graph.yaml", "--format", "megatron-layout", "-o", "x.json")
    assert code == 2 and "stages form a graph" in err and len(err.strip().splitlines()) == 1


def test_partition_of_a_chain_model_is_the_vshape_as_before(cli, tmp_path):
    code, out, err = cli("partition", "pyplan.examples.transformer:model", "--data",
                         "pyplan.examples.transformer:batch", "--loss",
                         "pyplan.examples.transformer:loss", "--devices", "2",
                         "--micro-batches", "4", "--repeats", "1", "-o",
                         str(tmp_path / "t.yaml"))
    assert code == 0, err
    assert "4 micro-batches; the best partitions" in out and "chosen" not in out
    assert "(vshape)" in out and "after:" not in (tmp_path / "t.yaml").read_text()


@pytest.mark.torchrun
def test_a_graph_pipeline_runs_on_4_ranks_as_one_process(tmp_path):
    """A fork feeding three stages (its gradients summed), a tie across two stages."""
    shutil.copy(MODELS / "branches.py", tmp_path / "branches.py")
    run = lambda *args: subprocess.run([*PYPLAN, *args], capture_output=True, text=True,  # noqa
                                       cwd=tmp_path, timeout=300)
    made = run("partition", "branches:forked", "--data", "branches:batch", "--loss",
               "branches:loss", "--devices", "4", "--micro-batches", "8", "--repeats", "1",
               "--shape", "graph", "-o", "forked.yaml")
    assert made.returncode == 0, made.stderr
    plan = (tmp_path / "forked.yaml").read_text()
    holders = {m.group(1): m.group(2) for m in re.finditer(r"    (stage\d): \[(.*)\]", plan)}
    tied = sorted(s for s, units in holders.items()
                  if '"branches.1.2"' in units or '"branches.2.2"' in units)
    if len(tied) == 2:  # the tie across stages
        assert f'parameter: "branches.1.2.weight", stages: [{", ".join(tied)}]' in plan
    reads = re.findall(r"after: \[([^\]]*)\]", plan)
    assert max(sum(s in r for r in reads) for s in holders) >= 2  # a stage feeding several
    assert run("solve", "forked.yaml", "--quiet").returncode == 0
    result = run("run", "forked.resolved.yaml", "--nproc-per-node", "4", "--check",
                 "--iterations", "2", "--json", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["check"]["ok"], report
