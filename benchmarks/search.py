"""Search cost and quality, measured side by side in one run.

    python benchmarks/search.py [--quick] [--to-limit SECONDS]

0. The plans in plans/ with 4 devices at their own settings: search_seconds (median of 5)
   against the targets for the papers' plans (50 ms, NN- and M-shape 0.3 s; none for plans
   written by pyplan partition from measured costs), the X-shape at Tessel's setting (N_R = 3,
   target 0.15 s) and the wall time of a whole `pyplan solve plans/tessel-vshape.yaml`
   process (median of 11; target 0.25 s).
1. pyplan solve vs the exact time-optimal Z3 formulation of the whole problem (Tessel's "TO")
   on the same placements for 1, 2, 4 and 6 micro-batches (Tessel Fig. 9): seconds and
   makespans side by side.
2. Scaling: V, X, M and NN shapes at 16, 32 and 64 devices, backward 1, 2 and 3 times the
   forward, 1024 micro-batches: seconds, makespan beside the best fitting template and the
   lower bound. Targets: under 2 s each, never worse than a template.
3. Order constraints on AlphaFold2 3F1B (nnScaler Table 7): the exhaustive Tessel search
   (every index assignment for N_R = 1..6, list-scheduled and evaluated, then a Z3 proof) with
   and without the rules; nnScaler reports 11.7x.
4. Z3 plain Solver with bisection vs z3.Optimize on the same time-optimal problems.
5. Plans the search was not tuned on: V, X, M, NN, K, interleaved and wave placements at 16,
   32 and 64 devices with other memory capacities and backward ratios (1024 micro-batches):
   default settings (the search stops once more work stops paying) against the best template
   that fits and against the same search with ten times the effort (--effort 10), side by
   side. Targets: every case under 5 s by default, within 1% of the 10x result.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pyplan import _core
from pyplan.problem import build_problem, load_problem
from pyplan.solver import incumbents, solve
from pyplan.solver.budget import Budget
from pyplan.solver.exact import modulo_repetend, time_optimal
from pyplan.spec import spec_from_text

PLANS = Path(__file__).resolve().parent.parent / "plans"


def shape_problem(kind: str, devices: int, micro_batches: int, ratio: float = 3,
                  memory: int | None = None, time: int = 1):
    shared = "shared: {time: 1, memory: 0, backward: {time: 1, memory: 0}}" \
        if kind in ("mshape", "nnshape") else ""
    if kind == "kshape":
        shared = "shared: {time: 1, memory: 1}"
    chunks = ", chunks: 2" if kind == "interleaved" else ""
    text = (f"pyplan: 1\nname: {kind}-{devices}\ndevices: {devices}\n"
            f"memory: {memory or 2 * devices + 4}\nmicro_batches: {micro_batches}\n"
            f"training: {{backward: {{time_ratio: {ratio}}}}}\n"
            f"shape: {{kind: {kind}{chunks}, stage: {{time: {time}, memory: 1}}, {shared}}}\n")
    return build_problem(spec_from_text(text))


# Section 5: (kind, devices, memory, stage time, backward ratio). Memory 16 holds fewer
# micro-batches than 1F1B keeps in flight from 32 devices on; D and 3D/2 are at and a little
# above what the first stage of a D-stage 1F1B holds; ratios 1.5 and 2.5 (stage time 2) give
# backward blocks of 3 and 5.
UNSEEN = [
    ("mshape", 16, 16, 1, 2), ("mshape", 64, 16, 1, 2), ("xshape", 32, 16, 1, 2),
    ("vshape", 16, 12, 2, 1.5), ("vshape", 32, 48, 1, 2), ("vshape", 64, 64, 2, 2.5),
    ("xshape", 16, 24, 2, 2.5), ("xshape", 64, 96, 1, 2),
    ("mshape", 32, 32, 2, 1.5), ("nnshape", 16, 16, 2, 2.5), ("nnshape", 32, 48, 1, 2),
    ("nnshape", 64, 64, 1, 1.5), ("kshape", 16, 16, 1, 2), ("kshape", 32, 24, 2, 1.5),
    ("interleaved", 16, 24, 1, 2), ("interleaved", 32, 32, 2, 2.5), ("wave", 16, 16, 1, 2),
    ("wave", 32, 48, 2, 1.5),
]


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def bench_paper_plans() -> None:
    print("0. 4-device plans at their own settings: search_seconds, median (min-max) of 5")
    print(f"{'plan':26} {'N':>3} {'makespan':>9} {'status':>9} {'ms':>8} {'range':>15} "
          f"{'target ms':>10}")
    missed = 0
    for path in sorted(PLANS.glob("*.yaml")):
        if path.name.endswith(".resolved.yaml"):
            continue
        problem = load_problem(path)
        if problem.num_devices != 4:
            continue
        runs = [solve(problem) for _ in range(5)]
        ms = [1000 * r.search_seconds for r in runs]
        # The targets are for the papers' settings; plans `pyplan partition` wrote from
        # measured costs (hundreds of time units per block, a recomputation choice) have none.
        measured = "written by pyplan partition" in problem.description.lower()
        target = None if measured else \
            300 if any(k in problem.name for k in ("nnshape", "mshape")) else 50
        missed += target is not None and statistics.median(ms) > target
        print(f"{problem.name:26} {problem.num_micro_batches:>3} {runs[0].schedule.makespan:>9} "
              f"{runs[0].status:>9} {statistics.median(ms):>8.1f} "
              f"{f'{min(ms):.1f}-{max(ms):.1f}':>15} {target or '-':>10}", flush=True)
    xshape = load_problem(PLANS / "tessel-xshape.yaml")
    tessel = dataclasses.replace(xshape, search=dataclasses.replace(
        xshape.search, max_repetend_micro_batches=3))
    runs = [solve(tessel) for _ in range(5)]
    ms = [1000 * r.search_seconds for r in runs]
    missed += statistics.median(ms) > 150
    print(f"{'tessel-xshape, N_R <= 3':26} {tessel.num_micro_batches:>3} "
          f"{runs[0].schedule.makespan:>9} {runs[0].status:>9} {statistics.median(ms):>8.1f} "
          f"{f'{min(ms):.1f}-{max(ms):.1f}':>15} {150:>10}", flush=True)
    walls = []
    script = Path(sys.executable).with_name("pyplan")  # the console script a user runs
    command = [str(script)] if script.exists() else [sys.executable, "-m", "pyplan"]
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(11):
            start = time.perf_counter()
            subprocess.run(command + ["solve", str(PLANS / "tessel-vshape.yaml"),
                                      "-o", f"{scratch}/out.yaml"],
                           check=True, capture_output=True)
            walls.append(time.perf_counter() - start)
    print(f"  over target: {missed}; `pyplan solve plans/tessel-vshape.yaml` wall time "
          f"{statistics.median(walls):.3f} s median ({min(walls):.3f}-{max(walls):.3f}), "
          "target 0.25 s\n")


def bench_time_optimal(quick: bool, to_limit: float) -> None:
    print("1. pyplan vs exact time-optimal Z3 (TO), 4 devices, paper costs (f=1, b=3)")
    print(f"{'plan':16} {'N':>3} {'pyplan s':>9} {'makespan':>9} {'TO s':>8} {'TO makespan':>12}"
          f" {'TO/pyplan time':>15}")
    for name in ("tessel-vshape", "tessel-mshape", "tessel-nnshape", "tessel-kshape"):
        base = load_problem(PLANS / f"{name}.yaml")
        for n in ((1, 2, 4) if quick else (1, 2, 4, 6)):
            problem = base.with_overrides(micro_batches=n)
            ours, t_ours = timed(lambda: solve(problem))
            everything = [(b.index, m) for m in range(n) for b in problem.blocks]
            exact, t_to = timed(lambda: time_optimal(problem, everything,
                                                     budget=Budget(to_limit)))
            shown = f"{exact.value}" + ("" if exact.status == "optimal" else " (limit)")
            if exact.status in ("none", "unknown"):
                shown = "none (limit)"
            print(f"{name:16} {n:>3} {t_ours:>9.2f} {ours.schedule.makespan:>9} {t_to:>8.2f} "
                  f"{shown:>12} {t_to / t_ours:>14.1f}x")


def bench_scaling(quick: bool) -> None:
    print("\n2. Scaling: 1024 micro-batches, memory 2D+4, backward = ratio x forward; the best "
          "template that fits, the lower bound")
    print(f"{'shape':8} {'devices':>7} {'ratio':>5} {'seconds':>8} {'status':>10} "
          f"{'makespan':>9} {'template':>22} {'bound':>7} {'gap':>6}")
    worse, slowest = 0, 0.0
    for kind in ("vshape", "xshape", "mshape", "nnshape"):
        for devices in ((16,) if quick else (16, 32, 64)):
            for ratio in (1, 2, 3):
                problem = shape_problem(kind, devices, 1024, ratio)
                solution, seconds = timed(lambda: solve(problem))
                made = solution.schedule.makespan
                fitting = {name: sch.makespan for name, sch in
                           incumbents(problem, solution.baselines).items()}
                best = min(fitting.items(), key=lambda item: item[1], default=None)
                worse += best is not None and made > best[1]
                slowest = max(slowest, seconds)
                shown = f"{best[0]} {best[1]}" if best else "-"
                print(f"{kind:8} {devices:>7} {ratio:>5} {seconds:>8.2f} {solution.status:>10} "
                      f"{made:>9} {shown:>22} {solution.lower_bound:>7} {solution.gap:>6.1%}",
                      flush=True)
    print(f"  worse than a fitting template: {worse}; slowest solve {slowest:.2f} s")


def exhaustive_tessel(problem, max_nr: int):
    """Every index assignment for N_R = 1..max_nr (no fast path), then a Z3 proof that no
    shorter period exists: the search nnScaler's constraints are meant to cut."""
    graph = problem.graph
    best = None
    count = 0
    for nr in range(1, max_nr + 1):
        rep, stats = _core.search_repetends(graph, nr, problem.capacity, 0, 0, 0)
        count += stats.enumerated
        if rep.feasible and (best is None or rep.period < best.period):
            best = rep
    checks = 0
    for period in range(problem.load_bound(), best.period):
        checks += 1
        if modulo_repetend(problem, period, max_nr).status == "sat":
            return period, count, checks
    return best.period, count, checks


