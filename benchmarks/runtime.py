"""`pyplan run` throughput, measured side by side on 4 CPU gloo ranks (or 2: `--ranks 2`):

  1. non-blocking vs blocking communication on the same plan (Tessel Fig. 17 reports up to
     1.9x on GPUs for M- and NN-shapes);
  2. pyplan vs torch.distributed.pipelining (Schedule1F1B, ScheduleGPipe,
     ScheduleInterleaved1F1B) on the same model, stage split and micro-batches;
  3. the GPT on the M-shape (vocabulary-parallel embedding and head on all ranks; the plan
     written by `pyplan partition --shape mshape`: pyplan.models.vocab), which
     torch's runtime cannot express, vs the best torch schedule of the same model with the
     embedding on the first and the head on the last stage, and vs the same placement written
     by hand (plans/gpt-mshape-blocks.yaml: hand-written tensor-parallel layers);
  4. data parallelism x pipeline (2 replicas of 2 stages, plans/transformer-vshape-dp2.yaml):
     each stage's gradients all-reduced right after its last backward (overlapped) vs all at
     the end of the iteration, and pyplan vs torch's Schedule1F1B with each stage wrapped in
     DistributedDataParallel over the same (dp, pp) device mesh;
  5. the zero-bubble split backward on one stage of equal matmuls (in this process, before the
     workers start): B (input gradients), W (weight gradients) and one full backward, timed
     alike; W/B should be about 1 and (B + W) / full about 1 (they share the work), beside
     torch.distributed.pipelining's own split of the same stage.

    python benchmarks/runtime.py [--rounds 5] [--iterations 6] [--ranks 4|2]

With `--ranks 2` only item 2 runs, on 2 ranks (a core each on a 2-core machine, where 4 ranks
are bound by the CPU time of all of them): 1F1B and GPipe over 2 stages of 4 layers, and
interleaved 1F1B over 4 stages of 2 layers, 2 per rank (the plan gets torch's order on the
first rank as order rules, and the memory it takes: 5 micro-batch stages); beside the times, each
case's CPU time per iteration summed over the ranks (getrusage: the work each runtime does,
whatever else the machine runs); then how long rank 1 waits for a message its peer sent while
it was busy, its receive posted before or after (why pyplan posts receives early).

The script solves the plans it needs into a temporary directory and re-launches itself under
torchrun; the workers run every case in turn (in reverse on odd rounds), `rounds` times, in the
same processes, and rank 0 prints each case's median iteration time and each ratio's median,
minimum and maximum over the rounds (a ratio is taken within a round). The example models are
enlarged here (their size constants) so that blocks, not Python overhead, dominate.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"transformer": dict(DIM=128, HEADS=4, SEQUENCE=32, BATCH=32, VOCAB=512),
         "gpt": dict(DIM=128, HEADS=4, SEQUENCE=32, BATCH=32, VOCAB=32768)}
HEADER = "# yaml-language-server: $schema=../schemas/plan.schema.json\npyplan: 1\n"
MODEL = ("model: {{blocks: 'pyplan.examples.transformer:{build}', "
         "data: 'pyplan.examples.transformer:batch', loss: 'pyplan.examples.transformer:loss'}}\n")
VSHAPE = ("devices: 4\nmicro_batches: 8\ntraining: {backward: {time_ratio: 2}}\n"
          "shape: {kind: vshape, stage: {time: 1, memory: 1}}\n")
PLANS = {
    # The V-shape under GPipe's order (every forward of a stage before its first backward).
    "transformer-gpipe": HEADER + "name: transformer-gpipe\nmemory: 8\n" + VSHAPE +
    "constraints:\n  order:\n    - {rule: 'stage{s}.f[m+7] < stage{s}.b[m]', for: {s: '0..3'}}\n"
    + MODEL.format(build="build"),
    # Eight stages of one layer, two per device (stage s on device s mod 4), with the memory
    # torch's interleaved order takes (11 micro-batch stages on the first device): pyplan runs
    # that order too (with less, it would run a longer schedule than torch's).
    "transformer-interleaved": HEADER + "name: transformer-interleaved\nmemory: 12\n"
    "devices: 4\nmicro_batches: 8\ntraining: {backward: {time_ratio: 2}}\n"
    "shape: {kind: interleaved, chunks: 2, stage: {time: 1, memory: 1}}\n"
    "search: {max_repetend_micro_batches: 4, time_limit: 20}\n"
    + MODEL.format(build="build_interleaved"),
}


# Two ranks: the same model in 2 stages (1F1B, GPipe) and in 4 stages, 2 per rank (interleaved).
TWO_RANKS = "devices: 2\nmicro_batches: 8\ntraining: {backward: {time_ratio: 2}}\n"
PLANS_TWO = {
    "two-1f1b": HEADER + "name: two-1f1b\nmemory: 4\n" + TWO_RANKS +
    "shape: {kind: vshape, stage: {time: 1, memory: 1}}\nconstraints:\n  order:\n"
    "    - {rule: 'stage{s}[m] < stage{s}[m+1]', for: {s: '0..1'}}\n"
    "    - {rule: 'stage{s}.b[m] < stage{s}.b[m+1]', for: {s: '0..1'}}\n"
    "    - {rule: 'stage{s}.f[m+{D-s-1}] < stage{s}.b[m]', for: {s: '0..1'}}\n"
    "    - {rule: 'stage{s}.b[m] < stage{s}.f[m+{D-s}]', for: {s: '0..1'}}\n"
    + MODEL.format(build="build_two"),
    "two-gpipe": HEADER + "name: two-gpipe\nmemory: 8\n" + TWO_RANKS +
    "shape: {kind: vshape, stage: {time: 1, memory: 1}}\nconstraints:\n  order:\n"
    "    - {rule: 'stage{s}.f[m+7] < stage{s}.b[m]', for: {s: '0..1'}}\n"
    + MODEL.format(build="build_two"),
    # torch's interleaved order on rank 0: in the steady state each forward before the
    # backward it alternates with (the solver's own order, as short in plan units, puts the
    # backward first and waits differently: docs/benchmarks.md).
    "two-interleaved": HEADER + "name: two-interleaved\nmemory: 5\n" + TWO_RANKS +
    "shape: {kind: interleaved, chunks: 2, stage: {time: 1, memory: 1}}\nconstraints:\n"
    "  order:\n    - 'stage0.f[m+2] < stage2.b[m]'\n    - 'stage2.b[m] < stage0.f[m+3]'\n"
    "    - 'stage2.f[m+2] < stage0.b[m]'\n    - 'stage0.b[m] < stage2.f[m+3]'\n"
    "search: {max_repetend_micro_batches: 4, time_limit: 20}\n" + MODEL.format(build="build"),
}


def ranks() -> int:
    return int(os.environ.get("PYPLAN_BENCH_RANKS", "4"))


def prepare(directory: Path) -> dict[str, Path]:
    """Solve every plan the benchmark runs; returns name -> resolved plan."""
    from pyplan.problem import load_problem
    from pyplan.resolved import resolved_path, write_resolved
    from pyplan.solver import solve

    paths = {}
    if ranks() == 2:
        for name, text in PLANS_TWO.items():
            plan = directory / f"{name}.yaml"
            plan.write_text(text)
            paths[name] = write_resolved(solve(load_problem(plan)), resolved_path(plan))
        return paths
    for name in ("transformer-vshape", "gpt-mshape", "gpt-mshape-blocks",
                 "transformer-vshape-dp2"):
        (directory / f"{name}.yaml").write_text((ROOT / "plans" / f"{name}.yaml").read_text())
    for name, text in PLANS.items():
        (directory / f"{name}.yaml").write_text(text)
    for name in ("transformer-vshape", "transformer-gpipe", "transformer-interleaved",
                 "gpt-mshape", "gpt-mshape-blocks", "transformer-vshape-dp2"):
        plan = directory / f"{name}.yaml"
        paths[name] = write_resolved(solve(load_problem(plan)), resolved_path(plan))
    return paths


# ---------------------------------------------------------------- workers (under torchrun)

class PyplanCase:
    def __init__(self, name: str, resolved: Path, *, blocking: bool,
                 sync_at_end: bool = False) -> None:
        from pyplan.train.report import Options
        from pyplan.train.session import Session

        self.name = name
        self.session = Session(resolved, None, Options(iterations=ITERATIONS,
                                                       blocking=blocking,
                                                       sync_at_end=sync_at_end), watch=False)
        # The measured step (memory census and FLOP count, one iteration of every train(),
        # Python per operation) is not what these cases time, nor what torch's cases do.
        self.session.census = lambda optimizer: contextlib.nullcontext()

    def run(self) -> list[float]:
        return self.session.train().seconds


class TorchScheduleCase:
    """Times a torch.distributed.pipelining schedule: subclasses set name, model, schedule,
    optimizer, first and last (whether this rank feeds the inputs / computes the loss), and
    `replica` with data parallelism (this rank trains on that slice of the global batch)."""

    replica: tuple[int, int] | None = None  # (this replica, replicas)

    def run(self) -> list[float]:
        import torch
        import torch.distributed as dist

        from pyplan.run.binding import make_batch
        from pyplan.run.data import split_batch

        seconds = []
        dist.barrier()  # (once: the steps follow each other as pyplan run's do)
        for step in range(ITERATIONS):
            inputs, targets = make_batch(self.model, step, 0, torch.device("cpu"))
            if self.replica is not None:
                index, replicas = self.replica
                inputs = split_batch(inputs, replicas)[index]
                targets = split_batch(targets, replicas)[index]
            # torch 2.11's PipelineStage checks its inputs' strides: a batch sliced from a
            # longer one (tokens[:, :-1]) is copied contiguous first (2.13 no longer checks)
            inputs, targets = inputs.contiguous(), targets.contiguous()
            self.optimizer.zero_grad(set_to_none=True)
            started = time.perf_counter()
            kwargs = {"target": targets, "losses": []} if self.last else {}
            self.schedule.step(*([inputs] if self.first else []), **kwargs)
            self.optimizer.step()
            seconds.append(time.perf_counter() - started)
        slowest = torch.tensor(seconds, dtype=torch.float64)  # each step's slowest rank
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.tolist()


class TorchCase(TorchScheduleCase):
    """The same modules under a torch.distributed.pipelining schedule."""

    def __init__(self, name: str, schedule: str, example: str, stages: list[list[str]]):
        import torch
        import torch.distributed as dist
        from torch.distributed import pipelining

        from pyplan.run.binding import Model, seed_everything

        self.name = name
        module = __import__(f"pyplan.examples.{example}", fromlist=["batch"])
        build = {2: module.build_two, 4: module.build, 8: module.build_interleaved}[len(stages)]
        self.model = Model(build, module.batch, module.loss)
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = [s for s in range(len(stages)) if s % world == rank]
        modules = []
        for blocks in stages:
            parts = []
            for block in blocks:
                seed_everything(0, "block", block)
                parts.append(build(block, None))
            modules.append(torch.nn.Sequential(*parts))
        # Static stage metadata: example input and output of every stage for one micro-batch
        # (torch's shape inference exchanges Python objects through numpy).
        x = module.batch(0)[0][: module.BATCH // 8]
        examples = []
        for m in modules:  # with autograd on: torch reads which tensors need gradients
            y = m(x)
            examples.append((x, y.detach().requires_grad_(True)))
            x = examples[-1][1]
        pipeline_stages = [pipelining.PipelineStage(modules[s], s, len(stages),
                                                    torch.device("cpu"),
                                                    input_args=examples[s][0],
                                                    output_args=examples[s][1])
                           for s in mine]
        self.params = [p for st in pipeline_stages for p in st.submod.parameters()]
        self.optimizer = torch.optim.SGD(self.params, lr=0.01)
        cls = getattr(pipelining, schedule)
        self.schedule = cls(pipeline_stages if len(mine) > 1 else pipeline_stages[0],
                            n_microbatches=8, loss_fn=module.loss)
        self.first, self.last = 0 in mine, len(stages) - 1 in mine



class TorchModelCase(TorchScheduleCase):
    """A torch.distributed.pipelining schedule over stages cut from one seeded whole model
    (`module.model()`, a chain of units: the model pyplan partition cuts), one stage per rank."""

    def __init__(self, name: str, schedule: str, module_name: str, stages: list[list[str]],
                 micro_batches: int = 8):
        import torch
        import torch.distributed as dist
        from torch.distributed import pipelining

        from pyplan.models.chain import stage
        from pyplan.run.binding import Model, seed_everything

        self.name = name
        module = __import__(module_name, fromlist=["model"])
        self.model = Model(None, module.batch, module.loss)
        seed_everything(0, "module")
        whole = module.model()
        modules = [stage(whole, tuple(names)) for names in stages]
        rank = dist.get_rank()
        x = module.batch(0)[0][: module.BATCH // micro_batches]
        examples = []
        for m in modules:  # with autograd on: torch reads which tensors need gradients
            y = m(x)
            examples.append((x, y.detach().requires_grad_(True)))
            x = examples[-1][1]
        pipeline_stage = pipelining.PipelineStage(modules[rank], rank, len(modules),
                                                  torch.device("cpu"),
                                                  input_args=examples[rank][0],
                                                  output_args=examples[rank][1])
        self.optimizer = torch.optim.SGD(modules[rank].parameters(), lr=0.01)
        self.schedule = getattr(pipelining, schedule)(pipeline_stage,
                                                      n_microbatches=micro_batches,
                                                      loss_fn=module.loss)
        self.first, self.last = rank == 0, rank == len(modules) - 1


class TorchDDPCase(TorchScheduleCase):
    """Two replicas of the two-stage transformer under torch's Schedule1F1B, each stage wrapped
    in DistributedDataParallel (gradients synchronised in the last micro-batch's backward),
    on a (dp 2, pp 2) device mesh: rank = replica x 2 + stage, as in pyplan."""

    def __init__(self, name: str) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed import pipelining
        from torch.distributed.device_mesh import init_device_mesh
        from torch.nn.parallel import DistributedDataParallel

        import pyplan.examples.transformer as module
        from pyplan.run.binding import Model, seed_everything

        self.name = name
        self.model = Model(module.build_two, module.batch, module.loss)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        replica, stage = divmod(dist.get_rank(), 2)
        self.replica = (replica, 2)
        stages = []
        for s in range(2):
            seed_everything(0, "block", f"stage{s}")
            stages.append(module.build_two(f"stage{s}", None))
        x = module.batch(0)[0][: module.BATCH // 8]  # one micro-batch: 2 replicas x 4
        y = stages[0](x).detach().requires_grad_(True)
        examples = [(x, y), (y, stages[1](y).detach().requires_grad_(True))]
        ddp = DistributedDataParallel(stages[stage], process_group=mesh.get_group("dp"))
        pipeline_stage = pipelining.PipelineStage(ddp, stage, 2, torch.device("cpu"),
                                                  input_args=examples[stage][0],
                                                  output_args=examples[stage][1],
                                                  group=mesh.get_group("pp"))
        self.optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        self.schedule = pipelining.Schedule1F1B(pipeline_stage, n_microbatches=4,
                                                loss_fn=module.loss)
        self.first, self.last = stage == 0, stage == 1



def worker(directory: Path, rounds: int) -> None:
    import pyplan.runtime  # noqa: F401 - quiet torch import
    import torch.distributed as dist

    import pyplan.examples.gpt as gpt
    import pyplan.examples.transformer as transformer

    for module, sizes in ((transformer, SIZES["transformer"]), (gpt, SIZES["gpt"])):
        for key, value in sizes.items():
            setattr(module, key, value)
    dist.init_process_group("gloo")
    if ranks() == 2:
        return worker_two(directory, rounds)
    plan = {name: directory / f"{name}.resolved.yaml" for name in
            ("transformer-vshape", "transformer-gpipe", "transformer-interleaved", "gpt-mshape",
             "gpt-mshape-blocks", "transformer-vshape-dp2")}
    four = [[f"stage{s}"] for s in range(4)]
    # The same whole model (gpt.model()) as plans/gpt-mshape.yaml, cut as torch can run it.
    gpt_vshape = [["embed", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "head"]]
    cases = [
        PyplanCase("pyplan 1F1B (V-shape)", plan["transformer-vshape"], blocking=False),
        PyplanCase("pyplan 1F1B, blocking", plan["transformer-vshape"], blocking=True),
        TorchCase("torch Schedule1F1B", "Schedule1F1B", "transformer", four),
        PyplanCase("pyplan GPipe order", plan["transformer-gpipe"], blocking=False),
        TorchCase("torch ScheduleGPipe", "ScheduleGPipe", "transformer", four),
        PyplanCase("pyplan interleaved (8 stages)", plan["transformer-interleaved"],
                   blocking=False),
        TorchCase("torch ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B", "transformer",
                  [[f"stage{s}"] for s in range(8)]),
        PyplanCase("pyplan GPT M-shape", plan["gpt-mshape"], blocking=False),
        PyplanCase("pyplan GPT M-shape, blocking", plan["gpt-mshape"], blocking=True),
        PyplanCase("pyplan GPT M-shape, hand-written blocks", plan["gpt-mshape-blocks"],
                   blocking=False),
        TorchModelCase("torch GPT Schedule1F1B", "Schedule1F1B", "pyplan.examples.gpt",
                       gpt_vshape),
        TorchModelCase("torch GPT ScheduleGPipe", "ScheduleGPipe", "pyplan.examples.gpt",
                       gpt_vshape),
        PyplanCase("pyplan DP2xPP2, overlapped sync", plan["transformer-vshape-dp2"],
                   blocking=False),
        PyplanCase("pyplan DP2xPP2, sync at the end", plan["transformer-vshape-dp2"],
                   blocking=False, sync_at_end=True),
        TorchDDPCase("torch Schedule1F1B + DDP, DP2xPP2"),
    ]
    only = os.environ.get("PYPLAN_BENCH_ONLY")
    if only:  # a quick look at some cases: the report names only those
        cases = [c for c in cases if any(word in c.name for word in only.split(","))]
    rounds_of = run_rounds(cases, rounds)
    if dist.get_rank() == 0:
        report(rounds_of)
    dist.destroy_process_group()


def worker_two(directory: Path, rounds: int) -> None:
    """Item 2 on two ranks: pyplan and torch.distributed.pipelining on the same schedules."""
    import torch
    import torch.distributed as dist

    plan = {name: directory / f"{name}.resolved.yaml" for name in PLANS_TWO}
    two, four = [[f"stage{s}"] for s in range(2)], [[f"stage{s}"] for s in range(4)]
    cases = [
        PyplanCase("pyplan 1F1B (2 stages)", plan["two-1f1b"], blocking=False),
        TorchCase("torch Schedule1F1B", "Schedule1F1B", "transformer", two),
        PyplanCase("pyplan GPipe order", plan["two-gpipe"], blocking=False),
        TorchCase("torch ScheduleGPipe", "ScheduleGPipe", "transformer", two),
        PyplanCase("pyplan interleaved (4 stages)", plan["two-interleaved"], blocking=False),
        TorchCase("torch ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B", "transformer",
                  four),
    ]
    cpu: dict[str, float] = {}
    rounds_of = run_rounds(cases, rounds, cpu)
    totals = torch.tensor([cpu[case.name] for case in cases], dtype=torch.float64)
    dist.all_reduce(totals)  # CPU seconds of all ranks
    if dist.get_rank() == 0:
        print_times(rounds_of, 34)
        per_iteration = {case.name: float(t) / (rounds * ITERATIONS)
                         for case, t in zip(cases, totals)}
        print("CPU time per iteration, summed over the ranks (getrusage, every iteration):")
        for name, seconds in per_iteration.items():
            print(f"  {name:34} {seconds * 1e3:8.1f} ms")
        print("ratios (> 1: the first named is faster):")
        for label, slow, fast in (
                ("pyplan vs torch Schedule1F1B", "torch Schedule1F1B", "pyplan 1F1B (2 stages)"),
                ("pyplan vs torch ScheduleGPipe", "torch ScheduleGPipe", "pyplan GPipe order"),
                ("pyplan vs torch ScheduleInterleaved1F1B", "torch ScheduleInterleaved1F1B",
                 "pyplan interleaved (4 stages)")):
            print_ratio(rounds_of, f"{label} (time)", slow, fast, width=50)
            print(f"{label + ' (CPU time)':50} "
                  f"{per_iteration[slow] / per_iteration[fast]:.2f}x")
    receive_posting()
    dist.destroy_process_group()


def receive_posting(repeats: int = 60) -> None:
    """Why pyplan posts a receive early (pyplan.lower._early_receives): rank 1 waits for one
    activation-sized message (64 KB) rank 0 sent while rank 1 was busy (a 10 ms sleep), its
    receive posted before the busy time or only after it; medians of the waits."""
    import torch
    import torch.distributed as dist

    rank, sent = dist.get_rank(), torch.randn(16384)
    waits: dict[str, list[float]] = {"early": [], "late": []}
    for k in range(repeats):
        posting = "late" if k % 2 else "early"
        dist.barrier()
        if rank == 0:
            dist.isend(sent, 1).wait()
        elif rank == 1:
            buffer = torch.empty_like(sent)
            work = dist.irecv(buffer, 0) if posting == "early" else None
            time.sleep(0.01)
            started = time.perf_counter()
            work = work or dist.irecv(buffer, 0)
            work.wait()
            waits[posting].append(time.perf_counter() - started)
    if rank == 1:
        early, late = (statistics.median(waits[p][5:]) * 1e3 for p in ("early", "late"))
        print(f"a 64 KB receive posted before the sender sent: waited {early:.3f} ms; posted "
              f"after: {late:.3f} ms (median of {repeats // 2 - 5})", flush=True)


def run_rounds(cases, rounds: int, cpu: dict[str, float] | None = None
               ) -> dict[str, list[float]]:
    """Per round, each case's median iteration: a ratio is taken within a round (the same
    machine load for both cases) and reported as its spread over the rounds. Odd rounds run
    the cases in reverse order, so no case always runs first or after the same other case.
    With `cpu`, each case's CPU seconds in this process (all its threads) are added up there."""
    rounds_of: dict[str, list[float]] = {case.name: [] for case in cases}
    for round_ in range(rounds):
        for case in cases if round_ % 2 == 0 else cases[::-1]:
            before = _cpu_seconds()
            seconds = case.run()
            if cpu is not None:
                cpu[case.name] = cpu.get(case.name, 0.0) + _cpu_seconds() - before
            rounds_of[case.name].append(statistics.median(seconds[WARMUP:]))
    return rounds_of


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def print_times(rounds_of: dict[str, list[float]], width: int) -> None:
    count = len(next(iter(rounds_of.values())))
    print(f"median iteration time, {ITERATIONS - WARMUP} iterations x {count} rounds "
          f"({ranks()} gloo ranks, {os.cpu_count()} CPU cores):")
    for name, seconds in rounds_of.items():
        print(f"  {name:{width}} {statistics.median(seconds) * 1e3:8.1f} ms")


