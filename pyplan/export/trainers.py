"""A plan's stages in the formats other trainers read, so that a partition found by pyplan can
drive them: Megatron-LM's `--pipeline-model-parallel-layout` string and torchtitan's
`[parallelism]` settings. Both need a plan whose model is one module cut into named
submodules (`model: {module, stages}`, as `pyplan partition` writes), each stage on one device.
Megatron-LM places stage s on rank s mod the pipeline size (loop); torchtitan also runs the V
(stage s and 2D-1-s on rank s: ZB-V, DualPipeV), and runs pyplan's own order from its
torch-csv export in torch's _PipelineScheduleRuntime."""

from __future__ import annotations

import json
import re

from pyplan.errors import PlanError
from pyplan.problem import Problem

__all__ = ["megatron_layout", "torchtitan_config"]

_EMBEDDING = re.compile(r"(^|\.)(embed\w*|wte|tok_embeddings|word_embeddings)$", re.IGNORECASE)
_OUTPUT = re.compile(r"(^|\.)(head|lm_head|output\w*|norm|final\w*|ln_f)$", re.IGNORECASE)


LOOP, V = "loop", "v"


def _placement(problem: Problem, allowed: tuple[str, ...], trainer: str) -> str:
    """How the plan places its stages on ranks (loop: stage s on s mod D; v: s and 2D-1-s on
    rank s); PlanError naming the first stage that fits none of `allowed`."""
    declared = [b for b in problem.blocks if b.is_forward]
    d = problem.num_devices
    shared = next((b for b in declared if len(b.devices) > 1), None)
    if shared is not None:
        model = problem.model
        vocab = model is not None and getattr(model, "vocab_parallel", None) is not None
        what = (" (sharded over the vocabulary, model.vocab_parallel)" if vocab else "")
        raise PlanError(f"block '{shared.name}' runs on devices {list(shared.devices)} at "
                        f"once{what}, but {trainer} gives each pipeline stage to one pipeline "
                        "rank: its tensor parallelism shards a stage within the ranks of that "
                        "stage, never across the pipeline's ranks as the M-shape does",
                        hint="export it as svg or chrome, or partition with --shape vshape or "
                             "interleaved for Megatron-LM or torchtitan",
                        file=problem.source_path or None)

    def rank(style: str, s: int) -> int:
        return s % d if style == LOOP else (s % (2 * d) if s % (2 * d) < d
                                            else 2 * d - 1 - s % (2 * d))
    for style in allowed:
        if all(b.devices == (rank(style, s),) for s, b in enumerate(declared)):
            return style
    style = allowed[0]
    s, block = next((s, b) for s, b in enumerate(declared) if b.devices != (rank(style, s),))
    where = " or ".join({LOOP: "s mod the pipeline size", V: "s and 2D-1-s on rank s (V)"}[a]
                        for a in allowed)
    raise PlanError(f"stage {s} ('{block.name}') runs on devices {list(block.devices)}, but "
                    f"{trainer} places stage s on rank {where}",
                    hint="partition with --shape vshape or interleaved",
                    file=problem.source_path or None)


def _stages(problem: Problem) -> list[tuple[str, ...]]:
    """Each stage's submodule names, in forward order; PlanError when the plan cannot say."""
    model = problem.model
    if model is None or model.module is None:
        raise PlanError("this export needs a model given as one module cut into submodules "
                        "(model: {module, stages}), as pyplan partition writes",
                        hint="partition the model with pyplan partition",
                        file=problem.source_path or None)
    stages = dict(model.stages)
    declared = [b for b in problem.blocks if b.is_forward]
    for block in declared:
        if not stages.get(block.name):
            raise PlanError(f"model.stages lists no submodules for block '{block.name}'",
                            hint="give every declared block its submodules",
                            file=problem.source_path or None)
    return [stages[b.name] for b in declared]


def megatron_layout(problem: Problem) -> str:
    """`--pipeline-model-parallel-layout`: stages split by |, E for an embedding unit, L for the
    output units at the end (head, final norm: Megatron's loss stage), t for every other unit
    (a decoder layer), repeats written x*N."""
    stages = _stages(problem)
    _placement(problem, (LOOP,), "Megatron-LM")
    last = [u for s in stages for u in s]
    tail = len(last)
    while tail > 0 and _OUTPUT.search(last[tail - 1]):
        tail -= 1
    parts, k = [], 0
    for units in stages:
        symbols = []
        for unit in units:
            symbols.append("E" if _EMBEDDING.search(unit) else "L" if k >= tail else "t")
            k += 1
        if symbols.count("L") > 1:  # the output units are one L
            symbols = [x for x in symbols if x != "L"] + ["L"]
        parts.append(_runs(symbols))
    return "|".join(parts) + "\n"


def _runs(symbols: list[str]) -> str:
    out, i = [], 0
    while i < len(symbols):
        j = i
        while j < len(symbols) and symbols[j] == symbols[i]:
            j += 1
        out.append(symbols[i] if j - i == 1 else f"{symbols[i]}*{j - i}")
        i = j
    return ",".join(out)


def torchtitan_config(problem: Problem) -> str:
    """torchtitan's `[parallelism]` TOML: the pipeline degree, the split points (the first
    submodule of every stage but the first), a torch schedule of the plan's placement (it
    tells torchtitan which stages each rank builds: loop or V) and the CSV of pyplan's own order,
    which torchtitan then runs in torch's _PipelineScheduleRuntime instead of the named one."""
    if not problem.training:
        raise PlanError(f"{problem.name} is an inference plan, and torchtitan's pipeline "
                        "settings are for training", hint="export megatron-layout, svg or "
                        "chrome instead", file=problem.source_path or None)
    stages = _stages(problem)
    split = any(b.kind == "weight" for b in problem.blocks)
    style = _placement(problem, (LOOP, V) if len(stages) == 2 * problem.num_devices
                       else (LOOP,), "torchtitan")
    if style == V:
        schedule = "ZBVZeroBubble" if split else "DualPipeV"
    elif len(stages) > problem.num_devices:
        schedule = "InterleavedZeroBubble" if split else "Interleaved1F1B"
    else:
        schedule = "1F1B"
        if split:
            raise PlanError("a split backward with one stage per rank has no torchtitan "
                            "schedule (its zero-bubble schedules run several stages per rank)",
                            hint="partition with --shape interleaved",
                            file=problem.source_path or None)
    csv = f"{problem.name}.csv"
    return "\n".join([
        f"# {problem.name}: {len(stages)} stages on {problem.num_devices} pipeline ranks "
        "(written by pyplan export --format torchtitan).",
        f"# The schedule pyplan found: pyplan export PLAN --format torch-csv -o {csv}",
        "# (drop pipeline_parallel_schedule_csv to run the named schedule instead).",
        "[parallelism]",
        f"pipeline_parallel_degree = {problem.num_devices}",
        "pipeline_parallel_split_points = ["
        + ", ".join(json.dumps(units[0]) for units in stages[1:]) + "]",
        f"pipeline_parallel_schedule = \"{schedule}\"",
        f"pipeline_parallel_schedule_csv = \"{csv}\"",
    ]) + "\n"
