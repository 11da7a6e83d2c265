"""The search over layouts: every degree and setting the user left open, pruned by bounds so
that only layouts that might win have their pipeline solved.

Each candidate first gets a lower bound on its iteration: the busiest pipeline rank's work
(every micro-batch's F, B and W, tensor-parallel waits included) plus its optimizer step, which
no schedule can shorten; and a memory floor: its static memory and one micro-batch of its
activations. Candidates whose floor exceeds the GPU are dropped; the rest are priced exactly
(schedule laid out and evaluated by pyplan's solver) in the order of their bounds, until the
next bound cannot beat the K-th best layout that fits. A layout that recomputes more is
skipped once the same layout recomputing less fits (it is never faster in this model); block
recomputation is priced for the fewest layers per chunk that fit (a bisection: more layers
rerun hold less and take longer).
When the distributed optimizer and sequence parallelism are not fixed, they are taken where
they apply: they move the same bytes as their alternatives and hold less.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, replace
from functools import cache

from pyplan.cluster.costs import Costs
from pyplan.cluster.hardware import Cluster
from pyplan.cluster.layout import RECOMPUTE, Batch, Layout, check_layout
from pyplan.cluster.memory import activations, rank_parameters, stage_state
from pyplan.cluster.model import Transformer
from pyplan.cluster.predict import Prediction, predict
from pyplan.cluster.pipeline import device_of, splits

__all__ = ["Fixed", "candidates", "search"]
CHUNKS = (2, 3, 4, 6, 8)  # chunks per GPU the search tries for interleaved 1F1B
MAX_MICRO_BATCH = 64


@dataclass(frozen=True)
class Fixed:
    """What the user fixed (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    vpp: int | None = None
    micro_batch: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    schedule: str | None = None
    distributed_optimizer: bool | None = None
    cp: int | None = None
    ep: int | None = None
    fsdp: bool | None = None
    dp_replicate: int | None = None
    recompute_layers: int | None = None
    """With block recomputation, the layers per chunk (None: the fewest that fit)."""

    @property
    def everything(self) -> bool:
        return all(getattr(self, name) is not None for name in (
            "tp", "pp", "dp", "micro_batch", "recompute", "schedule")) and (
            self.recompute != "block" or self.recompute_layers is not None)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _context_degrees(batch: Batch, tp: int, room: int) -> list[int]:
    """Context degrees worth trying: powers of two whose chunks keep >= 1,024 tokens (below
    that the ring's transfers outlast its blocks), none for sequences under 4,096."""
    out, cp = [1], 2
    while batch.sequence >= 4096 and cp <= room and batch.sequence // (2 * cp) >= 1024:
        if room % cp == 0 and batch.sequence % (2 * cp * tp) == 0:
            out.append(cp)
        cp *= 2
    return out


def _expert_degrees(model: Transformer, dp: int) -> list[int]:
    if not model.experts:
        return [1]
    return [e for e in _divisors(min(dp, model.experts))
            if model.experts % e == 0 and dp % e == 0 and e & (e - 1) == 0]


def candidates(model: Transformer, cluster: Cluster, batch: Batch, gpus: int,
               fixed: Fixed) -> list[Layout]:
    """Every layout the fixed choices allow that can run the model (check_layout). Tensor
    parallelism is searched inside a node (wider only when fixed); FSDP is searched where the
    framework is built on it (torchtitan), the distributed optimizer elsewhere."""
    out = []
    node = cluster.gpus_per_node
    fsdp_default = batch.framework.fsdp
    tps = [fixed.tp] if fixed.tp else [t for t in _divisors(min(node, gpus)) if gpus % t == 0]
    for tp in tps:
        if gpus % tp:
            continue
        cps = [fixed.cp] if fixed.cp else _context_degrees(batch, tp, gpus // tp) \
            if batch.flash_attention else [1]
        for cp in cps:
            if gpus % (tp * cp):
                continue
            pps = [fixed.pp] if fixed.pp else [p for p in _divisors(gpus // (tp * cp))
                                               if p <= model.layers]
            for pp in pps:
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if fixed.dp and dp != fixed.dp:
                    continue
                if batch.global_batch % dp:
                    continue
                out += _settings(model, batch, fixed, gpus, node, tp, cp, pp, dp,
                                 fsdp_default)
    return out


def _settings(model: Transformer, batch: Batch, fixed: Fixed, gpus: int, node: int, tp: int,
              cp: int, pp: int, dp: int, fsdp_default: bool) -> list[Layout]:
    out = []
    mbs = [fixed.micro_batch] if fixed.micro_batch else \
        [b for b in _divisors(batch.global_batch // dp) if b <= MAX_MICRO_BATCH]
    software = batch.framework
    if fixed.schedule:
        schedules = [fixed.schedule]
    elif pp == 1 or (fixed.pp and not fixed.vpp):
        # a pipeline the user fixed runs as its framework launches one without a virtual
        # pipeline or schedule flag: one chunk per GPU, its first schedule (1F1B)
        schedules = list(software.schedules[:1])
    else:
        schedules = list(software.schedules)
    fsdps = [fixed.fsdp] if fixed.fsdp is not None else [fsdp_default and dp * cp > 1]
    eps = [fixed.ep] if fixed.ep else _expert_degrees(model, dp)
    replicas = [fixed.dp_replicate or 1]
    for schedule, mb, fsdp, ep, replicate in itertools.product(schedules, mbs, fsdps, eps,
                                                               replicas):
        if fixed.vpp:
            vpps = [fixed.vpp]
        elif schedule == "interleaved-1f1b":
            vpps = [v for v in CHUNKS if pp * v <= model.layers]
        elif schedule == "zb-v":
            vpps = [2]
        else:
            vpps = [1]
        sps = [fixed.sequence_parallel] if fixed.sequence_parallel is not None \
            else [tp > 1 and software.sequence_parallel]
        dos = [fixed.distributed_optimizer] \
            if fixed.distributed_optimizer is not None \
            else [dp * cp > 1 and not fsdp and software.distributed_optimizer]
        recomputes = [fixed.recompute] if fixed.recompute else list(RECOMPUTE)
        for vpp, sp, do, recompute in itertools.product(vpps, sps, dos, recomputes):
            block = recompute == "block"
            if block and not fixed.recompute and -(-model.layers // (pp * vpp)) < 2:
                continue  # chunks of one layer: block recomputation is full recomputation
            layout = Layout(tp, pp, dp, vpp, mb, recompute, sp, schedule, do, cp, ep, fsdp,
                            replicate, (fixed.recompute_layers or 1) if block else 0)
            if check_layout(layout, model, batch, gpus, node) is None:
                out.append(layout)
    return out


@dataclass(frozen=True)
class _Bound:
    seconds: float
    memory: float


class _Bounds:
    """Lower bounds of candidates, sharing the per-layer costs of equal settings."""

    def __init__(self, model: Transformer, cluster: Cluster, batch: Batch,
                 search_block: bool = True) -> None:
        self.model, self.cluster, self.batch = model, cluster, batch
        self.search_block = search_block
        """Block recomputation's layers per chunk are searched (not fixed)."""
        self.capacity = cluster.gpu.memory_bytes - cluster.gpu.reserved_gib * 2**30
        self._layer = cache(self._layer)
        self._split = cache(self._split)

    def _layer(self, layout: Layout) -> tuple:
        """(costs, per-layer seconds, per-layer held bytes, embedding and head seconds,
        per-layer forward seconds, per-layer parameters on a rank, per-layer held bytes of a
        layer that reruns its forward): none depends on the pipeline's schedule or chunks
        (`layout` is the candidate's with those reset). Under block recomputation the
        seconds are those of a layer that reruns nothing (_bound adds the reruns)."""
        costs = Costs(self.model, self.cluster, layout, self.batch)
        total, held, forward, params, rerun_held = {}, {}, {}, {}, {}
        for moe in ({False, True} if self.model.moe_layers else {False}):
            pieces = costs.layer(moe)
            total[moe] = pieces.seconds
            forward[moe] = pieces.forward.seconds
            held[moe] = activations(self.model, layout, self.batch, moe).held
            rerun_held[moe] = activations(self.model, layout, self.batch, moe, True).held
            params[moe] = rank_parameters(self.model, layout, moe)
        ends_seconds = (costs.embedding().seconds, costs.head().seconds)
        return costs, total, held, ends_seconds, forward, params, rerun_held

    def _split(self, layout: Layout, key: Layout) -> tuple[tuple[int, ...], ...]:
        """The splits predict() prices (`key`: the layout whose per-layer costs they read)."""
        return tuple(splits(self.model, layout, self._layer(key)[0]))

    def bound(self, layout: Layout) -> _Bound:
        """The least time and memory any of the layer splits predict() prices can have."""
        key = replace(layout, pp=min(layout.pp, 2), vpp=1, schedule="1f1b")
        found = [self._bound(layout, key, counts) for counts in self._split(layout, key)]
        return _Bound(min(b.seconds for b in found), min(b.memory for b in found))

    def _bound(self, layout: Layout, key: Layout, counts: tuple[int, ...]) -> _Bound:
        _, total, held, (embedding, head), forward, per_layer, rerun_held = self._layer(key)
        model = self.model
        work, params = [0.0] * layout.pp, [0.0] * layout.pp
        first = [range(0)] * layout.pp  # each device's first chunk's layers
        fill = [None] * layout.pp  # forward time before the device's first block can start
        before, layer = 0.0, 0
        for c, count in enumerate(counts):
            d = device_of(c, layout)
            layers = range(layer, layer + count)
            layer += count
            moe = sum(1 for i in layers if model.is_moe(i))
            seconds = (count - moe) * total[False] + (moe and moe * total[True])
            params_c = (count - moe) * per_layer[False] + (moe and moe * per_layer[True])
            chunk_forward = (count - moe) * forward[False] + (moe and moe * forward[True])
            if c == 0:
                seconds += embedding
                params_c += model.embedding_params / layout.tp
            if c == len(counts) - 1:
                seconds += head
                params_c += model.head_params / layout.tp
            work[d] += seconds
            params[d] += params_c
            if fill[d] is None:
                fill[d], first[d] = before, layers
            before += chunk_forward
        m = layout.micro_batches(self.batch)
        largest = max(per_layer.values())
        state = [stage_state(p, self.batch, layout, largest_layer=largest).total
                 for p in params]

        def memory(rerun: int) -> float:
            """The floor with each chunk's first `rerun` layers keeping only their input."""
            return max(state[d] + _in_flight(layout, d, m) * sum(
                (rerun_held if position < rerun else held)[model.is_moe(i)]
                for position, i in enumerate(first[d])) for d in range(layout.pp))
        rerun = 0
        if layout.recompute == "block":
            # the fewest layers per chunk whose floor fits (at least the layout's own): no
            # fewer can fit, so their forwards are rerun in every chunk
            rerun = layout.recompute_layers
            if self.search_block:
                while rerun < max(counts) and memory(rerun) > self.capacity:
                    rerun += 1
            layer = 0
            for c, count in enumerate(counts):
                d = device_of(c, layout)
                work[d] += sum(forward[model.is_moe(i)]
                               for i in range(layer, layer + min(rerun, count)))
                layer += count
        seconds = max(fill[d] + m * work[d] for d in range(layout.pp))
        return _Bound(seconds, memory(rerun))


def _in_flight(layout: Layout, device: int, m: int) -> int:
    """Chunk activations the schedule's template holds at least on `device` at its peak:
    its warmup's forwards and one more (1F1B: p - d micro-batches; interleaved: Megatron-LM's
    2(p - d - 1) + (v - 1) p + 1 chunks; the V: p chunks, half its limit)."""
    p, v = layout.pp, layout.vpp
    if layout.schedule == "interleaved-1f1b":
        return min(m * v, 2 * (p - device - 1) + (v - 1) * p + 1)
    if layout.schedule == "zb-v":
        return min(2 * m, p)
    if layout.schedule in ("1f1b", "zb-h1", "zb-h2", "zb-2p"):
        return min(m, p - device)
    return 1


def search(model: Transformer, cluster: Cluster, batch: Batch, gpus: int, fixed: Fixed,
           top: int = 1) -> tuple[list[Prediction], int, int]:
    """The `top` fastest layouts that fit (when none fits: the least memory first), the
    number of candidates and how many were priced exactly."""
    bounds = _Bounds(model, cluster, batch, fixed.recompute_layers is None)
    found = candidates(model, cluster, batch, gpus, fixed)
    heap, smallest = [], None
    for i, layout in enumerate(found):
        b = bounds.bound(layout)
        if b.memory <= bounds.capacity or fixed.everything:
            heapq.heappush(heap, (b.seconds, i, layout))
        elif smallest is None or b.memory < smallest[0]:
            smallest = (b.memory, i, layout)
    if not heap and smallest is not None:  # nothing fits: show the least memory
        heapq.heappush(heap, (0.0, smallest[1], smallest[2]))
    best: list[Prediction] = []
    over: list[Prediction] = []
    fitting: set[tuple] = set()
    priced = 0
    while heap:
        seconds, _, layout = heapq.heappop(heap)
        if len(best) >= top and seconds >= best[top - 1].seconds:
            break
        if any((_key(layout), r) in fitting for r in LESSER[layout.recompute]):
            continue
        if layout.recompute == "block" and fixed.recompute_layers is None:
            prediction, count = _fewest_rerun(model, cluster, layout, batch)
        else:
            prediction, count = predict(model, cluster, layout, batch), 1
        priced += count
        if prediction.fits:
            fitting.add((_key(layout), layout.recompute))
            best.append(prediction)
            best.sort(key=lambda p: (p.seconds, _order(p.layout)))
            del best[top:]
        else:
            over.append(prediction)
    if best:
        return best, len(found), priced
    over.sort(key=lambda p: (p.memory_bytes, p.seconds))
    return over[:top], len(found), priced


# What recomputes less than each (never slower in this model): a layout is skipped where one
# of these fits. Selective and block are not ordered: block may rerun fewer FLOPs.
LESSER = {"none": (), "selective": ("none",), "block": ("none",),
          "full": ("none", "selective", "block")}


def _fewest_rerun(model: Transformer, cluster: Cluster, layout: Layout,
                  batch: Batch) -> tuple[Prediction, int]:
    """Block recomputation of the fewest layers per chunk that fit (more rerun hold less and
    take longer: a bisection over 1 .. the longest chunk's layers - 1; all of them is full
    recomputation), with the number of layouts priced; none fitting: the one that holds
    least."""
    least = predict(model, cluster, replace(layout, recompute_layers=1), batch)
    most = max(least.layers_per_stage) - 1
    if least.fits or most <= 1:
        return least, 1
    fits = predict(model, cluster, replace(layout, recompute_layers=most), batch)
    priced, low = 2, 1
    if not fits.fits:
        return fits, priced
    while fits.layout.recompute_layers - low > 1:
        middle = (low + fits.layout.recompute_layers) // 2
        trial = predict(model, cluster, replace(layout, recompute_layers=middle), batch)
        priced += 1
        if trial.fits:
            fits = trial
        else:
            low = middle
    return fits, priced


def _key(layout: Layout) -> tuple:
    return (layout.tp, layout.pp, layout.dp, layout.vpp, layout.micro_batch,
            layout.sequence_parallel, layout.schedule, layout.distributed_optimizer,
            layout.cp, layout.ep, layout.fsdp, layout.dp_replicate)


def _order(layout: Layout) -> tuple:
    """Ties go to the simpler layout."""
    return (layout.tp, layout.cp, layout.pp, layout.vpp, layout.ep, -layout.micro_batch,
            layout.schedule, RECOMPUTE.index(layout.recompute), layout.recompute_layers)