def print_ratio(rounds_of: dict[str, list[float]], label: str, slow: str, fast: str,
                width: int = 62) -> None:
    """slow / fast within each round: the median, with the least and the largest."""
    values = sorted(a / b for a, b in zip(rounds_of[slow], rounds_of[fast]))
    print(f"{label:{width}} {statistics.median(values):.2f}x  (min {values[0]:.2f}, max "
          f"{values[-1]:.2f} over {len(values)} rounds)")


def report(rounds_of: dict[str, list[float]]) -> None:
    median = {name: statistics.median(t) for name, t in rounds_of.items()}
    print_times(rounds_of, 34)

    def ratio(label: str, slow: str, fast: str) -> None:
        if slow in rounds_of and fast in rounds_of:
            print_ratio(rounds_of, label, slow, fast)

    print("ratios (> 1: the first named is faster):")
    ratio("non-blocking vs blocking, V-shape 1F1B", "pyplan 1F1B, blocking",
          "pyplan 1F1B (V-shape)")
    ratio("non-blocking vs blocking, GPT M-shape", "pyplan GPT M-shape, blocking",
          "pyplan GPT M-shape")
    ratio("pyplan vs torch Schedule1F1B (same model, split, micro-batches)",
          "torch Schedule1F1B", "pyplan 1F1B (V-shape)")
    ratio("pyplan vs torch ScheduleGPipe", "torch ScheduleGPipe", "pyplan GPipe order")
    ratio("pyplan vs torch ScheduleInterleaved1F1B", "torch ScheduleInterleaved1F1B",
          "pyplan interleaved (8 stages)")
    torch_gpt = [n for n in ("torch GPT Schedule1F1B", "torch GPT ScheduleGPipe") if n in median]
    if torch_gpt:
        best = min(torch_gpt, key=median.get)
        ratio(f"pyplan GPT M-shape vs best torch ({best.split()[-1]}, V-shape)", best,
              "pyplan GPT M-shape")
        ratio(f"pyplan GPT M-shape, hand-written blocks vs best torch ({best.split()[-1]})",
              best, "pyplan GPT M-shape, hand-written blocks")
    ratio("GPT M-shape: partition-written vs hand-written blocks",
          "pyplan GPT M-shape, hand-written blocks", "pyplan GPT M-shape")
    ratio("DP2xPP2: overlapped vs end-of-iteration gradient sync",
          "pyplan DP2xPP2, sync at the end", "pyplan DP2xPP2, overlapped sync")
    ratio("DP2xPP2: pyplan vs torch Schedule1F1B + DDP (same mesh)",
          "torch Schedule1F1B + DDP, DP2xPP2", "pyplan DP2xPP2, overlapped sync")


