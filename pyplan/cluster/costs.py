"""Time of one micro-batch's pieces on the cluster: per layer (and for the embedding and the
head) the forward F, the input-gradient backward B and the weight-gradient backward W, each a
sum of named parts so that a total can be traced to what makes it.

- GEMMs, fused attention and memory-bound kernels: pyplan.cluster.kernels, by shape (tile
  and wave quantisation, the K loop, the roofline); with fp8 the linear layers' GEMMs run at
  the fp8 peak and pay the casts of their inputs (attention, norms, the head stay 16-bit).
- Unfused attention (Megatron-LM before flash attention): batched GEMMs whose score matrix
  goes through HBM, and the softmax's passes over it.
- Tensor parallelism: two all-reduces per layer in the forward and two in the backward (all-
  gathers and reduce-scatters with sequence parallelism), on the node's links (across nodes
  where the group is wider than a node), blocking unless the framework overlaps them with the
  GEMMs they feed (Megatron-Core by default: a column-parallel linear's input-gradient
  collective beside its weight-gradient GEMM); an MoE layer's experts are sharded as its MLP
  would be.
- Context parallelism (ring attention, causal load balance: each rank holds chunks i and
  2cp-1-i of the sequence, so every rank computes 1/cp of the causal triangle): cp - 1 steps
  each way, each passing the keys and values (backward: and their gradients) to the next rank
  while the current block computes; only what a step's transfer outlasts its block is exposed.
- Expert parallelism: each rank's tokens dispatched to the experts' ranks and combined back
  (an all-to-all each way, forward and backward); each rank computes its experts over every
  rank's tokens routed to them.
- FSDP without a pipeline: each layer's parameters all-gathered before its forward and its
  backward, its gradients reduce-scattered after, per micro-batch; prefetched beside the
  neighbouring layer's compute where the framework does so (only what outlasts it is exposed).
- Host overhead: where a layer's kernels take less than the host needs to launch them, the
  GPU waits for the host.
- Recomputation: full reruns each layer's forward (its collectives too, not FSDP's gathers,
  which the backward makes anyway) before its backward, block only those of each model
  chunk's first N layers; selective reruns attention's core.
Counts follow Megatron-LM's GPT layer (Korthikanti et al. 2022) generalised to grouped
key/value heads, gated MLPs and experts (each expert's GEMMs get its share of the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyplan.cluster import collectives, constants, kernels
from pyplan.cluster.hardware import Cluster
from pyplan.cluster.layout import SPLIT_BACKWARD, Batch, Layout
from pyplan.cluster.model import Transformer

__all__ = ["COMMUNICATION", "Costs", "Work"]

COMMUNICATION = ("tp_comm", "cp_comm", "ep_comm", "fsdp_comm", "pp_comm")
PARTS = ("gemm", "attention", "elementwise", "kernels", "host") + COMMUNICATION


@dataclass
class Work:
    """Seconds of one piece, by part."""

    parts: dict = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    @property
    def compute(self) -> float:
        return self.seconds - sum(self.parts[k] for k in COMMUNICATION)

    @property
    def communication(self) -> float:
        return sum(self.parts[k] for k in COMMUNICATION)

    def add(self, part: str, seconds: float) -> "Work":
        self.parts[part] += seconds
        return self

    def __add__(self, other: "Work") -> "Work":
        return Work({k: self.parts[k] + other.parts[k] for k in PARTS})

    def without(self, part: str) -> "Work":
        return Work({k: (0.0 if k == part else v) for k, v in self.parts.items()})


@dataclass(frozen=True)
class Pieces:
    forward: Work
    backward: Work
    """Input gradient (B), recomputation included."""
    weight: Work
    """Weight gradient (W)."""

    @property
    def seconds(self) -> float:
        """F, B and W together: what one micro-batch of it costs its GPU."""
        return self.forward.seconds + self.backward.seconds + self.weight.seconds


def weight_bytes(batch: Batch) -> float:
    """Bytes of one parameter as the GEMMs read it (and FSDP gathers it): 16-bit, fp8 with an
    fp8 all-gather, fp32 for fp32 runs."""
    return {"fp32": 4, "fp8": 1}.get(batch.dtype, 2)


def gradient_bytes(batch: Batch) -> float:
    """Bytes of one gradient as it is reduced: fp32 main gradients for bf16 (Megatron-LM,
    FSDP2's reduce dtype), 16-bit for fp16."""
    return 2 if batch.dtype == "fp16" else 4


class Costs:
    """The cost model of one model on one cluster with one layout and batch."""

    def __init__(self, model: Transformer, cluster: Cluster, layout: Layout, batch: Batch):
        self.model, self.cluster, self.layout, self.batch = model, cluster, layout, batch
        gpu = self.gpu = cluster.gpu
        self.framework = batch.framework
        self.peak = gpu.peak(batch.state_dtype)
        self.fp8 = batch.dtype == "fp8"
        self.linear_peak = gpu.peak("fp8") * constants.FP8_EFFICIENCY if self.fp8 else self.peak
        self.bytes = 4 if batch.dtype == "fp32" else 2  # activations' element size
        self.tokens = layout.micro_batch * batch.sequence / layout.cp  # per rank
        self.fused = constants.FUSED_ELEMENTWISE if self.framework.fused_kernels else 1.0

    # -- primitives

    def gemm(self, m: float, n: float, k: float, count: float = 1.0,
             fp8: bool = False) -> float:
        """Seconds of `count` GEMMs of m x k by k x n, run as one (batched) kernel: 16-bit,
        or fp8 at the fp8 peak."""
        if fp8:
            return kernels.gemm(self.gpu, self.linear_peak, 1, m, n, k, count)
        return kernels.gemm(self.gpu, self.peak, self.bytes, m, n, k, count)

    def linear(self, m: float, n: float, k: float, count: float = 1.0) -> float:
        """A linear layer's GEMM: fp8 with its input's cast under fp8, else `gemm`."""
        seconds = self.gemm(m, n, k, count, fp8=self.fp8)
        if self.fp8:
            seconds += self.moved(m * k * count * constants.FP8_CAST_BYTES * self.fused)
        return seconds

    def moved(self, nbytes: float) -> float:
        """Seconds of a layer's element-wise kernels moving `nbytes`."""
        return kernels.memory_bound(self.gpu, nbytes)

    def streamed(self, nbytes: float) -> float:
        """Seconds of large contiguous passes over `nbytes`."""
        return kernels.streamed(self.gpu, nbytes)

    def kernels(self, count: float) -> float:
        return kernels.launches(self.gpu, count)

    def tp_collective(self, nbytes: float, overlapped: bool = False) -> float:
        """One all-reduce of `nbytes` over the tensor-parallel group (an all-gather plus a
        reduce-scatter with sequence parallelism moves the same bytes)."""
        t = self.layout.tp
        return collectives.all_reduce(self.cluster, nbytes, t,
                                      self.layout.per_node("tp", self.cluster.gpus_per_node),
                                      overlapped)

    def tp_gather_scatter(self, gathered: float, scattered: float,
                          overlapped: bool = False) -> float:
        """A sequence-parallel all-gather of `gathered` bytes and reduce-scatter of
        `scattered` bytes over the tensor-parallel group."""
        t, per_node = self.layout.tp, self.layout.per_node("tp", self.cluster.gpus_per_node)
        return (collectives.all_gather(self.cluster, gathered, t, per_node, overlapped) +
                collectives.reduce_scatter(self.cluster, scattered, t, per_node, overlapped))

    def _dgrad_exposed(self, nbytes: float, windows: list[float]) -> float:
        """The backward's tensor-parallel communication where each column-parallel linear's
        input-gradient all-reduce (with sequence parallelism: its reduce-scatter; the row-
        parallel linears' all-gathers of the incoming gradient still block) runs beside its
        weight-gradient GEMM (`windows`): what is left of it when the GEMM ends, and the SMs
        it holds meanwhile."""
        t, node = self.layout.tp, self.cluster.gpus_per_node
        per_node = self.layout.per_node("tp", node)
        exposed = 0.0
        overlapping = collectives.reduce_scatter if self.layout.sequence_parallel else \
            collectives.all_reduce
        for window in windows:
            if self.layout.sequence_parallel:
                exposed += collectives.all_gather(self.cluster, nbytes, t, per_node)
            exposed += self._beside(overlapping(self.cluster, nbytes, t, per_node),
                                   overlapping(self.cluster, nbytes, t, per_node, True), window)
        return exposed

    def _beside(self, alone: float, overlapped: float, window: float) -> float:
        """Exposed seconds of a collective (`alone` by itself, `overlapped` beside compute)
        started with `window` seconds of compute: it moves at its overlapped rate while the
        compute runs and at its own once that ends, and holds NCCL's SMs meanwhile."""
        if overlapped <= 0:
            return 0.0
        done = min(1.0, window / overlapped)
        return (1 - done) * alone + self.contention(min(overlapped, window))

    def _tp_exposed(self, collectives_seconds: float, overlapped_seconds: float,
                    gemm_seconds: float) -> float:
        """What of a pass's tensor-parallel communication is exposed: all of it, or with the
        framework's overlap what its chunks do not hide behind the GEMMs they feed (the
        first chunk of each never is)."""
        if not self.framework.tp_comm_overlap:
            return collectives_seconds
        hidden = min(overlapped_seconds, gemm_seconds) * (1 - 1 / max(self.layout.tp, 2))
        # (where the GEMMs are too short to hide the slower overlapped chunks, the blocking
        # collective is the better of the two: no slower than without the overlap)
        return min(collectives_seconds, overlapped_seconds - hidden + self.contention(hidden))

    # -- a layer

    def layer(self, moe: bool, rerun: bool | None = None) -> Pieces:
        """A layer's pieces; `rerun`: its backward first reruns its forward (None: as the
        layout's recomputation says of every layer; block says it of a chunk's first ones)."""
        model, layout, batch = self.model, self.layout, self.batch
        if rerun is None:
            rerun = layout.recompute == "full"
        t, T, b = layout.tp, self.tokens, layout.micro_batch
        h, q, kv = model.hidden, model.q_dim, model.kv_dim
        heads = model.heads / t
        f, b_, w = Work(), Work(), Work()

        # GEMMs with weights: (rows = tokens, output columns, inner) per rank
        weights = [(T, q / t + 2 * self.kv_rank, h), (T, h, q / t)]
        experts, local = [], 0
        column = [0]  # the column-parallel linears (QKV, the first MLP matrix): W's windows
        if not moe:
            column.append(len(weights))
            weights += self._mlp(T, model.ffn / t)
        else:
            weights.append((T, model.experts, h))  # the router (replicated)
            if model.shared_ffn:
                weights += self._mlp(T, model.shared_ffn / t)
            local = model.experts // layout.ep
            routed = T * model.top_k * layout.ep / model.experts  # tokens per local expert
            experts = self._mlp(routed, model.expert_ffn / t)
        windows = []
        for i, (m_, n_, k_) in enumerate(weights):
            f.add("gemm", self.linear(m_, n_, k_))
            b_.add("gemm", self.linear(m_, k_, n_))
            w.add("gemm", gradient := self.linear(k_, n_, m_))
            if i in column:
                windows.append(gradient)
        for i, (m_, n_, k_) in enumerate(experts):
            f.add("gemm", self.linear(m_, n_, k_, local))
            b_.add("gemm", self.linear(m_, k_, n_, local))
            w.add("gemm", gradient := self.linear(k_, n_, m_, local))
            if i == 0:
                windows.append(gradient)

        # Attention's s x s products (and context parallelism's ring)
        core_f, core_b = self.attention_core(b, heads)
        f.add("attention", core_f)
        b_.add("attention", core_b)
        if layout.cp > 1:
            ring_f, ring_b = self.cp_ring(core_f, core_b)
            f.add("cp_comm", ring_f)
            b_.add("cp_comm", ring_b)

        # Element-wise work and kernels
        ew = self.elementwise_forward(moe) * self.fused
        f.add("elementwise", self.moved(ew))
        b_.add("elementwise", self.moved(ew * constants.BACKWARD_ELEMENTWISE))
        launches = 14 + (4 if model.dropout else 0) + (2 * local if moe else 0)
        f.add("kernels", self.kernels(launches))
        b_.add("kernels", self.kernels(launches * 1.5))

        # Tensor parallelism: two collectives each way (the experts' as the MLP's); an MoE
        # layer's backward also sums the routing weights' gradient (fp32, top-k per token),
        # which each rank computes a part of (its slice of the experts)
        if t > 1:
            nbytes = T * h * self.bytes
            comm, overlapped = self.tp_collective(nbytes), self.tp_collective(nbytes, True)
            forward, forward_overlapped = comm, overlapped
            if self.fp8 and layout.sequence_parallel:
                # the column-parallel GEMMs' inputs are cast to fp8 before their all-gather
                # (Transformer Engine, torchao's Float8ColwiseParallel): half the bytes; the
                # reduce-scatters and the backward's collectives stay 16-bit
                forward, forward_overlapped = (self.tp_gather_scatter(nbytes / 2, nbytes, o)
                                               for o in (False, True))
            f.add("tp_comm", self._tp_exposed(2 * forward, 2 * forward_overlapped,
                                              f.parts["gemm"]))
            if self.framework.tp_dgrad_overlap and not self.framework.tp_comm_overlap and \
                    layout.schedule not in SPLIT_BACKWARD:
                b_.add("tp_comm", self._dgrad_exposed(nbytes, windows))
            else:
                b_.add("tp_comm", self._tp_exposed(2 * comm, 2 * overlapped,
                                                  b_.parts["gemm"]))
            if moe:
                b_.add("tp_comm", collectives.all_reduce(
                    self.cluster, T * model.top_k * 4, t,
                    layout.per_node("tp", self.cluster.gpus_per_node)))
        if moe and layout.ep > 1:
            dispatch = self.all_to_all(T * model.top_k * h * self.bytes /
                                       (t if layout.sequence_parallel else 1))
            f.add("ep_comm", 2 * dispatch)
            b_.add("ep_comm", 2 * dispatch)

        self._host(f, b_, w)
        if rerun:
            b_ = b_ + f
        elif layout.recompute == "selective":
            b_ = b_ + Work().add("attention", core_f).add(
                "elementwise", self.moved(self.score_bytes(b, heads, batch.sequence)))
        if layout.fsdp and layout.pp == 1:
            self._fsdp(f, b_, model.layer_params(moe))
        return Pieces(f, b_, w)

    @property
    def kv_rank(self) -> float:
        """Key/value width per tensor rank (heads replicated where fewer than tp)."""
        model, t = self.model, self.layout.tp
        return model.kv_dim / t if model.kv_heads % t == 0 else \
            model.head_dim * max(1, model.kv_heads // t)

    def all_to_all(self, nbytes: float) -> float:
        return collectives.all_to_all(self.cluster, nbytes, self.layout.ep,
                                      self.layout.per_node("ep", self.cluster.gpus_per_node))

    def cp_ring(self, core_f: float, core_b: float) -> tuple[float, float]:
        """Exposed seconds of ring attention's key/value exchange, forward and backward: cp - 1
        steps, each a send to the next rank of the ring of this rank's keys and values (the
        backward: and their gradients) beside one step's block of attention."""
        layout, cluster = self.layout, self.cluster
        cp = layout.cp
        nbytes = 2 * self.tokens * self.kv_rank * self.bytes  # this rank's keys and values
        across = layout.per_node("cp", cluster.gpus_per_node) < cp
        step = collectives.send(cluster, nbytes, across)
        step_f, step_b = core_f / cp, core_b / cp
        forward = (cp - 1) * max(0.0, step - step_f)
        backward = (cp - 1) * max(0.0, 2 * step - step_b)
        return forward, backward

    def contention(self, overlapped: float) -> float:
        """Compute lost to the SMs a collective holds while it overlaps compute for
        `overlapped` seconds."""
        return overlapped * constants.NCCL_SMS / self.gpu.sms

    def _host(self, f: Work, b_: Work, w: Work) -> None:
        """The GPU waits for the host where a pass's kernels are shorter than its launch."""
        host = constants.LAYER_US * 1e-6 * self.framework.host_overhead
        f.add("host", max(0.0, host - f.compute))
        b_.add("host", max(0.0, host - b_.compute - w.compute))

    def _fsdp(self, f: Work, b_: Work, parameters: float) -> None:
        """A layer's FSDP traffic per micro-batch: the parameters gathered for its forward and
        its backward, the gradients reduce-scattered (with HSDP, all-reduced across the
        replicas too); prefetched, only what outlasts the compute beside it is exposed."""
        gather, reduce = self.fsdp_traffic(parameters, self.framework.overlap_param_gather)
        if self.framework.overlap_param_gather:
            f.add("fsdp_comm", max(0.0, gather - f.compute))
            b_.add("fsdp_comm", max(0.0, gather + reduce - b_.compute))
            f.add("gemm", self.contention(min(gather, f.compute)))
            b_.add("gemm", self.contention(min(gather + reduce, b_.compute)))
        else:
            f.add("fsdp_comm", gather)
            b_.add("fsdp_comm", gather + reduce)

    def fsdp_traffic(self, parameters: float, overlapped: bool) -> tuple[float, float]:
        """(all-gather, reduce-scatter [+ replica all-reduce]) seconds of `parameters` (the
        whole layer's: each rank gathers its tensor shard's)."""
        layout, cluster, node = self.layout, self.cluster, self.cluster.gpus_per_node
        shard = layout.shard
        mine = parameters / layout.tp
        gather = collectives.all_gather(cluster, mine * weight_bytes(self.batch), shard,
                                        layout.per_node("shard", node), overlapped)
        grads = mine * gradient_bytes(self.batch)
        reduce = collectives.reduce_scatter(cluster, grads, shard,
                                            layout.per_node("shard", node), overlapped)
        if layout.dp_replicate > 1:
            reduce += collectives.all_reduce(cluster, grads / shard, layout.dp_replicate,
                                             layout.per_node("replicate", node), overlapped)
        return gather, reduce

    def _mlp(self, rows: float, width: float) -> list[tuple[float, float, float]]:
        h = self.model.hidden
        into = width * (2 if self.model.gated else 1)
        return [(rows, into, h), (rows, h, width)]

    def attention_core(self, b: int, heads: float) -> tuple[float, float]:
        """Forward and backward seconds of QK^T, softmax and PV for one micro-batch on one
        rank: fused (its 1/cp of the causal triangle, in cp ring steps), or unfused."""
        d, s, cp = self.model.head_dim, self.batch.sequence, self.layout.cp
        if self.batch.flash_attention:
            bias = self.model.alibi
            if cp == 1:
                return kernels.attention(self.gpu, self.peak, b, heads, s, s, d, bias=bias)
            # the diagonal step is causal; each of the others computes half of its block
            diagonal = kernels.attention(self.gpu, self.peak, b, heads, s / cp, s / cp, d,
                                         bias=bias)
            block = kernels.attention(self.gpu, self.peak, b, heads, s / cp, s / cp, d,
                                      causal=False, bias=bias)
            return (diagonal[0] + (cp - 1) * block[0] / 2,
                    diagonal[1] + (cp - 1) * block[1] / 2)
        count = b * heads
        forward = self.gemm(s, s, d, count) + self.gemm(s, d, s, count)
        backward = 2 * forward
        return forward, backward

    def score_bytes(self, b: int, heads: float, s: int) -> float:
        """Bytes the unfused softmax (and attention dropout) move over the score matrix."""
        if self.batch.flash_attention:
            return 0.0
        scores = b * heads * s * s
        per = 2 * self.bytes + ((2 * self.bytes + 1) if self.model.dropout else 0)
        return scores * per

    def elementwise_forward(self, moe: bool) -> float:
        """HBM bytes a layer's forward moves outside the GEMMs, per rank."""
        model, layout, batch = self.model, self.layout, self.batch
        t, T, e = layout.tp, self.tokens, self.bytes
        h, q, kv = model.hidden, model.q_dim, model.kv_dim
        replicated = T * h / (t if layout.sequence_parallel else 1)
        norm, rotary, gate = 2 * e, 2 * e, 3 * e           # fused: read, write (gate: 2 in)
        if self.framework.decomposed:  # eager PyTorch's (16-bit e; fp32 skips the casts)
            cast = e + 4 if e < 4 else 0                    # up to fp32 and back, each
            if model.norm == "rmsnorm":                     # square, mean, scale, weight
                norm = 2 * cast + 8 + 4 + 8 + 2 * e
            rotary = 2 * cast + 8                           # the complex product in fp32
            gate = 2 * e + 3 * e                            # SiLU, then the product
        total = 2 * norm * replicated                       # two norms
        total += 2 * 3 * replicated * e                     # two residual adds
        if model.dropout:
            total += 2 * replicated * 1                     # their dropout masks
        total += 2 * (q + 2 * model.kv_dim) * T / t * e     # q, k, v into head layout
        total += 2 * q * T / t * e                          # the context back
        if model.rotary:
            total += rotary * (q + kv) * T / t              # rotary on q and k
        total += self.score_bytes(layout.micro_batch, model.heads / t, batch.sequence)
        mlp = gate if model.gated else 2 * e                # per element of the inner width
        if not moe:
            total += mlp * model.ffn * T / t
        else:
            routed = T * model.top_k
            total += 2 * 2 * routed * h * e                # tokens to experts and back
            total += mlp * model.expert_ffn * routed / t
            if model.shared_ffn:
                total += mlp * model.shared_ffn * T / t
        return total

    # -- the ends of the model

    def embedding(self) -> Pieces:
        """The lookup (and position embeddings): memory-bound, one all-reduce (or
        reduce-scatter) over the vocabulary shards; its weight gradient a scatter-add."""
        model, t, T, e = self.model, self.layout.tp, self.tokens, self.bytes
        rows = T * model.hidden * e
        f = Work().add("elementwise", self.moved(2 * rows * (2 if model.positions else 1)))
        f.add("kernels", self.kernels(3))
        w = Work().add("elementwise", self.moved(3 * rows)).add("kernels", self.kernels(2))
        if t > 1:
            f.add("tp_comm", self.tp_collective(rows))
        return Pieces(f, Work(), w)

    def head(self) -> Pieces:
        """The final norm, the logits GEMM and the cross-entropy over the vocabulary (fp32
        passes over the logits, two small all-reduces across the vocabulary shards)."""
        model, t, T, e = self.model, self.layout.tp, self.tokens, self.bytes
        h, v = model.hidden, model.vocab / t
        replicated = T * h / (t if self.layout.sequence_parallel else 1)
        f, b_, w = Work(), Work(), Work()
        f.add("elementwise", self.moved(2 * replicated * e))
        f.add("gemm", self.gemm(T, v, h))
        b_.add("gemm", self.gemm(T, h, v))
        w.add("gemm", self.gemm(h, v, T))
        logits = T * v
        f.add("elementwise", self.streamed(logits * (e + 4 + 3 * 4)))  # fp32, max, exp-sum
        b_.add("elementwise", self.streamed(logits * (4 + e)) + self.moved(2 * replicated * e))
        f.add("kernels", self.kernels(8))
        b_.add("kernels", self.kernels(4))
        w.add("kernels", self.kernels(1))
        if t > 1:
            f.add("tp_comm", 2 * self.tp_collective(T * 4) +
                  self.tp_collective(T * h * e))  # max, sum; the sequence back together
            b_.add("tp_comm", self.tp_collective(T * h * e))
        if self.layout.recompute == "full":
            b_ = b_ + Work().add("elementwise", self.moved(2 * replicated * e))
        return Pieces(f, b_, w)
