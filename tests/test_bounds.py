"""Lower bounds are bounds: never above an exact optimum. The makespan bound (critical path,
device loads with idle time, subsets of a device's blocks, memory in flight, memory-time,
data-parallel synchronisations) against exhaustive search and Z3 on small plans; the period
bound (load, memory-time over capacity) against Z3's least repetend period."""

from __future__ import annotations


from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pyplan.problem import build_problem
from pyplan.problem.schedule import schedule_from_orders
from pyplan.solver.budget import Budget
from pyplan.solver.exact import modulo_repetend, time_optimal
from pyplan.planfile import spec_from_text


@st.composite
def small_plans(draw, sync: bool = False):
    """Training plans of a few blocks on 1-3 devices with tight memory and transfers, and with
    `sync`, two data-parallel replicas."""
    devices = draw(st.integers(1, 3))
    count = draw(st.integers(1, 3))
    lines = []
    for i in range(count):
        where = draw(st.lists(st.integers(0, devices - 1), min_size=1, max_size=2, unique=True))
        after = ""
        if i > 0 and draw(st.booleans()):
            parents = draw(st.lists(st.integers(0, i - 1), max_size=2, unique=True))
            after = f", after: [{', '.join(f'b{p}' for p in sorted(parents))}]"
        transfer = draw(st.sampled_from(["", "", ", transfer: 1", ", transfer: 3"]))
        lines.append(f"  - {{name: b{i}, devices: {sorted(where)}, time: "
                     f"{draw(st.integers(1, 3))}, memory: {draw(st.integers(0, 2))}"
                     f"{transfer}{after}}}")
    mesh = f"mesh: {{data: 2, sync: {draw(st.integers(1, 4))}}}\n" if sync else ""
    text = (f"pyplan: 1\nname: small\ndevices: {devices}\nmemory: {draw(st.integers(2, 5))}\n"
            f"micro_batches: {draw(st.integers(1, 2 if sync else 3))}\n"
            f"training: {{backward: {{time_ratio: {draw(st.sampled_from([1, 2]))}}}}}\n"
            f"{mesh}blocks:\n" + "\n".join(lines) + "\n")
    return build_problem(spec_from_text(text))


def fits(problem) -> bool:
    """One micro-batch alone fits (else there is no optimum to compare with)."""
    from pyplan.solver import min_memory

    return max(min_memory(problem)) <= problem.memory_capacity


def exhaustive_optimum(problem) -> int | None:
    """The least makespan (synchronisations included) over every order of the instances
    that keeps the dependencies and fits memory; each block starts as early as its order
    allows, which loses no optimum."""
    blocks, n = problem.blocks, problem.num_micro_batches
    instances = [(b, m) for m in range(n) for b in range(len(blocks))]
    preds = {b: [a for a, c in problem.edges if c == b] for b in range(len(blocks))}
    best, seen = None, set()

    def orders_of(sequence):
        return tuple(tuple(i for i in sequence if d in blocks[i[0]].devices)
                     for d in range(problem.num_devices))

    def extend(done, sequence):
        nonlocal best
        if len(sequence) == len(instances):
            orders = orders_of(sequence)
            if orders in seen:
                return
            seen.add(orders)
            evaluated = schedule_from_orders(problem, [list(o) for o in orders], n)
            if evaluated.fits_memory:
                made = evaluated.schedule.makespan
                best = made if best is None else min(best, made)
            return
        for x in instances:
            if x not in done and all((a, x[1]) in done for a in preds[x[0]]):
                extend(done | {x}, sequence + [x])

    extend(frozenset(), [])
    return best


@settings(max_examples=40, deadline=None)
@given(small_plans())
def test_makespan_bound_never_above_the_exact_optimum(problem):
    assume(fits(problem))
    everything = [(b.index, m) for m in range(problem.num_micro_batches) for b in problem.blocks]
    assume(len(everything) <= 12)
    # (instances of a block in micro-batch order lose no optimum: the plans have no rules)
    exact = time_optimal(problem, everything, symmetry=True, budget=Budget(30))
    if exact.status == "optimal":
        assert problem.makespan_bound() <= exact.value


