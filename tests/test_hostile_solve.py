"""Plans that are valid but odd for the solver: blocks the templates have no place for, and a
recomputation search whose work stays bounded (the same on any machine)."""

from __future__ import annotations

import itertools

import pytest

import pyplan
from pyplan import solver

KINDS = {"f": "", "nb": ", backward: false", "o": ", kind: other"}


def _chain(kinds: tuple[str, ...], split: bool, spread: bool) -> str:
    lines = [f"  - {{name: b{i}, devices: [{i % 2 if spread else i}], time: 1, "
             f"memory: {1 if k == 'f' else 0}{KINDS[k]}}}" for i, k in enumerate(kinds)]
    ratio = "{time_ratio: 1, weight_time_ratio: 1}" if split else "{time_ratio: 1}"
    return (f"pyplan: 1\nname: t\ndevices: {len(kinds)}\nmicro_batches: 4\n"
            f"training: {{backward: {ratio}}}\nblocks:\n" + "\n".join(lines) + "\n")


# Blocks of kind other (no backward) beside forward ones, with and without a split backward:
# the chain templates laid out the stages only and left them out ("b1@0 is not scheduled").
CASES = [kinds for n in (2, 3) for kinds in itertools.product(KINDS, repeat=n) if "o" in kinds]


@pytest.mark.parametrize("kinds", CASES, ids="-".join)
@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_blocks_without_a_gradient_beside_split_backwards_solve(kinds, split):
    for spread in (False, True):
        solution = pyplan.solve(pyplan.load_plan(_chain(kinds, split, spread)), time_limit=5)
        assert solution.makespan >= solution.lower_bound
        for base in solution.baselines.values():  # each template fits or says why not
            assert base.applicable or base.reason


def test_templates_without_a_place_for_a_block_say_so():
    found = pyplan.templates(_chain(("f", "o"), True, False))
    assert found["gpipe"].applicable
    assert found["1f1b"].reason == "it has no place for block 'b1'"


def _recompute_plan(blocks: int) -> str:
    lines = [f"  - {{name: b{i}, devices: [{i * 4 // blocks}], time: {1 + (7 * i) % 5}, "
             "memory: 4, recompute_memory: 1}" for i in range(blocks)]
    return (f"pyplan: 1\nname: rc\ndevices: 4\nmicro_batches: 16\nmemory: {120 * blocks // 64}"
            "\ntraining: {backward: {time_ratio: 2}, recompute: auto}\nblocks:\n"
            + "\n".join(lines) + "\n")


def test_the_recompute_search_solves_only_rungs_that_can_win(monkeypatch):
    # Every rung of the ladder used to be solved in full, each with a share of the time limit,
    # so a plan of many auto blocks ran into it (status time_limit, different bytes on a slower
    # machine). A rung whose own lower bound cannot beat what is found is skipped.
    solved = []
    inner = solver._solve

    def counting(problem, budget, progress):
        solved.append(problem)
        return inner(problem, budget, progress)

    monkeypatch.setattr(solver, "_solve", counting)
    plan = pyplan.load_plan(_recompute_plan(16))
    result = pyplan.solve(plan)
    assert result.status != "time_limit"
    assert 1 <= len(solved) < 2 + solver.RECOMPUTE_SOLVED
    ladder = solver.recompute_ladder(plan, solver.Budget())
    for rung in (ladder[0], ladder[-1]):  # none and all: solved unless they cannot win
        candidate = plan.with_recompute(rung)
        if all(candidate.blocks != p.blocks for p in solved):
            assert (candidate.makespan_bound(), len(rung)) >= \
                (result.makespan, len(result.recomputed))
    # the same answer every time
    assert pyplan.solve(plan).schedule.orders == result.schedule.orders


def test_too_little_memory_gives_a_figure_with_the_weights_and_a_position_each_try(cli,
                                                                                  tmp_path):
    plan = tmp_path / "w.yaml"
    text = ("pyplan: 1\nname: w\ndevices: 2\nmicro_batches: 4\nmemory: CAPACITY\nblocks:\n"
            "  - {name: a, devices: [0], time: 1, memory: 3, weights: 2}\n"
            "  - {name: b, devices: [0], time: 1, memory: 3}\n"
            "  - {name: c, devices: [1], time: 1, memory: 1}\n")
    tries = {"4": (2, "7:46: error: block 'a' alone needs 5 per device (3 and the weights on "
                      "device 0, 2), more than the capacity 4"),
             "5": (3, "5:9: error: one micro-batch alone needs 8 on device 0, more than the "
                      "capacity 5 (hint: the smallest memory that admits one micro-batch is 8"),
             "8": (0, "")}
    for capacity, (code, expected) in tries.items():
        plan.write_text(text.replace("CAPACITY", capacity))
        done, _, err = cli("solve", plan, "--quiet")
        assert done == code and (err.startswith(f"{plan}:{expected}") if code else not err)


def test_a_template_that_leaves_a_multi_device_block_off_a_device_does_not_apply():
    # zb-h2 placed b1 (on both devices) on one of them only: "b1@0 is missing on some of its
    # 2 devices" failed the solve.
    found = pyplan.templates(
        "pyplan: 1\nname: rt\ndevices: 2\nmicro_batches: 1\ntraining: {backward: {time_ratio: "
        "1, weight_time_ratio: 1}}\nblocks:\n  - {name: b0, devices: [0], time: 1}\n"
        "  - {name: b1, devices: all, time: 1}\n")
    assert found["zb-h2"].reason == "it has no place for block 'b1'"
    assert found["gpipe"].applicable
