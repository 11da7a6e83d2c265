"""The pipeline dimension, solved rather than approximated: a layout's per-stage block costs
become a pyplan plan (one pipeline of the mesh: its pp devices, each chunk a block with its
forward, input- and weight-gradient times, activations, static memory, workspace, the send to
the next stage and the data-parallel gradient synchronisation), and pyplan's own templates (or
its search) lay out and evaluate the schedule. So interleaved, zero-bubble and V schedules are
priced exactly, and the memory a stage holds is what the schedule holds, not a closed form.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyplan.cluster import collectives, constants
from pyplan.cluster.costs import Costs, Work, gradient_bytes
from pyplan.cluster.hardware import Cluster
from pyplan.cluster.layout import SPLIT_BACKWARD, Batch, Layout
from pyplan.cluster.memory import activations, ends, rank_parameters, stage_state
from pyplan.cluster.model import Transformer

__all__ = ["Chunk", "Priced", "chunks", "device_split", "plan_text", "price", "split_layers",
           "splits", "splits_evenly"]

BUCKET = 40e6  # parameters per gradient bucket (Megatron-LM's and DDP's default size)
UNITS = 1_000  # time units the longest block gets: times are integers, rounded by <= 0.05%


@dataclass(frozen=True)
class Chunk:
    """A pipeline stage (a model chunk) on one rank: its layers and what they cost."""

    index: int
    device: int
    layers: tuple[int, ...]
    first: bool
    last: bool
    forward: Work
    backward: Work
    weight: Work
    held: float
    """Activation bytes one micro-batch keeps from F to B."""
    weight_held: float
    """Of those, what W still needs after B."""
    working: float
    """Bytes only while its backward runs (recomputed activations, the loss's logits)."""
    parameters: float
    """Parameters on one rank (its tensor-parallel shard)."""
    state: float
    """Their weights, gradients and optimizer state, bytes."""
    send: float
    """Seconds to send its output to the next stage (0 for the last)."""
    sync: float
    """Seconds of its data-parallel gradient reduction."""
    update: float
    """Seconds of the optimizer's step over its parameters."""


def split_layers(model: Transformer, stages: int, costs: Costs,
                 given: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Layers per stage: `given`; else where the framework splits evenly (Megatron-LM,
    DeepSpeed's type:transformer) and the stages divide the layers, as many on each, the
    embedding and the head on top of the first and the last; else contiguous counts that
    balance the stages' time with the embedding on the first and the head on the last (the
    fewest stages over the least bottleneck; an exact search over the counts)."""
    if given is not None:
        return given
    if splits_evenly(model, stages, costs):
        return (model.layers // stages,) * stages
    per_kind = {moe: costs.layer(moe).seconds
                for moe in {model.is_moe(i) for i in range(model.layers)}}
    layer_time = [per_kind[model.is_moe(i)] for i in range(model.layers)]
    extra = {0: costs.embedding().seconds}
    extra[stages - 1] = extra.get(stages - 1, 0.0) + costs.head().seconds
    # The least bottleneck: a binary search over it, each candidate checked by filling the
    # stages in order as far as it allows (optimal for contiguous stages), each with a layer.
    prefix = [0.0]
    for x in layer_time:
        prefix.append(prefix[-1] + x)
    layers = model.layers

    def fill(limit: float) -> tuple[int, ...] | None:
        counts, start = [], 0
        for s in range(stages):
            end = layers if s == stages - 1 else start
            while end < layers - (stages - s - 1) and \
                    prefix[end + 1] - prefix[start] + extra.get(s, 0.0) <= limit:
                end += 1
            if end == start or prefix[end] - prefix[start] + extra.get(s, 0.0) > limit:
                return None
            counts.append(end - start)
            start = end
        return tuple(counts)
    low, high = 0.0, prefix[-1] + sum(extra.values())
    best = fill(high) or _even(layers, stages)
    for _ in range(50):
        middle = (low + high) / 2
        found = fill(middle)
        if found is not None:
            best, high = found, middle
        else:
            low = middle
    return best


def splits_evenly(model: Transformer, stages: int, costs: Costs) -> bool:
    """The framework splits the layers evenly (Megatron-LM, DeepSpeed's type:transformer) and
    the stages divide them."""
    return costs.framework.even_split and model.layers % stages == 0


def splits(model: Transformer, layout: Layout, costs: Costs) -> list[tuple[int, ...]]:
    """The layer splits worth pricing: split_layers' (each chunk's time balanced), and where a
    GPU holds several chunks and the framework does not split evenly, the GPUs' work balanced
    (device_split). Which runs faster depends on the schedule; the first and the later
    chunks are not held alike (interleaved 1F1B keeps more micro-batches of a GPU's first
    chunk in flight), so the two differ in memory too."""
    out = [split_layers(model, layout.stages, costs)]
    if not splits_evenly(model, layout.stages, costs):
        other = device_split(model, layout, costs)
        if other is not None and other != out[0]:
            out.append(other)
    return out


def device_split(model: Transformer, layout: Layout, costs: Costs) -> tuple[int, ...] | None:
    """Layers per chunk where a GPU holds several: each GPU's share of the layers first, so
    that the busiest GPU's work is the least it can be (each layer in turn to the GPU that
    would then be least loaded, the embedding's and the head's time on theirs), then each
    GPU's share over its chunks, as many on each and the extra ones on its last chunks (the
    ones a schedule holds the fewest micro-batches of). None where the layers differ in kind
    (a mixture's dense and expert layers) or a chunk would have none."""
    stages, pp = layout.stages, layout.pp
    if layout.vpp == 1 or stages > model.layers or \
            len({model.is_moe(i) for i in range(model.layers)}) > 1:
        return None
    layer = costs.layer(model.is_moe(0)).seconds
    load = [0.0] * pp
    for end, chunk in ((costs.embedding(), 0), (costs.head(), stages - 1)):
        load[device_of(chunk, layout)] += end.seconds
    share = [layout.vpp] * pp  # a layer in each chunk at least
    for _ in range(model.layers - stages):
        device = min(range(pp), key=lambda d: (load[d] + share[d] * layer, d))
        share[device] += 1
    counts = [0] * stages
    for device in range(pp):
        mine = [c for c in range(stages) if device_of(c, layout) == device]
        base, extra = divmod(share[device], len(mine))
        for i, c in enumerate(reversed(mine)):
            counts[c] = base + (1 if i < extra else 0)
    return tuple(counts)


def _even(layers: int, stages: int) -> tuple[int, ...]:
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if s < extra else 0) for s in range(stages))


