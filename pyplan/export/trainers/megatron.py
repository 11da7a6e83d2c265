"""Megatron-LM's settings for a layout: the `--pipeline-model-parallel-layout` string
(megatron-core 0.16.1's PipelineParallelLayerLayout reads it) and the arguments of
`pretrain_gpt.py` (Megatron-LM core_v0.16.1). Megatron-LM runs its own 1F1B, interleaved when
a pipeline rank holds several stages: other schedules, and a V, are refused."""

from __future__ import annotations

import re
import shlex
import textwrap

from pyplan.export.trainers.layout import (MEGATRON_CORE, MEGATRON_LM, V, LayoutError,
                                           TrainerLayout, layout_of, relocate,
                                           require_training)
from pyplan.problem import Problem

__all__ = ["megatron_argv", "megatron_arguments", "megatron_layout"]

_EMBEDDING = re.compile(r"(^|\.)(embed\w*|wte|tok_embeddings|word_embeddings)$", re.IGNORECASE)
_OUTPUT = re.compile(r"(^|\.)(head|lm_head|output\w*|norm|final\w*|ln_f)$", re.IGNORECASE)


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


def _megatron_stages(layout: TrainerLayout) -> list[list[str]]:
    """Each stage's layers as Megatron's layout letters: E the embedding, t a decoder layer,
    L the output (final norm, head: its loss stage)."""
    if layout.stage_layers is not None:
        last = len(layout.stage_layers) - 1
        return [["E"] * (s == 0) + ["t"] * n + ["L"] * (s == last)
                for s, n in enumerate(layout.stage_layers)]
    kinds = iter(_unit_kinds([u for s in layout.stage_modules for u in s]))
    stages = []
    for units in layout.stage_modules:
        symbols = [next(kinds) for _ in units]
        for one in ("E", "L"):  # the embedding units are one E, the output units one L
            if symbols.count(one) > 1:
                at = symbols.index(one)
                symbols = [x for x in symbols if x != one]
                symbols.insert(at if one == "E" else len(symbols), one)
        stages.append(symbols)
    flat = [x for s in stages for x in s]
    if flat.count("E") != 1 or flat[0] != "E" or flat.count("L") != 1 or flat[-1] != "L" \
            or "t" not in flat:
        raise LayoutError("stage_modules", "Megatron-LM's layout is the embedding (E), the "
                          "decoder layers (t), the output (L), but these modules read "
                          f"{_megatron_text(stages)} (the decoder layers: the longest run of "
                          "NAME.N; E: the modules before them; L: those after)",
                          "cut a model with an embedding, decoder layers and a head")
    return stages


def _megatron_text(stages: list[list[str]]) -> str:
    return "|".join(_runs(s) for s in stages)


def _megatron_check(layout: TrainerLayout) -> None:
    if layout.schedule not in ("1f1b", "interleaved-1f1b", "search"):
        raise LayoutError("schedule", f"Megatron-LM {MEGATRON_LM} has no {layout.schedule} "
                          "schedule: it runs 1F1B, interleaved when a pipeline rank holds "
                          "several stages", "use 1f1b or interleaved-1f1b, or torchtitan")
    if layout.placement == V:
        raise LayoutError("placement", "Megatron-LM places stage s on pipeline rank s mod "
                          "pp, never in a V", "use a loop placement, or torchtitan")
    if layout.vpp > 1 and layout.pp == 1:
        raise LayoutError("pp", "Megatron-LM interleaves stages only over 2 or more "
                          "pipeline ranks", "give pp > 1 or vpp=1")
    if layout.vpp > 1 and layout.micro_batches % layout.pp:
        raise LayoutError("micro_batches", f"Megatron-LM's interleaved schedule runs the "
                          f"micro-batches in groups of pp ({layout.pp}), and "
                          f"{layout.micro_batches} is not a multiple of {layout.pp}",
                          f"choose a multiple of {layout.pp} micro-batches")


def megatron_layout(layout: TrainerLayout | Problem) -> str:
    """Megatron-LM's `--pipeline-model-parallel-layout` (megatron-core 0.16.1's
    PipelineParallelLayerLayout): stages split by |, stage s on pipeline rank s mod pp, E the
    embedding, t a decoder layer, L the output; repeats written x*N."""
    layout, problem = layout_of(layout, "megatron")
    try:
        if layout.placement == V:
            raise LayoutError("placement", "Megatron-LM places stage s on pipeline rank s "
                              "mod pp, never in a V", "use a loop placement, or torchtitan")
        return _megatron_text(_megatron_stages(layout)) + "\n"
    except LayoutError as exc:
        raise exc if problem is None else relocate(problem, exc) from None


