"""Transfers and recomputation in the cost model, side by side in one run:

  1. the transfer-aware search vs the same search blind to transfers (it solves the plan with
     every transfer time 0), both schedules evaluated with the transfers: on
     plans/transformer-2node.yaml (two nodes, a slow link between them) and on the same plan
     in one node;
  2. recompute: auto vs always (Megatron's full recomputation) and never, under the same
     memory: plans/gpt24-recompute.yaml (predicted makespans);
  3. predicted vs measured iteration time on 4 CPU gloo ranks: gpt24-recompute with auto and
     with always (its costs were measured on this machine), and the 2-node V-shape's 4-rank
     counterpart (the same transformer in 4 stages on two "nodes" of two ranks) with the costs
     and the link between two processes measured here first (pyplan profile --links).

    python benchmarks/costs.py [--rounds 5] [--iterations 6]

Measured times are medians over iterations (the first of each round a warm-up); a ratio is
taken within a round and printed as its median with the minimum and maximum over the rounds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from runtime import launch, print_ratio, print_times, run_rounds  # noqa: E402 - on sys.path

GPT_UNIT_MS = 0.03191  # plans/gpt24-recompute.yaml: topology.time_unit_ms


def aware_vs_blind(problem) -> tuple[int, int]:
    """Makespans with transfers of the transfer-aware schedule and of the blind one."""
    from pyplan.problem.schedule import schedule_from_orders
    from pyplan.solver import solve

    aware = solve(problem).schedule
    blind = solve(dataclasses.replace(problem, transfers=())).schedule
    return aware.makespan, schedule_from_orders(problem, blind.orders,
                                                problem.num_micro_batches).schedule.makespan


def with_recompute(text: str, mode: str) -> str:
    return text.replace("recompute: auto", f"recompute: {mode}")


def counterpart(directory: Path) -> tuple[str, float]:
    """The 2-node V-shape's 4-rank counterpart: plans/transformer-vshape.yaml's model in 4
    stages on two nodes of two ranks, with block costs and the link measured here."""
    from pyplan.problem import load_problem
    from pyplan.run.binding import load_model
    from pyplan.measure.links import measure_link
    from pyplan.measure.profile import profile_blocks

    problem = load_problem(ROOT / "plans" / "transformer-vshape.yaml")
    costs = profile_blocks(problem, load_model(problem, ROOT / "plans"), repeats=7)
    bandwidth, latency, _ = measure_link()
    unit = min(c.forward_ms for c in costs) / 4  # a few units per block: rounding stays small
    link = f"{{bandwidth: {bandwidth}B, latency_ms: {latency:.6g}}}"
    blocks = "\n".join(
        f"  - {{name: {c.name}, devices: [{i}], time: {max(1, round(c.forward_ms / unit))}, "
        f"memory: 1, output: {c.output_bytes}B, "
        f"backward: {{time: {max(1, round(c.backward_ms / unit))}}}}}"
        for i, c in enumerate(costs))
    text = (f"pyplan: 1\nname: transformer-2node-4ranks\ndevices: 4\nmemory: 8\n"
            f"micro_batches: 8\ntraining: {{backward: {{time_ratio: 2}}}}\n"
            f"topology: {{devices_per_node: 2, time_unit_ms: {unit:.6g}, within_node: {link}, "
            f"across_nodes: {link}}}\nblocks:\n{blocks}\n"
            "model: {blocks: 'pyplan.examples.transformer:build', "
            "data: 'pyplan.examples.transformer:batch', "
            "loss: 'pyplan.examples.transformer:loss'}\n")
    return text, unit


def _predicted(schedule, unit_ms: float) -> tuple[float, float]:
    """Milliseconds the schedule takes: on its devices, and when its ranks share this machine's
    cores (no faster than all its work spread over them)."""
    cores = min(os.cpu_count() or 1, schedule.problem.num_devices)
    return (schedule.makespan * unit_ms,
            max(schedule.makespan, sum(schedule.busy) / cores) * unit_ms)


def prepare(directory: Path) -> dict:
    from pyplan.problem import build_problem, load_problem
    from pyplan.resolved import write_resolved
    from pyplan.solver import solve
    from pyplan.planfile import spec_from_text

    info: dict = {"aware": {}, "recompute": {}, "predicted": {}}
    two_nodes = load_problem(ROOT / "plans" / "transformer-2node.yaml")
    text = (ROOT / "plans" / "transformer-2node.yaml").read_text()
    one_node = build_problem(spec_from_text(text.replace("  devices_per_node: 4\n", "")))
    for label, problem in (("two nodes (transformer-2node)", two_nodes),
                           ("one node (the same plan)", one_node)):
        info["aware"][label] = aware_vs_blind(problem)

    gpt = (ROOT / "plans" / "gpt24-recompute.yaml").read_text()
    for mode in ("never", "always", "auto"):
        plan = directory / f"gpt24-{mode}.yaml"
        plan.write_text(with_recompute(gpt, mode))
        solution = solve(build_problem(spec_from_text(plan.read_text(), str(plan))))
        write_resolved(solution, directory / f"gpt24-{mode}.resolved.yaml")
        info["recompute"][mode] = solution.schedule.makespan
        info["predicted"][f"gpt24-recompute, {mode}"] = _predicted(solution.schedule,
                                                                   GPT_UNIT_MS)

    text, unit = counterpart(directory)
    plan = directory / "counterpart.yaml"
    plan.write_text(text)
    solution = solve(build_problem(spec_from_text(text, str(plan))))
    write_resolved(solution, directory / "counterpart.resolved.yaml")
    problem = solution.schedule.problem
    info["predicted"]["2-node V-shape, 4-rank counterpart"] = _predicted(solution.schedule, unit)
    info["counterpart_transfers"] = sorted(set(problem.transfers))
    (directory / "info.json").write_text(json.dumps(info))
    return info


def worker(directory: Path, rounds: int) -> None:
    import pyplan.runtime  # noqa: F401 - quiet torch import
    import torch.distributed as dist
    from runtime import PyplanCase

    dist.init_process_group("gloo")
    info = json.loads((directory / "info.json").read_text())
    cases = [PyplanCase(f"gpt24-recompute, {mode}", directory / f"gpt24-{mode}.resolved.yaml",
                        blocking=False) for mode in ("always", "auto")]
    cases.append(PyplanCase("2-node V-shape, 4-rank counterpart",
                            directory / "counterpart.resolved.yaml", blocking=False))
    rounds_of = run_rounds(cases, rounds)
    if dist.get_rank() == 0:
        report(info, rounds_of)
    dist.destroy_process_group()


def report(info: dict, rounds_of: dict[str, list[float]]) -> None:
    print("1. transfer-aware vs blind search, both schedules timed with the transfers:")
    for label, (aware, blind) in info["aware"].items():
        print(f"  {label:36} aware {aware:6}  blind {blind:6}  ratio {blind / aware:.3f}x")
    r = info["recompute"]
    print("2. gpt24-recompute under 11MiB per device, predicted makespan (time units):")
    print(f"  never {r['never']}, always {r['always']}, auto {r['auto']}: auto vs always "
          f"{r['always'] / r['auto']:.3f}x, auto vs never {r['never'] / r['auto']:.3f}x")
    print("3. predicted vs measured on 4 CPU gloo ranks:")
    print_times(rounds_of, 40)
    print(f"  predicted: the makespan; and with 4 ranks sharing {os.cpu_count()} cores, no less "
          "than the work over the cores")
    for name, seconds in rounds_of.items():
        measured = statistics.median(seconds) * 1e3
        alone, shared = info["predicted"][name]
        print(f"  {name:36} predicted {alone:6.1f} / {shared:6.1f} ms  measured {measured:6.1f} "
              f"ms  measured / predicted {measured / alone:.2f} / {measured / shared:.2f}")
    print(f"  (the counterpart's transfer times: {info['counterpart_transfers']} units)")
    print_ratio(rounds_of, "  measured: recompute auto vs always (gpt24-recompute)",
                "gpt24-recompute, always", "gpt24-recompute, auto", width=58)


def main() -> int:
    return launch(__file__, __doc__.splitlines()[0], prepare, worker)


if __name__ == "__main__":
    raise SystemExit(main())