def alphafold2(stages: int):
    """plans/alphafold2-3f1b.yaml generalised to any number of stages."""
    blocks = "".join(f"  - {{name: f{p}_s{i}, time: 1, devices: [{i}]"
                     + (", backward: false}\n" if p < 3 else ", memory: 1}\n")
                     for p in (1, 2, 3) for i in range(stages))
    text = (f"pyplan: 1\nname: af2-{stages}\ndevices: {stages}\nmemory: {stages + 2}\n"
            f"micro_batches: 16\ntraining: {{backward: {{time_ratio: 2}}}}\nblocks:\n{blocks}"
            "constraints:\n  order:\n"
            f"    - {{rule: \"f1_s{{i}}[m+2] < f2_s{{i}}[m+1]\", for: {{i: \"0..{stages - 1}\"}}}}\n"
            f"    - {{rule: \"f2_s{{i}}[m+1] < f3_s{{i}}[m]\", for: {{i: \"0..{stages - 1}\"}}}}\n"
            f"    - {{rule: \"f3_s{{i}}[m] < f3_s{{i}}.b[m-{{D-i-1}}] if m > {{D-i-1}}\", "
            f"for: {{i: \"0..{stages - 1}\"}}}}\n")
    return build_problem(spec_from_text(text))


def bench_constraints() -> None:
    print("\n3. Order constraints, AlphaFold2 3F1B (nnScaler Table 7), exhaustive Tessel search"
          " (N_R <= stages + 4) with and without the rules; nnScaler reports 11.7x at 4 stages")
    print(f"{'stages':>6} {'with s':>8} {'cand.':>8} {'period':>7} {'without s':>10} "
          f"{'cand.':>9} {'period':>7} {'speed-up':>9}")
    for stages in (4, 5):
        problem = alphafold2(stages)
        free = problem.with_overrides(rules=False)
        limit = stages + 4  # the rules need N_R > stages (f3 of m runs before b of m-(D-1))
        (p_with, n_with, _), t_with = timed(lambda: exhaustive_tessel(problem, limit))
        (p_free, n_free, _), t_free = timed(lambda: exhaustive_tessel(free, limit))
        print(f"{stages:>6} {t_with:>8.3f} {n_with:>8} {p_with:>7} {t_free:>10.3f} {n_free:>9} "
              f"{p_free:>7} {t_free / t_with:>8.1f}x")
    problem = load_problem(PLANS / "alphafold2-3f1b.yaml")
    free = problem.with_overrides(rules=False)
    with_solution, t_solve_with = timed(lambda: solve(problem))
    free_solution, t_solve_free = timed(lambda: solve(free))
    print(f"  full pyplan solve of plans/alphafold2-3f1b.yaml: with rules {t_solve_with:.2f}s "
          f"(makespan {with_solution.schedule.makespan}), without {t_solve_free:.2f}s (makespan "
          f"{free_solution.schedule.makespan}): the fast path needs no rules to reach the bound")


