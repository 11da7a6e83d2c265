"""torchtitan's settings for a layout: a Python module for torchtitan 0.3.0, whose runs are
configured by functions returning a Trainer.Config; its `pipeline(config)` sets the layout.
torchtitan runs torch.distributed.pipelining's schedules, and pyplan's own order from its torch
CSV in torch's _PipelineScheduleRuntime."""

from __future__ import annotations

import json
import re
import textwrap

from pyplan.export.trainers.layout import (TORCHTITAN, V, LayoutError, TrainerLayout,
                                           layout_of, relocate, require_training)
from pyplan.problem import Problem

__all__ = ["torchtitan_config", "torchtitan_fqns"]

# torch.distributed.pipelining's schedules (torchtitan's pipeline_parallel_schedule) that run a
# pyplan template's order. torch's InterleavedZeroBubble is the paper's ZB1P: with one stage
# per rank it is ZB-H1's order.
_TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B",
                         "interleaved-1f1b": "Interleaved1F1B",
                         "zb-h1": "InterleavedZeroBubble", "zb-v": "ZBVZeroBubble",
                         "dualpipev": "DualPipeV"}
# torchtitan 0.3.0 cuts a model by its top-level modules and the items of a top-level
# ModuleList or ModuleDict (layers.3); a deeper name would be dropped from every stage.
_TORCHTITAN_FQN = re.compile(r"[^.\s]+(\.[^.\s]+)?")


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


def _torchtitan_parts(layout: TrainerLayout) -> tuple[list[list[str]], str]:
    if layout.stage_layers is not None:
        parts, first, last = [], 0, len(layout.stage_layers) - 1
        for s, count in enumerate(layout.stage_layers):
            parts.append(["tok_embeddings"] * (s == 0) +
                         [f"layers.{i}" for i in range(first, first + count)] +
                         ["norm", "lm_head"] * (s == last))
            first += count
        return parts, "torchtitan's own decoder names"
    parts, whose = torchtitan_fqns(list(layout.stage_modules))
    deep = next((f for part in parts for f in part if not _TORCHTITAN_FQN.fullmatch(f)), None)
    if deep is not None:
        raise LayoutError("stage_modules", f"torchtitan {TORCHTITAN} cuts a model by its "
                          "top-level modules and the items of a top-level ModuleList or "
                          f"ModuleDict (layers.3), so it cannot keep '{deep}' in a stage",
                          "cut a model with top-level layers: torchtitan's own models, "
                          "Hugging Face Llama-family models")
    return parts, whose


def _torchtitan_schedule(layout: TrainerLayout) -> str:
    """torch's schedule for the layout: its template's, else (pyplan's own order, run from its
    CSV) the one of its placement, which torchtitan also uses to place the stages."""
    named = _TORCHTITAN_SCHEDULES.get(layout.schedule)
    if layout.schedule == "chimera":
        raise LayoutError("schedule", "chimera runs two pipelines in opposite directions, and "
                          "torchtitan one", "choose another schedule")
    if named is None and not layout.schedule_csv:
        what = ("pyplan's own order is no torch schedule" if layout.schedule == "search"
                else f"torch has no {layout.schedule} schedule")
        raise LayoutError("schedule", f"{what}: torchtitan runs it from its torch CSV",
                          "give the layout schedule_csv, the file pyplan export --format "
                          "torch-csv writes")
    if named is not None:
        return named
    split = layout.splits_backward
    if layout.placement == V:
        return "ZBVZeroBubble" if split else "DualPipeV"
    if split:
        return "InterleavedZeroBubble"
    return "Interleaved1F1B" if layout.vpp > 1 else "1F1B"


