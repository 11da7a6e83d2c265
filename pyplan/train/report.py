"""What `pyplan run` is told and tells: its options, and the report rank 0 prints at the end
(losses, times beside the plan's predicted iteration, each rank's memory beside the plan's,
throughput, --check's verdict), with the lines it logs as it goes."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from pyplan.cluster.memory import mesh_state_bytes
from pyplan.lower import Lowered
from pyplan.partition import OPTIMIZER_STATE
from pyplan.planfile import load_spec
from pyplan.planfile.types import CPU_LINK, TopologySpec
from pyplan.problem.shapes import expand_blocks
from pyplan.train.check import Verdict
from pyplan.run.pipeline import Pipeline
from pyplan.train.training import Training

__all__ = ["Options", "Report", "activation_peaks", "as_json", "header", "iteration_line", "link_note",
           "planned_memory", "predicted", "summary", "timed"]


@dataclass(frozen=True)
class Options:
    iterations: int = 1
    """Steps to train from where the run starts (a resumed one: more)."""
    steps: int | None = None
    """Train until this step in total (instead of --iterations more)."""
    max_time: float | None = None
    """Seconds: save and stop before a step would end after them."""
    max_bad_steps: int = 3
    """Stop after this many steps in a row whose loss or gradients were not finite."""
    seed: int = 0
    training: Training = Training()
    blocking: bool = False
    sync_at_end: bool = False
    """Start the data-parallel gradient synchronisations after the last block (to compare)."""
    check: bool = False
    tolerance: float | None = None
    """--check's largest relative error; None: the dtype's default (check.TOLERANCE)."""
    check_steps: int = 3
    """--check: the optimizer steps whose gradients and values are compared."""
    perturb: tuple[int, str] | None = None
    """Testing aid: (rank, parameter) whose gradient is made slightly wrong at every step."""
    trace: str | None = None
    fault_timeout: float = 300.0  # (pyplan.train.faults.TIMEOUT)
    fail_at: tuple[int, int, str] | None = None
    device: str | None = None
    """cpu, cuda or auto; None: $PYPLAN_DEVICE, else auto."""
    dtype: str = "fp32"
    params: str = "fp32"
    """The blocks' parameters: fp32, or bf16 (with dtype bf16) trained through fp32 masters."""
    compile: str | None = None
    """A torch.compile backend each block's forward is compiled with (None: eager)."""
    profile: str | None = None
    """--profile: the folder of the torch.profiler traces (pyplan.train.profiling)."""
    profile_steps: tuple[int, ...] | None = None
    """The steps profiled (1-based); None: the run's last."""
    save: str | None = None
    save_every: int | None = None
    async_save: bool = False
    """--async-save: checkpoints written while the next steps run."""
    keep_last: int | None = None
    """Checkpoints kept in --save's folder (None: all)."""
    resume: str | None = None
    """A checkpoint folder, or "auto": the newest in --save if there is one (else a fresh
    start)."""
    lines: bool = False
    """Rank 0 prints a line per step as it ends (not with --json)."""
    log: str | None = None
    """JSON lines, one per step and per evaluation, appended."""
    tensorboard: str | None = None
    eval_every: int | None = None
    eval_batches: int | None = 1
    """Batches per evaluation; None: the whole eval split."""
    config: dict | None = None
    """--config: {"file": ..., "options": ...}, recorded in each checkpoint."""
    fail_save: tuple[int, str] | None = None
    """Testing aid: (rank, "raise" or "kill") fails in the middle of the first save."""

    def settings(self, steps: int) -> dict:
        """What a checkpoint records of the run's settings, and a resume compares
        (training.changes): the update's, the schedule's length and the precision."""
        return {**self.training.record(), "steps": steps, "dtype": self.dtype,
                "params": self.params, "compile": self.compile}


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
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    """(step after which it ran, mean loss over the eval batches)."""
    resumed: dict | None = None
    """The checkpoint resumed from: path, step, the settings changed since."""
    saved: str | None = None
    """The last checkpoint written."""
    ranks: list[dict] = field(default_factory=list)
    """Per rank: its memory (`peak_bytes`, `static_bytes` measured by the census, beside the
    plan's `planned_peak_bytes` and `planned_static_bytes`), `max_rss_bytes` (the process's
    host memory at its most), `setup_seconds` (building its stages) and `weights_read` (tensors
    it read from model.weights)."""
    predicted: tuple[float, float] | None = None
    """The plan's iteration in seconds, and of it the schedule's makespan (when the plan says
    what its time unit is)."""
    shared_cores: tuple[int, int] | None = None
    """On the CPU, when rank 0's machine runs more ranks than it has cores: (its ranks, its
    cores)."""
    flops: tuple[float | None, float | None] = (None, None)
    """(the model FLOPs of one step over all ranks, counted in the first; one device's peak
    FLOP/s) when known (pyplan.train.flops)."""
    census_iteration: int | None = None
    """The iteration (counted from the first of this run) the memory census ran in: not timed."""
    link_note: str | None = None
    """How the prediction timed the transfers, when on one of pyplan's default links
    (link_note)."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def header(problem, ranks: int, device: str, backend: str, options: Options,
           steps: int) -> str:
    """The line rank 0 prints before the first step."""
    mode = "blocking" if options.blocking else "non-blocking"
    plural = "s" if steps != 1 else ""
    precision = options.dtype + (" with bf16 parameters and fp32 masters"
                                 if options.params == "bf16" else "")
    compiled = f", torch.compile {options.compile}" if options.compile else ""
    return (f"{problem.name}: {steps} step{plural} on {ranks} ranks ({device}, {backend}, "
            f"{precision}{compiled}), {mode} communication, {problem.num_micro_batches} "
            f"micro-batches, " + (options.training.describe() if problem.training else
                                  "forward only (an inference plan: no update)"))


def iteration_line(step: int, seconds: float, loss: float, samples: int, tokens: int | None,
                   norm: float | None, eta: float | None = None, skipped: str | None = None,
                   mfu: float | None = None) -> str:
    """A step's line: `step` is the step just completed (1-based)."""
    rate = f"  {samples / seconds:8.1f} samples/s" if samples else ""
    if tokens:
        rate += f"  {tokens / seconds:9.0f} tokens/s"
    if norm is not None:
        rate += f"  grad norm {norm:.4g}"
    if mfu is not None:
        rate += f"  MFU {mfu:.1%}"
    if eta is not None:
        rate += f"  ETA {duration(eta)}"
    if skipped:
        rate += f"  SKIPPED: {skipped}"
    return f"  step {step}: {seconds * 1e3:8.1f} ms  loss {loss:.6f}{rate}"


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 12s."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def summary(report: Report, lowered: Lowered, options: Options) -> list[str]:
    """The lines rank 0 prints after the last step (the header and a line per step came
    before, as they happened)."""
    problem = lowered.problem
    lines = []
    median = statistics.median(timed(report.seconds, report))
    parts = []
    for r, (compute, total) in enumerate(zip(report.compute, report.iteration_seconds)):
        c, t_ = statistics.median(timed(compute, report)), statistics.median(timed(total, report))
        parts.append(f"{r}: {c * 1e3:.1f}/{max(t_ - c, 0.0) * 1e3:.1f}")
    left_out = " (the first and the census's left out)" if len(report.seconds) > 2 else ""
    lines.append(f"  median iteration {median * 1e3:.1f} ms{left_out}; compute/rest per rank "
                 "(ms): " + "  ".join(parts))
    if report.predicted is not None:  # the schedule, transfers included, and the updates
        iteration, makespan = report.predicted
        lines.append(f"  the plan predicts {iteration * 1e3:.1f} ms (the schedule's makespan "
                     f"{makespan * 1e3:.1f} ms, then the optimizer's steps); measured / "
                     f"predicted {median / iteration:.2f}")
        if report.link_note is not None:
            lines.append(f"  note: {report.link_note}")
        if report.shared_cores is not None:
            ranks, cores = report.shared_cores
            lines.append(f"  note: {ranks} ranks share {cores} CPU cores here, so an iteration "
                         "takes longer than the plan predicts (it gives every rank a core)")
    if report.ranks and report.ranks[0].get("peak_bytes"):
        lines.append(f"  memory per rank, measured in step "
                     f"{report.first_step + report.census_iteration + 1} (peak; static after "
                     "its update: parameters, gradients, optimizer state, buffers)" +
                     ("" if "planned_peak_bytes" not in report.ranks[0] else
                      " / the plan's for its device") + ":")
        for r, x in enumerate(report.ranks):
            planned = ""
            if "planned_peak_bytes" in x:
                ratio = x["peak_bytes"] / max(x["planned_peak_bytes"], 1)
                planned = f" / {_mib(x['planned_peak_bytes'])} ({ratio:.2f}x)"
            lines.append(f"    rank {r}: peak {_mib(x['peak_bytes'])}{planned}; static "
                         f"{_mib(x['static_bytes'])}" + ("" if "planned_static_bytes" not in x
                                                        else f" / {_mib(x['planned_static_bytes'])}"))
    if report.ranks:
        lines.append("  host memory (max RSS) and set-up per rank: " + "  ".join(
            f"{r}: {_mib(x['max_rss_bytes'])}, {x['setup_seconds']:.1f} s"
            + (f", {x['weights_read']} tensors read" if x["weights_read"] else "")
            for r, x in enumerate(report.ranks)))
    if options.compile and report.ranks:  # (the steps counted run eagerly: pyplan.train.session)
        lines.append(f"  torch.compile {options.compile}: graphs captured per rank: " + "  ".join(
            f"{r}: {x.get('compiled_graphs', 0)}" for r, x in enumerate(report.ranks)) +
            ("" if all(x.get("compiled_graphs") for x in report.ranks) else
             " (a rank without any ran its blocks eagerly)"))
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
    model_flops, peak = report.flops
    if model_flops:
        counted = report.first_step + (report.census_iteration or 0) + 1
        lines.append(f"  model FLOPs per step: {model_flops:.3g} (torch's flop_registry, step "
                     f"{counted}); " + (f"MFU against {peak / 1e12:g} TFLOPS a device" if peak
                                         else f"MFU: no peak known for {report.device} "
                                         f"{options.dtype}"))
    elif problem.recomputed:
        lines.append("  MFU: not shown (the plan recomputes: its FLOPs are not the model's)")
    if report.verdict is not None:
        lines.append(("  check: " if report.verdict.ok else "  check FAILED: ")
                     + report.verdict.message)
    if options.trace:
        lines.append(f"  trace of step {report.first_step + len(report.seconds)}: "
                     f"{options.trace}")
    if report.saved:
        lines.append(f"  checkpoint: {report.saved} (step "
                     f"{report.first_step + len(report.seconds)})")
    return lines


