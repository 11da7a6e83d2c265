"""A pipeline layout in the formats other trainers read, so that what pyplan plans can drive
them: torchtitan's configuration (a Python module setting a Trainer.Config), Megatron-LM's
`--pipeline-model-parallel-layout` string and its `pretrain_gpt.py` argument line.

Each export is written for one released version of its client, stated in its header:
torchtitan 0.3.0, and megatron-core 0.16.1 with the Megatron-LM release cut beside it (tag
core_v0.16.1). tests/test_clients.py checks them with those releases' own code.

The exporters are functions of a `TrainerLayout`, plain data: the parallel degrees, the stages
(module names or decoder-layer counts), the micro-batches, the schedule and the settings that
change memory. `pyplan export --format torchtitan|megatron-layout|megatron-args` builds one
from a plan (`plan_layout`); the cluster planner builds one from its own layouts. A layout a
client cannot run is refused with one line saying why (a PlanError; from a plan, at its line).

pyplan's micro-batch count maps onto each client's own settings: torchtitan splits every
data-parallel rank's local batch into `local_batch_size // pipeline_parallel_microbatch_size`
micro-batches, so the export sets the local batch to micro-batches x micro-batch size;
Megatron-LM derives `global_batch_size // (micro_batch_size x data-parallel size)`, so the
export gives `--global-batch-size` as that product.
"""

from __future__ import annotations

import json
import re
import shlex
import textwrap
from dataclasses import dataclass

from pyplan.errors import PlanError, did_you_mean
from pyplan.problem import Problem
from pyplan.planfile.source import error_at

__all__ = ["MEGATRON_CORE", "MEGATRON_LM", "TORCHTITAN", "LayoutError", "TrainerLayout",
           "megatron_argv", "megatron_arguments", "megatron_layout", "plan_layout",
           "torchtitan_config", "torchtitan_fqns"]

TORCHTITAN = "0.3.0"
"""The torchtitan release the torchtitan export is written for."""
MEGATRON_CORE = "0.16.1"
"""The megatron-core release whose PipelineParallelLayerLayout reads the layout."""
MEGATRON_LM = "core_v0.16.1"
"""Megatron-LM's release (its git tag) beside megatron-core 0.16.1: pretrain_gpt.py's
arguments."""

RECOMPUTE = ("none", "selective", "full")
# pyplan's templates (pyplan.solver.templates) and "search": pyplan's own order.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "chimera", "zb-h1", "zb-h2", "zb-v",
             "dualpipev", "3f1b", "search")
_SPLIT = frozenset({"zb-h1", "zb-h2", "zb-v"})  # templates with a split backward (I and W)
LOOP, V = "loop", "v"
# Each template's placement: loop (stage s on rank s mod pp) or V (s and 2pp-1-s on rank s).
_PLACEMENT = {"gpipe": LOOP, "1f1b": LOOP, "interleaved-1f1b": LOOP, "zb-h1": LOOP,
              "zb-h2": LOOP, "zb-v": V, "dualpipev": V}
# Stages per rank (vpp) each template runs: a number, or None for any.
_VPP = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": None, "zb-h1": None, "zb-h2": 1,
        "zb-v": 2, "dualpipev": 2}
# torch.distributed.pipelining's schedules (torchtitan's pipeline_parallel_schedule) that run a
# pyplan template's order. torch's InterleavedZeroBubble is the paper's ZB1P: with one stage
# per rank it is ZB-H1's order.
_TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B",
                         "interleaved-1f1b": "Interleaved1F1B",
                         "zb-h1": "InterleavedZeroBubble", "zb-v": "ZBVZeroBubble",
                         "dualpipev": "DualPipeV"}

_EMBEDDING = re.compile(r"(^|\.)(embed\w*|wte|tok_embeddings|word_embeddings)$", re.IGNORECASE)
_OUTPUT = re.compile(r"(^|\.)(head|lm_head|output\w*|norm|final\w*|ln_f)$", re.IGNORECASE)
# torchtitan 0.3.0 cuts a model by its top-level modules and the items of a top-level
# ModuleList or ModuleDict (layers.3); a deeper name would be dropped from every stage.
_TORCHTITAN_FQN = re.compile(r"[^.\s]+(\.[^.\s]+)?")


