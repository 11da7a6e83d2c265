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
from pyplan.problem import BACKWARD, FORWARD, WEIGHT, Problem
from pyplan.schedule import Schedule, schedule_from_orders, with_syncs
from pyplan.solver.budget import Budget

__all__ = ["TEMPLATES", "Baseline", "baselines", "template_orders", "template_schedule"]

class NotApplicable(Exception):
    """The template does not fit this placement."""


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


# ---------------------------------------------------------------- structure of the placement

def _forward_chains(problem: Problem) -> list[list[int]]:
    """Connected chains of forward blocks, each in dependency order."""
    fwd = {b.index for b in problem.blocks if b.kind == FORWARD}
    succ = {b: [c for a, c in problem.edges if a == b and c in fwd] for b in fwd}
    pred = {b: [a for a, c in problem.edges if c == b and a in fwd] for b in fwd}
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


def _stages(problem: Problem, chain: list[int]) -> list[list[int]]:
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


def _stage_device(problem: Problem, stage: list[int]) -> int:
    return next(problem.blocks[b].devices[0] for b in stage
                if len(problem.blocks[b].devices) == 1)


def _backward_of(problem: Problem, block: int, kind: str) -> int | None:
    name = problem.blocks[block].name + (".b" if kind == BACKWARD else ".w")
    return problem.by_name.get(name)


def _require_training(problem: Problem, every_forward: bool = True,
                      split: bool = False) -> None:
    """Backward blocks for every forward one (or some), split into B and W when asked."""
    if not problem.training:
        raise NotApplicable("an inference plan has no backward blocks")
    for b in problem.blocks:
        if every_forward and b.kind == FORWARD and \
                _backward_of(problem, b.index, BACKWARD) is None:
            raise NotApplicable(f"forward block '{b.name}' has no derived backward")
    if split and not any(b.kind == WEIGHT for b in problem.blocks):
        raise NotApplicable("needs a split backward (training.backward.weight_time_ratio)")


# ---------------------------------------------------------------- stage-level simulation

def _one_f_one_b(num_stages: int, n: int, limits: list[int] | None = None
                 ) -> tuple[list[list[tuple[str, int]]], list[list[int]]]:
    """Unit-time 1F1B of `num_stages` stages, F flowing down and B back up: at each step a
    stage runs a backward as soon as one is ready, otherwise a forward while it holds fewer
    than num_stages - s micro-batches (or limits[s], if fewer). Each stage runs each op's
    micro-batches in order. Returns each stage's ops and the step of each of them: a stage
    runs its next op as soon as it is ready, so these are the ops' unit times."""
    caps = [num_stages - s if limits is None else min(num_stages - s, limits[s])
            for s in range(num_stages)]
    f, b = [0] * num_stages, [0] * num_stages
    last = num_stages - 1
    orders: list[list[tuple[str, int]]] = [[] for _ in range(num_stages)]
    steps: list[list[int]] = [[] for _ in range(num_stages)]
    remaining = num_stages * n * 2
    step = 0
    while remaining:
        chosen = []
        for s in range(num_stages):  # what each stage runs, from the counts before the step
            fs, bs = f[s], b[s]
            if bs < n and fs > bs and (s == last or b[s + 1] > bs):
                chosen.append(("B", s, bs))
            elif fs < n and (s == 0 or f[s - 1] > fs) and fs - bs < caps[s]:
                chosen.append(("F", s, fs))
        if not chosen:  # nothing can run now, so nothing ever will
            raise NotApplicable("the template does not make progress")
        for op, s, m in chosen:
            (f if op == "F" else b)[s] += 1
            orders[s].append((op, m))
            steps[s].append(step)
        remaining -= len(chosen)
        step += 1
    return orders, steps


