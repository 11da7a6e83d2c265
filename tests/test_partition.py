"""`pyplan partition`: the dynamic programme against brute force, memory capacity respected,
and a model partitioned, solved and run (V-shape and interleaved) matching single-process
training."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyplan.partition import (Held, UnitCost, best_partitions, candidates, optimal_partition,
                              smallest_capacity, stage_memory, stage_workspace)

MODELS = Path(__file__).resolve().parent / "models"
PYPLAN = str(Path(sys.executable).with_name("pyplan"))


def _units(rng: random.Random, k: int) -> list[UnitCost]:
    return [UnitCost(f"u{i}", rng.uniform(0.1, 3), rng.uniform(0.1, 6), rng.randint(0, 50),
                     rng.randint(0, 200)) for i in range(k)]


def _brute(units, stages, n, capacity):
    best = None
    k = len(units)
    for cuts in itertools.combinations(range(1, k), stages - 1):
        bounds = (0, *cuts, k)
        if capacity is not None and any(
                stage_memory(units, bounds[s], bounds[s + 1], s, stages, n) > capacity
                for s in range(stages)):
            continue
        value = max(sum(u.forward_ms + u.backward_ms for u in units[bounds[s]:bounds[s + 1]])
                    for s in range(stages))
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_dynamic_programme_equals_brute_force(seed):
    rng = random.Random(seed)
    units = _units(rng, rng.randint(1, 9))
    stages = rng.randint(1, len(units))
    n = rng.randint(1, 8)
    capacity = rng.choice([None, 150, 300, 600])
    found = optimal_partition(units, stages, micro_batches=n, capacity=capacity)
    brute = _brute(units, stages, n, capacity)
    if brute is None:
        assert found is None and best_partitions(units, stages, micro_batches=n,
                                                 capacity=capacity) == []
        return
    assert found is not None and found.bottleneck_ms == pytest.approx(brute)
    assert capacity is None or max(found.memory) <= capacity
    ranked = best_partitions(units, stages, micro_batches=n, capacity=capacity)
    assert ranked[0].bottleneck_ms == pytest.approx(brute)
    assert all(capacity is None or max(p.memory) <= capacity for p in ranked)


@pytest.mark.parametrize("seed", range(30))
def test_smallest_capacity_equals_brute_force(seed):
    rng = random.Random(seed)
    units = _units(rng, rng.randint(1, 8))
    stages = rng.randint(1, len(units))
    brute = min(max(stage_memory(units, b[s], b[s + 1], s, stages, 8, Held(alone=True))
                    for s in range(stages))
                for cuts in itertools.combinations(range(1, len(units)), stages - 1)
                for b in [(0, *cuts, len(units))])
    assert smallest_capacity(units, stages) == brute
    assert candidates(units, stages, micro_batches=8, capacity=brute)
    assert not candidates(units, stages, micro_batches=8, capacity=brute - 1)
    assert smallest_capacity(units, len(units) + 1) is None


def _costly_units(rng: random.Random, k: int) -> list[UnitCost]:
    return [UnitCost(f"u{i}", rng.uniform(0.5, 3), rng.uniform(0.5, 6), rng.randint(100, 900),
                     rng.randint(0, 400), input_bytes=rng.randint(10, 100),
                     output_bytes=rng.randint(10, 100)) for i in range(k)]


@pytest.mark.parametrize("seed, chunks", [(0, 1), (1, 1), (2, 2), (3, 1)])
def test_partition_and_solve_agree_on_what_fits(seed, chunks):
    """Partition counts a stage's memory as solve does: its candidates' one-micro-batch
    memory is solve's least peak for their plans; at the smallest memory it names, every
    candidate solves within it; one byte less, it refuses and names that memory."""
    import pyplan
    from pyplan.errors import InfeasibleError
    from pyplan.problem import build_problem
    from pyplan.solver.bounds import min_memory
    from pyplan.planfile import format_memory, spec_from_text

    rng = random.Random(seed)
    units = _costly_units(rng, 8)
    devices = 2 if chunks == 2 else 3
    common = dict(devices=devices, chunks=chunks, micro_batches=6, name="p", factory="m:f",
                  data="m:d", loss="m:l", time_limit=5.0)
    least = smallest_capacity(units, devices * chunks) * chunks
    plans = pyplan.partition_plans(units, memory=least, **common)
    for plan in plans:
        assert max(plan.solution.schedule.peak_memory) <= least
        problem = build_problem(spec_from_text(plan.text, "<test>"))
        stages = range(devices * chunks)
        bounds = [(plan.partition.bounds[s], plan.partition.bounds[s + 1]) for s in stages]
        alone = [stage_memory(units, a, b, s, devices * chunks, 6, Held(alone=True))
                 for s, (a, b) in zip(stages, bounds)]
        room = [stage_workspace(units[a:b], receives=a > 0, sends=b < len(units))
                for a, b in bounds]
        # A device reserves its stages' largest workspace once; partition counts each stage's
        # (a conservative share when interleaved).
        per_device = [sum(alone[d::devices]) - sum(room[d::devices]) + max(room[d::devices])
                      for d in range(devices)]
        assert min_memory(problem) == per_device
        assert all(sum(alone[d::devices]) >= per_device[d] for d in range(devices))
    with pytest.raises(InfeasibleError) as refused:
        pyplan.partition_plans(units, memory=least - chunks, **common)
    assert f"is {least}B ({format_memory(least, True)})" in refused.value.hint


def test_a_refusal_names_the_memory_that_fits_and_that_memory_fits(cli, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(MODELS))
    monkeypatch.delitem(sys.modules, "plain", raising=False)
    command = ["partition", "plain:model", "--data", "plain:batch", "--loss", "plain:loss",
               "--devices", "4", "--micro-batches", "4", "--repeats", "1", "-o",
               tmp_path / "p.yaml"]
    code, out, err = cli(*command, "--memory", "1KiB")
    assert (code, out, err.count("\n")) == (3, "", 1) and not (tmp_path / "p.yaml").exists()
    least = re.search(r"admits a partition is (\d+)B \(", err)
    assert least, err
    code, _, err = cli(*command, "--memory", f"{least.group(1)}B")
    assert code == 0, err
    code, _, err = cli("solve", tmp_path / "p.yaml", "--quiet")
    assert code == 0, err


def test_recomputation_widens_what_fits_at_full_throughput():
    """Twelve equal layers on 4 devices at a memory where 1F1B's in-flight micro-batches do
    not fit without recomputation: they do with it, and `auto` is never slower than `never`."""
    import pyplan

    units = [UnitCost(f"layer{i}", 1.0, 2.0, 1000, 100, input_bytes=100) for i in range(12)]
    capacity = 3 * 100 + 3 * 1000 + 3 * 300  # 4 in flight on stage 0, three keeping inputs
    assert not best_partitions(units, 4, micro_batches=8, capacity=capacity)
    assert best_partitions(units, 4, micro_batches=8, capacity=capacity,
                           held=Held(recompute="always"))[0].bounds == (0, 3, 6, 9, 12)
    common = dict(devices=4, micro_batches=8, name="p", factory="m:f", data="m:d", loss="m:l",
                  memory=capacity, time_limit=5.0)
    never = pyplan.partition_plans(units, recompute="never", **common)[0]
    auto = pyplan.partition_plans(units, recompute="auto", **common)[0]
    assert auto.makespan_ms <= never.makespan_ms
    assert max(auto.solution.schedule.peak_memory) <= capacity


def test_a_tight_capacity_forces_an_uneven_split():
    # Four equal units (10 bytes of activations, 5 of weights each); stage 0 holds 2
    # micro-batches' activations, stage 1 one. With room for 45 bytes the even split does not
    # fit stage 0 (10 + 2 x 20 = 50), one unit there does (25), three on stage 1 too (45).
    units = [UnitCost(f"u{i}", 1.0, 1.0, 10, 5) for i in range(4)]
    even = optimal_partition(units, 2, micro_batches=4, capacity=None)
    assert even.bounds == (0, 2, 4) and even.bottleneck_ms == 4.0
    tight = optimal_partition(units, 2, micro_batches=4, capacity=45)
    assert tight.bounds == (0, 1, 4) and tight.bottleneck_ms == 6.0
    assert tight.memory == (25, 45)
    assert optimal_partition(units, 2, micro_batches=4, capacity=10) is None


@pytest.mark.torchrun
@pytest.mark.parametrize("shape, model, cut", [
    ("vshape", "unequal", "chain"), ("interleaved", "unequal", "chain"),
    # not a chain of its children: learned positions added in forward, a list of layers
    ("vshape", "positional", "forward"),
    # neither: a long skip connection, so the traced pieces hand on two tensors
    ("vshape", "skip", "traced")])
def test_a_model_partitioned_solved_and_run_matches_single_process_training(shape, model, cut,
                                                                            tmp_path):
    shutil.copy(MODELS / f"{model}.py", tmp_path / "unequal.py")
    (tmp_path / "plans").mkdir()
    extra = ["--shape", "interleaved", "--chunks", "2"] if shape == "interleaved" else []
    run = lambda *args: subprocess.run([PYPLAN, *args], capture_output=True, text=True,  # noqa
                                       cwd=tmp_path, timeout=300)
    made = run("partition", "unequal:model", "--data", "unequal:batch", "--loss",
               "unequal:loss", "--devices", "4", "--memory", "2MiB", "--repeats", "2",
               "-o", "plans/unequal.yaml", *extra)
    assert made.returncode == 0, made.stderr
    plan = (tmp_path / "plans" / "unequal.yaml").read_text()
    assert "module: unequal:model" in plan and 'path: ".."' in plan
    assert plan.count("{name: stage") == (8 if shape == "interleaved" else 4)
    assert (f"cut: {cut}" in plan) == (cut != "chain")
    if model == "positional":  # a parameter of the model itself: every stage holds it
        assert '- {parameter: "positions", stages: [stage0, stage1, stage2, stage3]}' in plan
    solved = run("solve", "plans/unequal.yaml", "--quiet")
    assert solved.returncode == 0, solved.stderr
    result = run("run", "plans/unequal.resolved.yaml", "--nproc-per-node", "4", "--check",
                 "--iterations", "2", "--json", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["check"]["ok"], report


def test_partition_regenerates_the_transformer_plans_stages(cli, tmp_path):
    """plans/transformer-vshape.yaml's model, given whole, is cut into 4 stages, embedding
    first and head last; with its layers costing the same (measured times on a loaded machine
    may tip a near-tie either way), into exactly the plan's stages: the same submodules (by
    name and shape) as the plan's `build` makes for each stage."""
    from pyplan.examples import transformer
    from pyplan.partition import Partition, plan_text
    from pyplan.problem import load_problem
    from pyplan.models.chain import stage

    out = tmp_path / "transformer.yaml"
    code, _, err = cli("partition", "pyplan.examples.transformer:model", "--data",
                       "pyplan.examples.transformer:batch", "--loss",
                       "pyplan.examples.transformer:loss", "--devices", "4",
                       "--micro-batches", "8", "--repeats", "3", "-o", out)
    assert code == 0, err
    measured = dict(load_problem(out).model.stages)
    units = [name for s in range(4) for name in measured[f"stage{s}"]]
    assert units[0] == "embed" and units[-1] == "head" and len(units) == len(set(units))
    costs = [UnitCost(u, 1.0, 2.0, 100, 10) if u.startswith("layers.") else
             UnitCost(u, 0.1, 0.2, 100, 10) for u in units]
    even = optimal_partition(costs, 4, micro_batches=8, capacity=None)
    path = tmp_path / "even.yaml"
    path.write_text(plan_text(costs, Partition(even.bounds, 0.0, ()), name="even", devices=4,
                              micro_batches=8, capacity=None,
                              factory="pyplan.examples.transformer:model",
                              data="pyplan.examples.transformer:batch",
                              loss="pyplan.examples.transformer:loss", path=None,
                              time_unit_ms=1.0, shape="vshape"))
    stages = dict(load_problem(path).model.stages)
    names = [f"stage{s}" for s in range(4)]
    whole = transformer.model()
    for name in names:
        ours = {k: v.shape for k, v in stage(whole, stages[name]).state_dict().items()}
        theirs = {k: v.shape for k, v in transformer.build(name, None).state_dict().items()}
        assert list(ours.values()) == list(theirs.values()), name


