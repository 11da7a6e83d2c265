"""Schedule completion (Tessel IV-C): warmup and cooldown around the repeated repetend.

The periodic schedule (every repetition of the repetend, instances outside [0, N) dropped) is
always feasible and is the starting point. The cheap completion list-schedules its warmup and
cooldown against the rest; a local search over index assignments (`climb`) looks for
repetends of the same period whose cheap completion is shorter. For the winning repetends
only (lazy search), Z3 then finds time-optimal warmup (Eq. 5) and cooldown (Eq. 6) phases
that meet the repetend as a rigid periodic block (compaction at the boundaries, Fig. 6),
under the memory the other phases leave; the better composition wins, and its times are the
earliest its orders allow. With fewer micro-batches than the repetend spans there is no
steady state: the whole problem is solved time-optimally instead.

Small schedules are then improved as a whole: tiny ones (WHOLE_LIMIT instances) searched
exhaustively by the core (`search_whole`), then by Z3 (`complete_whole`); up to WINDOW_LIMIT
instances, windows of the schedule reordered (`improve_in_windows`), each first bounded by a
relaxation and by the core's search, Z3 asked only where those cannot settle it.
"""

from __future__ import annotations

from pyplan import _core
from pyplan.problem import Problem
from pyplan.problem.schedule import Instance, Schedule, build_schedule, repetend_from_core
from pyplan.solver.budget import Budget
from pyplan.solver.exact import Anchor, reoptimise, time_optimal
from pyplan.planfile.units import count

__all__ = ["EXACT_LIMIT", "PHASE_EFFORT", "WHOLE_LIMIT", "WINDOW_LIMIT", "cheap_completion",
           "climb", "climb_step_work", "complete", "complete_whole", "exact_applies",
           "improve_in_windows", "kept_pairs", "search_whole", "whole_applies",
           "window_bound"]

EXACT_LIMIT = 160          # instances: above this the exact warmup/cooldown solve is skipped
WHOLE_LIMIT = 48           # instances: up to this the whole problem is also solved exactly
PHASE_EFFORT = 1_000_000   # Z3 resource units for one phase (about 0.05 s here)
CLIMB_TRIED = 4            # neighbours completed per local-search step
WINDOW_LIMIT = 160         # instances: up to this many, Z3 reorders windows of the schedule
WINDOW = 24                # instances Z3 may reorder at once
WINDOW_EFFORT = 1_000_000  # Z3 resource units for one window (those that pay took 0.06-0.72M)
WINDOW_NODES = 20_000      # exhaustive-search nodes that may settle a window before Z3
COMPLETION_COST = 20       # a cheap completion costs about this many periodic evaluations
EXHAUSTIVE_EFFORT = 4_000_000  # effort units for the exhaustive search of a tiny problem
NODE_WORK = 4              # effort units per node of that search (about 200 ns here)
CLIMB_FULL = 16_384        # instances: above this, neighbours are ranked on fewer micro-batches


def _split_periodic(problem: Problem, rep: _core.Repetend):
    """Warmup and cooldown (relative micro-batches) of the periodic schedule."""
    # The periodic order is the same in every repetition, so the phases of N micro-batches are
    # those of 2 N_R (cooldown shifted): no need to lay out all N.
    n = min(problem.num_micro_batches, 2 * rep.num_micro_batches)
    shift = n - rep.num_micro_batches
    full = _core.periodic_orders(problem.graph, rep, n)
    indices = list(rep.indices)  # (the core copies it on every access)
    warmup = [[(b, m) for b, m in order if m < indices[b]] for order in full]
    cooldown = [[(b, m - shift) for b, m in order if m > indices[b] + shift] for order in full]
    return warmup, cooldown


def _list_scheduled(problem: Problem, around: Schedule, phase: list[Instance], *,
                    reverse: bool) -> list[list[Instance]]:
    """Per-device orders of a phase list-scheduled (by the core) against the rest of `around`,
    held fixed: the cooldown forward from the repetend's end, the warmup backward from its
    start (reverse). A heuristic that Z3 only has to improve on; orders it gets wrong fail
    evaluation and are dropped by the caller."""
    inside = set(phase)
    # A device is free once the last instance outside the phase is done (the last in its
    # order; reversed, the first, at minus its start).
    free = []
    for order in around.orders:
        outside = next((x for x in (order if reverse else reversed(order)) if x not in inside),
                       None)
        free.append(-(1 << 62) if outside is None else
                    -around.start_of(*outside) if reverse else around.end_of(*outside))
    return _core.list_schedule_phase(problem.graph, phase, around.start, free,
                                     problem.num_micro_batches, reverse)


