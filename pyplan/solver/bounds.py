"""The first stage of a solve: what any schedule needs. Memory: one micro-batch alone must fit
(else the plan is infeasible before any search); makespan: the C++ core's lower bound
(Problem.makespan_bound), which the later stages try to meet and which proves them optimal."""

from __future__ import annotations

from pyplan import _core
from pyplan.errors import InfeasibleError
from pyplan.problem import Problem

__all__ = ["check_fits", "min_memory"]


def min_memory(problem: Problem) -> list[int]:
    """Peak memory per device of one micro-batch run alone in dependency order."""
    order = problem.graph.topological_order()
    orders = [[(b, 0) for b in order if d in problem.blocks[b].devices]
              for d in range(problem.num_devices)]
    return list(_core.evaluate(problem.free_graph, orders).peak_memory)


def check_fits(problem: Problem) -> None:
    """InfeasibleError when one micro-batch alone exceeds a device's memory capacity."""
    if not problem.limited:
        return
    need = min_memory(problem)
    over = [d for d in range(problem.num_devices)
            if problem.capacity_of(d) is not None and need[d] > problem.capacity_of(d)]
    if not over:
        return
    worst = max(over, key=lambda d: need[d] - problem.capacity_of(d))
    if problem.device_memory:
        hint = (f"device {worst} needs at least {problem.show_memory(need[worst])}; raise its "
                "memory or split blocks")
    else:
        hint = (f"the smallest memory that admits one micro-batch is "
                f"{problem.show_memory(max(need))}; raise memory: or split blocks")
    raise InfeasibleError(
        f"one micro-batch alone needs {problem.show_memory(need[worst])} on device {worst}, "
        f"more than the capacity {problem.show_memory(problem.capacity_of(worst))}", hint=hint)
