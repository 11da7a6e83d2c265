"""A plan's stages in the formats other trainers read, so that a partition found by pyplan can
drive them: Megatron-LM's `--pipeline-model-parallel-layout` string and torchtitan's
`[parallelism]` settings. Both need a plan whose model is one module cut into named
submodules (`model: {module, stages}`, as `pyplan partition` writes) with stage s on device
s mod devices (V-shape or interleaved: the placements those trainers have)."""

from __future__ import annotations

import json
import re

from pyplan.errors import PlanError
from pyplan.problem import Problem

__all__ = ["megatron_layout", "torchtitan_config"]

_EMBEDDING = re.compile(r"(^|\.)(embed\w*|wte|tok_embeddings|word_embeddings)$", re.IGNORECASE)
_OUTPUT = re.compile(r"(^|\.)(head|lm_head|output\w*|norm|final\w*|ln_f)$", re.IGNORECASE)


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
    for s, block in enumerate(declared):
        if block.devices != (s % problem.num_devices,):
            raise PlanError(f"stage {s} ('{block.name}') runs on devices {list(block.devices)}, "
                            f"not on device {s % problem.num_devices}: Megatron-LM and "
                            "torchtitan place stage s on rank s mod the pipeline size",
                            file=problem.source_path or None)
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
    submodule of every stage but the first) and the matching torch schedule."""
    if not problem.training:
        raise PlanError(f"{problem.name} is an inference plan, and torchtitan's pipeline "
                        "settings are for training", hint="export megatron-layout, svg or "
                        "chrome instead", file=problem.source_path or None)
    stages = _stages(problem)
    looped = len(stages) > problem.num_devices
    return "\n".join([
        f"# {problem.name}: {len(stages)} stages on {problem.num_devices} pipeline ranks "
        "(written by pyplan export --format torchtitan).",
        "# To run pyplan's own schedule instead of the named one: pyplan export PLAN "
        "--format torch-csv -o schedule.csv",
        "# and set pipeline_parallel_schedule_csv = \"schedule.csv\".",
        "[parallelism]",
        f"pipeline_parallel_degree = {problem.num_devices}",
        "pipeline_parallel_split_points = ["
        + ", ".join(json.dumps(units[0]) for units in stages[1:]) + "]",
        f"pipeline_parallel_schedule = \"{'Interleaved1F1B' if looped else '1F1B'}\"",
    ]) + "\n"