def _closures(problem: Problem) -> tuple[list[frozenset], list[frozenset]]:
    """Each block with everything before it, and with everything after it, along the
    dependencies."""
    graph = problem.graph
    before: list = [frozenset([b]) for b in range(len(problem.blocks))]
    after: list = list(before)
    order = graph.topological_order()
    for b in order:
        before[b] = before[b].union(*(before[a] for a in graph.predecessors(b)))
    for b in reversed(order):
        after[b] = after[b].union(*(after[c] for c in graph.successors(b)))
    return before, after


def climb(problem: Problem, rep: _core.Repetend, start: tuple[Schedule, str], *, target: int,
          max_micro_batches: int, work: int,
          budget: Budget) -> list[tuple[_core.Repetend, tuple[Schedule, str]]]:
    """Local search over Tessel index assignments for a shorter cheap completion. A move
    shifts a block and everything before it (or after it) by one micro-batch, which keeps the
    assignment monotone along the dependencies; each neighbour is list-scheduled within the
    same period, the CLIMB_TRIED with the shortest periodic schedules are completed, and the
    best becomes the current one while it is shorter, until the completion meets `target`.
    Spends at most `work` instance evaluations (a count, so the same on every run). Returns
    the repetends it moved to, each with its completion."""
    graph, capacity = problem.graph, problem.capacity
    k = len(problem.blocks)
    ranked_n = _ranked_micro_batches(problem, max_micro_batches)
    before, after = _closures(problem)
    neighbours: dict[tuple, tuple[int, _core.Repetend] | None] = {}
    path: list = []
    current, best = list(rep.indices), start[0].makespan
    step_work = climb_step_work(problem, max_micro_batches)
    while best > target and work >= step_work and not budget.expired():
        work -= step_work
        budget.charge(step_work)
        moves = []
        for b in range(k):
            for shift, group in ((1, before[b]), (-1, after[b])):
                indices = [v + shift if i in group else v for i, v in enumerate(current)]
                low = min(indices)
                key = tuple(v - low for v in indices)
                if key not in neighbours:
                    neighbours[key] = None
                    candidate = _core.list_schedule_repetend(graph, list(key))
                    if max(key) < max_micro_batches and candidate.feasible and \
                            candidate.period <= rep.period and \
                            _core.memory_fits(graph, candidate, capacity):
                        makespan = _core.periodic_makespan(graph, candidate, ranked_n,
                                                           capacity)
                        if makespan >= 0:
                            neighbours[key] = makespan, candidate
                if neighbours[key] is not None and list(key) != current:
                    moves.append((neighbours[key][0], key))
        step = None
        for _, key in sorted(moves)[:CLIMB_TRIED]:
            candidate = neighbours[key][1]
            try:
                completion = cheap_completion(problem, candidate, target)
            except RuntimeError:  # the periodic order breaks an order rule
                continue
            if completion is not None and completion[0].makespan < \
                    (step[1][0].makespan if step else best):
                step = candidate, completion
        if step is None:
            break
        path.append(step)
        current, best = list(step[0].indices), step[1][0].makespan
    return path


def _ranked_micro_batches(problem: Problem, max_micro_batches: int) -> int:
    """Micro-batches over which the local search ranks its neighbours by their periodic
    schedule: all of them, except for large plans, where a few repetends' worth tell the
    warmups and cooldowns apart (every neighbour has the same period, so the steady state in
    between adds the same to each)."""
    n = problem.num_micro_batches
    if len(problem.blocks) * n <= CLIMB_FULL:
        return n
    return min(n, 2 * max_micro_batches + 2)


def climb_step_work(problem: Problem, max_micro_batches: int) -> int:
    """What one step of the local search costs: 2 k neighbours' periodic schedules of k
    instances per micro-batch ranked, and CLIMB_TRIED of them completed (laid out in Python,
    phases list-scheduled: about COMPLETION_COST evaluations per instance)."""
    n, k = problem.num_micro_batches, len(problem.blocks)
    return (2 * k * _ranked_micro_batches(problem, max_micro_batches)
            + CLIMB_TRIED * COMPLETION_COST * n) * k


