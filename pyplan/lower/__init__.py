"""Lowering: a schedule -> one instruction program per rank (COMPUTE, SEND, RECV, WAIT, REDUCE,
SYNC).

Tessel IV-D: one global order, a topological sort of the schedule (start time, then the
per-device orders), fixes where every rank posts its sends and receives. Each SEND/RECV pair
sits right after the block instance that produces its tensor, at the same place on both ranks,
so the pairs between two ranks are posted in the same order on both sides and cannot cross;
each WAIT sits right before the first block instance on its rank that consumes the tensor.
With non-blocking communication a receive then moves up to where the one before it from the
same rank has been waited for (`_early_receives`: the data moves while the receiver computes).

Routing of a tensor between a producer on devices P and a consumer on devices C: an activation
(one tensor, the same on every device of P) goes to each device of C that is not in P from the
lowest device of P. A gradient is computed by every device of a backward block; each device's
contribution goes back the way the activation came (to itself when it is also a device of the
receiving block, else to that block's lowest device), where all contributions are summed.

With a mesh (`mesh: {data, shard, tensor}`) each pipeline device is data_parallel x tensor
ranks (rank = (device x data_parallel + data_index) x tensor + tensor_index, MeshSpec), and
every one of them runs its device's program, its peers and groups moved to the ranks of its own
data and tensor index: a tensor rank sends to its peer in the next stage, 1:1. Each stage's
gradients are synchronised across the data-parallel ranks by a SYNC, a collective of the ranks
holding that device with the same tensor index, issued in the order the schedule's gradient
synchronisations take on the device, each after the stage's last gradient block there and what
it sends (and after its REDUCE, for a block on several devices).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pyplan.problem import BACKWARD, WEIGHT, Problem
from pyplan.problem.schedule import Schedule
from pyplan.planfile.source import error_at

__all__ = ["ACTIVATION", "COMPUTE", "GRADIENT", "RECV", "REDUCE", "SEND", "SYNC", "WAIT",
           "Instruction", "Lowered", "Value", "channels", "check_runnable", "describe",
           "describe_value", "forward_only", "global_order", "is_gradient", "lower"]

COMPUTE, SEND, RECV, WAIT, REDUCE, SYNC = "compute", "send", "recv", "wait", "reduce", "sync"
ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass(frozen=True)
class Value:
    """A tensor one block instance hands to another."""

    kind: str
    """activation: the output of `block`; gradient: a contribution to the gradient of
    `consumer`'s forward output, computed by backward block `block` on device `origin`."""
    block: int
    micro_batch: int
    consumer: int = -1
    origin: int = -1


@dataclass(frozen=True)
class Instruction:
    op: str
    seq: int
    """Position in the global order; both halves of a SEND/RECV pair share it."""
    block: int
    """compute/reduce: the block; send/recv: the producer; wait: the block that needs it;
    sync: the declared block whose gradients it synchronises."""
    micro_batch: int
    value: Value | None = None
    peer: int = -1
    group: tuple[int, ...] = ()
    """compute/reduce/sync: every rank that runs it (they meet in its collectives)."""
    inputs: tuple[Value, ...] = ()
    """compute: what it consumes on this rank (forward inputs in dependency order)."""


@dataclass(frozen=True)
class Lowered:
    problem: Problem
    order: tuple[tuple[int, int], ...]
    """Every (block, micro-batch) in the global order."""
    programs: tuple[tuple[Instruction, ...], ...]
    makespan: int = 0
    """The schedule's makespan (transfers and gradient syncs included), in plan units."""

    def name(self, block: int) -> str:
        return self.problem.blocks[block].name


def is_gradient(problem: Problem, src: int, dst: int) -> bool:
    """Does the dependency src -> dst carry a gradient (backward to backward)?"""
    return problem.blocks[src].kind == BACKWARD and problem.blocks[dst].kind == BACKWARD


