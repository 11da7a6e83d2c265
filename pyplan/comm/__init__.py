"""Point-to-point transfers between ranks: which communicator carries a tensor and how long it
is kept (pyplan.comm.devices decides the device and the backends).

Channels: a channel is one direction between two ranks (source, destination). On NCCL each
gets a communicator of its own, created in the same order on every rank: NCCL runs each
communicator on its own stream and matches its messages in order, so two ranks can send to
each other at once without one transfer waiting behind the other; a V-shape of D stages opens
2(D - 1). On gloo too each direction is a group of its own: with one group for every channel,
posting a transfer waited for the connection another transfer on it was using (0.47 ms per
receive posted against 0.22 ms with a group per direction, on 2 ranks of interleaved 1F1B).
Activations and gradients of one direction share its channel: both ranks post them in the one
global order of pyplan.lower, which pyplan.lower.verify checks message by message.

Shapes: the first activation of a stream (one producing block, one receiver) in every
iteration is preceded by a header with the value's structure and each tensor's dtype and shape,
sent over pyplan's gloo group (on CUDA too: reading a header never synchronises the GPU), so
shapes may change between iterations (another sequence length). The later micro-batches of the
stream in that iteration must have the same shapes: the sender refuses one that differs, naming
the block and the micro-batch, before anything is sent. Gradients have the shapes of the
receiver's own forward output. int16, which NCCL lacks, travels as its bytes.

Lifetimes: a sent tensor is kept only until its send completes, a received one until the
executor drops it after its last use, so a rank holds the tensors of the micro-batches in
flight, not of the iteration. On NCCL a send is never waited for (a wait would make the compute
stream wait until the receiver has the data): its Work and its tensor are kept, and released
once its completion (the Work's CUDA event, polled at every transfer) is seen, not earlier (the
caching allocator would hand its memory to a new tensor while NCCL's stream still reads it)
and not later: a send still in flight at the iteration's end is polled in the next one, and
closing the Pipeline makes the stream wait for those left. gloo reports a send complete only
once it is waited for, and waiting must not stall the sender on a receiver that is busy: sends
and receives sit in one global order (pyplan.lower), so once a rank has received something its
peer sent after one of its own sends in that order, the peer has posted the matching receive
and waiting for that send costs nothing. Those sends are completed and released at every
receive; at most `MAX_PENDING` more per peer are kept (a rank that never hears back, the first
stage of a forward-only pipeline, waits for its oldest: the receiver's progress up to that
receive depends only on what came earlier in the order, so this never deadlocks).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

with warnings.catch_warnings():
    # The lowest layer that needs torch (pyplan.mesh, run, measure, train and runtime import it
    # through here): torch warns at import when numpy is absent, and nothing here needs numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch
import torch.distributed as dist

from pyplan.errors import RunError, UserCodeError, exit_now
from pyplan.comm.devices import CPU_GROUPS
from pyplan.comm.values import flatten, rebuild, spec_text, structure, value_text

__all__ = ["Comm", "Pending", "Sends", "TransferError", "leave", "on_device",
           "transfer_error"]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_AS_BYTES = {torch.int16}  # no NCCL type: sent as its bytes
_MAX_DIMS = 8
_HEADER_WORDS = 512
_LEAF_WORDS = 2 + _MAX_DIMS
_MAGIC = 0x7079706C616E  # "pyplan"
MAX_PENDING = 8


class TransferError(RuntimeError):
    """A send, receive or reduction failed, most likely because a peer failed first."""


def transfer_error(exc: RuntimeError) -> TransferError:
    """What a failed send, receive or collective raises (`raise transfer_error(exc) from exc`):
    a TransferError with the first line of torch's message."""
    return TransferError(f"{exc}".splitlines()[0])


@dataclass
class Pending:
    """A posted receive: its buffers, their transfers (None once complete) and, for an
    activation, the structure the tensors rebuild into."""

    tensors: list[torch.Tensor]
    works: list | None
    spec: object | None = None


@dataclass
class _Sent:
    work: object
    tensor: torch.Tensor
    """Kept until the send is known complete: the caching allocator must not hand its memory
    to another tensor while NCCL's stream still reads it."""
    peer: int
    seq: int
    """The send's position in the global order."""
    polled: bool
    """NCCL: never waited for, only polled; gloo: completed by waiting."""
    nbytes: int


