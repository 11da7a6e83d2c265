"""`pyplan plan`'s cost model against runs that really happened (../shared/cluster/*.csv, or
PYPLAN_CLUSTER_DATA): each row's layout predicted on a DGX A100 cluster and set beside what was
measured.

- narayanan_sc21.csv (Megatron-LM, fp16, full recomputation, up to 3,072 A100s): iteration
  time, measured / predicted.
- zero_bubble.csv (pure pipelines on 8-32 A100s, four schedules): throughput per GPU and peak
  memory per schedule, and whether the measured order of the schedules is reproduced.
- zero_bubble_stage_times.csv: the measured F, B, W of one stage against the cost model's.

Prints every row, the mean and largest error of each table, and the Spearman rank correlation
of predicted and measured throughput over the zero bubble paper's layouts. `--fit` refits the
cost model's fitted constants (pyplan/cluster/constants.py) on these rows by least squares and
prints them; it changes nothing on disk.

    python benchmarks/cluster.py [--data DIR] [--fit]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyplan.cluster import constants  # noqa: E402
from pyplan.cluster.costs import Costs  # noqa: E402
from pyplan.cluster.hardware import load_cluster  # noqa: E402
from pyplan.cluster.layout import Batch, Layout  # noqa: E402
from pyplan.cluster.model import gpt  # noqa: E402
from pyplan.cluster.pipeline import chunks, price, split_layers  # noqa: E402

DATA = Path(os.environ.get("PYPLAN_CLUSTER_DATA") or
            Path(__file__).resolve().parent.parent.parent / "shared" / "cluster")
ZB_SCHEDULES = (("1f1b", "1f1b", 1), ("interleaved_1f1b", "interleaved-1f1b", 2),
                ("zb_1p", "zb-h1", 1), ("zb_2p", "zb-2p", 1))


def rows(name: str) -> list[dict]:
    with open(DATA / name, newline="") as f:
        lines = [line for line in f if line.strip() and not line.startswith("#")]
    return list(csv.DictReader(lines))


def a100(gpus: int, gpu_changes: dict | None = None):
    cluster = load_cluster("dgx-a100-80gb")
    gpu = replace(cluster.gpu, **(gpu_changes or {}))
    return replace(cluster, gpu=gpu, nodes=max(1, -(-gpus // cluster.gpus_per_node)))


def ends_lighter(layers: int, stages: int) -> tuple[int, ...]:
    """The zero bubble paper's split: the first and last stages hold one layer fewer (where
    the stages hold more than one), what does not divide going to the middle stages."""
    lighter = (layers + 2) // stages >= 2
    base, extra = divmod(layers + (2 if lighter else 0), stages)
    counts = [base] * stages
    if lighter:
        counts[0] -= 1
        counts[-1] -= 1
    for s in range(extra):
        counts[1 + s % (stages - 2)] += 1
    return tuple(counts)


def narayanan(gpu: dict | None = None) -> list[tuple]:
    out = []
    for r in rows("narayanan_sc21.csv"):
        layers, h, a, tp, pp, vpp, gpus, B, mb = (int(r[k]) for k in (
            "layers", "hidden", "heads", "tp", "pp", "vpp", "gpus", "global_batch",
            "micro_batch"))
        dp = gpus // (tp * pp)
        model = gpt(layers, h, a, vocab=51200, sequence=2048)
        layout = Layout(tp, pp, dp, vpp, mb, "full", False,
                        "1f1b" if vpp == 1 else "interleaved-1f1b", False)
        batch = Batch(B, 2048, "fp16", flash_attention=False)
        cluster = a100(gpus, gpu)
        counts = (layers // (pp * vpp),) * (pp * vpp)
        priced = price(chunks(model, cluster, layout, batch, counts), layout,
                       layout.micro_batches(batch), cluster.gpu.memory_bytes)
        out.append((r["model"], layout, float(r["iteration_seconds"]), priced))
    return out


def zero_bubble(gpu: dict | None = None) -> list[tuple]:
    out = []
    for r in rows("zero_bubble.csv"):
        layers, h, a, gpus, mb, m = (int(r[k]) for k in ("layers", "hidden", "heads", "gpus",
                                                        "micro_batch", "m"))
        model = gpt(layers, h, a, vocab=51200, sequence=1024)
        cluster = a100(gpus, gpu)
        batch = Batch(m * mb, 1024, "fp16", flash_attention=False)
        for column, schedule, vpp in ZB_SCHEDULES:
            layout = Layout(1, gpus, 1, vpp, mb, "none", False, schedule, False)
            # One chunk per GPU: the paper's split; interleaved: the planner's balance.
            counts = ends_lighter(layers, gpus) if vpp == 1 else \
                split_layers(model, gpus * vpp, Costs(model, cluster, layout, batch))
            priced = price(chunks(model, cluster, layout, batch, counts), layout, m,
                           cluster.gpu.memory_bytes)
            throughput = m * mb / priced.seconds / gpus
            out.append((f"{r['model']} m={m}", schedule, float(r[f"s_{column}"]),
                        throughput, float(r[f"mem_{column}"]),
                        max(priced.peak_bytes) / 1e9 + cluster.gpu.reserved_gib * 2**30 / 1e9))
    return out


def stage_times(gpu: dict | None = None) -> list[tuple]:
    shapes = {r["model"]: r for r in rows("zero_bubble.csv")}
    out = []
    for r in rows("zero_bubble_stage_times.csv"):
        shape = shapes[r["model"]]
        layers, h, a, mb = (int(shape[k]) for k in ("layers", "hidden", "heads", "micro_batch"))
        pp = int(r["pp"])
        model = gpt(layers, h, a, vocab=51200, sequence=1024)
        cluster = a100(pp, gpu)
        layout = Layout(1, pp, 1, 1, mb, "none", False, "zb-h1", False)
        costs = Costs(model, cluster, layout, Batch(mb, 1024, "fp16", flash_attention=False))
        per_stage = max(ends_lighter(layers, pp))  # the measured stage: a middle one
        layer = costs.layer(False)
        predicted = [x.seconds * per_stage * 1e3 for x in
                     (layer.forward, layer.backward, layer.weight)]
        measured = [float(r[k]) for k in ("t_f", "t_b", "t_w")]
        out.append((r["model"], measured, predicted))
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = rank
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def report(gpu: dict | None = None) -> dict:
    started = time.perf_counter()
    print("Megatron-LM, Narayanan et al. SC21 (DGX A100, fp16, full recompute): iteration "
          "seconds")
    errors, fit = [], 0
    capacity = a100(1).gpu.memory_bytes - a100(1).gpu.reserved_gib * 2**30
    for name, layout, measured, priced in narayanan(gpu):
        error = priced.seconds / measured - 1
        errors.append(error)
        fit += max(priced.peak_bytes) <= capacity
        print(f"  {name:>7}  {layout.describe():<64} measured {measured:6.1f}  predicted "
              f"{priced.seconds:6.2f}  {error:+6.1%}")
    nar = _summary("  iteration time", errors)
    print(f"  predicted to fit in the GPU's memory, as they ran: {fit} of {len(errors)}")

    print("\nZero bubble (Qi et al. 2024), pure pipelines on 8-32 A100s: samples/s/GPU and "
          "peak GB")
    zb = zero_bubble(gpu)
    t_errors, m_errors, order_kept, cases = [], [], 0, 0
    for case, group in itertools.groupby(zb, key=lambda x: x[0]):
        group = list(group)
        line = []
        for _, schedule, measured, predicted, mem_measured, mem_predicted in group:
            t_errors.append(predicted / measured - 1)
            m_errors.append(mem_predicted / mem_measured - 1)
            line.append(f"{schedule} {measured:.2f}/{predicted:.2f} "
                        f"({predicted / measured - 1:+.0%}, mem {mem_measured:.0f}/"
                        f"{mem_predicted:.0f})")
        measured_order = sorted(range(4), key=lambda i: group[i][2])
        predicted_order = sorted(range(4), key=lambda i: group[i][3])
        cases += 1
        order_kept += measured_order == predicted_order
        print(f"  {case:<13} " + "; ".join(line) +
              ("" if measured_order == predicted_order else "  [order differs]"))
    zbt = _summary("  throughput", t_errors)
    zbm = _summary("  peak memory", m_errors)
    zb_fit = sum(x[5] * 1e9 <= a100(1).gpu.memory_bytes for x in zb)
    print(f"  predicted to fit in the GPU's memory, as they ran: {zb_fit} of {len(zb)}")
    rho = spearman([x[2] for x in zb], [x[3] for x in zb])
    print(f"  schedule order (measured) reproduced in {order_kept} of {cases} cases; Spearman "
          f"rank correlation of throughput over all {len(zb)} layouts: {rho:.3f}")

    print("\nZero bubble, measured per-stage F / B / W (ms) against the cost model")
    s_errors = []
    for name, measured, predicted in stage_times(gpu):
        parts = []
        for what, m, p in zip("FBW", measured, predicted):
            s_errors.append(p / m - 1)
            parts.append(f"{what} {m:.2f}/{p:.2f} ({p / m - 1:+.0%})")
        print(f"  {name:>6}  " + ", ".join(parts))
    st = _summary("  stage times", s_errors)
    print(f"\n({time.perf_counter() - started:.1f} s)")
    return {"narayanan": nar, "zb_throughput": zbt, "zb_memory": zbm, "stages": st,
            "spearman": rho, "order": (order_kept, cases),
            "fit": (fit + zb_fit, len(errors) + len(zb))}


def _summary(what: str, errors: list[float]) -> tuple[float, float]:
    mean = sum(abs(e) for e in errors) / len(errors)
    worst = max(errors, key=abs)
    print(f"{what}: mean error {mean:.1%}, max {worst:+.1%} ({len(errors)} rows)")
    return mean, abs(worst)


def fit() -> None:
    """Least squares over a grid of the fitted constants: stage times and iteration times."""
    best = None
    for mm in (0.77, 0.78, 0.79, 0.80, 0.81):
        for mem in (0.35, 0.40, 0.45, 0.50, 0.55, 0.60):
            for back in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
                constants.BACKWARD_ELEMENTWISE = back
                gpu = {"matmul_efficiency": mm, "memory_efficiency": mem}
                errors = [p / m - 1 for _, ms, ps in stage_times(gpu) for m, p in zip(ms, ps)]
                errors += [p.seconds / m - 1 for _, _, m, p in narayanan(gpu)]
                score = sum(e * e for e in errors)
                if best is None or score < best[0]:
                    best = (score, mm, mem, back)
    score, mm, mem, back = best
    print(f"fitted: MATMUL_EFFICIENCY {mm}, MEMORY_EFFICIENCY {mem}, BACKWARD_ELEMENTWISE "
          f"{back} (rms relative error {(score / 22) ** 0.5:.1%})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="folder of the CSV files (default ../shared/cluster)")
    parser.add_argument("--fit", action="store_true", help="refit the fitted constants")
    args = parser.parse_args(argv)
    global DATA
    if args.data:
        DATA = Path(args.data)
    if args.fit:
        fit()
        return 0
    report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
