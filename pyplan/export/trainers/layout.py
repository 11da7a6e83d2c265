"""TrainerLayout: how one training run is laid out, as the trainer exports need it (plain
data: the planner builds one, `plan_layout` builds one from a plan), the client releases the
exports are for, and the refusals (LayoutError: one line, at the plan's line for a plan)."""

from __future__ import annotations

from dataclasses import dataclass

from pyplan.errors import PlanError, did_you_mean
from pyplan.planfile.source import error_at
from pyplan.problem import Problem

__all__ = ["LOOP", "MEGATRON_CORE", "MEGATRON_LM", "OVERLAPS", "RECOMPUTE", "SCHEDULES", "TORCHTITAN", "V",
           "LayoutError", "TrainerLayout", "layout_of", "plan_layout", "relocate",
           "require_training"]

TORCHTITAN = "0.3.0"
"""The torchtitan release the torchtitan export is written for."""
MEGATRON_CORE = "0.16.1"
"""The megatron-core release whose PipelineParallelLayerLayout reads the layout."""
MEGATRON_LM = "core_v0.16.1"
"""Megatron-LM's release (its git tag) beside megatron-core 0.16.1: pretrain_gpt.py's
arguments."""

RECOMPUTE = ("none", "selective", "block", "full")
OVERLAPS = ("grad-reduce", "param-gather", "tp-comm")
# pyplan's templates (pyplan.solver.templates) and "search": pyplan's own order.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "chimera", "zb-h1", "zb-h2", "zb-2p",
             "zb-v", "dualpipev", "3f1b", "search")
# templates with a split backward (I and W)
_SPLIT = frozenset({"zb-h1", "zb-h2", "zb-2p", "zb-v"})
LOOP, V = "loop", "v"
# Each template's placement: loop (stage s on rank s mod pp) or V (s and 2pp-1-s on rank s).
_PLACEMENT = {"gpipe": LOOP, "1f1b": LOOP, "interleaved-1f1b": LOOP, "zb-h1": LOOP,
              "zb-h2": LOOP, "zb-2p": LOOP, "zb-v": V, "dualpipev": V}
# Stages per rank (vpp) each template runs: a number, or None for any.
_VPP = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": None, "zb-h1": None, "zb-h2": 1,
        "zb-2p": 1, "zb-v": 2, "dualpipev": 2}


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
    recompute_layers: int = 0
    """With block recomputation: the layers of each stage recomputed (its first ones)."""
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks (ring attention)."""
    ep: int = 1
    """Expert parallelism: a mixture's experts split over ep of the data x context ranks."""
    overlaps: tuple[str, ...] = ()
    """What the run overlaps that its trainer has a switch for (grad-reduce, param-gather,
    tp-comm: Megatron-LM's --overlap-* flags), as `pyplan plan` priced it."""

    def __post_init__(self) -> None:
        for field in ("pp", "micro_batches", "tp", "dp_replicate", "dp_shard", "vpp",
                      "micro_batch_size", "cp", "ep"):
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
        if isinstance(self.recompute_layers, bool) or not isinstance(
                self.recompute_layers, int) or self.recompute_layers < 0:
            raise LayoutError("recompute_layers", "recompute_layers must be a whole number of "
                              f"layers, not {self.recompute_layers!r}")
        if (self.recompute == "block") != (self.recompute_layers > 0):
            raise LayoutError("recompute_layers", "block recomputation needs recompute_layers "
                              "> 0, and only it takes them",
                              "give recompute='block' with recompute_layers=N, or neither")
        if self.placement not in (LOOP, V):
            raise LayoutError("placement", f"unknown placement '{self.placement}'",
                              "choose loop or v")
        self._check_stages()
        self._check_schedule()
        if self.cp > 1 and self.sequence_length and self.sequence_length % (2 * self.cp):
            raise LayoutError("sequence_length", f"a sequence of {self.sequence_length} tokens "
                              f"does not split into 2 x cp {self.cp} chunks (context "
                              "parallelism's causal load balance)",
                              f"choose a sequence length divisible by {2 * self.cp}")
        if (self.dp * self.cp) % self.ep:
            raise LayoutError("ep", f"ep {self.ep} does not divide the {self.dp * self.cp} "
                              "data x context ranks the experts are split over",
                              "choose an ep that divides dp x cp")
        unknown = sorted(set(self.overlaps) - set(OVERLAPS))
        if unknown:
            raise LayoutError("overlaps", f"unknown overlap '{unknown[0]}'",
                              f"choose from {', '.join(OVERLAPS)}")
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
                sequence_length: int | None = None, schedule_csv: str | None = None,
                overlaps: tuple[str, ...] = ()) -> TrainerLayout:
        """From a cluster planner's layout: any object with tp, pp, dp, vpp, micro_batch,
        schedule, recompute, sequence_parallel and distributed_optimizer (its dp ranks shard
        the state with a distributed optimizer or FSDP, over dp / dp_replicate ranks, else
        replicate it; zb-v and dualpipev place
        their stages in a V)."""
        shard = bool(layout.distributed_optimizer or getattr(layout, "fsdp", False))
        replicas = getattr(layout, "dp_replicate", 1) if shard else layout.dp
        return cls(name=name, tp=layout.tp, pp=layout.pp, vpp=layout.vpp,
                   dp_replicate=replicas, dp_shard=layout.dp // replicas,
                   micro_batches=micro_batches, micro_batch_size=layout.micro_batch,
                   sequence_length=sequence_length, schedule=layout.schedule,
                   schedule_csv=schedule_csv, placement=_PLACEMENT.get(layout.schedule, LOOP),
                   sequence_parallel=layout.sequence_parallel, recompute=layout.recompute,
                   recompute_layers=getattr(layout, "recompute_layers", 0),
                   stage_layers=tuple(stage_layers), cp=getattr(layout, "cp", 1),
                   ep=getattr(layout, "ep", 1), overlaps=tuple(overlaps))

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

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
        context = f" x context parallel {self.cp}" if self.cp > 1 else ""
        text = (f"{self.gpus} GPUs = tensor parallel {self.tp}{context} x pipeline {self.pp} "
                f"x data parallel {self.dp}")
        if self.dp_replicate > 1 and self.dp_shard > 1:
            text += (f" ({self.dp_replicate} replicas, each sharded over {self.dp_shard} by "
                     f"{sharding})")
        elif self.dp_shard > 1:
            text += f" (sharded by {sharding})"
        if self.ep > 1:
            text += f"; the experts split over {self.ep} of the data x context ranks"
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