def megatron_argv(layout: TrainerLayout | Problem, template: str | None = None) -> list[str]:
    """pretrain_gpt.py's arguments for the layout (Megatron-LM core_v0.16.1); a plan's with the
    schedule `template` (else Megatron-LM's own on its layout)."""
    require_training(layout, "Megatron-LM's pretrain_gpt.py trains")
    layout, problem = layout_of(layout, "megatron", template)
    try:
        _megatron_check(layout)
        stages = _megatron_stages(layout)
    except LayoutError as exc:
        raise exc if problem is None else relocate(problem, exc) from None
    argv = ["--tensor-model-parallel-size", str(layout.tp),
            "--pipeline-model-parallel-size", str(layout.pp),
            "--num-layers", str(sum(s.count("t") for s in stages))]
    if layout.cp > 1:
        argv += ["--context-parallel-size", str(layout.cp)]
    if layout.ep > 1:
        argv += ["--expert-model-parallel-size", str(layout.ep)]
    if layout.stages > 1:
        argv += ["--pipeline-model-parallel-layout", _megatron_text(stages)]
    argv += ["--micro-batch-size", str(layout.micro_batch_size),
             "--global-batch-size", str(layout.global_batch)]
    if layout.sequence_length:
        argv += ["--seq-length", str(layout.sequence_length)]
    if layout.sequence_parallel:
        argv += ["--sequence-parallel"]
    if layout.recompute == "selective":
        argv += ["--recompute-granularity", "selective"]
    elif layout.recompute == "block":  # each chunk's first N layers
        argv += ["--recompute-granularity", "full", "--recompute-method", "block",
                 "--recompute-num-layers", str(layout.recompute_layers)]
    elif layout.recompute == "full":  # every layer recomputed, one at a time
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    if layout.distributed_optimizer:
        argv += ["--use-distributed-optimizer"]
        if layout.dp_replicate > 1:  # sharded within each group of dp_shard ranks
            argv += ["--num-distributed-optimizer-instances", str(layout.dp_replicate)]
    if "grad-reduce" in layout.overlaps:
        argv += ["--overlap-grad-reduce"]
    if "param-gather" in layout.overlaps and layout.distributed_optimizer:
        argv += ["--overlap-param-gather"]  # (it gathers the distributed optimizer's shards)
    if "tp-comm" in layout.overlaps and layout.sequence_parallel:
        argv += ["--tp-comm-overlap"]  # (Transformer Engine's userbuffers need it)
    return argv


def megatron_arguments(layout: TrainerLayout | Problem, template: str | None = None) -> str:
    """The argument line for Megatron-LM's pretrain_gpt.py (core_v0.16.1), shell-quoted, after
    a header of comments saying what it lays out and how to use it."""
    argv = megatron_argv(layout, template)
    layout, _ = layout_of(layout, "megatron", template)
    order = "Megatron-LM's " + ("interleaved 1F1B" if layout.vpp > 1 else "1F1B")
    if layout.schedule == "search":
        order += " (pyplan's own order is not one Megatron-LM runs; torchtitan runs it)"
    about = [f"{layout.name} for Megatron-LM {MEGATRON_LM} (megatron-core {MEGATRON_CORE}): "
             "pretrain_gpt.py arguments, written by pyplan export --format megatron-args.",
             f"{layout.describe('its distributed optimizer')}. Schedule: {order}.",
             f"Launch it on {layout.gpus} GPUs (Megatron-LM takes data parallel = GPUs / "
             f"(tp x {'cp x ' if layout.cp > 1 else ''}pp) = {layout.dp}) with your model, "
             "data and optimizer arguments after "
             "these: paste the line into your command or into an argument array such as "
             "MODEL_PARALLEL_ARGS=( ... ) in Megatron-LM's example scripts."]
    header = "".join(textwrap.fill(p, width=96, initial_indent="# ",
                                   subsequent_indent="#   ") + "\n" for p in about)
    return header + shlex.join(argv) + "\n"