def _partitioned(tmp_path, bounds, devices):
    from pyplan.partition import Partition, plan_text

    names = ["embed"] + [f"layers.{i}" for i in range(6)] + ["norm", "head"]
    units = [UnitCost(n, 1.0, 2.0, 100, 10) for n in names]
    p = Partition(bounds, 0.0, ())
    path = tmp_path / "p.yaml"
    path.write_text(plan_text(units, p, name="p", devices=devices, micro_batches=8,
                              capacity=None, factory="m:model", data="m:batch", loss="m:loss",
                              path=None, time_unit_ms=1.0, shape="test"))
    return path


def test_megatron_layout_and_torchtitan_module_fqns(cli, tmp_path):
    plan = _partitioned(tmp_path, (0, 2, 4, 6, 9), 4)
    code, out, err = cli("export", plan, "--format", "megatron-layout", "-o", "-")
    assert (code, err) == (0, "") and out == "E,t|t*2|t*2|t,L\n"
    code, out, _ = cli("export", plan, "--format", "torchtitan", "-o", "-")
    assert code == 0
    assert ('MODULE_FQNS_PER_MODEL_PART = [\n    ["embed", "layers.0"],\n    ["layers.1", '
            '"layers.2"],\n    ["layers.3", "layers.4"],\n    ["layers.5", "norm", "head"],\n]'
            ) in out
    assert "pipeline_parallel_degree = 4" in out and '"1F1B"' in out
    # Interleaved, 2 chunks on 2 ranks: chunk 0 of every rank first, as Megatron lists them.
    plan = _partitioned(tmp_path, (0, 3, 5, 7, 9), 2)
    assert cli("export", plan, "--format", "megatron-layout", "-o", "-")[1] == \
        "E,t*2|t*2|t*2|L\n"
    out = cli("export", plan, "--format", "torchtitan", "-o", "-")[1]
    assert '"Interleaved1F1B"' in out and 'pipeline_parallel_schedule_csv = "p.csv"' in out


