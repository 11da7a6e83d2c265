"""The link between two processes on this machine (gloo over loopback, CPU tensors): the
figures behind pyplan's CPU-class default link (pyplan.planfile.types.CPU_LINK), which
`pyplan partition --device cpu` writes into a plan's topology when it does not measure the link
itself (--links).

    python benchmarks/links.py [--rounds 5] [--quick]

Each round is one `measure_link("cpu")` (pyplan.measure.links: two processes play ping-pong
with tensors of 1 KiB to 16 MiB, seven times each, the fastest counts; the two largest sizes
give the bandwidth, the smallest the latency). Printed: each round's bandwidth and latency,
their medians and ranges, the median time per size beside what the default links (the CPU
one and a GPU node's) predict for it, and the ratio of the two defaults' times.
"""

from __future__ import annotations

import argparse
import statistics

from pyplan.measure.links import SIZES, measure_link
from pyplan.planfile.types import CPU_LINK, TopologySpec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="measurements (default 5)")
    parser.add_argument("--quick", action="store_true", help="two rounds of three repeats")
    args = parser.parse_args()
    rounds, repeats = (2, 3) if args.quick else (args.rounds, 7)
    found = []
    for k in range(rounds):
        bandwidth, latency, times = measure_link("cpu", repeats=repeats)
        found.append((bandwidth, latency, times))
        print(f"round {k}: bandwidth {bandwidth / 1e9:.2f} GB/s, latency {latency:.4f} ms")
    bandwidths = [f[0] for f in found]
    latencies = [f[1] for f in found]
    print(f"gloo between two local processes, {rounds} rounds: bandwidth median "
          f"{statistics.median(bandwidths) / 1e9:.2f} GB/s ({min(bandwidths) / 1e9:.2f}-"
          f"{max(bandwidths) / 1e9:.2f}), latency median {statistics.median(latencies):.4f} ms "
          f"({min(latencies):.4f}-{max(latencies):.4f})")
    gpu = TopologySpec().within_node
    print(f"{'bytes':>10} {'measured ms':>12} {'CPU default':>12} {'GPU default':>12}")
    for i, size in enumerate(SIZES):
        measured = statistics.median(f[2][i] for f in found)
        print(f"{size:>10} {measured:>12.4f} {CPU_LINK.milliseconds(size):>12.4f} "
              f"{gpu.milliseconds(size):>12.4f}")
    print(f"the defaults now: CPU {CPU_LINK.bandwidth / 1e9:.2f} GB/s + {CPU_LINK.latency_ms} "
          f"ms, GPU node {gpu.bandwidth / 1e9:.0f} GB/s + {gpu.latency_ms} ms; a 16 MiB "
          f"transfer takes {CPU_LINK.milliseconds(SIZES[-1]) / gpu.milliseconds(SIZES[-1]):.0f}x "
          "as long on the CPU default")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
