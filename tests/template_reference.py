"""The hand-written templates whose programs moved to the C++ core (csrc/core/templates.cpp),
as they were written in Python: the oracle of tests/test_core_templates.py. Written for
obviousness, not speed."""

from __future__ import annotations

from operator import itemgetter

from pyplan.problem import BACKWARD, WEIGHT, Problem
from pyplan.solver.stages import (NotApplicable, backward_of, forward_chains, in_flight_limits,
                                  require_training, single_chain_stages, stage_device,
                                  stage_ops, stages_of, wave_stages)


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
                        for pos, b in enumerate(stage_ops(problem, stages[s], op))]
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


def one_f_one_b(problem: Problem):
    require_training(problem)
    stages = single_chain_stages(problem)
    split = any(b.kind == WEIGHT for b in problem.blocks)
    order, steps = _one_f_one_b(len(stages), problem.num_micro_batches,
                                in_flight_limits(problem, stages))
    keyed = _chain_template(problem, order, stages, times=steps)
    if split:  # 1F1B runs a split backward's two halves back to back
        keyed = _glue_weights(problem, keyed)
    return _orders_from_keys(problem, keyed)


def _glue_weights(problem: Problem, keyed):
    out = []
    for key, (b, m) in keyed:
        out.append((key, (b, m)))
        if problem.blocks[b].kind == BACKWARD:
            w = backward_of(problem, problem.by_name[problem.blocks[b].layer], WEIGHT)
            if w is not None:
                out.append((key + 1, (w, m)))
    return out


def zb_h1(problem: Problem):
    require_training(problem, split=True)
    stages = single_chain_stages(problem)
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


def chimera(problem: Problem):
    require_training(problem)
    chains = forward_chains(problem)
    if len(chains) != 2:
        raise NotApplicable("needs two chains of stages in opposite directions (an X-shape)")
    keyed = []
    simulated: dict = {}  # by number of stages (both chains usually have the same)
    for tag, chain in enumerate(chains):
        stages = stages_of(problem, chain)
        devices = [stage_device(problem, s) for s in stages]
        if sorted(devices) != list(range(problem.num_devices)):
            raise NotApplicable("each chain must visit every device once")
        if len(stages) not in simulated:
            simulated[len(stages)] = _one_f_one_b(len(stages), problem.num_micro_batches)
        order, steps = simulated[len(stages)]
        keyed += _chain_template(problem, order, stages, tag, times=steps)
    if any(b.kind == WEIGHT for b in problem.blocks):
        keyed = _glue_weights(problem, keyed)
    return _orders_from_keys(problem, keyed)


def _device_orders(problem: Problem, stages: list[list[int]], programs) -> list[list]:
    """Per-device instance orders from per-device programs of (op, stage, micro-batch)."""
    orders: list[list[tuple[int, int]]] = [[] for _ in range(problem.num_devices)]
    for d, program in enumerate(programs):
        for op, s, m in program:
            orders[d] += [(b, m) for b in stage_ops(problem, stages[s], op)]
    return orders


def _greedy(stage_device: list[int], n: int, split: bool, in_flight: list[int],
            delta: list[dict] | None = None):
    """Unit-time list scheduling of a chain of stages (F down, B back up, W after B) on
    devices: each step a device runs a ready B (latest stage first), else a ready F while it
    holds fewer than in_flight[d] stage activations (latest stage first), else a deferred W
    (oldest first). Deferred W passes fill what would be bubbles (zero bubble, Qi et al.).
    With `delta` (each stage's memory change per op, every forward allocating), what a device
    holds is memory: at most in_flight[d] times its largest forward's."""
    S, D = len(stage_device), max(stage_device) + 1
    done: set[tuple[str, int, int]] = set()
    nxt = {(op, s): 0 for op in "FBW" for s in range(S)}
    held, used = [0] * D, [0] * D
    unit = [max((delta[s]["F"] for s in range(S) if stage_device[s] == d), default=0)
            for d in range(D)] if delta is not None else None
    # (an earlier stage's forward leaves room for one of each later stage on its device)
    later = [sum(delta[t]["F"] for t in range(s + 1, S) if stage_device[t] == stage_device[s])
             for s in range(S)] if delta is not None else None
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
                    room = held[d] < in_flight[d] if delta is None else \
                        used[d] + delta[s]["F"] + later[s] <= in_flight[d] * unit[d]
                    if op == "F" and (s == 0 or ("F", s - 1, m) in done) and room:
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
            used[d] += 0 if delta is None else delta[s][op]
            programs[d].append((op, s, m))
    raise NotApplicable("the template does not make progress")


def _deltas(problem: Problem, stages) -> list[dict] | None:
    """Each stage's memory change per op, when every forward allocates (else None)."""
    delta = [{op: sum(problem.blocks[b].memory for b in stage_ops(problem, st, op))
              for op in "FBW"} for st in stages]
    return delta if all(d["F"] > 0 for d in delta) else None


def _zb_chain(problem: Problem, in_flight):
    require_training(problem, split=True)
    stages = single_chain_stages(problem)
    p = len(stages)
    programs = _greedy(list(range(p)), problem.num_micro_batches, True,
                       [in_flight(s, p) for s in range(p)], _deltas(problem, stages))
    device_of = [stage_device(problem, st) for st in stages]
    return _device_orders(problem, stages, [programs[device_of.index(d)] if d in device_of
                                            else [] for d in range(problem.num_devices)])


def zb_h2(problem: Problem):
    # ZB-H2: about twice 1F1B's warmup forwards (2(p - s) - 1 in flight on stage s), so the
    # warmup has no bubble; deferred W passes fill the cooldown.
    return _zb_chain(problem, lambda s, p: 2 * (p - s) - 1)


def zb_2p(problem: Problem):
    # ZB-2p: every stage holds up to 2p micro-batches' activations, deferring W passes
    return _zb_chain(problem, lambda s, p: 2 * p)


def zb_v(problem: Problem):
    require_training(problem, split=True)
    stages = wave_stages(problem)
    D = problem.num_devices
    # ZB-V: 1F1B's activation memory (D micro-batches of the whole model, 2D stage
    # activations per device), the V placement making every device's first B come early.
    programs = _greedy([stage_device(problem, st) for st in stages],
                       problem.num_micro_batches, True, [2 * D] * D, _deltas(problem, stages))
    return _device_orders(problem, stages, programs)