def _warmup_anchor(problem: Problem, rep: _core.Repetend, instances) -> Anchor:
    blocks = problem.blocks
    T, n, a = rep.period, rep.indices, rep.offsets
    first = {d: min(a[b] for b in problem.graph.blocks_on(d))
             for d in range(problem.num_devices) if problem.graph.blocks_on(d)}
    members = set(instances)
    external: dict = {}
    for p, c in problem.edges:
        for (b, m) in instances:
            if b == p and (c, m) not in members:
                # (c, m) runs in repetition m - n[c] >= 0; b's output must have arrived
                due = (m - n[c]) * T + a[c] - problem.transfer.get((p, c), 0)
                external[(b, m)] = min(external.get((b, m), due), due)
    # R cannot be earlier than any device's warmup work, nor than any instance's own chain.
    head = problem.graph.heads()
    bound = 0
    for d, due in first.items():
        on = [(b, m) for b, m in instances if d in blocks[b].devices]
        if on:
            bound = max(bound, min(head[b] for b, _ in on) + sum(blocks[b].time for b, _ in on)
                        - due)
    for (b, _), due in external.items():
        bound = max(bound, head[b] + blocks[b].time - due)
    return Anchor("warmup", first, external, floor=bound)


def _cooldown_anchor(problem: Problem, rep: _core.Repetend, instances, last: int) -> Anchor:
    T, n, a = rep.period, rep.indices, rep.offsets
    time_of = [b.time for b in problem.blocks]
    end = {d: max(a[b] + time_of[b] for b in problem.graph.blocks_on(d))
           for d in range(problem.num_devices) if problem.graph.blocks_on(d)}
    members = set(instances)
    external: dict = {}
    for p, c in problem.edges:
        for (b, m) in instances:
            if b == c and (p, m) not in members:
                ready = (m - n[p] - last) * T + a[p] + time_of[p] + \
                    problem.transfer.get((p, c), 0)
                external[(b, m)] = max(external.get((b, m), ready), ready)
    # The end is no earlier than any device's cooldown work after its last repetition.
    tail = problem.graph.tails()
    floor = max(end.values(), default=0)
    for d, ready in end.items():
        on = [(b, m) for b, m in instances if d in problem.blocks[b].devices]
        if on:
            floor = max(floor, ready + sum(time_of[b] for b, _ in on)
                        + min(tail[b] for b, _ in on))
    for (b, _), ready in external.items():
        floor = max(floor, ready + time_of[b] + tail[b])
    return Anchor("cooldown", end, external, floor=floor)


def exact_applies(problem: Problem, rep: _core.Repetend, budget: Budget) -> bool:
    """Whether Z3 could still improve the cheap completion of `rep` (else `complete` with
    exact=True gives the cheap one again)."""
    if problem.num_micro_batches < rep.num_micro_batches or budget.spent or budget.expired():
        return False
    warm, cool, _ = _phases(problem, rep)
    return max(len(warm), len(cool)) <= EXACT_LIMIT


def _relative(orders, last: int) -> list[list[Instance]]:
    return [[(b, m - last) for b, m in order] for order in orders]


def _phases(problem: Problem, rep: _core.Repetend) -> tuple[list, list, int]:
    """The warmup and cooldown instances of a plan's micro-batches (Eq. 5-6), and the first
    micro-batch of the last repetition."""
    indices = list(rep.indices)
    last = problem.num_micro_batches - rep.num_micro_batches
    return (_core.warmup_blocks(indices),
            [(b, m + last) for b, m in _core.cooldown_blocks(indices)], last)


def cheap_completion(problem: Problem, rep: _core.Repetend,
                     target: int = 0) -> tuple[Schedule, str] | None:
    """The periodic completion, or if it is longer than `target` and list-scheduling its
    warmup, then its cooldown, shortens it, that; and which it is ("periodic" or
    "list-scheduled"). None when no full repetend fits in the plan's micro-batches."""
    if problem.num_micro_batches < rep.num_micro_batches:
        return None
    warm, cool, last = _phases(problem, rep)
    warmup, cooldown = _split_periodic(problem, rep)
    best = periodic = build_schedule(problem, warmup, repetend_from_core(problem, rep), cooldown)
    for phase, reverse in ((warm, True), (cool, False)):
        if not phase or best.makespan <= target:
            continue
        orders = _list_scheduled(problem, best, phase, reverse=reverse)
        warmup, cooldown = (orders, best.cooldown) if reverse else \
            (best.warmup, _relative(orders, last))
        if (warmup if reverse else cooldown) == \
                [list(o) for o in (best.warmup if reverse else best.cooldown)]:
            continue  # the same orders again
        try:
            candidate = build_schedule(problem, warmup, best.repetend, cooldown)
        except RuntimeError:
            continue  # memory or an order rule the heuristic does not see
        if candidate.makespan <= best.makespan:
            best = candidate
    if best.makespan == periodic.makespan:
        return periodic, "periodic"
    return best, "list-scheduled"