class Sends:
    """The sends not known complete, each with its Work and its tensor (the lifetimes above).
    `wait` completes a Work (Comm._wait)."""

    def __init__(self, wait) -> None:
        self.wait = wait
        self.sent: list[_Sent] = []
        self.bytes = 0
        """Bytes of the tensors whose sends have not completed yet."""

    def add(self, work, tensor: torch.Tensor, peer: int, seq: int, polled: bool) -> None:
        size = tensor.numel() * tensor.element_size()
        self.sent.append(_Sent(work, tensor, peer, seq, polled, size))
        self.bytes += size
        if not polled:
            mine = [x for x in self.sent if x.peer == peer and not x.polled]
            if len(mine) > MAX_PENDING:
                self.wait(mine[0].work)
        self.poll()

    def poll(self) -> None:
        """Release every send that has completed."""
        self._release(lambda x: x.work.is_completed())

    def heard_from(self, peer: int, seq: int) -> None:
        """This rank has received what `peer` sent at position `seq`: every gloo send to it
        from before that position has been matched by a posted receive, so waiting for it
        costs nothing; complete and release those, and whatever else has completed (an NCCL
        send only once it has: its tensor stays until then)."""
        def done(x: _Sent) -> bool:
            if x.peer == peer and x.seq < seq and not x.polled:
                self.wait(x.work)
                return True
            return x.work.is_completed()
        self._release(done)

    def finish(self) -> None:
        """The end of the iteration: every gloo send completed; the NCCL sends that have not
        completed stay (polled in the next iteration, or waited for by `close`)."""
        for x in self.sent:
            if not x.polled:
                self.wait(x.work)
        self.poll()

    def close(self) -> None:
        """Make the current stream wait for the NCCL sends still in flight, then let go of
        them: memory the allocator hands out again is used after them on that stream."""
        for x in self.sent:
            self.wait(x.work)
        self._release(lambda x: True)

    def _release(self, done) -> None:
        kept = [x for x in self.sent if not done(x)]
        if len(kept) < len(self.sent):
            self.sent = kept
            self.bytes = sum(x.nbytes for x in kept)


