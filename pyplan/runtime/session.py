"""`pyplan run` on one rank: a small trainer over Pipeline. Per iteration: the global batch,
zeroed gradients, `pipe.step`, clipping, the optimizer and the learning-rate schedule; every K
iterations a checkpoint; at the end the report (losses, times, throughput, memory, --check)
gathered on rank 0. A fault watchdog names the first rank that fails.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pyplan.errors import PyplanError, RunError
from pyplan.lower import COMPUTE, Lowered, describe
from pyplan.runtime import checkpoint
from pyplan.runtime.binding import Model, make_batch
from pyplan.runtime.check import Verdict, compare, full_gradients, reference_run
from pyplan.runtime.comm import TransferError, all_gather_objects
from pyplan.runtime.faults import Watchdog
from pyplan.runtime.pipeline import DTYPES, Pipeline
from pyplan.runtime.training import Training
from pyplan.trace import chrome_trace, write_chrome_trace

__all__ = ["Options", "Report", "Session", "summary"]

SETUP, REPORT = -1, -2  # positions outside the iterations, for fault messages


@dataclass(frozen=True)
class Options:
    iterations: int = 1
    seed: int = 0
    training: Training = Training()
    blocking: bool = False
    sync_at_end: bool = False
    """Start the data-parallel gradient synchronisations after the last block (to compare)."""
    check: bool = False
    tolerance: float | None = None
    """--check's largest difference; None: the dtype's default."""
    trace: str | None = None
    fault_timeout: float = 10.0
    fail_at: tuple[int, int, str] | None = None
    device: str | None = None
    """cpu, cuda or auto; None: $PYPLAN_DEVICE, else auto."""
    dtype: str = "fp32"
    save: str | None = None
    save_every: int | None = None
    resume: str | None = None
    progress: bool = False


TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}


@dataclass(frozen=True)
class Report:
    """What rank 0 prints: per iteration the slowest rank's time and the loss; per rank and
    iteration the time spent computing blocks (the rest of the iteration is waiting)."""

    first_step: int
    seconds: list[float]
    losses: list[float]
    compute: list[list[float]]
    iteration_seconds: list[list[float]]
    peak_activation_bytes: list[int]
    cuda_max_allocated: list[int] | None
    samples: int
    tokens: int | None
    verdict: Verdict | None
    backend: str
    device: str
    predicted_activation_bytes: list[int] | None = None
    """The plan's peak of activation memory per device (its peak minus the static memory),
    when the plan counts memory in bytes."""
    grad_norms: list[float] | None = None
    """With clipping: the global gradient norm of each iteration, before clipping."""
    ties: list[str] = field(default_factory=list)


class Session:
    def __init__(self, plan, model: Model | None, options: Options, *, watch: bool = True):
        """Joins (or creates) the default process group, builds the pipeline and, with
        `watch`, starts the fault watchdog."""
        self.options = options
        self.step_index = SETUP
        self.watchdog = None
        self.pipe = Pipeline(plan, device=options.device, seed=options.seed,
                             dtype=options.dtype, blocking=options.blocking,
                             sync_at_end=options.sync_at_end, model=model,
                             fail_at=options.fail_at)
        pipe = self.pipe
        self.lowered: Lowered = pipe.lowered
        self.problem, self.rank = pipe.problem, pipe.rank
        if watch:
            self.watchdog = Watchdog(self.rank, pipe.world, options.fault_timeout,
                                     self.position, self.where)

    # -- fault reporting

    def position(self) -> tuple[int, int]:
        executor = self.pipe.executor if self.pipe is not None else None
        if executor is None or self.step_index < 0:
            return (self.step_index, 0)
        if executor.iteration != self.step_index:  # the step has not reached the schedule yet
            return (self.step_index, -1)
        return (executor.iteration, executor.index)

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

    def failed(self, exc: BaseException) -> PyplanError:
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
            return _error(own, exc)
        message = self.watchdog.fail(own, wait_for_cause=echo)
        return _error(own, exc) if message == own else \
            RunError(f"rank {self.rank} stops: {message}")

    # -- the training loop

    def train(self) -> Report:
        opts, pipe = self.options, self.pipe
        optimizer, scheduler = opts.training.build(pipe.parameters()) \
            if self.problem.training and pipe.parameters() else (None, None)
        first = 0
        if opts.resume:
            meta = checkpoint.load(opts.resume, pipe, optimizer, scheduler)
            if meta["seed"] != opts.seed:
                raise RunError(f"the checkpoint in {opts.resume} was trained with --seed "
                               f"{meta['seed']}, not {opts.seed}", hint="resume with its seed")
            first = int(meta["step"])
        pipe.iteration = first - 1
        records, grads, samples, tokens = [], {}, 0, None
        bar = _Progress(opts.progress and self.rank == 0, opts.iterations)
        # Only a progress bar needs each step's loss on rank 0 (one more collective a step);
        # the report adds up the ranks' own losses at the end.
        shown = torch.tensor([bar.bar is not None])
        dist.broadcast(shown, 0)
        share_loss = bool(shown)
        for step in range(first, first + opts.iterations):
            self.step_index = step
            inputs, targets = make_batch(pipe.model, step, opts.seed, torch.device("cpu"))
            samples, tokens = _sizes(inputs)
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            started = time.perf_counter()
            loss = pipe.step(inputs, targets, trace=opts.trace is not None and
                             step == first + opts.iterations - 1,
                             whole_gradients=opts.check and step == first,
                             share_loss=share_loss)
            if opts.check and step == first:  # before the step changes them; not timed
                self._sync_device()
                seconds = time.perf_counter() - started
                grads = full_gradients(self.problem, pipe.modules, pipe.groups,
                                       pipe.device_index, pipe.built.names) \
                    if pipe.replica == 0 else {}
                started = time.perf_counter() - seconds
            norm = None
            if opts.training.clip_grad_norm is not None and self.problem.training:
                # On every rank, whatever its stages hold: the norm is an all-reduce.
                norm = pipe.clip_grad_norm_(opts.training.clip_grad_norm)
            if pipe.step_optimizer(optimizer):  # not after an fp16 overflow
                scheduler.step()
            self._sync_device()
            norm = None if norm is None else float(norm)  # read after the step: no sync
            seconds = time.perf_counter() - started
            result = pipe.last
            mine = None if result.loss is None else float(result.loss)  # this replica's
            records.append((seconds, result.compute, mine, result.peak_activation_bytes, norm))
            bar.advance(step, loss, seconds)
            if opts.save and ((opts.save_every and (step + 1 - first) % opts.save_every == 0)
                              or step == first + opts.iterations - 1):
                checkpoint.save(opts.save, pipe, optimizer, scheduler, step + 1)
        bar.close()
        self.step_index = REPORT
        events = pipe.last.events if opts.trace else []
        return self.report(first, records, events, grads, samples, tokens)

    def _sync_device(self) -> None:
        if self.pipe.device.type == "cuda":
            torch.cuda.synchronize(self.pipe.device)

    def report(self, first, records, events, grads, samples, tokens) -> Report:
        pipe = self.pipe
        cuda = torch.cuda.max_memory_allocated(pipe.device) \
            if pipe.device.type == "cuda" else None
        gathered = all_gather_objects((records, events, grads, cuda))
        result = None
        if self.rank == 0:
            by_rank = [g[0] for g in gathered]
            iterations = range(self.options.iterations)
            if self.options.trace:
                trace = chrome_trace([e for g in gathered for e in g[1]],
                                     title=f"pyplan run {self.problem.name}", time_unit="us",
                                     num_devices=pipe.world)
                write_chrome_trace(self.options.trace, trace)
            replicas = self.problem.mesh.data
            losses = [sum(r[i][2] for r in by_rank if r[i][2] is not None) / replicas
                      for i in iterations]
            verdict = None
            if self.options.check:
                verdict = self.check(first, losses,
                                     {k: v for g in gathered for k, v in g[2].items()})
            norms = [by_rank[0][i][4] for i in iterations]
            result = Report(first_step=first,
                            seconds=[max(r[i][0] for r in by_rank) for i in iterations],
                            losses=losses, compute=[[x[1] for x in r] for r in by_rank],
                            iteration_seconds=[[x[0] for x in r] for r in by_rank],
                            peak_activation_bytes=[max(x[3] for x in r) for r in by_rank],
                            cuda_max_allocated=None if cuda is None else [g[3] for g in gathered],
                            samples=samples, tokens=tokens, verdict=verdict,
                            backend=pipe.backend, device=pipe.device.type,
                            predicted_activation_bytes=_activation_peaks(pipe),
                            grad_norms=None if norms[0] is None else norms,
                            ties=[name for name, _, _ in pipe.ties])
        return all_gather_objects(result)[0]

    def check(self, first: int, losses: list[float], grads: dict) -> Verdict:
        opts, pipe = self.options, self.pipe
        ref_losses, ref_grads = reference_run(
            pipe.model, self.problem, pipe.output, seed=opts.seed, training=opts.training,
            steps=range(first, first + opts.iterations), device=pipe.device,
            micro_batches=self.problem.num_micro_batches * self.problem.mesh.data,
            autocast=DTYPES[opts.dtype])
        tolerance = opts.tolerance if opts.tolerance is not None else TOLERANCE[opts.dtype]
        return compare(losses, grads, ref_losses, ref_grads, tolerance)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.pipe is not None:
            self.pipe.close()


def _error(message: str, cause: BaseException) -> PyplanError:
    """This rank's failure: the cause's exit code, position and hint when it has them (the
    user's code failing is a plan error at the line that names it, exit 2)."""
    if not isinstance(cause, PyplanError):
        return RunError(message)
    error = type(cause)(message, hint=cause.hint, file=cause.file, line=cause.line,
                        column=cause.column)
    error.exit_code = cause.exit_code
    return error


def _sizes(inputs) -> tuple[int, int | None]:
    """(samples, tokens) of a global batch: its size along dim 0, and for token ids (an
    integer tensor of two dimensions, or `input_ids` of a dict) their number."""
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
    if isinstance(inputs, (tuple, list)) and inputs:
        ids = inputs[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() == 0:
        return 0, None
    tokens = ids.numel() if ids.dim() == 2 and not ids.is_floating_point() else None
    return ids.shape[0], tokens


class _Progress:
    """A progress bar on rank 0's terminal (rich), nothing otherwise."""

    def __init__(self, show: bool, total: int) -> None:
        self.bar = None
        if show and sys.stderr.isatty():
            from rich.progress import Progress

            self.bar = Progress(transient=True)
            self.bar.start()
            self.task = self.bar.add_task("training", total=total)

    def advance(self, step: int, loss: torch.Tensor, seconds: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"step {step} loss "
                            f"{float(loss):.4f} {seconds * 1e3:.0f} ms")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def summary(report: Report, lowered: Lowered, options: Options) -> list[str]:
    """The lines rank 0 prints."""
    problem = lowered.problem
    mode = "blocking" if options.blocking else "non-blocking"
    t = options.training
    how = f"{t.optimizer} lr {t.lr:g}" + (f" weight decay {t.weight_decay:g}"
                                           if t.weight_decay else "") + \
        (f", clip {t.clip_grad_norm:g}" if t.clip_grad_norm is not None else "") + \
        (f", warmup {t.lr_warmup}" if t.lr_warmup else "")
    lines = [f"{problem.name}: {len(report.seconds)} iterations on {len(lowered.programs)} "
             f"ranks ({report.device}, {report.backend}, {options.dtype}), {mode} "
             f"communication, {problem.num_micro_batches} micro-batches, {how}"]
    predicted = lowered.makespan * problem.time_unit_ms \
        if problem.time_unit_ms is not None else None
    for i, (seconds, loss) in enumerate(zip(report.seconds, report.losses)):
        rate = f"  {report.samples / seconds:8.1f} samples/s" if report.samples else ""
        if report.tokens:
            rate += f"  {report.tokens / seconds:9.0f} tokens/s"
        if report.grad_norms is not None:
            rate += f"  grad norm {report.grad_norms[i]:.4g}"
        lines.append(f"  iteration {report.first_step + i}: {seconds * 1e3:8.1f} ms  "
                     f"loss {loss:.6f}{rate}")
    median = statistics.median(report.seconds)
    parts = []
    for r, (compute, total) in enumerate(zip(report.compute, report.iteration_seconds)):
        c, t_ = statistics.median(compute), statistics.median(total)
        parts.append(f"{r}: {c * 1e3:.1f}/{max(t_ - c, 0.0) * 1e3:.1f}")
    lines.append(f"  median iteration {median * 1e3:.1f} ms; compute/rest per rank (ms): "
                 + "  ".join(parts))
    if predicted is not None:  # the schedule's makespan, transfers included
        lines.append(f"  the plan predicts {predicted:.1f} ms (makespan {lowered.makespan} x "
                     f"{problem.time_unit_ms:g} ms); measured / predicted "
                     f"{median * 1e3 / predicted:.2f}")
    held = "  ".join(f"{r}: {_mib(b)}" for r, b in enumerate(report.peak_activation_bytes))
    lines.append(f"  peak activations held per rank: {held}")
    if report.predicted_activation_bytes is not None:
        lines.append("  the plan's peak activations per device: " + "  ".join(
            f"{d}: {_mib(b)}" for d, b in enumerate(report.predicted_activation_bytes)))
    if report.cuda_max_allocated is not None:
        lines.append("  CUDA max allocated per rank: " + "  ".join(
            f"{r}: {_mib(b)}" for r, b in enumerate(report.cuda_max_allocated)))
    if report.ties:
        lines.append("  tied parameters (gradients summed over their copies): "
                     + ", ".join(report.ties))
    if problem.recomputed:
        lines.append("  recomputed in the backward (its forward rerun first): "
                     + ", ".join(problem.recomputed))
    if report.verdict is not None:
        lines.append(("  check: " if report.verdict.ok else "  check FAILED: ")
                     + report.verdict.message)
    if options.trace:
        lines.append(f"  trace of iteration {report.first_step + len(report.seconds) - 1}: "
                     f"{options.trace}")
    if options.save:
        lines.append(f"  checkpoint: {options.save} (step "
                     f"{report.first_step + len(report.seconds)})")
    return lines


def _activation_peaks(pipe: Pipeline) -> list[int] | None:
    problem = pipe.problem
    if not problem.memory_is_size:
        return None
    static = problem.static_memory
    return [peak - base for peak, base in zip(pipe.resolved.schedule.peak_memory, static)]
