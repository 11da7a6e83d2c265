"""A rank's program (pyplan.lower) compiled once into steps over numbered slots, one per value
the rank holds at some point, so that an iteration does list indexing, not dictionary traffic
(pyplan.run.executor runs the steps).

A step is a tuple whose first item is its code:
- (STEP_FORWARD, block, micro-batch, input slots, output slot)
- (STEP_BACKWARD, layer, micro-batch, gradient slots, {producer: slot}, block)
- (STEP_WEIGHT, layer, micro-batch)
- (STEP_SEND_ACT or STEP_SEND_GRAD, slot, peer, block, seq, what)
- (STEP_RECV_ACT, slot, peer, block), (STEP_RECV_GRAD, slot, peer, layer, micro-batch)
- (STEP_WAIT, slot, peer, the send's seq), (STEP_REDUCE, block), (STEP_SYNC, block)
The codes of compute steps come first: `code <= STEP_WEIGHT` is a block's work.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyplan.lower import (ACTIVATION, COMPUTE, GRADIENT, RECV, REDUCE, SEND, SYNC, WAIT,
                          Instruction, Value)
from pyplan.problem import BACKWARD, WEIGHT, Problem

__all__ = ["STEP_BACKWARD", "STEP_FORWARD", "STEP_RECV_ACT", "STEP_RECV_GRAD",
           "STEP_REDUCE", "STEP_SEND_ACT", "STEP_SEND_GRAD", "STEP_SYNC", "STEP_WAIT",
           "STEP_WEIGHT", "Steps", "compile_steps"]

STEP_FORWARD, STEP_BACKWARD, STEP_WEIGHT, STEP_SEND_ACT, STEP_SEND_GRAD, STEP_RECV_ACT, \
    STEP_RECV_GRAD, STEP_WAIT, STEP_REDUCE, STEP_SYNC = range(10)


@dataclass
class Steps:
    steps: list[tuple]
    drops: list[list[int]]
    """Per step, the slots to let go of after it (their last use, or nobody uses them)."""
    slots: int
    forwarded: set[int]
    """Slots the rank sends on (a received value handed on)."""
    received: set[int]
    """Slots of received activations."""


def compile_steps(program: tuple[Instruction, ...], problem: Problem, layer: list[int],
                  backs_to: list[set[int]], rank: int) -> Steps:
    """`program`'s steps; `layer[b]` is the declared block block b derives from, `backs_to[b]`
    the blocks layer b's backward sends gradients to."""
    blocks = problem.blocks
    slots: dict[Value, int] = {}

    def slot(value: Value) -> int:
        return slots.setdefault(value, len(slots))

    last: dict[int, int] = {}
    made: dict[int, int] = {}  # slot -> the step that produces it
    sent_at: dict[Value, int] = {}  # a received value -> its send's global position
    steps = []
    by_name = problem.by_name
    for index, ins in enumerate(program):
        if ins.op == COMPUTE:
            kind = blocks[ins.block].kind
            b, m = layer[ins.block], ins.micro_batch
            if kind == WEIGHT:
                steps.append((STEP_WEIGHT, b, m))
            elif kind == BACKWARD:
                grads = [slot(v) for v in ins.inputs if v.kind == GRADIENT]
                targets = {p: slot(Value(GRADIENT, ins.block, m,
                                         by_name[f"{blocks[p].name}.b"], rank))
                           for p in backs_to[b]}
                steps.append((STEP_BACKWARD, b, m, grads, targets, ins.block))
                made.update((t, index) for t in targets.values())
            else:
                out = slot(Value(ACTIVATION, b, m))
                steps.append((STEP_FORWARD, b, m, [slot(v) for v in ins.inputs], out))
                made[out] = index
            # A backward keeps its forward's graph itself: only what it receives is an
            # input here (its forward's output is not held for it).
            for v in ins.inputs:
                if blocks[ins.block].is_forward or v.kind == GRADIENT:
                    last[slots[v]] = index
        elif ins.op == SEND:
            code = STEP_SEND_ACT if ins.value.kind == ACTIVATION else STEP_SEND_GRAD
            what = f"block '{blocks[ins.value.block].name}' " \
                f"(micro-batch {ins.value.micro_batch})"
            steps.append((code, slot(ins.value), ins.peer, ins.value.block, ins.seq, what))
            last[slots[ins.value]] = index
        elif ins.op == RECV:
            sent_at[ins.value] = ins.seq
            if ins.value.kind == ACTIVATION:
                steps.append((STEP_RECV_ACT, slot(ins.value), ins.peer, ins.value.block))
            else:
                steps.append((STEP_RECV_GRAD, slot(ins.value), ins.peer,
                              layer[ins.value.consumer], ins.value.micro_batch))
        elif ins.op == WAIT:
            steps.append((STEP_WAIT, slot(ins.value), ins.peer, sent_at[ins.value]))
        elif ins.op == REDUCE:
            steps.append((STEP_REDUCE, ins.block))
        elif ins.op == SYNC:
            steps.append((STEP_SYNC, ins.block))
    drops: list[list[int]] = [[] for _ in steps]
    for s, index in {**made, **last}.items():  # what nobody uses goes at once
        drops[index].append(s)
    return Steps(steps, drops, len(slots),
                 {step[1] for step in steps if step[0] == STEP_SEND_ACT},
                 {step[1] for step in steps if step[0] == STEP_RECV_ACT})