def complete(problem: Problem, rep: _core.Repetend, *, exact: bool, budget: Budget,
             notes: list[str], target: int = 0,
             cheap: tuple[Schedule, str] | None = None) -> tuple[Schedule, bool]:
    """The best completion found, and whether Z3 stopped before proving its phases optimal.
    First the cheap ones: the periodic order, and its phases list-scheduled (`cheap`, when the
    caller laid them out already); one that takes no more than `target` (the lower bound) is
    kept without asking Z3."""
    n = problem.num_micro_batches
    if n < rep.num_micro_batches:
        schedule = build_schedule(problem, _core.periodic_orders(problem.graph, rep, n), None, ())
        notes.append("completion: periodic order (no full repetend fits in "
                     f"{count(n, 'micro-batch')})")
        return schedule, False
    warm, cool, last = _phases(problem, rep)
    cheap, how = cheap or cheap_completion(problem, rep, target)
    phases = f"warmup ({count(len(warm), 'block')}) and cooldown ({count(len(cool), 'block')})"
    if cheap.makespan <= target:
        notes.append(f"completion: {how} {phases} meet the lower bound")
        return cheap, False
    if not exact or max(len(warm), len(cool)) > EXACT_LIMIT or budget.spent or \
            budget.expired():
        reason = ("" if not exact else ", exact effort used up" if budget.spent else
                  ", the time limit ran out" if budget.timed_out() else
                  ", the work allowance ran out" if budget.expired() else
                  f", above the exact limit of {EXACT_LIMIT}")
        notes.append(f"completion: {how} {phases}{reason}")
        return cheap, False
    w = c = None
    cut = False
    if warm:
        result = time_optimal(problem, warm, anchor=_warmup_anchor(problem, rep, warm),
                              budget=budget.slice(budget.units(PHASE_EFFORT)))
        cut |= result.status in ("feasible", "unknown")
        w = result.orders if result.orders else None
    if cool:
        result = time_optimal(problem, cool, initial_memory=list(rep.entry_memory),
                              anchor=_cooldown_anchor(problem, rep, cool, last),
                              budget=budget.slice(budget.units(PHASE_EFFORT)))
        cut |= result.status in ("feasible", "unknown")
        c = _relative(result.orders, last) if result.orders else None
    best = cheap
    if w is not None or c is not None:
        try:
            candidate = build_schedule(problem, w if w is not None else cheap.warmup,
                                       cheap.repetend, c if c is not None else cheap.cooldown)
            if candidate.makespan < best.makespan:
                best = candidate
        except RuntimeError:
            pass  # an order rule ties a phase to the repetend: the cheap phases stay
    if best is cheap:
        notes.append(f"completion: {how} {phases}; Z3's phases "
                     + ("within its effort " if cut else "") + "are no shorter")
    else:
        notes.append(f"completion: {phases} "
                     + ("improved by Z3 within its effort, not proven optimal" if cut
                        else "time-optimal (Z3)"))
    return best, cut


def whole_applies(problem: Problem) -> bool:
    """Whether the problem is small enough to be solved whole with Z3 (complete_whole)."""
    return len(problem.blocks) * problem.num_micro_batches <= WHOLE_LIMIT


def complete_whole(problem: Problem, best: Schedule, *, budget: Budget,
                   notes: list[str]) -> tuple[Schedule, bool]:
    """For small problems: the whole schedule time-optimal, if that beats `best`; and whether
    the schedule returned is proven optimal (Z3 found none shorter)."""
    if not whole_applies(problem) or budget.spent:
        return best, False
    everything = [(b.index, m) for m in range(problem.num_micro_batches)
                  for b in problem.blocks]
    # Ordering each block's instances by micro-batch loses no schedule without order rules
    # (relabel the k-th instance in time as micro-batch k); a rule with a shift can need others.
    result = time_optimal(problem, everything, upper_bound=best.makespan,
                          lower_bound=problem.makespan_bound(), budget=budget,
                          symmetry=not problem.rules, top_first=True)
    if not result.orders:
        if result.status == "none":
            notes.append("completion: Z3 proved that no shorter schedule exists")
        return best, result.status == "none"
    schedule = build_schedule(problem, result.orders, None, ())
    # Z3's objective bounds the synchronisations' queueing from below: proven only if met.
    proven = result.status == "optimal" and schedule.makespan == result.value
    if schedule.makespan >= best.makespan:
        return best, False
    notes[:] = ["completion: whole schedule time-optimal (Z3), shorter than any repetend or "
                "template"
                if proven else
                "completion: whole schedule improved by Z3, not proven optimal"]
    return schedule, proven


