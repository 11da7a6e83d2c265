"""The cost model's constants: each a physical quantity, with where its value comes from.

Fitted (least squares on `../shared/cluster`'s rows, `benchmarks/cluster.py --fit`, each
checked by leaving one source out): K_OVERHEAD, LAYER_US, OVERLAP_SHARE, ATTENTION_BACKWARD,
ATTENTION_SHARE and MEMORY_EFFICIENCY. MATMUL_EFFICIENCY was fitted on the zero bubble paper's
W passes (pure GEMMs). Everything else is a first-principles or spec-sheet value, and a
cluster file may override the per-GPU and per-link ones.
"""

# GPU (A100 defaults; presets override what differs)
SMS = 108
"""Streaming multiprocessors: a GEMM's output tiles run in waves of this many (A100: 108,
H100 SXM: 132)."""
MATMUL_EFFICIENCY = 0.77
"""Fraction of the dense tensor-core peak a large, well-shaped GEMM reaches. Fitted: the zero
bubble paper's W passes (pure GEMMs) run at 238-252 TFLOP/s on A100 (0.76-0.81 of 312)."""
ATTENTION_EFFICIENCY = 0.55
"""Fraction of peak a fused (flash) attention kernel reaches on the FLOPs it computes
(FlashAttention-2 reports 50-73% of A100 peak forward and backward at head dim 128)."""
ATTENTION_BACKWARD = 2.5
"""Fused attention's backward time over its forward's: 2.5 times the FLOPs (the scores are
recomputed; dQ, dK, dV), and FlashAttention-2 runs its backward below its forward's rate
(its paper: ~0.8 of it on A100 and H100), so ~3. Fitted within 2.5-3.5."""
ATTENTION_SHARE = 0.68
"""What the trainers' fused attention reaches relative to each GPU's `attention_efficiency`
(FlashAttention-2's own figures): SDPA's dispatch, short sequences, head dimensions below 128
reach less (a kernel with ALiBi's bias: BIAS_ATTENTION of this). Fitted."""
BIAS_ATTENTION = 0.8
"""A fused attention kernel that adds a bias to its scores (ALiBi: MPT, BLOOM) relative to one
that does not: it computes the bias per score tile. Fitted (only MPT's rows have one)."""
MEMORY_EFFICIENCY = 0.53
"""Fraction of HBM bandwidth that memory-bound kernels (norms, activations, softmax, dropout,
layout copies) reach, with pyplan's count of what each reads and writes. Fitted on the zero
bubble paper's F - W and B - W times."""
STREAM_EFFICIENCY = 0.90
"""Fraction of HBM bandwidth a large contiguous pass reaches: a memory-bound GEMM (attention's
s x s products), the loss's passes over the logits (STREAM benchmarks: ~90% on A100 and H100)."""
K_OVERHEAD = 110.0
"""A GEMM tile's K-loop prologue and epilogue (filling the pipeline of loads, writing the tile
out), in elements of K on an A100: a GEMM with inner dimension k runs at k / (k + K_OVERHEAD)
of its tile's rate there. The time is fixed (load latency, the tile's write), so a GPU whose
SMs compute faster pays more elements' worth: K_OVERHEAD times its per-SM rate over
REFERENCE_SM_FLOPS. Fitted."""
REFERENCE_SM_FLOPS = 312e12 / 108
"""An A100's dense 16-bit tensor rate per SM, FLOP/s: what K_OVERHEAD is counted at."""
LAYER_US = 60.0
"""Host time per transformer layer and pass (Python, autograd, dispatching its ~15-25
kernels) that the GPU waits for where a layer's kernels are shorter than their launches.
Fitted; a framework scales it."""
OVERLAP_SHARE = 0.50
"""Share of its bandwidth a collective keeps while compute kernels run beside it (NCCL gets
fewer SMs for its channels and shares HBM). Fitted."""
NCCL_SMS = 16
"""SMs NCCL's kernels hold while a collective runs beside compute (one per channel; 8-16
channels on NVLink and InfiniBand): the compute beside it runs on the others, so an overlapped
collective still costs NCCL_SMS / sms of its duration in compute."""
FUSED_ELEMENTWISE = 0.6
"""Share of the element-wise bytes that remain when norms, activations, casts and rotary are
fused (Transformer Engine, torch.compile) rather than run as one kernel each."""
FP8_EFFICIENCY = 0.8
"""An fp8 GEMM's share of the fp8 peak relative to a 16-bit GEMM's share of its own: cuBLASLt
on H100 SXM reaches ~1,100-1,300 of 1,979 fp8 TFLOP/s where bf16 reaches ~700 of 989 (fp8
runs 1.3-1.6x faster, not 2x, in Transformer Engine's and torchao's benchmarks)."""
FP8_CAST_BYTES = 3.0
"""HBM bytes per element of an fp8 GEMM's 16-bit input: read it (2), write its fp8 copy (1);
the scaling's amax is taken in the same pass (delayed or current tensor-wise scaling)."""
COLLECTIVE_US = 8.0
"""Fixed cost of launching one NCCL collective and synchronising its ranks, microseconds."""
KERNEL_US = 4.0
"""Fixed cost of one kernel launch and its tail, microseconds (what makes tiny layers slow)."""
RESERVED_GIB = 2.0
"""What a GPU holds besides the model's tensors: CUDA context and cuBLAS workspace (~0.6 GiB),
NCCL buffers (~0.5 GiB per communicator set) and the caching allocator's fragmentation."""

