"""Solver quality: every plan in plans/ at several micro-batch counts, beside every template.

    python benchmarks/quality.py [--quick] [--exact-limit SECONDS]

For each plan x N: the searched makespan, the best template that fits memory and keeps the
plan's order rules, the makespan lower bound, and the exact optimum (Z3 on the whole problem,
without symmetry breaking) where it finishes within the limit on small cases. Prints the
number of cases worse than a template (must be 0), worse than the exact optimum while claiming
`optimal` (must be 0), how many are proven optimal, and the median and maximum gap to the bound.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from pyplan.errors import InfeasibleError
from pyplan.problem import load_problem
from pyplan.solver import incumbents, solve
from pyplan.solver.budget import Budget
from pyplan.solver.exact import time_optimal
from pyplan.solver.templates import baselines

PLANS = Path(__file__).resolve().parent.parent / "plans"
COUNTS = (1, 2, 3, 4, 8, 24, 64)
EXACT_INSTANCES = 40  # whole-problem Z3 only up to this many block instances


def exact_optimum(problem, limit: float) -> int | None:
    everything = [(b.index, m) for m in range(problem.num_micro_batches) for b in problem.blocks]
    if len(everything) > EXACT_INSTANCES:
        return None
    result = time_optimal(problem, everything, symmetry=False,
                          lower_bound=problem.makespan_bound(), budget=Budget(limit))
    return result.value if result.status == "optimal" else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N in {1, 4, 24} only")
    parser.add_argument("--exact-limit", type=float, default=10.0, metavar="S",
                        help="seconds for each exact Z3 solve (default 10)")
    args = parser.parse_args()
    counts = (1, 4, 24) if args.quick else COUNTS
    print(f"{'plan':26} {'N':>3} {'searched':>9} {'template':>24} {'bound':>6} {'exact':>6} "
          f"{'status':>10} {'gap':>6} {'seconds':>8}")
    worse = wrong = proven = cases = 0
    gaps, slowest = [], 0.0
    for path in sorted(PLANS.glob("*.yaml")):
        if path.name.endswith(".resolved.yaml"):
            continue
        base = load_problem(path)
        for n in counts:
            problem = base.with_overrides(micro_batches=n)
            try:
                solution = solve(problem)
            except InfeasibleError as exc:
                print(f"{base.name:26} {n:>3} infeasible: {exc}")
                continue
            cases += 1
            made = solution.schedule.makespan
            chosen = solution.schedule.problem  # with the recomputation chosen, if any
            fitting = {name: s.makespan for name, s in
                       incumbents(chosen, solution.baselines).items()}
            if problem.recompute_choices():  # and the templates without and with all of it
                for label, variant in (("never", problem), ("always", problem.with_recompute(
                        problem.recompute_choices()))):
                    fitting.update({f"{name} ({label})": s.makespan for name, s in
                                    incumbents(variant, baselines(variant)).items()})
            best = min(fitting.items(), key=lambda item: item[1], default=None)
            exact = exact_optimum(chosen, args.exact_limit)
            worse += best is not None and made > best[1]
            wrong += exact is not None and solution.status == "optimal" and made != exact
            wrong += exact is not None and solution.lower_bound > exact
            proven += solution.status == "optimal"
            gaps.append(solution.gap)
            slowest = max(slowest, solution.search_seconds)
            shown = f"{best[0]} {best[1]}" if best else "-"
            print(f"{base.name:26} {n:>3} {made:>9} {shown:>24} {solution.lower_bound:>6} "
                  f"{exact if exact is not None else '-':>6} {solution.status:>10} "
                  f"{solution.gap:>6.1%} {solution.search_seconds:>8.2f}")
            sys.stdout.flush()
    print(f"\n{cases} cases: {worse} worse than a fitting template, {wrong} contradicting an "
          f"exact optimum, {proven} proven optimal; gap to the bound median "
          f"{statistics.median(gaps):.1%}, max {max(gaps):.1%}; slowest search "
          f"{slowest:.2f} s")
    return 1 if worse or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
