"""`pyplan solve`: the papers' results, exact optima on small cases, templates, resolved plans."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import PLANS, spec_plans
from pyplan.errors import InfeasibleError
from pyplan.problem import build_problem
from pyplan.planfile import spec_from_text
from pyplan import _core
from pyplan.problem import load_problem
from pyplan.resolved import load_resolved, render_resolved, resolved_path, write_resolved
from pyplan.problem.schedule import build_schedule, gradient_syncs
from pyplan.solver import min_memory, solve
from pyplan.solver.budget import Budget
from pyplan.solver.exact import time_optimal
from pyplan.solver.search import SearchStats, search_repetend
from pyplan.solver.templates import baselines

TESSEL = {"v": "tessel-vshape", "x": "tessel-xshape", "m": "tessel-mshape",
          "nn": "tessel-nnshape", "k": "tessel-kshape"}


def unlimited(problem, max_nr):
    """Fig. 11 setting: memory not constrained, repetends of at most max_nr micro-batches."""
    search = dataclasses.replace(problem.search, max_repetend_micro_batches=max_nr)
    return dataclasses.replace(problem, memory_capacity=None, search=search)


def best_period(problem):
    found = search_repetend(problem, budget=Budget(60), exact=True, stats=SearchStats())
    assert found.proven_optimal
    return found.repetend


@pytest.mark.parametrize("shape, zero_from", [("v", 4), ("m", 6), ("nn", 6)])
def test_fig11_zero_bubble_needs_enough_micro_batches(shape, zero_from):
    problem = load_problem(PLANS / f"{TESSEL[shape]}.yaml")
    below = best_period(unlimited(problem, zero_from - 1))
    at = best_period(unlimited(problem, zero_from))
    assert below.bubble_rate(problem.graph) > 0
    assert at.bubble_rate(problem.graph) == 0 and at.period == problem.load_bound()


@pytest.mark.parametrize("shape", ["v", "m", "nn", "k"])
def test_table2_tessel_finds_zero_bubble_repetends(shape):
    solution = solve(load_problem(PLANS / f"{TESSEL[shape]}.yaml"))
    assert solution.period_status == "optimal"
    assert solution.schedule.repetend.bubble_rate == 0


def steady_bubble(problem, template):
    """Steady-state bubble of a template: its makespan growth per extra micro-batch."""
    small = baselines(problem.with_overrides(micro_batches=64))[template]
    large = baselines(problem.with_overrides(micro_batches=128))[template]
    period = (large.makespan - small.makespan) / 64
    return 1 - sum(problem.device_loads()) / problem.num_devices / period


def test_table2_one_f_one_b_plus_bubbles():
    # 1F1B adapted to the M- and NN-shape placements: 25% and 20% in steady state.
    assert steady_bubble(load_problem(PLANS / "tessel-mshape.yaml"), "1f1b") == pytest.approx(0.25)
    assert steady_bubble(load_problem(PLANS / "tessel-nnshape.yaml"), "1f1b") == pytest.approx(0.20)
    assert not baselines(load_problem(PLANS / "tessel-kshape.yaml"))["1f1b"].applicable


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_small_vshape_completion_is_time_optimal(n):
    problem = load_problem(PLANS / "tessel-vshape.yaml").with_overrides(micro_batches=n)
    solution = solve(problem)
    everything = [(b.index, m) for m in range(n) for b in problem.blocks]
    exact = time_optimal(problem, everything, symmetry=False)
    assert exact.status == "optimal"
    assert solution.schedule.makespan == exact.value


@pytest.mark.parametrize("plan, n", [("tessel-vshape", 2), ("gpt24", 3), ("alphafold2-3f1b", 2)])
def test_time_optimal_orders_run_in_the_optimal_time(plan, n):
    # The orders Z3's model gives (read back by the names the model declares) lay out to the
    # makespan it proves, with the plan's block names and order rules.
    problem = load_problem(PLANS / f"{plan}.yaml").with_overrides(micro_batches=n)
    everything = [(b.index, m) for m in range(n) for b in problem.blocks]
    exact = time_optimal(problem, everything, symmetry=not problem.rules)
    assert exact.status == "optimal"
    assert build_schedule(problem, exact.orders, None, ()).makespan == exact.value
    assert len(set(exact.starts.values())) > 1


def test_symmetry_breaking_keeps_the_optimum():
    problem = load_problem(PLANS / "tessel-kshape.yaml").with_overrides(micro_batches=2)
    everything = [(b.index, m) for m in range(2) for b in problem.blocks]
    with_sym = time_optimal(problem, everything, symmetry=True)
    without = time_optimal(problem, everything, symmetry=False)
    assert with_sym.value == without.value


def test_bisection_and_optimize_agree():
    problem = load_problem(PLANS / "tessel-mshape.yaml").with_overrides(micro_batches=2)
    everything = [(b.index, m) for m in range(2) for b in problem.blocks]
    a = time_optimal(problem, everything, method="bisection")
    b = time_optimal(problem, everything, method="optimize")
    assert a.status == b.status == "optimal" and a.value == b.value


@pytest.mark.parametrize("shape, smallest", [("v", 1), ("m", 2), ("nn", 4), ("k", 2)])
def test_fig12_bubble_never_increases_with_memory(shape, smallest):
    # (NN-shape starts at 4: proving the optimum under 2 or 3 units takes Z3 10-20 s.)
    problem = load_problem(PLANS / f"{TESSEL[shape]}.yaml")
    periods = []
    for memory in range(smallest, 9):
        p = dataclasses.replace(unlimited(problem, 6), memory_capacity=memory)
        periods.append(best_period(p).period)
    assert periods == sorted(periods, reverse=True)
    assert periods[-1] == problem.load_bound()


def test_templates_reproduce_closed_forms():
    one = baselines(load_problem(PLANS / "1f1b-4stage.yaml"))
    assert (one["1f1b"].makespan, one["gpipe"].makespan) == (22, 22)  # (m+p-1)(F+B)
    assert round(one["1f1b"].bubble_rate, 3) == 0.273
    eight = baselines(load_problem(PLANS / "1f1b-8stage.yaml"))
    assert eight["1f1b"].makespan == (32 + 7) * 2 and round(eight["1f1b"].bubble_rate, 3) == 0.179
    assert eight["1f1b"].peak_memory == tuple(range(8, 0, -1))  # rank r holds p - r
    # Interleaved 1F1B: bubble time (1/v)(p-1)(F+B) per device, v = 2, p = 4, F+B = 3 x 2.
    inter = baselines(load_problem(PLANS / "interleaved-1f1b.yaml"))["interleaved-1f1b"]
    ideal = 8 * 2 * 3
    assert inter.makespan - ideal == (4 - 1) * 6 / 2
    assert (inter.makespan - ideal) / ideal == pytest.approx((1 / 2) * (4 - 1) / 8)
    # ZB-H1: a third of 1F1B's bubble time at 1F1B's memory (T_F = T_B = T_W = 1, p=4, m=8):
    # 1F1B with a fused backward takes (m+p-1)(F+B+W) = 33, bubble 9; ZB-H1 takes 24 + 3.
    zb = baselines(load_problem(PLANS / "zero-bubble.yaml"))["zb-h1"]
    assert zb.makespan == 8 * 3 + (4 - 1) * (1 + 1 - 1)
    assert zb.makespan - 24 == 9 / 3 and max(zb.peak_memory) == 4


def test_searched_schedule_never_loses_to_a_fitting_template():
    for name in ("tessel-xshape", "zero-bubble", "interleaved-1f1b", "1f1b-4stage"):
        solution = solve(load_problem(PLANS / f"{name}.yaml"))
        fitting = [b.makespan for b in solution.baselines.values()
                   if b.applicable and b.fits_memory]
        assert solution.schedule.makespan <= min(fitting), name


@pytest.mark.parametrize("plan", spec_plans(), ids=lambda p: p.stem)
def test_every_resolved_plan_reverifies(plan, tmp_path):
    problem = load_problem(plan)
    solution = solve(problem)
    # The committed resolved plan is fresh and is exactly what solving gives today.
    committed = resolved_path(plan)
    load_resolved(committed).check_fresh()
    assert render_resolved(solution, plan.name) == committed.read_text(), \
        f"{committed.name} is out of date: re-run pyplan solve {plan.name}"
    out = write_resolved(solution, tmp_path / "out.resolved.yaml")
    loaded = load_resolved(out)
    assert loaded.schedule.orders == solution.schedule.orders
    assert loaded.schedule.makespan == solution.schedule.makespan
    problem = solution.schedule.problem  # with the recomputation the solver chose, if any
    ev = _core.evaluate(problem.graph, [list(o) for o in loaded.schedule.orders],
                        memory_capacity=problem.capacity,
                        complete_micro_batches=problem.num_micro_batches)
    # The core times the compute; gradient synchronisations (data parallelism) may end later.
    syncs = gradient_syncs(problem, loaded.schedule.orders, ev.start)
    assert ev.ok and max([ev.makespan] + [x.end for x in syncs]) == solution.schedule.makespan
    assert max(ev.peak_memory) <= (problem.memory_capacity or max(ev.peak_memory))


@pytest.mark.parametrize("name", ["tessel-kshape", "interleaved-1f1b"])
def test_same_plan_same_bytes(name):
    # Budgets are counts and Z3 gets a fresh context per model, so nothing depends on timing
    # or on what ran before in the process.
    problem = load_problem(PLANS / f"{name}.yaml")
    first = render_resolved(solve(problem), f"{name}.yaml")
    second = render_resolved(solve(load_problem(PLANS / f"{name}.yaml")), f"{name}.yaml")
    assert first == second


def test_resolved_plan_extends_to_any_n(tmp_path):
    solution = solve(load_problem(PLANS / "tessel-vshape.yaml"))
    loaded = load_resolved(write_resolved(solution, tmp_path / "v.resolved.yaml"))
    for n in (4, 16, 64):
        assert loaded.expand(n).makespan == (n + 4 - 1) * 4  # 1F1B-optimal for f=1, b=3


def test_cli_json_and_files(cli, tmp_path):
    out = tmp_path / "k.resolved.yaml"
    code, stdout, err = cli("solve", PLANS / "tessel-kshape.yaml", "-o", out, "--json")
    assert (code, err) == (0, "")
    data = json.loads(stdout)
    for key in ("status", "makespan", "lower_bound", "bubble_rate", "repetend", "peak_memory",
                "memory_capacity", "devices", "micro_batches", "search_seconds", "baselines"):
        assert key in data
    assert data["status"] == "optimal" and data["repetend"]["bubble_rate"] == 0
    assert set(data["repetend"]) >= {"micro_batches", "period", "bubble_rate", "start", "end"}
    assert data["baselines"]["1f1b"] == "not applicable"
    assert out.exists()


def test_cli_overrides(cli, tmp_path):
    out = tmp_path / "v.resolved.yaml"
    code, stdout, _ = cli("solve", PLANS / "tessel-vshape.yaml", "-o", out, "--json",
                          "--micro-batches", "32", "--memory", "5", "--time-limit", "30")
    data = json.loads(stdout)
    assert code == 0 and data["micro_batches"] == 32 and data["memory_capacity"] == 5
    assert max(data["peak_memory"]) <= 5


def test_cli_infeasible_memory_exits_3(cli, tmp_path):
    # K-shape: a branch forward (+1) and the cross encoder (+1) share device 0.
    code, stdout, err = cli("solve", PLANS / "tessel-kshape.yaml", "-o", tmp_path / "x.yaml",
                            "--memory", "1")
    assert code == 3 and stdout == ""
    assert err == ("error: one micro-batch alone needs 2 on device 0, more than the capacity 1 "
                   "(hint: the smallest memory that admits one micro-batch is 2; raise memory: "
                   "or split blocks)\n")
    assert not (tmp_path / "x.yaml").exists()


def test_cli_bad_override_exits_2(cli):
    code, _, err = cli("solve", PLANS / "tessel-vshape.yaml", "--memory", "lots")
    assert code == 2 and "is not an amount" in err


def test_quiet_prints_nothing(cli, tmp_path):
    code, stdout, err = cli("solve", PLANS / "1f1b-4stage.yaml", "-o", tmp_path / "a.yaml",
                            "--quiet")
    assert (code, stdout, err) == (0, "", "")


@st.composite
def random_plans(draw):
    """Small random training plans: a shape with random stage costs and memory."""
    kind = draw(st.sampled_from(["vshape", "xshape", "mshape", "nnshape", "kshape"]))
    devices = draw(st.integers(2, 4))
    times = [draw(st.integers(1, 3)) for _ in range(2 * devices if kind == "xshape" else devices)]
    ratio = draw(st.sampled_from([1, 2, 3]))
    shared = "shared: {time: 1, memory: 1}" if kind != "vshape" and kind != "xshape" else ""
    text = (f"pyplan: 1\nname: random\ndevices: {devices}\nmemory: {draw(st.integers(3, 8))}\n"
            f"micro_batches: {draw(st.integers(1, 12))}\n"
            f"training: {{backward: {{time_ratio: {ratio}}}}}\n"
            f"shape: {{kind: {kind}, stage: {{time: {times}, memory: 1}}, {shared}}}\n"
            "search: {time_limit: 30}\n")
    return build_problem(spec_from_text(text))


@settings(max_examples=25, deadline=None)
@given(random_plans())
def test_random_plans_solve_to_verified_schedules(problem):
    try:
        solution = solve(problem)
    except InfeasibleError:
        need = max(min_memory(problem))
        assert need > problem.memory_capacity
        return
    schedule = solution.schedule
    ev = _core.evaluate(problem.graph, [list(o) for o in schedule.orders],
                        memory_capacity=problem.capacity,
                        complete_micro_batches=problem.num_micro_batches)
    assert ev.ok and ev.makespan == schedule.makespan
    assert schedule.makespan >= solution.lower_bound
    assert schedule.repetend is None or schedule.repetend.period >= solution.period_bound
    # time_limit: a Z3 subproblem ran out of its wall-clock share (a busy machine); what was
    # found must still verify and beat every template that fits
    assert solution.status in ("optimal", "feasible", "time_limit")
    fitting = [b.makespan for b in solution.baselines.values() if b.applicable and b.fits_memory]
    assert all(schedule.makespan <= m for m in fitting)


_RECOMPUTE_AUTO = """\
pyplan: 1
name: r
devices: 2
memory: 3
micro_batches: 3
training:
  backward: {time_ratio: 2}
  recompute: auto
blocks:
  - {name: s0, devices: [0], time: 2, memory: 2, recompute_memory: 1}
  - {name: s1, devices: [1], time: 1, memory: 1, recompute_memory: 1}
"""


def test_a_summary_claims_no_proof_its_status_denies(cli, tmp_path):
    """With recompute: auto, the chosen blocks' schedule may be proven the shortest for that
    choice while the plan's status is not optimal (another choice is not ruled out): the
    proof says which it covers."""
    (tmp_path / "r.yaml").write_text(_RECOMPUTE_AUTO)
    code, out, err = cli("solve", tmp_path / "r.yaml")
    assert code == 0, err
    assert "not proven optimal" in out.split("\n")[0]
    proofs = [line for line in out.split("\n") if "no shorter schedule exists" in line]
    assert proofs and all(line.endswith("with these blocks recomputed") for line in proofs)
