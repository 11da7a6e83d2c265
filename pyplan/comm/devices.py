"""Devices and backends: the one place that decides which device each rank computes on and
which backend carries what; and gathering Python objects from every rank.

Device and backend: one for the whole world. An existing default process group decides (a CUDA
side on NCCL: each rank's GPU; else the CPU); otherwise the ranks choose together through
torchrun's store before any group exists: CUDA when every rank has a GPU of its own (or
`--device cuda`, which names a rank that has none), else the CPU, said on one line when some
rank has CUDA (`--device auto` never falls back silently). A rank's GPU is its local rank
modulo the GPUs it sees: LOCAL_RANK, or without one (a launcher that sets none) its position
among its host's ranks; two ranks that would share one (same host, same GPU UUID) do not each
have their own: NCCL refuses that. The agreement costs O(ranks) store traffic: one key per
rank, read once by rank 0, and one answer per rank, read once by it. On CUDA the default group
pyplan creates is "cpu:gloo,cuda:nccl". A caller's group may have one side only (plain NCCL):
pyplan's own groups name their backend (NCCL for device tensors, gloo for the CPU ones), never
inherit it.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import json
import os
import pickle
import re
import socket
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pyplan.errors import PyplanError, RunError

__all__ = ["CUDA_BACKEND", "Choice", "DEVICES", "Seen", "agree", "agree_on_error",
           "all_gather_numbers", "all_gather_objects", "choose", "choose_cuda", "device_backend",
           "has_cpu_side", "join_world", "objects_group", "seen_here"]

DEVICES = ("auto", "cpu", "cuda")
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


@dataclass(frozen=True)
class Seen:
    """What one rank tells the others about itself before the world chooses its device."""

    host: str
    gpus: tuple[str, ...]
    """The UUIDs of the GPUs it sees, by index."""
    local_rank: int | None
    """LOCAL_RANK, when its launcher set one."""
    why_none: str = ""
    """Without a GPU: why, when CUDA seems to be there (a driver torch refuses, a
    CUDA_VISIBLE_DEVICES that hides every GPU); "" on a machine without CUDA."""

    def text(self) -> str:
        return json.dumps([self.host, list(self.gpus), self.local_rank, self.why_none])

    @staticmethod
    def read(text: str | bytes) -> "Seen":
        host, gpus, local, why = json.loads(text)
        return Seen(host, tuple(gpus), local, why)


def seen_here() -> Seen:
    local = os.environ.get("LOCAL_RANK")
    with warnings.catch_warnings(record=True) as caught:  # torch's reason CUDA failed
        warnings.simplefilter("always")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(count))
    why = "" if gpus else _why_no_gpu([str(w.message) for w in caught])
    return Seen(socket.gethostname(), gpus, int(local) if local else None, why)


def _why_no_gpu(warned: list[str]) -> str:
    """Why this process sees no GPU, when CUDA seems to be there; "" on a machine without."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    nvidia = Path("/dev/nvidiactl").exists()
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA" if nvidia else ""
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    cause = next((w for w in warned if "CUDA" in w), None)
    if cause is not None:  # "CUDA initialization: The NVIDIA driver on your system is too old"
        return cause.splitlines()[0].strip()
    if visible is not None:
        return f"torch finds no GPU among CUDA_VISIBLE_DEVICES={visible!r}"
    return "torch finds no GPU" if nvidia else ""


@dataclass(frozen=True)
class Choice:
    """The world's device: CUDA or the CPU, and each rank's GPU index on CUDA."""

    cuda: bool
    gpus: tuple[int | None, ...]
    why_cpu: str = ""
    """On the CPU while some rank has CUDA: why, in a few words ("rank 3 has no GPU: ...")."""


def choose(request: str, seen: list[Seen]) -> Choice:
    """The device of every rank, from what each one sees: a rank's GPU is its local rank (its
    LOCAL_RANK, else its position among the ranks of its host) modulo the GPUs it sees (0 when
    it sees one, as under SLURM's --gpus-per-task=1 or a pod per GPU); then choose_cuda."""
    on_host: dict[str, int] = {}
    index: list[int | None] = []
    for s in seen:
        position = on_host.get(s.host, 0)
        on_host[s.host] = position + 1
        local = s.local_rank if s.local_rank is not None else position
        index.append(local % len(s.gpus) if s.gpus else None)
    gpus = [None if i is None else f"{s.host}/{s.gpus[i]}" for s, i in zip(seen, index)]
    if choose_cuda(request, gpus):
        return Choice(True, tuple(index))
    return Choice(False, (None,) * len(seen), _why_cpu(seen, gpus))


