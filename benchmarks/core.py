"""C++ core vs the plain-Python reference, measured side by side in one run.

    python benchmarks/core.py [--quick]

1. Schedule evaluation (earliest start of a full N-micro-batch schedule): evaluations per second
   and evaluated blocks per second, V-shape and M-shape at 4-32 devices, 64-256 micro-batches.
2. Repetend candidates enumerated and evaluated (list schedule + exact steady-state period) per
   second at 4-32 devices.
"""

from __future__ import annotations

import argparse
import time

from pyplan import _core
from pyplan.problem import reference as ref
from pyplan.problem import build_problem
from pyplan.planfile import spec_from_text


def shape_problem(kind: str, devices: int):
    shared = "shared: {time: 1, memory: 0, backward: {time: 1, memory: 0}}" \
        if kind == "mshape" else ""
    text = (f"pyplan: 1\nname: bench\ndevices: {devices}\nmicro_batches: 1\n"
            f"training: {{backward: {{time_ratio: 3}}}}\n"
            f"shape: {{kind: {kind}, stage: {{time: 1, memory: 1}}, {shared}}}\n")
    return build_problem(spec_from_text(text))


def some_repetend(problem):
    """A valid (not necessarily good) repetend: indices fall by one every two blocks."""
    g = problem.graph
    order = g.topological_order()
    k = len(order)
    indices = [0] * k
    for pos, b in enumerate(order):
        indices[b] = (k - 1 - pos) // 2
    return _core.list_schedule_repetend(g, indices)


def rate(fn, budget: float) -> tuple[float, int]:
    """Calls per second of fn over about `budget` seconds (at least one call)."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget:
            return calls / elapsed, calls


def bench_evaluation(quick: bool) -> None:
    print("Schedule evaluation: C++ core vs Python reference (same schedule, same result)")
    print(f"{'shape':7} {'devices':>7} {'micro-batches':>13} {'blocks':>8} "
          f"{'C++ eval/s':>11} {'C++ blocks/s':>13} {'Python eval/s':>13} {'ratio':>7}")
    ratios, speeds = [], []
    for kind in ("vshape", "mshape"):
        for devices in (4, 8, 16, 32):
            n = 64 if devices <= 8 else (128 if devices == 16 else 256)
            problem = shape_problem(kind, devices)
            g = problem.graph
            rep = some_repetend(problem)
            orders = _core.periodic_orders(g, rep, n)
            blocks = [(b.time, b.memory, list(b.devices)) for b in problem.blocks]
            edges = list(problem.edges)
            fast = _core.evaluate(g, orders)
            slow = ref.evaluate(problem.num_devices, blocks, edges, orders)
            assert fast.ok and slow["ok"] and fast.makespan == slow["makespan"]
            count = fast.scheduled_blocks
            prepared = _core.Orders(orders)  # converted once, as the solver holds them
            cpp, _ = rate(lambda: _core.evaluate(g, prepared), 0.2 if quick else 1.0)
            py, _ = rate(lambda: ref.evaluate(problem.num_devices, blocks, edges, orders),
                         0.2 if quick else 1.0)
            ratios.append(cpp / py)
            speeds.append(cpp * count)
            print(f"{kind:7} {devices:>7} {n:>13} {count:>8} {cpp:>11.1f} {cpp * count:>13.3g} "
                  f"{py:>13.2f} {cpp / py:>6.0f}x")
    print(f"  minimum speed-up {min(ratios):.0f}x (target >= 50x); "
          f"minimum {min(speeds):.3g} evaluated blocks/s (target >= 1e6)")


def bench_enumeration(quick: bool) -> None:
    print("\nRepetend candidates (V-shape, f=1 b=3, N_R = devices): enumerated and evaluated")
    print(f"{'devices':>7} {'candidates/s':>13} {'evaluated/s':>12} {'seconds':>8}")
    for devices in (4, 8, 16, 32):
        problem = shape_problem("vshape", devices)
        g = problem.graph
        limit = 2_000 if quick else 20_000
        start = time.perf_counter()
        _, stats = _core.search_repetends(g, devices, -1, 0, 0, limit)
        elapsed = time.perf_counter() - start
        print(f"{devices:>7} {stats.enumerated / elapsed:>13.0f} "
              f"{stats.evaluated / elapsed:>12.0f} {elapsed:>8.2f}")
    print("\nRepetend enumeration, C++ vs the Python reference (brute force over N_R^K), same set:")
    for devices, nr in ((3, 4), (4, 4)):
        problem = shape_problem("vshape", devices)
        blocks = [(b.time, b.memory, list(b.devices)) for b in problem.blocks]
        found, py = timed(lambda: ref.enumerate_repetends(devices, blocks, list(problem.edges),
                                                          nr))
        cpp_list, fast = timed(lambda: list(_core.RepetendEnumerator(problem.graph, nr)))
        assert sorted(cpp_list) == sorted(found)
        print(f"  {devices} devices, N_R = {nr}: {len(found)} candidates; Python {py:.3f}s, "
              f"C++ {fast:.5f}s, ratio {py / fast:.0f}x")


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing windows")
    args = parser.parse_args()
    bench_evaluation(args.quick)
    bench_enumeration(args.quick)


if __name__ == "__main__":
    main()
