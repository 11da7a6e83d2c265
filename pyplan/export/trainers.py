"""A plan's stages in the formats other trainers read, so that a partition found by pyplan can
drive them: Megatron-LM's `--pipeline-model-parallel-layout` string and torchtitan's
`[parallelism]` settings. Both need a plan whose model is one module cut into named
submodules (`model: {module, stages}`, as `pyplan partition` writes), each stage on one device.
Megatron-LM places stage s on rank s mod the pipeline size (loop); torchtitan also runs the V
(stage s and 2D-1-s on rank s: ZB-V, DualPipeV), and runs pyplan's own order from its
torch-csv export in torch's _PipelineScheduleRuntime. torchtitan is configured in Python
(functions returning a Trainer.Config), its pipeline by `parallelism.module_fqns_per_model_part`
(the split points of older versions are gone): the export is a module with a function that
sets them."""

from __future__ import annotations

import json
import re
import textwrap

from pyplan.errors import PlanError
from pyplan.problem import Problem
from pyplan.planfile.source import error_at

__all__ = ["megatron_layout", "torchtitan_config", "torchtitan_fqns"]

_EMBEDDING = re.compile(r"(^|\.)(embed\w*|wte|tok_embeddings|word_embeddings)$", re.IGNORECASE)
_OUTPUT = re.compile(r"(^|\.)(head|lm_head|output\w*|norm|final\w*|ln_f)$", re.IGNORECASE)


LOOP, V = "loop", "v"


def _at(problem: Problem, keys: tuple, message: str, hint: str) -> PlanError:
    """A PlanError at `keys` of the plan (or resolved plan) the problem was read from."""
    return error_at(problem.source_path or None, keys, message, hint)


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
        raise _at(problem, ("blocks", shared.index),
                  f"block '{shared.name}' runs on devices {list(shared.devices)} at "
                  f"once{what}, but {trainer} gives each pipeline stage to one pipeline "
                  "rank: its tensor parallelism shards a stage within the ranks of that "
                  "stage, never across the pipeline's ranks as the M-shape does",
                  "export it as svg or chrome, or partition with --shape vshape or "
                  "interleaved for Megatron-LM or torchtitan")

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
    raise _at(problem, ("blocks", block.index),
              f"stage {s} ('{block.name}') runs on devices {list(block.devices)}, but "
              f"{trainer} places stage s on rank {where}",
              "partition with --shape vshape or interleaved")


def _stages(problem: Problem) -> list[tuple[str, ...]]:
    """Each stage's submodule names, in forward order; PlanError when the plan cannot say."""
    model = problem.model
    if model is None or model.module is None:
        raise _at(problem, ("model",), "this export needs a model given as one module cut "
                  "into submodules (model: {module, stages}), as pyplan partition writes",
                  "partition the model with pyplan partition")
    stages = dict(model.stages)
    declared = [b for b in problem.blocks if b.is_forward]
    for block in declared:
        if not stages.get(block.name):
            raise _at(problem, ("model", "stages"), f"model.stages lists no submodules for "
                      f"block '{block.name}'", "give every declared block its submodules")
    return [stages[b.name] for b in declared]


def megatron_layout(problem: Problem) -> str:
    """`--pipeline-model-parallel-layout`: stages split by |, E for an embedding unit, L for the
    output units at the end (head, final norm: Megatron's loss stage), t for every other unit
    (a decoder layer), repeats written x*N."""
    stages = _stages(problem)
    _placement(problem, (LOOP,), "Megatron-LM")
    kinds = iter(_unit_kinds([u for s in stages for u in s]))
    parts = []
    for units in stages:
        symbols = [next(kinds) for _ in units]
        for one in ("E", "L"):  # the embedding units are one E, the output units one L
            if symbols.count(one) > 1:
                at = symbols.index(one)
                symbols = [x for x in symbols if x != one]
                symbols.insert(at if one == "E" else len(symbols), one)
        parts.append(_runs(symbols))
    return "|".join(parts) + "\n"


def _unit_kinds(units: list[str]) -> list[str]:
    """E, t or L for each unit of the model, in order. The decoder layers are the longest run
    of units named PREFIX.N with one prefix (transformer.h.0 ..); what comes before them is
    the embedding (GPT-2's wte and wpe: one E), what comes after them the output (final norm,
    head: one L). Without such layers, by name: embeddings, and the output units at the end."""
    numbered: dict[str, list[int]] = {}
    for i, unit in enumerate(units):
        head, _, tail = unit.rpartition(".")
        if head and tail.isdigit():
            numbered.setdefault(head, []).append(i)
    if numbered:
        layers = max(numbered.values(), key=len)
        first, last = layers[0], layers[-1]
        return ["E" if i < first else "L" if i > last else "t" for i in range(len(units))]
    tail = len(units)
    while tail > 0 and _OUTPUT.search(units[tail - 1]):
        tail -= 1
    return ["E" if _EMBEDDING.search(unit) else "L" if i >= tail else "t"
            for i, unit in enumerate(units)]


