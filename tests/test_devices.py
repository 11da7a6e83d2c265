"""Devices that differ (mixed GPU types): each device's memory and speed, from the plan through
the core, the Z3 models, the templates, the bounds, the resolved plan, show/export and
partition."""

from __future__ import annotations

import json

import pytest

from pyplan.partition import UnitCost
from pyplan.problem import build_problem
from pyplan.resolved import load_resolved
from pyplan.solver import solve
from pyplan.solver.budget import Budget
from pyplan.solver.exact import modulo_repetend, time_optimal
from pyplan.planfile import spec_from_text


def plan(devices: str, memory: str = "", n: int = 8, time: int = 2, ratio: float = 1.5,
         kind: str = "vshape") -> str:
    return (f"pyplan: 1\nname: mixed\ndevices: {devices}\n{memory}micro_batches: {n}\n"
            f"training: {{backward: {{time_ratio: {ratio}}}}}\n"
            f"shape: {{kind: {kind}, stage: {{time: {time}, memory: 1}}}}\n")


def problem_of(text: str):
    return build_problem(spec_from_text(text))


def slow(k: int, speed: float, count: int = 4) -> str:
    return "[" + ", ".join(f"{{speed: {speed}}}" if d == k else "{}" for d in range(count)) + "]"


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("speed, n", [(0.5, 8), (0.5, 32), (0.25, 8)])
def test_a_chain_with_one_slow_device_meets_its_closed_form(k, speed, n):
    # Stages of forward 2 and backward 3; device k runs them 1 / speed times as long. With
    # enough micro-batches it is busy throughout: the stages before it fill the pipeline and
    # drain it, n x (f_k + b_k) in between: optimal, and the lower bound proves it.
    problem = problem_of(plan(slow(k, speed), n=n))
    f, b = round(2 / speed), round(3 / speed)
    stage = problem.block(f"stage{k}")
    assert (stage.time, problem.block(f"stage{k}.b").time) == (f, b)
    assert problem.block(f"stage{(k + 1) % 4}").time == 2
    solution = solve(problem)
    assert solution.schedule.makespan == k * (2 + 3) + n * (f + b)
    assert solution.status == "optimal" and solution.lower_bound == solution.schedule.makespan
    assert solution.period_bound == f + b  # the slow device's load per micro-batch


def test_speed_rounds_to_the_nearest_step_and_a_shared_block_waits_for_the_slowest():
    text = ("pyplan: 1\nname: s\ndevices: [{speed: 3}, {speed: 0.4}, {}]\nmicro_batches: 2\n"
            "training: {backward: {time_ratio: 2}}\nblocks:\n"
            "  - {name: a, devices: [0], time: 4, memory: 1}\n"
            "  - {name: both, devices: [0, 2], time: 3}\n"
            "  - {name: c, devices: [1], time: 1, memory: 1}\n")
    problem = problem_of(text)
    times = {b.name: b.time for b in problem.blocks}
    # a: 4 / 3 -> 1; its backward 8 / 3 -> 3; both: max(3 / 3, 3 / 1) = 3; c: 1 / 0.4 -> 2
    # (2.5 to the nearest even step, as time_ratio rounds) and its backward 2 / 0.4 = 5.
    assert times == {"a": 1, "a.b": 3, "both": 3, "both.b": 6, "c": 2, "c.b": 5}


def test_equal_devices_written_either_way_are_the_same_plan():
    plain = problem_of(plan("4", "memory: 6\n"))
    listed = problem_of(plan("[{memory: 6}, {}, {memory: 6}, {speed: 1}]", "memory: 6\n"))
    by_list = problem_of(plan("4", "memory: [6, 6, 6, 6]\n"))
    for other in (listed, by_list):
        assert other.blocks == plain.blocks and other.memory_capacity == 6
        assert other.device_memory == () and other.device_speed == ()
        assert solve(other).schedule.orders == solve(plain).schedule.orders