def predicted(pipe: Pipeline, options: Options) -> tuple[float, float] | None:
    """(the plan's iteration, its makespan) in seconds: the schedule, then each device's
    optimizer step after its last block (after the makespan when clipping synchronises every
    device first)."""
    problem, schedule = pipe.problem, pipe.resolved.schedule
    if problem.time_unit_ms is None:
        return None
    unit = problem.time_unit_ms / 1e3
    clipping = options.training.clip_grad_norm is not None
    return schedule.iteration(synchronised=clipping) * unit, schedule.makespan * unit


def link_note(resolved, device: str) -> str | None:
    """What to say when the plan times its transfers on one of pyplan's default links, not
    on one measured or given: a GPU node's (the plan's topology gives none) or the CPU-class
    one `pyplan partition` writes on the CPU. None when the plan predicts no time, times no
    output on its links, or its plan file is not there to tell."""
    path = resolved.plan_path
    if resolved.problem.time_unit_ms is None or path is None or not path.is_file():
        return None
    spec = load_spec(path)
    if not any(b.output is not None and b.transfer is None for b in expand_blocks(spec)):
        return None
    topology = spec.topology
    used = [topology.within_node] + ([topology.across_nodes]
                                     if topology.devices_per_node is not None else [])
    measure = "pyplan partition --links (or profile --links, into topology.within_node)"
    if TopologySpec().within_node in used or TopologySpec().across_nodes in used:
        here = ", not this CPU's" if device == "cpu" else ""
        return (f"the prediction times transfers on a GPU node's default link{here}; "
                f"measure this machine's with {measure}")
    if CPU_LINK in used:
        return ("the prediction times transfers on pyplan's default CPU link "
                f"({CPU_LINK.bandwidth / 1e9:.2f} GB/s, {CPU_LINK.latency_ms} ms), not on one "
                f"measured here: {measure}")
    return None