def device_of(chunk: int, layout: Layout) -> int:
    """Interleaved: chunk c on rank c mod pp; the V of zb-v: down the ranks and back."""
    pp = layout.pp
    if layout.schedule == "zb-v":
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def chunks(model: Transformer, cluster: Cluster, layout: Layout, batch: Batch,
           counts: tuple[int, ...]) -> list[Chunk]:
    costs = Costs(model, cluster, layout, batch)
    kinds: dict[tuple[bool, bool], tuple] = {}

    def layer(i: int, position: int) -> tuple:
        """(pieces, activations) of layer i at `position` in its chunk: dense or experts,
        its forward rerun in the backward or not (priced once each)."""
        key = (model.is_moe(i), layout.recomputes(position))
        if key not in kinds:
            kinds[key] = (costs.layer(*key), activations(model, layout, batch, *key))
        return kinds[key]
    embedding_act, head_act = ends(model, layout, batch)
    embedding, head = costs.embedding(), costs.head()
    t = layout.tp
    out, first_layer = [], 0
    stages = len(counts)
    boundary, gather = boundary_traffic(costs)
    node = cluster.gpus_per_node

    def send_to(c: int, other: int) -> float:
        """One send from chunk c to chunk `other`: over the network where their pipeline
        ranks are on two nodes, none where they are one (the turn of zb-v's V)."""
        mine, theirs = device_of(c, layout), device_of(other, layout)
        if mine == theirs:
            return 0.0
        return collectives.send(cluster, boundary, layout.node_of_stage(mine, node) !=
                                layout.node_of_stage(theirs, node))
    tied = tied_embedding_sync(costs)
    for c, count in enumerate(counts):
        layers = tuple(range(first_layer, first_layer + count))
        first_layer += count
        pieces = [layer(i, position)[0] for position, i in enumerate(layers)]
        acts = [layer(i, position)[1] for position, i in enumerate(layers)]
        per_layer = [rank_parameters(model, layout, model.is_moe(i)) for i in layers]
        params = sum(per_layer)
        experts = sum(model.experts * model.mlp_params(model.expert_ffn) / (t * layout.ep)
                      for i in layers if model.is_moe(i))
        if c == 0:
            pieces.insert(0, embedding)
            acts.insert(0, embedding_act)
            params += model.embedding_params / t
        if c == stages - 1:
            pieces.append(head)
            acts.append(head_act)
            params += model.head_params / t
        f, b, w = Work(), Work(), Work()
        for p in pieces:
            f, b, w = f + p.forward, b + p.backward, w + p.weight
        if batch.framework.grad_accumulation_pass and batch.dtype == "bf16":
            b.add("elementwise", costs.streamed(params * constants.GRAD_ACCUMULATION_BYTES))
        send = send_to(c, c + 1) if c < stages - 1 else 0.0
        if not batch.framework.overlaps_p2p(layout.vpp) and stages > 1:
            # blocking sends (Megatron-Core's 1F1B): the activation to the next stage after
            # the forward, the gradient to the previous one after the backward
            f.add("pp_comm", send)
            b.add("pp_comm", send_to(c, c - 1) if c > 0 else 0.0)
            send = 0.0
        if stages > 1:  # the scattered activation (gradient) gathered after it arrives
            f.add("pp_comm", gather if c > 0 else 0.0)
            b.add("pp_comm", gather if c < stages - 1 else 0.0)
        working = max((a.working for a in acts), default=0.0)
        sync = gradient_sync(costs, params, experts, f, b + w)
        if c in (0, stages - 1):
            sync += tied
        state = stage_state(params, batch, layout, largest_layer=max(per_layer, default=0.0))
        shards = layout.shard if layout.fsdp else \
            layout.dp * layout.cp if layout.distributed_optimizer else 1
        update = costs.moved(params / shards * constants.ADAM_BYTES[batch.state_dtype])
        out.append(Chunk(c, device_of(c, layout), layers, c == 0, c == stages - 1, f, b, w,
                         sum(a.held for a in acts), sum(a.weight_held for a in acts),
                         working, params, state.total,
                         send,
                         sync, update))
    return out


