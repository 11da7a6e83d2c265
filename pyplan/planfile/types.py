"""The typed, immutable view of a plan: one frozen dataclass per part of the document.

pyplan.planfile.plan reads a document into these; the problem IR (pyplan.problem) is built from
them.
"""

from __future__ import annotations

from fractions import Fraction
from dataclasses import dataclass, field
from pathlib import Path

from pyplan.planfile.source import Source

# model.layer_returns (forward cut): the hidden states alone, or a tuple of 1 to 8 values with
# them first (a stand-in for a layer another rank holds returns the same structure).
LAYER_RETURNS = ("tensor", "tuple", *(f"tuple of {n}" for n in range(2, 9)))

__all__ = [
    "FORMAT_VERSION",
    "LAYER_RETURNS",
    "BackwardOverride",
    "BackwardSpec",
    "BlockSpec",
    "CostSpec",
    "CPU_LINK",
    "LinkSpec",
    "MeshSpec",
    "ModelSpec",
    "OrderSpec",
    "PlanSpec",
    "SearchSpec",
    "ShapeSpec",
    "TopologySpec",
]

FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class BackwardSpec:
    """How backward blocks are derived from forward blocks (training.backward)."""

    time_ratio: float = 2.0
    """Backward (or input-gradient) time as a multiple of the forward time."""
    weight_time_ratio: float | None = None
    """When set, the backward splits into NAME.b and a weight-gradient block NAME.w."""
    weight_memory_ratio: float = 0.0
    """Fraction of the forward's memory that stays allocated until NAME.w runs."""


@dataclass(frozen=True, kw_only=True)
class BackwardOverride:
    """A block's own backward costs (overriding the derived ones), or no backward at all."""

    enabled: bool = True
    time: int | None = None
    memory: int | None = None
    weight_time: int | None = None
    weight_memory: int | None = None


@dataclass(frozen=True, kw_only=True)
class BlockSpec:
    """One block as written in `blocks:`."""

    name: str
    kind: str = "forward"
    time: int
    memory: int = 0
    weights: int = 0
    """Static memory on each of its devices for the whole run (parameters, gradients,
    optimizer state)."""
    workspace: int = 0
    """Memory it needs while it (or its backward) runs, beyond what it holds: temporaries,
    the gradients flowing through it. The largest on a device is reserved there."""
    update: int = 0
    """Time of the optimizer's step over its parameters (and of keeping its tied copies
    equal), once per iteration after its last backward: not scheduled, predicted beside."""
    transfer: int | None = None
    """Time its output (and that output's gradient) takes between devices."""
    output: int | None = None
    """Bytes of its output, timed on the topology's links when transfer is not given."""
    recompute: str | None = None
    """never, always or auto; None: training.recompute."""
    recompute_memory: int = 0
    devices: tuple[int, ...] | None
    """Device ids; None means all devices."""
    after: tuple[str, ...] | None = None
    """Dependencies by name; None means "the block listed before"."""
    backward: BackwardOverride = BackwardOverride()
    path: tuple = ()
    """Where the block sits in the document, for error messages."""


@dataclass(frozen=True, kw_only=True)
class CostSpec:
    """Costs of a shape's stage blocks or shared blocks."""

    time: int | tuple[int, ...] = 1
    memory: int | tuple[int, ...] = 0
    weights: int | tuple[int, ...] = 0
    transfer: int | tuple[int, ...] | None = None
    output: int | tuple[int, ...] | None = None
    recompute: str | None = None
    recompute_memory: int | tuple[int, ...] = 0
    backward: BackwardOverride = BackwardOverride()
    path: tuple = ()


@dataclass(frozen=True, kw_only=True)
class ShapeSpec:
    """A placement shorthand (shape:) that expands into blocks."""

    kind: str
    stages: int | None = None
    chunks: int | None = None
    stage: CostSpec = CostSpec()
    shared: CostSpec = CostSpec()
    path: tuple = ("shape",)


@dataclass(frozen=True, kw_only=True)
class OrderSpec:
    """One order rule as written; `loop` holds the values of its {variables}."""

    text: str
    loop: dict[str, tuple[int, ...]] = field(default_factory=dict)
    path: tuple = ()
    text_path: tuple = ()


