"""Measuring one piece of a model on this machine: its forward and backward times (medians of
repeated runs taken until stable, on CUDA with events), the bytes autograd saves, and the
warnings a measurement owes its reader (times that stay spread, a busy machine). Shared by
`pyplan profile` and `pyplan partition` (pyplan.measure.profile) and by the vocabulary-sharded
units' measurements (pyplan.measure.sharded)."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from pyplan.models import Unit, member
from pyplan.run.backward import backward_input, backward_weight
from pyplan.measure.census import Census, storage_bytes
from pyplan.comm.values import flatten, rebuild, saved_bytes

__all__ = ["MORE", "SPREAD", "BlockCost", "Measured", "Peaks", "Timer", "block_arguments", "busy",
           "compute_threads", "host_bytes", "leaves", "measure", "memory_peaks", "optimizer", "rss_bytes", "run_threads",
           "threads",
           "split_backward", "unit_buffer_bytes", "update_ms",
           "unit_parameters"]

SPREAD = 0.10  # interquartile range / median above which more runs are taken
MORE = 8       # at most this many times the asked repeats


@dataclass(frozen=True)
class BlockCost:
    name: str
    devices: tuple[int, ...]
    forward_ms: float
    backward_ms: float | None
    """None for a block without a backward (inference, or a no-grad pass)."""
    activation_bytes: int
    input_bytes: int = 0
    """What it keeps when recomputed."""
    output_bytes: int = 0
    """What goes to its consumers on other devices (and its gradient back)."""


@dataclass
class Measured:
    """What the measurements noticed besides the figures."""

    spread: dict[str, float] = field(default_factory=dict)
    """What was timed -> the spread of its times, where they stayed over SPREAD."""
    load: float | None = None
    """The highest load average seen above the cores, if any."""
    cpu_time: bool = False
    """Times are this thread's CPU time (unaffected by other processes)."""

    @property
    def warnings(self) -> list[str]:
        """Lines for the user."""
        lines = []
        if self.spread:
            worst = max(self.spread, key=self.spread.get)
            lines.append(f"the times of {len(self.spread)} measurements spread more than "
                         f"{SPREAD:.0%} around their medians however often repeated (worst: "
                         f"{worst}, {self.spread[worst]:.0%}); the medians count")
        if self.load is not None and self.cpu_time:
            lines.append(f"the machine looks busy (load average {self.load:.1f} on "
                         f"{os.cpu_count() or 1} cores): the times are CPU time, which other "
                         "work does not lengthen, but a run on a machine this busy takes "
                         "longer than predicted")
        elif self.load is not None:
            lines.append(f"the machine looks busy (load average {self.load:.1f} on "
                         f"{os.cpu_count() or 1} cores): other work competing for the cores "
                         "makes every time too long; measure again when it is idle")
        return lines


def _spread(samples: list[float]) -> float:
    if len(samples) < 4:
        return 0.0
    q = statistics.quantiles(samples, n=4)
    middle = statistics.median(samples)
    return (q[2] - q[0]) / middle if middle > 0 else 0.0


def _cache_bytes(device) -> int:
    """Twice the last-level cache (what writing that much evicts): the CPU's from sysfs
    (64 MiB when it says nothing), a GPU's L2 (256 MiB covers any so far)."""
    if device.type == "cuda":
        return 256 * 2**20
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]])
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return 2 * max(sizes, default=32 * 2**20)