def bench_optimize(quick: bool) -> None:
    print("\n4. Z3: plain Solver + bisection vs Optimize (whole problem, time-optimal)")
    print(f"{'plan':16} {'N':>3} {'bisection s':>12} {'optimize s':>11} {'ratio':>7} "
          f"{'makespans':>12}")
    for name in ("tessel-vshape", "tessel-kshape", "tessel-mshape"):
        for n in ((2,) if quick else (2, 3)):
            problem = load_problem(PLANS / f"{name}.yaml").with_overrides(micro_batches=n)
            everything = [(b.index, m) for m in range(n) for b in problem.blocks]
            a, t_a = timed(lambda: time_optimal(problem, everything, method="bisection"))
            b, t_b = timed(lambda: time_optimal(problem, everything, method="optimize"))
            print(f"{name:16} {n:>3} {t_a:>12.2f} {t_b:>11.2f} {t_b / t_a:>6.1f}x "
                  f"{a.value:>5} / {b.value:<5}")


def bench_unseen(quick: bool) -> None:
    print("\n5. Plans not tuned on (1024 micro-batches): default settings vs the best fitting "
          "template and vs ten times the effort")
    print(f"{'shape':11} {'D':>3} {'mem':>4} {'f/b':>7} {'seconds':>8} {'status':>9} "
          f"{'makespan':>9} {'template':>22} {'bound':>7} {'10x s':>7} {'10x':>7} "
          f"{'vs 10x':>7}")
    slowest, worst, worse = 0.0, 0.0, 0
    for kind, devices, memory, time_, ratio in (UNSEEN[:6] if quick else UNSEEN):
        problem = shape_problem(kind, devices, 1024, ratio, memory, time_)
        solution, seconds = timed(lambda: solve(problem))
        more, more_seconds = timed(lambda: solve(problem.with_overrides(effort=10)))
        made, better = solution.schedule.makespan, more.schedule.makespan
        fitting = {name: sch.makespan for name, sch in
                   incumbents(problem, solution.baselines).items()}
        best = min(fitting.items(), key=lambda item: item[1], default=None)
        worse += best is not None and made > best[1]
        slowest = max(slowest, seconds)
        worst = max(worst, made / better - 1)
        shown = f"{best[0]} {best[1]}" if best else "-"
        backward = round(time_ * ratio)
        print(f"{kind:11} {devices:>3} {memory:>4} {f'{time_}/{backward}':>7} {seconds:>8.2f} "
              f"{solution.status:>9} {made:>9} {shown:>22} {solution.lower_bound:>7} "
              f"{more_seconds:>7.2f} {better:>7} {made / better - 1:>7.2%}", flush=True)
    print(f"  slowest default solve {slowest:.2f} s (target 5 s); furthest from the 10x result "
          f"{worst:.2%} (target 1%); worse than a fitting template: {worse}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer and smaller cases")
    parser.add_argument("--to-limit", type=float, default=120.0,
                        help="seconds allowed to each exact TO solve (default 120)")
    parser.add_argument("--only", type=int, metavar="K", help="run section K alone")
    args = parser.parse_args()
    if args.only is not None:
        {0: bench_paper_plans, 1: lambda: bench_time_optimal(args.quick, args.to_limit),
         2: lambda: bench_scaling(args.quick), 3: bench_constraints,
         4: lambda: bench_optimize(args.quick), 5: lambda: bench_unseen(args.quick)}[args.only]()
        return
    bench_paper_plans()
    bench_scaling(args.quick)
    bench_constraints()
    bench_optimize(args.quick)
    bench_time_optimal(args.quick, args.to_limit)
    bench_unseen(args.quick)


if __name__ == "__main__":
    main()
