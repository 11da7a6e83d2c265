"""How a training run is laid out on the cluster: the parallel degrees and the settings that
change its time and memory. One frozen value, checked once against the model and the batch;
the search enumerates them, the cost model reads them, the plan records them.

Ranks are numbered as Megatron-LM and torchtitan do: tensor parallel innermost (its ranks share
a node), then context parallel, then data parallel (expert parallelism splits the data ranks,
its ranks innermost), then pipeline outermost. `Layout.per_node` says how many ranks of each
group share a node, which decides whether its collectives cross the network.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pyplan.cluster.framework import FRAMEWORKS, Framework
from pyplan.cluster.model import Transformer

__all__ = ["RECOMPUTE", "SCHEDULES", "Batch", "Layout", "check_layout"]

# What a layer keeps for its backward: everything; all but attention's scores (selective:
# recomputed in the backward); block: the first `recompute_layers` layers of each model chunk
# keep only their input and rerun their forward (Megatron-LM's --recompute-method block), the
# rest everything; full: every layer only its input.
RECOMPUTE = ("none", "selective", "block", "full")
# The pipeline schedules pyplan prices (its templates' names); "search": pyplan's own.
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-2p", "zb-v", "gpipe",
             "search")
SPLIT_BACKWARD = frozenset({"zb-h1", "zb-h2", "zb-2p", "zb-v", "search"})


@dataclass(frozen=True)
class Batch:
    global_batch: int
    """Sequences per optimizer step."""
    sequence: int
    """Tokens per sequence."""
    dtype: str = "bf16"
    """bf16, fp16 or fp32; fp8: the linear layers' GEMMs in fp8 (Transformer Engine,
    torchao's float8), everything else in bf16."""
    flash_attention: bool | None = None
    """Fused attention; None: the framework's default for the dtype (Framework.flash_attention)."""
    framework: Framework = field(default=FRAMEWORKS["megatron"])
    """The software that runs it: which communication overlaps compute, what is fused."""

    def __post_init__(self) -> None:
        if self.flash_attention is None:
            object.__setattr__(self, "flash_attention",
                               self.dtype in self.framework.flash_attention)

    @property
    def state_dtype(self) -> str:
        """The dtype of the weights, gradients and activations kept (fp8 keeps bf16 ones)."""
        return "bf16" if self.dtype == "fp8" else self.dtype


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vpp: int = 1
    """Model chunks per pipeline rank (interleaved; 2 for the V of zb-v)."""
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    distributed_optimizer: bool = False
    """ZeRO-1: the optimizer's state sharded over the data-parallel ranks."""
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks (ring attention)."""
    ep: int = 1
    """Expert parallelism: a mixture's experts split over ep of the data-parallel ranks."""
    fsdp: bool = False
    """ZeRO-3 / FULL_SHARD: parameters, gradients and optimizer state sharded over the data
    (and context) ranks, each layer's parameters all-gathered for its forward and backward."""
    dp_replicate: int = 1
    """HSDP: the data ranks are dp_replicate replicas of FSDP groups of dp / dp_replicate."""
    recompute_layers: int = 0
    """With block recomputation: the layers of each model chunk recomputed (its first ones;
    a chunk with fewer recomputes them all)."""

    def recomputes(self, position: int) -> bool:
        """Whether the layer at `position` in its model chunk reruns its whole forward."""
        return self.recompute == "full" or (self.recompute == "block" and
                                            position < self.recompute_layers)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard(self) -> int:
        """Ranks that hold one share of the parameters under FSDP (the data ranks of one
        replica, times the context ranks, as torchtitan shards)."""
        return self.dp // self.dp_replicate * self.cp

    def per_node(self, group: str, gpus_per_node: int) -> int:
        """How many ranks of one `group` (tp, cp, dp, ep, grad: the data and context ranks
        that reduce gradients together, shard, replicate) share a node."""
        node, tp, cp = gpus_per_node, self.tp, self.cp
        if group == "tp":
            return min(tp, node)
        inner = max(1, node // tp)
        if group == "cp":
            return max(1, min(cp, inner))
        if group in ("grad", "shard"):
            size = self.dp * cp if group == "grad" else self.shard
            return max(1, min(size, inner))
        inner = max(1, inner // cp)
        if group == "dp":
            return max(1, min(self.dp, inner))
        if group == "ep":
            return max(1, min(self.ep, inner))
        if group == "replicate":
            return max(1, min(self.dp_replicate, inner // (self.dp // self.dp_replicate)))
        raise ValueError(group)

    def pipeline_across_nodes(self, gpus_per_node: int) -> bool:
        """The pipeline's ranks span more than one node (its first and last stages on two)."""
        return self.tp * self.cp * self.dp * self.pp > gpus_per_node

    def node_of_stage(self, device: int, gpus_per_node: int) -> int:
        """The node of pipeline rank `device`'s first GPU: consecutive pipeline ranks are
        tp x cp x dp GPUs apart (Megatron-LM's rank order), so a node holds several stages
        where their groups are smaller than it."""
        return device * self.tp * self.cp * self.dp // gpus_per_node

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def micro_batches(self, batch: Batch) -> int:
        """Micro-batches per iteration on each pipeline."""
        return batch.global_batch // (self.dp * self.micro_batch)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        text = f"tp {self.tp}"
        if self.cp > 1:
            text += f" x cp {self.cp}"
        text += f" x pp {self.pp} x dp {self.dp}"
        if self.ep > 1:
            text += f" (ep {self.ep})"
        if self.fsdp:
            text += ", FSDP" if self.dp_replicate == 1 else \
                f", HSDP ({self.dp_replicate} replicas)"
        if self.vpp > 1:
            text += f", {self.vpp} chunks per GPU"
        text += f", micro-batch {self.micro_batch}, {self.schedule}"
        if self.recompute == "block":
            text += (f", block recompute ({self.recompute_layers} layer"
                     f"{'s' if self.recompute_layers > 1 else ''} per chunk)")
        elif self.recompute != "none":
            text += f", {self.recompute} recompute"
        if self.sequence_parallel:
            text += ", sequence parallel"
        if self.distributed_optimizer:
            text += ", distributed optimizer"
        return text


def check_layout(layout: Layout, model: Transformer, batch: Batch, gpus: int,
                 gpus_per_node: int) -> str | None:
    """Why the layout cannot run this model and batch on `gpus` GPUs, or None."""
    if layout.gpus != gpus:
        return (f"tp {layout.tp} x cp {layout.cp} x pp {layout.pp} x dp {layout.dp} = "
                f"{layout.gpus} GPUs, not the {gpus} given")
    if layout.tp > gpus_per_node and layout.tp % gpus_per_node:
        return (f"tensor parallelism over {layout.tp} GPUs is not whole nodes of "
                f"{gpus_per_node}")
    if layout.cp > 1 and batch.sequence % (2 * layout.cp * layout.tp):
        return (f"a sequence of {batch.sequence} does not split into 2 x cp {layout.cp} "
                f"chunks of whole tensor-parallel slices (tp {layout.tp})")
    if layout.ep > 1:
        if not model.experts:
            return "expert parallelism needs a mixture of experts"
        if model.experts % layout.ep:
            return f"{model.experts} experts do not divide over ep {layout.ep}"
        if layout.dp % layout.ep:
            return f"ep {layout.ep} does not divide the {layout.dp} data-parallel ranks"
    if (layout.recompute == "block") != (layout.recompute_layers > 0):
        return ("block recomputation needs the layers per chunk it recomputes (--recompute-"
                "layers N)" if layout.recompute == "block" else
                "--recompute-layers needs --recompute block")
    if layout.recompute_layers > model.layers:
        return (f"block recomputation of {layout.recompute_layers} layers per chunk: the "
                f"model has {model.layers}")
    if layout.dp_replicate > 1 and not layout.fsdp:
        return "--dp-replicate (HSDP) needs --fsdp"
    if layout.dp % layout.dp_replicate:
        return f"dp {layout.dp} does not split into {layout.dp_replicate} replicas"
    if layout.fsdp and layout.distributed_optimizer:
        return "FSDP already shards the optimizer's state (no --distributed-optimizer)"
    if model.heads % layout.tp:
        return f"{model.heads} attention heads do not divide over tp {layout.tp}"
    if model.kv_heads % layout.tp and layout.tp % model.kv_heads:
        return f"{model.kv_heads} key/value heads do not divide over tp {layout.tp}"
    if layout.sequence_parallel and layout.tp == 1:
        return "sequence parallelism needs tp > 1"
    if batch.global_batch % (layout.dp * layout.micro_batch):
        return (f"a global batch of {batch.global_batch} does not split into {layout.dp} "
                f"replicas of micro-batches of {layout.micro_batch}")
    if batch.sequence % layout.tp and layout.sequence_parallel:
        return f"a sequence of {batch.sequence} does not split over tp {layout.tp}"
    if layout.stages > model.layers:
        return f"{layout.stages} pipeline stages for {model.layers} layers"
    m = layout.micro_batches(batch)
    if layout.schedule == "interleaved-1f1b":
        if layout.vpp < 2:
            return "interleaved-1f1b needs 2 or more chunks per GPU (--vpp)"
        if m % layout.pp:
            return f"interleaved-1f1b needs micro-batches ({m}) divisible by pp ({layout.pp})"
    elif layout.schedule == "zb-v":
        if layout.vpp != 2:
            return "zb-v places 2 chunks per GPU (--vpp 2)"
    elif layout.vpp != 1 and layout.schedule != "search":
        return f"{layout.schedule} runs one chunk per GPU (--vpp 1)"
    if layout.pp == 1 and layout.schedule not in ("1f1b", "search"):
        return f"{layout.schedule} needs pipeline stages (pp > 1)"
    return None
