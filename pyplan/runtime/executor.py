"""One rank's program for one iteration: COMPUTE runs a block on a micro-batch, SEND/RECV post
transfers, WAIT completes one right before the block that needs it, REDUCE sums replicated
gradients of a multi-device block over its ranks.

Every block's inputs are detached leaves, so a backward block runs autograd for exactly its
block: from the saved forward output (or the loss, in the last block) back to those leaves,
whose gradients go to the blocks that produced the inputs. With a weight block (NAME.w, the
zero-bubble split) NAME.b computes only the input gradients and keeps the graph; NAME.w then
computes the weight gradients from it.

A multi-device block is one SPMD program over its process group: every rank gets the same
inputs and returns the same output; the output gradient may be split among its ranks in any way
(ranks that get none start from zeros) and the input gradients of its ranks are summed, which
is exactly the semantics of differentiable collectives such as an all-reduce. The last block's
output only feeds the loss on the same ranks, so it may stay sharded: with several ranks the
loss gets the block's group, every rank computes it, and it counts once, on the first rank.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from pyplan.errors import RunError
from pyplan.lower import (ACTIVATION, COMPUTE, GRADIENT, RECV, REDUCE, SEND, SYNC, WAIT, Lowered,
                          Value, describe, is_gradient)
from pyplan.problem import BACKWARD, WEIGHT
from pyplan.runtime.binding import forward_rng, shard_dim
from pyplan.runtime.comm import Comm, TransferError
from pyplan.trace import TraceEvent

__all__ = ["Executor", "IterationResult"]


@dataclass
class IterationResult:
    loss: float | None
    """Mean loss over the micro-batches (on the rank that owns the loss, else None)."""
    seconds: float
    compute: float
    events: list[TraceEvent] = field(default_factory=list)


class Executor:
    def __init__(self, lowered: Lowered, rank: int, modules: dict, groups: dict, comm: Comm,
                 loss_fn, output_block: int, *, seed: int, dp_group=None,
                 sync_at_end: bool = False, fail_at: tuple[int, int, str] | None = None):
        problem = lowered.problem
        self.lowered, self.rank, self.modules, self.groups = lowered, rank, modules, groups
        self.comm, self.loss_fn, self.output = comm, loss_fn, output_block
        self.seed, self.dp_group = seed, dp_group
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
        self.loss_owner = problem.blocks[output_block].devices[0] == device
        self.fail_at = fail_at if fail_at and fail_at[0] == rank else None
        self.drop = _last_uses(self.program)
        self.iteration, self.index = -1, -1  # read by the fault watchdog

    def run(self, inputs: list, targets: list, *, iteration: int,
            trace: bool = False) -> IterationResult:
        self.iteration = iteration
        self.inputs, self.targets = inputs, targets
        self.store: dict[Value, torch.Tensor] = {}
        self.received: dict = {}
        self.saved: dict = {}
        self.losses: list[torch.Tensor] = []
        events, compute = [], 0.0
        sync = trace and self.comm.device.type == "cuda"
        start = time.perf_counter()
        for index, ins in enumerate(self.program):
            self.index = index
            if self.fail_at and self.fail_at[1] == index and iteration == 0:
                _inject(self.fail_at[2])
            t0 = time.perf_counter()
            if ins.op == COMPUTE:
                self.compute(ins)
                if sync:
                    torch.cuda.current_stream(self.comm.device).synchronize()
            elif ins.op == SEND:
                stream = ins.value.block if ins.value.kind == ACTIVATION else None
                self.comm.send(self.store[ins.value], ins.peer, stream)
            elif ins.op == RECV:
                self.received[ins.value] = self.recv(ins.value, ins.peer)
            elif ins.op == WAIT:
                self.store[ins.value] = self.comm.wait(self.received.pop(ins.value))
            elif ins.op == REDUCE:
                self.reduce(ins.block)
            elif ins.op == SYNC:
                if self.sync_at_end:
                    self.deferred.append(ins.block)
                else:
                    self.sync(ins.block)
            t1 = time.perf_counter()
            if ins.op == COMPUTE:
                compute += t1 - t0
            if trace:
                events.append(self.event(ins, t0 - start, t1 - t0))
            for value in self.drop.get(index, ()):
                self.store.pop(value, None)
        self.index = len(self.program)
        t0 = time.perf_counter()
        self.comm.finish()
        if trace and time.perf_counter() - t0 > 1e-6:
            events.append(TraceEvent(self.rank, "finish sends", "wait", (t0 - start) * 1e6,
                                     (time.perf_counter() - t0) * 1e6))
        loss = (float(torch.stack(self.losses).mean()) if self.loss_owner and self.losses
                else None)
        return IterationResult(loss, time.perf_counter() - start, compute, events)

    # -- blocks

    def compute(self, ins) -> None:
        kind = self.blocks[ins.block].kind
        if kind == BACKWARD:
            self.backward(ins)
        elif kind == WEIGHT:
            root, grad, params = self.saved.pop(("w", self.layer[ins.block], ins.micro_batch))
            if params and root.requires_grad:
                torch.autograd.backward(root, grad, inputs=params)
        else:
            self.forward(ins)

    def forward(self, ins) -> None:
        b, m = ins.block, ins.micro_batch
        trains = b in self.trains
        if self.preds[b]:
            args, leaves = [], []
            for p, value in zip(self.preds[b], ins.inputs):
                x = self.store[value].detach()
                if trains and p in self.backs_to[b] and x.is_floating_point():
                    x.requires_grad_(True)
                    leaves.append((p, x))
                args.append(x)
        else:
            args, leaves = [self.inputs[m]], []
        with torch.set_grad_enabled(trains), \
                forward_rng(self.seed, self.iteration, self.blocks[b].name,
                            self.first_micro_batch + m, self.comm.device):
            if trains and self.blocks[b].recomputed:
                # Keep only the inputs; the backward reruns the forward (same RNG state).
                out = checkpoint(self.modules[b], *args, use_reentrant=False)
            else:
                out = self.modules[b](*args)
            if not isinstance(out, torch.Tensor):
                raise RunError(f"block '{self.blocks[b].name}' returned "
                               f"{type(out).__name__}; a block returns one tensor")
            loss = None
            if b == self.output:
                group = self.groups.get(b)
                loss = self.loss_fn(out, self.targets[m], *(() if group is None else (group,)))
                self.losses.append(loss.detach())
        self.store[Value(ACTIVATION, b, m)] = out.detach()
        if trains:
            self.saved[(b, m)] = (out, loss, leaves)

    def backward(self, ins) -> None:
        b, m = self.layer[ins.block], ins.micro_batch
        out, loss, leaves = self.saved.pop((b, m))
        grads = [self.store[v] for v in ins.inputs if v.kind == GRADIENT]
        if loss is not None:  # the loss counts once, on the first rank of the last block
            scale = 1 / self.lowered.problem.num_micro_batches if self.loss_owner else 0.0
            root, grad = loss, torch.tensor(scale, dtype=loss.dtype, device=loss.device)
        else:
            root, grad = out, sum(grads) if grads else torch.zeros_like(out)
        xs = [x for _, x in leaves]
        if b in self.split:
            params = [p for p in self.modules[b].parameters() if p.requires_grad]
            self.saved[("w", b, m)] = (root, grad, params)
            gs = (torch.autograd.grad(root, xs, grad, retain_graph=True, allow_unused=True)
                  if xs and root.requires_grad else [None] * len(xs))
        else:
            if root.requires_grad:
                torch.autograd.backward(root, grad)
            gs = [x.grad for x in xs]
        by_name = self.lowered.problem.by_name
        for (p, x), g in zip(leaves, gs):
            target = by_name[f"{self.blocks[p].name}.b"]
            self.store[Value(GRADIENT, ins.block, m, target, self.rank)] = \
                torch.zeros_like(x) if g is None else g

    def recv(self, value: Value, peer: int):
        if value.kind == GRADIENT:  # shaped like the local output it is the gradient of
            like = self.saved[(self.layer[value.consumer], value.micro_batch)][0]
            return self.comm.recv(peer, None, like)
        return self.comm.recv(peer, value.block, None)

    def reduce(self, block: int) -> None:
        params = [p for p in self.modules[block].parameters()
                  if p.requires_grad and shard_dim(p) is None]
        if not params:
            return
        flat = flat_gradients(params)
        try:
            dist.all_reduce(flat, group=self.groups[block])
        except RuntimeError as exc:
            raise TransferError(f"{exc}".splitlines()[0]) from exc
        set_gradients(params, flat)

    def sync(self, block: int) -> None:
        """Start the synchronisation of a stage's gradients across the replicas, on its own
        (gloo or NCCL) stream: all-reduce, or reduce-scatter when sharded (mesh.shard)."""
        params = [p for p in self.modules[block].parameters() if p.requires_grad]
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
        returned (and with `whole`, the whole gradient is gathered back too, for --check)."""
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

    def event(self, ins, start: float, seconds: float) -> TraceEvent:
        if ins.op == COMPUTE:
            block = self.blocks[ins.block]
            return TraceEvent(self.rank, f"{block.name}@{ins.micro_batch}", block.kind,
                              start * 1e6, seconds * 1e6, ins.micro_batch)
        return TraceEvent(self.rank, describe(self.lowered, ins), ins.op, start * 1e6,
                          seconds * 1e6, ins.micro_batch)


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


def _last_uses(program) -> dict[int, list[Value]]:
    """Instruction index -> values this rank no longer needs after it."""
    last: dict[Value, int] = {}
    for index, ins in enumerate(program):
        for value in ins.inputs if ins.op == COMPUTE else (ins.value,) if ins.op == SEND else ():
            last[value] = index
    drop: dict[int, list[Value]] = {}
    for value, index in last.items():
        drop.setdefault(index, []).append(value)
    return drop


def _inject(mode: str) -> None:
    """--fail-at: make this rank fail here (a testing aid for the fault handling)."""
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("injected fault (--fail-at)")
