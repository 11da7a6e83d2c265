"""One rank's program for one iteration: COMPUTE runs a block on a micro-batch, SEND/RECV post
transfers, WAIT completes one right before the block that needs it, REDUCE sums replicated
gradients of a multi-device block over its ranks, SYNC starts a stage's gradient
synchronisation across data-parallel replicas.

The program is compiled once into steps over numbered slots (one per value the rank holds at
some point; pyplan.run.steps), so an iteration does list indexing, not dictionary traffic. The
REDUCEs and SYNCs are pyplan.run.gradients' Reductions. A value is a tensor or a tuple, list
or dict of tensors (pyplan.comm.values); gradients travel for its floating tensors only.

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

Time: the host clock on the CPU; on CUDA, events on the compute stream, read when the figures are
first asked for (no synchronisation inside the iteration, nor at its end).
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
from pyplan.lower import COMPUTE, Lowered, describe, is_gradient
from pyplan.run.backward import backward_input, backward_weight, full_backward, root
from pyplan.run.binding import block_seeds, forward_seed, seed_generators
from pyplan.comm import Comm
from pyplan.run.gradients import Reductions, Slots
from pyplan.run.steps import (STEP_BACKWARD, STEP_FORWARD, STEP_RECV_ACT, STEP_RECV_GRAD,
                              STEP_REDUCE, STEP_SEND_ACT, STEP_SEND_GRAD, STEP_WAIT, STEP_WEIGHT,
                              compile_steps)
from pyplan.comm.values import differentiable, flatten, nbytes, rebuild, saved_bytes
from pyplan.files.trace import TraceEvent

__all__ = ["Executor", "IterationResult", "loss_seed"]


@dataclass
class IterationResult:
    loss: torch.Tensor | None
    """Mean loss over the micro-batches, a 0-dim tensor on the rank that owns the loss (its
    value is read only when someone asks for it), else None."""
    peak_activation_bytes: int
    """The most bytes of activations this rank held at once, as its plan counts them (blocks'
    `memory:`): what each forward keeps for its backward (what autograd saved; a recomputed
    block's received input; with a split backward, the gradients B captures, until W). Values
    in transfer and temporaries are the plan's workspace, which the census counts."""
    outputs: list = field(default_factory=list)
    """Forward-only runs: the last block's output per micro-batch (on its ranks)."""
    timing: _Timing | None = None

    @property
    def seconds(self) -> float:
        """The iteration's time (on CUDA read from its events: waits for its work)."""
        return self.timing.figures()[0]

    @property
    def compute(self) -> float:
        """Of which its blocks' work."""
        return self.timing.figures()[1]

    @property
    def events(self) -> list[TraceEvent]:
        """Each step's trace event, when the iteration was traced."""
        return self.timing.figures()[2]


def _updated(module: torch.nn.Module, versions: list) -> list[torch.Tensor]:
    """The buffers a forward of `module` updated in place: those whose version moved, and the
    running statistics of its batch norms (their kernel updates them without a version)."""
    found = {id(t): t for t, version in versions if t._version != version}
    for norm in module.modules():
        if isinstance(norm, torch.nn.modules.batchnorm._NormBase) and norm.track_running_stats:
            for t in (norm.running_mean, norm.running_var, norm.num_batches_tracked):
                if t is not None:
                    found[id(t)] = t
    return list(found.values())


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
                 data_parallel=None, tensor_random=None, sync_at_end: bool = False,
                 autocast: torch.dtype | None = None, compiled: bool = False,
                 fail_at: tuple[int, int, str] | None = None, tied=frozenset()):
        problem = lowered.problem
        self.lowered, self.rank, self.modules, self.groups = lowered, rank, modules, groups
        self.comm, self.loss_fn, self.output = comm, loss_fn, output_block
        self.device = comm.device
        self.seed, self.autocast = seed, autocast
        self.compiled = compiled
        """The blocks are torch.compile'd: their first forward (which measures what autograd
        saves) runs eagerly, and no received input is freed early (a compiled graph may save
        other tensors than the eager forward that was measured)."""
        self.tensor_random = tensor_random
        """Tensor-parallel regions' own random stream (pyplan.mesh.tensor.TensorRandom)."""
        self.wants_inputs = wants_inputs
        device, self.data_index, tensor_index = problem.mesh.coords(rank)
        # Micro-batch m of data-parallel rank i is micro-batch i x N + m of the global batch.
        self.first_micro_batch = self.data_index * problem.num_micro_batches
        self.program = lowered.programs[rank]
        self.blocks = problem.blocks
        self.layer = [problem.by_name[b.layer] for b in problem.blocks]
        self.trains, self.split = problem.trained_layers, problem.split_layers
        self.preds: list[list[int]] = [[] for _ in problem.blocks]
        self.backs_to: list[set[int]] = [set() for _ in problem.blocks]
        for a, c in problem.edges:
            if is_gradient(problem, a, c):
                self.backs_to[self.layer[a]].add(self.layer[c])
            elif problem.blocks[c].is_forward:
                self.preds[c].append(a)
        self.params = Slots(modules)
        """Each block's trainable parameters, as they are now (FSDP swaps the objects)."""
        self.seeds = block_seeds(seed, [b.name for b in problem.blocks])
        self.loss_owner = problem.blocks[output_block].devices[0] == device
        self.scale = 1 / problem.num_micro_batches if self.loss_owner else 0.0
        self.reports_loss = self.loss_owner and tensor_index == 0
        """Every tensor rank computes the loss (and runs its backward); one reports it."""
        self.loss_scale = 1.0
        """fp16: the loss is multiplied by this before its backward (the caller unscales)."""
        self.fail_at = fail_at if fail_at and fail_at[0] == rank else None
        self.saved_bytes: dict[int, int] = {}
        self.updated_buffers: dict[int, list[torch.Tensor]] = {}
        """The buffers a recomputed block's forward updates in place (batch norms' running
        statistics), found on its first forward: its rerun's update is undone."""
        self.kept_inputs: dict[int, set[tuple[int, int]]] = {}
        """Per block, the (input, tensor) positions whose storage autograd saves."""
        self.iteration, self.index = -1, -1  # read by the fault watchdog
        self._compile()
        self.reductions = Reductions(self.program, self.params, groups,
                                     data_parallel=data_parallel, tied=tied,
                                     sync_at_end=sync_at_end)
        """The program's REDUCEs and SYNCs (pyplan.run.gradients); the caller finishes the
        SYNCs after the iteration (reductions.finish)."""

    # -- compiling the program into steps over slots (pyplan.run.steps)

    def _compile(self) -> None:
        compiled = compile_steps(self.program, self.lowered.problem, self.layer, self.backs_to,
                                 self.rank)
        self.steps, self.drops, self.num_slots = compiled.steps, compiled.drops, compiled.slots
        self.forwarded = compiled.forwarded
        """Slots this rank sends on (a received value handed on)."""
        self.received = compiled.received
        self.labels = [f"{self.blocks[ins.block].name}@{ins.micro_batch}" if ins.op == COMPUTE
                       else describe(self.lowered, ins) for ins in self.program]
        """Each step's name in profiles: NVTX ranges, torch.profiler's record_function."""

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
        loss = torch.stack(self.losses).mean() if self.reports_loss and self.losses else None
        return IterationResult(loss, self.peak, self.outputs,
                               _Timing(self, clock, start, end, marks, trace))

    def _steps(self, clock: _Clock, marks: list, trace: bool, forward_only: bool,
               iteration: int) -> None:
        annotate = _annotation(self.device)
        for index, step in enumerate(self.steps):
            self.index = index
            if self.fail_at and self.fail_at[1] == index and iteration == 0:
                _inject(self.fail_at[2])
            code = step[0]
            if code <= STEP_WEIGHT:
                before = clock.mark()
                if annotate is None:
                    self.compute(step, forward_only)
                else:
                    with annotate(self.labels[index]):
                        self.compute(step, forward_only)
                marks.append((index, before, clock.mark()))
            elif trace:
                before = clock.mark()
                self.communicate(step)
                marks.append((index, before, clock.mark()))
            elif annotate is not None:
                with annotate(self.labels[index]):
                    self.communicate(step)
            else:
                self.communicate(step)
            for s in self.drops[index]:
                self.drop(s)

    def compute(self, step, forward_only: bool) -> None:
        code = step[0]
        if code == STEP_FORWARD:
            self.forward(*step[1:], keep=not forward_only)
        elif code == STEP_BACKWARD:
            self.backward(*step[1:])
        else:
            work, held = self.weight_work.pop((step[1], step[2]))
            backward_weight(work)
            del work  # its graph goes now, not at the next W (that rebinds the name)
            self.held -= held

    def communicate(self, step) -> None:
        code = step[0]
        if code == STEP_SEND_ACT:
            _, s, peer, block, seq, what = step
            self.comm.send_value(self.values[s], what, peer, block, seq)
        elif code == STEP_SEND_GRAD:
            _, s, peer, _, seq, _ = step
            self.comm.send_gradients(self.values[s], peer, seq)
        elif code == STEP_RECV_ACT:
            self.pending[step[1]] = self.comm.recv_value(step[2], step[3])
        elif code == STEP_RECV_GRAD:
            _, s, peer, layer, m = step
            self.pending[s] = self.comm.recv_gradients(peer, self.saved[(layer, m)].shapes)
        elif code == STEP_WAIT:
            _, s, peer, seq = step
            self.keep(s, self.comm.wait(self.pending[s], peer, seq))
            self.pending[s] = None
        elif code == STEP_REDUCE:
            self.reductions.reduce(step[1])
        else:
            self.reductions.sync(step[1])

    # -- what the rank holds

    def keep(self, s: int, value) -> None:
        self.values[s] = value

    def drop(self, s: int) -> None:
        self.values[s] = None

    def _holds(self, size: int) -> None:
        """A forward's activations (or B's captured gradients) from now on, as planned."""
        self.held += size
        self.peak = max(self.peak, self.held)

    # -- blocks

    @contextlib.contextmanager
    def _numbers(self, b: int, m: int):
        """Random numbers of block b on micro-batch m (the same in a rerun and in the
        reference), and autocast when asked for."""
        seed = forward_seed(self.seeds[b], self.iteration, self.first_micro_batch + m)
        seed_generators(seed, self.device)
        if self.tensor_random is not None:
            self.tensor_random.begin(seed)
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
        received = nbytes(args)  # what a recomputed block keeps (the batch is held anyway)
        if not self.preds[b] or b in self.wants_inputs:
            args.insert(0, self.inputs[m])
        recomputed = trains and self.blocks[b].recomputed
        measure = trains and not recomputed and b not in self.saved_bytes
        with saved_bytes(lambda: self.params[b]) if measure else \
                contextlib.nullcontext() as saved, \
                torch.compiler.set_stance("force_eager") if measure and self.compiled else \
                contextlib.nullcontext():  # (torch.compile does not trace the hooks)
            if recomputed and b not in self.updated_buffers:
                versions = [(t, t._version) for t in self.modules[b].buffers()]
            out, loss = self._call(b, m, args, trains and not recomputed)
            if recomputed and b not in self.updated_buffers:
                self.updated_buffers[b] = _updated(self.modules[b], versions)
        if measure:
            self.saved_bytes[b] = saved.bytes
            # Which of its inputs autograd keeps (the same in every micro-batch): the others
            # are freed after their last use, though the graph still holds them as leaves.
            self.kept_inputs[b] = {(i, j) for i, (_, xs) in enumerate(leaves)
                                   for j, x in enumerate(xs)
                                   if x.untyped_storage().data_ptr() in saved.storages}
        if trains and not recomputed and not self.compiled:
            self._free_inputs(b, inputs, leaves, out)
        if loss is not None:  # an fp32 copy: a loss may live in a buffer its input's size
            self.losses.append(loss.detach().to(torch.float32, copy=True))  # (mse)
        detached = _detach(out)
        self.keep(out_slot, detached)
        if b == self.output and not keep:
            self.outputs.append(detached)
        if trains:
            tensors, _ = flatten(out, f"block '{self.blocks[b].name}'")
            tensors = [tensors[i] for i in differentiable(tensors)]
            roots = None if loss is not None or recomputed else [root(t) for t in tensors]
            held = received if recomputed else self.saved_bytes[b]
            self._holds(held)
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
            # (a micro-batch updates a batch norm's running statistics once, as without
            # recomputation: what the rerun adds to them is undone)
            kept = [t.clone() for t in self.updated_buffers.get(b, ())]
            out, loss = self._call(b, m, state.rerun, True)
            for t, value in zip(self.updated_buffers.get(b, ()), kept):
                # (batch norm's backward in training reads its batch's statistics, not the
                # running ones autograd saved: their version may stay)
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t):
                    t.copy_(value)
            tensors, _ = flatten(out, f"block '{self.blocks[b].name}'")
            roots = [root(tensors[i]) for i in differentiable(tensors)]
            del out, tensors
        if loss is not None:  # the loss counts once, on the first rank of the last block
            roots, grads = loss_seed(loss, self.scale * self.loss_scale)
        else:
            grads = _summed([self.values[s] for s in grad_slots], state.shapes, self.device)
        inputs = [x for _, xs in state.leaves for x in xs if x.requires_grad]
        if b in self.split:  # the graph stays for W, with the gradients B captured for it
            found, work = backward_input(roots, grads, inputs, self.params[b])
            self.weight_work[(b, m)] = (work, state.held + work.captured_bytes)
            self._holds(work.captured_bytes)
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

    def event(self, index: int, start: float, seconds: float) -> TraceEvent:
        ins = self.program[index]
        if ins.op == COMPUTE:
            block = self.blocks[ins.block]
            return TraceEvent(self.rank, f"{block.name}@{ins.micro_batch}", block.kind,
                              start * 1e6, seconds * 1e6, ins.micro_batch)
        return TraceEvent(self.rank, describe(self.lowered, ins), ins.op, start * 1e6,
                          seconds * 1e6, ins.micro_batch)