def test_per_device_memory_reaches_templates_search_and_bounds():
    # Device 0 holds what 1F1B keeps in flight on the first stage (4): with room for 2 only,
    # 1F1B runs fewer warmup forwards there; GPipe (8 in flight) fits nowhere near it.
    tight = problem_of(plan("4", "memory: [2, 8, 8, 8]\n"))
    roomy = problem_of(plan("4", "memory: 8\n"))
    assert tight.capacities == (2, 8, 8, 8)
    t, r = solve(tight), solve(roomy)
    assert r.baselines["gpipe"].fits_memory and not t.baselines["gpipe"].fits_memory
    one_f_one_b = t.baselines["1f1b"]
    assert one_f_one_b.fits_memory and one_f_one_b.peak_memory[0] <= 2
    assert r.baselines["1f1b"].peak_memory[0] == 4
    assert one_f_one_b.makespan > r.baselines["1f1b"].makespan
    assert all(p <= c for p, c in zip(t.schedule.peak_memory, tight.capacities))
    assert t.schedule.makespan <= one_f_one_b.makespan
    assert t.schedule.makespan >= t.lower_bound >= r.lower_bound
    # A device that holds one micro-batch at a time: its memory-time (forward start to
    # backward start: 2 + 2 + 2 + 2 + 3 + 3 + 3 = 17) is the period's bound.
    single = problem_of(plan("4", "memory: [1, 8, 8, 8]\n"))
    assert single.graph.memory_time(0) == 17 and single.period_bound() == 17


def test_per_device_memory_in_the_z3_models():
    # Two stages; device 0 holds one micro-batch at a time, device 1 plenty.
    text = plan("2", "memory: [1, 8]\n", n=2, ratio=1.5)
    problem = problem_of(text)
    everything = [(b.index, m) for m in range(2) for b in problem.blocks]
    exact = time_optimal(problem, everything, symmetry=False, budget=Budget(60))
    # One micro-batch after the other on device 0: 2 x (2 + 2 + 3 + 3).
    assert exact.status == "optimal" and exact.value == 20
    free = problem_of(plan("2", "memory: 8\n", n=2, ratio=1.5))
    assert time_optimal(free, everything, symmetry=False).value < 20
    solution = solve(problem)
    assert solution.schedule.makespan == 20 and solution.status == "optimal"
    # A repetend: device 0 frees a micro-batch when its backward starts and takes the next
    # forward after it: period = 2 + 2 + 3 + 3 = 10, proven by Z3 (9 is impossible).
    assert modulo_repetend(problem, 9, 4, budget=Budget(60)).status == "unsat"
    assert modulo_repetend(problem, 10, 4, budget=Budget(60)).status == "sat"