def global_order(problem: Problem, schedule: Schedule) -> tuple[tuple[int, int], ...]:
    """All instances sorted by start time (ties: block, micro-batch); a topological order of the
    dependencies and of every device's order, because blocks take positive time."""
    order = sorted(((b, m) for b in range(len(problem.blocks))
                    for m in range(problem.num_micro_batches)),
                   key=lambda i: (schedule.start_of(*i), i))
    where = {inst: k for k, inst in enumerate(order)}
    for device_order in schedule.orders:
        if any(where[a] > where[b] for a, b in zip(device_order, device_order[1:])):
            raise ValueError("the schedule's device orders disagree with its start times")
    return tuple(order)


def lower(problem: Problem, schedule: Schedule, *, early_receives: bool = True) -> Lowered:
    """Per-rank programs for one iteration (all micro-batches) of a schedule, for every rank of
    every data-parallel replica; `early_receives`: receives posted ahead (`_early_receives`:
    non-blocking communication only)."""
    pipeline = _pipeline(problem, schedule)
    if early_receives:
        pipeline = [_early_receives(problem, program) for program in pipeline]
    programs = [_with_syncs(problem, schedule, d, program) for d, program in enumerate(pipeline)]
    mesh = problem.mesh
    world = [_moved(programs[device], mesh, device, data_index, tensor_index)
             for device, data_index, tensor_index in
             map(mesh.coords, range(mesh.world(problem.num_devices)))]
    return Lowered(problem, global_order(problem, schedule), tuple(world), schedule.makespan)


def _with_syncs(problem: Problem, schedule: Schedule, device: int,
                program: list[Instruction]) -> tuple[Instruction, ...]:
    """A device's program with its SYNCs, in the order of the schedule's synchronisations."""
    program = list(program)
    replicas = tuple(range(problem.mesh.data_parallel))  # data indices, moved with the rest
    after = -1
    for sync in (x for x in schedule.syncs if x.device == device):
        layer = problem.blocks[sync.layer]
        last = max(i for i, ins in enumerate(program)
                   if (ins.op == COMPUTE and problem.blocks[ins.block].layer == layer.name
                       and not problem.blocks[ins.block].is_forward)
                   or (ins.op == REDUCE and ins.block == layer.index))
        block, mb = program[last].block, program[last].micro_batch
        while last + 1 < len(program) and program[last + 1].op == SEND and \
                (program[last + 1].block, program[last + 1].micro_batch) == (block, mb):
            last += 1  # the gradient sends go first: the pipeline waits for them
        after = max(after, last) + 1
        program.insert(after, Instruction(SYNC, program[last].seq, layer.index, -1,
                                          group=replicas))
    return tuple(program)


def _moved(program: tuple[Instruction, ...], mesh, device: int, data_index: int,
           tensor_index: int) -> tuple[Instruction, ...]:
    """A rank's copy of its device's program: peers, groups and gradient origins (devices) moved
    to the ranks of its data and tensor index; a SYNC's group (data indices) to the ranks of its
    device and tensor index."""
    if mesh.data_parallel * mesh.tensor == 1:
        return program

    def rank(other: int) -> int:
        return mesh.rank(other, data_index, tensor_index)

    def value(v: Value | None) -> Value | None:
        return v if v is None or v.kind != GRADIENT else replace(v, origin=rank(v.origin))

    return tuple(
        replace(ins, group=tuple(mesh.rank(device, d, tensor_index) for d in ins.group))
        if ins.op == SYNC else
        replace(ins, peer=rank(ins.peer) if ins.peer >= 0 else -1,
                group=tuple(rank(g) for g in ins.group), value=value(ins.value),
                inputs=tuple(value(v) for v in ins.inputs))
        for ins in program)


