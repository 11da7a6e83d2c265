"""Lowering to per-rank programs and the static verifier: real plans verify, random plans verify,
hand-broken programs are refused with the rank and block of the first instruction that blocks."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import PLANS
from dags import problems
from pyplan.errors import PlanError
from pyplan.lower import (ACTIVATION, COMPUTE, GRADIENT, RECV, REDUCE, SEND, SYNC, WAIT,
                          check_runnable, lower)
from pyplan.problem import FORWARD, Block, Problem, load_problem
from pyplan.resolved import load_resolved
from pyplan.problem.schedule import build_schedule
from pyplan.solver import solve
from pyplan.planfile import spec_from_text
from pyplan.problem import build_problem
from pyplan.lower.verify import verify

EXAMPLES = ["gpt-mshape", "gpt-mshape-blocks", "flava-kshape", "transformer-vshape"]
SOLVED = ["tessel-nnshape", "tessel-xshape", "zero-bubble", "interleaved-1f1b",
          "alphafold2-3f1b", "tessel-kshape-inference"]


def _scheduled(name: str):
    if name in EXAMPLES:
        plan = load_resolved(PLANS / f"{name}.resolved.yaml")
        return plan.problem, plan.schedule
    problem = load_problem(PLANS / f"{name}.yaml")
    return problem, solve(problem).schedule


def _lowered(name: str, early_receives: bool = True):
    return lower(*_scheduled(name), early_receives=early_receives)


def _verified_both_ways(problem, schedule):
    """The programs verify with non-blocking communication and receives posted early, and
    with blocking communication at the global order's places; the early ones differ only in
    where receives sit, each no later than its place (relative to the rest) and in the same
    order per sender; gradient receives come after the forward that shapes them."""
    early = lower(problem, schedule)
    plain = lower(problem, schedule, early_receives=False)
    verify(early)
    verify(plain, blocking=True)
    for ours, theirs in zip(early.programs, plain.programs):
        assert [i for i in ours if i.op != RECV] == [i for i in theirs if i.op != RECV]
        assert len(ours) == len(theirs)
        for peer in {i.peer for i in ours if i.op == RECV}:
            assert [i for i in ours if i.op == RECV and i.peer == peer] == \
                [i for i in theirs if i.op == RECV and i.peer == peer]

            assert _most_in_flight(ours, peer) <= max(_most_in_flight(theirs, peer), 1)

        def rest_before(program, ins):  # how many other instructions precede `ins`
            return sum(1 for i in program[:program.index(ins)] if i.op != RECV)

        for ins in (i for i in theirs if i.op == RECV):
            assert rest_before(ours, ins) <= rest_before(theirs, ins)
            if ins.value.kind == GRADIENT:
                layer = problem.by_name[problem.blocks[ins.value.consumer].layer]
                forward = next(i for i in ours if i.op == COMPUTE and i.block == layer and
                               i.micro_batch == ins.value.micro_batch)
                assert ours.index(forward) < ours.index(ins)
    return early


def _pairs_in_order(lowered) -> None:
    """Between every two ranks, the sends of one and the receives of the other list the same
    tensors in the same order, and each pair sits at the same place of the global order."""
    programs = lowered.programs
    for src in range(len(programs)):
        for dst in range(len(programs)):
            sent = [(i.seq, i.value) for i in programs[src] if i.op == SEND and i.peer == dst]
            got = [(i.seq, i.value) for i in programs[dst] if i.op == RECV and i.peer == src]
            assert sent == got


def _waits_right_before_consumers(lowered) -> None:
    for program in lowered.programs:
        for k, ins in enumerate(program):
            if ins.op == WAIT:
                after = next(i for i in program[k:] if i.op not in (WAIT, RECV))
                assert after.op == COMPUTE and ins.value in after.inputs
                assert (after.block, after.micro_batch) == (ins.block, ins.micro_batch)


@pytest.mark.parametrize("name", EXAMPLES + SOLVED)
def _most_in_flight(program, peer: int) -> int:
    """The most receives from `peer` posted and not yet waited for at once."""
    posted, most = set(), 0
    for ins in program:
        if ins.op == RECV and ins.peer == peer:
            posted.add(ins.value)
            most = max(most, len(posted))
        elif ins.op == WAIT:
            posted.discard(ins.value)
    return most


@pytest.mark.parametrize("name", EXAMPLES + SOLVED)
def test_plans_lower_to_verified_programs(name):
    lowered = _verified_both_ways(*_scheduled(name))
    _pairs_in_order(lowered)
    _waits_right_before_consumers(lowered)
    problem = lowered.problem
    for d, program in enumerate(lowered.programs):
        computes = [(i.block, i.micro_batch) for i in program if i.op == COMPUTE]
        assert sorted(computes) == sorted((b.index, m) for b in problem.blocks
                                          if d in b.devices
                                          for m in range(problem.num_micro_batches))


def test_mshape_routes_through_the_all_device_blocks():
    lowered = _lowered("gpt-mshape")
    by_name = lowered.problem.by_name
    sends = {(i.value.kind, lowered.name(i.block), r, i.peer)
             for r, p in enumerate(lowered.programs) for i in p if i.op == SEND}
    # stage3's output reaches every device of the head; each head rank sends its share of
    # stage3's gradient back; the embedding gets its gradient on rank 0 only (no transfer).
    assert {(ACTIVATION, "stage3", 3, d) for d in (0, 1, 2)} <= sends
    assert {(GRADIENT, "head.b", r, 3) for r in (0, 1, 2)} <= sends
    assert not any(name == "stage0.b" for _, name, _, _ in sends)
    embed_b = [i for i in lowered.programs[0] if i.op == COMPUTE and
               i.block == by_name["embed.b"]]
    assert all([v.kind for v in i.inputs] == [GRADIENT] for i in embed_b)
    assert all(i.inputs == () for i in lowered.programs[1]
               if i.op == COMPUTE and i.block == by_name["embed.b"])


@st.composite
def scheduled_problems(draw):
    """A random DAG with every micro-batch run in one random topological order."""
    num_devices, blocks, edges = draw(problems(max_devices=4, max_blocks=8))
    n = draw(st.integers(1, 3))
    problem = Problem(name="random", description="", num_devices=num_devices,
                      memory_capacity=None, memory_is_size=False, num_micro_batches=n,
                      training=False,
                      blocks=tuple(Block(i, f"b{i}", FORWARD, t, 0, tuple(d), f"b{i}")
                                   for i, (t, _, d) in enumerate(blocks)),
                      edges=tuple(edges))
    rng = random.Random(draw(st.integers(0, 2**32)))
    pending = {(b, m): sum(1 for _, c in edges if c == b) for b in range(len(blocks))
               for m in range(n)}
    order = []
    while pending:
        ready = sorted(i for i, k in pending.items() if k == 0)
        pick = rng.choice(ready)
        order.append(pick)
        del pending[pick]
        for a, c in edges:
            if a == pick[0]:
                pending[(c, pick[1])] -= 1
    orders = [[i for i in order if d in blocks[i[0]][2]] for d in range(num_devices)]
    return problem, build_schedule(problem, orders, None, ())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scheduled_problems())
def test_random_schedules_lower_to_verified_programs(case):
    problem, schedule = case
    lowered = _verified_both_ways(problem, schedule)
    _pairs_in_order(lowered)
    _waits_right_before_consumers(lowered)


# ---------------------------------------------------------------- hand-broken programs

def _edit(lowered, rank: int, edit):
    programs = list(lowered.programs)
    program = list(programs[rank])
    edit(program)
    programs[rank] = tuple(program)
    return dataclasses.replace(lowered, programs=tuple(programs))


def _index(program, op, predicate=lambda i: True, nth=0):
    return [k for k, i in enumerate(program) if i.op == op and predicate(i)][nth]


def test_missing_send_blocks_forever_naming_rank_and_block():
    lowered = _lowered("transformer-vshape")
    last = lambda p: max(k for k, i in enumerate(p) if i.op == SEND)  # noqa: E731
    broken = _edit(lowered, 0, lambda p: p.pop(last(p)))
    with pytest.raises(PlanError) as exc:
        verify(broken)
    assert ("rank 1 instruction 50 (wait for stage0@7 output from rank 0 before stage1@7): "
            "blocks forever: rank 0 never sends it (rank 0 is at instruction 31: wait for "
            "gradient stage1.b->stage0.b@5 of rank 1 from rank 1 before stage0.b@5)"
            in str(exc.value))


def test_missing_first_send_makes_the_later_pairs_cross():
    lowered = _lowered("transformer-vshape")
    broken = _edit(lowered, 0, lambda p: p.pop(_index(p, SEND)))
    with pytest.raises(PlanError, match=r"rank 1 instruction 0 \(recv stage0@0 output from "
                                        r"rank 0\): pairs with rank 0's send of stage0@1 "
                                        r"output: the pairs cross"):
        verify(broken)


def test_crossed_receives_are_refused():
    lowered = _lowered("transformer-vshape", early_receives=False)

    def swap(program):
        first = _index(program, RECV, lambda i: i.peer == 0)
        second = _index(program, RECV, lambda i: i.peer == 0, nth=1)
        program[first], program[second] = program[second], program[first]

    broken = _edit(lowered, 1, swap)
    with pytest.raises(PlanError, match=r"rank 1 instruction 0 \(recv stage0@1 output from "
                                        r"rank 0\): pairs with rank 0's send of stage0@0 "
                                        r"output: the pairs cross"):
        verify(broken)
    with pytest.raises(PlanError, match=r"rank 0 instruction 1 \(send stage0@0 output to rank "
                                        r"1\): meets rank 1's recv stage0@1 output from rank 0: "
                                        r"the pairs cross"):
        verify(broken, blocking=True)


def test_wait_after_its_consumer_is_refused():
    lowered = _lowered("transformer-vshape")

    def late(program):
        k = _index(program, WAIT)
        program.insert(k + 1, program.pop(k))

    with pytest.raises(PlanError, match=r"rank 1 instruction \d+ \(compute stage1@0\): needs "
                                        r"stage0@0 output, which is not on rank 1 by then"):
        verify(_edit(lowered, 1, late))


def test_collectives_in_different_orders_deadlock():
    lowered = _lowered("gpt-mshape")
    embed = lowered.problem.by_name["embed"]

    def swap(program):
        a = _index(program, COMPUTE, lambda i: i.block == embed)
        b = _index(program, COMPUTE, lambda i: i.block == embed, nth=1)
        program[a], program[b] = program[b], program[a]

    with pytest.raises(PlanError, match=r"rank 0 instruction 0 \(compute embed@0 on ranks "
                                        r"0-3\): blocks forever: rank 2 never joins \(rank 2 is "
                                        r"at instruction 0: compute embed@1 on ranks 0-3\)"):
        verify(_edit(lowered, 2, swap))


def _replicated_stages():
    """Two replicas of one device holding two stages (a, then b): two SYNCs per rank."""
    problem = _problem("pyplan: 1\nname: dp\ndevices: 1\nmicro_batches: 2\n"
                       "training:\n  backward: {time_ratio: 1}\n"
                       "mesh: {data: 2, sync: 2}\nblocks:\n"
                       "  - {name: a, time: 1, devices: [0]}\n"
                       "  - {name: b, time: 1, devices: [0]}\n")
    return lower(problem, solve(problem).schedule)


def test_replicas_run_the_same_program_with_gradient_syncs_in_schedule_order():
    lowered = _replicated_stages()
    problem = lowered.problem
    assert len(lowered.programs) == 2
    syncs = [[(i.block, i.group) for i in p if i.op == SYNC] for p in lowered.programs]
    # b's gradients are final first (the backward runs b.b, then a.b), then a's.
    expected = [(problem.by_name["b"], (0, 1)), (problem.by_name["a"], (0, 1))]
    assert syncs == [expected, expected]
    assert [x.layer for x in solve(problem).schedule.syncs] == [b for b, _ in expected]
    verify(lowered)
    verify(lowered, blocking=True)


def test_a_replica_issuing_its_syncs_in_another_order_is_refused():
    lowered = _replicated_stages()

    def swap(program):
        a, b = _index(program, SYNC), _index(program, SYNC, nth=1)
        program[a], program[b] = program[b], program[a]

    with pytest.raises(PlanError, match=r"rank 0 instruction \d+ \(sync b gradients across "
                                        r"replicas on ranks 0,1\): blocks forever: rank 1 "
                                        r"never joins \(rank 1 is at instruction \d+: sync a "):
        verify(_edit(lowered, 1, swap))


def test_replicas_talk_within_their_own_pipeline():
    lowered = lower(*_resolved("transformer-vshape-dp2"))
    mesh = lowered.problem.mesh
    # Ranks run pipeline-major: device d's two replicas are ranks 2d and 2d + 1.
    assert [mesh.coords(r) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    for rank, program in enumerate(lowered.programs):
        device, replica, _ = mesh.coords(rank)
        for ins in program:
            if ins.op in (SEND, RECV, WAIT):
                assert mesh.coords(ins.peer)[1] == replica
            if ins.op == SYNC:
                assert ins.group == (2 * device, 2 * device + 1)
    _pairs_in_order(lowered)
    verify(lowered)


def _resolved(name: str):
    plan = load_resolved(PLANS / f"{name}.resolved.yaml")
    return plan.problem, plan.schedule


def _crossing_pair():
    """a (rank 0) feeds d (rank 1), b (rank 1) feeds c (rank 0) and d."""
    problem = _problem(HEAD.replace("micro_batches: 2", "micro_batches: 1") +
                       "task: inference\nblocks:\n"
                       "  - {name: a, time: 1, devices: [0]}\n"
                       "  - {name: b, time: 1, devices: [1], after: []}\n"
                       "  - {name: c, time: 1, devices: [0], after: [b]}\n"
                       "  - {name: d, time: 1, devices: [1], after: [a, c]}\n")
    return lower(problem, solve(problem).schedule, early_receives=False)


def test_send_before_receive_on_both_sides_deadlocks_only_when_blocking():
    # If rank 1 sends b before it posts its receive of a, both ranks send first: fine with
    # non-blocking sends, a deadlock with blocking ones.
    lowered = _crossing_pair()
    assert [i.op for i in lowered.programs[1]][:3] == [RECV, COMPUTE, SEND]
    broken = _edit(lowered, 1, lambda p: p.insert(2, p.pop(0)))
    verify(broken)
    with pytest.raises(PlanError, match=r"rank 0 instruction 1 \(send a@0 output to rank 1\): "
                                        r"blocks forever: rank 1 never receives it \(rank 1 is "
                                        r"at instruction 1: send b@0 output to rank 0\)"):
        verify(broken, blocking=True)


def test_sends_never_received_and_receives_never_waited_are_refused():
    lowered = _crossing_pair()
    d = lowered.problem.by_name["d"]
    program = lowered.programs[1]
    drop_d = [i for i in program if i.op != RECV and i.block != d]  # recv, wait, compute d
    with pytest.raises(PlanError, match="rank 0 sends a@0 output to rank 1, which never "
                                        "receives it: the send blocks forever"):
        verify(_edit(lowered, 1, lambda p: p.__setitem__(slice(None), drop_d)))
    keep_recv = [i for i in program if i.block != d]  # the recv names a, the wait d
    with pytest.raises(PlanError, match="rank 1 receives a@0 output but never waits for it"):
        verify(_edit(lowered, 1, lambda p: p.__setitem__(slice(None), keep_recv)))


# ---------------------------------------------------------------- what pyplan run accepts

def _problem(text: str):
    return build_problem(spec_from_text(text))


HEAD = "pyplan: 1\nname: t\ndevices: 2\nmicro_batches: 2\n"


def test_check_runnable_finds_the_output_block():
    problem = load_problem(PLANS / "flava-kshape.yaml")
    assert problem.blocks[check_runnable(problem)].name == "cross"


def test_two_last_blocks_are_refused():
    problem = _problem(HEAD + "task: inference\nblocks:\n"
                       "  - {name: a, time: 1, devices: [0]}\n"
                       "  - {name: b, time: 1, devices: [1], after: []}\n")
    with pytest.raises(PlanError, match="exactly one last forward block .* has 2: a, b"):
        check_runnable(problem)


def test_hand_written_backward_blocks_are_refused():
    problem = _problem(HEAD + "blocks:\n"
                       "  - {name: a, time: 1, devices: [0], memory: 1}\n"
                       "  - {name: a_grad, kind: backward, time: 1, devices: [0], memory: -1}\n")
    with pytest.raises(PlanError, match="'a_grad' is a hand-written backward block"):
        check_runnable(problem)


def test_blocks_on_several_devices_sync_after_their_reduce():
    text = (PLANS / "gpt-mshape-blocks.yaml").read_text() + "\nmesh: {data: 2, sync: 2}\n"
    problem = build_problem(spec_from_text(text, str(PLANS / "dp.yaml")))
    schedule = solve(problem).schedule
    lowered = lower(problem, schedule)
    verify(lowered)
    program = lowered.programs[problem.mesh.rank(1, 1)]  # device 1, replica 1
    order = [(i.op, lowered.name(i.block)) for i in program if i.op in (SYNC, REDUCE)]
    assert order == [(SYNC, "stage1"), (REDUCE, "embed"), (SYNC, "embed"), (REDUCE, "head"),
                     (SYNC, "head")]
    # The schedule times them in that order too: the stage's sync first, the shared blocks'
    # when the device's last block has ended.
    mine = [x for x in schedule.syncs if x.device == 1]
    assert [problem.blocks[x.layer].name for x in mine][0] == "stage1"
    last = max(schedule.end_of(b, m) for b, m in schedule.orders[1])
    assert all(x.start >= last for x in mine[1:])