def test_torchtitan_settings_for_the_v_and_what_it_cannot_run(cli, tmp_path):
    from pyplan.partition import Partition, plan_text

    units = [UnitCost(n, 1.0, 2.0, 100, 10) for n in ["embed", "l0", "l1", "head"]]
    text = plan_text(units, Partition((0, 1, 2, 3, 4), 0.0, ()), name="v", devices=2,
                     micro_batches=4, capacity=None, factory="m:model", data="m:batch",
                     loss="m:loss", path=None, time_unit_ms=1.0, shape="test")
    # ZB-V's placement: stages 0 and 3 on rank 0, 1 and 2 on rank 1, a split backward.
    v = text.replace("stage2, devices: [0]", "stage2, devices: [1]").replace(
        "stage3, devices: [1]", "stage3, devices: [0]")
    (tmp_path / "v.yaml").write_text(v.replace("{time_ratio: 1}",
                                               "{time_ratio: 1, weight_time_ratio: 1}"))
    code, out, err = cli("export", tmp_path / "v.yaml", "--format", "torchtitan", "-o", "-")
    assert code == 0, err
    assert '"ZBVZeroBubble"' in out and 'pipeline_parallel_schedule_csv = "v.csv"' in out
    (tmp_path / "v2.yaml").write_text(v.replace("name: v\n", "name: v2\n"))
    assert '"DualPipeV"' in cli("export", tmp_path / "v2.yaml", "--format", "torchtitan",
                               "-o", "-")[1]
    # Megatron-LM has no V: refused with the stage that does not fit.
    code, out, err = cli("export", tmp_path / "v.yaml", "--format", "megatron-layout", "-o", "-")
    assert code == 2 and "stage 2 ('stage2') runs on devices [1], but Megatron-LM places " \
        "stage s on rank s mod the pipeline size" in err


