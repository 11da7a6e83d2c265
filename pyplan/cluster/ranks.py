"""What one tensor-parallel rank of a measured unit costs (`pyplan partition --tensor T`): the
units measured whole on this machine, each priced as one of T ranks runs it with pyplan plan's
own cost model (pyplan.cluster.costs and .memory) for everything the degree changes:

- compute: the measured time times the model's per-rank compute at T over its compute at 1
  (GEMMs and attention divided by T; norms, residual adds and dropout too with sequence
  parallelism; kernels' fixed costs not);
- the tensor-parallel collectives: the model's (two each way per layer, the head's gather),
  on the plan's link (its bandwidth and latency as a node's links);
- activations: the measured bytes times memory.py's per-layer bytes at T (sequence-parallel or
  not) over those at 1; the stage's input kept for recomputation is a slice with sequence
  parallelism;
- weights (parameters, gradients, optimizer state): what the caller gives, a tensor rank's
  (pyplan partition counts what `pyplan run` holds: its tensor plan's sharded layers divided,
  the embedding, norms and the rest whole), and the optimizer's step over them.

An embedding or head of which a tensor rank holds all the weights (pyplan run keeps GPT-2's
and Llama's embedding whole, and GPT-2's head tied to it) runs whole: it keeps its measured
costs. The plan's blocks are then all one tensor rank's (mesh.priced); `pyplan run` divides a
stage's state further by the shard degree only (memory.mesh_state_bytes).
"""

from __future__ import annotations

import dataclasses

from pyplan.cluster.costs import Costs, Pieces
from pyplan.cluster.hardware import Cluster, Gpu
from pyplan.cluster.layout import Batch, Layout
from pyplan.cluster.memory import Activations, activations, ends
from pyplan.cluster.model import Transformer
from pyplan.partition import UnitCost
from pyplan.planfile.types import LinkSpec

__all__ = ["KINDS", "rank_units"]

KINDS = ("embedding", "layer", "head")
# The compute the ratios are taken on: a GPU of the cost model's default efficiencies (the
# ratios, not the seconds, are used; its links are the plan's).
_GPU = Gpu(name="reference", peak_tflops={"bf16": 989, "fp16": 989, "fp32": 67, "tf32": 495},
           memory_gib=80, memory_bandwidth_gbs=3350)


def _costs(model: Transformer, tensor: int, sequence_parallel: bool, batch: Batch,
           micro_batch: int, link: LinkSpec) -> Costs:
    cluster = Cluster(name="plan", gpu=_GPU, gpus_per_node=max(tensor, 1),
                      link_gbs=link.bandwidth / 1e9, network_gbs=link.bandwidth / 1e9,
                      link_latency_us=link.latency_ms * 1e3, link_efficiency=1.0)
    layout = Layout(tp=tensor, pp=1, dp=1, micro_batch=micro_batch,
                    sequence_parallel=sequence_parallel)
    return Costs(model, cluster, layout, batch)


def _pieces(costs: Costs, kind: str, moe: bool) -> Pieces:
    return costs.layer(moe) if kind == "layer" else \
        costs.embedding() if kind == "embedding" else costs.head()


def _held(model: Transformer, tensor: int, sequence_parallel: bool, batch: Batch,
          micro_batch: int, kind: str, moe: bool) -> Activations:
    layout = Layout(tp=tensor, pp=1, dp=1, micro_batch=micro_batch,
                    sequence_parallel=sequence_parallel)
    if kind == "layer":
        return activations(model, layout, batch, moe)
    embedding, head = ends(model, layout, batch)
    return embedding if kind == "embedding" else head


def _kernels(work) -> float:
    """The GPU's own time of a piece: its compute without the host's wait (the measured
    times already hold this machine's host overhead)."""
    return work.compute - work.parts["host"]


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 1.0


def rank_units(units: list[UnitCost], kinds: list[str], model: Transformer, *, tensor: int,
               sequence_parallel: bool, micro_batch: int, sequence: int, dtype: str,
               link: LinkSpec, weights: list[int]) -> list[UnitCost]:
    """`units` (measured whole; `kinds[i]`: embedding, layer or head) as one of `tensor`
    ranks runs them, for micro-batches of `micro_batch` sequences of `sequence` tokens;
    `weights[i]`: what a tensor rank holds of unit i's weights (its optimizer's step works
    over that share)."""
    if tensor <= 1:
        return list(units)
    batch = Batch(global_batch=micro_batch, sequence=sequence, dtype=dtype,
                  flash_attention=False)
    one = _costs(model, 1, False, batch, micro_batch, link)
    many = _costs(model, tensor, sequence_parallel, batch, micro_batch, link)
    out, layer = [], 0
    for unit, kind, mine_bytes in zip(units, kinds, weights):
        moe = kind == "layer" and model.is_moe(min(layer, model.layers - 1))
        layer += kind == "layer"
        if kind != "layer" and mine_bytes == unit.weight_bytes:
            out.append(unit)  # an embedding or head kept whole runs whole on every rank
            continue
        whole, mine = _pieces(one, kind, moe), _pieces(many, kind, moe)
        held = _ratio(_held(model, tensor, sequence_parallel, batch, micro_batch, kind,
                            moe).held,
                      _held(model, 1, False, batch, micro_batch, kind, moe).held)
        f = _ratio(_kernels(mine.forward), _kernels(whole.forward))
        b = _ratio(_kernels(mine.backward), _kernels(whole.backward))
        w = _ratio(_kernels(mine.weight), _kernels(whole.weight))
        bw = _ratio(_kernels(mine.backward) + _kernels(mine.weight),
                    _kernels(whole.backward) + _kernels(whole.weight))
        comm_f = mine.forward.parts["tp_comm"] * 1e3
        comm_b = mine.backward.parts["tp_comm"] * 1e3
        sliced = 1 / tensor if sequence_parallel else 1.0
        share = _ratio(mine_bytes, unit.weight_bytes)
        out.append(dataclasses.replace(
            unit, forward_ms=unit.forward_ms * f + comm_f,
            backward_ms=unit.backward_ms * bw + comm_b,
            input_grad_ms=None if unit.input_grad_ms is None else
            unit.input_grad_ms * b + comm_b,
            weight_grad_ms=unit.weight_grad_ms * w,
            activation_bytes=round(unit.activation_bytes * held),
            forward_peak_bytes=round(unit.forward_peak_bytes * held),
            backward_peak_bytes=round(unit.backward_peak_bytes * held),
            saved_input_bytes=round(unit.saved_input_bytes * sliced),
            saved_output_bytes=round(unit.saved_output_bytes * sliced),
            weight_bytes=mine_bytes, update_ms=unit.update_ms * share,
            update_peak_bytes=round(unit.update_peak_bytes * share),
            captured_bytes=round(unit.captured_bytes * held),
            released_bytes=round(unit.released_bytes * held),
            input_bytes=round(unit.input_bytes * sliced)))
    return out