def window_bound(problem: Problem, orders, free) -> int:
    """A lower bound on the makespan of any schedule in which every device keeps `orders`
    except among the instances in `free` (what `reoptimise` searches): the longest path
    through the dependencies and the kept orders, and on each device the free instances run
    one at a time between the earliest any of them can start and the least time any of them
    leaves after it. Memory and order rules left out, it only bounds from below: a window it
    puts at or above the makespan cannot give a shorter schedule."""
    blocks, n = problem.blocks, problem.num_micro_batches
    k = len(blocks)
    time_of = [b.time for b in blocks]
    count_ = k * n
    succ: list[list[tuple[int, int]]] = [[] for _ in range(count_)]  # instance m * k + b

    def after(x: int, y: int, gap: int) -> None:
        succ[x].append((y, gap))

    for a, c in problem.edges:
        gap = time_of[a] + problem.transfer.get((a, c), 0)
        for m in range(n):
            after(m * k + a, m * k + c, gap)
    loose = {m * k + b for b, m in free}
    for order in orders:
        ids = [m * k + b for b, m in order]
        kept = [x for x in ids if x not in loose]
        for x, y in zip(kept, kept[1:]):
            after(x, y, time_of[x % k])
        position = {x: p for p, x in enumerate(ids)}
        for x in ids:  # a free instance keeps its place among the kept ones
            if x in loose:
                for y in kept:
                    if position[y] < position[x]:
                        after(y, x, time_of[y % k])
                    else:
                        after(x, y, time_of[x % k])
    indegree = [0] * count_
    for edges in succ:
        for y, _ in edges:
            indegree[y] += 1
    topological = [x for x in range(count_) if indegree[x] == 0]
    head = [0] * count_
    for x in topological:  # (grows while it is walked)
        for y, gap in succ[x]:
            head[y] = max(head[y], head[x] + gap)
            indegree[y] -= 1
            if indegree[y] == 0:
                topological.append(y)
    if len(topological) < count_:
        return 0  # the kept orders contradict the dependencies: no bound
    sync = problem.sync_time
    tail = [0] * count_  # from the instance's start to the end it forces
    for x in reversed(topological):
        own = time_of[x % k] + (0 if blocks[x % k].is_forward else sync)
        tail[x] = max([own] + [gap + tail[y] for y, gap in succ[x]])
    bound = max(head[x] + tail[x] for x in range(count_))
    for d in range(problem.num_devices):
        on = [x for x in loose if d in blocks[x % k].devices]
        if on:
            bound = max(bound, min(head[x] for x in on) + sum(time_of[x % k] for x in on)
                        + min(tail[x] - time_of[x % k] for x in on))
    return bound


