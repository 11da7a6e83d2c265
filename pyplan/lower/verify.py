"""Static verifier: run every rank's lowered program together on an abstract machine before
anything runs, and name the first instruction (rank, position, block) that could block forever
or would use, send or receive the wrong tensor.

Posting a send or receive never blocks (non-blocking mode) unless it is the first activation on
its stream, whose shape the receiver learns from a header first; a WAIT blocks until the matching
send is posted. In blocking mode a SEND and its RECV meet like a rendezvous. Blocks on several
ranks, REDUCEs and SYNCs (across data-parallel replicas) are collectives: all their ranks must
reach them, so collectives issued in different orders by two replicas block forever. Messages
between two ranks match in posting order per channel: the runtime opens one communicator per
ordered pair of ranks (a direction; activations and gradients share it), and gloo and NCCL match
the messages of one communicator in order.
"""

from __future__ import annotations

from pyplan.errors import PlanError
from pyplan.lower import (ACTIVATION, COMPUTE, GRADIENT, RECV, REDUCE, SEND, SYNC, WAIT,
                          Instruction, Lowered, Value, describe, describe_value, is_gradient)

__all__ = ["verify"]

def verify(lowered: Lowered, *, blocking: bool = False) -> None:
    """Raise PlanError unless the programs run to the end, in non-blocking or blocking mode."""
    _Machine(lowered, blocking).run()


