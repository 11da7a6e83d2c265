"""The solver's promises: never worse than a template that fits, a lower bound that is a bound
(and tight where the optimum is known), `optimal` only when proven, order rules at small N,
the same bytes under any hash seed."""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import PLANS
from pyplan import _core
from pyplan.errors import InfeasibleError, PlanError
from pyplan.problem import build_problem, load_problem
from pyplan.problem.schedule import schedule_from_orders
from pyplan.solver import incumbents, min_memory, solve
from pyplan.solver.budget import Budget
from pyplan.solver.complete import cheap_completion, climb
from pyplan.solver.exact import time_optimal
from pyplan.solver.search import SearchStats, candidate_pool, search_repetend
from pyplan.solver.templates import baselines as baselines_of
from pyplan.solver.templates import template_orders
from pyplan.planfile import spec_from_text


def exact_optimum(problem) -> int | None:
    """Z3's optimum of the whole problem (instances of a block in micro-batch order, which
    loses nothing without order rules), or None if it takes more than 20 seconds."""
    assert not problem.rules
    everything = [(b.index, m) for m in range(problem.num_micro_batches) for b in problem.blocks]
    result = time_optimal(problem, everything, symmetry=True, budget=Budget(20))
    return result.value if result.status == "optimal" else None


@st.composite
def placements(draw):
    """Small random training plans: a chain of forward blocks with branches (a block may
    depend on any earlier one), some blocks on several devices, random costs, memory and
    transfer times."""
    devices = draw(st.integers(1, 3))
    count = draw(st.integers(1, 4))
    lines = []
    for i in range(count):
        where = draw(st.lists(st.integers(0, devices - 1), min_size=1, max_size=devices,
                              unique=True))
        after = ""
        if i > 0 and draw(st.booleans()):
            parents = draw(st.lists(st.integers(0, i - 1), min_size=0, max_size=2, unique=True))
            after = f", after: [{', '.join(f'b{p}' for p in sorted(parents))}]"
        transfer = draw(st.sampled_from(["", "", ", transfer: 1", ", transfer: 2"]))
        lines.append(f"  - {{name: b{i}, devices: {sorted(where)}, "
                     f"time: {draw(st.integers(1, 3))}, memory: {draw(st.integers(0, 2))}"
                     f"{transfer}{after}}}")
    ratio = draw(st.sampled_from([1, 2]))
    text = (f"pyplan: 1\nname: random\ndevices: {devices}\nmemory: {draw(st.integers(2, 6))}\n"
            f"micro_batches: {draw(st.integers(1, 3))}\n"
            f"training: {{backward: {{time_ratio: {ratio}}}}}\nblocks:\n" + "\n".join(lines)
            + "\nsearch: {time_limit: 30}\n")
    return build_problem(spec_from_text(text))


@settings(max_examples=25, deadline=None)
@given(placements())
def test_never_worse_than_a_template_and_optimal_only_when_proven(problem):
    try:
        solution = solve(problem)
    except InfeasibleError:
        assert max(min_memory(problem)) > problem.memory_capacity
        return
    made = solution.schedule.makespan
    for name, schedule in incumbents(problem, solution.baselines).items():
        assert made <= schedule.makespan, name
    assert made >= solution.lower_bound
    exact = exact_optimum(problem) if len(problem.blocks) * problem.num_micro_batches <= 16 \
        else None
    if exact is not None:
        assert solution.lower_bound <= exact <= made
        if solution.status == "optimal":
            assert made == exact


@pytest.mark.parametrize("n", [1, 2, 3, 5, 9, 24, 100])
def test_bound_meets_the_known_optima(n):
    # V-shape 4N+12 and M-shape 6N+12 (4 devices, f=1, b=3; enough memory).
    assert load_problem(PLANS / "tessel-vshape.yaml").graph.makespan_bound(n) == 4 * n + 12
    assert load_problem(PLANS / "tessel-mshape.yaml").graph.makespan_bound(n) == 6 * n + 12


