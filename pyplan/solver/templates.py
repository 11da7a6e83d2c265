"""Hand-written schedules as baselines on the plan's own placement, evaluated by the core.

GPipe applies to any placement. 1F1B (with fewer warmup forwards where the memory capacity
cannot hold p - s micro-batches on stage s), ZB-H1/H2 and 3F1B need the forward blocks to form
one chain whose single-device blocks are the pipeline stages; blocks spanning several devices
(a sharded embedding, say) are glued to their neighbouring stage, which is Tessel's "1F1B+".
Interleaved 1F1B needs stage s on device s mod D with several chunks per device, Chimera the two
chains of an X-shape, ZB-V and DualPipeV the wave placement. A template that does not fit the
placement says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter

from pyplan import _core
from pyplan.errors import PlanError, did_you_mean
from pyplan.problem import BACKWARD, Problem
from pyplan.problem.schedule import Schedule, schedule_from_orders, with_syncs
from pyplan.solver.budget import Budget
from pyplan.solver.stages import (NotApplicable, backward_of, forward_chains, in_flight_limits,
                                  require_training, single_chain_stages, stage_blocks,
                                  stage_device, stage_ops, stages_of, wave_stages,
                                  weight_after)

__all__ = ["TEMPLATES", "Baseline", "NotApplicable", "baselines", "template_orders",
           "template_schedule"]

TEMPLATE_WORK = 5  # effort units per instance a template lays out (in Python) and evaluates


@dataclass(frozen=True)
class Baseline:
    name: str
    makespan: int | None = None
    bubble_rate: float | None = None
    peak_memory: tuple[int, ...] = ()
    fits_memory: bool = True
    reason: str | None = None  # why it does not apply
    orders: tuple = field(default=(), compare=False, repr=False)
    """Per-device (block, micro-batch) orders, for templates that apply."""

    @property
    def applicable(self) -> bool:
        return self.reason is None


# ---------------------------------------------------------------- the templates

def _gpipe(problem: Problem):
    """All forwards, then all backwards, each phase a wavefront: block b of micro-batch m at
    step depth(b) + m, depth counted within its phase (a plain pipeline fill and drain)."""
    topo = problem.graph.topological_order()
    phase = {b.index: 0 if b.is_forward else 1 for b in problem.blocks}
    depth = dict.fromkeys(topo, 0)
    for b in topo:
        for a, c in problem.edges:
            if a == b and phase[a] == phase[c]:
                depth[c] = max(depth[c], depth[b] + 1)
    # Sorted by (phase, step, micro-batch, topological position), packed into one integer:
    # sorting millions of ints is many times faster than sorting tuples.
    n, k = problem.num_micro_batches, len(topo)
    span = max(depth.values()) + n
    orders = []
    for d in range(problem.num_devices):
        keys = sorted(((phase[b] * span + depth[b] + m) * n + m) * k + i
                      for i, b in enumerate(topo) if d in problem.blocks[b].devices
                      for m in range(n))
        orders.append([(topo[key % k], key // k % n) for key in keys])
    return orders


def _made(orders: list | None) -> list:
    """The core's orders of a template, or NotApplicable where its program stalls."""
    if orders is None:
        raise NotApplicable("the template does not make progress")
    return orders


def _1f1b(problem: Problem):
    """Unit-time 1F1B: each stage runs a backward as soon as one is ready, otherwise a forward
    while it holds fewer than p - s micro-batches (fewer where memory is short); a split
    backward's two halves run back to back."""
    require_training(problem)
    stages = single_chain_stages(problem)
    return _made(_core.one_f_one_b_orders(
        problem.graph, [[stage_blocks(problem, s) for s in stages]], problem.num_micro_batches,
        in_flight_limits(problem, stages) or [],
        weight_after(problem) if problem.split_layers else []))


def _zb_h1(problem: Problem):
    """ZB-H1: 1F1B's F/B order, with stage s running W(m) right after B(m + s); the W passes
    deferred this way fill the cooldown bubbles at 1F1B's activation memory."""
    require_training(problem, split=True)
    stages = single_chain_stages(problem)
    return _made(_core.zb_h1_orders(problem.graph, [stage_blocks(problem, s) for s in stages],
                                    problem.num_micro_batches))


