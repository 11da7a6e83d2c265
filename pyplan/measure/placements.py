"""Placements of a measured model, each cut into stages and solved (`pyplan partition --shape`):
the V-shape (stage s on device s), interleaved (stage s on device s mod D, 2-4 chunks per
device) and Tessel's M-shape (the first unit, with the token embedding, and the last, with the
head, on every device at once, each rank holding 1/D of the vocabulary; the layers between them
in one stage per device). `auto` solves every placement that applies with the measured costs
and ranks them by predicted makespan; on a machine with fewer cores than devices (ranks that
share CPU cores), by the longer of the makespan and the iteration's total compute divided by
the cores, which no schedule can beat there.

The M-shape's first and last units cost what one of their ranks spends, collectives included
(pyplan.measure.sharded measures them); the units between them are cut by the same dynamic
programme and even splits as the V-shape, within the memory the sharded units leave.

Nothing here needs torch.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

from pyplan.api import UNITS_PER_STAGE, PartitionPlan, partition_plans, solved_plans
from pyplan.errors import InfeasibleError, PlanError
from pyplan.partition import Partition, UnitCost, candidates, plan_text, smallest_capacity
from pyplan.partition.graph import UnitGraph, graph_candidates, graph_plan_text
from pyplan.planfile import LinkSpec, format_memory

__all__ = ["CHUNKS", "Placement", "Sharded", "graph_plans", "mshape_plans", "placements"]

CHUNKS = (2, 3, 4)  # interleaved chunks per device that `auto` tries


@dataclass(frozen=True)
class Sharded:
    """The M-shape's all-device units, as one of their ranks runs them."""

    first: UnitCost
    last: UnitCost
    vocab: tuple[str, str]
    """(token embedding, head): what they shard over the vocabulary."""


@dataclass(frozen=True)
class Placement:
    """One placement tried: its solved plans (shortest first), or why it has none."""

    shape: str
    """vshape, mshape or interleaved-C (C chunks per device)."""
    plans: tuple[PartitionPlan, ...] = ()
    reason: str | None = None
    busy_ms: float = 0.0
    """The compute of one iteration summed over all devices (an all-device unit counts once
    per device)."""
    cores: int | None = None
    """The CPU cores the devices share, when fewer than the devices."""

    @property
    def expected_ms(self) -> float:
        """The predicted makespan, or the cores' bound on it when the devices share them."""
        shared = self.busy_ms / self.cores if self.cores else 0.0
        return max(self.best.makespan_ms, shared)

    @property
    def label(self) -> str:
        if self.shape.startswith("interleaved-"):
            return f"interleaved, {self.shape.split('-')[1]} chunks"
        return self.shape

    @property
    def best(self) -> PartitionPlan | None:
        return self.plans[0] if self.plans else None


def mshape_plans(units: list[UnitCost], sharded: Sharded, *, devices: int, name: str,
                 factory: str, data: str, loss: str, micro_batches: int,
                 memory: int | None = None, path: str | None = None, keep: int = 3,
                 time_limit: float = 10.0, source: str = "<partition>", cut: str = "chain",
                 layer_returns: str = "tensor", everywhere: tuple[str, ...] = (),
                 recompute: str = "never", weights: str | None = None,
                 link: LinkSpec | None = None,
                 optimizer: str | None = None) -> list[PartitionPlan]:
    """Plans of the M-shape: block `embed` (the first unit, sharded) and block `head` (the last)
    on all devices, the units between them cut into `devices` stages (the best `keep` by
    bottleneck and the even splits), each solved, shortest makespan first. Their partitions
    count the first and last units as stages of their own."""
    middle = units[1:-1]
    if len(middle) < devices:
        raise PlanError(f"the M-shape needs at least {devices} units between the first and the "
                        f"last, the model has {len(middle)}", hint="use fewer --devices")
    if everywhere:
        raise PlanError(f"the M-shape cannot shard a model whose own parameters every stage "
                        f"holds ({', '.join(everywhere[:3])})",
                        hint="use --shape vshape or interleaved")
    # On every device: each holds the data's batch, as the first and last units' stages do.
    first, last = (dataclasses.replace(u, batch_bytes=whole.batch_bytes) for u, whole in
                   ((sharded.first, units[0]), (sharded.last, units[-1])))
    share = None
    if memory is not None:  # what the all-device units leave on every device (one micro-batch)
        kept = first.weight_bytes + last.weight_bytes + first.activation_bytes + \
            last.activation_bytes
        share = memory - kept
        least = smallest_capacity(middle, devices, recompute) + kept
        if share <= 0 or least > memory:
            raise InfeasibleError(f"no partition of {len(middle)} units into {devices} stages "
                                  f"fits beside the sharded first and last units in "
                                  f"{format_memory(memory, True)} per device, even one "
                                  "micro-batch at a time",
                                  hint=f"the smallest memory per device that admits the "
                                  f"M-shape is {least}B ({format_memory(least, True)}); give "
                                  "that much, or more devices")
    found = candidates(middle, devices, micro_batches=micro_batches, capacity=share, keep=keep,
                       recompute=recompute)
    slowest = max(first.forward_ms + first.backward_ms, last.forward_ms + last.backward_ms,
                  *(c.bottleneck_ms for c in found))
    unit_ms = slowest / UNITS_PER_STAGE
    everything = [first, *middle, last]
    names = ("embed", *(f"stage{s}" for s in range(devices)), "head")
    placement = (None, *((s,) for s in range(devices)), None)
    texts = []
    for p in found:
        whole = Partition((0, *(1 + b for b in p.bounds), len(everything)),
                          p.bottleneck_ms, (0, *p.memory, 0))
        texts.append((whole, plan_text(
            everything, whole, name=name, devices=devices, micro_batches=micro_batches,
            capacity=memory, factory=factory, data=data, loss=loss, path=path,
            time_unit_ms=unit_ms, shape="mshape: the first and last units sharded over the "
            "vocabulary on all devices", cut=cut, layer_returns=layer_returns,
            recompute=recompute, names=names, placement=placement, vocab=sharded.vocab,
            weights=weights, link=link, optimizer=optimizer)))
    return solved_plans(texts, source=source, time_limit=time_limit, unit_ms=unit_ms)