def test_one_micro_batch_too_big_for_one_device_names_it(cli, tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(plan("4", "memory: [4, 4, 0, 4]\n").replace("memory: 1", "memory: 1"))
    code, _, err = cli("validate", path)
    assert code == 2 and "memory capacity must be positive" in err and ":4:" in err
    path.write_text(plan("[{}, {memory: 1}, {}, {}]", "memory: 4\n").replace(
        "memory: 1}}", "memory: 2}}"))
    code, _, err = cli("solve", path, "-o", tmp_path / "out.yaml")
    assert code == 2 and "alone needs 2 per device, more than the capacity 1" in err
    # A block with the weights of its device beyond that device's capacity: at the block.
    path.write_text(plan("[{}, {memory: 3}, {}, {}]", "memory: 4\n").replace(
        "stage: {time: 2, memory: 1}", "stage: {time: 2, memory: 1, weights: [0, 3, 0, 0]}"))
    code, _, err = cli("solve", path, "-o", tmp_path / "out.yaml")
    assert code == 2 and "more than the capacity 3" in err
    # Two stages on device 1 (interleaved) with its weights: each fits alone, one micro-batch
    # does not (2 + 1 + 1 > 3): infeasible, the device named.
    path.write_text(plan("[{}, {memory: 3}, {}, {}]", "memory: 8\n", kind="interleaved, chunks: 2")
                    .replace("stage: {time: 2, memory: 1}",
                             "stage: {time: 2, memory: 1, weights: [0, 1, 0, 0, 0, 1, 0, 0]}"))
    code, _, err = cli("solve", path, "-o", tmp_path / "out.yaml")
    assert code == 3 and "device 1" in err and "capacity 3" in err


@pytest.mark.parametrize("devices, memory, message", [
    ("4", "memory: [4, 4]\n", "memory lists 2 capacities for 4 devices"),
    ("[{memory: 4}, {}]", "memory: [4, 4]\n", "memory is given both here and as a memory:"),
    ("[{speed: 0}, {}]", "", "speed"),
    ("[{speed: fast}, {}]", "", "speed"),
    ("[{memroy: 4}, {}]", "", "memroy"),
    ("[]", "", "devices"),
])
def test_bad_device_lists_are_one_line_errors(cli, tmp_path, devices, memory, message):
    path = tmp_path / "bad.yaml"
    path.write_text(plan(devices, memory, n=2))
    code, out, err = cli("validate", path)
    assert code == 2 and message in err, err
    first = err.splitlines()[0]
    assert first.startswith(f"{path}:") and ": error: " in first


def test_resolved_plan_records_and_rechecks_the_devices(cli, tmp_path):
    path = tmp_path / "mixed.yaml"
    path.write_text(plan("[{memory: 8}, {memory: 8}, {memory: 4, speed: 0.5}, {speed: 2}]",
                         "memory: 6\n"))
    code, out, err = cli("solve", path, "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["device_memory"] == [8, 8, 4, 6]
    assert summary["device_speed"] == [1.0, 1.0, 0.5, 2.0]
    resolved = tmp_path / "mixed.resolved.yaml"
    text = resolved.read_text()
    assert "device_memory: [8, 8, 4, 6]\n" in text and "device_speed: [1.0, 1.0, 0.5, 2.0]\n" in text
    loaded = load_resolved(resolved)
    assert loaded.problem.capacities == (8, 8, 4, 6)
    assert loaded.problem.device_speed == (1.0, 1.0, 0.5, 2.0)
    # The same bytes when solved again.
    first = text
    code, _, _ = cli("solve", path, "--quiet")
    assert code == 0 and resolved.read_text() == first
    # show and export say how the devices differ.
    code, out, _ = cli("show", resolved, "--color", "never")
    assert code == 0 and "device speeds 1 1 0.5 2" in out and "/4 " in out
    code, _, _ = cli("export", resolved, "--format", "svg", "-o", tmp_path / "m.svg")
    assert code == 0 and "capacity 8 8 4 6, speeds 1 1 0.5 2" in (tmp_path / "m.svg").read_text()
    # An edited device list is refused at its line.
    resolved.write_text(first.replace("device_speed: [1.0, 1.0, 0.5, 2.0]",
                                      "device_speed: [1.0, 1.0, 0, 2.0]"))
    code, _, err = cli("validate", resolved)
    assert code == 2 and "device_speed" in err


def test_partition_gives_slow_and_small_devices_fewer_units():
    import pyplan

    units = [UnitCost(f"layer{i}", 1.0, 2.0, 1000, 100) for i in range(12)]
    common = dict(devices=4, micro_batches=8, name="p", factory="m:f", data="m:d", loss="m:l")
    even = pyplan.partition_plans(units, **common)[0]
    assert even.partition.bounds == (0, 3, 6, 9, 12)
    ranked = pyplan.partition_plans(units, speeds=[1, 1, 0.5, 1], **common)
    slow_device = ranked[0]
    assert len(slow_device.partition.stage(2)) < 3
    assert "speed: 0.5" in slow_device.text
    # The even split is among those solved (an incumbent), and no shorter on these devices.
    even_here = next(p for p in ranked if p.partition.bounds == (0, 3, 6, 9, 12))
    assert slow_device.makespan_ms < even_here.makespan_ms
    small = pyplan.partition_plans(units, memory=[10**6, 10**6, 2200, 10**6], **common)[0]
    assert len(small.partition.stage(2)) == 1  # 2 x 1000 B in flight + 100 B of weights
    assert "memory: 2200B" in small.text
    assert small.solution.schedule.peak_memory[2] <= 2200
