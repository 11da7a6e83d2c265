"""`pyplan partition` measured side by side, on 4 CPU gloo ranks, 8 micro-batches:

  1. on the test model with unequal units (tests/models/unequal.py: heavy embedding and head,
     layers of two widths), a 24-layer GPT (pyplan.examples.gpt_chain) and two Hugging Face
     models as they come (benchmarks/hf_models.py: GPT-2 with tied embeddings and Llama, 8
     layers, cut in their own forward), 4 stages: the partition `pyplan partition` picks vs an
     even split of the layers (Megatron-LM's default: layers evenly over the stages, the
     embedding on the first, the head on the last), both solved by pyplan: predicted makespan
     (from the measured unit costs) and measured iteration time; and, for the first two,
     pyplan's run of its partition vs the best of torch.distributed.pipelining's Schedule1F1B
     and ScheduleGPipe on the same split (measured);
  2. placements of one model, a GPT with a large vocabulary (pyplan.examples.gpt's model()
     with a vocabulary of 32768, width 64 and 8 layers), each partitioned and solved from the
     same measured costs:
     the M-shape (`--shape mshape`: embedding and head sharded over the vocabulary on all four
     ranks, the loss fused; their all-reduces measured among 4 local processes, as pyplan
     partition does) vs the V-shape and interleaved (2 chunks), as `--shape auto` ranks them
     (predicted: with the 4 ranks sharing fewer cores, as here, at least the iteration's
     compute divided by the cores) and as `pyplan run` runs them (measured).

    python benchmarks/partition.py [--rounds 5] [--iterations 6]

Each round runs every case in the same processes; a ratio is taken within a round and printed
as its median with the minimum and maximum over the rounds. The units are measured with one
thread, as each torchrun worker runs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "models"))

from runtime import (TorchModelCase, print_ratio, print_times,  # noqa: E402 - on sys.path
                     run_rounds)

MODELS = {  # name -> (module with batch/loss, its factory, its folder for the plans'
    #   model.path, whether torch's schedules run the same split: a chain of modules)
    "unequal": ("unequal", "model", ROOT / "tests" / "models", True),
    "gpt24": ("pyplan.examples.gpt_chain", "model", None, True),
    "hf-gpt2": ("hf_models", "gpt2", ROOT / "benchmarks", False),
    "hf-llama": ("hf_models", "llama", ROOT / "benchmarks", False),
}
DEVICES, MICRO_BATCHES = 4, 8
VOCAB_MODEL = "pyplan.examples.gpt"  # its whole model, gpt.model(), enlarged:
VOCAB_SIZES = dict(VOCAB=32768, DIM=64, HEADS=4, SEQUENCE=16, BATCH=16, LAYERS=8)
PLACEMENTS = ("mshape", "vshape", "interleaved-2")


def _enlarge() -> None:
    module = __import__(VOCAB_MODEL, fromlist=["model"])
    for key, value in VOCAB_SIZES.items():
        setattr(module, key, value)


def _even(units, stages: int):
    """Megatron's default split: the layers evenly, the embedding first, the head last (one of
    the even splits pyplan partition also solves)."""
    from pyplan.partition import Partition

    layers = len(units) - 2
    bounds = [0] + [1 + round(layers * s / stages) for s in range(1, stages)] + [len(units)]
    return Partition(tuple(bounds), 0.0, ())


def _placements(directory: Path) -> dict[str, float]:
    """The large-vocabulary GPT measured once and placed as PLACEMENTS (what `pyplan partition
    --shape auto` does): each best plan written and solved; returns the predicted makespans."""
    import torch

    from pyplan.models import FORWARD, find_units
    from pyplan.models.forward import logits, whole_forward
    from pyplan.models.vocab import find
    from pyplan.measure.placements import Sharded, placements
    from pyplan.problem import build_problem
    from pyplan.resolved import write_resolved
    from pyplan.run.binding import Model, make_batch, seed_everything
    from pyplan.run.data import split_batch
    from pyplan.measure.profile import profile_units
    from pyplan.measure.sharded import profile_sharded
    from pyplan.solver import solve
    from pyplan.planfile import spec_from_text

    _enlarge()
    module = __import__(VOCAB_MODEL, fromlist=["model"])
    seed_everything(0, "module")
    model = module.model()
    inputs, targets = make_batch(Model(None, module.batch, module.loss), 0, 0,
                                 torch.device("cpu"))
    inputs = split_batch(inputs, MICRO_BATCHES)[0]
    targets = split_batch(targets, MICRO_BATCHES)[0]
    costs, cut = profile_units(model, inputs, targets, module.loss)
    _, units = find_units(model, inputs)
    with torch.no_grad():
        out = logits(whole_forward(model, inputs) if cut.kind == FORWARD else model(inputs))
    vocab = find(model, inputs, units[0].modules, units[-1].modules, out)
    ends = profile_sharded(model, inputs, targets, module.loss, cut=cut, units=units,
                           costs=costs, vocab=vocab, devices=DEVICES, measure=True)
    tried = placements(costs, devices=DEVICES, shapes=PLACEMENTS,
                       sharded=Sharded(ends.first, ends.last, (vocab.embedding, vocab.head)),
                       name="placement", factory=f"{VOCAB_MODEL}:model",
                       data=f"{VOCAB_MODEL}:batch", loss=f"{VOCAB_MODEL}:loss",
                       micro_batches=MICRO_BATCHES, cut=cut.kind, cores=_cores())
    predicted = {}
    for p in tried:
        plan = directory / f"placement-{p.shape}.yaml"
        plan.write_text(p.best.text)
        write_resolved(solve(build_problem(spec_from_text(p.best.text, str(plan)))),
                       directory / f"placement-{p.shape}.resolved.yaml")
        predicted[p.shape] = p.expected_ms
    shared = f"; at least compute / {tried[0].cores} cores" if tried[0].cores else ""
    print(f"placements of the large-vocabulary GPT, predicted (makespan{shared}): " + ", ".join(
        f"{p.label} {p.best.makespan_ms:.2f} ms" +
        (f" ({p.busy_ms / p.cores:.2f} ms)" if p.cores else "") for p in tried), flush=True)
    return predicted


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1


def prepare(directory: Path) -> dict:
    """Profile each model, write pyplan's partition and the even split as solved plans; returns
    the predicted makespans and each plan's stages."""
    import torch

    from pyplan.api import partition_plans
    from pyplan.models import Unit, everywhere
    from pyplan.partition import plan_text
    from pyplan.problem import build_problem
    from pyplan.resolved import write_resolved
    from pyplan.run.binding import Model, make_batch, seed_everything
    from pyplan.run.data import split_batch
    from pyplan.measure.profile import profile_units
    from pyplan.solver import solve
    from pyplan.planfile import spec_from_text

    torch.set_num_threads(1)  # as each torchrun worker (OMP_NUM_THREADS=1)
    info = {"placements": _placements(directory)}
    for name, (module_name, factory, folder, _) in MODELS.items():
        module = __import__(module_name, fromlist=["batch"])
        seed_everything(0, "module")
        model = getattr(module, factory)()
        inputs, targets = make_batch(Model(None, module.batch, module.loss), 0, 0,
                                     torch.device("cpu"))
        inputs = split_batch(inputs, MICRO_BATCHES)[0]
        targets = split_batch(targets, MICRO_BATCHES)[0]
        units, cut = profile_units(model, inputs, targets, module.loss)
        shared = everywhere(model, [Unit(u.name, u.module_names) for u in units]) \
            if cut.kind == "forward" else ()
        path = None if folder is None else os.path.relpath(folder, directory)
        kwargs = dict(factory=f"{module_name}:{factory}", data=f"{module_name}:batch",
                      loss=f"{module_name}:loss", path=path, cut=cut.kind,
                      layer_returns=cut.layer_returns, everywhere=shared)
        best = partition_plans(units, devices=DEVICES, name=f"{name}-pyplan",
                               micro_batches=MICRO_BATCHES, **kwargs)[0]
        unit_ms = best.makespan_ms / best.solution.schedule.makespan
        even_text = plan_text(units, _even(units, DEVICES), name=f"{name}-even",
                              devices=DEVICES, micro_batches=MICRO_BATCHES, capacity=None,
                              time_unit_ms=unit_ms, shape="vshape, even layers", **kwargs)
        even = solve(build_problem(spec_from_text(even_text)))
        for label, text in (("pyplan", best.text), ("even", even_text)):
            plan = directory / f"{name}-{label}.yaml"
            plan.write_text(text)
            write_resolved(solve(build_problem(spec_from_text(text, str(plan)))),
                           directory / f"{name}-{label}.resolved.yaml")
        stages = [[units[i].name for i in best.partition.stage(s)] for s in range(DEVICES)]
        info[name] = {"predicted_pyplan": best.makespan_ms,
                      "predicted_even": even.schedule.makespan * unit_ms,
                      "module": module_name, "stages": stages,
                      "torch": MODELS[name][3]}
    (directory / "info.json").write_text(json.dumps(info))
    return info