def _why_cpu(seen: list[Seen], gpus: list[str | None]) -> str:
    without = [r for r, gpu in enumerate(gpus) if gpu is None]
    if len(without) == len(gpus) and not any(s.why_none for s in seen):
        return ""  # no CUDA anywhere: nothing to explain
    first: dict[str, int] = {}
    for r, gpu in enumerate(gpus):
        if gpu is not None and first.setdefault(gpu, r) != r:
            return f"ranks {first[gpu]} and {r} would share one GPU ({gpu})"
    r = next((r for r in without if seen[r].why_none), without[0])
    others = f" ({len(without)} of {len(gpus)} ranks have none)" if len(without) > 1 else ""
    return f"rank {r} has no GPU{': ' + seen[r].why_none if seen[r].why_none else ''}{others}"


def _sides(config: str) -> dict[str, str]:
    """Device type -> backend of a backend configuration ("cpu:gloo,cuda:nccl")."""
    return dict(part.split(":", 1) for part in config.split(",") if ":" in part)


def has_cpu_side(group=None) -> bool:
    """Whether `group` (default: the default group) carries CPU tensors."""
    return "cpu" in _sides(dist.get_backend_config(group))


def device_backend(device: torch.device) -> str:
    """The backend of pyplan's own groups for tensors on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


def _device_of_group(request: str) -> torch.device:
    """The device the caller's default group can carry for this rank: on NCCL the GPU the
    group is bound to (init_process_group's device_id), else the one the caller set (a
    current device other than 0), else choose's over the group (LOCAL_RANK, or this rank's
    position among its host's ranks, gathered: a launcher without LOCAL_RANK, mpirun)."""
    config = dist.get_backend_config()
    cuda = _sides(config).get("cuda") == "nccl" and request != "cpu"
    if request == "cuda" and not cuda:
        raise RunError(f"--device cuda, but the process group's backend is {config}",
                       hint="create it with NCCL, or run with --device cpu")
    if not cuda:
        if "cpu" not in _sides(config):
            raise RunError(f"--device cpu needs gloo, but the process group's backend is "
                           f"{config}")
        return torch.device("cpu")
    bound = dist.group.WORLD.bound_device_id
    if bound is not None:
        return torch.device("cuda", torch.cuda.current_device() if bound.index is None
                            else bound.index)
    if torch.cuda.is_available() and torch.cuda.current_device() != 0:
        return torch.device("cuda", torch.cuda.current_device())
    choice = choose("auto", [Seen.read(t) for t in all_gather_objects(seen_here().text())])
    if not choice.cuda:
        raise RunError(f"the process group's backend is {config}, but "
                       f"{choice.why_cpu or 'no rank has a GPU'}",
                       hint="start one process per GPU, or create the group with "
                            "init_process_group(..., device_id=torch.device('cuda', i))")
    return torch.device("cuda", choice.gpus[dist.get_rank()])