def _pipeline(problem: Problem, schedule: Schedule) -> list[list[Instruction]]:
    """The programs of one pipeline (ranks 0 .. devices-1), without gradient syncs."""
    blocks = problem.blocks
    preds: list[list[int]] = [[] for _ in blocks]
    succs: list[list[int]] = [[] for _ in blocks]
    for a, c in problem.edges:
        preds[c].append(a)
        succs[a].append(c)
    programs: list[list[Instruction]] = [[] for _ in range(problem.num_devices)]
    pending: list[set[Value]] = [set() for _ in programs]  # received, not yet waited
    seq = 0
    order = global_order(problem, schedule)
    for b, m in order:
        devices = blocks[b].devices
        seq += 1
        for d in devices:
            inputs = tuple(v for p in preds[b] for v in _inputs(problem, p, b, m, d))
            for v in inputs:
                if v in pending[d]:
                    pending[d].discard(v)
                    programs[d].append(Instruction(WAIT, seq, b, m, v, _source(v, d, problem)))
            programs[d].append(Instruction(COMPUTE, seq, b, m, group=devices, inputs=inputs))
        for value, src, dst in _transfers(problem, b, m, succs[b]):
            seq += 1
            programs[src].append(Instruction(SEND, seq, b, m, value, dst))
            programs[dst].append(Instruction(RECV, seq, b, m, value, src))
            pending[dst].add(value)
    if problem.training:
        # Replicated parameters of multi-device blocks: their gradients are summed over the
        # block's ranks once all micro-batches are done, in block order on every rank.
        for block in blocks:
            if len(block.devices) > 1 and block.is_forward and \
                    f"{block.name}.b" in problem.by_name:
                seq += 1
                for d in block.devices:
                    programs[d].append(Instruction(REDUCE, seq, block.index, -1,
                                                   group=block.devices))
    return programs


def _early_receives(problem: Problem, program: list[Instruction]) -> list[Instruction]:
    """The program with each receive posted as soon as the one before it from the same rank
    has been waited for, rather than where the global order puts its send: gloo (and NCCL)
    move the data once the receive is posted, so a receive posted at the global order's place,
    which a real run often reaches after its sender has sent, costs a round trip in the wait
    that follows (benchmarks/runtime.py). From each rank the receives keep their order
    (messages match in posting order), a gradient's comes after the forward whose output
    shapes it, and the first activation of a stream stays: posting it blocks on the header
    with its shapes (pyplan.comm), which its sender may send only later."""
    out: list[Instruction] = []
    free: dict[int, int | None] = {}  # peer -> the earliest place for its next receive
    last: dict[int, Value] = {}  # peer -> its last receive so far
    forwards: dict[tuple[int, int], int] = {}  # (forward block, micro-batch) -> place
    streams: set[tuple[int, int]] = set()  # (peer, producer) whose header has come

    def insert(at: int, ins: Instruction) -> None:
        out.insert(at, ins)
        for table in (free, forwards):
            for key, where in table.items():
                if where is not None and where >= at:
                    table[key] = where + 1

    for ins in program:
        if ins.op == RECV:
            value, peer = ins.value, ins.peer
            if value.kind == ACTIVATION and (peer, value.block) not in streams:
                streams.add((peer, value.block))
                at = len(out)
            else:
                at = free.get(peer, 0)
                at = len(out) if at is None else at
                if value.kind == GRADIENT:
                    layer = problem.by_name[problem.blocks[value.consumer].layer]
                    at = max(at, forwards[(layer, value.micro_batch)] + 1)
            insert(at, ins)
            free[peer], last[peer] = None, value  # the next: not before this one's wait
        else:
            if ins.op == WAIT and last.get(ins.peer) == ins.value:
                free[ins.peer] = len(out) + 1
            elif ins.op == COMPUTE and problem.blocks[ins.block].is_forward:
                forwards[(ins.block, ins.micro_batch)] = len(out)
            out.append(ins)
    return out


def forward_only(lowered: Lowered) -> Lowered:
    """The programs of a forward pass alone (evaluation): every instruction that computes or
    moves an activation, in the same places. A subsequence of verified programs that drops only
    gradient work, which no forward waits for."""
    blocks = lowered.problem.blocks

    def keeps(ins: Instruction) -> bool:
        if ins.op in (COMPUTE,):
            return blocks[ins.block].is_forward
        if ins.op in (SEND, RECV, WAIT):
            return ins.value.kind == ACTIVATION
        return False

    return replace(lowered, programs=tuple(tuple(ins for ins in program if keeps(ins))
                                           for program in lowered.programs))


def channels(lowered: Lowered) -> list[tuple[int, int, str]]:
    """Every (source rank, destination rank, kind) a transfer uses: the communicators the
    runtime opens, the same list on every rank."""
    return sorted({(r, ins.peer, ins.value.kind) for r, program in enumerate(lowered.programs)
                   for ins in program if ins.op == SEND})