def graph_plans(units: list[UnitCost], graph: UnitGraph, *, devices: int, name: str,
                factory: str, data: str, loss: str, micro_batches: int,
                memory: int | None = None, path: str | None = None, keep: int = 3,
                time_limit: float = 10.0, source: str = "<partition>", cut: str = "chain",
                layer_returns: str = "tensor", everywhere: tuple[str, ...] = (),
                recompute: str = "never", weights: str | None = None,
                link: LinkSpec | None = None,
                optimizer: str | None = None) -> list[PartitionPlan]:
    """Plans of graph pipelines (pyplan.partition.graph): stage DAGs of one stage per device
    following the model's branches, the shallowest at the least bottleneck and at a few larger
    ones, each solved, shortest makespan first. The model is cut by torch's tracer."""
    if cut != "traced" or everywhere:
        raise PlanError("a graph pipeline cuts the model with torch's tracer, and this model "
                        f"is cut {'in its own forward' if cut == 'forward' else 'as a chain'}",
                        hint="use --shape vshape")
    if len(units) < devices:
        raise PlanError(f"{devices} stages need as many units, the model has {len(units)}")
    found = graph_candidates(units, graph, devices, micro_batches=micro_batches,
                             capacity=memory, recompute=recompute)[:keep + 2]
    if not found:
        raise InfeasibleError(f"no stage DAG of {len(units)} units on {devices} devices fits "
                              f"{format_memory(memory, True)} per device, even one "
                              "micro-batch at a time", hint="give more memory or devices")
    unit_ms = max(c.bottleneck_ms for c in found) / UNITS_PER_STAGE
    texts = [(p, graph_plan_text(units, graph, p, name=name, devices=devices,
                                 micro_batches=micro_batches, capacity=memory, factory=factory,
                                 data=data, loss=loss, path=path, time_unit_ms=unit_ms,
                                 recompute=recompute, weights=weights, link=link,
                                 optimizer=optimizer)) for p in found]
    return solved_plans(texts, source=source, time_limit=time_limit, unit_ms=unit_ms)


def _busy_ms(units: list[UnitCost], sharded: Sharded | None, devices: int,
             micro_batches: int) -> float:
    each = lambda u: u.forward_ms + u.backward_ms  # noqa: E731
    if sharded is None:
        return micro_batches * sum(each(u) for u in units)
    return micro_batches * (sum(each(u) for u in units[1:-1]) +
                            devices * (each(sharded.first) + each(sharded.last)))


def placements(units: list[UnitCost], *, devices: int, shapes: tuple[str, ...],
               sharded: Sharded | None, why_not_mshape: str | None = None,
               cores: int | None = None, graph: UnitGraph | None = None,
               why_not_graph: str | None = None, **options) -> list[Placement]:
    """Every placement of `shapes` (vshape, interleaved-C, mshape, graph: with the units'
    `graph`), solved with the measured
    costs; those that do not apply or fit say why. Sorted by expected_ms (with `cores`, the
    CPU cores the devices share when fewer), the shortest first (then those without a plan,
    in the order asked)."""
    cores = cores if cores is not None and cores < devices else None
    found = []
    for shape in shapes:
        try:
            if shape == "mshape":
                if sharded is None:
                    found.append(Placement(shape, reason=why_not_mshape or "not applicable"))
                    continue
                plans = mshape_plans(units, sharded, devices=devices, **options)
            elif shape == "graph":
                if graph is None:
                    found.append(Placement(shape, reason=why_not_graph or "not applicable"))
                    continue
                plans = graph_plans(units, graph, devices=devices, **options)
            else:
                chunks = int(shape.split("-")[1]) if shape.startswith("interleaved-") else 1
                if len(units) < devices * chunks:
                    found.append(Placement(shape, reason=f"{devices * chunks} stages need as "
                                           f"many units, the model has {len(units)}"))
                    continue
                plans = partition_plans(units, devices=devices, chunks=chunks, **options)
        except (PlanError, InfeasibleError) as exc:
            found.append(Placement(shape, reason=exc.message))
            continue
        busy = _busy_ms(units, sharded if shape == "mshape" else None, devices,
                        options["micro_batches"])
        found.append(Placement(shape, tuple(plans), busy_ms=busy, cores=cores))
    order = {shape: i for i, shape in enumerate(shapes)}
    return sorted(found, key=lambda p: (p.best is None,
                                        p.expected_ms if p.best else 0.0, order[p.shape]))