def _runs(symbols: list[str]) -> str:
    out, i = [], 0
    while i < len(symbols):
        j = i
        while j < len(symbols) and symbols[j] == symbols[i]:
            j += 1
        out.append(symbols[i] if j - i == 1 else f"{symbols[i]}*{j - i}")
        i = j
    return ",".join(out)


# Hugging Face names of the Llama family (Llama, Mistral, Qwen, ...) -> torchtitan's, which its
# own decoders (Llama 3, Qwen 3) and its transformers backend share.
_TORCHTITAN_NAMES = ((re.compile(r"model\.embed_tokens"), "tok_embeddings"),
                     (re.compile(r"model\.layers\.(\d+)"), r"layers.\1"),
                     (re.compile(r"model\.norm"), "norm"),
                     (re.compile(r"model\.rotary_emb"), "rotary_emb"),
                     (re.compile(r"lm_head"), "lm_head"))
_TORCHTITAN_OWN = re.compile(r"tok_embeddings|layers\.\d+|norm|output|lm_head|rotary_emb")


def torchtitan_fqns(stages: list[tuple[str, ...]]) -> tuple[list[list[str]], str]:
    """torchtitan's module FQNs per model part, and the note that says whose names they are:
    torchtitan's own when the units are (its Llama's), mapped from Hugging Face Llama-family
    names when every unit has such a name, else the model's own."""
    units = [u for part in stages for u in part]
    if all(_TORCHTITAN_OWN.fullmatch(u) for u in units):
        return [list(part) for part in stages], "torchtitan's own module names"
    mapped = []
    for part in stages:
        names = []
        for unit in part:
            name = next((pattern.sub(to, unit) for pattern, to in _TORCHTITAN_NAMES
                         if pattern.fullmatch(unit)), None)
            if name is None:
                return [list(p) for p in stages], (
                    "the model's own module names: torchtitan looks each FQN up in the model "
                    "it builds, so they fit a model with these submodules; its own decoders "
                    "name them tok_embeddings, layers.N, norm, lm_head")
            names.append(name)
        mapped.append(names)
    return mapped, ("Hugging Face Llama-family names mapped to torchtitan's (model.embed_tokens "
                    "-> tok_embeddings, model.layers.N -> layers.N, model.norm -> norm, lm_head)")


def torchtitan_config(problem: Problem) -> str:
    """A Python module for current torchtitan, whose runs are configured by functions returning
    a Trainer.Config: `pipeline(config)` sets the pipeline degree, the module FQNs of each
    model part (`parallelism.module_fqns_per_model_part`), a torch schedule of the plan's
    placement (it tells torchtitan which stages each rank builds: loop or V), the micro-batch
    count and the CSV of pyplan's own order, which torchtitan then runs in torch's
    _PipelineScheduleRuntime instead of the named one."""
    if not problem.training:
        raise _at(problem, ("task",), f"{problem.name} is an inference plan, and "
                  "torchtitan's pipeline settings are for training",
                  "export megatron-layout, svg or chrome instead")
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
    fqns, whose = torchtitan_fqns(stages)
    csv = f"{problem.name}.csv"
    parts = "".join(f"    {json.dumps(part)},\n" for part in fqns)
    module = _module_name(problem.name)
    about = textwrap.fill(
        f"{problem.name}: {len(stages)} stages on {problem.num_devices} pipeline ranks, for "
        "torchtitan (written by pyplan export --format torchtitan). torchtitan configures a "
        "run with a function returning its Trainer.Config; give yours this plan's pipeline:",
        width=96)
    after = textwrap.fill(
        f"and run it with --module <your module> --config llama3_8b_pyplan. The module FQNs "
        f"are {whose}. The schedule pyplan found: pyplan export PLAN --format torch-csv -o "
        f"{csv} (set pipeline_parallel_schedule_csv to \"\" to run the named schedule "
        "instead).", width=96)
    return f'''"""{about}

    from {module} import pipeline   # this file, saved as {module}.py
    from torchtitan.models.llama3.config_registry import llama3_8b

    def llama3_8b_pyplan():
        return pipeline(llama3_8b())

{after}
"""

MODULE_FQNS_PER_MODEL_PART = [
{parts}]


def pipeline(config):
    """Set this plan's pipeline on a torchtitan Trainer.Config (its `parallelism`)."""
    parallelism = config.parallelism
    parallelism.pipeline_parallel_degree = {problem.num_devices}
    parallelism.module_fqns_per_model_part = MODULE_FQNS_PER_MODEL_PART
    parallelism.pipeline_parallel_schedule = "{schedule}"
    parallelism.pipeline_parallel_schedule_csv = "{csv}"
    parallelism.num_pp_microbatches = {problem.num_micro_batches}
    return config
'''


def _module_name(name: str) -> str:
    """A Python module name for a plan's name (the file the export is saved as)."""
    return re.sub(r"\W", "_", name) if re.sub(r"\W", "_", name)[:1].isalpha() else \
        "plan_" + re.sub(r"\W", "_", name)
