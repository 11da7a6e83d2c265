"""The software a run uses: the same layout runs at different speeds in Megatron-LM, in NVIDIA's
NeMo recipes and in torchtitan, because they overlap different communication with compute,
fuse different kernels and pay different per-layer host overheads. Each framework is a set of
switches the cost model reads; `pyplan plan --framework` picks one and its flags change an
overlap (docs/cluster-planning.md says what each assumes and why).

- megatron: Megatron-LM with its own defaults. Its overlaps are opt-in flags
  (`--overlap-grad-reduce`, `--overlap-param-gather`, `--tp-comm-overlap`), so off; its own
  and apex's fused kernels (layer norm, bias + GeLU, scaled masked softmax) are the baseline
  the element-wise byte counts describe; pipeline sends and receives block the compute stream.
- nemo: NeMo / Megatron-Bridge recipes on Megatron-Core: gradient reduction and parameter
  all-gathers (distributed optimizer) overlap the backward and the forward, tensor-parallel
  communication overlaps its GEMMs (Transformer Engine's userbuffers), pipeline sends overlap
  compute, and Transformer Engine fuses norms, casts and activations.
- torchtitan: FSDP2 / DTensor: FSDP's all-gathers are prefetched and its reduce-scatters
  overlap the backward; tensor-parallel collectives block (async TP, `--tp-comm-overlap`,
  overlaps them); torch.compile fuses element-wise kernels (`--no-fused-kernels`: eager);
  selective (per-op) activation checkpointing is its default.
- megatron-deepspeed: BigScience's and Microsoft's Megatron-DeepSpeed (BLOOM-176B, MT-NLG
  530B): Megatron-LM's layers run by DeepSpeed's pipeline engine, which sends each boundary's
  whole activation from every tensor rank (no scatter/gather) and blocks on it, reduces
  gradients after the pipeline's flush and overlaps nothing; ZeRO-1 is its
  `--distributed-optimizer`.

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
    """Pipeline sends and receives run on their own stream beside compute."""
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

    def describe(self) -> str:
        on = [name for name, value in (
            ("grad-reduce overlap", self.overlap_grad_reduce),
            ("param-gather overlap", self.overlap_param_gather),
            ("tp-comm overlap", self.tp_comm_overlap), ("p2p overlap", self.overlap_p2p),
            ("fused kernels", self.fused_kernels)) if value]
        return f"{self.name} ({', '.join(on) or 'no overlaps'})"


FRAMEWORKS = {
    "megatron": Framework("megatron", False, False, False, False, False, "none", 1.0,
                          even_split=True),
    "nemo": Framework("nemo", True, True, True, True, True, "none", 1.0),
    "torchtitan": Framework("torchtitan", True, True, False, False, True, "selective", 1.5),
    "megatron-deepspeed": Framework("megatron-deepspeed", False, False, False, False, False,
                                    "none", 1.0, even_split=True,
                                    p2p_scatter_gather=False),
}


def framework(name: str, **changes) -> Framework:
    """The framework `name` with some switches changed (None: its default)."""
    from dataclasses import replace

    base = FRAMEWORKS[name]
    return replace(base, **{k: v for k, v in changes.items() if v is not None})