def boundary_traffic(costs: Costs) -> tuple[float, float]:
    """(bytes each rank sends across a stage boundary per micro-batch, seconds of the
    receiver's all-gather over its tensor group): with sequence parallelism each tensor rank
    sends its shard of the sequence; without it, with the framework's scatter/gather
    (Megatron-LM's `scatter_gather_tensors_in_pipeline`), 1/tp of the activation, all-gathered
    over the tensor ranks after it arrives; else every tensor rank sends the whole (DeepSpeed's
    pipeline engine)."""
    layout, model = costs.layout, costs.model
    t = layout.tp
    whole = costs.tokens * model.hidden * costs.bytes
    if t == 1 or layout.sequence_parallel:
        return whole / t, 0.0
    if costs.framework.p2p_scatter_gather:
        gather = collectives.all_gather(costs.cluster, whole, t,
                                        layout.per_node("tp", costs.cluster.gpus_per_node))
        return whole / t, gather
    return whole, 0.0


def tied_embedding_sync(costs: Costs) -> float:
    """Seconds of the all-reduce of a tied embedding's gradient between the first and the last
    pipeline stage, which both hold it (Megatron's `_allreduce_embedding_grads`, DeepSpeed's
    tied modules): its vocabulary shard on each tensor rank, once per iteration after the
    pipeline's flush, over the network where the pipeline spans nodes."""
    layout, model, cluster = costs.layout, costs.model, costs.cluster
    if layout.pp == 1 or not model.tied:
        return 0.0
    nbytes = model.vocab * model.hidden / layout.tp * gradient_bytes(costs.batch)
    return collectives.all_reduce(cluster, nbytes, 2,
                                  1 if layout.pipeline_across_nodes(cluster.gpus_per_node)
                                  else 2)


