"""A cluster that is not here: its GPUs, their links inside a node and the network between
nodes, read from a YAML file (schemas/cluster.schema.json) or a preset by name
(pyplan/cluster/presets/), and the time its collectives take.

Collectives are rings (NCCL's algorithm for large messages): an all-reduce of S bytes over n
ranks moves 2(n-1)/n S through each rank's busiest link, an all-gather or a reduce-scatter
half that. Inside a node the link is NVLink/NVSwitch; a group that spans nodes
crosses the network once per node on each ring, and NCCL spreads its rings over the node's
network interfaces, so the bytes crossing it share the bandwidth of the group's GPUs on that
node (a data-parallel group of one GPU per node gets one GPU's share). Each collective also
pays the link's latency, which is what makes small messages slow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from pyplan.cluster import constants
from pyplan.errors import PlanError

__all__ = ["Cluster", "Gpu", "PRESETS", "load_cluster", "preset_names"]

PRESETS = Path(__file__).resolve().parent / "presets"
DTYPES = ("bf16", "fp16", "fp32", "tf32", "fp8")


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_tflops: dict
    """Dense peak per dtype (bf16, fp16, tf32, fp32, fp8), TFLOP/s."""
    memory_gib: float
    memory_bandwidth_gbs: float
    sms: int = constants.SMS
    matmul_efficiency: float = constants.MATMUL_EFFICIENCY
    memory_efficiency: float = constants.MEMORY_EFFICIENCY
    attention_efficiency: float = constants.ATTENTION_EFFICIENCY
    reserved_gib: float = constants.RESERVED_GIB
    kernel_us: float = constants.KERNEL_US

    def peak(self, dtype: str) -> float:
        """FLOP/s of the dtype's tensor cores (fp32 runs as tf32 where only that is given)."""
        table = self.peak_tflops
        value = table.get(dtype) or (table.get("tf32") if dtype == "fp32" else None) \
            or table.get("bf16") or table.get("fp16")
        return float(value) * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: Gpu
    gpus_per_node: int
    link_gbs: float
    """NVLink/NVSwitch bandwidth per GPU, one direction."""
    network_gbs: float
    """Network bandwidth per GPU between nodes, one direction."""
    nodes: int | None = None
    """None: as many as asked for (a preset describes a node type)."""
    link_latency_us: float = constants.LINK_LATENCY_US
    network_latency_us: float = constants.NETWORK_LATENCY_US
    link_efficiency: float = constants.LINK_EFFICIENCY
    network_efficiency: float = constants.NETWORK_EFFICIENCY
    source: str = field(default="", compare=False)

    @property
    def gpus(self) -> int | None:
        return None if self.nodes is None else self.gpus_per_node * self.nodes

    def bandwidth(self, ranks: int, per_node: int) -> tuple[float, float]:
        """(bytes per second, seconds of latency) of a collective over `ranks` GPUs with
        `per_node` of them on each node. A large message is cut into chunks that the ring
        pipelines, so latency is paid about once inside a node; across nodes NCCL's trees make
        it grow with the logarithm of the nodes."""
        inside = self.link_gbs * 1e9 * self.link_efficiency
        if per_node >= ranks:
            return inside, self.link_latency_us * 1e-6
        across = self.network_gbs * 1e9 * self.network_efficiency * per_node
        nodes = -(-ranks // per_node)
        return min(inside, across), self.network_latency_us * 1e-6 * (1 + math.log2(nodes))

    def all_reduce(self, nbytes: float, ranks: int, per_node: int) -> float:
        return self._ring(nbytes, ranks, per_node, 2)

    def all_gather(self, nbytes: float, ranks: int, per_node: int) -> float:
        """All-gather (or reduce-scatter) of `nbytes` in all, each rank holding 1/ranks."""
        return self._ring(nbytes, ranks, per_node, 1)

    def _ring(self, nbytes: float, ranks: int, per_node: int, passes: int) -> float:
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        bandwidth, latency = self.bandwidth(ranks, per_node)
        return passes * latency + passes * (ranks - 1) / ranks * nbytes / bandwidth

    def send(self, nbytes: float, across_nodes: bool) -> float:
        """One point-to-point message between two GPUs."""
        if nbytes <= 0:
            return 0.0
        if across_nodes:
            return self.network_latency_us * 1e-6 + nbytes / (
                self.network_gbs * 1e9 * self.network_efficiency)
        return self.link_latency_us * 1e-6 + nbytes / (self.link_gbs * 1e9 *
                                                       self.link_efficiency)


_GPU_KEYS = {f.name for f in fields(Gpu)}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def load_cluster(where: str) -> Cluster:
    """A cluster file, or a preset's name (dgx-a100-80gb, dgx-h100, ...)."""
    from pyplan.planfile.plan import check_document
    from pyplan.planfile.schema import check_schema
    from pyplan.planfile.source import load_yaml

    path = Path(where)
    if not path.exists() and (PRESETS / f"{where}.yaml").is_file():
        path = PRESETS / f"{where}.yaml"
    if not path.is_file():
        raise PlanError(f"{where}: no such cluster file or preset",
                        hint="a cluster YAML file (docs/cluster-planning.md), or one of the "
                        "presets: " + ", ".join(preset_names()), file=where, line=1, column=1)
    source = load_yaml(path)
    check_document(source)  # (.nan and .inf pass JSON Schema's bounds)
    check_schema(source, "cluster")
    doc = source.data
    gpu = doc["gpu"]
    peaks = gpu["peak_tflops"]
    return Cluster(name=doc.get("name", path.stem),
                   gpu=Gpu(**{k: v for k, v in gpu.items() if k in _GPU_KEYS
                              and k != "peak_tflops"}, peak_tflops=dict(peaks)),
                   gpus_per_node=doc["node"]["gpus"], link_gbs=doc["node"]["link_gbs"],
                   link_latency_us=doc["node"].get("latency_us", constants.LINK_LATENCY_US),
                   network_gbs=doc["network"]["gbs_per_gpu"],
                   network_latency_us=doc["network"].get("latency_us",
                                                         constants.NETWORK_LATENCY_US),
                   nodes=doc.get("nodes"), source=str(path))