def test_m_shape_reaches_its_optimum_and_says_so():
    problem = load_problem(PLANS / "tessel-mshape.yaml").with_overrides(micro_batches=24,
                                                                       memory=32)
    solution = solve(problem)
    assert solution.schedule.makespan == solution.lower_bound == 6 * 24 + 12
    assert solution.status == "optimal" and solution.gap == 0


@pytest.mark.parametrize("plan, counts", [("1f1b-4stage", (1, 2, 3)),
                                          ("transformer-vshape", (1, 2)),
                                          ("alphafold2-3f1b", (1, 2, 4))])
def test_order_rules_beyond_the_micro_batches_hold_vacuously(plan, counts):
    for n in counts:
        problem = load_problem(PLANS / f"{plan}.yaml").with_overrides(micro_batches=n)
        solution = solve(problem)
        schedule = solution.schedule
        assert schedule.makespan >= solution.lower_bound
        # Every rule pair that exists is kept.
        for rule in problem.rules:
            for m in range(rule.min_m, n):
                a, b = m + rule.before_shift, m + rule.after_shift
                if 0 <= a < n and 0 <= b < n and (rule.before, a) != (rule.after, b):
                    assert schedule.end_of(rule.before, a) <= schedule.start_of(rule.after, b)


def test_same_bytes_under_any_hash_seed(tmp_path):
    outputs = []
    for seed in ("0", "12345"):
        out = tmp_path / f"x{seed}.resolved.yaml"
        env = dict(os.environ, PYTHONHASHSEED=seed)
        subprocess.run([sys.executable, "-m", "pyplan", "solve", str(PLANS / "tessel-xshape.yaml"),
                        "-o", str(out), "--quiet"], check=True, env=env, cwd=tmp_path)
        text = out.read_text()
        outputs.append(text[text.index("\nname:"):])  # the plan path differs by location only
    assert outputs[0] == outputs[1]


# ---------------------------------------------------------------- the newer templates

def wave_plan(devices: int, micro_batches: int, memory: int) -> str:
    return (f"pyplan: 1\nname: wave\ndevices: {devices}\nmemory: {memory}\n"
            f"micro_batches: {micro_batches}\n"
            "training: {backward: {time_ratio: 1, weight_time_ratio: 1}}\n"
            "shape: {kind: wave, stage: {time: 1, memory: 1}}\n")


