"""The software a run uses: the same layout runs at different speeds in Megatron-LM, in NVIDIA's
NeMo recipes and in torchtitan, because they overlap different communication with compute,
fuse different kernels and pay different per-layer host overheads. Each framework is a set of
switches the cost model reads; `pyplan plan --framework` picks one and its flags change an
overlap (docs/cluster-planning.md says what each assumes and why).

- megatron: Megatron-LM with its own defaults. Its overlaps are opt-in flags
  (`--overlap-grad-reduce`, `--overlap-param-gather`, `--tp-comm-overlap`), so off; its own
  and apex's fused kernels (layer norm, bias + GeLU, scaled masked softmax) are the baseline
  the element-wise byte counts describe; a column-parallel linear's input-gradient collective
  overlaps its weight-gradient GEMM (Megatron-Core does so by default); pipeline sends overlap
  compute under the interleaved
  schedule (its `--overlap-p2p-communication`, on unless `--no-overlap-p2p-communication`)
  and block the compute stream under 1F1B, whose sends and receives Megatron-Core pairs in
  blocking batches.
- nemo: NeMo / Megatron-Bridge recipes on Megatron-Core: gradient reduction and parameter
  all-gathers (distributed optimizer) overlap the backward and the forward, tensor-parallel
  communication overlaps its GEMMs (Transformer Engine's userbuffers), pipeline sends overlap
  compute under the interleaved schedule (Megatron-Core's rule, as above), and Transformer
  Engine fuses norms, casts and activations.
- torchtitan: FSDP2 / DTensor: FSDP's all-gathers are prefetched and its reduce-scatters
  overlap the backward; tensor-parallel collectives block (async TP, `--tp-comm-overlap`,
  overlaps them); torch.compile fuses element-wise kernels (`--no-fused-kernels`: eager
  PyTorch's decomposed norms, rotary and gates);
  selective (per-op) activation checkpointing is its default.
- megatron-deepspeed: BigScience's and Microsoft's Megatron-DeepSpeed (BLOOM-176B, MT-NLG
  530B): Megatron-LM's layers run by DeepSpeed's pipeline engine, which sends each boundary's
  whole activation from every tensor rank (no scatter/gather) and blocks on it, adds each
  micro-batch's bf16 gradients into fp32 ones in a pass of its own, reduces gradients after
  the pipeline's flush and overlaps nothing; ZeRO-1 is its `--distributed-optimizer`.

Besides the overlaps, each says whether it splits the layers evenly over the pipeline stages
(Megatron-LM requires it without --decoder-first/last-pipeline-num-layers, DeepSpeed's
`partition_method: type:transformer` does it) and whether its pipeline sends scatter the
activation over the tensor ranks and gather it after (Megatron-LM's
`scatter_gather_tensors_in_pipeline`, on by default in the 2021-2022 releases the published
runs used; with sequence parallelism each rank's shard is sent as it is).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FRAMEWORKS", "Framework", "framework"]


@dataclass(frozen=True)
class Framework:
    name: str
    overlap_grad_reduce: bool
    """Data-parallel gradient reduction (or FSDP's reduce-scatter) runs beside the backward."""
    overlap_param_gather: bool
    """Parameter all-gathers (distributed optimizer, FSDP) are prefetched beside compute."""
    tp_comm_overlap: bool
    """Tensor-parallel all-gathers and reduce-scatters are split into chunks that overlap the
    GEMMs they feed (userbuffers, async TP)."""
    overlap_p2p: bool
    """Pipeline sends and receives run on their own stream beside compute (with
    `p2p_overlap_interleaved`: under interleaved schedules only)."""
    fused_kernels: bool
    """Element-wise work fused beyond Megatron-LM's kernels into fewer passes (Transformer
    Engine's fused norm + cast + GEMM prologues, torch.compile): constants.FUSED_ELEMENTWISE of
    the bytes remain."""
    recompute: str
    """What the framework recomputes when not told (its default)."""
    host_overhead: float
    """Host (Python, dispatch) time per layer and pass, as a multiple of the fitted
    constants.LAYER_US: eager PyTorch with DTensor dispatch pays more than Megatron's modules."""
    even_split: bool = False
    """The layers split evenly over the pipeline stages (the embedding and the head on top of
    the first and last), not balanced by time."""
    p2p_scatter_gather: bool = True
    """A pipeline send carries 1/tp of the activation from each tensor rank, the receiver
    all-gathers it over its tensor group; off: every tensor rank sends the whole."""
    schedules: tuple[str, ...] = ("1f1b", "interleaved-1f1b")
    """The pipeline schedules the framework runs: what `pyplan plan` searches when --schedule
    is not given (another of pyplan's templates is priced when asked for)."""
    flash_attention: tuple[str, ...] = ("bf16", "fp16", "fp8")
    """The training dtypes whose attention is fused when not told (--flash-attention / --no-
    flash-attention); fp32 never is (the fused kernels take 16-bit inputs)."""
    sequence_parallel: bool = True
    """Sequence parallelism inside tensor-parallel groups when not told."""
    distributed_optimizer: bool = True
    """The optimizer's state sharded over the data-parallel ranks (ZeRO-1) when not told."""
    fsdp: bool = False
    """FULL_SHARD over the data ranks is the framework's own way (searched when not told)."""
    tp_dgrad_overlap: bool = False
    """A column-parallel linear's input-gradient all-reduce (reduce-scatter with sequence
    parallelism) runs beside its weight-gradient GEMM: Megatron-Core's
    LinearWithGradAccumulationAndAsyncCommunication, which CUDA_DEVICE_MAX_CONNECTIONS=1 orders
    ahead of that GEMM (Megatron-LM since 2022); not where the weight gradient is deferred
    (zero-bubble schedules)."""
    p2p_overlap_interleaved: bool = False
    """Its sends overlap only where a GPU holds several model chunks: Megatron-Core's 1F1B
    without a virtual pipeline sends and receives in blocking pairs."""
    eager: bool = False
    """Without fused kernels its element-wise ops run as eager PyTorch decomposes them (an
    RMSNorm upcast to fp32 over six kernels, rotary as a complex product in fp32, SiLU and the
    gate's product apart); off: Megatron-LM's, apex's and DeepSpeed's fused CUDA kernels."""
    grad_accumulation_pass: bool = False
    """With bf16, each micro-batch's 16-bit gradients are added into fp32 ones after its
    backward, a pass over the stage's parameters (DeepSpeed's BF16_Optimizer under its pipeline
    engine); off: accumulated in fp32 by the weight-gradient GEMM itself (Megatron-LM's
    gradient accumulation fusion) or not at all (one micro-batch per step under FSDP)."""

    def overlaps_p2p(self, vpp: int) -> bool:
        """Whether a pipeline of `vpp` chunks per GPU overlaps its sends with compute."""
        return self.overlap_p2p and (vpp > 1 or not self.p2p_overlap_interleaved)

    @property
    def decomposed(self) -> bool:
        """Its element-wise ops run as eager PyTorch decomposes them: eager, and not fused."""
        return self.eager and not self.fused_kernels

    def describe(self) -> str:
        on = [name for name, value in (
            ("grad-reduce overlap", self.overlap_grad_reduce),
            ("param-gather overlap", self.overlap_param_gather),
            ("tp-comm overlap", self.tp_comm_overlap),
            ("interleaved " * self.p2p_overlap_interleaved + "p2p overlap", self.overlap_p2p),
            ("fused kernels", self.fused_kernels)) if value]
        return f"{self.name} ({', '.join(on) or 'no overlaps'})"


# What each runs when a switch is not given is its own command line's default: Megatron-LM's
# --sequence-parallel and --use-distributed-optimizer are opt-in, NeMo's recipes turn them on,
# torchtitan's tensor-parallel plan is always sequence-parallel over FSDP2 with SDPA's flash
# kernel. Megatron-LM's attention is fused by Transformer Engine in its bf16 and fp8 recipes;
# its fp16 recipe (loss scaling, 2019-2022, the published A100 runs) ran apex's scaled masked
# softmax over scores in memory, as Megatron-DeepSpeed (BLOOM, MT-NLG) did in any dtype. None
# of Megatron-LM, NeMo or DeepSpeed runs a zero-bubble schedule (sail-sg's fork of Megatron
# does); torchtitan runs ZBVZeroBubble.
FRAMEWORKS = {
    "megatron": Framework("megatron", False, False, False, True, False, "none", 1.0,
                          even_split=True, flash_attention=("bf16", "fp8"),
                          sequence_parallel=False, distributed_optimizer=False,
                          tp_dgrad_overlap=True, p2p_overlap_interleaved=True),
    "nemo": Framework("nemo", True, True, True, True, True, "none", 1.0,
                      tp_dgrad_overlap=True, p2p_overlap_interleaved=True),
    "torchtitan": Framework("torchtitan", True, True, False, False, True, "selective", 1.5,
                            schedules=("1f1b", "interleaved-1f1b", "zb-v"),
                            distributed_optimizer=False, fsdp=True, eager=True),
    "megatron-deepspeed": Framework("megatron-deepspeed", False, False, False, False, False,
                                    "none", 1.0, even_split=True,
                                    p2p_scatter_gather=False, schedules=("1f1b",),
                                    flash_attention=(), sequence_parallel=False,
                                    distributed_optimizer=False,
                                    grad_accumulation_pass=True),
}


def framework(name: str, **changes) -> Framework:
    """The framework `name` with some switches changed (None: its default)."""
    from dataclasses import replace

    base = FRAMEWORKS[name]
    return replace(base, **{k: v for k, v in changes.items() if v is not None})
