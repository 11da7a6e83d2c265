"""The time of NCCL's collectives on a cluster, by message size.

A collective of S bytes over n ranks with k of them on each node:

- bandwidth: a ring moves 2(n-1)/n S (all-reduce) or (n-1)/n S (all-gather, reduce-scatter)
  through each rank's busiest link, at the bus bandwidth nccl-tests reports for large
  messages: NVLink/NVSwitch inside a node; across nodes the node's network ports, which NCCL's
  channels spread the group's k GPUs' rings over (a group of one GPU per node gets one port);
- latency: every step of the ring pays the link's per-step latency (2(n-1) steps for an
  all-reduce, those between nodes the network's), across nodes NCCL's trees pay about
  2 log2(nodes) network steps instead where that is shorter for an all-reduce (NCCL runs
  all-gathers and reduce-scatters as rings only: their latency grows with the ranks), and
  each collective pays a fixed latency. Small messages are latency bound: this is what makes
  a small model's or a small micro-batch's collectives slow;
- protocol: NCCL times each collective with its three protocols and runs the fastest; LL and
  LL128 step quickly but carry less payload per byte moved, Simple carries all of it in slow
  steps (constants.NCCL_PROTOCOLS: the figures of NCCL's own tuning model);
- overlap: a collective that runs beside compute kernels gets fewer SMs for its channels and
  shares HBM with them: `overlapped=True` divides its bandwidth by the fitted share it keeps.

All-to-all (expert dispatch and combine): each rank sends (n-1)/n of its bytes, the part for
ranks on its node over NVLink and the rest over its own network port (all-to-all traffic does
not aggregate over a node's ports as a ring's does).
"""

from __future__ import annotations

import math

from pyplan.cluster import constants
from pyplan.cluster.hardware import Cluster

__all__ = ["all_gather", "all_reduce", "all_to_all", "reduce_scatter", "send", "spans_nodes"]


def spans_nodes(cluster: Cluster, ranks: int, per_node: int) -> bool:
    return per_node < ranks


def _bandwidth(cluster: Cluster, ranks: int, per_node: int) -> float:
    inside = cluster.link_gbs * 1e9 * cluster.link_efficiency
    if per_node >= ranks:
        return inside
    return min(inside, cluster.network_gbs * 1e9 * cluster.network_efficiency * per_node)


def _ring(cluster: Cluster, nbytes: float, ranks: int, per_node: int, passes: int,
          overlapped: bool) -> float:
    """The fastest of NCCL's protocols (and for an all-reduce across nodes, of its ring and its
    tree): each a fixed latency, a latency per step and its share of the bus bandwidth."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    per_node = max(1, min(per_node, ranks))
    bandwidth = _bandwidth(cluster, ranks, per_node)
    if overlapped:
        bandwidth *= constants.OVERLAP_SHARE
    nodes = -(-ranks // per_node)
    link = cluster.link_latency_us / constants.LINK_LATENCY_US * 1e-6
    network = cluster.network_latency_us / constants.NETWORK_LATENCY_US * 1e-6
    steps, across = passes * (ranks - 1), passes * (nodes - 1)
    moved = passes * (ranks - 1) / ranks * nbytes
    best = math.inf
    for name, (share, fixed, ring_in, ring_out, tree_in, tree_out, tree_fixed) in \
            constants.NCCL_PROTOCOLS.items():
        if name == "LL" and nodes == 1 and passes == 1:
            share = 1 / 3  # (LL's flags cost less of an all-gather inside a node)
        if name == "LL" and nodes > 1:
            ring_in *= constants.LL_INTRA_ACROSS_NODES
            tree_in *= constants.LL_INTRA_ACROSS_NODES
        latency = fixed * 1e-6 + (steps - across) * ring_in * link + across * ring_out * network
        if name == "Simple" and passes == 2 and nodes > 1 and \
                nbytes >= ranks / 16 * 65536:
            latency *= constants.RING_PLATEAU
        best = min(best, latency + moved / (bandwidth * share))
        if passes == 2 and nodes > 1:  # NCCL's tree: up and down, log2(nodes) network steps
            latency = tree_fixed * 1e-6 + 2 * ((per_node - 1) * tree_in * link + math.ceil(
                math.log2(nodes)) * tree_out * network)
            best = min(best, latency + 2 * nbytes / (bandwidth * constants.TREE_BANDWIDTH *
                                                      share))
    return best


def all_reduce(cluster: Cluster, nbytes: float, ranks: int, per_node: int,
               overlapped: bool = False) -> float:
    """An all-reduce of `nbytes` (each rank's whole buffer)."""
    return _ring(cluster, nbytes, ranks, per_node, 2, overlapped)


def all_gather(cluster: Cluster, nbytes: float, ranks: int, per_node: int,
               overlapped: bool = False) -> float:
    """An all-gather of `nbytes` in all, each rank holding 1/ranks of them."""
    return _ring(cluster, nbytes, ranks, per_node, 1, overlapped)


reduce_scatter = all_gather
"""A reduce-scatter of `nbytes` in all (each rank's whole buffer) moves what an all-gather
moves."""


def all_to_all(cluster: Cluster, nbytes: float, ranks: int, per_node: int,
               overlapped: bool = False) -> float:
    """Each rank sends `nbytes` in all, 1/ranks of them to each rank (itself included)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    per_node = max(1, min(per_node, ranks))
    inside = cluster.link_gbs * 1e9 * cluster.link_efficiency
    network = cluster.network_gbs * 1e9 * cluster.network_efficiency
    local = nbytes * (per_node - 1) / ranks
    remote = nbytes * (ranks - per_node) / ranks
    share = constants.OVERLAP_SHARE if overlapped else 1.0
    seconds = max(local / inside, remote / network if remote else 0.0) / share
    latency = cluster.network_latency_us if remote else cluster.link_latency_us
    return constants.COLLECTIVE_US * 1e-6 + latency * 1e-6 + seconds


def send(cluster: Cluster, nbytes: float, across_nodes: bool) -> float:
    """One point-to-point message between two GPUs."""
    if nbytes <= 0:
        return 0.0
    if across_nodes:
        return (constants.COLLECTIVE_US + cluster.network_latency_us) * 1e-6 + nbytes / (
            cluster.network_gbs * 1e9 * cluster.network_efficiency)
    return (constants.COLLECTIVE_US + cluster.link_latency_us) * 1e-6 + nbytes / (
        cluster.link_gbs * 1e9 * cluster.link_efficiency)