def test_layout_exports_need_a_module_cut_into_stages(cli):
    from conftest import PLANS

    code, out, err = cli("export", PLANS / "gpt-mshape-blocks.resolved.yaml", "--format",
                         "megatron-layout", "-o", "-")
    assert (code, out) == (2, "")
    assert "needs a model given as one module cut into submodules" in err


def test_partition_plans_include_the_even_splits_and_put_the_shortest_first():
    import pyplan

    rng = random.Random(3)
    units = _units(rng, 9)
    plans = pyplan.partition_plans(units, devices=3, micro_batches=6, name="p",
                                   factory="m:model", data="m:batch", loss="m:loss")
    bounds = [p.partition.bounds for p in plans]
    assert (0, 3, 6, 9) in bounds  # by count
    assert (0, 1 + round(7 / 3), 1 + round(14 / 3), 9) in bounds  # embedding first, head last
    assert [p.makespan_ms for p in plans] == sorted(p.makespan_ms for p in plans)
    assert plans[0].solution.status in ("optimal", "feasible")
    assert "module: m:model" in plans[0].text


BROKEN = """\
import torch


def raising():
    raise ValueError("no such layer")


def batch(step):
    return torch.zeros(4, 2), torch.zeros(4, 2)


def loss(output, target):
    return (output - target).pow(2).mean()


class Branches(torch.nn.Module):  # its forward is not its children one after another
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.a(x) + self.b(x)
"""


