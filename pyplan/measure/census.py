"""An independent count of the bytes a process holds in tensors on the CPU: every tensor an
operation makes while the census runs is counted, by its storage, until that storage is freed
(a weak reference tells), with the storages that existed before it started (parameters,
gradients, the optimizer's state, buffers) given to it up front. Its peak is what the memory
plan must hold, measured without the executor's own bookkeeping: torch's dispatcher sees every
allocation, pyplan's code none. On CUDA, torch.cuda.max_memory_allocated is that count.

A dispatch mode costs Python per operation, so a run takes its census in one iteration and
times the others.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from pyplan.comm.values import plain

__all__ = ["Census", "storage_bytes"]


def storage_bytes(tensors) -> int:
    """The bytes of the distinct storages of `tensors` (a view counts its storage once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            storage = t.untyped_storage()
            seen[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
    return sum(seen.values())


class Census(TorchDispatchMode):
    """Live bytes of the storages on `device` while the mode runs; `peak` is their most.
    `track(tensors)` counts storages that exist already (call it before the body)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.bytes = self.peak = 0

    def track(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._count(t)

    def _count(self, t: torch.Tensor) -> None:
        if t.device != self.device or t.is_meta:
            return
        if is_traceable_wrapper_subclass(t):  # a DTensor: its local tensor holds the bytes
            for inner in plain(t):
                self._count(inner)
            return
        storage = t.untyped_storage()
        key = id(storage)
        found = self.live.get(key)
        if found is not None and found[0]() is storage:
            size = storage.nbytes()
            if size != found[1]:  # resized in place
                self.bytes += size - found[1]
                self.live[key] = (found[0], size)
                self.peak = max(self.peak, self.bytes)
            return
        size = storage.nbytes()
        self.live[key] = (weakref.ref(storage, lambda _, key=key: self._free(key)), size)
        self.bytes += size
        self.peak = max(self.peak, self.bytes)

    def _free(self, key: int) -> None:
        found = self.live.pop(key, None)
        if found is not None:
            self.bytes -= found[1]

    def __enter__(self):
        # Storage.resize_ (the executor frees inputs so) is no operation the dispatcher sees.
        census, resize = self, torch.UntypedStorage.resize_
        self._resize = resize

        def counted(storage, size):
            out = resize(storage, size)
            found = census.live.get(id(storage))
            if found is not None and found[0]() is storage:
                census.bytes += storage.nbytes() - found[1]
                census.live[id(storage)] = (found[0], storage.nbytes())
                census.peak = max(census.peak, census.bytes)
            return out
        torch.UntypedStorage.resize_ = counted
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view (or the tensor an in-place operation returns) lives in an input's storage:
        # nothing new, whether or not that storage is counted.
        given = {id(x.untyped_storage()) for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and not t.is_meta for x in plain(t)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta and \
                    id(t.untyped_storage()) not in given:
                self._count(t)
        return out