def search_whole(problem: Problem, best: Schedule, *, budget: Budget,
                 notes: list[str]) -> tuple[Schedule, bool]:
    """For tiny problems without order rules (whole_applies): the core's exhaustive search
    for a schedule shorter than `best`, again below each one it finds, within
    EXHAUSTIVE_EFFORT; the best schedule and whether it is proven optimal (the search ran
    out of schedules, not of effort). It settles most tiny problems in milliseconds, where Z3
    (complete_whole) takes longer to start than this takes to finish."""
    if not whole_applies(problem) or problem.rules:
        return best, False
    head = [-1 if problem.headroom(d) is None else problem.headroom(d)
            for d in range(problem.num_devices)]
    forward = [b.is_forward for b in problem.blocks]
    k, n = len(problem.blocks), problem.num_micro_batches
    nodes = max(1, budget.units(EXHAUSTIVE_EFFORT) // NODE_WORK)
    start = best
    while nodes > 0 and not budget.expired():
        status, starts, used = _core.schedule_within(
            problem.graph, n, best.makespan - 1, head, forward, problem.sync_time, nodes)
        nodes -= used
        budget.charge(used * NODE_WORK)
        if status == "none":
            if best is not start:
                notes[:] = [_FOUND]
            notes.append("completion: an exhaustive search proved that no shorter schedule "
                         "exists")
            return best, True
        if status == "unknown":
            break
        orders = [sorted(((b, m) for m in range(n) for b in range(k)
                          if d in problem.blocks[b].devices),
                         key=lambda x: (starts[x[1] * k + x[0]], x[1], x[0]))
                  for d in range(problem.num_devices)]
        schedule = build_schedule(problem, orders, None, ())
        if schedule.makespan >= best.makespan:  # (synchronisations queue: Z3 decides)
            break
        best = schedule
    if best is not start:
        notes[:] = [_FOUND]
    return best, False


_FOUND = "completion: whole schedule found by an exhaustive search, shorter than any " \
    "repetend or template"


def kept_pairs(problem: Problem, orders, free) -> list[tuple[int, int]]:
    """The orders a window keeps, as pairs of instances [m * K + b] (x, y): y after x. Every
    device keeps its order except among the free instances (as reoptimise's model)."""
    k = len(problem.blocks)
    loose = set(map(tuple, free))
    pairs = []
    for order in orders:
        ids = [(b, m) for b, m in order]
        kept = [x for x in ids if x not in loose]
        pairs += [(x[1] * k + x[0], y[1] * k + y[0]) for x, y in zip(kept, kept[1:])]
        before = None  # the kept instance before the current position
        for p, x in enumerate(ids):
            if x not in loose:
                before = x
                continue
            after = next((y for y in ids[p + 1:] if y not in loose), None)
            if before is not None:
                pairs.append((before[1] * k + before[0], x[1] * k + x[0]))
            if after is not None:
                pairs.append((x[1] * k + x[0], after[1] * k + after[0]))
    return pairs


def _window_searched(problem: Problem, schedule: Schedule, free, budget: Budget) -> bool:
    """Whether the core's exhaustive search proves, within WINDOW_NODES, that no reordering of
    the window is shorter (no order rules: Z3 decides those)."""
    if problem.rules:
        return False
    head = [-1 if problem.headroom(d) is None else problem.headroom(d)
            for d in range(problem.num_devices)]
    status, _, nodes = _core.schedule_within(
        problem.graph, problem.num_micro_batches, schedule.makespan - 1, head,
        [b.is_forward for b in problem.blocks], problem.sync_time, WINDOW_NODES,
        kept_pairs(problem, schedule.orders, free))
    budget.charge(nodes * NODE_WORK)
    return status == "none"


def improve_in_windows(problem: Problem, best: Schedule, *, budget: Budget, target: int,
                       notes: list[str]) -> Schedule:
    """Large-neighbourhood search with Z3 for schedules of a few hundred instances: a window
    of WINDOW instances consecutive in start time may be reordered among themselves while
    every other pair keeps its order (all may move in time); a window that gives a shorter
    schedule is taken and the pass starts again, until a pass gives nothing, the schedule
    meets `target` or the budget's units run out. Windows overlap by half. The result has no
    repetend (its orders are the schedule)."""
    count_ = len(problem.blocks) * problem.num_micro_batches
    if count_ > WINDOW_LIMIT or best.makespan <= target or budget.spent:
        return best
    schedule, size = best, min(WINDOW, count_)
    while schedule.makespan > target and not budget.spent and not budget.expired():
        instances = sorted({(schedule.start_of(b, m), m, b)
                            for order in schedule.orders for b, m in order})
        improved = False
        for low in range(0, max(1, count_ - size // 2), max(1, size // 2)):
            free = [(b, m) for _, m, b in instances[low:low + size]]
            if window_bound(problem, schedule.orders, free) >= schedule.makespan or \
                    _window_searched(problem, schedule, free, budget):
                continue  # no reordering of this window can be shorter: no need to ask Z3
            result = reoptimise(problem, schedule.orders, free, upper_bound=schedule.makespan,
                                budget=budget.slice(budget.units(WINDOW_EFFORT)))
            if result.orders:
                try:
                    candidate = build_schedule(problem, result.orders, None, ())
                except RuntimeError:  # an order rule the window's orders do not keep
                    candidate = None
                if candidate is not None and candidate.makespan < schedule.makespan:
                    schedule, improved = candidate, True
                    break
            if budget.spent or budget.expired():
                break
        if not improved:
            break
    if schedule is not best:
        notes.append(f"completion: Z3 reordered windows of {count(size, 'instance')} "
                     f"(makespan {best.makespan} -> {schedule.makespan})")
    return schedule