def _branching(problem: Problem) -> tuple[int, str] | None:
    """(a forward block, how its stages branch) where they are not one chain, else None."""
    forward = {b.index for b in problem.blocks if b.is_forward}
    ins: dict[int, list[int]] = {b: [] for b in forward}
    outs: dict[int, list[int]] = {b: [] for b in forward}
    for a, c in problem.edges:
        if a in forward and c in forward:
            ins[c].append(a)
            outs[a].append(c)
    for b in sorted(forward):
        name = problem.blocks[b].name
        if len(outs[b]) > 1:
            return b, f"block '{name}' feeds {len(outs[b])} blocks"
        if len(ins[b]) > 1:
            return b, f"block '{name}' joins {len(ins[b])} blocks"
    if sum(not ins[b] for b in forward) > 1:
        return min(forward), "its forward blocks start more than one chain"
    return None


def plan_layout(problem: Problem, trainer: str, template: str | None = None) -> TrainerLayout:
    """The layout of a plan `pyplan partition` wrote, for `trainer` (torchtitan or megatron):
    its devices are the pipeline ranks, its stages the model's submodules, its `mesh:` the data
    parallelism (`shard: true`: sharded) and the tensor parallelism (`tensor`), micro-batches
    of one sequence. The schedule is `template`, or pyplan's order from its torch CSV
    (`NAME.csv`)."""
    name = _TRAINERS[trainer]
    stages = _stages(problem)
    branch = _branching(problem)
    if branch is not None:  # a graph pipeline
        raise _at(problem, ("blocks", branch[0]), f"{problem.name}'s stages form a graph "
                  f"({branch[1]}), but {name}'s pipeline stages form one chain",
                  "export svg or chrome, or partition with --shape vshape")
    d = problem.num_devices
    style = _placement(problem, (LOOP, V) if trainer == "torchtitan" and len(stages) == 2 * d
                       else (LOOP,), name)
    mesh = problem.mesh
    data, shard, tensor = ((mesh.data, mesh.shard, mesh.tensor) if mesh is not None
                           else (1, False, 1))
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
        raise relocate(problem, exc) from None


def relocate(problem: Problem, exc: LayoutError) -> PlanError:
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


def require_training(layout: TrainerLayout | Problem, why: str) -> None:
    """Refuse an inference plan for a trainer's training settings."""
    if isinstance(layout, Problem) and not layout.training:
        raise _at(layout, ("task",), f"{layout.name} is an inference plan, and {why}",
                  "export megatron-layout, svg or chrome instead")


def layout_of(layout: TrainerLayout | Problem, trainer: str,
              template: str | None = None) -> tuple[TrainerLayout, Problem | None]:
    """The layout an export is of, and the plan it came from (None for a layout given)."""
    if isinstance(layout, Problem):
        return plan_layout(layout, trainer, template), layout
    return layout, None
