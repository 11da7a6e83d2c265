"""Graph pipelines against the best chain (issue #58), on models of GraphPipe's shapes (Jeon et
al., thesis ch. 3, 3.10.3), at 4, 8 and 16 devices:

    python benchmarks/graph.py [--width 256] [--devices 4,8,16] [--time-limit 5]

- CANDLE-Uno: 7 branches of 4 Linear + ReLU, concatenated, a head of 3 layers;
- multi-modal transformer (MMT): 4 branches (a projection, 4 transformer layers), pooled,
  concatenated, a head;
- DLRM: 7 dense branches of 4 Linear + ReLU and 7 embedding bags (8 rows each, summed),
  concatenated (the interaction), a top MLP of 3 layers.

Each model's units are measured once on this machine (pyplan.measure.profile: one micro-batch
of 8 samples, one CPU thread) and its graph found by torch's tracer (pyplan.models.graph); from
those same costs, per device count (micro-batches: 2 x devices, partition's default), the
graph plans (`pyplan partition --shape graph`: pyplan.measure.placements.graph_plans) and the
chain plans (`--shape vshape`: the best partitions and the even splits) are solved by pyplan's
solver. Printed per model and device count: each one's predicted throughput (samples per
second of the solved makespan), efficiency (the blocks' total time / (devices x makespan)),
depth (the longest chain of stages), the ratio graph / chain, and the graph search's time (the
series-parallel decomposition, the DP and its binary search; GraphPipe's Table 3.1, on an
Apple M1 Max: 0.12-3.00 s at 4-16 GPUs, 54.6 s at most at 32) beside the time its candidates
took to solve.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from pyplan.api import partition_plans
from pyplan.measure.placements import graph_plans
from pyplan.measure.profile import profile_units
from pyplan.models.graph import unit_graph
from pyplan.partition.graph import UnitGraph, graph_candidates

BATCH, SEQUENCE, ROWS, BAG = 8, 16, 1000, 8


def _mlp(inputs: int, width: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*[m for i in range(layers) for m in (
        nn.Linear(inputs if i == 0 else width, width), nn.ReLU())])


class Uno(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(_mlp(width, width, 4) for _ in range(7))
        self.head = nn.Sequential(nn.Linear(7 * width, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, x):
        return self.head(torch.cat([b(x[:, i]) for i, b in enumerate(self.branches)], -1))


class Layer(nn.Module):
    """Pre-norm self-attention and MLP."""

    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2))
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Mean(nn.Module):
    """The mean over the sequence, a module of the branch: what the forward does between two
    units goes with the later one (pyplan.models.graph), so a branch's own last step belongs
    inside its modules, not between them."""

    def forward(self, x):
        return x.mean(1)


class MMT(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), *(Layer(width) for _ in range(4)), Mean())
            for _ in range(4))
        self.head = nn.Linear(4 * width, 1)

    def forward(self, x):
        return self.head(torch.cat([b(x[:, i]) for i, b in enumerate(self.branches)], -1))


class DLRM(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.dense = nn.ModuleList(_mlp(width, width, 4) for _ in range(7))
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, width, mode="sum") for _ in range(7))
        self.top = nn.Sequential(nn.Linear(14 * width, width), nn.ReLU(),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, x):  # (dense features | bag ids) per branch, in one tensor
        width = self.tables[0].embedding_dim  # (each branch slices its own: see Mean)
        parts = [b(x[:, i, :width]) for i, b in enumerate(self.dense)]
        parts += [t(x[:, i, width:].long()) for i, t in enumerate(self.tables)]
        return self.top(torch.cat(parts, -1))


def _inputs(name: str, width: int, g: torch.Generator):
    if name == "uno":
        return torch.randn(BATCH, 7, width, generator=g)
    if name == "mmt":
        return torch.randn(BATCH, 4, SEQUENCE, width, generator=g)
    return torch.cat([torch.randn(BATCH, 7, width, generator=g),
                      torch.randint(0, ROWS, (BATCH, 7, BAG), generator=g).float()], -1)


def measured(name: str, width: int):
    """(the units' costs, their graph) of one model, measured here."""
    torch.manual_seed(0)
    model = {"uno": Uno, "mmt": MMT, "dlrm": DLRM}[name](width)
    g = torch.Generator().manual_seed(0)
    x, y = _inputs(name, width, g), torch.randn(BATCH, 1, generator=g)
    units, cut = profile_units(model, x, y, F.mse_loss, repeats=3, threads=1)
    assert cut.kind == "traced", cut
    preds, reads, sizes = unit_graph(model, [u.name for u in units], x)
    return units, UnitGraph(tuple(preds), tuple(reads), tuple(sizes))


def compare(units, graph, devices: int, time_limit: float) -> dict:
    n = 2 * devices
    options = dict(name="bench", factory="bench:model", data="bench:batch",
                   loss="bench:loss", micro_batches=n, time_limit=time_limit)
    start = time.perf_counter()
    graph_candidates(units, graph, devices, micro_batches=n)
    search = time.perf_counter() - start
    start = time.perf_counter()
    graphs = graph_plans(units, graph, devices=devices, cut="traced", **options)
    solve = time.perf_counter() - start
    chains = partition_plans(units, devices=devices, cut="traced", **options)
    busy = n * sum(u.forward_ms + u.backward_ms for u in units)
    row = {"search_s": search, "solve_s": solve}
    for kind, best in (("graph", graphs[0]), ("chain", chains[0])):
        row[kind] = {"samples_s": n * BATCH / (best.makespan_ms / 1e3),
                     "efficiency": busy / (devices * best.makespan_ms),
                     "depth": getattr(best.partition, "depth", best.partition.num_stages)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--devices", default="4,8,16")
    parser.add_argument("--time-limit", type=float, default=5.0)
    args = parser.parse_args()
    counts = [int(d) for d in args.devices.split(",")]
    torch.set_num_threads(1)
    print(f"width {args.width}, micro-batch {BATCH} samples, 2 x devices micro-batches")
    print(f"{'model':6} {'dev':>3} {'units':>5} | {'graph samples/s':>15} {'eff':>5} "
          f"{'depth':>5} | {'chain samples/s':>15} {'eff':>5} {'depth':>5} | {'ratio':>5} | "
          f"{'search s':>8} {'solve s':>7}")
    for name in ("uno", "mmt", "dlrm"):
        units, graph = measured(name, args.width)
        for devices in counts:
            row = compare(units, graph, devices, args.time_limit)
            g, c = row["graph"], row["chain"]
            print(f"{name:6} {devices:>3} {len(units):>5} | {g['samples_s']:15.1f} "
                  f"{g['efficiency']:5.2f} {g['depth']:>5} | {c['samples_s']:15.1f} "
                  f"{c['efficiency']:5.2f} {c['depth']:>5} | "
                  f"{g['samples_s'] / c['samples_s']:5.2f} | {row['search_s']:8.3f} "
                  f"{row['solve_s']:7.1f}", flush=True)


if __name__ == "__main__":
    main()
