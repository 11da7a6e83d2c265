"""`pyplan run` on one rank: a small trainer over Pipeline. Per step: zeroed gradients, the
global batch and `pipe.step` (--accumulate times), clipping, the optimizer and the learning-rate
schedule, a line logged on rank 0 as the step ends; every K steps an evaluation and a
checkpoint; at the end the report (losses, times, throughput, memory, --check) gathered on
rank 0. A fault watchdog names the first rank that fails.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import time
import warnings

import torch
import torch.distributed as dist

from pyplan.errors import EXIT_RUN_FAILED, PlanError, PyplanError, RunError
from pyplan.lower import COMPUTE, Lowered, describe
import pyplan.train.checkpoint as checkpoint
from pyplan.train.async_checkpoint import AsyncCheckpoints
from pyplan.run.binding import Model, make_batch
from pyplan.measure.census import Census
from pyplan.train.check import (TOLERANCE, Verdict, compare, gathered, perturb,
                                reference_run, tokens_of)
from pyplan.comm import TransferError
from pyplan.comm.devices import all_gather_numbers, all_gather_objects
from pyplan.train import flops
from pyplan.train.faults import Watchdog
from pyplan.run.pipeline import DTYPES, Pipeline, compiled_graphs
from pyplan.train.logs import Log
from pyplan.train.profiling import StepProfiler
from pyplan.train.stopping import out_of_time
from pyplan.train.report import (Options, Report, activation_peaks, header,
                                 iteration_line, link_note, planned_memory, predicted)
from pyplan.train.training import changes
from pyplan.files.trace import chrome_trace, write_chrome_trace

__all__ = ["Session"]

SETUP, REPORT, SAVE, EVAL = -1, -2, -3, -4  # positions outside the iterations (faults)


class Session:
    def __init__(self, plan, model: Model | None, options: Options, *, watch: bool = True):
        """Joins (or creates) the default process group, builds the pipeline and, with
        `watch`, starts the fault watchdog."""
        self.options = options
        self.step_index = SETUP
        self.watchdog = None
        self.resumed = self.saved = None
        self.memory = (0, 0)
        self.clock = time.monotonic()  # --max-time counts from here
        self.checkpoint = None
        self.stopped: str | None = None
        """Why the run stopped before its last step (a signal, --max-time), if it did."""
        started = time.perf_counter()
        # No agreement per call: make_batch checks the batches, the optimizer is ours.
        self.pipe = Pipeline(plan, device=options.device, seed=options.seed,
                             dtype=options.dtype, blocking=options.blocking,
                             sync_at_end=options.sync_at_end, model=model,
                             fail_at=options.fail_at, compile=options.compile,
                             params=options.params, agree_arguments=False)
        self.setup_seconds = time.perf_counter() - started
        pipe = self.pipe
        self.saves = AsyncCheckpoints(pipe.timeout) \
            if options.async_save and options.save else None
        self.lowered: Lowered = pipe.lowered
        self.problem, self.rank = pipe.problem, pipe.rank
        if options.check and self.problem.mesh.tensor > 1 and _drops(pipe):
            raise PlanError("--check with mesh.tensor: the model has dropout, whose masks inside "
                           "tensor-parallel regions are each tensor rank's own, so no single-"
                           "process run draws the same",
                           hint="check with the model's dropout set to 0 (what --check "
                           "compares is exact then), or with mesh.tensor: 1")
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
        if iteration == SAVE:
            return "a checkpoint save"
        if iteration == EVAL:
            return "an evaluation"
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
            (ins is not None and ins.op == COMPUTE and len(ins.group) > 1) or \
            (iteration in (SAVE, EVAL) and not isinstance(exc, PyplanError))
        if self.watchdog is None:
            return _error(own, exc)
        message, code = self.watchdog.fail(own, wait_for_cause=echo, code=exc.exit_code if
                                           isinstance(exc, PyplanError) else EXIT_RUN_FAILED)
        if message == own:
            return _error(own, exc)
        error = RunError(f"rank {self.rank} stops: {message}")
        error.exit_code = code  # bad input found on another rank is bad input here too
        return error

    # -- the training loop

    def train(self) -> Report | None:
        """The training loop; None when --steps is reached already (nothing to train)."""
        opts, pipe = self.options, self.pipe
        training = opts.training
        trains = self.problem.training and bool(pipe.parameters())
        at = self.first_step()
        steps = opts.steps if opts.steps is not None else at + opts.iterations
        self.iterations = steps - at
        optimizer, scheduler = training.build(pipe.parameters(), steps) if trains \
            else (None, None)
        first, batches, history, resumed = self.resume(optimizer, steps)
        self.history = history
        pipe.iteration = batches - 1
        if resumed is not None and optimizer is not None:  # this run's schedule, at its step
            scheduler = training.switch(optimizer, steps, first)
        self.batches, self.snapshots, self.samples, self.tokens = batches, [], 0, None
        self.check_seconds, self.bad_steps, self.save_seconds = 0.0, 0, 0.0
        self.step_seconds: list[float] = []  # the slowest rank's, per step
        self.flops = self.model_flops = None  # this rank's, all ranks' in one step
        self.peak_flops = flops.peak_flops(pipe.device, opts.dtype)
        records, eval_losses = [], []
        log = Log(lines=opts.lines and self.rank == 0, path=opts.log if self.rank == 0 else None,
                  tensorboard=opts.tensorboard if self.rank == 0 else None, after=first)
        self.log = log
        if self.iterations <= 0:
            log.say(f"{self.problem.name}: at step {first} of --steps {steps} already; nothing "
                    "left to train")
            log.close()
            return None
        log.say(header(self.problem, pipe.world, pipe.device.type, pipe.backend, opts,
                       self.iterations))
        if resumed is not None:
            log.say(resumed)
        last = first + self.iterations - 1
        self.first, self.last = first, last
        # One step, the second when there are several (everything the run holds exists by
        # then: gradients, the optimizer's state), is measured: the memory census and the
        # model FLOPs; its time does not count (both cost Python per operation).
        self.census_step = first + (1 if self.iterations > 1 else 0)
        profiler = None if opts.profile is None else checkpoint.agree(  # (every rank says it)
            lambda: StepProfiler(opts.profile, opts.profile_steps, first + 1, last + 1,
                                 self.rank, pipe.device))
        try:
            for step in range(first, last + 1):
                lr = scheduler.get_last_lr()[0] if scheduler is not None else None
                self.current = step + 1  # steps are named 1-based: the step just completed
                with contextlib.ExitStack() as around:
                    if opts.compile and step == self.census_step:  # (under its dispatch
                        # modes torch.compile would give the blocks up for good: eager)
                        around.enter_context(torch.compiler.set_stance("force_eager"))
                    if profiler is not None:
                        around.enter_context(profiler.step(step + 1))
                    if step == self.census_step:
                        around.enter_context(self.census(optimizer))
                    records.append(self.one_step(optimizer, scheduler, trace=step == last,
                                                 check=opts.check and
                                                 len(records) < opts.check_steps))
                self.stopped = self.progress(step, records, lr)
                if opts.eval_every and (step + 1) % opts.eval_every == 0:
                    eval_losses.append((step + 1, self.evaluate(step + 1)))
                if opts.save and ((opts.save_every and (step + 1) % opts.save_every == 0)
                                  or step == last or self.stopped):
                    self.save(optimizer, step + 1, history, steps)
                if self.saves is not None:  # the last save is waited for before the run ends
                    done = self.saves.poll(pipe, wait=step == last or bool(self.stopped))
                    self.saved = str(done) if done is not None else self.saved
                    self.save_seconds = max(self.save_seconds, self.saves.seconds)
                if self.stopped:
                    log.say(f"  stopped after step {step + 1} of {steps}: {self.stopped}; " +
                            (f"saved {self.saved}; " if opts.save else "nothing saved (no "
                             "--save); ") + "the same command with --resume auto continues")
                    break
        finally:
            log.close()
        self.step_index = REPORT
        events = pipe.last.events if opts.trace else []
        return self.report(first, records, events, self.snapshots, self.samples, self.tokens,
                           eval_losses)

    def one_step(self, optimizer, scheduler, *, trace: bool, check: bool) -> tuple:
        """One optimizer step over --accumulate global batches: (seconds, compute seconds,
        this replica's mean loss on its loss rank else None, peak activation bytes, the
        gradient norm before clipping)."""
        opts, pipe, K = self.options, self.pipe, self.options.training.accumulate
        if optimizer is not None:  # the gradients stay allocated: static memory
            optimizer.zero_grad(set_to_none=False)
        seconds, compute, mine, peak, bad = 0.0, 0.0, [], 0, None
        for j in range(K):
            self.step_index = self.batches
            inputs, targets = self.batch(self.batches)
            if inputs is not None:
                self.samples, self.tokens = (x * K if x else x for x in _sizes(inputs))
            # No barrier: a rank that is early waits where the schedule makes it. On CUDA no
            # synchronisation either: pipe.step returns once every rank's verdict on
            # non-finite values is in (the one wait a step needs), by when the iteration's work
            # is done; the optimizer's kernels then overlap the next step's launch.
            started = time.perf_counter()
            pipe.step(inputs, targets, trace=opts.trace is not None and trace and j == K - 1,
                      share_loss=False, grad_norm=j == K - 1 and self.problem.training)
            self.batches += 1
            seconds += time.perf_counter() - started
            compute += pipe.last.compute
            bad = bad or self._bad(pipe.nonfinite)
            peak = max(peak, pipe.last.peak_activation_bytes)
            if pipe.last.loss is not None:
                mine.append(float(pipe.last.loss))
        started = time.perf_counter()
        norm = self.optimizer_step(optimizer, scheduler, check=check)
        seconds += time.perf_counter() - started - self.check_seconds
        self.bad_steps = self.bad_steps + 1 if bad else 0
        if self.bad_steps >= self.options.max_bad_steps:  # every rank knows: all raise it
            raise RunError(f"step {self.current}: {bad}, {self.bad_steps} steps in a row "
                           "(--max-bad-steps); the run stops", hint="lower --lr, clip with "
                           "--clip-grad-norm, or look at the data of those steps")
        return (seconds, compute, sum(mine) / K if mine else None, peak, norm, bad)

    def _bad(self, nonfinite: list) -> str | None:
        """What was not finite in a step, where (every rank sees the same list), or None; in
        fp16 an overflow of the gradients alone is the loss scale's business, not a bad
        step."""
        fp16 = self.options.dtype == "fp16"
        for rank, grads, loss in nonfinite:
            if loss or not fp16:
                stages = ", ".join(b.name for b in self.problem.blocks if b.is_forward and
                                   rank % self.problem.num_devices in b.devices)
                return (f"a non-finite {'loss' if loss else 'gradient'} on rank {rank} "
                        f"({stages})")
        return None

    def census(self, optimizer):
        """A context counting what this rank holds at most while it runs (pyplan.measure.census
        on the CPU, torch.cuda's peak on a GPU): `self.memory` = (peak, static) bytes, where
        static is what the run holds for good (parameters, gradients, optimizer state,
        buffers) counted after the step: in a run's first step the gradients and the
        optimizer's state appear only during it. It counts the step's FLOPs too
        (`self.flops`; not when the plan recomputes: those are not the model's)."""
        pipe = self.pipe

        def held() -> list:
            return [*pipe.parameters(), *(p.grad for p in pipe.parameters()
                                          if p.grad is not None),
                    *(t for state in (optimizer.state.values() if optimizer else ())
                      for t in state.values() if isinstance(t, torch.Tensor)),
                    *(b for m in pipe.modules.values() for b in m.buffers())]
        return _Counting(self, pipe.device, held)

    def first_step(self) -> int:
        """The step a resumed run starts at (0 otherwise), agreed by every rank."""
        opts = self.options
        if not opts.resume:
            return 0
        if opts.resume == "auto":  # the newest complete checkpoint in --save, if any
            self.checkpoint = checkpoint.agree(lambda: checkpoint.newest(opts.save))
        else:
            self.checkpoint = checkpoint.agree(lambda: checkpoint.named(opts.resume))
        return 0 if self.checkpoint is None else int(self.checkpoint[1]["step"])

    def resume(self, optimizer, steps: int):
        """Load the checkpoint to resume from: (first step, batches consumed, the history of
        settings, the line that says so); with no --resume, a fresh start."""
        opts, pipe = self.options, self.pipe
        now = opts.settings(steps)
        if self.checkpoint is None:
            return 0, 0, [{"step": 0, "batches": 0, **now}], None
        folder, meta = self.checkpoint
        saved = meta.get("training") or {}
        checkpoint.agree(lambda: checkpoint.resumable(folder, meta, opts.seed,
                                                             opts.training.optimizer))
        checkpoint.load(folder, pipe, optimizer)
        first, batches = int(meta["step"]), int(meta.get("batches", meta["step"]))
        history = list(meta.get("history") or [])
        changed = changes(now, saved)
        if changed or not history:
            history.append({"step": first, "batches": batches, **now})
        line = f"resumed from {folder} (step {first}, saved under plan " \
               f"{meta.get('plan')!r})" + ("; changed: " + ", ".join(changed) if changed else "")
        self.resumed = {"path": str(folder), "step": first, "changed": changed}
        return first, batches, history, line

    def optimizer_step(self, optimizer, scheduler, *, check: bool = False) -> float | None:
        """Accumulated gradients averaged, clipped, applied (unless fp16 overflowed); the
        schedule moves on either way. Returns the norm before clipping when clipping. With
        `check`, --check's snapshot of every gradient just before the update and every value
        just after it (its time is left out: `check_seconds`)."""
        opts, pipe = self.options, self.pipe
        self.check_seconds = 0.0
        if not self.problem.training:
            return None
        K = opts.training.accumulate
        if K > 1:
            for p in pipe.parameters():
                if p.grad is not None:
                    p.grad.mul_(1 / K)
        # The norm (logged at every step, before clipping) of the K steps' sum came with the
        # last step's check for inf/NaN: no collective of its own.
        norm = pipe.step_norm / K
        if opts.training.clip_grad_norm is not None:
            pipe.clip_grads_with_norm_(opts.training.clip_grad_norm, norm)
        if opts.perturb is not None and opts.perturb[0] == self.rank:
            perturb(pipe, opts.perturb[1])
        if check:
            started = time.perf_counter()
            self.snapshots.append({"gradients": gathered(pipe, "gradients")})
            self.check_seconds += time.perf_counter() - started
        # Read before the update is queued: the host waits for the norm alone, not for the
        # optimizer's kernels, which run while the next step starts.
        norm = float(norm)
        pipe.step_optimizer(optimizer)  # every rank; skipped when fp16 overflowed anywhere
        if optimizer is not None:
            with warnings.catch_warnings():  # an fp16 step skipped: the schedule still moves
                warnings.simplefilter("ignore")
                scheduler.step()
        if check:
            started = time.perf_counter()
            self.snapshots[-1].update({k: gathered(pipe, k) for k in ("values", "buffers")})
            self.check_seconds += time.perf_counter() - started
        return norm

    def batch(self, step: int, split: str | None = None):
        """The global batch of `step` where this rank's blocks read it, else (None, None): only
        the ranks that take the inputs or compute the loss call the data."""
        pipe = self.pipe
        if not (pipe.takes_inputs or pipe.takes_targets):
            return None, None
        return make_batch(pipe.model, step, self.options.seed, torch.device("cpu"), split=split)

    def progress(self, step: int, records: list, lr) -> str | None:
        """Rank 0 logs the step as it ends (named step + 1: the steps done): the global loss,
        the slowest rank's time, the largest peak of activations, throughput and the time left.
        One small gather, which is also where the ranks agree to stop early: returns why (a
        signal any rank got, --max-time), the same on every rank, or None."""
        seconds, _, own, peak, norm, bad = records[-1]
        signalled = self.watchdog.stop_signal if self.watchdog is not None else None
        every = all_gather_numbers((own, seconds, peak, lr, norm, self.samples, self.tokens,
                                    None if signalled is None else int(signalled),
                                    time.monotonic() - self.clock, self.flops),
                                   whole=(2, 5, 6, 7, 9))
        # The batch's size from a rank that read it (a rank that reads none has no batch).
        samples = self.samples = max(g[5] for g in every)
        tokens = self.tokens = max((g[6] for g in every if g[6]), default=None)
        slowest = max(g[1] for g in every)
        self.step_seconds.append(slowest)
        if self.model_flops is None and all(g[9] is not None for g in every):
            self.model_flops = sum(g[9] for g in every)
        got = next(((r, g[7]) for r, g in enumerate(every) if g[7] is not None), None)
        stop = None
        if got is not None:
            stop = f"rank {got[0]} got {signal.Signals(got[1]).name}"
        elif out_of_time(self.options.max_time, max(g[8] for g in every),
                         max(self.step_seconds), self.save_seconds) and step < self.last:
            stop = f"--max-time {self.options.max_time:g} s would pass during the next step"
        if self.rank != 0:
            return stop
        owned = [g[0] for g in every if g[0] is not None]
        loss = sum(owned) / self.problem.mesh.data_parallel
        lr = next((g[3] for g in every if g[3] is not None), None)
        norm = next((g[4] for g in every if g[4] is not None), None)
        timed_steps = self.step_seconds[1:] or self.step_seconds  # the first: a warm-up
        eta = sum(timed_steps) / len(timed_steps) * (self.last - step)
        entry = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm,
                 "seconds": slowest, "eta_seconds": eta,
                 "samples_per_second": samples / slowest if samples else None,
                 "tokens_per_second": tokens / slowest if tokens else None,
                 "peak_activation_bytes": max(g[2] for g in every)}
        mfu = None if not (self.model_flops and self.peak_flops) else \
            self.model_flops / (slowest * self.pipe.world * self.peak_flops)
        if mfu is not None:
            entry["mfu"] = mfu
        if bad:
            entry["skipped"] = bad
        if self.pipe.device.type == "cuda":
            entry["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.pipe.device)
        self.log.step(entry, iteration_line(step + 1, slowest, loss, samples, tokens, norm,
                                            eta, bad, mfu))
        return stop

    def evaluate(self, step: int) -> float:
        """The loss over --eval-batches batches of the data's eval split (None: all of it,
        until the data returns None), forward only, in eval mode (no dropout), each batch's
        mean weighted by its target tokens (check.tokens_of): the mean over the split's
        tokens. The ranks that read the data tell the others, per batch, whether it ended."""
        opts, pipe = self.options, self.pipe
        self.step_index = EVAL
        reads = pipe.takes_inputs or pipe.takes_targets
        pipe.eval()
        total = weight = 0.0
        i = 0
        while opts.eval_batches is None or i < opts.eval_batches:
            data = make_batch(pipe.model, i, opts.seed, torch.device("cpu"), split="eval") \
                if reads else (None, None)
            told = all_gather_objects(None if not reads else
                                      -1 if data is None else tokens_of(data[1]))
            if -1 in told:
                break
            w = max(t for t in told if t is not None)
            total += w * float(pipe.eval_step(*data, loss=True))
            weight += w
            i += 1
        pipe.train()
        if i == 0:
            raise RunError(f"{self.problem.model.data}(0, split='eval') returned None: the "
                           "eval split is empty", hint="return the evaluation batches for "
                           "split='eval', None past the last")
        loss = total / weight
        self.log.evaluation(step, loss, f"  eval after step {step}: loss {loss:.6f} "
                            f"({i} batches)")
        return loss

    def save(self, optimizer, step: int, history: list, steps: int) -> None:
        opts, pipe = self.options, self.pipe
        self.step_index = SAVE
        fail = opts.fail_save[1] if opts.fail_save and opts.fail_save[0] == self.rank else None
        meta = {"seed": opts.seed, "batches": self.batches,
                "training": opts.settings(steps), "history": history}
        if opts.config is not None:
            meta["config"] = opts.config
        started = time.monotonic()
        if self.saves is not None:  # written while the next steps run (train: poll)
            self.saves.start(opts.save, pipe, optimizer, step=step, meta=meta,
                             keep_last=opts.keep_last, fail=fail)
        else:
            self.saved = str(checkpoint.save(opts.save, pipe, optimizer, step=step, meta=meta,
                                             keep_last=opts.keep_last, fail=fail))
        self.save_seconds = max(self.save_seconds, time.monotonic() - started)

    def report(self, first, records, events, snapshots, samples, tokens, evals) -> Report:
        pipe = self.pipe
        cuda = torch.cuda.max_memory_allocated(pipe.device) \
            if pipe.device.type == "cuda" else None
        mine = {"peak_bytes": self.memory[0], "static_bytes": self.memory[1],
                "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "setup_seconds": self.setup_seconds, "weights_read": len(pipe.built.read)}
        if self.options.compile:  # (a block torch.compile gave up on runs eagerly, unsaid)
            mine["compiled_graphs"] = compiled_graphs()
        every = all_gather_objects((records, events, snapshots, cuda, mine))
        result = None
        if self.rank == 0:
            by_rank = [g[0] for g in every]
            iterations = range(len(records))
            if self.options.trace:
                trace = chrome_trace([e for g in every for e in g[1]],
                                     title=f"pyplan run {self.problem.name}", time_unit="us",
                                     num_devices=pipe.world)
                write_chrome_trace(self.options.trace, trace)
            replicas = self.problem.mesh.data_parallel
            losses = [sum(r[i][2] for r in by_rank if r[i][2] is not None) / replicas
                      for i in iterations]
            verdict = None
            if self.options.check:
                merged = [{kind: {k: v for g in every for k, v in g[2][i][kind].items()}
                           for kind in snapshots[i]} for i in range(len(snapshots))]
                verdict = self.check(first, losses, merged, evals)
            norms = [next((r[i][4] for r in by_rank if r[i][4] is not None), None)
                     for i in iterations]
            result = Report(first_step=first,
                            seconds=[max(r[i][0] for r in by_rank) for i in iterations],
                            losses=losses, compute=[[x[1] for x in r] for r in by_rank],
                            iteration_seconds=[[x[0] for x in r] for r in by_rank],
                            peak_activation_bytes=[max(x[3] for x in r) for r in by_rank],
                            cuda_max_allocated=None if cuda is None else [g[3] for g in every],
                            samples=samples, tokens=tokens, verdict=verdict,
                            backend=pipe.backend, device=pipe.device.type,
                            predicted_activation_bytes=activation_peaks(pipe),
                            grad_norms=None if norms[0] is None else norms,
                            ties=[name for name, _, _ in pipe.ties], eval_losses=evals,
                            resumed=self.resumed, saved=self.saved,
                            ranks=[{**g[4], **planned} for g, planned in
                                   zip(every, planned_memory(
                                       pipe, self.options.training.optimizer))],
                            census_iteration=self.census_step - first,
                            predicted=predicted(pipe, self.options),
                            flops=(self.model_flops, self.peak_flops),
                            link_note=link_note(pipe.resolved, pipe.device.type),
                            shared_cores=_shared_cores(pipe))
        return all_gather_objects(result)[0]

    def check(self, first: int, losses: list[float], snapshots: list, evals: list) -> Verdict:
        opts, pipe = self.options, self.pipe
        replicas = self.problem.mesh.data_parallel
        history = self.history
        evaluation = (opts.eval_every, opts.eval_batches,
                      lambda inputs: pipe._eval_micro_batches(inputs) * replicas) \
            if opts.eval_every else None
        ref_losses, ref_snapshots, ref_evals = reference_run(
            pipe.model, self.problem, pipe.output, seed=opts.seed, history=history,
            steps=range(first, first + opts.iterations), device=pipe.device,
            micro_batches=self.problem.num_micro_batches * replicas,
            check_steps=len(snapshots), autocast=DTYPES[opts.dtype], evaluation=evaluation,
            anchors=[{name: t for (name, _), t in reversed(s["values"].items())}
                     for s in snapshots])
        tolerance = opts.tolerance if opts.tolerance is not None else TOLERANCE[opts.dtype]
        return compare(losses, snapshots, ref_losses, ref_snapshots, tolerance, evals,
                       ref_evals, first_step=first, forward_only=not self.problem.training)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.pipe is not None:
            self.pipe.close()


class _Counting:
    """Session.census's context."""

    def __init__(self, session: Session, device: torch.device, held) -> None:
        self.session, self.device, self.held = session, device, held

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.census = Census(self.device)
            self.census.__enter__()
            self.census.track(self.held())
        self.flops = flops.counter().__enter__()  # (innermost: it allocates nothing)
        return self

    def __exit__(self, *exc):
        self.flops.__exit__(*exc)
        if not self.session.problem.recomputed:  # a recomputing plan's FLOPs are not the model's
            self.session.flops = self.flops.get_total_flops()
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.census.__exit__(*exc)
            peak = self.census.peak
        static = Census(self.device)  # (not entered: it only counts the storages given)
        static.track(self.held())
        self.session.memory = (peak, static.bytes)


def _drops(pipe: Pipeline) -> bool:
    """Whether the rank's stages drop out anything (nn.Dropout, or an attention dropout its
    model's config sets)."""
    config = getattr(pipe.built.whole, "config", None)
    if any(isinstance(getattr(config, key, 0), float) and getattr(config, key) > 0
           for key in ("attention_dropout", "attn_pdrop", "resid_pdrop", "hidden_dropout")):
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0
               for module in pipe.modules.values() for m in module.modules())


def _shared_cores(pipe: Pipeline) -> tuple[int, int] | None:
    """(ranks on this machine, its cores) when the CPU ranks outnumber the cores."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", pipe.world))
    cores = len(os.sched_getaffinity(0))
    return (ranks, cores) if pipe.device.type == "cpu" and ranks > cores else None


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
