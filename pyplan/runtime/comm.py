"""Devices, backends and point-to-point transfers between ranks: the one place that decides
where tensors live, which communicator carries them and how long they are kept.

Device and backend: one for the whole world. An existing default process group decides (gloo:
the CPU; NCCL: each rank's GPU); otherwise every rank publishes whether it has a GPU in
torchrun's store before any group exists, and all choose together: CUDA when every rank has
one (or `--device cuda`, which names a rank that has none), else the CPU. On CUDA the default
group is "cpu:gloo,cuda:nccl": tensors on the GPU go over NCCL, the small shape headers and
reports over gloo, so reading a header never synchronises the GPU.

Channels: a channel is one ordered pair of ranks and one kind of traffic, activations or
gradients. On NCCL each gets its own communicator (a process group, created in the same order
on every rank): NCCL runs each communicator on its own stream, so an activation never queues
behind a gradient going the other way or the same way (with a single communicator per pair
both would sit in one FIFO). On gloo a TCP connection carries both directions at once and a
message never waits for another's kind, so all channels share one process group and differ by
tag (a group per channel would only add gloo's connections and threads). Messages of one
channel match in posting order; pyplan.verify checks the programs against exactly that.

Shapes: the first activation of a stream (one producing block, one receiver) in every
iteration is preceded by a header with the value's structure and each tensor's dtype and shape,
so shapes may change between iterations (another sequence length). Gradients have the shapes of
the receiver's own forward output.

Lifetimes: a sent tensor is kept only until its send completes, a received one until the
executor drops it after its last use, so a rank holds the tensors of the micro-batches in
flight, not of the iteration. gloo reports a send complete only once it is waited for, and
waiting must not stall the sender on a receiver that is busy: sends and receives sit in one
global order (pyplan.lower), so once a rank has received something its peer sent after one of
its own sends in that order, the peer has posted the matching receive and waiting for that
send costs nothing. Those sends are completed and released at every receive; at most
`MAX_PENDING` more per channel are kept (a rank that never hears back, the first stage of a
forward-only pipeline, waits for its oldest: the receiver's progress up to that receive depends
only on what came earlier in the order, so this never deadlocks).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import pickle
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from pyplan.errors import RunError
from pyplan.runtime.values import flatten, rebuild, spec_text, structure

__all__ = ["ACTIVATIONS", "CUDA_BACKEND", "Comm", "DEVICES", "GRADIENTS", "Pending",
           "TransferError", "all_gather_objects", "choose_cuda", "join_world", "leave"]

DEVICES = ("auto", "cpu", "cuda")
CUDA_BACKEND = "cpu:gloo,cuda:nccl"
ACTIVATIONS, GRADIENTS = "activation", "gradient"
_TAGS = {ACTIVATIONS: 0, GRADIENTS: 1}

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 8
_HEADER_WORDS = 512
_LEAF_WORDS = 2 + _MAX_DIMS
_MAGIC = 0x7079706C616E  # "pyplan"
MAX_PENDING = 8


class TransferError(RuntimeError):
    """A send, receive or reduction failed, most likely because a peer failed first."""


def _has_gpu(local_rank: int) -> bool:
    return torch.cuda.is_available() and local_rank < torch.cuda.device_count()


def _device_of_group(backend: str, local_rank: int, request: str) -> torch.device:
    """The device an existing default group's backend can carry for this rank."""
    kinds = {part.split(":")[-1] for part in backend.split(",")}
    cuda = "nccl" in kinds and request != "cpu"
    if request == "cuda" and not cuda:
        raise RunError(f"--device cuda, but the process group's backend is {backend}",
                       hint="create it with NCCL, or run with --device cpu")
    if cuda and not _has_gpu(local_rank):
        raise RunError(f"rank {dist.get_rank()} (LOCAL_RANK {local_rank}) has no GPU of its own, "
                       f"but the process group's backend is {backend}",
                       hint="start one process per GPU")
    if not cuda and "gloo" not in kinds:
        raise RunError(f"--device cpu needs gloo, but the process group's backend is {backend}")
    return torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def choose_cuda(request: str, gpus: list[bool]) -> bool:
    """Whether the world runs on CUDA, given whether each rank has a GPU of its own: auto takes
    CUDA when every rank has one (one rank without would leave the others waiting for it in
    NCCL forever), cuda insists and names a rank that cannot follow."""
    without = [r for r, has in enumerate(gpus) if not has]
    if request == "cuda" and without:
        raise RunError(f"--device cuda, but rank {without[0]} has no GPU of its own "
                       f"({len(without)} of {len(gpus)} ranks have none)",
                       hint="start at most one process per GPU on each node, or use "
                            "--device cpu")
    return request == "cuda" or (request == "auto" and not without)


