"""Devices and backends: the one place that decides which device each rank computes on and
which backend carries what; and gathering Python objects from every rank.

Device and backend: one for the whole world. An existing default process group decides (a CUDA
side on NCCL: each rank's GPU; else the CPU); otherwise every rank publishes the GPU it would
use in torchrun's store before any group exists, and all choose together: CUDA when every rank
has a GPU of its own (or `--device cuda`, which names a rank that has none), else the CPU. A
rank's GPU is LOCAL_RANK modulo the GPUs it sees (0 when it sees one, as under SLURM's
`--gpus-per-task=1` or one pod per GPU); two ranks that would share one (same host, same GPU
UUID) do not each have their own: NCCL refuses that. On CUDA the default group pyplan creates is
"cpu:gloo,cuda:nccl". A caller's group may have one side only (plain NCCL): pyplan's own
groups name their backend (NCCL for device tensors, gloo for the CPU ones), never inherit it.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import pickle
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from pyplan.errors import RunError

__all__ = ["CUDA_BACKEND", "DEVICES", "all_gather_objects", "choose_cuda", "device_backend",
           "gpu_identity", "has_cpu_side", "join_world", "local_gpu", "objects_group"]

DEVICES = ("auto", "cpu", "cuda")
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


def local_gpu(local_rank: int) -> int | None:
    """The index of the GPU this process uses: LOCAL_RANK modulo the GPUs it sees (0 when it
    sees one); None when it sees none."""
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    return local_rank % count if count else None


def gpu_identity(local_rank: int) -> str | None:
    """The GPU this process would use, as host/UUID (two ranks with the same identity would
    share it), or None without one."""
    index = local_gpu(local_rank)
    if index is None:
        return None
    return f"{socket.gethostname()}/{torch.cuda.get_device_properties(index).uuid}"


def _sides(config: str) -> dict[str, str]:
    """Device type -> backend of a backend configuration ("cpu:gloo,cuda:nccl")."""
    return dict(part.split(":", 1) for part in config.split(",") if ":" in part)


def has_cpu_side(group=None) -> bool:
    """Whether `group` (default: the default group) carries CPU tensors."""
    return "cpu" in _sides(dist.get_backend_config(group))


def device_backend(device: torch.device) -> str:
    """The backend of pyplan's own groups for tensors on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


def _device_of_group(local_rank: int, request: str) -> torch.device:
    """The device the existing default group can carry for this rank."""
    config = dist.get_backend_config()
    cuda = _sides(config).get("cuda") == "nccl" and request != "cpu"
    if request == "cuda" and not cuda:
        raise RunError(f"--device cuda, but the process group's backend is {config}",
                       hint="create it with NCCL, or run with --device cpu")
    index = local_gpu(local_rank)
    if cuda and index is None:
        raise RunError(f"rank {dist.get_rank()} (LOCAL_RANK {local_rank}) sees no GPU, "
                       f"but the process group's backend is {config}",
                       hint="start one process per GPU")
    if not cuda and "cpu" not in _sides(config):
        raise RunError(f"--device cpu needs gloo, but the process group's backend is {config}")
    return torch.device("cuda", index) if cuda else torch.device("cpu")


def choose_cuda(request: str, gpus: list[str | None]) -> bool:
    """Whether the world runs on CUDA, given the GPU each rank would use (gpu_identity; None:
    none): auto takes CUDA when every rank has one of its own (a rank without would leave the
    others waiting for it in NCCL forever; two sharing one fail in NCCL), cuda insists and
    names a rank that cannot follow."""
    without = [r for r, gpu in enumerate(gpus) if gpu is None]
    first: dict[str, int] = {}
    shared = [(first.setdefault(gpu, r), r) for r, gpu in enumerate(gpus)
              if gpu is not None and first.setdefault(gpu, r) != r]
    hint = "start at most one process per GPU on each node, or use --device cpu"
    if request == "cuda" and without:
        raise RunError(f"--device cuda, but rank {without[0]} has no GPU of its own "
                       f"({len(without)} of {len(gpus)} ranks have none)", hint=hint)
    if request == "cuda" and shared:
        a, b = shared[0]
        raise RunError(f"--device cuda, but ranks {a} and {b} would share one GPU "
                       f"({gpus[a]})", hint=hint)
    return request == "cuda" or (request == "auto" and not without and not shared)


def join_world(request: str = "auto", *, timeout: float = 600.0) -> tuple[torch.device, bool]:
    """(this rank's device, whether this call created the default process group)."""
    if request not in DEVICES:
        raise RunError(f"device {request!r} (--device or $PYPLAN_DEVICE) is not one of "
                       f"{', '.join(DEVICES)}")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        device = _device_of_group(local, request)
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
    store.set(str(rank), gpu_identity(local) or "")
    cuda = choose_cuda(request, [store.get(str(r)).decode() or None for r in range(world)])
    if cuda:
        device = torch.device("cuda", local_gpu(local))
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


def all_gather_objects(obj) -> list:
    """Every rank's picklable object, on every rank, through a group with a CPU side: the
    default group when it has one, else pyplan's own gloo group. (torch's *_object collectives
    go through numpy, which torch does not install.)"""
    group = objects_group()
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size, group=group)
    buffer = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8)
    buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffers = [torch.empty_like(buffer) for _ in sizes]
    dist.all_gather(buffers, buffer, group=group)
    return [pickle.loads(ctypes.string_at(b.data_ptr(), int(n)))
            for b, n in zip(buffers, sizes)]


CPU_GROUPS: list = []
"""pyplan's gloo groups over the world, the newest last (a Comm makes one)."""


def objects_group():
    if has_cpu_side():
        return None
    if not CPU_GROUPS:  # every rank gathers at the same point: the same group everywhere
        CPU_GROUPS.append(dist.new_group(backend="gloo"))
    return CPU_GROUPS[-1]