def torchtitan_config(layout: TrainerLayout | Problem, template: str | None = None) -> str:
    """A Python module for torchtitan 0.3.0, whose runs are configured by functions returning a
    Trainer.Config: its `pipeline(config)` sets the layout's parallel degrees, the module FQNs
    of each model part (`parallelism.module_fqns_per_model_part`), the torch schedule (and the
    CSV of pyplan's order, which torchtitan then runs in torch's _PipelineScheduleRuntime), the
    micro-batches (local batch = micro-batches x `pipeline_parallel_microbatch_size`), the
    sequence length and the recomputation, and turns CUDA graphs off (torchtitan 0.3.0 refuses
    them with a pipeline)."""
    require_training(layout, "torchtitan's pipeline settings are for training")
    layout, problem = layout_of(layout, "torchtitan", template)
    try:
        if layout.ep > 1:
            raise LayoutError("ep", "torchtitan's expert parallelism spans its tensor ranks "
                              "too (expert_parallel_degree at least tp), not the data ranks "
                              "this layout splits the experts over (Megatron-LM's)",
                              "write it with --megatron, or fix --ep 1 for torchtitan")
        if layout.recompute == "block":
            raise LayoutError("recompute", "torchtitan checkpoints every k-th layer, not "
                              f"the first {layout.recompute_layers} of each stage as Megatron-"
                              "LM's block recomputation does",
                              "write it with --megatron, or fix --recompute full or "
                              "selective for torchtitan")
        schedule = _torchtitan_schedule(layout)
        parts, whose = _torchtitan_parts(layout)
        if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and \
                not layout.schedule_csv:
            rounds = max(1, layout.micro_batches // layout.pp)
            if layout.micro_batches % rounds:
                raise LayoutError("micro_batches", f"torch's {schedule} runs the "
                                  f"micro-batches in {rounds} rounds of pp ({layout.pp}), and "
                                  f"{layout.micro_batches} does not split into {rounds}",
                                  f"choose a multiple of {layout.pp} micro-batches")
    except LayoutError as exc:
        raise exc if problem is None else relocate(problem, exc) from None
    csv = layout.schedule_csv or ""
    module = _module_name(layout.name)
    part_lines = "".join(f"    {json.dumps(part)},\n" for part in parts)
    order = {"search": "pyplan's own order"}.get(layout.schedule, layout.schedule)
    about = "\n\n".join(textwrap.fill(p, width=96) for p in (
        f"{layout.name} for torchtitan {TORCHTITAN}, written by pyplan export --format "
        "torchtitan.", f"{layout.describe('FSDP')}.",
        "torchtitan configures a run with a function returning its Trainer.Config; give yours "
        "this layout:"))
    after = [f"and run it on {layout.gpus} GPUs with --module <your module> --config "
             f"llama3_8b_pyplan. The module FQNs are {whose}."]
    if csv:
        after.append(f"The schedule, {order}: pyplan export PLAN --format torch-csv -o {csv} "
                     f"(torchtitan runs it instead of {schedule}, which places the stages; set "
                     "pipeline_parallel_schedule_csv to \"\" to run the named schedule).")
    else:
        after.append(f"The schedule, {order}: torch's {schedule}.")
    after_text = "\n\n".join(textwrap.fill(p, width=96) for p in after)
    lines = [
        "parallelism = config.parallelism",
        f"parallelism.tensor_parallel_degree = {layout.tp}",
        f"parallelism.enable_sequence_parallel = {layout.sequence_parallel}",
        f"parallelism.context_parallel_degree = {layout.cp}",
        f"parallelism.data_parallel_replicate_degree = {layout.dp_replicate}",
        f"parallelism.data_parallel_shard_degree = {layout.dp_shard}",
        f"parallelism.pipeline_parallel_degree = {layout.pp}",
        "parallelism.module_fqns_per_model_part = MODULE_FQNS_PER_MODEL_PART",
        f"parallelism.pipeline_parallel_schedule = \"{schedule}\"",
        f"parallelism.pipeline_parallel_schedule_csv = {json.dumps(csv)}",
        f"# {layout.micro_batches} micro-batches per pipeline and step: torchtitan splits each "
        "data-parallel",
        "# rank's local batch into local_batch_size // pipeline_parallel_microbatch_size.",
        f"parallelism.pipeline_parallel_microbatch_size = {layout.micro_batch_size}",
        f"config.training.local_batch_size = "
        f"{layout.micro_batches * layout.micro_batch_size}",
        f"config.training.global_batch_size = {layout.global_batch}",
    ]
    if layout.sequence_length:
        lines.append(f"config.training.seq_len = {layout.sequence_length}")
    if layout.pp > 1:
        lines.append("config.training.disable_cuda_graphs = True  # none with a pipeline")
    if layout.recompute == "none":
        lines.append("config.activation_checkpoint = None")
    elif layout.recompute is not None:
        policy = {"selective": "SelectiveAC", "full": "FullAC"}[layout.recompute]
        lines += [f"from torchtitan.distributed.activation_checkpoint import {policy}",
                  "", f"config.activation_checkpoint = {policy}.Config()"]
    body = "".join(f"    {line}\n" if line else "\n" for line in lines)
    return f'''"""{about}

    from {module} import pipeline   # this file, saved as {module}.py
    from torchtitan.models.llama3.config_registry import llama3_8b

    def llama3_8b_pyplan():
        return pipeline(llama3_8b())

{after_text}
"""

TORCHTITAN = "{TORCHTITAN}"  # the release these settings are for

MODULE_FQNS_PER_MODEL_PART = [
{part_lines}]


def pipeline(config):
    """Set this layout on a torchtitan {TORCHTITAN} Trainer.Config and return it."""
{body}    return config
'''


def _module_name(name: str) -> str:
    """A Python module name for a plan's name (the file the export is saved as)."""
    return re.sub(r"\W", "_", name) if re.sub(r"\W", "_", name)[:1].isalpha() else \
        "plan_" + re.sub(r"\W", "_", name)
