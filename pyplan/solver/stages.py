"""The pipeline stages of a placement, as the hand-written templates see them.

The forward blocks must form chains whose single-device blocks are the pipeline stages; blocks
spanning several devices (a sharded embedding, say) are glued to their neighbouring stage,
which is Tessel's "1F1B+". A placement these do not fit raises NotApplicable, saying why.
"""

from __future__ import annotations

from pyplan.problem import BACKWARD, FORWARD, WEIGHT, Problem

__all__ = ["NotApplicable", "backward_of", "forward_chains", "in_flight_limits",
           "require_training", "single_chain_stages", "stage_blocks", "stage_device",
           "stage_ops", "stages_of", "wave_stages", "weight_after"]


class NotApplicable(Exception):
    """The template does not fit this placement."""


def forward_chains(problem: Problem) -> list[list[int]]:
    """Connected chains of forward blocks, each in dependency order."""
    fwd = {b.index for b in problem.blocks if b.kind == FORWARD}
    succ: dict[int, list[int]] = {b: [] for b in fwd}
    pred: dict[int, list[int]] = {b: [] for b in fwd}
    for a, c in problem.edges:  # (one pass over the edges: plans can have thousands)
        if a in fwd and c in fwd:
            succ[a].append(c)
            pred[c].append(a)
    chains = []
    for head in sorted(b for b in fwd if not pred[b]):
        chain = [head]
        while True:
            nxt = succ[chain[-1]]
            if len(nxt) > 1 or any(len(pred[n]) > 1 for n in nxt):
                raise NotApplicable("the forward blocks branch or join")
            if not nxt:
                break
            chain.append(nxt[0])
        chains.append(chain)
    if sum(map(len, chains)) != len(fwd):
        raise NotApplicable("the forward blocks do not form chains")
    return chains


def stages_of(problem: Problem, chain: list[int]) -> list[list[int]]:
    """Group a chain into stages: each single-device block with the spanning blocks glued to it
    (those before the first stage block go with it, others with the stage before them)."""
    stages: list[list[int]] = []
    pending: list[int] = []
    for b in chain:
        if len(problem.blocks[b].devices) == 1:
            stages.append(pending + [b])
            pending = []
        elif stages:
            stages[-1].append(b)
        else:
            pending.append(b)
    if not stages:
        raise NotApplicable("no single-device stage blocks")
    stages[-1].extend(pending)
    return stages


def stage_device(problem: Problem, stage: list[int]) -> int:
    return next(problem.blocks[b].devices[0] for b in stage
                if len(problem.blocks[b].devices) == 1)


def backward_of(problem: Problem, block: int, kind: str) -> int | None:
    name = problem.blocks[block].name + (".b" if kind == BACKWARD else ".w")
    return problem.by_name.get(name)


def require_training(problem: Problem, every_forward: bool = True,
                     split: bool = False) -> None:
    """Backward blocks for every forward one (or some), split into B and W when asked."""
    if not problem.training:
        raise NotApplicable("an inference plan has no backward blocks")
    for b in problem.blocks:
        if every_forward and b.kind == FORWARD and \
                backward_of(problem, b.index, BACKWARD) is None:
            raise NotApplicable(f"forward block '{b.name}' has no derived backward")
    if split and not problem.split_layers:
        raise NotApplicable("needs a split backward (training.backward.weight_time_ratio)")


def single_chain_stages(problem: Problem, one_per_device: bool = True) -> list[list[int]]:
    chains = forward_chains(problem)
    if len(chains) != 1:
        raise NotApplicable(f"the forward blocks form {len(chains)} chains, not one")
    stages = stages_of(problem, chains[0])
    devices = [stage_device(problem, s) for s in stages]
    if one_per_device and len(set(devices)) != len(devices):
        raise NotApplicable("a device holds several stages (see interleaved-1f1b)")
    return stages


def wave_stages(problem: Problem) -> list[list[int]]:
    """Stages of a wave placement: 2D stages, stage s on device s, then back up."""
    D = problem.num_devices
    stages = single_chain_stages(problem, one_per_device=False)
    devices = [stage_device(problem, st) for st in stages]
    if devices != list(range(D)) + list(range(D - 1, -1, -1)):
        raise NotApplicable("needs a wave placement: 2 x devices stages, down the devices and "
                            "back up (shape: {kind: wave})")
    return stages


def in_flight_limits(problem: Problem, stages: list[list[int]]) -> list[int] | None:
    """How many micro-batches each stage may hold within the memory capacity: 1F1B with
    fewer warmup forwards where its usual p - s do not fit (at least one)."""
    if not problem.limited:
        return None
    held: dict[int, int] = {}  # device -> memory one micro-batch of its stages holds
    for stage in stages:
        device = stage_device(problem, stage)
        held[device] = held.get(device, 0) + sum(max(0, problem.blocks[b].memory)
                                                 for b in stage)
    limits = []
    for stage in stages:
        device = stage_device(problem, stage)
        room = problem.headroom(device)
        fits = max(1, room // held[device]) if held[device] > 0 and room is not None \
            else len(stages)
        # No stage holds more than all the micro-batches: a vast capacity (2^31 or more)
        # limits nothing, and stays within the core's int.
        limits.append(min(fits, problem.num_micro_batches))
    return limits


def stage_ops(problem: Problem, stage: list[int], op: str) -> list[int]:
    """The blocks one op of a stage runs: F its forwards, B its (input-)gradient blocks in
    reverse, W its weight-gradient blocks (none without a split backward)."""
    if op == "F":
        return list(stage)
    kind = BACKWARD if op == "B" else WEIGHT
    return [x for x in (backward_of(problem, b, kind) for b in reversed(stage)) if x is not None]


def stage_blocks(problem: Problem, stage: list[int]) -> tuple[list[int], list[int], list[int]]:
    """A stage as the core's template programs take it: the blocks of its F, B and W ops."""
    return stage_ops(problem, stage, "F"), stage_ops(problem, stage, "B"), \
        stage_ops(problem, stage, "W")


def weight_after(problem: Problem) -> list[int]:
    """For each backward block, the weight-gradient block of its layer (-1: none, or not a
    backward block): where a template runs a split backward's two halves back to back."""
    out = []
    for b in problem.blocks:
        w = backward_of(problem, problem.by_name[b.layer], WEIGHT) \
            if b.kind == BACKWARD else None
        out.append(-1 if w is None else w)
    return out