ITERATIONS = int(os.environ.get("PYPLAN_BENCH_ITERATIONS", "6"))
WARMUP = 1


def launch(script: str, description: str, prepare, worker, *, rank_counts=(4,),
           first=None) -> int:
    """The command line of a benchmark that prepares plans here, then runs `worker` under
    torchrun on 4 ranks, or another of `rank_counts` (this script again, with --worker);
    `first` runs here before, with the default count."""
    parser = argparse.ArgumentParser(description=description)
    if len(rank_counts) > 1:
        parser.add_argument("--ranks", type=int, choices=rank_counts, default=rank_counts[0],
                            help="how many ranks the cases run on")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=6,
                        help="iterations per case and round (the first is a warm-up)")
    parser.add_argument("--only", metavar="WORDS",
                        help="run only the cases whose names contain one of these "
                        "comma-separated words (a quick look; the full run is the figure)")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from pyplan.comm import leave

        worker(Path(args.worker), args.rounds)
        leave(0)  # a rank: no interpreter teardown (see leave)
    count = getattr(args, "ranks", rank_counts[0])
    if first is not None and count == rank_counts[0]:
        first()
    os.environ["PYPLAN_BENCH_RANKS"] = str(count)  # for prepare, and the workers
    with tempfile.TemporaryDirectory() as directory:
        prepare(Path(directory))
        env = dict(os.environ, PYPLAN_BENCH_ITERATIONS=str(args.iterations),
                   PYPLAN_BENCH_ONLY=args.only or "")
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", str(count), script, "--worker", directory,
                               "--rounds", str(args.rounds)], env=env).returncode