@pytest.mark.parametrize("options, message", [
    (["--speeds", "1,0,1,1"], "error: --speeds: '0' is not a speed in 0.001 .. 1000 (hint: a "
                          "device's speed relative to the one measuring, e.g. 0.5)\n"),
    (["--speeds", "1,nan,1,1"], "error: --speeds: 'nan' is not a speed in 0.001 .. 1000 (hint: "
                                "a device's speed relative to the one measuring, e.g. 0.5)\n"),
    (["--memory", "1GiB,2GiB"], "error: --memory gives 2 values for 4 devices (hint: give one "
                                "for every device, or one for all)\n"),
    (["--memory", "1GiB,2GiB,0B,1GiB"], "error: --memory must be a positive size such as 24GiB\n"),
    (["--memory", "1GiB,1GiB,1GiB,2GiB", "--shape", "mshape"],
     "error: --shape mshape takes one --memory for every device and no --speeds (its sharded "
     "units run on all devices alike) (hint: use --shape vshape or interleaved)\n"),
])
def test_per_device_options_are_checked_first(options, message, cli, tmp_path):
    code, out, err = cli("partition", "nowhere:model", "--data", "nowhere:batch", "--loss",
                         "nowhere:loss", "--devices", "4", *options, "-o", tmp_path / "p.yaml")
    assert (code, out, err) == (2, "", message)