def _chimera(problem: Problem):
    """Chimera: 1F1B on both chains of an X-shape, the second's ops after the first's."""
    require_training(problem)
    chains = forward_chains(problem)
    if len(chains) != 2:
        raise NotApplicable("needs two chains of stages in opposite directions (an X-shape)")
    staged = []
    for chain in chains:
        stages = stages_of(problem, chain)
        devices = [stage_device(problem, s) for s in stages]
        if sorted(devices) != list(range(problem.num_devices)):
            raise NotApplicable("each chain must visit every device once")
        staged.append([stage_blocks(problem, s) for s in stages])
    return _made(_core.one_f_one_b_orders(
        problem.graph, staged, problem.num_micro_batches, [],
        weight_after(problem) if problem.split_layers else []))


def _interleaved(problem: Problem):
    require_training(problem)
    D, n = problem.num_devices, problem.num_micro_batches
    stages = single_chain_stages(problem, one_per_device=False)
    if len(stages) % D or len(stages) == D:
        raise NotApplicable("needs several stages per device (stage s on device s mod D)")
    if any(stage_device(problem, st) != s % D for s, st in enumerate(stages)):
        raise NotApplicable("stage s must run on device s mod D")
    if any(len(st) != 1 for st in stages):
        raise NotApplicable("blocks spanning several devices are not supported")
    if n % D:
        raise NotApplicable(f"needs micro-batches divisible by devices ({D})")
    if problem.split_layers:
        raise NotApplicable("a split backward is not supported")
    v = len(stages) // D
    total = n * v

    def forward_op(k):
        return (k // D) % v, (k // (D * v)) * D + k % D

    def backward_op(k):
        return v - 1 - (k // D) % v, (k // (D * v)) * D + k % D

    orders = []
    for r in range(D):
        warmup = min((D - r - 1) * 2 + (v - 1) * D, total)
        ops = [("F", k) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [("F", warmup + i), ("B", i)]
        ops += [("B", k) for k in range(total - warmup, total)]
        order = []
        for op, k in ops:
            chunk, m = forward_op(k) if op == "F" else backward_op(k)
            block = stages[chunk * D + r][0]
            if op == "B":
                block = backward_of(problem, block, BACKWARD)
            order.append((block, m))
        orders.append(order)
    return orders


def _3f1b(problem: Problem):
    require_training(problem, every_forward=False)  # the first two passes have no backward
    stages = single_chain_stages(problem, one_per_device=False)
    if any(len(st) != 1 for st in stages) or len(stages) % 3:
        raise NotApplicable("needs three forward passes over the same single-device stages")
    S = len(stages) // 3
    passes = [[st[0] for st in stages[p * S:(p + 1) * S]] for p in range(3)]
    devices = [[problem.blocks[b].devices[0] for b in ps] for ps in passes]
    if not devices[0] == devices[1] == devices[2] or len(set(devices[0])) != S:
        raise NotApplicable("the three passes must visit the same devices in the same order")
    if any(backward_of(problem, b, BACKWARD) is not None for b in passes[0] + passes[1]) or \
            any(backward_of(problem, b, BACKWARD) is None for b in passes[2]):
        raise NotApplicable("only the third pass may have a backward")
    n = problem.num_micro_batches
    orders: list[list[tuple[int, int]]] = [[] for _ in range(problem.num_devices)]
    for i in range(S):
        ofst = S - i - 1  # nnScaler Table 7 with stages counted from 0
        f1, f2, f3 = passes[0][i], passes[1][i], passes[2][i]
        b = backward_of(problem, f3, BACKWARD)
        order = orders[devices[0][i]]
        for r in range(n + ofst + 3):
            for block, m in ((f1, r), (f2, r - 1), (f3, r - 2), (b, r - 2 - ofst)):
                if 0 <= m < n:
                    order.append((block, m))
    return orders


# ---------------------------------------------------------------- device-level programs

def _zb_chain(problem: Problem, in_flight) -> list[list[tuple[int, int]]]:
    """Zero bubble's greedy order on one stage per device, stage s holding up to
    in_flight(s, p) forwards' activations."""
    require_training(problem, split=True)
    stages = single_chain_stages(problem)
    p = len(stages)
    return _made(_core.greedy_orders(
        problem.graph, [stage_blocks(problem, s) for s in stages], list(range(p)),
        problem.num_micro_batches, True, [in_flight(s, p) for s in range(p)],
        [stage_device(problem, st) for st in stages]))


def _zb_h2(problem: Problem):
    """ZB-H2: about twice 1F1B's warmup forwards (2(p - s) - 1 in flight on stage s), so the
    warmup has no bubble; deferred W passes fill the cooldown."""
    return _zb_chain(problem, lambda s, p: 2 * (p - s) - 1)


def _zb_2p(problem: Problem):
    """ZB-2p, the zero bubble paper's automatic schedule at its memory limit: every stage may
    hold 2p micro-batches' activations (with the W passes' held inputs), so W passes are
    deferred (more forwards run first) and fill the cooldown (Qi et al., section 3)."""
    return _zb_chain(problem, lambda s, p: 2 * p)


def _zb_v(problem: Problem):
    """ZB-V: 1F1B's activation memory (D micro-batches of the whole model, 2D stage
    activations per device), the V placement making every device's first B come early."""
    require_training(problem, split=True)
    stages = wave_stages(problem)
    D = problem.num_devices
    return _made(_core.greedy_orders(
        problem.graph, [stage_blocks(problem, s) for s in stages],
        [stage_device(problem, st) for st in stages], problem.num_micro_batches, True,
        [2 * D] * D, list(range(D))))


def _device_orders(problem: Problem, stages: list[list[int]], programs) -> list[list]:
    """Per-device instance orders from per-device programs of (op, stage, micro-batch)."""
    orders: list[list[tuple[int, int]]] = [[] for _ in range(problem.num_devices)]
    for d, program in enumerate(programs):
        for op, s, m in program:
            orders[d] += [(b, m) for b in stage_ops(problem, stages[s], op)]
    return orders


def _dualpipe_v(problem: Problem):
    """DualPipeV (DeepSeek-V3's DualPipe cut in half, on the wave placement): device r feeds
    chunk 0 (stage r) and chunk 1 (stage 2D-1-r) in eight phases; the steady state pairs a
    forward of one chunk with a backward of the other, which a runtime can overlap to hide
    communication. Backward passes are split into B and W where the plan splits them."""
    require_training(problem)
    stages = wave_stages(problem)
    D, n = problem.num_devices, problem.num_micro_batches
    if n < 2 * D:
        raise NotApplicable(f"needs at least {2 * D} micro-batches (2 x devices)")
    split = bool(problem.split_layers)
    programs = []
    for r in range(D):
        chunk = (r, 2 * D - 1 - r)
        count = {(op, c): 0 for op in "FBW" for c in (0, 1)}
        deferred: list[tuple[int, int]] = []
        program: list[tuple[str, int, int]] = []

        def run(op: str, c: int, defer_w: bool = False) -> None:
            m = count[(op, c)]
            count[(op, c)] += 1
            program.append((op, chunk[c], m))
            if op == "B" and split:
                if defer_w:
                    deferred.append((c, m))
                else:
                    program.append(("W", chunk[c], m))

        def weight() -> None:
            c, m = deferred.pop(0)
            program.append(("W", chunk[c], m))

        for _ in range((D - r - 1) * 2):       # 1: forwards of chunk 0
            run("F", 0)
        for _ in range(r + 1):                 # 2: both chunks' forwards
            run("F", 0)
            run("F", 1)
        for _ in range(D - r - 1):             # 3: chunk 1's first backwards, zero bubble
            run("B", 1)
            run("F", 1)
        for i in range(n - 2 * D + r + 1):     # 4: steady state, F of one chunk with B of
            if i == 0 and r == D - 1:          #    the other (the last device's first pair
                run("F", 0)                    #    stays apart: its B waits for that F)
                run("B", 1)
            else:
                run("F", 0)
                run("B", 1)
            run("F", 1)
            run("B", 0)
        for _ in range(D - r - 1):             # 5: chunk 0's forwards are done
            run("B", 1)
            run("F", 1)
            run("B", 0)
        for _ in range(r + 1):                 # 6: backwards, chunk 0's W deferred
            run("B", 1)
            run("B", 0, defer_w=True)
        for _ in range(D - r - 1):             # 7: a deferred W, then a backward
            if deferred:
                weight()
            run("B", 0, defer_w=True)
        while deferred:                        # 8: the remaining W passes
            weight()
        programs.append(program)
    return _device_orders(problem, stages, programs)


_BUILDERS = {"gpipe": _gpipe, "1f1b": _1f1b, "interleaved-1f1b": _interleaved,
             "chimera": _chimera, "zb-h1": _zb_h1, "zb-h2": _zb_h2, "zb-2p": _zb_2p,
             "zb-v": _zb_v,
             "dualpipev": _dualpipe_v, "3f1b": _3f1b}
TEMPLATES = tuple(_BUILDERS)  # names, in the order they are listed and tried


def template_orders(problem: Problem, name: str) -> list[list[tuple[int, int]]]:
    """Per-device orders of a template; raises NotApplicable when it does not fit."""
    orders = _BUILDERS[name](problem)
    placed = [set(map(itemgetter(0), order)) for order in orders]  # blocks on each device
    for block in problem.blocks:  # (a template lays out the stages: kind: other, say, not)
        if any(d >= len(placed) or block.index not in placed[d] for d in block.devices):
            raise NotApplicable(f"it has no place for block '{block.name}'")
    return orders


def template_schedule(problem: Problem, name: str) -> Schedule:
    """A template by name as a schedule (PlanError for an unknown or unfitting one)."""
    if name not in TEMPLATES:
        raise PlanError(f"unknown template '{name}'", hint=did_you_mean(name, TEMPLATES)
                        or f"choose one of {', '.join(TEMPLATES)}")
    try:
        orders = template_orders(problem, name)
    except NotApplicable as exc:
        raise PlanError(f"template {name} does not fit {problem.name}: {exc}") from None
    # A template is its own order rule, and its memory is reported rather than enforced.
    return schedule_from_orders(problem, orders, problem.num_micro_batches).schedule


def baselines(problem: Problem, budget: Budget = Budget()) -> dict[str, Baseline]:
    """Every template evaluated on the problem (memory reported, not enforced); those the
    budget's time does not allow say so."""
    out = {}
    instances = len(problem.blocks) * problem.num_micro_batches
    for name in TEMPLATES:
        if not budget.allows_template(instances):
            out[name] = Baseline(name, reason=f"not evaluated: {instances:,} instances take "
                                 "longer to lay out than the time limit allows")
            continue
        if budget.expired():
            out[name] = Baseline(name, reason="not evaluated: the time limit ran out"
                                 if budget.timed_out() else
                                 "not evaluated: the search's work allowance ran out")
            continue
        try:
            orders = template_orders(problem, name)
        except NotApplicable as exc:
            out[name] = Baseline(name, reason=str(exc))
            continue
        budget.charge(instances * TEMPLATE_WORK)
        # A template is its own order rule: the plan's order constraints do not apply to it.
        ev = _core.evaluate(problem.free_graph, orders,
                            complete_micro_batches=problem.num_micro_batches,
                            enforce_rules=False)
        if not ev.ok:
            out[name] = Baseline(name, reason=f"does not run on this placement ({ev.reason})")
            continue
        fits = problem.fits(ev.peak_memory)
        _, makespan, bubble_rate = with_syncs(problem, orders, ev)
        out[name] = Baseline(name, makespan, bubble_rate, tuple(ev.peak_memory), fits,
                             orders=tuple(tuple(map(tuple, o)) for o in orders))
    return out
