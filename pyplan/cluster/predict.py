"""One layout's prediction: its iteration time with its parts, throughput, MFU and HFU, and
the memory of its fullest GPU with its parts, from the cost model and the schedule pyplan's
solver lays out for it.

MFU counts model FLOPs (6 per active weight per token, forward and backward, the output
projection included, plus attention's 12 l q_dim s per token: no recomputation), the
convention of Megatron-LM's and PaLM's papers (Korthikanti et al. 2022's "72" formula for a
GPT); HFU adds what recomputation reruns (a full forward, or attention's core with selective
recomputation). Both are over the dense peak of the run's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyplan.cluster.costs import COMMUNICATION, Costs
from pyplan.cluster.hardware import Cluster
from pyplan.cluster.layout import Batch, Layout
from pyplan.cluster.memory import rank_parameters, stage_state
from pyplan.cluster.model import Transformer
from pyplan.cluster.pipeline import Chunk, Priced, chunks, price, splits

__all__ = ["Prediction", "predict"]


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    seconds: float
    tokens_per_second_per_gpu: float
    mfu: float
    hfu: float
    memory_bytes: float
    """The fullest GPU's peak."""
    memory: dict
    """That GPU's peak by part: weights, gradients, optimizer, activations, buffers."""
    fits: bool
    breakdown: dict
    """The iteration by part on its busiest GPU: compute, exposed tensor-parallel
    communication, pipeline bubble, exposed data-parallel communication, optimizer step."""
    layers_per_stage: tuple[int, ...]
    plan: str = field(repr=False)
    """The pipeline as a pyplan plan (what `-o` writes)."""
    framework: str = "megatron"

    def as_json(self) -> dict:
        return {"layout": self.layout.as_dict(), "iteration_seconds": self.seconds,
                "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
                "mfu": self.mfu, "hfu": self.hfu, "memory_bytes_per_gpu": self.memory_bytes,
                "memory_breakdown": self.memory, "fits": self.fits,
                "breakdown": self.breakdown, "layers_per_stage": list(self.layers_per_stage)}


def predict(model: Transformer, cluster: Cluster, layout: Layout, batch: Batch,
            counts: tuple[int, ...] | None = None, name: str = "plan") -> Prediction:
    """The layout priced exactly, its layers split as `counts` says, else by the split that
    runs fastest and fits of those worth pricing (pipeline.splits; none fitting: the one that
    holds least)."""
    costs = Costs(model, cluster, layout, batch)
    capacity = cluster.gpu.memory_bytes - cluster.gpu.reserved_gib * 2**30
    m = layout.micro_batches(batch)
    best = None
    for split in [counts] if counts is not None else splits(model, layout, costs):
        chunk_list = chunks(model, cluster, layout, batch, split)
        priced = price(chunk_list, layout, m, capacity, name=name)
        fits = max(priced.peak_bytes) <= capacity
        rank = (not fits, priced.seconds if fits else max(priced.peak_bytes))
        if best is None or rank < best[0]:
            best = (rank, chunk_list, priced, split)
    _, chunk_list, priced, counts = best
    return _prediction(model, cluster, layout, batch, chunk_list, priced, counts, capacity)


def _prediction(model: Transformer, cluster: Cluster, layout: Layout, batch: Batch,
                chunk_list: list[Chunk], priced: Priced, counts: tuple[int, ...],
                capacity: float) -> Prediction:
    m = layout.micro_batches(batch)
    tokens = batch.global_batch * batch.sequence
    peak = cluster.gpu.peak(batch.state_dtype)  # fp8 runs: over the 16-bit peak, as reported
    model_flops = model.model_flops(batch.sequence) * tokens
    mfu = model_flops / (priced.seconds * layout.gpus * peak)
    hfu = (model_flops + _recomputed_flops(model, layout, batch, counts) * tokens) / (
        priced.seconds * layout.gpus * peak)
    # The fullest GPU and its parts.
    device = max(range(layout.pp), key=lambda d: priced.peak_bytes[d])
    mine = [c for c in chunk_list if c.device == device]
    largest = max((rank_parameters(model, layout, model.is_moe(i)) for c in mine
                   for i in c.layers), default=0.0)
    state = stage_state(sum(c.parameters for c in mine), batch, layout, largest_layer=largest)
    static = state.total
    activations = priced.peak_bytes[device] - static
    buffers = cluster.gpu.reserved_gib * 2**30
    memory = {"weights": state.weights, "gradients": state.gradients,
              "optimizer": state.optimizer, "activations": activations, "buffers": buffers}
    total = sum(memory.values())
    # The busiest GPU's iteration by part.
    busiest = max(range(layout.pp), key=lambda d: priced.busy[d])
    work = [c for c in chunk_list if c.device == busiest]
    compute = m * sum(c.forward.compute + c.backward.compute + c.weight.compute for c in work)
    comm = {part: m * sum(c.forward.parts[part] + c.backward.parts[part] for c in work)
            for part in COMMUNICATION}
    exposed_dp = max(0.0, priced.makespan - priced.compute_makespan)
    bubble = max(0.0, priced.compute_makespan - compute - sum(comm.values()))
    breakdown = {"compute": compute, "tp_communication": comm["tp_comm"],
                 "cp_communication": comm["cp_comm"], "ep_communication": comm["ep_comm"],
                 "fsdp_communication": comm["fsdp_comm"],
                 "pp_communication": comm["pp_comm"], "pipeline_bubble": bubble,
                 "dp_communication": exposed_dp, "optimizer": priced.update}
    return Prediction(layout, priced.seconds, tokens / priced.seconds / layout.gpus, mfu, hfu,
                      total, memory, priced.peak_bytes[device] <= capacity, breakdown,
                      counts, priced.text, batch.framework.name)


def _recomputed_flops(model: Transformer, layout: Layout, batch: Batch,
                      counts: tuple[int, ...]) -> float:
    """FLOPs per token recomputation adds (block: the forwards of each chunk's first
    layers, 2 per active weight and attention's 4 q_dim s)."""
    if layout.recompute == "full":
        return model.model_flops(batch.sequence) / 3
    if layout.recompute == "block":
        rerun, first = 0.0, 0
        for count in counts:
            for i in range(first, first + min(count, layout.recompute_layers)):
                rerun += 2.0 * model.layer_active_params(model.is_moe(i)) + \
                    4.0 * model.q_dim * batch.sequence
            first += count
        return rerun
    if layout.recompute == "selective":
        return 4.0 * model.layers * model.q_dim * batch.sequence
    return 0.0