# ---------------------------------------------------------------- workers (under torchrun)

def worker(directory: Path, rounds: int) -> None:
    import pyplan.runtime  # noqa: F401 - quiet torch import
    import torch.distributed as dist
    from runtime import PyplanCase

    _enlarge()
    dist.init_process_group("gloo")
    info = json.loads((directory / "info.json").read_text())
    cases = [PyplanCase(f"placements: pyplan run, {shape}",
                        directory / f"placement-{shape}.resolved.yaml", blocking=False)
             for shape in info["placements"]]
    for name, item in info.items():
        if name == "placements":
            continue
        for label in ("pyplan", "even"):
            cases.append(PyplanCase(f"{name}: pyplan run, {label} split",
                                    directory / f"{name}-{label}.resolved.yaml", blocking=False))
        for schedule in ("Schedule1F1B", "ScheduleGPipe") if item["torch"] else ():
            cases.append(TorchModelCase(f"{name}: torch {schedule}, pyplan split", schedule,
                                        item["module"], item["stages"], MICRO_BATCHES))
    rounds_of = run_rounds(cases, rounds)
    if dist.get_rank() == 0:
        report(info, rounds_of)
    dist.destroy_process_group()


def report(info: dict, rounds_of: dict[str, list[float]]) -> None:
    print_times(rounds_of, 42)

    def ratio(label: str, slow: str, fast: str) -> None:
        print_ratio(rounds_of, f"  {label}", slow, fast, width=60)

    print("ratios (> 1: the first named is faster):")
    placed = info["placements"]
    for other in [s for s in placed if s != "mshape"]:
        print(f"  {'placements: M-shape vs ' + other + ', predicted':58} "
              f"{placed[other] / placed['mshape']:.2f}x  ({placed[other]:.2f} vs "
              f"{placed['mshape']:.2f} ms)")
        ratio(f"placements: M-shape vs {other}, measured",
              f"placements: pyplan run, {other}", "placements: pyplan run, mshape")
    for name, item in info.items():
        if name == "placements":
            continue
        print(f"  {name + ': pyplan partition vs even split, predicted':58} "
              f"{item['predicted_even'] / item['predicted_pyplan']:.2f}x  "
              f"({item['predicted_even']:.2f} vs {item['predicted_pyplan']:.2f} ms)")
        ratio(f"{name}: pyplan partition vs even split, measured",
              f"{name}: pyplan run, even split", f"{name}: pyplan run, pyplan split")
        if item["torch"]:
            best = min((f"{name}: torch {s}, pyplan split" for s in ("Schedule1F1B",
                                                                     "ScheduleGPipe")),
                       key=lambda k: statistics.median(rounds_of[k]))
            ratio(f"{name}: pyplan vs best torch ({best.split()[2].rstrip(',')}), same split",
                  best, f"{name}: pyplan run, pyplan split")
        print(f"  {name}: pyplan's stages: " + " | ".join(",".join(s) for s in item["stages"]))


def main() -> int:
    from runtime import launch

    return launch(__file__, __doc__.splitlines()[0], prepare, worker)


if __name__ == "__main__":
    raise SystemExit(main())