def timed(values: list, report: Report) -> list:
    """The figures of the iterations whose time counts: all but the census's and the first
    (a warm-up: first-touch allocations, the transports' first messages, torch.compile's
    compilation), as long as one is left."""
    index = report.census_iteration
    not_census = [v for i, v in enumerate(values) if i != index] if len(values) > 1 else values
    return not_census[1:] if len(not_census) > 1 else not_census


def planned_memory(pipe: Pipeline, optimizer: str) -> list[dict]:
    """Per rank, the plan's peak memory of its device and the weights it counts there
    (parameters, gradients, optimizer state), in bytes (when the plan counts memory in
    bytes); on a mesh, each rank's share of the weights (pyplan.cluster.memory's rule, with
    the run's optimizer's state tensors)."""
    problem, mesh = pipe.problem, pipe.problem.mesh
    if not problem.memory_is_size:
        return [{} for _ in range(pipe.world)]
    weights = [sum(b.weights for b in problem.blocks if d in b.devices)
               for d in range(problem.num_devices)]
    peaks = pipe.resolved.schedule.peak_memory
    tensors = 2 + OPTIMIZER_STATE.get(optimizer, 0)
    out = []
    for r in range(pipe.world):
        device = mesh.coords(r)[0]
        mine = mesh_state_bytes(weights[device], tensors, shards=mesh.shards)
        out.append({"planned_peak_bytes": peaks[device] - weights[device] + mine,
                    "planned_static_bytes": mine})
    return out