class LayoutError(PlanError):
    """A layout a client cannot run; `field` names the TrainerLayout field it is about."""

    def __init__(self, field: str, message: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.field = field


@dataclass(frozen=True)
class TrainerLayout:
    """How one training run is laid out, as the trainer exports need it. Ranks number as
    Megatron-LM and torchtitan number them: tensor parallel innermost, then data parallel, then
    pipeline; the run takes tp x pp x dp GPUs.

    Stages are given either as module names (`stage_modules`, pp x vpp of them, in forward
    order: as a plan's `model.stages` lists them) or as decoder-layer counts (`stage_layers`:
    the first stage also holds the embedding, the last the final norm and output, as torchtitan
    and Megatron-LM name them). Stage s runs on pipeline rank s mod pp (`placement="loop"`) or,
    for V schedules, s and 2pp-1-s on rank s (`"v"`, vpp 2).

    `schedule` is one of pyplan's templates (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zb-v,
    dualpipev, ...) or "search", pyplan's own order, which torchtitan runs from its torch CSV
    (`schedule_csv`: the file `pyplan export --format torch-csv` writes; it then also runs any
    template). Megatron-LM runs its own 1F1B (interleaved with vpp > 1) on the layout.

    `dp_shard` ranks shard the training state: torchtitan's FSDP degree, Megatron-LM's
    distributed optimizer (`distributed_optimizer`); `dp_replicate` replicate it (DDP, or the
    groups of HSDP). A planner layout of dp replicas with a distributed optimizer is
    dp_shard=dp, without one dp_replicate=dp. `recompute` None leaves the client's own setting.
    """

    name: str
    pp: int
    micro_batches: int
    """Micro-batches per pipeline and optimizer step (pyplan's count)."""
    stage_modules: tuple[tuple[str, ...], ...] | None = None
    stage_layers: tuple[int, ...] | None = None
    tp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    vpp: int = 1
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    sequence_length: int | None = None
    schedule: str = "1f1b"
    schedule_csv: str | None = None
    placement: str = LOOP
    split_backward: bool = False
    """The order splits each backward into input and weight gradients (pyplan's search may);
    the zero-bubble templates always do."""
    sequence_parallel: bool = False
    recompute: str | None = None

    def __post_init__(self) -> None:
        for field in ("pp", "micro_batches", "tp", "dp_replicate", "dp_shard", "vpp",
                      "micro_batch_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(field, f"{field} must be a whole number of at least 1, not "
                                  f"{value!r}")
        if not isinstance(self.name, str) or not self.name.strip():
            raise LayoutError("name", "a layout needs a name", "name it after the model")
        if self.sequence_length is not None and (
                isinstance(self.sequence_length, bool) or
                not isinstance(self.sequence_length, int) or self.sequence_length < 1):
            raise LayoutError("sequence_length", "sequence_length must be a whole number of "
                              f"tokens, at least 1, not {self.sequence_length!r}")
        if self.schedule not in SCHEDULES:
            raise LayoutError("schedule", f"unknown schedule '{self.schedule}'",
                              did_you_mean(self.schedule, SCHEDULES) or
                              f"choose one of {', '.join(SCHEDULES)}")
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise LayoutError("recompute", f"unknown recompute '{self.recompute}'",
                              f"choose {', '.join(RECOMPUTE)}, or None for the client's own")
        if self.placement not in (LOOP, V):
            raise LayoutError("placement", f"unknown placement '{self.placement}'",
                              "choose loop or v")
        self._check_stages()
        self._check_schedule()
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("sequence_parallel", "sequence parallelism splits the sequence "
                              "over the tensor-parallel ranks, and tp is 1",
                              "set tp > 1 or sequence_parallel=False")
        if self.sequence_parallel and self.sequence_length and self.sequence_length % self.tp:
            raise LayoutError("sequence_length", f"a sequence of {self.sequence_length} tokens "
                              f"does not split over tp {self.tp} (sequence parallel)",
                              "choose a sequence length divisible by tp")

    def _check_stages(self) -> None:
        given = [f for f in ("stage_modules", "stage_layers") if getattr(self, f) is not None]
        if len(given) != 1:
            raise LayoutError("stage_modules", "a layout gives its stages either as module "
                              "names (stage_modules) or as decoder-layer counts (stage_layers)"
                              + (", not both" if given else ""),
                              "give one of stage_modules, stage_layers")
        stages = getattr(self, given[0])
        if len(stages) != self.pp * self.vpp:
            raise LayoutError(given[0], f"{len(stages)} stages for pp {self.pp} x vpp "
                              f"{self.vpp} = {self.pp * self.vpp}",
                              "give pp x vpp stages, vpp of them per pipeline rank")
        if self.stage_modules is not None:
            for s, units in enumerate(self.stage_modules):
                if not units or not all(isinstance(u, str) and u for u in units):
                    raise LayoutError("stage_modules", f"stage {s} names no modules",
                                      "give every stage its modules")
        else:
            last = len(self.stage_layers) - 1
            for s, count in enumerate(self.stage_layers):
                least = 0 if s in (0, last) else 1  # the ends also hold embedding, output
                if isinstance(count, bool) or not isinstance(count, int) or count < least:
                    raise LayoutError("stage_layers", f"stage {s} has {count!r} decoder "
                                      f"layers; a stage needs at least {least}",
                                      "give each middle stage one layer or more")

    def _check_schedule(self) -> None:
        placement = _PLACEMENT.get(self.schedule)
        if placement is not None and placement != self.placement:
            raise LayoutError("placement", f"{self.schedule} places its stages "
                              f"{'in a V' if placement == V else 'in a loop'}, not "
                              f"{self.placement}", f"give placement='{placement}'")
        if self.placement == V and self.vpp != 2:
            raise LayoutError("vpp", f"a V places 2 stages on each rank, not {self.vpp}",
                              "give vpp=2")
        want = _VPP.get(self.schedule, 0)
        if want and self.vpp != want:
            raise LayoutError("vpp", f"{self.schedule} runs {want} stage"
                              f"{'s' if want > 1 else ''} per pipeline rank, not {self.vpp}",
                              f"give vpp={want}")
        if self.schedule == "interleaved-1f1b" and self.vpp < 2:
            raise LayoutError("vpp", "interleaved-1f1b runs 2 or more stages per pipeline "
                              "rank", "give vpp=2 or more, or schedule='1f1b'")

    @classmethod
    def planned(cls, layout, *, name: str, micro_batches: int, stage_layers: tuple[int, ...],
                sequence_length: int | None = None,
                schedule_csv: str | None = None) -> TrainerLayout:
        """From a cluster planner's layout: any object with tp, pp, dp, vpp, micro_batch,
        schedule, recompute, sequence_parallel and distributed_optimizer (its dp ranks shard
        the state with a distributed optimizer, else replicate it; zb-v and dualpipev place
        their stages in a V)."""
        shard = bool(layout.distributed_optimizer)
        return cls(name=name, tp=layout.tp, pp=layout.pp, vpp=layout.vpp,
                   dp_replicate=1 if shard else layout.dp, dp_shard=layout.dp if shard else 1,
                   micro_batches=micro_batches, micro_batch_size=layout.micro_batch,
                   sequence_length=sequence_length, schedule=layout.schedule,
                   schedule_csv=schedule_csv, placement=_PLACEMENT.get(layout.schedule, LOOP),
                   sequence_parallel=layout.sequence_parallel, recompute=layout.recompute,
                   stage_layers=tuple(stage_layers))

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.micro_batches * self.micro_batch_size * self.dp

    @property
    def distributed_optimizer(self) -> bool:
        """The optimizer state is sharded over data-parallel ranks (dp_shard > 1)."""
        return self.dp_shard > 1

    @property
    def splits_backward(self) -> bool:
        return self.split_backward or self.schedule in _SPLIT

    def stage_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages pipeline rank `rank` runs, in forward order."""
        if self.placement == V:
            return (rank, 2 * self.pp - 1 - rank)
        return tuple(rank + v * self.pp for v in range(self.vpp))

    def describe(self, sharding: str) -> str:
        """The layout in words; `sharding`: what the client shards the state with."""
        text = (f"{self.gpus} GPUs = tensor parallel {self.tp} x pipeline {self.pp} x data "
                f"parallel {self.dp}")
        if self.dp_replicate > 1 and self.dp_shard > 1:
            text += (f" ({self.dp_replicate} replicas, each sharded over {self.dp_shard} by "
                     f"{sharding})")
        elif self.dp_shard > 1:
            text += f" (sharded by {sharding})"
        text += f"; {self.stages} stages"
        if self.vpp > 1:
            text += (f", {self.vpp} per pipeline rank "
                     f"({'V' if self.placement == V else 'interleaved'})")
        text += (f"; {self.micro_batches} micro-batches of {self.micro_batch_size} "
                 f"sequence{'s' if self.micro_batch_size > 1 else ''}"
                 + (f" of {self.sequence_length} tokens" if self.sequence_length else "")
                 + f" per pipeline and step (global batch {self.global_batch})")
        return text


# ---------------------------------------------------------------- from a plan

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


_TRAINERS = {"torchtitan": "torchtitan", "megatron": "Megatron-LM"}


def plan_layout(problem: Problem, trainer: str, template: str | None = None) -> TrainerLayout:
    """The layout of a plan `pyplan partition` wrote, for `trainer` (torchtitan or megatron):
    its devices are the pipeline ranks, its stages the model's submodules, its `mesh:` the data
    parallelism (`shard: true`: sharded) and the tensor parallelism (`tensor`), micro-batches
    of one sequence. The schedule is `template`, or pyplan's order from its torch CSV
    (`NAME.csv`)."""
    name = _TRAINERS[trainer]
    stages = _stages(problem)
    d = problem.num_devices
    style = _placement(problem, (LOOP, V) if trainer == "torchtitan" and len(stages) == 2 * d
                       else (LOOP,), name)
    mesh = problem.mesh
    data, shard, tensor = ((mesh.data, mesh.shard, getattr(mesh, "tensor", 1))
                           if mesh is not None else (1, False, 1))
    if template is not None and template not in SCHEDULES:
        raise PlanError(f"unknown template '{template}'", hint=did_you_mean(template, SCHEDULES)
                        or f"choose one of {', '.join(SCHEDULES[:-1])}")
    try:
        return TrainerLayout(
            name=problem.name, pp=d, tp=tensor, vpp=max(1, len(stages) // d),
            stage_modules=tuple(stages),
            micro_batches=problem.num_micro_batches, dp_replicate=1 if shard else data,
            dp_shard=data if shard else 1, schedule=template or "search",
            schedule_csv=None if template else f"{problem.name}.csv", placement=style,
            split_backward=any(b.kind == "weight" for b in problem.blocks))
    except LayoutError as exc:
        raise _relocated(problem, exc) from None


def _relocated(problem: Problem, exc: LayoutError) -> PlanError:
    """A layout's refusal at the line of the plan it came from."""
    keys = {"micro_batches": ("micro_batches",), "stage_modules": ("model", "stages"),
            "dp_replicate": ("mesh",), "dp_shard": ("mesh",)}.get(exc.field)
    hint = exc.hint
    if keys is None:  # the placement: its blocks (a --template that does not fit it)
        declared = [b for b in problem.blocks if b.is_forward]
        keys = ("blocks", declared[0].index) if declared else ("blocks",)
        if exc.field in ("vpp", "placement"):
            hint = "choose a template for this placement"
    return _at(problem, keys, exc.message, hint)


def _training(layout: TrainerLayout | Problem, why: str) -> None:
    if isinstance(layout, Problem) and not layout.training:
        raise _at(layout, ("task",), f"{layout.name} is an inference plan, and {why}",
                  "export megatron-layout, svg or chrome instead")


def _layout(layout: TrainerLayout | Problem, trainer: str,
            template: str | None = None) -> tuple[TrainerLayout, Problem | None]:
    if isinstance(layout, Problem):
        return plan_layout(layout, trainer, template), layout
    return layout, None


# ---------------------------------------------------------------- Megatron-LM

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
    layout, problem = _layout(layout, "megatron")
    try:
        if layout.placement == V:
            raise LayoutError("placement", "Megatron-LM places stage s on pipeline rank s "
                              "mod pp, never in a V", "use a loop placement, or torchtitan")
        return _megatron_text(_megatron_stages(layout)) + "\n"
    except LayoutError as exc:
        raise exc if problem is None else _relocated(problem, exc) from None


def megatron_argv(layout: TrainerLayout | Problem, template: str | None = None) -> list[str]:
    """pretrain_gpt.py's arguments for the layout (Megatron-LM core_v0.16.1); a plan's with the
    schedule `template` (else Megatron-LM's own on its layout)."""
    _training(layout, "Megatron-LM's pretrain_gpt.py trains")
    layout, problem = _layout(layout, "megatron", template)
    try:
        _megatron_check(layout)
        stages = _megatron_stages(layout)
    except LayoutError as exc:
        raise exc if problem is None else _relocated(problem, exc) from None
    argv = ["--tensor-model-parallel-size", str(layout.tp),
            "--pipeline-model-parallel-size", str(layout.pp),
            "--num-layers", str(sum(s.count("t") for s in stages))]
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
    elif layout.recompute == "full":  # every layer recomputed, one at a time
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    if layout.distributed_optimizer:
        argv += ["--use-distributed-optimizer"]
        if layout.dp_replicate > 1:  # sharded within each group of dp_shard ranks
            argv += ["--num-distributed-optimizer-instances", str(layout.dp_replicate)]
    return argv


def megatron_arguments(layout: TrainerLayout | Problem, template: str | None = None) -> str:
    """The argument line for Megatron-LM's pretrain_gpt.py (core_v0.16.1), shell-quoted, after
    a header of comments saying what it lays out and how to use it."""
    argv = megatron_argv(layout, template)
    layout, _ = _layout(layout, "megatron", template)
    order = "Megatron-LM's " + ("interleaved 1F1B" if layout.vpp > 1 else "1F1B")
    if layout.schedule == "search":
        order += " (pyplan's own order is not one Megatron-LM runs; torchtitan runs it)"
    about = [f"{layout.name} for Megatron-LM {MEGATRON_LM} (megatron-core {MEGATRON_CORE}): "
             "pretrain_gpt.py arguments, written by pyplan export --format megatron-args.",
             f"{layout.describe('its distributed optimizer')}. Schedule: {order}.",
             f"Launch it on {layout.gpus} GPUs (Megatron-LM takes data parallel = GPUs / "
             f"(tp x pp) = {layout.dp}) with your model, data and optimizer arguments after "
             "these: paste the line into your command or into an argument array such as "
             "MODEL_PARALLEL_ARGS=( ... ) in Megatron-LM's example scripts."]
    header = "".join(textwrap.fill(p, width=96, initial_indent="# ",
                                   subsequent_indent="#   ") + "\n" for p in about)
    return header + shlex.join(argv) + "\n"


# ---------------------------------------------------------------- torchtitan

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
    _training(layout, "torchtitan's pipeline settings are for training")
    layout, problem = _layout(layout, "torchtitan", template)
    try:
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
        raise exc if problem is None else _relocated(problem, exc) from None
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
        "parallelism.context_parallel_degree = 1",
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