@pytest.mark.parametrize("factory, message", [
    ("broken_model:raising", "error: factory (broken_model:raising) raised ValueError: no such "
                             "layer (hint: the factory returns the whole model, an nn.Module)\n"),
    ("broken_model:Branches", "error: broken_model:Branches has 2 units (a, b), fewer than the 4 "
                              "stages asked for (hint: use fewer devices (or chunks))\n"),
    ("broken_model:nope", "error: factory: broken_model has no function 'nope'\n"),
])
def test_partition_errors_are_one_line(factory, message, cli, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    (tmp_path / "broken_model.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = cli("partition", factory, "--data", "broken_model:batch", "--loss",
                         "broken_model:loss", "--devices", "4", "--micro-batches", "2",
                         "-o", tmp_path / "p.yaml")
    assert (code, err) == (2, message)
    assert not (tmp_path / "p.yaml").exists()


def test_a_tensor_two_units_save_is_held_once():
    """A ReLU saves its output, which the next Linear saves as its input: one tensor."""
    from pyplan.partition import stage_activations

    relu = UnitCost("relu", 1, 1, 100, 0, saved_output_bytes=100)
    linear = UnitCost("linear", 1, 1, 150, 0, saved_input_bytes=100)
    gelu = UnitCost("gelu", 1, 1, 100, 0, saved_input_bytes=100)
    assert stage_activations([relu, linear]) == 150
    assert stage_activations([linear, gelu]) == 250  # the Linear does not save its output


def test_the_workspace_is_a_stages_most_at_any_moment_less_its_activations():
    """Closed forms: in unit k's backward the units up to it hold theirs; recomputed, the
    input is held beside; the optimizer's step beyond one micro-batch's activations; one
    transfer each way; the batch."""
    from pyplan.partition import recompute_bytes, stage_workspace

    units = [UnitCost(f"u{i}", 1, 1, act, 0, input_bytes=20, output_bytes=30,
                      forward_peak_bytes=fwd, backward_peak_bytes=bwd)
             for i, (act, fwd, bwd) in enumerate([(100, 120, 50), (200, 210, 10),
                                                  (300, 330, 40)])]
    total = 600
    backward = max(100 + 50, 300 + 10, 600 + 40)  # 640
    forward = max(0 + 0 + 120, 100 + 30 + 210, 300 + 30 + 330)  # 660, first stage
    assert stage_workspace(units, receives=False) == max(forward, backward) - total
    # Receiving its input (20 bytes, not saved) and sending its output: one of each.
    forward_received = max(20 + 120, 100 + 30 + 210, 300 + 30 + 330)
    assert stage_workspace(units, sends=True) == \
        max(forward_received, backward) - total + 20 + 30
    # Recomputed: the input kept, held beside the rerun and the backward.
    assert recompute_bytes(units) == 20 and recompute_bytes(units, receives=False) == 0
    rerun = max(20 + 120, 100 + 30 + 210 + 20, 300 + 30 + 330 + 20)
    plain = max(20 + 120, 30 + 210 + 20, 30 + 330 + 20)
    always = max(plain, rerun, backward + 20) - total
    assert stage_workspace(units, recompute="always") == always + 20
    assert stage_workspace(units, recompute="auto") == \
        max(always, max(forward_received, backward) - total) + 20
    # AdamW's step: one parameter at a time on the CPU, beyond one micro-batch's activations.
    stepping = [dataclasses.replace(u, update_peak_bytes=700 + i) for i, u in enumerate(units)]
    assert stage_workspace(stepping, receives=False) == 702 - total
    at_once = [dataclasses.replace(u, update_at_once=True) for u in stepping]
    assert stage_workspace(at_once, receives=False) == 2103 - total
    # The batch, on the ranks that read it, throughout.
    batch = [dataclasses.replace(units[0], batch_bytes=1000), *units[1:]]
    assert stage_workspace(batch, receives=False) == max(forward, backward) - total + 1000


def test_host_memory_is_each_ranks_share_less_a_process():
    from pyplan.partition import host_capacity

    assert host_capacity(None, 4000, 4, 200) == 800
    assert host_capacity(500, 4000, 4, 200) == 500
    assert host_capacity([None, 900], 4000, 2, 1000) == [1000, 900]


def test_host_memory_bounds_each_rank_and_its_planned_host_memory_is_printed(cli, tmp_path,
                                                                          monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(MODELS))
    monkeypatch.delitem(sys.modules, "plain", raising=False)
    command = ["partition", "plain:model", "--data", "plain:batch", "--loss", "plain:loss",
               "--devices", "2", "--micro-batches", "4", "--repeats", "1", "-o",
               tmp_path / "p.yaml"]
    code, out, err = cli(*command, "--host-memory", "seven")
    assert (code, out, err) == (2, "", "error: --host-memory: not a memory size: 'seven'\n")
    code, out, err = cli(*command, "--host-memory", "8GiB")
    assert code == 0, err
    planned = re.search(r"planned host memory per rank .*: 0: ([\d.]+) GiB  1: ([\d.]+) GiB",
                        out)
    assert planned and all(0.05 < float(g) < 4 for g in planned.groups()), out
    capacity = int(re.search(r"^memory: (\d+)B$", (tmp_path / "p.yaml").read_text(),
                             re.M).group(1))
    assert 2 * 2**30 < capacity < 4 * 2**30  # a share of 4 GiB less the process's own


def test_the_plan_records_its_optimizer_and_run_trains_with_it(cli, tmp_path, monkeypatch,
                                                               capsys):
    """partition --optimizer writes model.optimizer (the state the weights count), solve
    carries it into the resolved plan, and run takes it unless told otherwise, warning then."""
    pytest.importorskip("torch")
    from pyplan.cli.run import _optimizer
    from pyplan.resolved import load_resolved

    monkeypatch.syspath_prepend(str(MODELS))
    monkeypatch.delitem(sys.modules, "plain", raising=False)
    sizes = {}
    for optimizer in ("sgd", "adamw"):
        out = tmp_path / f"{optimizer}.yaml"
        code, _, err = cli("partition", "plain:model", "--data", "plain:batch", "--loss",
                           "plain:loss", "--devices", "2", "--micro-batches", "4",
                           "--repeats", "1", "--optimizer", optimizer, "-o", out)
        assert code == 0, err
        assert f"  optimizer: {optimizer}\n" in out.read_text()
        code, _, err = cli("solve", out, "--quiet")
        assert code == 0, err
        model = load_resolved(tmp_path / f"{optimizer}.resolved.yaml").problem.model
        assert model.optimizer == optimizer
        sizes[optimizer] = re.findall(r"weights: (\d+)B", out.read_text())
    # AdamW's two fp32 moments: each stage's weights count 4 tensors of its parameters, not 2
    assert all(int(a) > int(s) for a, s in zip(sizes["adamw"], sizes["sgd"])), sizes
    capsys.readouterr()
    monkeypatch.setenv("RANK", "0")
    assert _optimizer(None, model) == "adamw" and _optimizer("adamw", model) == "adamw"
    assert capsys.readouterr().err == ""
    assert _optimizer("sgd", model) == "sgd"
    assert capsys.readouterr().err.startswith(
        "warning: --optimizer sgd: the plan was partitioned for adamw (model.optimizer)")
    monkeypatch.setenv("RANK", "1")  # said once, by rank 0
    assert _optimizer("sgd", model) == "sgd" and capsys.readouterr().err == ""
    assert _optimizer(None, dataclasses.replace(model, optimizer=None)) == "sgd"
