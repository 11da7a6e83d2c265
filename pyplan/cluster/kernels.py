"""The time of one GPU's kernels by shape: GEMMs, fused attention and memory-bound passes.

- A GEMM (m x k by k x n, `count` of them batched) computes its output in tiles, each on one
  SM; the tiles run in waves of the GPU's SMs. cuBLAS picks the tile that finishes first among
  a few (large tiles reach more of the peak, small ones waste less of a ragged edge or a last,
  partly filled wave), so the time is the best of: 2mnk FLOPs at the large-GEMM efficiency
  times the tile's own efficiency, divided by the share of the waves' tile slots the matrix
  fills. Each tile also pays its K loop's prologue and epilogue (filling the pipeline of loads,
  writing the tile out), a fixed time worth `K_OVERHEAD` elements of K on an A100's SM (more
  on faster SMs): a short K loop (a tensor-parallel
  rank's out-projection, attention's head dimension) runs far below peak. A GEMM is never
  faster than reading its operands and writing its result from HBM (the roofline), and each
  kernel pays a launch.
- Fused (flash) attention: its FLOPs on the causal half at the GPU's attention efficiency
  (a kernel adding ALiBi's bias to its scores at BIAS_ATTENTION of that),
  its query blocks (128 rows of one head of one sequence) in waves of SMs, and its inner loop
  over the keys (half the sequence on average) paying the same prologue as a GEMM's K loop.
- Memory-bound kernels (norms, activations, residual adds, casts, layout copies): bytes at the
  share of HBM bandwidth such kernels reach (fitted), large contiguous passes at the STREAM
  share.
"""

from __future__ import annotations

import math

from pyplan.cluster import constants
from pyplan.cluster.hardware import Gpu

__all__ = ["attention", "gemm", "launches", "memory_bound", "streamed"]

# (rows, columns, efficiency relative to the largest tile): CUTLASS/cuBLAS tensor-core tiles
TILES = ((256, 128, 1.0), (128, 256, 1.0), (128, 128, 0.92), (128, 64, 0.80), (64, 64, 0.62))
QUERY_BLOCK = 128


def launches(gpu: Gpu, count: float) -> float:
    return count * gpu.kernel_us * 1e-6


def _k_use(gpu: Gpu, peak: float, k: float) -> float:
    """The share of a tile's time its K loop computes: the prologue and epilogue take a fixed
    time, K_OVERHEAD elements of K at an A100's per-SM rate, so more elements on SMs that
    compute faster (an H100's, an fp8 GEMM's)."""
    overhead = constants.K_OVERHEAD * (peak / gpu.sms) / constants.REFERENCE_SM_FLOPS
    return k / (k + overhead)


def gemm(gpu: Gpu, peak: float, element: float, m: float, n: float, k: float,
         count: float = 1.0, stream: float | None = None) -> float:
    """Seconds of `count` GEMMs of m x k by k x n with operands of `element` bytes, at
    `peak` FLOP/s, as one (batched) kernel."""
    if m <= 0 or n <= 0 or k <= 0 or count <= 0:
        return 0.0
    flops = 2 * m * n * k * count
    best = math.inf
    for rows, cols, efficiency in TILES:
        tiles = math.ceil(m / rows) * math.ceil(n / cols) * count
        slots = math.ceil(tiles / gpu.sms) * gpu.sms * rows * cols
        use = m * n * count / slots
        best = min(best, flops / (peak * gpu.matmul_efficiency * efficiency * use))
    best /= _k_use(gpu, peak, k)
    stream = stream or gpu.memory_bandwidth_gbs * 1e9 * constants.STREAM_EFFICIENCY
    memory = (element * (m * k + k * n) + max(2.0, element) * m * n) * count / stream
    return max(best, memory) + launches(gpu, 1)


def attention(gpu: Gpu, peak: float, sequences: float, heads: float, queries: float,
              keys: float, head_dim: int, causal: bool = True,
              bias: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of fused attention: `queries` rows against `keys` keys per
    head and sequence (causal: the lower triangle, keys == queries in length); the backward
    (2.5 times the forward's FLOPs: it recomputes the scores) takes ATTENTION_BACKWARD times
    the forward's time."""
    if sequences <= 0 or heads <= 0 or queries <= 0:
        return 0.0, 0.0
    share = 0.5 if causal else 1.0
    flops = 4 * sequences * heads * queries * keys * head_dim * share
    blocks = sequences * math.ceil(heads) * math.ceil(queries / QUERY_BLOCK)
    use = blocks / (math.ceil(blocks / gpu.sms) * gpu.sms)
    loop = _k_use(gpu, peak, keys * share)
    rate = peak * gpu.attention_efficiency * constants.ATTENTION_SHARE * use * loop
    if bias:
        rate *= constants.BIAS_ATTENTION
    return (flops / rate + launches(gpu, 1),
            constants.ATTENTION_BACKWARD * flops / rate + launches(gpu, 2))


def memory_bound(gpu: Gpu, nbytes: float) -> float:
    """Seconds of element-wise kernels moving `nbytes`."""
    share = gpu.memory_efficiency or constants.MEMORY_EFFICIENCY
    return nbytes / (gpu.memory_bandwidth_gbs * 1e9 * share)


def streamed(gpu: Gpu, nbytes: float) -> float:
    """Seconds of large contiguous passes over `nbytes`."""
    return nbytes / (gpu.memory_bandwidth_gbs * 1e9 * constants.STREAM_EFFICIENCY)
