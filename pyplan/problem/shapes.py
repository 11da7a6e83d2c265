"""Placement shapes (Tessel Fig. 1/8, Megatron interleaving) expanded into block lists.

A shape names its blocks predictably so order constraints can refer to them:
vshape/interleaved/mshape/nnshape/wave use stage0..stageS-1 (plus embed, embed2 for the all-device
blocks), xshape uses down0.. and up0.., kshape uses left0.., right0.. and cross.
"""

from __future__ import annotations

from pyplan.planfile import BlockSpec, CostSpec, PlanSpec, ShapeSpec

__all__ = ["SHAPES", "expand_blocks"]

SHAPES = ("vshape", "interleaved", "xshape", "mshape", "nnshape", "kshape", "wave")


class _Expander:
    def __init__(self, spec: PlanSpec, shape: ShapeSpec) -> None:
        self.spec = spec
        self.shape = shape
        self.source = spec.source
        self.blocks: list[BlockSpec] = []
        self.stage_index = 0

    def fail(self, path: tuple, message: str, hint: str | None = None, key: bool = False):
        return self.source.error(path, message, hint, key=key)

    def pick(self, cost: CostSpec, field: str, i: int, count: int) -> int:
        value = getattr(cost, field)
        if not isinstance(value, tuple):
            return value
        if len(value) != count:
            raise self.fail(cost.path + (field,),
                            f"{field} lists {len(value)} values for {count} stage blocks",
                            f"give one number for all stages or exactly {count} values")
        return value[i]

    def stage(self, name: str, device: int, count: int, after: tuple[str, ...] | None) -> None:
        cost = self.shape.stage
        i = self.stage_index
        self.stage_index += 1
        self.blocks.append(BlockSpec(
            name=name, time=self.pick(cost, "time", i, count),
            memory=self.pick(cost, "memory", i, count),
            weights=self.pick(cost, "weights", i, count),
            transfer=self.pick(cost, "transfer", i, count),
            output=self.pick(cost, "output", i, count), recompute=cost.recompute,
            recompute_memory=self.pick(cost, "recompute_memory", i, count),
            devices=(device,), after=after,
            backward=cost.backward, path=cost.path or self.shape.path))

    def shared(self, name: str, after: tuple[str, ...] | None) -> None:
        cost = self.shared_cost
        self.blocks.append(BlockSpec(name=name, time=cost.time, memory=cost.memory,
                                     weights=cost.weights, transfer=cost.transfer,
                                     output=cost.output, recompute=cost.recompute,
                                     recompute_memory=cost.recompute_memory,
                                     devices=None, after=after,
                                     backward=cost.backward, path=cost.path or self.shape.path))

    @property
    def shared_cost(self) -> CostSpec:
        cost = self.shape.shared
        for field in ("time", "memory", "weights", "transfer", "output", "recompute_memory"):
            if isinstance(getattr(cost, field), tuple):
                raise self.fail(cost.path + (field,),
                                f"shared {field} must be one value, not a list")
        return cost

    def expand(self) -> list[BlockSpec]:
        shape, D = self.shape, self.spec.num_devices
        kind = shape.kind
        if shape.chunks is not None and kind != "interleaved":
            raise self.fail(shape.path + ("chunks",), "chunks only applies to interleaved",
                            key=True)
        stages = shape.stages
        if kind == "interleaved":
            chunks = shape.chunks or 2
            stages = stages or D * chunks
            if stages % D:
                raise self.fail(shape.path + ("stages",),
                                f"interleaved needs stages to be a multiple of devices ({D}), "
                                f"got {stages}")
            for s in range(stages):
                self.stage(f"stage{s}", s % D, stages, None)
            return self.blocks
        if kind == "wave":  # down the devices and back up: two chunks per device
            if stages is not None and stages != 2 * D:
                raise self.fail(shape.path + ("stages",),
                                f"wave places two stages per device: stages must be {2 * D}, "
                                f"got {stages}")
            for s in range(2 * D):
                self.stage(f"stage{s}", s if s < D else 2 * D - 1 - s, 2 * D, None)
            return self.blocks
        if stages is not None and stages != D:
            raise self.fail(shape.path + ("stages",),
                            f"{kind} places one stage per device: stages must be {D}, "
                            f"got {stages}", "use kind: interleaved for several stages per device")
        if kind in ("nnshape", "kshape") and D < 2:
            raise self.fail(shape.path + ("kind",), f"{kind} needs at least 2 devices")
        if kind == "vshape":
            for s in range(D):
                self.stage(f"stage{s}", s, D, None)
        elif kind == "xshape":
            for s in range(D):
                self.stage(f"down{s}", s, 2 * D, None)
            for s in range(D):
                self.stage(f"up{s}", D - 1 - s, 2 * D, () if s == 0 else None)
        elif kind == "mshape":
            self.shared("embed", None)
            for s in range(D):
                self.stage(f"stage{s}", s, D, None)
        elif kind == "nnshape":
            half = D // 2
            self.shared("embed", None)
            for s in range(D):
                if s == half:
                    self.shared("embed2", None)
                self.stage(f"stage{s}", s, D, None)
        elif kind == "kshape":
            half = D // 2
            for s in range(half):
                self.stage(f"left{s}", s, D, None)
            for s in range(D - half):
                self.stage(f"right{s}", half + s, D, () if s == 0 else None)
            self.shared("cross", (f"left{half - 1}", f"right{D - half - 1}"))
        else:  # the schema admits only SHAPES
            raise AssertionError(kind)
        return self.blocks


def expand_blocks(spec: PlanSpec) -> list[BlockSpec]:
    """The plan's blocks as written, or its shape expanded into blocks."""
    if spec.shape is None:
        return list(spec.blocks)
    return _Expander(spec, spec.shape).expand()