class _Machine:
    def __init__(self, lowered: Lowered, blocking: bool) -> None:
        self.lowered, self.blocking = lowered, blocking
        self.programs = lowered.programs
        ranks = range(len(self.programs))
        self.pc = [0 for _ in ranks]
        self.have: list[set[Value]] = [set() for _ in ranks]
        self.posted: list[dict[Value, int]] = [{} for _ in ranks]
        self.waited: list[set[Value]] = [set() for _ in ranks]
        self.sent: dict[tuple[int, int], list[Value]] = {}
        self.received: dict[tuple[int, int], int] = {}
        self.streams: set[tuple[int, int, int]] = set()
        self.gradient_edges = [[c for a, c in lowered.problem.edges if a == b and
                                is_gradient(lowered.problem, a, c)]
                               for b in range(len(lowered.problem.blocks))]

    def at(self, r: int) -> Instruction | None:
        return self.programs[r][self.pc[r]] if self.pc[r] < len(self.programs[r]) else None

    def error(self, r: int, message: str) -> PlanError:
        ins = self.at(r)
        return PlanError(f"rank {r} instruction {self.pc[r]} "
                         f"({describe(self.lowered, ins)}): {message}",
                         hint="the per-rank programs are inconsistent; do not run them",
                         file=self.lowered.problem.source_path or None)

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for r in range(len(self.programs)):
                while self.at(r) is not None and self.step(r):
                    progress = True
        stuck = [r for r in range(len(self.programs)) if self.at(r) is not None]
        if stuck:
            r = min(stuck, key=lambda r: (self.at(r).seq, r))
            raise self.error(r, f"blocks forever: {self.why(r)}")
        for (src, dst), values in self.sent.items():
            if len(values) > self.received.get((src, dst), 0):
                value = values[self.received.get((src, dst), 0)]
                raise PlanError(f"rank {src} sends {describe_value(self.lowered, value)} to "
                                f"rank {dst}, which never receives it: the send blocks forever",
                                file=self.lowered.problem.source_path or None)
        for r, posted in enumerate(self.posted):
            for value in [v for v in posted if v not in self.waited[r]]:  # first posted first
                raise PlanError(f"rank {r} receives {describe_value(self.lowered, value)} but "
                                "never waits for it", file=self.lowered.problem.source_path or None)

    def produce(self, r: int, ins: Instruction) -> None:
        self.have[r].add(Value(ACTIVATION, ins.block, ins.micro_batch))
        for c in self.gradient_edges[ins.block]:
            self.have[r].add(Value(GRADIENT, ins.block, ins.micro_batch, c, r))

    def step(self, r: int) -> bool:
        ins = self.at(r)
        if ins.op in (COMPUTE, REDUCE, SYNC):
            self.check_inputs(r)
            members = [m for m in ins.group if m != r]
            if any(not self.same(self.at(m), ins) for m in members):
                return False
            for m in [r] + members:
                self.check_inputs(m)
                if ins.op == COMPUTE:
                    self.produce(m, self.at(m))
                if m != r:
                    self.pc[m] += 1
        elif ins.op == SEND:
            if ins.value not in self.have[r]:
                raise self.error(r, "sends a tensor that is not on this rank by then")
            if self.blocking:
                return self.meet(r, ins.peer, r, ins.value)
            self.sent.setdefault((r, ins.peer), []).append(ins.value)
        elif ins.op == RECV:
            if self.blocking:
                return self.meet(ins.peer, r, r, ins.value)
            channel = (ins.peer, r)
            index = self.received.get(channel, 0)
            stream = (ins.peer, r, ins.value.block)
            if ins.value.kind == ACTIVATION and stream not in self.streams:
                if not self.matched(r, channel, index, ins.value):
                    return False
                self.streams.add(stream)
            self.received[channel] = index + 1
            self.posted[r][ins.value] = index
        elif ins.op == WAIT and not self.blocking:
            if ins.value not in self.posted[r]:
                raise self.error(r, "waits for a tensor it never posted a receive for")
            if not self.matched(r, (ins.peer, r), self.posted[r][ins.value],
                                ins.value):
                return False
            self.waited[r].add(ins.value)
            self.have[r].add(ins.value)
        elif ins.op == WAIT and ins.value not in self.have[r]:
            raise self.error(r, "waits for a tensor it never received")
        self.pc[r] += 1
        return True

    def check_inputs(self, r: int) -> None:
        missing = [v for v in self.at(r).inputs if v not in self.have[r]]
        if missing:
            raise self.error(r, f"needs {describe_value(self.lowered, missing[0])}, which is "
                             f"not on rank {r} by then")

    @staticmethod
    def same(a: Instruction | None, b: Instruction) -> bool:
        return a is not None and (a.op, a.block, a.micro_batch) == (b.op, b.block, b.micro_batch)

    def matched(self, r: int, channel: tuple[int, int], index: int, value: Value) -> bool:
        sent = self.sent.get(channel, [])
        if len(sent) <= index:
            return False
        if sent[index] != value:
            raise self.error(r, f"pairs with rank {channel[0]}'s send of "
                             f"{describe_value(self.lowered, sent[index])}: the pairs cross")
        return True

    def meet(self, src: int, dst: int, r: int, value: Value) -> bool:
        """A blocking SEND on src and RECV on dst complete together."""
        other = dst if r == src else src
        peer = self.at(other)
        want = RECV if r == src else SEND
        if peer is None or peer.op != want or peer.peer != r:
            return False
        if peer.value != value:
            raise self.error(r, f"meets rank {other}'s {describe(self.lowered, peer)}: the "
                             "pairs cross")
        self.have[dst].add(value)
        self.pc[other] += 1
        self.pc[r] += 1
        return True

    def why(self, r: int) -> str:
        ins = self.at(r)
        if ins.op in (COMPUTE, REDUCE, SYNC):
            absent = [m for m in ins.group if m != r and not self.same(self.at(m), ins)]
            return f"rank {absent[0]} never joins ({self.state(absent[0])})"
        if ins.op == SEND:
            return f"rank {ins.peer} never receives it ({self.state(ins.peer)})"
        return f"rank {ins.peer} never sends it ({self.state(ins.peer)})"

    def state(self, r: int) -> str:
        ins = self.at(r)
        if ins is None:
            return f"rank {r} has finished"
        return f"rank {r} is at instruction {self.pc[r]}: {describe(self.lowered, ins)}"
