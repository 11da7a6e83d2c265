"""Why a plan admits no schedule, in terms its author can act on: the order rules of a minimal
unsat core (each at its position in the plan), or the least memory that admits the rules."""

from __future__ import annotations

from pyplan.errors import InfeasibleError
from pyplan.problem import Problem
from pyplan.solver.budget import Budget
from pyplan.solver.exact import infeasibility_core
from pyplan.planfile.units import count

__all__ = ["EXPLAIN_LIMIT", "explain"]

EXPLAIN_LIMIT = 120          # instances: up to this an infeasible plan gets an unsat core
EXPLAIN_EFFORT = 80_000_000  # Z3 resource units for one core (about 5 s here)


def explain(problem: Problem, budget: Budget) -> InfeasibleError:
    """Name what makes the plan infeasible: the order rules of a minimal unsat core (each at
    its position), or the least memory that admits the rules. A schedule of N micro-batches,
    cut to its first n, is one of n (rules naming a missing micro-batch hold vacuously), so
    what rules out n micro-batches rules out N."""
    span = max((abs(r.before_shift - r.after_shift) + 1 + r.min_m for r in problem.rules),
               default=1)
    n = min(problem.num_micro_batches, max(2, span))
    small = problem.with_overrides(micro_batches=n)
    generic = InfeasibleError("no schedule satisfies the memory capacity and order rules",
                              hint="raise memory: or relax constraints:")
    if len(problem.blocks) * n > EXPLAIN_LIMIT or budget.expired():
        return generic
    core = infeasibility_core(small, budget=budget.slice(EXPLAIN_EFFORT, fixed=True))
    if not core:
        return generic
    rules = [problem.rules[int(label.split()[1])] for label in core if label != "memory"]
    file = problem.source_path or None
    if not rules:
        if problem.device_memory:  # no one capacity to raise
            return InfeasibleError(
                f"the order rules need more memory than the capacities "
                f"{problem.show_capacity()} for {count(n, 'micro-batch')}",
                hint="raise the devices' memory or relax constraints:")
        need = _least_memory(small, budget)
        return InfeasibleError(
            f"the order rules need more memory than the capacity "
            f"{problem.show_memory(problem.memory_capacity)} for {count(n, 'micro-batch')}",
            hint=(f"raise memory: to at least {problem.show_memory(need)}" if need else
                  "raise memory: or relax constraints:"))
    where = ", ".join(f"line {r.line} '{r.text}'" for r in rules)
    memory = (f" within the memory capacity {problem.show_capacity()}"
              if "memory" in core else "")
    first = rules[0]
    return InfeasibleError(
        f"no schedule of {count(n, 'micro-batch')} keeps these order rules together"
        f"{memory}: {where}",
        hint="relax or remove one of them" + (" or raise memory:" if memory else ""),
        file=file, line=first.line or 1, column=first.column or 1)


def _least_memory(problem: Problem, budget: Budget) -> int | None:
    """The least capacity with a schedule (bisection with Z3), or None if Z3 cannot tell."""
    lo = problem.memory_capacity + 1
    hi = sum(max(0, b.memory) * len(b.devices) for b in problem.blocks) * \
        problem.num_micro_batches + max(problem.static_memory)
    found = None
    while lo <= hi:
        if budget.expired():
            return None  # what is known so far is not a proof of the least capacity
        mid = (lo + hi) // 2
        core = infeasibility_core(problem.with_overrides(memory=mid),
                                  budget=budget.slice(EXPLAIN_EFFORT, fixed=True))
        if core is None:  # a schedule exists (or Z3 gave up: then stay on the safe side)
            found, hi = mid, mid - 1
        else:
            lo = mid + 1
    return found