class Comm:
    def __init__(self, device: torch.device, channels: list[tuple[int, int, str]], *,
                 blocking: bool, timeout: timedelta | None = None) -> None:
        """`channels`: every (source rank, destination rank, kind) any program uses, the same
        list on every rank (on NCCL each direction becomes a communicator, created in this
        order); `timeout`: of their transfers (None: torch's default)."""
        self.device, self.blocking = device, blocking
        self.nccl = device.type == "cuda"
        self.rank = dist.get_rank()
        # Every rank creates every group in the same order (new_group is collective).
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        """pyplan's own gloo group over the world: the headers."""
        CPU_GROUPS.append(self.cpu_group)
        directions = sorted({(src, dst) for src, dst, _ in channels})
        self.links = {d: dist.new_group(sorted(d), backend="nccl" if self.nccl else "gloo",
                                        timeout=timeout) for d in directions}
        """(source, destination) -> the group carrying its tensors."""
        self.sends = Sends(self._wait)
        self.new_iteration()

    @property
    def sending_bytes(self) -> int:
        """Bytes of the tensors whose sends have not completed yet."""
        return self.sends.bytes

    def close(self) -> None:
        """Let go of the sends in flight and of pyplan's groups (each holds the world's store,
        whose server would stay up until the groups are collected)."""
        try:
            self.sends.close()
        except TransferError:  # a peer failed: that failure is the one reported
            self.sends = Sends(self._wait)
        CPU_GROUPS[:] = [g for g in CPU_GROUPS if g is not self.cpu_group]
        self.cpu_group, self.links = None, {}

    def new_iteration(self) -> None:
        """Headers again from here: shapes may differ from the last iteration's."""
        self.announced: dict[tuple[int, int], tuple] = {}
        self.shapes: dict[tuple[int, int], tuple] = {}

    # -- sending

    def send_value(self, value, what: str, peer: int, stream: int, seq: int) -> None:
        """An activation (any value) to `peer`; `what` names its block and micro-batch,
        `stream` is its producing block, `seq` the send's position in the global order."""
        leaves, spec = flatten(value, what)
        shapes = [(t.dtype, t.shape) for t in leaves]
        announced = self.announced.get((peer, stream))
        if announced is None:
            on_device(leaves, self.device, what)
            self.announced[(peer, stream)] = (spec, shapes, what)
            self._send(_header(leaves, spec, what), peer, self.cpu_group, seq)
        elif announced[1] != shapes or announced[0] != spec:
            raise UserCodeError(f"{what} returned {value_text(spec, shapes)}, but "
                                f"{announced[2]} returned {value_text(*announced[:2])} in this "
                                "iteration: between stages, structures and shapes may change "
                                "from one iteration to the next, not between the "
                                "micro-batches of one",
                                hint="give every micro-batch of a batch the same shapes (e.g. "
                                     "pad to one sequence length per batch)")
        link = self.links[(self.rank, peer)]
        for leaf in leaves:
            self._send(_wire(leaf.detach().contiguous()), peer, link, seq)

    def send_gradients(self, tensors: list[torch.Tensor], peer: int, seq: int) -> None:
        link = self.links[(self.rank, peer)]
        for tensor in tensors:
            self._send(tensor.detach().contiguous(), peer, link, seq)

    def _send(self, tensor: torch.Tensor, peer: int, group, seq: int) -> None:
        work = self._post(dist.isend, tensor, peer, group)
        if self.blocking:
            self._wait(work)
            return
        self.sends.add(work, tensor, peer, seq, polled=self.nccl and tensor.is_cuda)

    def finish(self) -> None:
        """The end of the iteration: complete every gloo send (NCCL ones stay until done)."""
        self.sends.finish()

    # -- receiving

    def recv_value(self, peer: int, stream: int) -> Pending:
        if (peer, stream) not in self.shapes:
            header = torch.empty(_HEADER_WORDS, dtype=torch.int64)
            self._wait(self._post(dist.irecv, header, peer, self.cpu_group))
            self.shapes[(peer, stream)] = _read_header(header)
        spec, shapes = self.shapes[(peer, stream)]
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in shapes]
        return self._receive(buffers, peer, spec)

    def recv_gradients(self, peer: int, shapes: list[tuple[torch.Size, torch.dtype]]) -> Pending:
        """Gradients of this rank's output tensors, of their `shapes` (and dtypes)."""
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in shapes]
        return self._receive(buffers, peer, None)

    def _receive(self, buffers, peer: int, spec) -> Pending:
        link = self.links[(peer, self.rank)]
        works = [self._post(dist.irecv, _wire(b), peer, link) for b in buffers]
        if self.blocking:
            for work in works:
                self._wait(work)
            works = None
        return Pending(buffers, works, spec)

    def wait(self, pending: Pending, peer: int, seq: int):
        """The received value (an activation rebuilt into its structure, or the list of
        gradient tensors) that `peer` sent at position `seq` of the global order."""
        if pending.works is not None:
            for work in pending.works:
                self._wait(work)
            pending.works = None
        self.sends.heard_from(peer, seq)
        return pending.tensors if pending.spec is None else rebuild(pending.tensors,
                                                                     pending.spec)

    # -- posting and completing

    @staticmethod
    def _post(op, tensor: torch.Tensor, peer: int, group):
        try:
            return op(tensor, peer, group=group)
        except RuntimeError as exc:
            raise transfer_error(exc) from exc

    @staticmethod
    def _wait(work) -> None:
        """Complete a transfer; on NCCL this makes the current stream wait for it, without
        blocking the host."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise transfer_error(exc) from exc


def on_device(leaves: list[torch.Tensor], device: torch.device, what: str) -> None:
    """UserCodeError naming the block (`what`) when a tensor it hands to another rank is not
    on the rank's device (a .cpu() left in a CUDA run: NCCL would fail without saying where)."""
    for leaf in leaves:
        if leaf.device != device:
            raise UserCodeError(f"{what} returned a tensor on {leaf.device}, but this rank "
                                f"computes on {device}",
                                hint="create tensors on the input's device (x.device), and "
                                     "leave no .cpu() or .to(...) in the block's output")


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What travels for t (sharing its memory): t, or its bytes for a dtype NCCL lacks."""
    return t.reshape(-1).view(torch.uint8) if t.dtype in _AS_BYTES else t


def _header(leaves: list[torch.Tensor], spec, what: str) -> torch.Tensor:
    text = spec_text(spec).encode()
    words = 3 + _LEAF_WORDS * len(leaves) + (len(text) + 7) // 8
    if words > _HEADER_WORDS:
        raise RunError(f"{what} returned {len(leaves)} tensors in a structure too large to "
                       f"send between stages ({words} header words, at most {_HEADER_WORDS})",
                       hint="hand on fewer tensors, e.g. a tuple of the ones the next block "
                            "needs")
    header = [_MAGIC, len(leaves), len(text)]
    for leaf in leaves:
        if leaf.dim() > _MAX_DIMS or leaf.dtype not in _DTYPES:
            raise RunError(f"{what} returned a {leaf.dtype} tensor of {leaf.dim()} dimensions; "
                           f"between stages at most {_MAX_DIMS} dimensions of "
                           f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}")
        header += [_DTYPES.index(leaf.dtype), leaf.dim(), *leaf.shape,
                   *[0] * (_MAX_DIMS - leaf.dim())]
    padded = text + b"\0" * (-len(text) % 8)
    header += [int.from_bytes(padded[i:i + 8], "little", signed=True)
               for i in range(0, len(padded), 8)]
    return torch.tensor(header + [0] * (_HEADER_WORDS - len(header)), dtype=torch.int64)


def _read_header(header: torch.Tensor) -> tuple[object, list[tuple[torch.dtype, tuple]]]:
    words = header.tolist()
    if words[0] != _MAGIC:
        raise TransferError("a shape header was expected but something else arrived")
    count, length = words[1], words[2]
    shapes = []
    for i in range(count):
        code, ndim, *dims = words[3 + _LEAF_WORDS * i: 3 + _LEAF_WORDS * (i + 1)]
        shapes.append((_DTYPES[code], tuple(dims[:ndim])))
    start = 3 + _LEAF_WORDS * count
    raw = b"".join(w.to_bytes(8, "little", signed=True)
                   for w in words[start:start + (length + 7) // 8])
    return structure(raw[:length].decode()), shapes


def leave(code: int) -> NoReturn:
    """End a process that was a rank, with exit code `code`, skipping Python's teardown: a
    process group torch still holds (DTensor's meshes do) is otherwise destroyed during the
    teardown, and that now and then aborts a finished run ("terminate called without an active
    exception", SIGABRT)."""
    exit_now(code)