def split_backward(rounds: int = 5, repeats: int = 20) -> None:
    """B, W and a full backward of one stage of 8 equal linear layers (width 512, 256 rows),
    timed alike, for pyplan's split and for torch.distributed.pipelining's
    (stage_backward_input / stage_backward_weight); medians over rounds of `repeats` runs."""
    import torch
    from torch.distributed.pipelining._backward import (stage_backward_input,
                                                        stage_backward_weight)

    from pyplan.run.backward import backward_input, backward_weight

    torch.manual_seed(0)
    stage = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8)))
    params = list(stage.parameters())
    x, grad = torch.randn(256, 512), torch.randn(256, 512)

    def pyplan_split(out, leaf):
        work = backward_input([out], [grad], [leaf], params)[1]
        return lambda: backward_weight(work)

    def torch_split(out, leaf):
        groups = stage_backward_input([out], [grad], [leaf], iter(params))[1]
        return lambda: stage_backward_weight(iter(params), groups)

    def full(out, leaf):
        out.backward(grad)
        return lambda: None

    def timed(backward) -> tuple[float, float]:
        """Median seconds of `backward` (B, or the whole backward) and of what it leaves (W)."""
        first, second = [], []
        for _ in range(repeats):
            for p in params:
                p.grad = None
            leaf = x.clone().requires_grad_()
            out = stage(leaf)
            start = time.perf_counter()
            rest = backward(out, leaf)
            middle = time.perf_counter()
            rest()
            first.append(middle - start)
            second.append(time.perf_counter() - middle)
        return statistics.median(first), statistics.median(second)

    found = {name: [] for name in ("full", "pyplan", "torch")}
    for _ in range(rounds):
        for name, backward in (("full", full), ("pyplan", pyplan_split), ("torch", torch_split)):
            found[name].append(timed(backward))
    ms = {name: [statistics.median(v[i] for v in values) * 1e3 for i in (0, 1)]
          for name, values in found.items()}
    whole = ms["full"][0]
    print(f"zero-bubble split backward, one stage of 8 linear layers (512 wide, 256 rows), "
          f"median of {rounds} rounds: full backward {whole:.2f} ms")
    for name, label in (("pyplan", "pyplan"),
                        ("torch", "torch.distributed.pipelining's stage_backward_input/weight")):
        b, w = ms[name]
        print(f"  {label}: B {b:.2f} ms, W {w:.2f} ms; W/B {w / b:.2f}, (B + W) / full "
              f"{(b + w) / whole:.2f}")


def main() -> int:
    return launch(__file__, __doc__.splitlines()[0], prepare, worker, rank_counts=(4, 2),
                  first=split_backward)


if __name__ == "__main__":
    raise SystemExit(main())
