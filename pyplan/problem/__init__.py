"""The problem IR built from a plan: shapes expanded, backward blocks derived, and every check
that needs the expanded blocks, each pointing back at the plan line it concerns.

The IR itself (Block, OrderRule, Problem) lives in pyplan.problem.ir; its names are importable
from here too, beside build_problem and load_problem.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pyplan import _core
from pyplan.problem.constraints import RuleSyntaxError, expand_template
from pyplan.errors import PlanError, did_you_mean
from pyplan.problem.ir import (BACKWARD, FORWARD, OTHER, WEIGHT, Block, OrderRule, Problem,
                               RuleError, layer_of, reaches, resolve_rule)
from pyplan.problem.shapes import expand_blocks
from pyplan.planfile import BackwardSpec, BlockSpec, PlanSpec, format_memory, load_spec
from pyplan.planfile.plan import MAX_TIME

__all__ = ["FORWARD", "BACKWARD", "WEIGHT", "OTHER", "Block", "OrderRule", "Problem",
           "build_problem", "layer_of", "load_problem", "reaches", "resolve_rule"]


class _Builder:
    def __init__(self, spec: PlanSpec) -> None:
        self.spec = spec
        self.source = spec.source
        self.blocks: list[Block] = []
        self.edges: list[tuple[int, int]] = []
        self.paths: list[tuple] = []  # document path of the declaration behind each block
        self.by_name: dict[str, int] = {}
        self.declared: dict[str, BlockSpec] = {}

    def fail(self, path, message, hint=None, **kw) -> PlanError:
        return self.source.error(path, message, hint, **kw)

    def add(self, name: str, kind: str, time: int, memory: int, devices: tuple[int, ...],
            path: tuple, **extra) -> int:
        index = len(self.blocks)
        self.blocks.append(Block(index, name, kind, time, memory, devices, layer_of(name, kind),
                                 **extra))
        self.paths.append(path)
        self.by_name[name] = index
        return index

    # -- declared blocks

    def declare(self, specs: list[BlockSpec]) -> None:
        D = self.spec.num_devices
        for spec in specs:
            path = spec.path
            if spec.name in self.by_name:
                first = self.source.locate(self.paths[self.by_name[spec.name]])[0]
                raise self.fail(path + ("name",), f"duplicate block name '{spec.name}'",
                                f"first declared on line {first}; block names must be unique")
            if spec.time <= 0:
                raise self.fail(path + ("time",), f"block '{spec.name}' has time {spec.time}; "
                                "times must be positive integers", "use 1 for negligible work")
            if spec.devices is None:
                devices = tuple(range(D))
            else:
                for i, d in enumerate(spec.devices):
                    if not 0 <= d < D:
                        raise self.fail(path + ("devices", i) if self.spec.shape is None else path,
                                        f"block '{spec.name}' uses device {d}, but the plan has "
                                        f"{D} devices (0..{D - 1})",
                                        "raise devices: or fix the device id")
                if len(set(spec.devices)) != len(spec.devices):
                    raise self.fail(path + ("devices",),
                                    f"block '{spec.name}' lists a device twice")
                devices = tuple(sorted(spec.devices))
            if spec.kind == BACKWARD and not self.spec.training:
                raise self.fail(path + ("kind",), f"block '{spec.name}' is a backward block in "
                                "an inference plan", "set task: training or remove the block")
            self.declared[spec.name] = spec
            self.add(spec.name, spec.kind, spec.time, spec.memory, devices, path,
                     weights=spec.weights, workspace=spec.workspace, update=spec.update,
                     recompute_memory=spec.recompute_memory)

    def check_alone(self) -> None:
        """Each block fits the capacity by itself, with the weights resident on its devices
        (on each device, its own capacity where the devices differ)."""
        spec = self.spec
        capacities = spec.device_memory or (spec.memory_capacity,) * spec.num_devices
        if all(c is None for c in capacities):
            return
        weights = [0] * self.spec.num_devices
        for b in self.blocks:
            for d in b.devices:
                weights[d] += b.weights
        for b in self.blocks:
            limited = [d for d in b.devices if capacities[d] is not None]
            if not limited:
                continue
            d = max(limited, key=lambda d: weights[d] - capacities[d])
            capacity = capacities[d]
            if b.memory + weights[d] > capacity:
                held = f" ({self.show(b.memory)} and the weights on device {d}, " \
                    f"{self.show(weights[d])})" if weights[d] else ""
                raise self.fail(self.paths[b.index] + ("memory",),
                                f"block '{b.name}' alone needs "
                                f"{self.show(b.memory + weights[d])} per device{held}, more "
                                f"than the capacity {self.show(capacity)}",
                                "split the block over more devices or raise memory:")

    def show(self, amount: int) -> str:
        return format_memory(amount, self.spec.memory_is_size)

    def depend(self, specs: list[BlockSpec]) -> None:
        previous = None
        for spec in specs:
            index = self.by_name[spec.name]
            if spec.after is None:
                parents = [previous] if previous is not None else []
            else:
                parents = []
                for i, name in enumerate(spec.after):
                    if name not in self.by_name:
                        raise self.fail(spec.path + ("after", i),
                                        f"block '{spec.name}' depends on unknown block '{name}'",
                                        did_you_mean(name, self.by_name) or
                                        "name a block declared in this plan")
                    if name == spec.name:
                        raise self.fail(spec.path + ("after", i),
                                        f"block '{spec.name}' depends on itself")
                    parents.append(self.by_name[name])
            for p in dict.fromkeys(parents):
                self.edges.append((p, index))
            previous = index

    # -- derived backward blocks

    def derive_backward(self, specs: list[BlockSpec]) -> None:
        rule = self.spec.backward
        forwards = [s for s in specs if s.kind == FORWARD and s.backward.enabled]
        if rule is None:
            if not self.spec.training or any(s.kind == BACKWARD for s in specs):
                return  # inference, or backward blocks listed by hand
            rule = BackwardSpec()  # the schema's defaults: a backward twice the forward
        derived = {s.name: None for s in forwards}  # ordered: the same edges under any hash seed
        for spec in forwards:
            fwd = self.blocks[self.by_name[spec.name]]
            over = spec.backward
            keep = 0
            if rule.weight_time_ratio is not None:
                keep = round(fwd.memory * rule.weight_memory_ratio)
            b_time = over.time if over.time is not None else max(1, round(fwd.time *
                                                                         rule.time_ratio))
            b_mem = over.memory if over.memory is not None else -(fwd.memory - keep)
            if b_time <= 0:
                raise self.fail(spec.path + ("backward", "time"),
                                f"backward time of '{spec.name}' must be positive")
            self.check_time(spec, f"the backward of '{spec.name}'", b_time, fwd.time,
                            rule.time_ratio)
            b = self.add(f"{spec.name}.b", BACKWARD, b_time, b_mem, fwd.devices, spec.path)
            if rule.weight_time_ratio is not None:
                w_time = (over.weight_time if over.weight_time is not None
                          else max(1, round(fwd.time * rule.weight_time_ratio)))
                w_mem = over.weight_memory if over.weight_memory is not None else -keep
                if w_time <= 0:
                    raise self.fail(spec.path + ("backward", "weight_time"),
                                    f"weight-gradient time of '{spec.name}' must be positive")
                self.check_time(spec, f"the weight gradient of '{spec.name}'", w_time,
                                fwd.time, rule.weight_time_ratio)
                w = self.add(f"{spec.name}.w", WEIGHT, w_time, w_mem, fwd.devices, spec.path)
                self.edges.append((b, w))
        # Gradients flow back along the forward edges between blocks that have a backward; the
        # backward chain starts at the forward blocks none of whose successors has one.
        forward_edges = list(self.edges)
        for src, dst in forward_edges:
            a, c = self.blocks[src].name, self.blocks[dst].name
            if a in derived and c in derived:
                self.edges.append((self.by_name[f"{c}.b"], self.by_name[f"{a}.b"]))
        for name in derived:
            index = self.by_name[name]
            if not any(self.blocks[d].name in derived for s, d in forward_edges if s == index):
                self.edges.append((index, self.by_name[f"{name}.b"]))

    def check_time(self, spec: BlockSpec, what: str, time: int, forward: int,
                   ratio: float) -> None:
        """A derived time within the supported range, or an error with the true figure."""
        if time > MAX_TIME:
            raise self.fail(spec.path + ("time",), f"{what} takes {time:,} time units (time "
                            f"{forward:,} x ratio {ratio:g}), more than the supported "
                            f"{MAX_TIME:,}", "use a smaller time unit or ratio")

    # -- transfers and recomputation

    def transfers(self) -> list[int]:
        """Per edge, the time its data takes to reach the devices of the consumer that the
        producer is not on: a forward edge carries the producer's output, a gradient edge
        (c.b -> a.b) the gradient of a's output, the same size."""
        topology = self.spec.topology
        # With sequence parallelism each tensor rank sends its own slice to its peer, 1:1.
        mesh = self.spec.mesh
        slices = mesh.tensor if mesh.sequence_parallel else 1
        out = []
        for x, y in self.edges:
            src, dst = self.blocks[x], self.blocks[y]
            gradient = src.kind == dst.kind == BACKWARD and src.name != src.layer
            owner = dst.layer if gradient else src.layer
            spec = self.declared.get(owner)
            missing = [q for q in dst.devices if q not in src.devices]
            if spec is None or not missing:
                out.append(0)
            elif spec.transfer is not None:
                out.append(spec.transfer)
            elif spec.output is not None:
                time = max(min(topology.transfer_time(-(-spec.output // slices), p, q)
                               for p in src.devices) for q in missing)
                if time > MAX_TIME:
                    raise self.fail(spec.path + ("output",), f"the output of '{owner}' takes "
                                    f"{time:,} time units to send, more than the supported "
                                    f"{MAX_TIME:,}", "check the output size, the links' "
                                    "bandwidth and latency and topology.time_unit_ms")
                out.append(time)
            else:
                out.append(0)
        return out

    def recompute(self) -> list[int]:
        """Mark each forward block with a derived backward with its recompute mode; return
        those recomputed always."""
        always = []
        for name, spec in self.declared.items():
            block = self.blocks[self.by_name[name]]
            mode = spec.recompute or (self.spec.recompute if self.spec.training else "never")
            derived = block.kind == FORWARD and f"{name}.b" in self.by_name
            if mode == "never":
                continue
            if not derived:
                if spec.recompute is None:
                    continue  # the plan-wide default only concerns blocks it can apply to
                raise self.fail(spec.path + ("recompute",), f"block '{name}' has no derived "
                                "backward to recompute it in",
                                "recompute applies to forward blocks of a training plan")
            if not 0 <= spec.recompute_memory <= block.memory:
                raise self.fail(spec.path + ("recompute_memory",),
                                f"block '{name}' keeps {self.show(spec.recompute_memory)} when "
                                f"recomputed, but holds only {self.show(block.memory)}",
                                "recompute_memory is what it keeps (its input), at most memory")
            back = self.blocks[self.by_name[f"{name}.b"]]
            if back.time + block.time > MAX_TIME:
                where = spec.path + ("recompute",) if spec.recompute else \
                    ("training", "recompute")
                raise self.fail(where, f"recomputing '{name}' makes its backward take "
                                f"{back.time + block.time:,} time units ({back.time:,} + the "
                                f"forward's {block.time:,}), more than the supported "
                                f"{MAX_TIME:,}", "use a smaller time unit")
            self.blocks[block.index] = dataclasses.replace(block, recompute=mode)
            if mode == "always":
                always.append(block.index)
        return always

    # -- whole-problem checks

    def check_cycles(self) -> None:
        graph = _core.Graph(self.spec.num_devices,
                            [_core.Block(b.name, b.time, 0, list(b.devices)) for b in self.blocks],
                            self.edges)
        cycle = graph.find_cycle()
        if cycle:
            names = [self.blocks[i].name for i in cycle]
            first = min(cycle, key=lambda i: self.source.locate(self.paths[i]))
            raise self.fail(self.paths[first] + ("after",),
                            "dependency cycle: " + " -> ".join(names + [names[0]]),
                            "a block cannot depend, directly or not, on itself; fix after:",
                            key=True)

    def check_memory_balance(self) -> None:
        net = [0] * self.spec.num_devices
        for b in self.blocks:
            for d in b.devices:
                net[d] += b.memory
        for d, amount in enumerate(net):
            if amount != 0:
                first = next(i for i, b in enumerate(self.blocks)
                             if d in b.devices and b.memory != 0)
                raise self.fail(self.paths[first] + ("memory",),
                                f"memory does not balance on device {d}: one micro-batch "
                                f"leaves {self.show(amount)} allocated",
                                "backward blocks must free what forward blocks allocate "
                                "(for inference plans use memory 0)")

    def check_model_stages(self) -> None:
        """model.stages (a model given as one module) names exactly the declared blocks."""
        model = self.spec.model
        if model is None or model.module is None:
            return
        declared = [b.name for b in self.blocks if b.is_forward]
        listed = [name for name, _ in model.stages]
        for name in listed:
            if name not in declared:
                raise self.fail(("model", "stages", name), f"model.stages names '{name}', which "
                                "is not a declared block", did_you_mean(name, declared))
        missing = [name for name in declared if name not in listed]
        if missing:
            raise self.fail(("model", "stages"), f"model.stages lists no submodules for block "
                            f"'{missing[0]}'", "give every declared block its submodules")

    def rules(self) -> list[OrderRule]:
        rules = []
        for order in self.spec.order:
            texts = [order.text]
            try:
                if order.loop:
                    texts = expand_template(order.text, order.loop,
                                            {"D": self.spec.num_devices,
                                             "N": self.spec.num_micro_batches})
                for text in texts:
                    rules.append(self.rule(text, order))
            except RuleSyntaxError as exc:
                raise self.fail(order.text_path, f"malformed order rule: {exc}", exc.hint,
                                offset=exc.offset if not order.loop else 0) from None
        return rules

    def rule(self, text: str, order) -> OrderRule:
        try:
            rule = resolve_rule(text, self.blocks, self.by_name, self.edges)
        except RuleError as exc:
            raise self.fail(order.text_path, str(exc), exc.hint,
                            offset=exc.offset if not order.loop else 0) from None
        line, column = self.source.locate(order.text_path)
        return dataclasses.replace(rule, line=line, column=column)

    def apply_speeds(self) -> None:
        """A block's time on devices that differ in speed: its time / speed, to the nearest
        step and at least 1, on the slowest of its devices (they run it together)."""
        speeds = self.spec.device_speed
        if not speeds:
            return
        for i, b in enumerate(self.blocks):
            time = max(max(1, round(b.time / speeds[d])) for d in b.devices)
            if time > MAX_TIME:
                raise self.fail(self.paths[i] + ("time",), f"block '{b.name}' takes {time} "
                                f"steps on its slowest device, more than {MAX_TIME:,}",
                                "a device's speed divides the times of its blocks")
            self.blocks[i] = dataclasses.replace(b, time=time)

    def build(self) -> Problem:
        spec = self.spec
        specs = expand_blocks(spec)
        self.declare(specs)
        self.check_alone()
        self.depend(specs)
        self.derive_backward(specs)
        self.apply_speeds()
        self.check_cycles()
        self.check_memory_balance()
        self.check_model_stages()
        rules = self.rules()
        always = self.recompute()
        transfers = self.transfers()
        problem = Problem(name=spec.name, description=spec.description,
                          num_devices=spec.num_devices, memory_capacity=spec.memory_capacity,
                          device_memory=spec.device_memory,
                          device_speed=spec.device_speed,
                          memory_is_size=spec.memory_is_size,
                          num_micro_batches=spec.num_micro_batches, training=spec.training,
                          blocks=tuple(self.blocks), edges=tuple(self.edges), rules=tuple(rules),
                          transfers=tuple(transfers),
                          search=spec.search, mesh=spec.mesh, model=spec.model,
                          time_unit_ms=spec.topology.time_unit_ms,
                          spec_sha256=spec.source.sha256,
                          source_path=spec.source.path).with_recompute(always)
        self.check_sums(problem)
        return problem

    def check_sums(self, problem: Problem) -> None:
        """A schedule too large to lay out (at micro_batches), memory that could sum beyond
        int64 (at the first block on the device that adds to it)."""
        why = problem.too_large()
        if why is not None:
            raise self.fail(("micro_batches",), why, "fewer micro-batches or blocks")
        overflow = problem.memory_overflow()
        if overflow is not None:
            device, why = overflow
            first = next(b.index for b in self.blocks
                         if device in b.devices and (b.weights or b.memory > 0))
            key = "weights" if self.blocks[first].weights else "memory"
            raise self.fail(self.paths[first] + (key,), why,
                            "these amounts are far beyond any device: check the unit")


def build_problem(spec: PlanSpec) -> Problem:
    """Expand shapes, derive backward blocks, check the result and build the IR."""
    return _Builder(spec).build()


def load_problem(path: str | Path) -> Problem:
    """Load, validate and build a plan file."""
    return build_problem(load_spec(path))
