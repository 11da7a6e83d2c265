"""A cluster that is not here: its GPUs, their links inside a node and the network between
nodes, read from a YAML file (schemas/cluster.schema.json) or a preset by name
(pyplan/cluster/presets/). What its collectives cost is pyplan.cluster.collectives'.
"""

from __future__ import annotations

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
    memory_efficiency: float | None = None
    """None: constants.MEMORY_EFFICIENCY (fitted)."""
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