@pytest.mark.parametrize("devices, n", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zb_v_fills_the_pipeline_at_1f1b_memory(devices, n):
    # Qi et al. Section 6: with T_F = T_B = T_W, ZB-V has no bubble beyond the unavoidable fill
    # (the lower bound) while holding what 1F1B holds on its first device: `devices`
    # micro-batches of two chunks each.
    problem = build_problem(spec_from_text(wave_plan(devices, n, 2 * devices)))
    zbv = baselines_of(problem)["zb-v"]
    assert zbv.fits_memory and max(zbv.peak_memory) <= 2 * devices
    assert zbv.makespan == problem.graph.makespan_bound(n)


@pytest.mark.parametrize("devices, n", [(2, 4), (4, 8), (4, 20)])
def test_dualpipe_v_follows_its_eight_phases(devices, n):
    problem = build_problem(spec_from_text(wave_plan(devices, n, 4 * devices)))
    orders = template_orders(problem, "dualpipev")
    name = [[problem.blocks[b].name for b, _ in order] for order in orders]
    for r in range(devices):
        chunk0, chunk1 = f"stage{r}", f"stage{2 * devices - 1 - r}"
        # Phases 1-2: 2(D - r - 1) + 1 forwards of chunk 0 come first, then chunk 1's first.
        lead = 2 * (devices - r - 1) + 1
        assert name[r][:lead] == [chunk0] * lead and name[r][lead] == chunk1
        # Every device ends on weight-gradient passes (phase 8) of chunk 0.
        assert name[r][-1] == f"{chunk0}.w"
    dual = baselines_of(problem)["dualpipev"]
    assert dual.makespan == problem.graph.makespan_bound(n)  # F = B = W: no bubble left


@pytest.mark.parametrize("ratio", [1, 2])
def test_zb_h2_holds_twice_the_warmup_and_never_loses_to_zb_h1(ratio):
    text = ("pyplan: 1\nname: zb\ndevices: 4\nmicro_batches: 12\n"
            f"training: {{backward: {{time_ratio: {ratio}, weight_time_ratio: 1}}}}\n"
            "shape: {kind: vshape, stage: {time: 1, memory: 1}}\n")
    problem = build_problem(spec_from_text(text))
    found = baselines_of(problem)
    # 2(p - s) - 1 micro-batches in flight on stage s (ZB-H2's doubled warmup) vs 1F1B's p - s.
    assert found["zb-h2"].peak_memory == (7, 5, 3, 1)
    assert found["zb-h1"].peak_memory == (4, 3, 2, 1)
    assert found["zb-h2"].makespan <= found["zb-h1"].makespan


def test_zero_bubble_v_and_dualpipe_v_cost_what_torchs_do(tmp_path):
    # torch.distributed.pipelining implements both (ScheduleZBVZeroBubble, ScheduleDualPipeV):
    # their orders, costed by the core, take as long and hold as much as ours.
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    torch = pytest.importorskip("torch")
    from pyplan.export.torch_csv import read_torch_csv
    devices, n = 4, 8
    problem = build_problem(spec_from_text(wave_plan(devices, n, 64)))

    class Stage:
        def __init__(self, index: int) -> None:
            self.num_stages, self.group_size = 2 * devices, devices
            self.group_rank, self.stage_index = 0, index
            self.submod = torch.nn.Module()

    ours = baselines_of(problem)
    for cls, name in (("ScheduleZBVZeroBubble", "zb-v"), ("ScheduleDualPipeV", "dualpipev")):
        theirs = getattr(schedules, cls)([Stage(0), Stage(2 * devices - 1)], n)
        path = tmp_path / f"{name}.csv"
        theirs._dump_csv(str(path), format="compute_only")
        orders = read_torch_csv(path, problem).orders
        ev = _core.evaluate(problem.graph, orders,
                            complete_micro_batches=n, enforce_rules=False)
        assert ev.ok
        assert (ours[name].makespan, ours[name].peak_memory) == \
            (ev.makespan, tuple(ev.peak_memory)), name


def test_infeasible_rules_are_named_at_their_lines(cli, tmp_path):
    # Two rules that contradict each other (no memory involved): the minimal core is both.
    plan = tmp_path / "rules.yaml"
    plan.write_text("pyplan: 1\nname: rules\ndevices: 2\nmicro_batches: 4\n"
                    "training: {backward: {time_ratio: 2}}\n"
                    "shape: {kind: vshape, stage: {time: 1, memory: 1}}\n"
                    "constraints:\n  order:\n"
                    "    - \"stage0.f[m+1] < stage1.f[m]\"\n"
                    "    - \"stage1.f[m] < stage0.f[m+1]\"\n"
                    "    - \"stage0.b[m] < stage0.b[m+1]\"\n")
    code, out, err = cli("solve", plan, "-o", tmp_path / "out.yaml")
    assert (code, out) == (3, "")
    assert err == (f"{plan}:9:7: error: no schedule of 2 micro-batches keeps these order rules "
                   "together: line 9 'stage0.f[m+1] < stage1.f[m]', line 10 'stage1.f[m] < "
                   "stage0.f[m+1]' (hint: relax or remove one of them)\n")
    assert not (tmp_path / "out.yaml").exists()


def test_memory_alone_gets_the_least_capacity(cli):
    # 1F1B's rules on 4 stages hold 4 micro-batches on stage 0: memory 3 cannot, and the
    # message names the rules and the memory together (both are needed for the conflict).
    code, _, err = cli("solve", PLANS / "1f1b-4stage.yaml", "--memory", "3", "-o", "/dev/null")
    assert code == 3
    assert "within the memory capacity 3" in err and "stage0.f[m+3] < stage0.b[m]" in err


DP_PLANS = {
    "two stages on one device": "pyplan: 1\nname: dp\ndevices: 1\nmicro_batches: 3\n"
                                "training:\n  backward: {time_ratio: 2}\n"
                                "mesh: {data: 2, sync: 2}\nblocks:\n"
                                "  - {name: a, time: 1, devices: [0]}\n"
                                "  - {name: b, time: 2, devices: [0]}\n",
    "transformer-vshape-dp2": (PLANS / "transformer-vshape-dp2.yaml").read_text(),
}


@pytest.mark.parametrize("name", DP_PLANS)
def test_gradient_syncs_queue_after_their_stage_and_optimal_means_no_order_is_shorter(name):
    problem = build_problem(spec_from_text(DP_PLANS[name]))
    solution = solve(problem)
    schedule = solution.schedule
    blocks = problem.blocks
    for d in range(problem.num_devices):
        mine = [x for x in schedule.syncs if x.device == d]
        free = 0
        for x in mine:  # each as soon as its stage's gradients are final and the stream is free
            ready = max(schedule.end_of(b, m) for b, m in schedule.orders[d]
                        if not blocks[b].is_forward and blocks[b].layer == blocks[x.layer].name)
            assert x.start == max(ready, free) and x.end == x.start + problem.mesh.sync
            free = x.end
    compute_end = max(schedule.end_of(b, m) for order in schedule.orders for b, m in order)
    assert schedule.makespan == max([compute_end] + [x.end for x in schedule.syncs])
    assert solution.lower_bound <= schedule.makespan
    # No random valid order that fits memory beats a schedule called optimal.
    rng = random.Random(0)
    n = problem.num_micro_batches
    preds = {b: [a for a, c in problem.edges if c == b] for b in range(len(blocks))}
    for _ in range(300):
        done, order = set(), []
        pending = [(b, m) for m in range(n) for b in range(len(blocks))]
        while pending:
            ready = [i for i in pending if all((a, i[1]) in done for a in preds[i[0]])]
            pick = rng.choice(ready)
            pending.remove(pick)
            done.add(pick)
            order.append(pick)
        orders = [[i for i in order if d in blocks[i[0]].devices]
                  for d in range(problem.num_devices)]
        evaluated = schedule_from_orders(problem, orders, n)
        if evaluated.fits_memory and solution.status == "optimal":
            assert evaluated.schedule.makespan >= schedule.makespan


WEIGHTS_PLAN = """\
pyplan: 1
name: weights
devices: 4
memory: 6
micro_batches: 8
training:
  backward: {time_ratio: 2}
blocks:
  - {name: s0, devices: [0], time: 1, memory: 1, weights: WEIGHTS}
  - {name: s1, devices: [1], time: 1, memory: 1}
  - {name: s2, devices: [2], time: 1, memory: 1}
  - {name: s3, devices: [3], time: 1, memory: 1}
"""


def test_weights_are_resident_memory_in_peaks_templates_and_the_search(tmp_path):
    plans = {w: build_problem(spec_from_text(WEIGHTS_PLAN.replace("WEIGHTS", str(w))))
             for w in (0, 2, 4)}
    assert plans[4].static_memory == (4, 0, 0, 0)
    solved = {w: solve(p) for w, p in plans.items()}
    for w, s in solved.items():
        # Device 0 holds its weights all along: its peak counts them and stays within 6.
        assert w + 1 <= s.schedule.peak_memory[0] <= 6
        assert all(b.peak_memory[0] >= w for b in s.baselines.values() if b.applicable)
        ev = _core.evaluate(plans[w].graph, [list(o) for o in s.schedule.orders],
                            memory_capacity=6, complete_micro_batches=8)
        assert ev.ok and list(ev.peak_memory) == list(s.schedule.peak_memory)
    # Less room for activations on device 0 can only make the schedule longer.
    assert solved[0].schedule.makespan <= solved[2].schedule.makespan <= \
        solved[4].schedule.makespan
    assert solved[4].schedule.makespan > solved[0].schedule.makespan
    # The resolved plan records them and reads back the same schedule.
    from pyplan.resolved import load_resolved, write_resolved

    out = write_resolved(solved[4], tmp_path / "w.resolved.yaml")
    assert "{name: s0, kind: forward, time: 1, memory: 1, weights: 4, devices: [0]}" in \
        out.read_text()
    assert load_resolved(out).schedule.peak_memory == solved[4].schedule.peak_memory


def test_weights_that_leave_no_room_are_infeasible():
    # (a block that cannot fit beside the weights on its device is refused where it is)
    with pytest.raises(PlanError, match=r"block 's0' alone needs 7 per device \(1 and the "
                       r"weights on device 0, 6\), more than the capacity 6"):
        solve(build_problem(spec_from_text(WEIGHTS_PLAN.replace("WEIGHTS", "6"))))


def test_shape_costs_carry_weights_per_stage_and_for_shared_blocks():
    plan = build_problem(spec_from_text(
        "pyplan: 1\nname: s\ndevices: 4\nmemory: 8\nmicro_batches: 8\n"
        "training: {backward: {time_ratio: 2}}\nshape:\n  kind: mshape\n"
        "  stage: {time: 1, memory: 1, weights: [3, 1, 1, 2]}\n"
        "  shared: {time: 1, memory: 0, weights: 1}\n"))
    assert plan.static_memory == (4, 2, 2, 3)  # a stage's weights + the shared block's
    assert solve(plan).schedule.peak_memory[0] <= 8


SHORTENED = ["tessel-xshape", "alphafold2-3f1b", "tessel-nnshape", "zero-bubble", "zb-v",
             "gpt24", "interleaved-1f1b", "1f1b-8stage"]


@pytest.mark.parametrize("n", [4, 9])
def test_cheap_completion_and_local_search_only_shorten(n):
    # List-scheduled phases are kept only where they run and are shorter than the periodic
    # order; every local-search step keeps the period, a monotone index assignment and memory,
    # and is strictly shorter than the one before.
    kinds = collections.Counter()
    for name in SHORTENED:
        problem = load_problem(PLANS / f"{name}.yaml").with_overrides(micro_batches=n)
        try:
            found = search_repetend(problem, budget=Budget(30), exact=False,
                                    stats=SearchStats())
        except InfeasibleError:  # (no repetend without Z3: the whole problem is solved)
            continue
        for rep in candidate_pool(problem, found.repetend, budget=Budget(30),
                                  stats=SearchStats(), work=0):
            start = cheap_completion(problem, rep)
            if start is None:
                assert n < rep.num_micro_batches
                continue
            periodic = _core.periodic_makespan(problem.graph, rep, n, problem.capacity)
            assert start[0].makespan <= periodic
            assert start[1] == ("periodic" if start[0].makespan == periodic
                                else "list-scheduled")
            kinds[start[1]] += 1
            made = start[0].makespan
            for step, (schedule, _) in climb(problem, rep, start, target=0,
                                             max_micro_batches=n, work=10**6,
                                             budget=Budget(30)):
                kinds["climbed"] += 1
                assert step.period <= rep.period and step.num_micro_batches <= n
                assert all(step.indices[c] <= step.indices[a] for a, c in problem.edges)
                assert _core.memory_fits(step, problem.capacity)
                assert schedule.makespan < made
                assert max(schedule.peak_memory) <= problem.memory_capacity
                made = schedule.makespan
    assert kinds["list-scheduled"] >= 3 and kinds["climbed"] >= 3, kinds


@pytest.mark.parametrize("n, optimum", [(8, 68), (16, 132), (24, 196)])
def test_local_search_completes_the_x_shape_at_its_bound(n, optimum):
    # The modulo repetends of the X-shape complete 6-10% above the bound; moving blocks with
    # everything before (or after) them to other micro-batches reaches it.
    problem = load_problem(PLANS / "tessel-xshape.yaml").with_overrides(micro_batches=n)
    assert problem.makespan_bound() == optimum
    stats = SearchStats()
    found = search_repetend(problem, budget=Budget(30), exact=False, stats=stats)
    pool = candidate_pool(problem, found.repetend, budget=Budget(30), stats=stats, work=0)
    best = min(cheap_completion(problem, rep)[0].makespan for rep in pool)
    assert best > optimum
    climbed = [schedule.makespan for rep in pool
               for _, (schedule, _) in climb(problem, rep, cheap_completion(problem, rep),
                                             target=optimum, max_micro_batches=6,
                                             work=10**7, budget=Budget(30))]
    assert min(climbed) == optimum