def _in_flight_limits(problem: Problem, stages: list[list[int]]) -> list[int] | None:
    """How many micro-batches each stage may hold within the memory capacity: 1F1B with
    fewer warmup forwards where its usual p - s do not fit (at least one)."""
    if problem.memory_capacity is None:
        return None
    limits = []
    for stage in stages:
        device = _stage_device(problem, stage)
        held = sum(max(0, problem.blocks[b].memory) for st in stages
                   if _stage_device(problem, st) == device for b in st)
        limits.append(max(1, problem.headroom(device) // held) if held > 0 else len(stages))
    return limits


def _chain_template(problem: Problem, stage_orders, stages: list[list[int]], tag: int = 0,
                    times: list[list[int]] | None = None) -> list[tuple[int, tuple[int, int]]]:
    """Real instances keyed by the unit-time step of their stage op, then chain (tag 0 or 1),
    then position inside the stage, so sorting all keys gives one global order every device
    agrees with. The key is one integer (sorting a million of them is several times faster
    than tuples), even, so that _glue_weights can slot a weight pass right after its key."""
    assert tag in (0, 1)
    times = times or _unit_times(stage_orders)
    width = len(problem.blocks) + 1  # positions inside a stage
    keyed = []
    for s, order in enumerate(stage_orders):
        members = {op: [(2 * pos + 2 * tag * width, b)  # the key's position and chain parts
                        for pos, b in enumerate(_stage_ops(problem, stages[s], op))]
                   for op in "FBW"}
        keyed += [(step * 4 * width + part, (b, m))
                  for (op, m), step in zip(order, times[s]) for part, b in members[op]]
    return keyed


def _unit_times(stage_orders) -> list[list[int]]:
    """Start step of each stage's ops when every op takes one step."""
    num = len(stage_orders)
    pos = [0] * num
    free = [0] * num
    end = {op: [{} for _ in range(num)] for op in "FBW"}  # op -> stage -> mb -> end step
    progress = True
    while progress:
        progress = False
        for s in range(num):
            order = stage_orders[s]
            while pos[s] < len(order):  # as far as this stage's inputs allow
                op, m = order[pos[s]]
                if op == "F":
                    deps = (end["F"][s - 1],) if s > 0 else ()
                elif op == "B":
                    deps = (end["F"][s], end["B"][s + 1]) if s < num - 1 else (end["F"][s],)
                else:
                    deps = (end["B"][s],)
                if any(m not in d for d in deps):
                    break
                start = max([free[s]] + [d[m] for d in deps])
                end[op][s][m] = free[s] = start + 1
                pos[s] += 1
                progress = True
    return [[end[op][s][m] - 1 for op, m in order] for s, order in enumerate(stage_orders)]


def _orders_from_keys(problem: Problem, keyed) -> list[list[tuple[int, int]]]:
    keyed.sort(key=itemgetter(0))
    orders: list[list[tuple[int, int]]] = [[] for _ in range(problem.num_devices)]
    appends = [[orders[d].append for d in b.devices] for b in problem.blocks]
    for _, instance in keyed:
        for append in appends[instance[0]]:
            append(instance)
    return orders


def _single_chain_stages(problem: Problem, one_per_device: bool = True) -> list[list[int]]:
    chains = _forward_chains(problem)
    if len(chains) != 1:
        raise NotApplicable(f"the forward blocks form {len(chains)} chains, not one")
    stages = _stages(problem, chains[0])
    devices = [_stage_device(problem, s) for s in stages]
    if one_per_device and len(set(devices)) != len(devices):
        raise NotApplicable("a device holds several stages (see interleaved-1f1b)")
    return stages


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


def _1f1b(problem: Problem):
    _require_training(problem)
    stages = _single_chain_stages(problem)
    split = any(b.kind == WEIGHT for b in problem.blocks)
    order, steps = _one_f_one_b(len(stages), problem.num_micro_batches,
                                _in_flight_limits(problem, stages))
    keyed = _chain_template(problem, order, stages, times=steps)
    if split:  # 1F1B runs a split backward's two halves back to back
        keyed = _glue_weights(problem, keyed)
    return _orders_from_keys(problem, keyed)


def _glue_weights(problem: Problem, keyed):
    out = []
    for key, (b, m) in keyed:
        out.append((key, (b, m)))
        if problem.blocks[b].kind == BACKWARD:
            w = _backward_of(problem, problem.by_name[problem.blocks[b].layer], WEIGHT)
            if w is not None:
                out.append((key + 1, (w, m)))
    return out


def _zb_h1(problem: Problem):
    _require_training(problem, split=True)
    stages = _single_chain_stages(problem)
    n = problem.num_micro_batches
    one_f_one_b, _ = _one_f_one_b(len(stages), n)
    # ZB-H1: 1F1B's F/B order, with stage s running W(m) right after B(m + s); the W passes
    # deferred this way fill the cooldown bubbles at 1F1B's activation memory.
    order = []
    for s, stage_order in enumerate(one_f_one_b):
        ops = []
        for op, m in stage_order:
            ops.append((op, m))
            if op == "B" and m - s >= 0:
                ops.append(("W", m - s))
        ops += [("W", m) for m in range(max(0, n - s), n)]
        order.append(ops)
    return _orders_from_keys(problem, _chain_template(problem, order, stages))


def _chimera(problem: Problem):
    _require_training(problem)
    chains = _forward_chains(problem)
    if len(chains) != 2:
        raise NotApplicable("needs two chains of stages in opposite directions (an X-shape)")
    keyed = []
    simulated: dict = {}  # by number of stages (both chains usually have the same)
    for tag, chain in enumerate(chains):
        stages = _stages(problem, chain)
        devices = [_stage_device(problem, s) for s in stages]
        if sorted(devices) != list(range(problem.num_devices)):
            raise NotApplicable("each chain must visit every device once")
        if len(stages) not in simulated:
            simulated[len(stages)] = _one_f_one_b(len(stages), problem.num_micro_batches)
        order, steps = simulated[len(stages)]
        keyed += _chain_template(problem, order, stages, tag, times=steps)
    if any(b.kind == WEIGHT for b in problem.blocks):
        keyed = _glue_weights(problem, keyed)
    return _orders_from_keys(problem, keyed)


def _interleaved(problem: Problem):
    _require_training(problem)
    D, n = problem.num_devices, problem.num_micro_batches
    stages = _single_chain_stages(problem, one_per_device=False)
    if len(stages) % D or len(stages) == D:
        raise NotApplicable("needs several stages per device (stage s on device s mod D)")
    if any(_stage_device(problem, st) != s % D for s, st in enumerate(stages)):
        raise NotApplicable("stage s must run on device s mod D")
    if any(len(st) != 1 for st in stages):
        raise NotApplicable("blocks spanning several devices are not supported")
    if n % D:
        raise NotApplicable(f"needs micro-batches divisible by devices ({D})")
    if any(b.kind == WEIGHT for b in problem.blocks):
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
                block = _backward_of(problem, block, BACKWARD)
            order.append((block, m))
        orders.append(order)
    return orders


def _3f1b(problem: Problem):
    _require_training(problem, every_forward=False)  # the first two passes have no backward
    stages = _single_chain_stages(problem, one_per_device=False)
    if any(len(st) != 1 for st in stages) or len(stages) % 3:
        raise NotApplicable("needs three forward passes over the same single-device stages")
    S = len(stages) // 3
    passes = [[st[0] for st in stages[p * S:(p + 1) * S]] for p in range(3)]
    devices = [[problem.blocks[b].devices[0] for b in ps] for ps in passes]
    if not devices[0] == devices[1] == devices[2] or len(set(devices[0])) != S:
        raise NotApplicable("the three passes must visit the same devices in the same order")
    if any(_backward_of(problem, b, BACKWARD) is not None for b in passes[0] + passes[1]) or \
            any(_backward_of(problem, b, BACKWARD) is None for b in passes[2]):
        raise NotApplicable("only the third pass may have a backward")
    n = problem.num_micro_batches
    orders: list[list[tuple[int, int]]] = [[] for _ in range(problem.num_devices)]
    for i in range(S):
        ofst = S - i - 1  # nnScaler Table 7 with stages counted from 0
        f1, f2, f3 = passes[0][i], passes[1][i], passes[2][i]
        b = _backward_of(problem, f3, BACKWARD)
        order = orders[devices[0][i]]
        for r in range(n + ofst + 3):
            for block, m in ((f1, r), (f2, r - 1), (f3, r - 2), (b, r - 2 - ofst)):
                if 0 <= m < n:
                    order.append((block, m))
    return orders


# ---------------------------------------------------------------- device-level programs

def _stage_ops(problem: Problem, stage: list[int], op: str) -> list[int]:
    """The blocks one op of a stage runs: F its forwards, B its (input-)gradient blocks in
    reverse, W its weight-gradient blocks (none without a split backward)."""
    if op == "F":
        return list(stage)
    kind = BACKWARD if op == "B" else WEIGHT
    return [x for x in (_backward_of(problem, b, kind) for b in reversed(stage)) if x is not None]


def _device_orders(problem: Problem, stages: list[list[int]], programs) -> list[list]:
    """Per-device instance orders from per-device programs of (op, stage, micro-batch)."""
    orders: list[list[tuple[int, int]]] = [[] for _ in range(problem.num_devices)]
    for d, program in enumerate(programs):
        for op, s, m in program:
            orders[d] += [(b, m) for b in _stage_ops(problem, stages[s], op)]
    return orders


def _greedy(stage_device: list[int], n: int, split: bool, in_flight: list[int]):
    """Unit-time list scheduling of a chain of stages (F down, B back up, W after B) on
    devices: each step a device runs a ready B (latest stage first), else a ready F while it
    holds fewer than in_flight[d] stage activations (latest stage first), else a deferred W
    (oldest first). Deferred W passes fill what would be bubbles (zero bubble, Qi et al.)."""
    S, D = len(stage_device), max(stage_device) + 1
    done: set[tuple[str, int, int]] = set()
    nxt = {(op, s): 0 for op in "FBW" for s in range(S)}
    held = [0] * D
    programs: list[list[tuple[str, int, int]]] = [[] for _ in range(D)]
    total = S * n * (3 if split else 2)
    on = [sorted((s for s in range(S) if stage_device[s] == d), reverse=True) for d in range(D)]
    for _ in range(4 * total + 10):
        if len(done) == total:
            return programs
        chosen = []
        for d in range(D):
            for op in "BFW":
                ready = []
                for s in on[d]:
                    m = nxt[(op, s)]
                    if m >= n:
                        continue
                    if op == "F" and (s == 0 or ("F", s - 1, m) in done) and \
                            held[d] < in_flight[d]:
                        ready.append(s)
                    if op == "B" and ("F", s, m) in done and \
                            (s == S - 1 or ("B", s + 1, m) in done):
                        ready.append(s)
                    if op == "W" and split and ("B", s, m) in done:
                        ready.append(s)
                if ready:
                    s = min(ready, key=lambda x: nxt[("W", x)]) if op == "W" else ready[0]
                    chosen.append((d, op, s, nxt[(op, s)]))
                    break
        if not chosen:
            break
        for d, op, s, m in chosen:
            done.add((op, s, m))
            nxt[(op, s)] += 1
            held[d] += {"F": 1, "B": -1, "W": 0}[op]
            programs[d].append((op, s, m))
    raise NotApplicable("the template does not make progress")


def _wave_stages(problem: Problem) -> list[list[int]]:
    """Stages of a wave placement: 2D stages, stage s on device s, then back up."""
    D = problem.num_devices
    stages = _single_chain_stages(problem, one_per_device=False)
    devices = [_stage_device(problem, st) for st in stages]
    if devices != list(range(D)) + list(range(D - 1, -1, -1)):
        raise NotApplicable("needs a wave placement: 2 x devices stages, down the devices and "
                            "back up (shape: {kind: wave})")
    return stages


def _zb_h2(problem: Problem):
    _require_training(problem, split=True)
    stages = _single_chain_stages(problem)
    p = len(stages)
    # ZB-H2: about twice 1F1B's warmup forwards (2(p - s) - 1 in flight on stage s), so the
    # warmup has no bubble; deferred W passes fill the cooldown.
    programs = _greedy(list(range(p)), problem.num_micro_batches, True,
                       [2 * (p - s) - 1 for s in range(p)])
    device_of = [_stage_device(problem, st) for st in stages]
    return _device_orders(problem, stages, [programs[device_of.index(d)] if d in device_of
                                            else [] for d in range(problem.num_devices)])


def _zb_v(problem: Problem):
    _require_training(problem, split=True)
    stages = _wave_stages(problem)
    D = problem.num_devices
    # ZB-V: 1F1B's activation memory (D micro-batches of the whole model, 2D stage
    # activations per device), the V placement making every device's first B come early.
    programs = _greedy([_stage_device(problem, st) for st in stages],
                       problem.num_micro_batches, True, [2 * D] * D)
    return _device_orders(problem, stages, programs)


def _dualpipe_v(problem: Problem):
    """DualPipeV (DeepSeek-V3's DualPipe cut in half, on the wave placement): device r feeds
    chunk 0 (stage r) and chunk 1 (stage 2D-1-r) in eight phases; the steady state pairs a
    forward of one chunk with a backward of the other, which a runtime can overlap to hide
    communication. Backward passes are split into B and W where the plan splits them."""
    _require_training(problem)
    stages = _wave_stages(problem)
    D, n = problem.num_devices, problem.num_micro_batches
    if n < 2 * D:
        raise NotApplicable(f"needs at least {2 * D} micro-batches (2 x devices)")
    split = any(b.kind == WEIGHT for b in problem.blocks)
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
             "chimera": _chimera, "zb-h1": _zb_h1, "zb-h2": _zb_h2, "zb-v": _zb_v,
             "dualpipev": _dualpipe_v, "3f1b": _3f1b}
TEMPLATES = tuple(_BUILDERS)  # names, in the order they are listed and tried


def template_orders(problem: Problem, name: str) -> list[list[tuple[int, int]]]:
    """Per-device orders of a template; raises NotApplicable when it does not fit."""
    orders = _BUILDERS[name](problem)
    placed = {(b, d) for d, order in enumerate(orders) for b, _ in order}
    for block in problem.blocks:  # (a template lays out the stages: kind: other, say, not)
        if any((block.index, d) not in placed for d in block.devices):
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
            out[name] = Baseline(name, reason="not evaluated: the time limit ran out")
            continue
        try:
            orders = template_orders(problem, name)
        except NotApplicable as exc:
            out[name] = Baseline(name, reason=str(exc))
            continue
        # A template is its own order rule: the plan's order constraints do not apply to it.
        ev = _core.evaluate(problem.graph, orders, complete_micro_batches=problem.num_micro_batches,
                            enforce_rules=False)
        if not ev.ok:
            out[name] = Baseline(name, reason=f"does not run on this placement ({ev.reason})")
            continue
        fits = problem.memory_capacity is None or max(ev.peak_memory) <= problem.memory_capacity
        _, makespan, bubble_rate = with_syncs(problem, orders, ev)
        out[name] = Baseline(name, makespan, bubble_rate, tuple(ev.peak_memory), fits,
                             orders=tuple(tuple(map(tuple, o)) for o in orders))
    return out
