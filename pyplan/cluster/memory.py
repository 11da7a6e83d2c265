"""Bytes per GPU: the model's state (weights, gradients, optimizer) by dtype and sharding, and
one micro-batch's activations per layer by recomputation, tensor and sequence parallelism and
flash attention (Korthikanti et al. 2022's counts, generalised to grouped key/value heads,
gated MLPs, experts and runs without dropout). How many micro-batches a stage holds at once
is not a closed form here: the schedule pyplan's solver evaluates holds them.

These rules are the one memory model of a mesh: `pyplan plan` costs a cluster with them and
`pyplan run` divides a stage's state by its shard degree the same way (a plan's blocks are
already one tensor rank's: mesh.priced).
"""

from __future__ import annotations

from dataclasses import dataclass

from pyplan.cluster.layout import Batch, Layout
from pyplan.cluster.model import Transformer

__all__ = ["Activations", "State", "activations", "mesh_state_bytes", "rank_parameters",
           "stage_state", "state_bytes_per_parameter"]


def state_bytes_per_parameter(dtype: str, optimizer: str = "adam", shards: int = 1,
                              sharded_gradients: bool = False) -> dict[str, float]:
    """What one parameter costs for the whole run, by part: mixed precision keeps a 16-bit
    weight, a gradient (fp32 for bf16, as Megatron-LM's main gradients; 16-bit for fp16) and
    fp32 master weights with Adam's two moments (with fp16 also an fp32 copy of the
    gradient); fp32 keeps the weight, its gradient and the moments. The optimizer's state is
    divided over `shards` data-parallel ranks (a distributed optimizer, ZeRO-1, FSDP); with
    `sharded_gradients` the gradient too (ZeRO-2/3, FSDP)."""
    moments = {"adam": 8, "adamw": 8, "sgd": 0, "momentum": 4}[optimizer]
    if dtype == "fp32":
        weight, gradient, optimizer_state = 4, 4, moments
    elif dtype == "bf16":
        weight, gradient, optimizer_state = 2, 4, 4 + moments
    else:  # fp16: 16-bit gradients, fp32 master weights and their gradient copy
        weight, gradient, optimizer_state = 2, 2, 8 + moments
    return {"weights": weight,
            "gradients": gradient / (shards if sharded_gradients else 1),
            "optimizer": optimizer_state / shards}


@dataclass(frozen=True)
class Activations:
    """One micro-batch of one layer (or end) on one rank, bytes."""

    held: float
    """Kept from its forward until its backward."""
    weight_held: float
    """Of `held`, what the weight-gradient pass (W) still needs after B: each GEMM's input."""
    working: float
    """Needed only while its backward runs (a fully recomputed layer's activations)."""


