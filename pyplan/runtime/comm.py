"""Point-to-point transfers between ranks: non-blocking (isend/irecv, awaited only before the
block that consumes the tensor) or blocking, on gloo (CPU) or NCCL (CUDA).

On CUDA the transfers run on a dedicated stream: it first waits for the compute stream (the
tensor is ready), and the compute stream waits for it again only when the tensor is consumed,
so communication overlaps the blocks in between (Tessel IV-D, Fig. 7).

The receiver of an activation does not know its shape: the first activation of a stream (one
producing block, one ordered pair of ranks) is preceded by a small header with dtype and shape,
received right away (see pyplan.verify). Gradients have the shape of the local forward output.
"""

from __future__ import annotations

import ctypes
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Comm", "Received", "TransferError", "all_gather_objects"]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 8


class TransferError(RuntimeError):
    """A send, receive or reduction failed, most likely because a peer failed first."""


@dataclass
class Received:
    tensor: torch.Tensor
    work: object | None  # None once complete (or when blocking)


class Comm:
    def __init__(self, device: torch.device, *, blocking: bool) -> None:
        self.device = device
        self.blocking = blocking
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.sends: list[tuple[object, torch.Tensor]] = []
        self.announced: set[tuple[int, int]] = set()
        self.shapes: dict[tuple[int, int], tuple[torch.dtype, tuple[int, ...]]] = {}

    # -- sending

    def send(self, tensor: torch.Tensor, peer: int, stream: int | None) -> None:
        """Send `tensor` to `peer`; `stream` names the producing block of an activation (its
        first send to a peer carries a header), None for gradients."""
        tensor = tensor.detach().contiguous()
        parts = [tensor]
        if stream is not None and (peer, stream) not in self.announced:
            self.announced.add((peer, stream))
            parts.insert(0, _header(tensor, self.device))
        for part in parts:
            work = self._post(dist.isend, part, peer)
            if self.blocking:
                self._wait(work)
            else:
                self.sends.append((work, part))  # keeps the tensor alive until it is sent

    def finish(self) -> None:
        """Wait until every send of the iteration has completed."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()

    # -- receiving

    def recv(self, peer: int, stream: int | None, like: torch.Tensor | None) -> Received:
        if like is not None:
            buffer = torch.empty_like(like, memory_format=torch.contiguous_format)
        else:
            if (peer, stream) not in self.shapes:
                header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
                self._wait(self._post(dist.irecv, header, peer))
                code, ndim, *dims = header.tolist()
                self.shapes[(peer, stream)] = (_DTYPES[code], tuple(dims[:ndim]))
            dtype, shape = self.shapes[(peer, stream)]
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
        work = self._post(dist.irecv, buffer, peer)
        if self.blocking:
            self._wait(work)
            work = None
        return Received(buffer, work)

    def wait(self, received: Received) -> torch.Tensor:
        if received.work is not None:
            self._wait(received.work)
            received.work = None
        return received.tensor

    # -- streams

    def _post(self, op, tensor: torch.Tensor, peer: int):
        try:
            if self.stream is None:
                return op(tensor, peer)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                work = op(tensor, peer)
            tensor.record_stream(self.stream)
            return work
        except RuntimeError as exc:
            raise TransferError(f"{exc}".splitlines()[0]) from exc

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise TransferError(f"{exc}".splitlines()[0]) from exc
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def _header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise TypeError(f"cannot send a {tensor.dtype} tensor of {tensor.dim()} dimensions "
                        f"between blocks (at most {_MAX_DIMS}; dtypes {_DTYPES})")
    dims = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
    return torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim()] + dims, dtype=torch.int64,
                        device=device)


def all_gather_objects(obj, device: torch.device) -> list:
    """Every rank's picklable object, on every rank. (torch's *_object collectives go through
    numpy, which torch does not install.)"""
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    buffer = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8, device=device)
    buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffers = [torch.empty_like(buffer) for _ in sizes]
    dist.all_gather(buffers, buffer)
    return [pickle.loads(ctypes.string_at(b.cpu().data_ptr(), int(n)))
            for b, n in zip(buffers, sizes)]
