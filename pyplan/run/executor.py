"""One rank's program for one iteration: COMPUTE runs a block on a micro-batch, SEND/RECV post
transfers, WAIT completes one right before the block that needs it, REDUCE sums replicated
gradients of a multi-device block over its ranks, SYNC starts a stage's gradient
synchronisation across data-parallel replicas.

The program is compiled once into steps over numbered slots (one per value the rank holds at
some point), so an iteration does list indexing, not dictionary traffic. A value is a tensor or
a tuple, list or dict of tensors (pyplan.run.values); gradients travel for its floating
tensors only.

Every block's inputs are detached leaves, so a backward block runs autograd for exactly its
block: from the saved forward output (or the loss, in the last block) back to those leaves,
whose gradients go to the blocks that produced the inputs. With a weight block (NAME.w, the
zero-bubble split) NAME.b computes only the input gradients and NAME.w the weight gradients
from what B captured (pyplan.run.backward): together one backward's work. A recomputed
block runs its forward without autograd, keeps its inputs, and reruns the forward (same random
numbers) at the start of its backward, so B and W share one rerun.

A multi-device block is one SPMD program over its process group: every rank gets the same
inputs and returns the same output; the output gradient may be split among its ranks in any way
(ranks that get none start from zeros) and the input gradients of its ranks are summed, which
is exactly the semantics of differentiable collectives such as an all-reduce. The last block's
output only feeds the loss on the same ranks, so it may stay sharded: with several ranks the
loss gets the block's group, every rank computes it, and it counts once, on the first rank.

Time: the host clock on the CPU; on CUDA, events on the compute stream, read once at the end of
the iteration (no synchronisation inside it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pyplan.errors import PyplanError, UserCodeError, describe_exception
from pyplan.lower import (ACTIVATION, COMPUTE, GRADIENT, RECV, REDUCE, SEND, SYNC, WAIT, Lowered,
                          Value, describe, is_gradient)
from pyplan.problem import BACKWARD, WEIGHT
from pyplan.run.backward import backward_input, backward_weight, full_backward, root
from pyplan.models.chunks import shard_dim
from pyplan.run.binding import block_seeds, forward_seed, seed_generators
from pyplan.models.collectives import all_reduce_
from pyplan.run.comm import Comm, TransferError
from pyplan.run.values import differentiable, flatten, nbytes, rebuild, saved_bytes
from pyplan.trace import TraceEvent

__all__ = ["Executor", "IterationResult", "flat_gradients", "padded", "set_gradients",
           "unflatten_into"]

# Step codes.
_FORWARD, _BACKWARD, _WEIGHT, _SEND_ACT, _SEND_GRAD, _RECV_ACT, _RECV_GRAD, _WAIT, _REDUCE, \
    _SYNC = range(10)


@dataclass
class IterationResult:
    loss: torch.Tensor | None
    """Mean loss over the micro-batches, a 0-dim tensor on the rank that owns the loss (its
    value is read only when someone asks for it), else None."""
    seconds: float
    compute: float
    peak_activation_bytes: int
    """The most bytes of activations this rank held at once: values kept for later blocks or
    in flight, and what autograd saved for the backwards still to come."""
    outputs: list = field(default_factory=list)
    """Forward-only runs: the last block's output per micro-batch (on its ranks)."""
    events: list[TraceEvent] = field(default_factory=list)


@dataclass
class _Forward:
    """What a forward keeps for its backward: autograd's graph and what starts its backward,
    not the output itself (freed once sent, unless autograd saved it), nor the logits of the
    loss's block."""

    roots: list | None
    """The gradient edges of the output's differentiable tensors (None: the loss is the root,
    or the forward is rerun)."""
    shapes: list[tuple[torch.Size, torch.dtype]]
    """Shape and dtype of each differentiable output tensor: the gradients it receives."""
    loss: torch.Tensor | None
    leaves: list[tuple[int, list[torch.Tensor]]]
    """(producing block, the tensors of its value as this block's leaves)."""
    rerun: list | None
    """The arguments, when the block is recomputed in its backward."""
    held: int