def gradient_sync(costs: Costs, params: float, experts: float, forward: Work,
                  backward: Work) -> float:
    """Exposed seconds of a stage's once-per-iteration data-parallel traffic: the gradients'
    all-reduce over the data and context ranks (the experts' over those of their expert
    group), or with the distributed optimizer a reduce-scatter and the parameters'
    all-gather, or under a pipeline FSDP's one gather and one reduce-scatter of the stage.
    Where the framework overlaps them, the reduction runs beside the last micro-batch's
    backward and the gather beside the first's forward: only what outlasts those (and at
    least one bucket of Megatron-LM's 40M parameters) is exposed."""
    layout, cluster, batch = costs.layout, costs.cluster, costs.batch
    framework, node = batch.framework, cluster.gpus_per_node
    if layout.fsdp:
        if layout.pp == 1:
            return 0.0  # per layer, in the layers' costs
        gather, reduce = costs.fsdp_traffic(params * layout.tp, False)
        gather_ov, reduce_ov = costs.fsdp_traffic(params * layout.tp, True)
    else:
        ranks = layout.dp * layout.cp
        if ranks == 1:
            return 0.0
        grads = gradient_bytes(batch)
        groups = ((params - experts, ranks, layout.per_node("grad", node)),
                  (experts, ranks // layout.ep, max(1, layout.per_node("grad", node) //
                                                   layout.per_node("ep", node))))
        gather = gather_ov = reduce = reduce_ov = 0.0
        for count, size, per_node in groups:
            if count <= 0 or size <= 1:
                continue
            if layout.distributed_optimizer:
                reduce += collectives.reduce_scatter(cluster, count * grads, size, per_node)
                reduce_ov += collectives.reduce_scatter(cluster, count * grads, size, per_node,
                                                        True)
                gather += collectives.all_gather(cluster, count * costs.bytes, size, per_node)
                gather_ov += collectives.all_gather(cluster, count * costs.bytes, size,
                                                    per_node, True)
            else:
                reduce += collectives.all_reduce(cluster, count * grads, size, per_node)
                reduce_ov += collectives.all_reduce(cluster, count * grads, size, per_node,
                                                    True)
    bucket = min(1.0, BUCKET / max(params * layout.tp, 1.0))
    if framework.overlap_grad_reduce:
        reduce = max(reduce * bucket, reduce_ov - backward.compute) + costs.contention(
            min(reduce_ov, backward.compute))
    if framework.overlap_param_gather:
        gather = max(gather * bucket, gather_ov - forward.compute) + costs.contention(
            min(gather_ov, forward.compute))
    return reduce + gather


@dataclass(frozen=True)
class Priced:
    """A layout's iteration as the schedule runs it."""

    seconds: float
    makespan: float
    """The pipeline's schedule, gradient synchronisations included."""
    compute_makespan: float
    """When its last block ends (without the synchronisations after it)."""
    update: float
    peak_bytes: tuple[float, ...]
    """Per pipeline rank: static + the activations the schedule holds at most + workspace."""
    busy: tuple[float, ...]
    schedule: str
    text: str


