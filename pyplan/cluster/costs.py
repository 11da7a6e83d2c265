"""Time of one micro-batch's pieces on the cluster: per layer (and for the embedding and the
head) the forward F, the input-gradient backward B and the weight-gradient backward W, each a
sum of named parts so that a total can be traced to what makes it.

- GEMMs: 2MNK FLOPs at the GPU's large-GEMM efficiency, less where the matrix edges leave
  output tiles partly empty or the tiles fill the last wave of SMs partly (the shape
  dependence: small hidden sizes and micro-batches run below peak), never faster than reading
  and writing the three matrices from HBM (the roofline), plus a kernel's fixed cost.
- Attention's s x s products: batched GEMMs whose score matrix goes through HBM (unfused), or
  one fused kernel at its own efficiency on the causal half (flash attention).
- Element-wise work (norms, activations, softmax, dropout, layout copies): bytes each op reads
  and writes, at the memory-bound kernels' share of HBM bandwidth.
- Tensor parallelism: two all-reduces per layer in the forward and two in the backward (all-
  gathers and reduce-scatters with sequence parallelism), on the node's links, not hidden
  behind compute (as Megatron-LM runs them by default); an MoE layer's experts are sharded as
  its MLP would be (each rank every expert's slice of the inner width, the router whole), and
  its backward sums the routing weights' gradient too.
- Recomputation: full reruns each layer's forward before its backward; selective reruns the
  attention core only.
Counts follow Megatron-LM's GPT layer (Korthikanti et al. 2022) generalised to grouped
key/value heads, gated MLPs and experts (each expert's GEMMs get its share of the tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pyplan.cluster import constants
from pyplan.cluster.hardware import Cluster
from pyplan.cluster.layout import Batch, Layout
from pyplan.cluster.model import Transformer

__all__ = ["Costs", "Work"]

PARTS = ("gemm", "attention", "elementwise", "tp_comm", "kernels")


@dataclass
class Work:
    """Seconds of one piece, by part."""

    parts: dict = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    @property
    def compute(self) -> float:
        return self.seconds - self.parts["tp_comm"]

    def add(self, part: str, seconds: float) -> "Work":
        self.parts[part] += seconds
        return self

    def __add__(self, other: "Work") -> "Work":
        return Work({k: self.parts[k] + other.parts[k] for k in PARTS})



@dataclass(frozen=True)
class Pieces:
    forward: Work
    backward: Work
    """Input gradient (B), recomputation included."""
    weight: Work
    """Weight gradient (W)."""


class Costs:
    """The cost model of one model on one cluster with one layout and batch."""

    def __init__(self, model: Transformer, cluster: Cluster, layout: Layout, batch: Batch):
        self.model, self.cluster, self.layout, self.batch = model, cluster, layout, batch
        gpu = cluster.gpu
        self.peak = gpu.peak(batch.dtype)
        self.bytes = 4 if batch.dtype == "fp32" else 2  # activations' element size
        self.hbm = gpu.memory_bandwidth_gbs * 1e9 * gpu.memory_efficiency
        # Large contiguous passes (a GEMM's operands, an s x s score matrix, the loss's passes
        # over the logits) stream near the bandwidth; a layer's many small element-wise
        # kernels and layout copies get the fitted, lower share.
        self.stream_hbm = gpu.memory_bandwidth_gbs * 1e9 * constants.STREAM_EFFICIENCY
        self.tokens = layout.micro_batch * batch.sequence

    # -- primitives

    def gemm(self, m: float, n: float, k: float, count: float = 1.0) -> float:
        """Seconds of `count` GEMMs of m x k by k x n, run as one (batched) kernel."""
        if m <= 0 or n <= 0 or k <= 0 or count <= 0:
            return 0.0
        gpu, tile = self.cluster.gpu, constants.TILE
        tiles = math.ceil(m / tile) * math.ceil(n / tile) * count
        waves = math.ceil(tiles / gpu.sms)
        use = m * n * count / (tile * tile * waves * gpu.sms)  # full tiles, full waves: 1
        compute = 2 * m * n * k * count / (self.peak * gpu.matmul_efficiency * use)
        memory = self.bytes * (m * k + k * n + m * n) * count / self.stream_hbm
        return max(compute, memory) + self.kernels(1)

    def moved(self, nbytes: float) -> float:
        """Seconds of a layer's element-wise kernels moving `nbytes`."""
        return nbytes / self.hbm

    def streamed(self, nbytes: float) -> float:
        """Seconds of large contiguous passes over `nbytes`."""
        return nbytes / self.stream_hbm

    def kernels(self, count: float) -> float:
        return count * self.cluster.gpu.kernel_us * 1e-6

    def tp_collective(self, nbytes: float) -> float:
        """One all-reduce of `nbytes` over the tensor-parallel group (an all-gather plus a
        reduce-scatter with sequence parallelism moves the same bytes)."""
        t = self.layout.tp
        return self.cluster.all_reduce(nbytes, t, t)

    # -- a layer

    def layer(self, moe: bool) -> Pieces:
        model, layout, batch = self.model, self.layout, self.batch
        t, T, s, b = layout.tp, self.tokens, batch.sequence, layout.micro_batch
        h, q, kv = model.hidden, model.q_dim, model.kv_dim
        kv_rank = kv / t if model.kv_heads % t == 0 else model.head_dim * max(
            1, model.kv_heads // t)
        heads = model.heads / t
        f, b_, w = Work(), Work(), Work()

        # GEMMs with weights: (rows = tokens, output columns, inner) per rank
        weights = [(T, q / t + 2 * kv_rank, h), (T, h, q / t)]
        experts = []
        if not moe:
            weights += self._mlp(T, model.ffn / t)
        else:
            weights.append((T, model.experts, h))  # the router (replicated)
            if model.shared_ffn:
                weights += self._mlp(T, model.shared_ffn / t)
            routed = T * model.top_k / model.experts  # tokens per expert, on average
            experts = self._mlp(routed, model.expert_ffn / t)
        for m_, n_, k_ in weights:
            f.add("gemm", self.gemm(m_, n_, k_))
            b_.add("gemm", self.gemm(m_, k_, n_))
            w.add("gemm", self.gemm(k_, n_, m_))
        for m_, n_, k_ in experts:
            f.add("gemm", self.gemm(m_, n_, k_, model.experts))
            b_.add("gemm", self.gemm(m_, k_, n_, model.experts))
            w.add("gemm", self.gemm(k_, n_, m_, model.experts))

        # Attention's s x s products
        core_f, core_b = self.attention_core(b, heads, s)
        f.add("attention", core_f)
        b_.add("attention", core_b)

        # Element-wise work and kernels
        ew = self.elementwise_forward(moe)
        f.add("elementwise", self.moved(ew))
        b_.add("elementwise", self.moved(ew * constants.BACKWARD_ELEMENTWISE))
        launches = 14 + (4 if model.dropout else 0) + (2 * model.experts if moe else 0)
        f.add("kernels", self.kernels(launches))
        b_.add("kernels", self.kernels(launches * 1.5))

        # Tensor parallelism: two collectives each way (the experts' as the MLP's); an MoE
        # layer's backward also sums the routing weights' gradient (fp32, top-k per token),
        # which each rank computes a part of (its slice of the experts)
        if t > 1:
            comm = self.tp_collective(T * h * self.bytes)
            f.add("tp_comm", 2 * comm)
            b_.add("tp_comm", 2 * comm)
            if moe:
                b_.add("tp_comm", self.cluster.all_reduce(T * model.top_k * 4, t, t))

        if layout.recompute == "full":
            b_ = b_ + f
        elif layout.recompute == "selective":
            b_ = b_ + Work().add("attention", core_f).add(
                "elementwise", self.moved(self.score_bytes(b, heads, s)))
        return Pieces(f, b_, w)

    def _mlp(self, rows: float, width: float) -> list[tuple[float, float, float]]:
        h = self.model.hidden
        into = width * (2 if self.model.gated else 1)
        return [(rows, into, h), (rows, h, width)]

    def attention_core(self, b: int, heads: float, s: int) -> tuple[float, float]:
        """Forward and backward seconds of QK^T, softmax and PV for one micro-batch."""
        d = self.model.head_dim
        if self.batch.flash_attention:
            flops = 4 * b * heads * s * s * d * 0.5  # causal: the lower triangle
            rate = self.peak * self.cluster.gpu.attention_efficiency
            return flops / rate + self.kernels(1), 2.5 * flops / rate + self.kernels(2)
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
        total = 2 * 2 * replicated * e                      # two norms: read, write
        total += 2 * 3 * replicated * e                     # two residual adds
        if model.dropout:
            total += 2 * replicated * 1                     # their dropout masks
        total += 2 * (q + 2 * model.kv_dim) * T / t * e     # q, k, v into head layout
        total += 2 * q * T / t * e                          # the context back
        if model.positions == 0:
            total += 2 * (q + kv) * T / t * e               # rotary on q and k
        total += self.score_bytes(layout.micro_batch, model.heads / t, batch.sequence)
        if not moe:
            total += (3 if model.gated else 2) * model.ffn * T / t * e
        else:
            routed = T * model.top_k
            total += 2 * 2 * routed * h * e                # tokens to experts and back
            total += (3 if model.gated else 2) * model.expert_ffn * routed / t * e
            if model.shared_ffn:
                total += (3 if model.gated else 2) * model.shared_ffn * T / t * e
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
            f.add("tp_comm", 2 * self.cluster.all_reduce(T * 4, t, t) +
                  self.tp_collective(T * h * e))  # max, sum; the sequence back together
            b_.add("tp_comm", self.tp_collective(T * h * e))
        if self.layout.recompute == "full":
            b_ = b_ + Work().add("elementwise", self.moved(2 * replicated * e))
        return Pieces(f, b_, w)
