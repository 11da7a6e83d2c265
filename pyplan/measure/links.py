"""The link between two processes, measured: what `topology:` needs to time block outputs.

Two ranks play ping-pong with tensors of growing size; half the median round trip of each size
is one transfer (the fastest of the repeats: on a shared machine, noise only adds); the largest
sizes give the bandwidth, the smallest the latency. `measure_link` starts two local processes:
over gloo with CPU tensors (the within-node link of a CPU machine), or with `device="cuda"`
over NCCL between the first two GPUs, timed with CUDA events; `ping_pong` runs in any existing
two-rank group, e.g. one rank per node under torchrun for the link across nodes.

`measure_all_reduces` times all-reduces the same way among D local processes, as pyplan run
issues them (pyplan.models.collectives): what a multi-device block's collectives cost here,
where a model of one link can be far off (gloo's ring with more ranks than cores).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pyplan.errors import PlanError

__all__ = ["SIZES", "all_reduce_times", "fit_link", "measure_all_reduces", "measure_link",
           "ping_pong"]

SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24)  # bytes


def ping_pong(rank: int, sizes=SIZES, repeats: int = 7, group=None,
              device: torch.device | None = None) -> list[float]:
    """Milliseconds of one transfer of each size between ranks 0 and 1 of `group`."""
    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    out = []
    for size in sizes:
        buffer = torch.zeros(size // 4, dtype=torch.float32, device=device)
        samples = []
        for k in range(repeats + 1):  # the first round trip warms the connection up
            dist.barrier(group=group)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), \
                    torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1, group=group)
                dist.recv(buffer, 1, group=group)
            else:
                dist.recv(buffer, 0, group=group)
                dist.send(buffer, 0, group=group)
            if cuda:
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                seconds = time.perf_counter() - start
            if k:
                samples.append(seconds * 1e3 / 2)
        out.append(min(samples))
    return out


def fit_link(sizes, milliseconds) -> tuple[int, float]:
    """(bytes per second, latency in ms) for time = latency + size / bandwidth: the bandwidth
    from the two largest sizes (where it dominates), the latency from the smallest."""
    points = sorted(zip(sizes, milliseconds))
    (x0, y0), (x1, y1), (x2, y2) = points[0], points[-2], points[-1]
    slope = max((y2 - y1) / (x2 - x1), 1e-12)  # ms per byte; flat: too fast to resolve
    return int(1e3 / slope), max(0.0, y0 - slope * x0)


def all_reduce_times(sizes, repeats: int = 7, group=None,
                     device: torch.device | None = None) -> list[float]:
    """Milliseconds of one all-reduce (a sum of float32) of each size over `group`, as pyplan
    run issues it: the median over the repeats (unlike a transfer, an all-reduce on a shared
    machine costs what its slowest rank brings, and the run pays that too)."""
    from pyplan.models.collectives import all_reduce_

    device = device or torch.device("cpu")
    group = group or dist.group.WORLD
    out = []
    for size in sizes:
        buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        samples = []
        for k in range(repeats + 1):  # the first warms the connections up
            dist.barrier(group=group)
            start = time.perf_counter()
            all_reduce_(buffer, group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if k:
                samples.append((time.perf_counter() - start) * 1e3)
        out.append(statistics.median(samples))
    return out


def _worker(rank: int, world: int, store: str, job: str, sizes, repeats: int, results,
            cuda: bool) -> None:
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world)
    try:
        if job == "ping_pong":
            times = ping_pong(rank, sizes, repeats, device=device)
        else:
            times = all_reduce_times(sizes, repeats, device=device)
        if rank == 0:
            results.put(times)
    finally:
        dist.destroy_process_group()


def _spawn(job: str, world: int, sizes, repeats: int, cuda: bool) -> list[float]:
    # The processes meet in a file (torch's FileStore), not on a port: a free port found here
    # could be taken by another program before the children bind it (EADDRINUSE).
    results = mp.get_context("spawn").SimpleQueue()
    saved = sys.path[:]  # spawned children start with this process's sys.path
    sys.path[:] = _without_other_pyplans(saved)
    try:
        with tempfile.TemporaryDirectory(prefix="pyplan-links-") as folder:
            store = os.path.join(folder, "store")
            mp.start_processes(_worker, args=(world, store, job, tuple(sizes), repeats,
                                              results, cuda), nprocs=world,
                               start_method="spawn")
    finally:
        sys.path[:] = saved
    return results.get()


def _without_other_pyplans(paths: list[str]) -> list[str]:
    """`paths` without folders holding a pyplan package other than this one: the working
    directory the CLI puts on sys.path for the user's model may be a source tree without a
    build, which would shadow the installed package in a fresh process."""
    here = Path(__file__).resolve().parents[1]  # this pyplan package's folder

    def other(path: str) -> bool:
        candidate = Path(path or ".") / "pyplan"
        return (candidate / "__init__.py").is_file() and candidate.resolve() != here
    return [p for p in paths if not other(p)]


def measure_link(device: str = "cpu", sizes=SIZES,
                 repeats: int = 7) -> tuple[int, float, list[float]]:
    """Bandwidth (bytes per second), latency (ms) and the per-size times of the link between
    two processes on this machine (device cuda: between its first two GPUs, over NCCL)."""
    cuda = device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise PlanError("--links with --device cuda needs two GPUs on this machine")
    times = _spawn("ping_pong", 2, sizes, repeats, cuda)
    bandwidth, latency = fit_link(sizes, times)
    return bandwidth, latency, times


def measure_all_reduces(devices: int, sizes, device: str = "cpu",
                        repeats: int = 7) -> list[float] | None:
    """Milliseconds of an all-reduce of each size among `devices` local processes (gloo; with
    device cuda, NCCL over the first `devices` GPUs); None when this machine has too few GPUs."""
    cuda = device == "cuda"
    if cuda and torch.cuda.device_count() < devices:
        return None
    return _spawn("all_reduce", devices, sizes, repeats, cuda)