@settings(max_examples=40, deadline=None)
@given(small_plans(sync=True))
def test_synchronisation_bound_never_above_the_exhaustive_optimum(problem):
    assume(fits(problem) and len(problem.blocks) * problem.num_micro_batches <= 7)
    optimum = exhaustive_optimum(problem)
    if optimum is not None:
        assert problem.makespan_bound() <= optimum


@settings(max_examples=30, deadline=None)
@given(small_plans())
def test_period_bound_never_above_the_least_period(problem):
    assume(fits(problem))
    bound = problem.period_bound()
    # No repetend of up to 4 micro-batches has a shorter period (Z3 over every period below).
    for period in range(problem.load_bound(), bound):
        assert modulo_repetend(problem, period, 4, budget=Budget(30)).status != "sat"


TIGHT = """\
pyplan: 1
name: tight
devices: 4
memory: MEMORY
micro_batches: 64
training: {backward: {time_ratio: 2}}
shape: {kind: interleaved, chunks: 2, stage: {time: 1, memory: 1}}
"""


def test_memory_time_raises_the_bounds_where_memory_binds():
    # Interleaved over 4 devices: device 0 holds stages 0 and 4. A micro-batch keeps stage 0's
    # activation from its forward to its backward: 8 forwards and 7 backwards of 2 = 22 steps
    # at least, and stage 4's 4 + 3 x 2 = 10: 32 memory x time a micro-batch.
    loose = build_problem(spec_from_text(TIGHT.replace("MEMORY", "64")))
    tight = build_problem(spec_from_text(TIGHT.replace("MEMORY", "4")))
    assert tight.graph.memory_time(0) == 22 + 10
    assert loose.period_bound() == loose.load_bound() == 6
    assert tight.period_bound() == 8  # 32 / 4 on average in flight: one micro-batch per 8 steps
    assert tight.makespan_bound() >= 64 * 8
    assert tight.makespan_bound() > loose.makespan_bound()
    # And Z3 agrees that no repetend is shorter (here: up to 6 micro-batches).
    assert modulo_repetend(tight, 7, 6, budget=Budget(60)).status == "unsat"


DP = """\
pyplan: 1
name: dp
devices: 2
memory: 4
micro_batches: N
training: {backward: {time_ratio: 2}}
shape: {kind: vshape, stage: {time: 2, memory: 1}}
mesh: {data: 2, sync: 3}
"""


def test_synchronisation_bound_meets_the_dp_optimum_at_every_n():
    # Device 1 cannot end its work before n x 6 + 2 (it waits for the first forward) and the
    # last gradient of stage 0 follows 4 later; its synchronisation takes 3 more: 6 n + 9.
    from pyplan.solver import solve

    for n in (1, 2, 3, 4, 8, 24):
        problem = build_problem(spec_from_text(DP.replace("N", str(n))))
        solution = solve(problem)
        assert problem.makespan_bound() == solution.schedule.makespan == 6 * n + 9
        assert solution.status == "optimal"


@settings(max_examples=40, deadline=None)
@given(small_plans(), st.randoms())
def test_window_bound_never_above_a_schedule_the_window_allows(problem, rng):
    # The relaxation that lets the windows' large-neighbourhood search skip Z3: a lower bound
    # on every schedule that keeps the orders outside the window.
    from pyplan.solver import solve
    from pyplan.solver.complete import window_bound

    assume(fits(problem))
    schedule = solve(problem).schedule
    instances = [(b.index, m) for m in range(problem.num_micro_batches) for b in problem.blocks]
    window = rng.sample(instances, rng.randrange(len(instances) + 1))
    assert window_bound(problem, schedule.orders, window) <= schedule.makespan
    if not problem.transfers and problem.sync_time == 0:  # the orders' own longest path
        assert window_bound(problem, schedule.orders, []) == schedule.makespan
    if len(instances) <= 7:  # everything free: never above the optimum
        optimum = exhaustive_optimum(problem)
        if optimum is not None:
            assert window_bound(problem, schedule.orders, instances) <= optimum