def join_world(request: str = "auto", *, timeout: float = 600.0) -> tuple[torch.device, bool]:
    """(this rank's device, whether this call created the default process group)."""
    if request not in DEVICES:
        raise RunError(f"device {request!r} (--device or $PYPLAN_DEVICE) is not one of "
                       f"{', '.join(DEVICES)}")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        device = _device_of_group(dist.get_backend(), local, request)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device, False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun's store, as init_process_group("env://") would open it: its agent hosts it, or
    # (started without torchrun's agent) rank 0 does.
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    root = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=rank == 0 and not hosted, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)
    store = dist.PrefixStore("pyplan/devices/", root)
    store.set(str(rank), "1" if _has_gpu(local) else "0")
    cuda = choose_cuda(request, [store.get(str(r)) == b"1" for r in range(world)])
    if cuda:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # torch._dynamo, imported after the group exists (any meta-tensor op imports it), keeps the
    # default group alive past destroy_process_group, until interpreter teardown; imported
    # first, it does not.
    importlib.import_module("torch._dynamo")

    dist.init_process_group(CUDA_BACKEND if cuda else "gloo", store=root, rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    return device, True


@dataclass
class Pending:
    """A posted receive: its buffers, their transfers (None once complete) and, for an
    activation, the structure the tensors rebuild into."""

    tensors: list[torch.Tensor]
    works: list | None
    spec: object | None = None


class Comm:
    def __init__(self, device: torch.device, channels: list[tuple[int, int, str]], *,
                 blocking: bool) -> None:
        """`channels`: every (source rank, destination rank, kind) any program uses, the same
        list on every rank (on NCCL each becomes a process group, created in this order)."""
        self.device, self.blocking = device, blocking
        self.channels: dict[tuple[int, int, str], tuple[object, int]] = {}
        """(source, destination, kind) -> (process group, tag)."""
        used = sorted(set(channels))
        if device.type == "cuda":
            for channel in used:
                self.channels[channel] = (dist.new_group(sorted(set(channel[:2]))), 0)
        elif used:  # the same on every rank, so every rank creates it
            shared = dist.new_group(list(range(dist.get_world_size())))
            for channel in used:
                self.channels[channel] = (shared, _TAGS[channel[2]])
        self.rank = dist.get_rank()
        self.sending: list[tuple[object, torch.Tensor, int, int]] = []
        """(work, tensor, peer, position in the global order) of the sends not known done."""
        self.sending_bytes = 0
        """Bytes of the tensors whose sends have not completed yet."""
        self.new_iteration()

    def new_iteration(self) -> None:
        """Headers again from here: shapes may differ from the last iteration's."""
        self.announced: set[tuple[int, int]] = set()
        self.shapes: dict[tuple[int, int], tuple] = {}

    # -- sending

    def send_value(self, value, what: str, peer: int, stream: int, seq: int) -> None:
        """An activation (any value) to `peer`; `stream` is its producing block, `seq` the
        send's position in the global order."""
        leaves, spec = flatten(value, what)
        channel = self.channels[(self.rank, peer, ACTIVATIONS)]
        if (peer, stream) not in self.announced:
            self.announced.add((peer, stream))
            self._send(_header(leaves, spec, what), peer, channel, seq)
        for leaf in leaves:
            self._send(leaf.detach().contiguous(), peer, channel, seq)

    def send_gradients(self, tensors: list[torch.Tensor], peer: int, seq: int) -> None:
        channel = self.channels[(self.rank, peer, GRADIENTS)]
        for tensor in tensors:
            self._send(tensor.detach().contiguous(), peer, channel, seq)

    def _send(self, tensor: torch.Tensor, peer: int, channel, seq: int) -> None:
        work = self._post(dist.isend, tensor, peer, channel)
        if self.blocking:
            self._wait(work)
            return
        self.sending.append((work, tensor, peer, seq))  # gloo reads it until it is sent
        self.sending_bytes += tensor.numel() * tensor.element_size()
        mine = [i for i, x in enumerate(self.sending) if x[2] == peer]
        if len(mine) > MAX_PENDING:
            self._wait(self.sending[mine[0]][0])
        self._release(lambda work, _peer, _seq: work.is_completed())

    def heard_from(self, peer: int, seq: int) -> None:
        """This rank has received what `peer` sent at position `seq`: every send to it from
        before that position has been matched by a posted receive; complete and drop them."""
        def matched(work, to, at):
            if to == peer and at < seq:
                self._wait(work)
                return True
            return work.is_completed()
        self._release(matched)

    def _release(self, done) -> None:
        if self.sending:
            self.sending = [x for x in self.sending if not done(x[0], x[2], x[3])]
            self.sending_bytes = sum(t.numel() * t.element_size() for _, t, _, _ in self.sending)

    def finish(self) -> None:
        """Wait until every send of the iteration has completed."""
        for work, _, _, _ in self.sending:
            self._wait(work)
        self.sending.clear()
        self.sending_bytes = 0

    # -- receiving

    def recv_value(self, peer: int, stream: int) -> Pending:
        channel = self.channels[(peer, self.rank, ACTIVATIONS)]
        if (peer, stream) not in self.shapes:
            header = torch.empty(_HEADER_WORDS, dtype=torch.int64)
            self._wait(self._post(dist.irecv, header, peer, channel))
            self.shapes[(peer, stream)] = _read_header(header)
        spec, shapes = self.shapes[(peer, stream)]
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in shapes]
        return self._receive(buffers, peer, channel, spec)

    def recv_gradients(self, peer: int, like: list[torch.Tensor]) -> Pending:
        buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
        return self._receive(buffers, peer, self.channels[(peer, self.rank, GRADIENTS)], None)

    def _receive(self, buffers, peer: int, channel, spec) -> Pending:
        works = [self._post(dist.irecv, b, peer, channel) for b in buffers]
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
        self.heard_from(peer, seq)
        return pending.tensors if pending.spec is None else rebuild(pending.tensors,
                                                                     pending.spec)

    # -- posting and completing

    @staticmethod
    def _post(op, tensor: torch.Tensor, peer: int, channel):
        group, tag = channel
        try:
            return op(tensor, peer, group=group, tag=tag)
        except RuntimeError as exc:
            raise TransferError(f"{exc}".splitlines()[0]) from exc

    @staticmethod
    def _wait(work) -> None:
        """Complete a transfer; on NCCL this makes the current stream wait for it, without
        blocking the host."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise TransferError(f"{exc}".splitlines()[0]) from exc


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
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a closed pipe: nothing more to say
            pass
    os._exit(code)


def all_gather_objects(obj) -> list:
    """Every rank's picklable object, on every rank, through the CPU (gloo) part of the
    default group. (torch's *_object collectives go through numpy, which torch does not
    install.)"""
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    buffer = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8)
    buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffers = [torch.empty_like(buffer) for _ in sizes]
    dist.all_gather(buffers, buffer)
    return [pickle.loads(ctypes.string_at(b.data_ptr(), int(n)))
            for b, n in zip(buffers, sizes)]