class Executor:
    def __init__(self, lowered: Lowered, rank: int, modules: dict, groups: dict, comm: Comm,
                 loss_fn, output_block: int, *, seed: int, wants_inputs=frozenset(),
                 dp_group=None, sync_at_end: bool = False, autocast: torch.dtype | None = None,
                 fail_at: tuple[int, int, str] | None = None, tied=frozenset()):
        problem = lowered.problem
        self.lowered, self.rank, self.modules, self.groups = lowered, rank, modules, groups
        self.comm, self.loss_fn, self.output = comm, loss_fn, output_block
        self.device = comm.device
        self.seed, self.dp_group, self.autocast = seed, dp_group, autocast
        self.wants_inputs = wants_inputs
        self.tied = tied
        """ids of tied parameters whose gradients the tie's all-reduce sums over every rank
        holding them (REDUCE leaves them alone, or a multi-device holder counts its ranks')."""
        self.replica, device = divmod(rank, problem.num_devices)
        # Micro-batch m of this replica is micro-batch replica x N + m of the global batch.
        self.first_micro_batch = self.replica * problem.num_micro_batches
        self.syncing: list = []  # gradient synchronisations started, not yet finished
        self.sync_at_end, self.deferred = sync_at_end, []
        self.program = lowered.programs[rank]
        self.blocks = problem.blocks
        self.layer = [problem.by_name[b.layer] for b in problem.blocks]
        self.trains = {self.layer[b.index] for b in problem.blocks if b.kind == BACKWARD}
        self.split = {self.layer[b.index] for b in problem.blocks if b.kind == WEIGHT}
        self.preds: list[list[int]] = [[] for _ in problem.blocks]
        self.backs_to: list[set[int]] = [set() for _ in problem.blocks]
        for a, c in problem.edges:
            if is_gradient(problem, a, c):
                self.backs_to[self.layer[a]].add(self.layer[c])
            elif problem.blocks[c].is_forward:
                self.preds[c].append(a)
        self.params = {b: [p for p in m.parameters() if p.requires_grad]
                       for b, m in modules.items()}
        self.seeds = block_seeds(seed, [b.name for b in problem.blocks])
        self.loss_owner = problem.blocks[output_block].devices[0] == device
        self.scale = 1 / problem.num_micro_batches if self.loss_owner else 0.0
        self.loss_scale = 1.0
        """fp16: the loss is multiplied by this before its backward (the caller unscales)."""
        self.fail_at = fail_at if fail_at and fail_at[0] == rank else None
        self.saved_bytes: dict[int, int] = {}
        self.kept_inputs: dict[int, set[tuple[int, int]]] = {}
        """Per block, the (input, tensor) positions whose storage autograd saves."""
        self.iteration, self.index = -1, -1  # read by the fault watchdog
        self._compile()
        self.reduced = self._reduced()

    # -- compiling the program into steps over slots

    def _compile(self) -> None:
        slots: dict[Value, int] = {}

        def slot(value: Value) -> int:
            return slots.setdefault(value, len(slots))

        last: dict[int, int] = {}
        made: dict[int, int] = {}  # slot -> the step that produces it
        sent_at: dict[Value, int] = {}  # a received value -> its send's global position
        steps = []
        by_name = self.lowered.problem.by_name
        for index, ins in enumerate(self.program):
            if ins.op == COMPUTE:
                kind = self.blocks[ins.block].kind
                b, m = self.layer[ins.block], ins.micro_batch
                if kind == WEIGHT:
                    steps.append((_WEIGHT, b, m))
                elif kind == BACKWARD:
                    grads = [slot(v) for v in ins.inputs if v.kind == GRADIENT]
                    targets = {p: slot(Value(GRADIENT, ins.block, m,
                                             by_name[f"{self.blocks[p].name}.b"], self.rank))
                               for p in self.backs_to[b]}
                    steps.append((_BACKWARD, b, m, grads, targets, ins.block))
                    made.update((t, index) for t in targets.values())
                else:
                    out = slot(Value(ACTIVATION, b, m))
                    steps.append((_FORWARD, b, m, [slot(v) for v in ins.inputs], out))
                    made[out] = index
                # A backward keeps its forward's graph itself: only what it receives is an
                # input here (its forward's output is not held for it).
                for v in ins.inputs:
                    if kind not in (BACKWARD, WEIGHT) or v.kind == GRADIENT:
                        last[slots[v]] = index
            elif ins.op == SEND:
                code = _SEND_ACT if ins.value.kind == ACTIVATION else _SEND_GRAD
                what = f"block '{self.blocks[ins.value.block].name}' " \
                    f"(micro-batch {ins.value.micro_batch})"
                steps.append((code, slot(ins.value), ins.peer, ins.value.block, ins.seq, what))
                last[slots[ins.value]] = index
            elif ins.op == RECV:
                sent_at[ins.value] = ins.seq
                if ins.value.kind == ACTIVATION:
                    steps.append((_RECV_ACT, slot(ins.value), ins.peer, ins.value.block))
                else:
                    steps.append((_RECV_GRAD, slot(ins.value), ins.peer,
                                  self.layer[ins.value.consumer], ins.value.micro_batch))
            elif ins.op == WAIT:
                steps.append((_WAIT, slot(ins.value), ins.peer, sent_at[ins.value]))
            elif ins.op == REDUCE:
                steps.append((_REDUCE, ins.block))
            elif ins.op == SYNC:
                steps.append((_SYNC, ins.block))
        drops: list[list[int]] = [[] for _ in steps]
        for s, index in {**made, **last}.items():  # what nobody uses goes at once
            drops[index].append(s)
        self.steps = steps
        self.drops = drops
        self.forwarded = {step[1] for step in steps if step[0] == _SEND_ACT}
        """Slots this rank sends on (a received value handed on)."""
        self.received = {step[1] for step in steps if step[0] == _RECV_ACT}
        self.num_slots = len(slots)

    # -- one iteration

    def run(self, inputs: list, targets: list | None, *, iteration: int, trace: bool = False,
            forward_only: bool = False) -> IterationResult:
        self.iteration = iteration
        self.inputs, self.targets = inputs, targets
        self.values: list = [None] * self.num_slots
        self.pending: list = [None] * self.num_slots
        self.saved: dict[tuple[int, int], _Forward] = {}
        self.pinned: set[int] = set()  # received slots a forward of this iteration saved
        self.weight_work: dict = {}
        self.losses: list[torch.Tensor] = []
        self.outputs: list = []
        self.held = self.peak = 0
        self.comm.new_iteration()
        clock = _Clock(self.device)
        marks = []
        start = clock.mark()
        with _no_host_sync(self.device), self._weight_casts():
            self._steps(clock, marks, trace, forward_only, iteration)
        self.index = len(self.steps)
        self.comm.finish()
        end = clock.mark()
        clock.finish()
        compute = sum(clock.seconds(a, b) for i, a, b in marks if self.steps[i][0] <= _WEIGHT)
        events = [self.event(i, clock.seconds(start, a), clock.seconds(a, b))
                  for i, a, b in marks] if trace else []
        loss = torch.stack(self.losses).mean() if self.loss_owner and self.losses else None
        return IterationResult(loss, clock.seconds(start, end), compute, self.peak,
                               self.outputs, events)

    def _steps(self, clock: _Clock, marks: list, trace: bool, forward_only: bool,
               iteration: int) -> None:
        for index, step in enumerate(self.steps):
            self.index = index
            if self.fail_at and self.fail_at[1] == index and iteration == 0:
                _inject(self.fail_at[2])
            code = step[0]
            if code <= _WEIGHT:
                before = clock.mark()
                if code == _FORWARD:
                    self.forward(*step[1:], keep=not forward_only)
                elif code == _BACKWARD:
                    self.backward(*step[1:])
                else:
                    work, held = self.weight_work.pop((step[1], step[2]))
                    backward_weight(work)
                    del work  # its graph goes now, not at the next W (that rebinds the name)
                    self.held -= held
                marks.append((index, before, clock.mark()))
            elif trace:
                before = clock.mark()
                self.communicate(step)
                marks.append((index, before, clock.mark()))
            else:
                self.communicate(step)
            for s in self.drops[index]:
                self.drop(s)

    def communicate(self, step) -> None:
        code = step[0]
        if code == _SEND_ACT:
            _, s, peer, block, seq, what = step
            self.comm.send_value(self.values[s], what, peer, block, seq)
        elif code == _SEND_GRAD:
            _, s, peer, _, seq, _ = step
            self.comm.send_gradients(self.values[s], peer, seq)
        elif code == _RECV_ACT:
            self.pending[step[1]] = self.comm.recv_value(step[2], step[3])
        elif code == _RECV_GRAD:
            _, s, peer, layer, m = step
            self.pending[s] = self.comm.recv_gradients(peer, self.saved[(layer, m)].shapes)
        elif code == _WAIT:
            _, s, peer, seq = step
            self.keep(s, self.comm.wait(self.pending[s], peer, seq))
            self.pending[s] = None
        elif code == _REDUCE:
            self.reduce(step[1])
        elif self.sync_at_end:
            self.deferred.append(step[1])
        else:
            self.sync(step[1])

    # -- what the rank holds

    def keep(self, s: int, value) -> None:
        self.values[s] = value
        self.held += nbytes(value)
        self.peak = max(self.peak, self.held + self.comm.sending_bytes)

    def drop(self, s: int) -> None:
        value = self.values[s]
        if value is not None:
            self.held -= nbytes(value)
            self.values[s] = None

    # -- blocks

    @contextlib.contextmanager
    def _numbers(self, b: int, m: int):
        """Random numbers of block b on micro-batch m (the same in a rerun and in the
        reference), and autocast when asked for."""
        seed_generators(forward_seed(self.seeds[b], self.iteration, self.first_micro_batch + m),
                        self.device)
        if self.autocast is None:
            yield
        else:
            with torch.autocast(self.device.type, dtype=self.autocast):
                yield

    def _weight_casts(self):
        """Autocast off around the iteration's steps, on in each forward: nested so, autocast
        keeps its casts of the weights (leaves that require gradients) until the iteration
        ends, instead of casting them again for every micro-batch."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast, enabled=False)

    def _call(self, b: int, m: int, args: list, grad: bool):
        with torch.set_grad_enabled(grad), self._numbers(b, m):
            try:
                out = self.modules[b](*args)
            except (PyplanError, KeyboardInterrupt, dist.DistError):
                raise
            except BaseException as exc:  # SystemExit too: the user's block failed
                raise UserCodeError(f"block '{self.blocks[b].name}' (micro-batch {m}) raised "
                                    f"{describe_exception(exc)}") from None
            loss = None
            if b == self.output and self.targets is not None:
                group = self.groups.get(b)
                loss = self.loss_fn(out, self.targets[m], *(() if group is None else (group,)))
        return out, loss

    def forward(self, b: int, m: int, inputs: list[int], out_slot: int, keep: bool) -> None:
        trains = keep and b in self.trains
        args, leaves = [], []
        for p, s in zip(self.preds[b], inputs):
            value = self.values[s]
            if trains and p in self.backs_to[b]:
                tensors, spec = flatten(value, f"block '{self.blocks[p].name}'")
                tensors = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
                leaves.append((p, tensors))
                if self.autocast is not None:  # a view: autocast caches no cast of it
                    tensors = [t.view_as(t) if t.requires_grad else t for t in tensors]
                value = rebuild(tensors, spec)
            args.append(value)
        if not self.preds[b] or b in self.wants_inputs:
            args.insert(0, self.inputs[m])
        recomputed = trains and self.blocks[b].recomputed
        measure = trains and not recomputed and b not in self.saved_bytes
        with saved_bytes(self.params[b]) if measure else contextlib.nullcontext() as saved:
            out, loss = self._call(b, m, args, trains and not recomputed)
        if measure:
            self.saved_bytes[b] = saved.bytes
            # Which of its inputs autograd keeps (the same in every micro-batch): the others
            # are freed after their last use, though the graph still holds them as leaves.
            self.kept_inputs[b] = {(i, j) for i, (_, xs) in enumerate(leaves)
                                   for j, x in enumerate(xs)
                                   if x.untyped_storage().data_ptr() in saved.storages}
        if trains and not recomputed:
            self._free_inputs(b, inputs, leaves, out)
        if loss is not None:
            self.losses.append(loss.detach())
        detached = _detach(out)
        self.keep(out_slot, detached)
        if b == self.output and not keep:
            self.outputs.append(detached)
        if trains:
            tensors, _ = flatten(out, f"block '{self.blocks[b].name}'")
            tensors = [tensors[i] for i in differentiable(tensors)]
            roots = None if loss is not None or recomputed else [root(t) for t in tensors]
            held = nbytes(args) if recomputed else self.saved_bytes[b]
            self.held += held
            self.peak = max(self.peak, self.held + self.comm.sending_bytes)
            self.saved[(b, m)] = _Forward(roots, [(t.shape, t.dtype) for t in tensors], loss,
                                          leaves, args if recomputed else None, held)

    def _free_inputs(self, b: int, slots: list[int], leaves, out) -> None:
        """Free the storage of the received inputs this forward was the last to use, that
        autograd did not save and its output does not hand on (their leaves' data is never
        read again; the leaves stay for their gradients)."""
        last = set(self.drops[self.index])
        kept = self.kept_inputs.get(b, set())
        handed_on = {t.untyped_storage().data_ptr() for t in flatten(out, "a block")[0]}
        mine = [s for p, s in zip(self.preds[b], slots) if p in self.backs_to[b]]
        self.pinned.update(mine[i] for i, _ in kept)
        for i, ((_, xs), s) in enumerate(zip(leaves, mine)):
            # Only a received value, last used here, that no forward saved and no send reads.
            if s not in last or s not in self.received or s in self.forwarded or \
                    s in self.pinned:
                continue
            for x in xs:
                if x.untyped_storage().data_ptr() not in handed_on:
                    x.untyped_storage().resize_(0)

    def backward(self, b: int, m: int, grad_slots: list[int], targets: dict[int, int],
                 block: int) -> None:
        state = self.saved.pop((b, m))
        roots, loss = state.roots, state.loss
        if state.rerun is not None:  # the rerun's output is not kept either, only its graph
            out, loss = self._call(b, m, state.rerun, True)
            tensors, _ = flatten(out, f"block '{self.blocks[b].name}'")
            roots = [root(tensors[i]) for i in differentiable(tensors)]
            del out, tensors
        if loss is not None:  # the loss counts once, on the first rank of the last block
            roots = [loss]
            grads = [torch.full((), self.scale * self.loss_scale, dtype=loss.dtype,
                                device=loss.device)]
        else:
            grads = _summed([self.values[s] for s in grad_slots], state.shapes, self.device)
        inputs = [x for _, xs in state.leaves for x in xs if x.requires_grad]
        if b in self.split:  # the graph stays for W, with the gradients B captured for it
            found, work = backward_input(roots, grads, inputs, self.params[b])
            self.weight_work[(b, m)] = (work, state.held + work.captured_bytes)
            self.held += work.captured_bytes
            self.peak = max(self.peak, self.held + self.comm.sending_bytes)
        else:
            full_backward(roots, grads)
            found = [x.grad for x in inputs]
            self.held -= state.held
        got = iter(found)
        for p, xs in state.leaves:
            if p not in targets:
                continue
            grads_p = []
            for x in xs:
                if x.requires_grad:
                    g = next(got)
                    grads_p.append(torch.zeros_like(x) if g is None else g)
            self.keep(targets[p], grads_p)

    def _reduced(self) -> dict[int, list[torch.Tensor]]:
        """block -> the replicated parameters its REDUCE sums over the block's ranks: each at
        the last REDUCE of a block holding it (blocks on the same devices may share one, a
        tie), none that a tie's all-reduce sums anyway."""
        last = {}
        for ins in self.program:
            if ins.op == REDUCE:
                last.update((id(p), ins.block) for p in self.params[ins.block])
        return {b: [p for p in self.params[b] if last[id(p)] == b and shard_dim(p) is None
                    and id(p) not in self.tied] for b in set(last.values())}

    def reduce(self, block: int) -> None:
        params = self.reduced.get(block)
        if not params:
            return
        flat = flat_gradients(params)
        try:
            all_reduce_(flat, self.groups[block])
        except RuntimeError as exc:
            raise TransferError(f"{exc}".splitlines()[0]) from exc
        set_gradients(params, flat)

    def sync(self, block: int) -> None:
        """Start the synchronisation of a stage's gradients across the replicas, on its own
        (gloo or NCCL) stream: all-reduce, or reduce-scatter when sharded (mesh.shard)."""
        params = self.params[block]
        if not params:
            return
        flat = flat_gradients(params)
        replicas = self.lowered.problem.mesh.data
        try:
            if self.lowered.problem.mesh.shard:
                flat = padded(flat, replicas)
                part = flat.new_empty(len(flat) // replicas)
                handle = dist.reduce_scatter_tensor(part, flat, group=self.dp_group,
                                                    async_op=True)
            else:
                part = None
                handle = dist.all_reduce(flat, group=self.dp_group, async_op=True)
        except RuntimeError as exc:
            raise TransferError(f"{exc}".splitlines()[0]) from exc
        self.syncing.append((block, handle, params, flat, part))

    def finish_syncs(self, *, whole: bool = False) -> dict[int, torch.Tensor]:
        """Wait for the synchronisations: all-reduced gradients, averaged, go back to the
        parameters; sharded, this replica's averaged part of each stage's flat gradient is
        returned (and with `whole`, the whole gradient is gathered back too)."""
        for block in self.deferred:
            self.sync(block)
        self.deferred = []
        parts = {}
        replicas = self.lowered.problem.mesh.data
        try:
            for block, handle, params, flat, part in self.syncing:
                handle.wait()
                if part is not None:
                    parts[block] = part.div_(replicas)
                    if not whole:
                        continue
                    dist.all_gather_into_tensor(flat, part, group=self.dp_group)
                else:
                    flat.div_(replicas)
                set_gradients(params, flat)
        except RuntimeError as exc:
            raise TransferError(f"{exc}".splitlines()[0]) from exc
        self.syncing = []
        return parts

    def event(self, index: int, start: float, seconds: float) -> TraceEvent:
        ins = self.program[index]
        if ins.op == COMPUTE:
            block = self.blocks[ins.block]
            return TraceEvent(self.rank, f"{block.name}@{ins.micro_batch}", block.kind,
                              start * 1e6, seconds * 1e6, ins.micro_batch)
        return TraceEvent(self.rank, describe(self.lowered, ins), ins.op, start * 1e6,
                          seconds * 1e6, ins.micro_batch)


@contextlib.contextmanager
def _no_host_sync(device: torch.device):
    """With PYPLAN_CHECK_SYNC=1 on CUDA, any synchronisation of the host with the GPU inside the
    iteration's steps raises (torch.cuda.set_sync_debug_mode): the GPU tests run so."""
    if device.type != "cuda" or os.environ.get("PYPLAN_CHECK_SYNC") != "1":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _Clock:
    """Marks on the host clock, or CUDA events on the compute stream resolved at the end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def _detach(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    leaves, spec = flatten(value, "a block")
    return rebuild([t.detach() for t in leaves], spec)


def _summed(contributions: list[list[torch.Tensor]], shapes: list, device):
    """The gradient of each output tensor (`shapes`: their shapes and dtypes): the sum of every
    contribution received (zeros if none)."""
    if not contributions:
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    if len(contributions) == 1:
        return contributions[0]
    return [sum(parts) for parts in zip(*contributions)]


def flat_gradients(params: list[torch.Tensor]) -> torch.Tensor:
    """The parameters' gradients (zeros where none) in one flat tensor: one collective each."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return torch.cat([p.grad.reshape(-1) for p in params])


def padded(flat: torch.Tensor, parts: int) -> torch.Tensor:
    """`flat` with zeros at the end, so that it splits into `parts` equal parts."""
    return torch.nn.functional.pad(flat, (0, -len(flat) % parts))


def unflatten_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of `flat` into the tensors (the inverse of flattening them)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def set_gradients(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    unflatten_into([p.grad for p in params], flat)


def _inject(mode: str) -> None:
    """--fail-at: make this rank fail here (a testing aid for the fault handling)."""
    if mode == "kill":
        # As a rank dying in the middle of its work: the watchdog's heartbeat (every 0.1 s)
        # has carried this position by then, so the others can say where it was last seen.
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("injected fault (--fail-at)")