class Timer:
    """Times on `device`: CUDA events; on the CPU with one thread (as each rank of a run
    computes: torchrun gives every process one), the CPU time of this thread, which other
    processes competing for the cores do not lengthen; with more threads, the wall clock."""

    def __init__(self, device, repeats: int, measured: Measured) -> None:
        self.device, self.repeats, self.measured = device, repeats, measured
        measured.cpu_time = device.type == "cpu" and torch.get_num_threads() == 1
        self.clock = time.thread_time if measured.cpu_time else time.perf_counter
        self.cold = False
        self._flush: torch.Tensor | None = None

    def cold_for(self, param_bytes: int) -> None:
        """Time cold (start()) when a model's parameters (`param_bytes`) and their gradients
        take more than half the last-level cache: beside the activations and the other ranks
        sharing that cache, a run cannot keep them there (an MLP of 15 MB ran 1.6x as long
        per block as timed warm)."""
        self.cold = 2 * param_bytes > _cache_bytes(self.device) // 4

    def start(self):
        """now(); when `cold`, with the caches emptied first: in a run whose weights do not fit
        the cache, a block finds its weights where the blocks between left them (out of it),
        not where its last repeat did."""
        if self.cold:
            if self._flush is None:
                self._flush = torch.zeros(_cache_bytes(self.device) // 4, dtype=torch.int32,
                                          device=self.device)
            self._flush.add_(1)
        return self.now()

    def now(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.clock()

    def ms(self, start, end) -> float:
        if self.device.type == "cuda":
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def median(self, sample, what: str) -> float:
        """Median milliseconds of `sample()` (which times one run and returns ms), after one
        warm-up run, with runs added while they spread too widely."""
        sample()
        samples = [sample() for _ in range(self.repeats)]
        while _spread(samples) > SPREAD and len(samples) < MORE * self.repeats:
            samples.append(sample())
        spread = _spread(samples)
        if spread > SPREAD:
            self.measured.spread[what] = spread
        return statistics.median(samples)

    def call(self, fn, what: str) -> tuple[float, object]:
        """Median ms of fn() and its last result."""
        box = [None]

        def sample():
            start = self.start()
            box[0] = fn()
            return self.ms(start, self.now())
        return self.median(sample, what), box[0]


def rss_bytes() -> int:
    """This process's resident memory now (Linux), else its most so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_bytes() -> int:
    """This machine's memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 0


def run_threads() -> int:
    """The CPU threads each rank of a run computes with: $OMP_NUM_THREADS, else one (what
    torchrun gives each of several processes)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


@contextlib.contextmanager
def threads(count: int):
    """torch computes with `count` threads inside (as a rank of the run will), and as before
    after."""
    was = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def compute_threads(device, count: int | None = None):
    """On the CPU, compute with `count` threads (default: as each rank of a run) inside."""
    if torch.device(device).type != "cpu":
        return contextlib.nullcontext()
    return threads(count or run_threads())


def busy(measured: Measured) -> None:
    """Flag a machine whose load average exceeds its cores (before or after measuring)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return
    if load > (os.cpu_count() or 1) + 0.5:
        measured.load = max(load, measured.load or 0.0)


def block_arguments(b: int, preds: dict, outputs: dict, inputs, wants_inputs, grad: bool):
    """Block b's arguments from its predecessors' outputs (and the batch's inputs where it
    takes them), and the leaves to differentiate: inputs from other blocks are leaves here,
    so the backward stops at this block."""
    args, wrt = [], []
    for p in preds[b]:
        value, fresh = leaves(outputs[p], grad)
        args.append(value)
        wrt += fresh
    if not preds[b] or b in wants_inputs:
        args.insert(0, inputs)
    return args, wrt


def _saved_bytes(fn, params) -> int:
    """Bytes autograd saves for backward while fn runs (pyplan.comm.values.saved_bytes)."""
    with saved_bytes(params) as saved:
        fn()
    return saved.bytes


def leaves(value, grad: bool):
    """A value's tensors as fresh leaves (floating ones requiring grad when `grad`)."""
    if value is None:
        return None, []
    tensors, spec = flatten(value, "a block")
    fresh = [t.detach().requires_grad_(grad and t.is_floating_point()) for t in tensors]
    return rebuild(fresh, spec), [t for t in fresh if t.requires_grad]


def _roots(out, loss_fn):
    """What a backward starts from: the loss of the output, or each floating output tensor
    (with ones as its gradient)."""
    if loss_fn is not None:
        return [loss_fn(out)], None
    tensors, _ = flatten(out, "a block")
    roots = [t for t in tensors if t.is_floating_point() and t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def measure(timer: Timer, module, args: list, wrt_inputs: list, params: list, loss_fn,
            what: str, grad: bool = True) -> tuple[float, float | None, int, object]:
    """(forward ms, backward ms, saved bytes, output) of module(*args). The backward
    accumulates into the gradients of the parameters, allocated beforehand and kept, as a run
    keeps them, and of the inputs, as the executor's does."""
    with torch.set_grad_enabled(grad):
        forward_ms, out = timer.call(lambda: module(*args), f"{what} forward")
        # What the loss saves too (its log-probabilities): the last block keeps it.
        saved = _saved_bytes(lambda: _roots(module(*args), loss_fn), params) if grad else 0
    if not grad:
        return forward_ms, None, saved, out
    wrt = wrt_inputs + params
    _gradients_allocated(params)

    def backward():
        with torch.enable_grad():
            roots, seeds = _roots(module(*args), loss_fn)
        for x in wrt_inputs:
            x.grad = None
        start = timer.start()
        if wrt and any(r.requires_grad for r in roots):
            torch.autograd.backward(roots, seeds, inputs=wrt)
        return timer.ms(start, timer.now())

    return forward_ms, timer.median(backward, f"{what} backward"), saved, out


def split_backward(timer: Timer, module, args: list, wrt_inputs: list, params: list, loss_fn,
                   what: str) -> tuple[float, float, int, int]:
    """The zero-bubble split of module(*args)'s backward, as the executor runs it
    (pyplan.run.backward): (median ms of B, the input gradients; median ms of W, the
    weight gradients; the bytes of the gradients B captures for W; what the census sees
    freed when B lets go of the outputs: the graph above W's pieces)."""
    _gradients_allocated(params)

    def prepared():
        with torch.enable_grad():
            roots, seeds = _roots(module(*args), loss_fn)
        return roots, seeds or [torch.ones((), dtype=r.dtype) for r in roots]

    def b_sample():
        roots, seeds = prepared()
        start = timer.start()
        backward_input(roots, seeds, wrt_inputs, params)
        return timer.ms(start, timer.now())

    def w_sample():
        roots, seeds = prepared()
        _, work = backward_input(roots, seeds, wrt_inputs, params)
        start = timer.start()
        backward_weight(work)
        return timer.ms(start, timer.now())

    census = Census(params[0].device if params else "cpu")
    with census:
        roots, seeds = prepared()
        grads, work = backward_input(roots, seeds, wrt_inputs, params)
        del grads
        for x in wrt_inputs:
            x.grad = None
        before = census.bytes
        # The executor lets go of the roots after B: what only the graph above W's pieces
        # saved (a loss's log-probabilities) goes with them.
        del roots, seeds
        released = before - census.bytes
    b_ms = timer.median(b_sample, f"{what} input gradients")
    return (b_ms, timer.median(w_sample, f"{what} weight gradients"), work.captured_bytes,
            released)


def optimizer(name: str, params: list):
    """The optimizer `pyplan run --optimizer NAME` builds (pyplan.train.training), with a
    learning rate that leaves the parameters almost as they were."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-6)
    return torch.optim.SGD(params, lr=1e-6)


def update_ms(timer: Timer, params: list, optimizer_name: str, what: str
              ) -> tuple[float, int]:
    """(median ms of one step of the optimizer over `params` (their gradients allocated),
    with the gradients zeroed in place as a run zeroes them for the next iteration; the most
    the step allocates at once beyond its state: its temporaries, counted by the census)."""
    if not params:
        return 0.0, 0
    _gradients_allocated(params)
    kept = [p.detach().clone() for p in params]
    step = optimizer(optimizer_name, params)

    def sample():
        start = timer.start()
        step.step()
        step.zero_grad(set_to_none=False)
        return timer.ms(start, timer.now())

    found = timer.median(sample, f"{what} update")  # the warm-up run makes Adam's state
    with Census(params[0].device) as census:
        step.step()
    with torch.no_grad():  # the unit as it was: later units' inputs do not move
        for p, value in zip(params, kept):
            p.copy_(value)
    return found, census.peak


def _gradients_allocated(params: list) -> None:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


@dataclass(frozen=True)
class Peaks:
    """What a unit allocates at its most, counted by the census (pyplan.partition composes a
    stage's workspace from its units': pyplan.partition.stage_workspace)."""

    forward: int
    """The most its forward allocates at once (what it saves, its output, temporaries)."""
    backward: int
    """The most its backward allocates at once beyond what the forward left, with the
    gradient it receives."""
    saved_input: int = 0
    """The bytes of its input that autograd saves (the unit before may save the same tensor
    as its output: a stage holds it once)."""
    saved_output: int = 0
    """The bytes of its output that autograd saves."""


def memory_peaks(module, args: list, wrt_inputs: list, params: list, loss_fn,
                 device) -> Peaks:
    """The most bytes module(*args) allocates at once in its forward and in its backward
    (beside the gradient it receives), counted by the census with the parameters' gradients
    allocated beforehand (a run keeps them), and which of its input and output autograd
    saves."""
    _gradients_allocated(params)
    wrt = wrt_inputs + params
    with torch.enable_grad(), Census(device) as census:
        with saved_bytes(params) as saved:
            out = module(*args)
            roots, seeds = _roots(out, loss_fn)
        forward = census.peak
        census.peak = before = census.bytes
        if wrt and any(r.requires_grad for r in roots):
            torch.autograd.backward(roots, seeds, inputs=wrt)
        received = sum(s.numel() * s.element_size() for s in seeds or ())
        backward = census.peak - before + received
        kept = (_kept_bytes(args, saved.storages),
                0 if loss_fn is not None else _kept_bytes(out, saved.storages))
        del out, roots, seeds
    for x in wrt_inputs:
        x.grad = None
    return Peaks(forward, backward, *kept)


def _kept_bytes(value, storages: frozenset[int]) -> int:
    """The bytes of value's storages among `storages` (those autograd saved)."""
    return storage_bytes(t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and
                         t.untyped_storage().data_ptr() in storages)


def unit_buffer_bytes(model: torch.nn.Module, unit: Unit) -> int:
    """The bytes of the buffers of a unit's modules (each storage once)."""
    return storage_bytes(b for name in unit.modules for b in member(model, name).buffers())


def unit_parameters(model: torch.nn.Module, unit: Unit) -> list[torch.Tensor]:
    """The parameters of a unit's modules (each once)."""
    found = {}
    for name in unit.modules:
        for p in member(model, name).parameters():
            if p.requires_grad:
                found[id(p)] = p
    return list(found.values())