@dataclass(frozen=True, kw_only=True)
class SearchSpec:
    """Options of `pyplan solve`."""

    max_repetend_micro_batches: int | None = None
    time_limit: float | None = None
    """A hard cap on the search's wall time, in seconds (None: the solver's default)."""
    exact: bool = True
    effort: float = 1.0
    """How long the search may go on without progress, relative to the work it has done (and
    how much its fixed stages may spend): 10 searches about ten times as long."""


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """The plan is one pipeline of a device mesh. Each pipeline device is `data` x `shard` x
    `tensor` GPUs: `data` replicas of the pipeline (and with `shard: N`, N shards of each,
    HSDP) train on slices of the global batch and synchronise each stage's gradients once per
    iteration, `sync` time units after the stage's last backward on a device (overlapped with
    the remaining work); `shard` shards parameters, gradients and optimizer state (FSDP2):
    `true` over all `data` ranks, N over N ranks inside each of `data` replicas; `tensor`
    GPUs split each stage's layers (tensor parallelism). World ranks run pipeline-major with
    tensor parallelism innermost, as Megatron-LM and torchtitan order them: rank =
    (device x data_parallel + data_index) x tensor + tensor_index, data_index = replica x
    shards + shard."""

    data: int = 1
    shard: bool | int = False
    sync: int = 0
    tensor: int = 1
    """Tensor-parallel GPUs per pipeline device."""
    tensor_plan: tuple[tuple[str, str], ...] = ()
    """(module path pattern, style) pairs added to (or overriding) the model's own plan."""
    sequence: bool = True
    """Sequence parallelism beside tensor parallelism (Megatron-LM's --sequence-parallel):
    the norms and dropouts between the tensor-parallel regions run on sequence slices."""
    priced: int = 1
    """The tensor degree the blocks' costs are one rank's of (`pyplan partition --tensor T`
    and `pyplan plan` write it): a plan loads only where it equals `tensor`, so no mesh runs on
    costs measured for another (a whole model's, most often)."""

    @property
    def sequence_parallel(self) -> bool:
        return self.tensor > 1 and self.sequence

    @property
    def replicas(self) -> int:
        """Copies of the parameters (dp_replicate)."""
        return 1 if self.shard is True else self.data

    @property
    def shards(self) -> int:
        """Parts each copy is sharded into (dp_shard)."""
        if self.shard is True:
            return self.data
        return self.shard if type(self.shard) is int and self.shard > 1 else 1

    @property
    def data_parallel(self) -> int:
        """Ranks per pipeline device and tensor rank that train on different data."""
        return self.replicas * self.shards

    def world(self, devices: int) -> int:
        return devices * self.data_parallel * self.tensor

    def rank(self, device: int, data_index: int = 0, tensor_index: int = 0) -> int:
        return (device * self.data_parallel + data_index) * self.tensor + tensor_index

    def describe(self, devices: int) -> str:
        """'4 devices', '2 devices x 2 replicas x 2 shards x 2 tensor ranks'."""
        parts = [f"{devices} device" + ("s" if devices != 1 else "")]
        if self.replicas > 1:
            parts.append(f"{self.replicas} replicas")
        if self.shards > 1:
            parts.append(f"{self.shards} shards")
        if self.tensor > 1:
            parts.append(f"{self.tensor} tensor ranks")
        return " x ".join(parts)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(device, data index, tensor index) of a world rank."""
        rest, tensor_index = divmod(rank, self.tensor)
        device, data_index = divmod(rest, self.data_parallel)
        return device, data_index, tensor_index


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """A link between two devices: bytes per second and a fixed latency."""

    bandwidth: int
    latency_ms: float

    def milliseconds(self, size: int) -> float:
        return self.latency_ms + 1000.0 * size / self.bandwidth


# gloo between two processes of a CPU machine, as benchmarks/links.py measures it (the median
# of its rounds on a 2-core machine): what `pyplan partition --device cpu` writes into a plan
# when it does not measure the link (--links). TopologySpec's defaults are a GPU node's.
CPU_LINK = LinkSpec(bandwidth=1_880_000_000, latency_ms=0.093)


@dataclass(frozen=True, kw_only=True)
class TopologySpec:
    """Nodes of devices_per_node devices and the links within and across them; times the
    transfers of blocks that give their output size."""

    devices_per_node: int | None = None
    """None: every device in one node."""
    time_unit_ms: float | None = None
    """Milliseconds per time unit, when the plan says; transfers are timed with 1 otherwise."""
    within_node: LinkSpec = LinkSpec(bandwidth=100 * 10**9, latency_ms=0.01)
    across_nodes: LinkSpec = LinkSpec(bandwidth=125 * 10**8, latency_ms=0.02)

    def node(self, device: int) -> int:
        return 0 if self.devices_per_node is None else device // self.devices_per_node

    def transfer_time(self, size: int, source: int, target: int) -> int:
        """Time units to move `size` bytes from one device to another, to the nearest unit."""
        link = self.within_node if self.node(source) == self.node(target) else self.across_nodes
        units = link.milliseconds(size) / (self.time_unit_ms or 1.0)
        if units < 2**62:
            return int(units + 0.5)
        # Past that, exactly: a tiny (denormal) time unit makes the float quotient infinite.
        return int(Fraction(link.milliseconds(size)) / Fraction(self.time_unit_ms or 1.0)
                   + Fraction(1, 2))


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Import paths `pyplan run` uses to build modules, data and loss: a `blocks` function
    building each block, or a `module` function building the whole model and, in `stages`, the
    dotted submodule names each block runs."""

    blocks: str | None = None
    module: str | None = None
    stages: tuple[tuple[str, tuple[str, ...]], ...] = ()
    cut: str = "chain"
    """With module: how stages are cut out of the model: chain (its children in a row),
    forward (the model's own forward, entered and left at each stage's first module) or
    traced (torch's pipeline tracer). `traced: true` is the older spelling of cut: traced."""
    layer_returns: str = "tensor"
    """Forward cut: what the model's layers return, one of LAYER_RETURNS: tensor, tuple (of
    one, or of any length whose later values the model does not unpack) or tuple of N (hidden
    states first)."""
    ties: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    """Parameters several stages hold: (name in the model, the stages), as partition found
    them; None when the plan records none."""
    vocab_parallel: tuple[str, str] | None = None
    """With module: (token embedding, output head), sharded over the vocabulary by the
    multi-device blocks holding them (M-shape); None when nothing is sharded."""
    weights: str | None = None
    """With module: a safetensors checkpoint folder (relative to the plan) the parameters
    start from, each rank reading only its own; None: the factory's initialisation."""
    optimizer: str | None = None
    """The optimizer (sgd or adamw) whose state the plan's weights count: `pyplan run`'s
    default; None when the plan does not say (sgd)."""
    data: str
    loss: str
    path: str | None = None

    @property
    def builder(self) -> str:
        """The import path that builds the modules."""
        return self.blocks if self.blocks is not None else self.module

    @property
    def traced(self) -> bool:
        return self.cut == "traced"


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """A whole plan as written (shapes not yet expanded)."""

    source: Source
    name: str
    description: str = ""
    num_devices: int
    memory_capacity: int | None = None
    """Per-device capacity in the plan's unit (bytes when sizes are used); None = unlimited."""
    device_memory: tuple[int | None, ...] = ()
    """Each device's capacity where the devices differ (None: unlimited); empty when they all
    have memory_capacity."""
    device_speed: tuple[float, ...] = ()
    """Each device's speed relative to the one block times were measured on, where some
    differs from 1 (empty: all 1)."""
    memory_is_size: bool = False
    num_micro_batches: int
    task: str = "training"
    backward: BackwardSpec | None = None
    recompute: str = "never"
    """training.recompute: the default of every forward block with a derived backward."""
    topology: TopologySpec = TopologySpec()
    shape: ShapeSpec | None = None
    blocks: tuple[BlockSpec, ...] = ()
    order: tuple[OrderSpec, ...] = ()
    search: SearchSpec = SearchSpec()
    mesh: MeshSpec = MeshSpec()
    model: ModelSpec | None = None

    @property
    def training(self) -> bool:
        return self.task == "training"

    @property
    def base_dir(self) -> Path:
        return Path(self.source.path).resolve().parent
