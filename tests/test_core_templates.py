"""The templates' programs in the core (csrc/core/templates.cpp) vs their Python reference
(tests/template_reference.py): the same per-device orders, or both not applicable."""

from __future__ import annotations

from pathlib import Path

import pytest

import template_reference as ref
from pyplan import _core
from pyplan.problem import build_problem, load_problem
from pyplan.solver.stages import NotApplicable, stage_blocks
from pyplan.solver.templates import template_orders
from pyplan.planfile import spec_from_text

PLANS = Path(__file__).resolve().parent.parent / "plans"
REFERENCE = {"1f1b": ref.one_f_one_b, "zb-h1": ref.zb_h1, "chimera": ref.chimera,
             "zb-h2": ref.zb_h2, "zb-2p": ref.zb_2p, "zb-v": ref.zb_v}


def _shape(kind: str, devices: int, n: int, memory: int | None, split: bool) -> str:
    backward = "{time_ratio: 2, weight_time_ratio: 1}" if split else "{time_ratio: 2}"
    chunks = ", chunks: 2" if kind == "interleaved" else ""
    shared = ", shared: {time: 1, memory: 0, backward: {time: 1, memory: 0}}" \
        if kind in ("mshape", "nnshape") else ""
    return (f"pyplan: 1\nname: {kind}\ndevices: {devices}\nmicro_batches: {n}\n"
            + (f"memory: {memory}\n" if memory else "")
            + f"training: {{backward: {backward}}}\n"
            f"shape: {{kind: {kind}{chunks}, stage: {{time: 1, memory: 1}}{shared}}}\n")


def _cases():
    for path in sorted(PLANS.glob("*.yaml")):
        if not path.name.endswith(".resolved.yaml"):
            for n in (1, 3, 8):
                yield f"{path.stem}-{n}", lambda path=path, n=n: \
                    load_problem(path).with_overrides(micro_batches=n)
    # memory 2 and 5 leave 1F1B fewer micro-batches in flight on the first stages
    for kind in ("vshape", "xshape", "mshape", "nnshape", "wave", "kshape"):
        for devices, n, memory in ((2, 5, None), (4, 9, 2), (4, 16, 5), (8, 24, None)):
            for split in (False, True):
                yield f"{kind}-{devices}-{n}-{memory}-{split}", \
                    lambda args=(kind, devices, n, memory, split): \
                    build_problem(spec_from_text(_shape(*args)))


CASES = dict(_cases())


def _outcome(build, problem):
    try:
        return [list(map(tuple, order)) for order in build(problem)]
    except NotApplicable as exc:
        return f"not applicable: {exc}"


@pytest.mark.parametrize("case", CASES)
def test_template_programs_match_the_reference(case):
    problem = CASES[case]()
    for name, reference in REFERENCE.items():
        got = _outcome(lambda p: template_orders(p, name), problem)
        want = _outcome(reference, problem)
        if isinstance(want, list):  # (template_orders also checks every block has a place)
            try:
                template_orders(problem, name)
            except NotApplicable as exc:
                want = f"not applicable: {exc}"
        assert got == want, name


def test_template_programs_refuse_malformed_stages():
    problem = load_problem(PLANS / "zero-bubble.yaml")
    stages = [stage_blocks(problem, [b.index]) for b in problem.blocks if b.kind == "forward"]
    graph = problem.graph
    with pytest.raises(IndexError):  # a block the graph does not have
        _core.zb_h1_orders(graph, stages + [([99], [], [])], 4)
    with pytest.raises(ValueError):  # one limit per stage
        _core.one_f_one_b_orders(graph, [stages], 4, [1])
    with pytest.raises(ValueError):  # one device per stage
        _core.greedy_orders(graph, stages, [0], 4, True, [1], [0])
    with pytest.raises(ValueError):
        _core.zb_h1_orders(graph, stages, -1)


def test_a_stalled_program_is_not_applicable():
    # Stage 0 may hold no micro-batch in flight (a limit of 0 only the core can be given):
    # nothing ever runs, and the core says so instead of looping.
    problem = load_problem(PLANS / "1f1b-4stage.yaml")
    stages = [stage_blocks(problem, [b.index]) for b in problem.blocks if b.kind == "forward"]
    assert _core.one_f_one_b_orders(problem.graph, [stages], 4, [0, 1, 1, 1]) is None
    assert _core.greedy_orders(problem.graph, stages, [0, 1, 2, 3], 4, False, [0, 1, 1, 1],
                               [0, 1, 2, 3]) is None