def choose_cuda(request: str, gpus: list[str | None]) -> bool:
    """Whether the world runs on CUDA, given the GPU each rank would use (host/UUID; None:
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


def agree(store, rank: int, world: int, request: str, mine: Seen) -> int | None:
    """This rank's GPU index (None: the world runs on the CPU), agreed through `store` with
    O(world) traffic: each rank writes one key, rank 0 reads them all once, chooses, and
    writes each rank's answer to a key that rank alone reads. Rank 0 says on stderr why
    --device auto chose the CPU where some rank has CUDA; every rank raises choose's
    RunError."""
    store.set(f"seen/{rank}", mine.text())
    if rank == 0:
        keys = [f"seen/{r}" for r in range(world)]
        store.wait(keys)
        try:
            choice = choose(request, [Seen.read(t) for t in store.multi_get(keys)])
            answers = [json.dumps({"gpu": gpu, "cuda": choice.cuda}) for gpu in choice.gpus]
        except RunError as exc:
            choice, answers = None, [json.dumps({"error": exc.message, "hint": exc.hint})] * world
        for r in range(1, world):
            store.set(f"choice/{r}", answers[r])
        if choice is not None and request == "auto" and choice.why_cpu:
            print(f"warning: --device auto runs on the CPU: {choice.why_cpu}",
                  file=sys.stderr, flush=True)
        answer = json.loads(answers[0])
    else:
        answer = json.loads(store.get(f"choice/{rank}"))
    if "error" in answer:
        raise RunError(answer["error"], hint=answer["hint"])
    return answer["gpu"] if answer["cuda"] else None


_JOINED = itertools.count()
"""join_world calls in this process (every rank makes the same ones): each agrees under keys
of its own, never reading an earlier one's."""


def join_world(request: str = "auto", *, timeout: float = 600.0) -> tuple[torch.device, bool]:
    """(this rank's device, whether this call created the default process group)."""
    if request not in DEVICES:
        raise RunError(f"device {request!r} (--device or $PYPLAN_DEVICE) is not one of "
                       f"{', '.join(DEVICES)}")
    if dist.is_initialized():
        device = _device_of_group(request)
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
    joined = next(_JOINED)  # (each rank's count of its joins: the same on every rank)
    store = dist.PrefixStore(f"pyplan/devices/{joined}/", root)
    gpu = agree(store, rank, world, request, seen_here())
    device = torch.device("cpu") if gpu is None else torch.device("cuda", gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # torch._dynamo, imported after the group exists (any meta-tensor op imports it), keeps the
    # default group alive past destroy_process_group, until interpreter teardown; imported
    # first, it does not.
    importlib.import_module("torch._dynamo")

    # A join of its own in the store: a second Pipeline after close() would otherwise read the
    # first group's addresses (the default group's keys are the same each time) and fail to
    # connect.
    dist.init_process_group(CUDA_BACKEND if gpu is not None else "gloo",
                            store=dist.PrefixStore(f"pyplan/world/{joined}/", root), rank=rank,
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


def all_gather_numbers(values: tuple, whole: tuple[int, ...] = ()) -> list[tuple]:
    """Every rank's tuple of numbers or None (the same length everywhere), on every rank, in
    one all-gather of a small tensor (all_gather_objects pickles and takes two): the positions
    in `whole` come back as ints (exact below 2**53), the others as floats."""
    mine = torch.tensor([[float("nan") if v is None else float(v) for v in values],
                         [v is not None for v in values]], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine, group=objects_group())
    return [tuple(None if not given else int(v) if i in whole else v
                  for i, (v, given) in enumerate(zip(*t.tolist())))
            for t in every]


def agree_on_error(error: PyplanError | None, group=None) -> None:
    """Raise on every rank the first (lowest rank's) of the ranks' errors, the same class,
    message (naming that rank) and hint, so that no rank goes on into a collective another
    left (the others would fail with the backend's "connection closed"); return when no rank
    has one: one all-reduce of an integer over `group` (a group with a CPU side; default:
    objects_group's)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    group = objects_group() if group is None else group
    first = torch.tensor([rank if error is not None else world], dtype=torch.int64)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    if int(first) == world:
        return
    told = all_gather_objects(None if rank != int(first) else (
        type(error), error.message, error.hint, error.file, error.line, error.column,
        error.exit_code))
    kind, message, hint, file, line, column, code = told[int(first)]
    if not re.search(rf"\brank {int(first)}\b", message):
        message = f"rank {int(first)}: {message}"
    raised = kind(message, hint=hint, file=file, line=line, column=column)
    raised.exit_code = code
    raise raised


CPU_GROUPS: list = []
"""pyplan's gloo groups over the world, the newest last (a Comm makes one)."""


def objects_group():
    if has_cpu_side():
        return None
    if not CPU_GROUPS:  # every rank gathers at the same point: the same group everywhere
        CPU_GROUPS.append(dist.new_group(backend="gloo"))
    return CPU_GROUPS[-1]