def _route(to: int, devices: tuple[int, ...]) -> int:
    return to if to in devices else devices[0]


def _inputs(problem: Problem, src: int, dst: int, m: int, device: int) -> list[Value]:
    """What block `dst` on `device` consumes from `src` for micro-batch m."""
    if not is_gradient(problem, src, dst):
        return [Value(ACTIVATION, src, m)]
    here = problem.blocks[dst].devices
    return [Value(GRADIENT, src, m, dst, k) for k in problem.blocks[src].devices
            if _route(k, here) == device]


def _source(value: Value, device: int, problem: Problem) -> int:
    if value.kind == GRADIENT:
        return value.origin
    return _route(device, problem.blocks[value.block].devices)


def _transfers(problem: Problem, b: int, m: int, consumers: list[int]):
    """(value, src, dst) for everything instance (b, m) sends, in a fixed order."""
    here = problem.blocks[b].devices
    needs: dict[int, None] = {}
    out = []
    for c in consumers:
        there = problem.blocks[c].devices
        if is_gradient(problem, b, c):
            for k in here:
                if _route(k, there) != k:
                    out.append((Value(GRADIENT, b, m, c, k), k, there[0]))
        else:
            needs.update((d, None) for d in there if d not in here)
    out[:0] = [(Value(ACTIVATION, b, m), here[0], d) for d in sorted(needs)]
    return out


def check_runnable(problem: Problem) -> int:
    """Raise PlanError unless `pyplan run` can execute the plan; returns the output block (the
    one forward block whose output goes to the loss)."""
    by_name = problem.by_name
    for block in problem.blocks:
        suffix = {BACKWARD: ".b", WEIGHT: ".w"}.get(block.kind)
        if suffix and (block.name != block.layer + suffix or block.layer not in by_name):
            raise error_at(problem.source_path, ("blocks", block.index),
                           f"block '{block.name}' is a hand-written {block.kind} block; "
                           "pyplan run derives backward work from forward blocks",
                           "let training: backward: derive NAME.b (and NAME.w) blocks")
    forward = [b for b in problem.blocks if b.is_forward]
    feeds = {a for a, c in problem.edges if problem.blocks[c].is_forward}
    last = [b.name for b in forward if b.index not in feeds]
    if len(last) != 1:
        raise error_at(problem.source_path, ("blocks",),
                       f"pyplan run needs exactly one last forward block (its output goes to "
                       f"the loss); this plan has {len(last)}: {', '.join(last)}",
                       "join the branches in one block with after:")
    return by_name[last[0]]


def describe(lowered: Lowered, ins: Instruction) -> str:
    """One instruction in words, e.g. 'wait for stage0@3 output from rank 0 before stage1@3'."""
    name = lowered.name
    if ins.op == COMPUTE:
        where = f" on ranks {_ranks(ins.group)}" if len(ins.group) > 1 else ""
        return f"compute {name(ins.block)}@{ins.micro_batch}{where}"
    if ins.op == REDUCE:
        return f"reduce {name(ins.block)} gradients over ranks {_ranks(ins.group)}"
    if ins.op == SYNC:
        return f"sync {name(ins.block)} gradients across replicas on ranks {_ranks(ins.group)}"
    what = describe_value(lowered, ins.value)
    if ins.op == SEND:
        return f"send {what} to rank {ins.peer}"
    if ins.op == RECV:
        return f"recv {what} from rank {ins.peer}"
    return f"wait for {what} from rank {ins.peer} before {name(ins.block)}@{ins.micro_batch}"


def describe_value(lowered: Lowered, value: Value) -> str:
    if value.kind == ACTIVATION:
        return f"{lowered.name(value.block)}@{value.micro_batch} output"
    return (f"gradient {lowered.name(value.block)}->{lowered.name(value.consumer)}"
            f"@{value.micro_batch} of rank {value.origin}")


def _ranks(group: tuple[int, ...]) -> str:
    if list(group) == list(range(group[0], group[-1] + 1)) and len(group) > 2:
        return f"{group[0]}-{group[-1]}"
    return ",".join(str(g) for g in group)