def _annotation(device: torch.device):
    """How the iteration's steps are named in profiles, or None: torch.profiler's
    record_function while a profiler runs (its trace shows each block), and on CUDA an NVTX
    range around each block (Nsight Systems shows them, profiler or not)."""
    profiled = torch.autograd.profiler._is_profiler_enabled
    if device.type != "cuda":
        return torch.profiler.record_function if profiled else None
    if not profiled:
        return torch.cuda.nvtx.range
    return _both


@contextlib.contextmanager
def _both(label: str):
    with torch.cuda.nvtx.range(label), torch.profiler.record_function(label):
        yield


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
    """Marks on the host clock, or CUDA events on the compute stream (resolved by _Timing)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class _Timing:
    """An iteration's clock marks, turned into figures when first asked for: on CUDA the
    host waits for the iteration's last event then, not at the iteration's end (a loop that
    reads them a step later never waits)."""

    def __init__(self, executor: Executor, clock: _Clock, start, end, marks: list,
                 trace: bool) -> None:
        self.executor, self.clock, self.start, self.end = executor, clock, start, end
        self.marks, self.trace = marks, trace
        self.steps, self.program = executor.steps, executor.program
        self.found: tuple | None = None

    def figures(self) -> tuple[float, float, list[TraceEvent]]:
        if self.found is None:
            clock, start = self.clock, self.start
            if clock.cuda:
                self.end.synchronize()
            compute = sum(clock.seconds(a, b) for i, a, b in self.marks
                          if self.steps[i][0] <= STEP_WEIGHT)
            events = [self.executor.event(i, clock.seconds(start, a), clock.seconds(a, b))
                      for i, a, b in self.marks] if self.trace else []
            self.found = (clock.seconds(start, self.end), compute, events)
            self.executor = self.marks = None  # (the figures hold no events or executor)
        return self.found


def loss_seed(loss: torch.Tensor, value: float) -> tuple[list, list[torch.Tensor]]:
    """Where the backward of a loss starts and its gradient there, `value` (the micro-batch's
    share times fp16's loss scale): in fp32, as torch.amp.GradScaler scales (a loss left in
    fp16 or bf16 is cast up first; its own gradient is then the value rounded once, by
    autograd, into its dtype)."""
    return [loss.float()], [torch.full((), value, dtype=torch.float32, device=loss.device)]


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


def _inject(mode: str) -> None:
    """--fail-at: make this rank fail here (a testing aid for the fault handling)."""
    if mode == "kill":
        # As a rank dying in the middle of its work: the watchdog's heartbeat (every 0.1 s)
        # has carried this position by then, so the others can say where it was last seen.
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("injected fault (--fail-at)")
