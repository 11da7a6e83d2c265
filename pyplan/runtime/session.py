"""A `pyplan run` on one rank: process groups, modules and optimizer, the iterations, then the
report (timings, loss, trace, --check) gathered on rank 0.

NCCL on CUDA, gloo on CPU, chosen automatically. Multi-node needs nothing here: torchrun's
rendezvous gives every process its global rank. With data-parallel replicas (`mesh:`) the ranks
form a (dp, pp) DeviceMesh: rank = replica x devices + device; each replica trains on its slice
of the global batch; sharded replicas (mesh.shard) each keep and update one part of every
stage's parameters and all-gather them after the step (ZeRO).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pyplan.errors import PyplanError, RunError
from pyplan.lower import COMPUTE, SYNC, Lowered, describe
from pyplan.runtime.binding import Model, build_modules, make_batch, split_batch
from pyplan.runtime.check import Verdict, compare, full_gradients, reference_run
from pyplan.runtime.comm import Comm, TransferError, all_gather_objects
from pyplan.runtime.executor import Executor, padded, unflatten_into
from pyplan.runtime.faults import Watchdog
from pyplan.trace import chrome_trace, write_chrome_trace

__all__ = ["Options", "Report", "Session"]

SETUP, REPORT = -1, -2  # positions outside the iterations, for fault messages


@dataclass(frozen=True)
class Options:
    iterations: int = 1
    seed: int = 0
    lr: float = 0.01
    blocking: bool = False
    sync_at_end: bool = False
    """Start the data-parallel gradient synchronisations after the last block (to compare)."""
    check: bool = False
    tolerance: float = 1e-5
    trace: str | None = None
    fault_timeout: float = 10.0
    fail_at: tuple[int, int, str] | None = None


@dataclass(frozen=True)
class Report:
    """What rank 0 prints: per iteration the slowest rank's time and the loss; per rank and
    iteration the time spent computing blocks (the rest of the iteration is waiting)."""

    seconds: list[float]
    losses: list[float | None]
    compute: list[list[float]]
    iteration_seconds: list[list[float]]
    verdict: Verdict | None
    backend: str


class Session:
    def __init__(self, lowered: Lowered, output_block: int, model: Model, options: Options, *,
                 watch: bool = True):
        """Joins the default process group (creating it unless the caller did) and, with
        `watch`, starts the fault watchdog."""
        self.lowered, self.output, self.model, self.options = lowered, output_block, model, options
        self.problem = lowered.problem
        local = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available() and local < torch.cuda.device_count()
        self.device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        self.owns_group = not dist.is_initialized()
        if self.owns_group:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
        self.backend = dist.get_backend()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.replica, self.device_index = divmod(self.rank, self.problem.num_devices)
        self.executor: Executor | None = None
        self.watchdog = Watchdog(self.rank, self.world, options.fault_timeout, self.position,
                                 self.where) if watch else None

    # -- fault reporting

    def position(self) -> tuple[int, int]:
        return (SETUP, 0) if self.executor is None else \
            (self.executor.iteration, self.executor.index)

    def where(self, rank: int, iteration: int, index: int) -> str:
        if iteration == SETUP:
            return "set-up"
        if iteration == REPORT:
            return "the final report"
        program = self.lowered.programs[rank]
        if not 0 <= index < len(program):
            return f"the {'end' if index >= 0 else 'start'} of iteration {iteration}"
        return (f"instruction {index} of iteration {iteration} "
                f"({describe(self.lowered, program[index])})")

    def failed(self, exc: BaseException) -> RunError:
        """Agree with the other ranks on the first failure; the error this rank exits with."""
        iteration, index = self.position()
        text = exc.message if isinstance(exc, PyplanError) else f"{type(exc).__name__}: {exc}"
        own = f"rank {self.rank} failed at {self.where(self.rank, iteration, index)}: {text}"
        program = self.lowered.programs[self.rank]
        ins = program[index] if iteration >= 0 and 0 <= index < len(program) else None
        # A failed transfer or collective is most likely the echo of another rank's failure.
        echo = isinstance(exc, (TransferError, dist.DistError)) or \
            (ins is not None and ins.op == COMPUTE and len(ins.group) > 1)
        if self.watchdog is None:
            return RunError(own)
        message = self.watchdog.fail(own, wait_for_cause=echo)
        return RunError(message if message == own else f"rank {self.rank} stops: {message}")

    # -- build, run, report, close

    def build(self) -> None:
        opts = self.options
        problem = self.problem
        replicas, devices = problem.mesh.data, problem.num_devices
        # Every rank creates every group, in the same order, as new_group requires: the
        # multi-device blocks' groups of every replica, then the mesh's.
        sets = sorted({b.devices for b in problem.blocks if len(b.devices) > 1})
        made = {(r, ds): dist.new_group([d + r * devices for d in ds])
                for r in range(replicas) for ds in sets}
        self.groups = {b.index: made[(self.replica, b.devices)] for b in problem.blocks
                       if len(b.devices) > 1}
        dp_group = None
        if replicas > 1:
            mesh = init_device_mesh(self.device.type, (replicas, devices),
                                    mesh_dim_names=("dp", "pp"))
            dp_group = mesh.get_group("dp")
        self.modules = build_modules(self.model, problem, seed=opts.seed, device=self.device,
                                     rank=self.device_index, groups=self.groups)
        synced = {id(p) for x in self.lowered.programs[self.rank] if x.op == SYNC
                  for p in self.modules[x.block].parameters()}
        self.shards = _Shards(self.modules, self.lowered.programs[self.rank], self.replica,
                              replicas, dp_group, opts.lr) if problem.mesh.shard else None
        params = list({id(p): p for m in self.modules.values() for p in m.parameters()
                       if p.requires_grad and not (self.shards and id(p) in synced)}.values())
        self.optimizer = (torch.optim.SGD(params, lr=opts.lr)
                          if problem.training and params else None)
        self.executor = Executor(self.lowered, self.rank, self.modules, self.groups,
                                 Comm(self.device, blocking=opts.blocking), self.model.loss,
                                 self.output, seed=opts.seed, dp_group=dp_group,
                                 sync_at_end=opts.sync_at_end, fail_at=opts.fail_at)

    def train(self) -> Report:
        opts, n = self.options, self.problem.num_micro_batches
        records, events, grads = [], [], {}
        for step in range(opts.iterations):
            inputs, targets = make_batch(self.model, step, opts.seed, self.device)
            replicas = self.problem.mesh.data
            if replicas > 1:  # this replica's slice of the global batch
                inputs = split_batch(inputs, replicas)[self.replica]
                targets = split_batch(targets, replicas)[self.replica]
            inputs, targets = split_batch(inputs, n), split_batch(targets, n)
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            for module in self.modules.values() if self.shards else ():
                module.zero_grad(set_to_none=True)
            dist.barrier()
            started = time.perf_counter()
            result = self.executor.run(inputs, targets, iteration=step,
                                       trace=opts.trace is not None and
                                       step == opts.iterations - 1)
            checked = opts.check and step == 0
            parts = self.executor.finish_syncs(whole=checked)
            seconds = time.perf_counter() - started
            if checked and self.replica == 0:  # before the step changes them; not timed
                grads = full_gradients(self.problem, self.modules, self.groups,
                                       self.device_index)
            started = time.perf_counter()
            if self.optimizer is not None:
                self.optimizer.step()
            if self.shards is not None:
                self.shards.step(parts)
            seconds += time.perf_counter() - started
            records.append((seconds, result.compute, result.loss))
            events = result.events or events
        self.executor.iteration = REPORT
        return self.report(records, events, grads)

    def report(self, records, events, grads) -> Report:
        gathered = all_gather_objects((records, events, grads), self.device)
        result = None
        if self.rank == 0:
            by_rank = [g[0] for g in gathered]
            iterations = range(self.options.iterations)
            # One loss per replica (its mean over its micro-batches): the global batch's loss
            # is their mean.
            owned = [[r[i][2] for r in by_rank if r[i][2] is not None] for i in iterations]
            losses = [sum(x) / len(x) if x else None for x in owned]
            if self.options.trace:
                trace = chrome_trace([e for g in gathered for e in g[1]],
                                     title=f"pyplan run {self.problem.name}", time_unit="us",
                                     num_devices=self.world)
                write_chrome_trace(self.options.trace, trace)
            verdict = None
            if self.options.check:
                verdict = self.check(losses, {k: v for g in gathered for k, v in g[2].items()})
            result = Report(seconds=[max(r[i][0] for r in by_rank) for i in iterations],
                            losses=losses, compute=[[x[1] for x in r] for r in by_rank],
                            iteration_seconds=[[x[0] for x in r] for r in by_rank],
                            verdict=verdict, backend=self.backend)
        return all_gather_objects(result, self.device)[0]

    def check(self, losses: list[float], grads: dict) -> Verdict:
        opts = self.options
        ref_losses, ref_grads = reference_run(
            self.model, self.problem, self.output, seed=opts.seed, lr=opts.lr,
            iterations=opts.iterations, device=self.device,
            micro_batches=self.problem.num_micro_batches * self.problem.mesh.data)
        return compare(losses, grads, ref_losses, ref_grads, opts.tolerance)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.owns_group:
            dist.destroy_process_group()


class _Shards:
    """Sharded data parallelism (ZeRO): for each synchronised stage on this rank, the replica's
    part of its flattened parameters, updated by an SGD optimizer over the parts alone (its
    state is sharded too), then all-gathered back into the parameters."""

    def __init__(self, modules: dict, program, replica: int, replicas: int, group,
                 lr: float) -> None:
        self.group, self.stages = group, {}
        for ins in program:
            if ins.op != SYNC:
                continue
            params = [p for p in modules[ins.block].parameters() if p.requires_grad]
            if not params:
                continue
            flat = padded(torch.cat([p.detach().reshape(-1) for p in params]), replicas)
            size = len(flat) // replicas
            part = torch.nn.Parameter(flat[replica * size:(replica + 1) * size].clone())
            self.stages[ins.block] = (params, flat, part)
        parts = [part for _, _, part in self.stages.values()]
        self.optimizer = torch.optim.SGD(parts, lr=lr) if parts else None

    def step(self, grads: dict[int, torch.Tensor]) -> None:
        if self.optimizer is None:
            return
        for block, (_, _, part) in self.stages.items():
            part.grad = grads[block]
        self.optimizer.step()
        for params, flat, part in self.stages.values():
            dist.all_gather_into_tensor(flat, part.detach(), group=self.group)
            unflatten_into(params, flat)


def summary(report: Report, lowered: Lowered, options: Options) -> list[str]:
    """The lines rank 0 prints."""
    problem = lowered.problem
    mode = "blocking" if options.blocking else "non-blocking"
    lines = [f"{problem.name}: {len(report.seconds)} iterations on {len(lowered.programs)} "
             f"ranks ({report.backend}), {mode} communication, {problem.num_micro_batches} "
             "micro-batches"]
    for i, (seconds, loss) in enumerate(zip(report.seconds, report.losses)):
        lines.append(f"  iteration {i}: {seconds * 1e3:8.1f} ms" +
                     ("" if loss is None else f"  loss {loss:.6f}"))
    median = statistics.median(report.seconds)
    parts = []
    for r, (compute, total) in enumerate(zip(report.compute, report.iteration_seconds)):
        c, t = statistics.median(compute), statistics.median(total)
        parts.append(f"{r}: {c * 1e3:.1f}/{(t - c) * 1e3:.1f}")
    lines.append(f"  median iteration {median * 1e3:.1f} ms; compute/wait per rank (ms): "
                 + "  ".join(parts))
    if problem.time_unit_ms is not None:  # the schedule's makespan, transfers included
        predicted = lowered.makespan * problem.time_unit_ms
        lines.append(f"  the plan predicts {predicted:.1f} ms (makespan {lowered.makespan} x "
                     f"{problem.time_unit_ms:g} ms); measured / predicted "
                     f"{median * 1e3 / predicted:.2f}")
    if problem.recomputed:
        lines.append("  recomputed in the backward (torch.utils.checkpoint): "
                     + ", ".join(problem.recomputed))
    if report.verdict is not None:
        lines.append(("  check: " if report.verdict.ok else "  check FAILED: ")
                     + report.verdict.message)
    if options.trace:
        lines.append(f"  trace of iteration {len(report.seconds) - 1}: {options.trace}")
    return lines