def activations(model: Transformer, layout: Layout, batch: Batch, moe: bool,
                rerun: bool | None = None) -> Activations:
    """A layer's activations for one micro-batch on one tensor- and context-parallel rank (its
    1/cp of each sequence; fp8 runs keep them in bf16); `rerun`: it keeps only its input and
    recomputes the rest (None: as the layout's recomputation says of every layer)."""
    if rerun is None:
        rerun = layout.recompute == "full"
    t, e = layout.tp, (4 if batch.dtype == "fp32" else 2)
    T = layout.micro_batch * batch.sequence / layout.cp
    sp = layout.sequence_parallel
    h, q, kv = model.hidden, model.q_dim, model.kv_dim
    kv_rank = kv / t if model.kv_heads % t == 0 else model.head_dim * max(1, model.kv_heads // t)
    rep = T * h / (t if sp else 1)  # one tensor of the replicated region, elements
    mask = 1 if model.dropout else 0  # bytes per element of a dropout mask

    norms = 2 * rep * e                          # the two norms' inputs
    gemm_inputs = 2 * rep * e + T * q / t * e    # QKV's and the first MLP matrix's, out-proj's
    qkv = T * (q / t + 2 * kv_rank) * e          # q and k for the scores, v for PV
    residual_masks = 2 * rep * mask
    scores = 0.0
    if not batch.flash_attention and layout.recompute in ("none", "block") and not rerun:
        heads = model.heads / t
        s = batch.sequence
        scores = layout.micro_batch * heads * s * s * (e + mask + (e if mask else 0))
    elif batch.flash_attention:
        scores = layout.micro_batch * model.heads / t * T / layout.micro_batch * 4  # lse

    # A gated activation keeps its two inputs, and eager PyTorch also SiLU's output for the
    # product's backward; a fused one (Megatron-LM's bias_swiglu, Transformer Engine,
    # torch.compile's partitioner) recomputes it
    gate_inputs = 2 + batch.framework.decomposed

    def mlp(tokens: float, width: float) -> tuple[float, float]:
        """(held, what W needs) of an MLP over `tokens` with inner `width` per rank."""
        inner = tokens * width / t * e
        held = (gate_inputs if model.gated else 1) * inner + inner  # activation; down's input
        return held, inner
    if not moe:
        mlp_held, mlp_w = mlp(T, model.ffn)
    else:
        routed = T * model.top_k
        mlp_held, mlp_w = mlp(routed, model.expert_ffn)
        mlp_held += routed * h * e                # the tokens as the experts got them
        mlp_w += routed * h * e
        if model.shared_ffn:
            held, w = mlp(T, model.shared_ffn)
            mlp_held, mlp_w = mlp_held + held, mlp_w + w
    held = norms + gemm_inputs + qkv + residual_masks + scores + mlp_held
    weight_held = gemm_inputs + mlp_w
    if rerun:
        layer_input = rep * e
        return Activations(layer_input, 0.0, held)
    return Activations(held, weight_held, 0.0)


def ends(model: Transformer, layout: Layout, batch: Batch) -> tuple[Activations, Activations]:
    """(embedding, head): the embedding keeps its dropout mask; the head its input and the
    loss's fp32 softmax over the vocabulary shard (4 s b V / t bytes)."""
    t, e = layout.tp, (4 if batch.dtype == "fp32" else 2)
    T = layout.micro_batch * batch.sequence / layout.cp
    rep = T * model.hidden / (t if layout.sequence_parallel else 1)
    embedding = Activations(rep * (1 if model.dropout else 0), 0.0, 0.0)
    logits = 4 * T * model.vocab / t
    head = Activations(2 * rep * e + logits, rep * e, logits)
    return embedding, head


@dataclass(frozen=True)
class State:
    """A stage's parameters on one rank and what they cost, bytes by part."""

    parameters: float
    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def rank_parameters(model: Transformer, layout: Layout, moe: bool) -> float:
    """One layer's parameters on one rank: its tensor shard, the experts' also split over the
    expert-parallel ranks."""
    whole = model.layer_params(moe)
    experts = model.experts * model.mlp_params(model.expert_ffn) if moe else 0
    return (whole - experts) / layout.tp + experts / (layout.tp * layout.ep)


def stage_state(parameters: float, batch: Batch, layout: Layout, optimizer: str = "adam",
                largest_layer: float = 0.0) -> State:
    """A stage's state on one rank. The distributed optimizer (ZeRO-1) shards the optimizer's
    state over the data ranks; FSDP (ZeRO-3) shards everything over its shard group and holds
    what it gathers: without a pipeline two layers' 16-bit parameters (the one computing and
    the one prefetched) and one layer's unsharded gradients (`largest_layer`: the largest
    layer's parameters on this rank); under a pipeline, which gathers once per iteration
    (torchtitan does not reshard after the forward there), the whole stage's."""
    dtype = batch.state_dtype
    if layout.fsdp:
        shard = layout.shard
        per = state_bytes_per_parameter(dtype, optimizer, shard, sharded_gradients=True)
        weight = 2 if dtype != "fp32" else 4
        gradient = 2 if dtype == "fp16" else 4
        gathered = parameters if layout.pp > 1 else largest_layer
        weights = parameters * per["weights"] / shard + gathered * weight * \
            (1 if layout.pp > 1 else 2)
        gradients = parameters * per["gradients"] + gathered * gradient
        return State(parameters, weights, gradients, parameters * per["optimizer"])
    per = state_bytes_per_parameter(dtype, optimizer,
                                    layout.dp * layout.cp if layout.distributed_optimizer
                                    else 1)
    return State(parameters, parameters * per["weights"], parameters * per["gradients"],
                 parameters * per["optimizer"])


def mesh_state_bytes(state_bytes: float, state_tensors: int, *, shards: int = 1) -> float:
    """What one rank of a mesh holds at its peak of a stage's `state_bytes` (one tensor rank's
    parameters, gradients and optimizer state, as the plan's blocks give them: `pyplan
    partition --tensor` counts what a tensor rank holds; `state_tensors` tensors of the
    parameters' size): with FSDP's shards under a pipeline, the parameters and gradients whole
    over the data ranks from the first forward to the last backward (pyplan.mesh: one
    all-gather per iteration) beside their shards, and the optimizer's state sharded."""
    if shards <= 1:
        return state_bytes
    per = state_bytes / max(state_tensors, 1)
    return 2 * per + per * state_tensors / shards