def activation_peaks(pipe: Pipeline) -> list[int] | None:
    problem = pipe.problem
    if not problem.memory_is_size:
        return None
    static = problem.static_memory
    return [peak - base for peak, base in zip(pipe.resolved.schedule.peak_memory, static)]


def _finite_or_none(values: list | None) -> list | None:
    """JSON has no NaN or infinity (a skipped step's loss or norm): null instead."""
    return None if values is None else \
        [v if v is None or math.isfinite(v) else None for v in values]


def as_json(report: Report, lowered: Lowered, options: Options) -> dict:
    """What pyplan run --json prints."""
    problem = lowered.problem
    forecast = report.predicted[0] if report.predicted is not None else None
    return {
        "plan": problem.name,
        "ranks": len(lowered.programs),
        "backend": report.backend,
        "device": report.device,
        "dtype": options.dtype,
        "params": options.params,
        "compile": options.compile,
        "blocking": options.blocking,
        "micro_batches": problem.num_micro_batches,
        "optimizer": options.training.optimizer,
        "first_iteration": report.first_step,
        "iteration_seconds": report.seconds,
        "losses": _finite_or_none(report.losses),
        "grad_norms": _finite_or_none(report.grad_norms),
        "samples_per_second": [report.samples / s for s in report.seconds]
        if report.samples else None,
        "tokens_per_second": [report.tokens / s for s in report.seconds]
        if report.tokens else None,
        "predicted_seconds": forecast,
        "predicted_makespan_seconds": report.predicted[1] if report.predicted else None,
        "prediction_note": report.link_note,
        "median_seconds": statistics.median(timed(report.seconds, report)),
        "census_iteration": report.census_iteration,
        "rank_memory": report.ranks,
        "compute_seconds": report.compute,
        "rank_iteration_seconds": report.iteration_seconds,
        "peak_activation_bytes": report.peak_activation_bytes,
        "predicted_activation_bytes": report.predicted_activation_bytes,
        "cuda_max_allocated": report.cuda_max_allocated,
        "ties": report.ties,
        "model_flops": report.flops[0],
        "peak_flops": report.flops[1],
        "eval_losses": [{"step": step, "loss": loss} for step, loss in report.eval_losses],
        "resumed": report.resumed,
        "checkpoint": report.saved,
        "check": None if report.verdict is None else {"ok": report.verdict.ok,
                                                      "message": report.verdict.message},
    }
