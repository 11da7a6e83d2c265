"""How a training run is laid out on the cluster: the parallel degrees and the settings that
change its time and memory. One frozen value, checked once against the model and the batch;
the search enumerates them, the cost model reads them, the plan records them.

Ranks are numbered as Megatron-LM and torchtitan do: tensor parallel innermost (its ranks share
a node), then data parallel, then pipeline outermost.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pyplan.cluster.model import Transformer

__all__ = ["RECOMPUTE", "SCHEDULES", "Batch", "Layout", "check_layout"]

RECOMPUTE = ("none", "selective", "full")
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
    flash_attention: bool = True


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

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def micro_batches(self, batch: Batch) -> int:
        """Micro-batches per iteration on each pipeline."""
        return batch.global_batch // (self.dp * self.micro_batch)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        text = f"tp {self.tp} x pp {self.pp} x dp {self.dp}"
        if self.vpp > 1:
            text += f", {self.vpp} chunks per GPU"
        text += f", micro-batch {self.micro_batch}, {self.schedule}"
        if self.recompute != "none":
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
        return (f"tp {layout.tp} x pp {layout.pp} x dp {layout.dp} = {layout.gpus} GPUs, not "
                f"the {gpus} given")
    if layout.tp > gpus_per_node:
        return f"tensor parallelism over {layout.tp} GPUs leaves a node of {gpus_per_node}"
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