def time_unit(chunk_list: list[Chunk]) -> float:
    """Seconds per plan time unit: the longest block gets about UNITS units."""
    longest = max(max(c.forward.seconds, c.backward.seconds + c.weight.seconds, c.sync)
                  for c in chunk_list)
    return longest / UNITS


def plan_text(name: str, chunk_list: list[Chunk], layout: Layout, micro_batches: int,
              capacity: float | None, unit: float) -> str:
    """The pipeline as a pyplan plan (times in units of `unit` seconds, memory in bytes)."""
    split = layout.schedule in SPLIT_BACKWARD

    def units(seconds: float) -> int:
        return max(1, round(seconds / unit))
    lines = ["pyplan: 1", f"name: {name}", f"devices: {layout.pp}"] + ([f"memory: {int(capacity)}B"] if capacity else []) + [
              f"micro_batches: {micro_batches}", "training:",
              "  backward: {time_ratio: 1" + (", weight_time_ratio: 1}" if split else "}"),
              f"topology: {{time_unit_ms: {unit * 1e3:.9g}}}"]
    sync = max(c.sync for c in chunk_list)
    mesh = [f"data: {layout.dp}"] if layout.dp > 1 else []
    if layout.dp > 1 and (layout.distributed_optimizer or layout.fsdp):  # (state sharded)
        mesh.append("shard: true")
    if layout.tp > 1:
        mesh.append(f"tensor: {layout.tp}, priced: {layout.tp}")  # (the chunks' costs)
        if not layout.sequence_parallel:
            mesh.append("sequence: false")
    if sync > 0:
        mesh.append(f"sync: {units(sync)}")
    if mesh:
        lines.append(f"mesh: {{{', '.join(mesh)}}}")
    lines.append("blocks:")
    for c in chunk_list:
        held = int(c.held)
        if split:
            w_held = int(min(c.weight_held, held))
            backward = (f"time: {units(c.backward.seconds)}, memory: {-(held - w_held)}B, "
                        f"weight_time: {units(c.weight.seconds)}, weight_memory: {-w_held}B")
        else:
            backward = f"time: {units(c.backward.seconds + c.weight.seconds)}"
        send = f", transfer: {units(c.send)}" if c.send > 0 else ""
        lines.append(f"  - {{name: stage{c.index}, devices: [{c.device}], "
                     f"time: {units(c.forward.seconds)}, memory: {held}B, "
                     f"weights: {int(c.state)}B, workspace: {int(c.working)}B, "
                     f"update: {units(c.update)}{send}, backward: {{{backward}}}}}")
    return "\n".join(lines) + "\n"


def price(chunk_list: list[Chunk], layout: Layout, micro_batches: int, capacity: float,
          name: str = "pipeline") -> Priced:
    """Lay out the layout's schedule on its plan and evaluate it."""
    from pyplan.problem import build_problem
    from pyplan.solver.templates import template_schedule
    from pyplan.planfile.plan import spec_from_text

    unit = time_unit(chunk_list)
    # A template is priced without a capacity (it reports memory, it does not enforce it);
    # pyplan's search keeps within it; the plan written for the user carries the GPU's.
    text = plan_text(name, chunk_list, layout, micro_batches, capacity, unit)
    search = layout.schedule == "search"
    problem = build_problem(spec_from_text(text if search else plan_text(
        name, chunk_list, layout, micro_batches, None, unit), f"<{name}>"))
    if search:
        from pyplan.solver import solve
        schedule = solve(problem).schedule
    else:
        schedule = template_schedule(problem, layout.schedule)
    makespan = schedule.makespan * unit
    times = [b.time for b in problem.blocks]
    k = len(times)
    last = max(start + times[i % k] for i, start in enumerate(schedule.start))
    per_device = [0.0] * layout.pp
    for c in chunk_list:
        per_device[c.device] += c.update
    update = max(per_device)
    peak = tuple(float(p) for p in schedule.peak_memory)
    return Priced(makespan + update, makespan, last * unit, update, peak,
                  tuple(b * unit for b in schedule.busy), layout.schedule, text)