# Links (NCCL ring bandwidth as a share of the spec-sheet one-direction bandwidth)
LINK_EFFICIENCY = 0.78
"""NVLink/NVSwitch: nccl-tests' all-reduce bus bandwidth on DGX A100 is ~230-240 GB/s of 300."""
NETWORK_EFFICIENCY = 0.90
"""InfiniBand: ~22-23 GB/s of a 200 Gb/s HDR port's 25 GB/s in nccl-tests across nodes."""
LINK_LATENCY_US = 3.4
"""Latency of one ring step of a collective inside a node with NCCL's Simple protocol (the one
large messages use), microseconds: NCCL's own tuning model (src/graph/tuning.cc) counts 3.4 on
NVLink. The LL and LL128 protocols' steps are shorter in NCCL_PROTOCOLS' proportions."""
NETWORK_LATENCY_US = 9.6
"""The same across nodes (InfiniBand and NCCL's proxy thread): 9.6 in NCCL's tuning model."""
NCCL_PROTOCOLS = {
    # protocol: (share of the bus bandwidth, fixed latency us, ring step inside a node us,
    #            across nodes us, tree step inside us, across us, tree's fixed latency us)
    "LL": (0.25, 3.6, 0.47, 2.7, 0.52, 5.0, 4.4),
    "LL128": (0.92, 10.0, 1.9, 4.0, 1.2, 8.5, 4.4),
    "Simple": (1.0, 8.4, 3.4, 9.6, 28.0, 50.0, 0.0),
}
"""NCCL's three protocols as its tuning model prices them (the figures of src/graph/tuning.cc,
the table NCCL picks a protocol and an algorithm by): LL flags every 8-byte word (a quarter of
the bandwidth reaches payload across nodes or in an all-reduce, a third otherwise, the
quickest steps), LL128 every 128-byte line (92%), Simple moves whole chunks (all of it, the
slowest steps; a tree's Simple step waits for a 256 kB chunk). A collective takes whichever is
fastest at its size. The step latencies scale with a cluster's `latency_us` values, which are
Simple's ring steps (LINK_LATENCY_US, NETWORK_LATENCY_US)."""
LL_INTRA_ACROSS_NODES = 1.8
"""LL's steps inside a node take 1.8 times as long when the collective also spans nodes (NCCL's
tuning model)."""
RING_PLATEAU = 1.9
"""A ring all-reduce across nodes of at least ranks/16 x 64 KiB with the Simple protocol pays
1.9 times its latency (NCCL's tuning model: the ring's plateau, measured)."""
TREE_BANDWIDTH = 0.9
"""A tree all-reduce reaches 0.9 of the ring's bus bandwidth (NCCL's tuning model)."""

# Work the model counts per element
BACKWARD_ELEMENTWISE = 0.7
"""An element-wise op's backward moves about twice its forward's bytes (it reads the incoming
gradient and what the forward saved, and writes a gradient)."""
GRAD_ACCUMULATION_BYTES = 20
"""HBM bytes per parameter of adding one micro-batch's bf16 gradients into fp32 ones as a pass
of their own (DeepSpeed's BF16_Optimizer): the 16-bit gradient cast up (2 + 4), added into
the fp32 one (4 + 4 + 4), and zeroed for the next micro-batch (2)."""
ADAM_BYTES = {"bf16": 30, "fp16": 30, "fp32": 28}
"""HBM bytes Adam moves per parameter at its step, a memory-bound pass: the fp32 master weight,
its two moments and the gradient read (16), the three written back (12), and with mixed
precision the 16-bit weight written (2)."""
