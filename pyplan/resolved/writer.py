"""Writing a resolved plan: the canonical text of a Solution, ended by its seal (pyplan.resolved.seal).

Deterministic: the same solution gives the same bytes, and every value reads back as itself.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pyplan._version import __version__
from pyplan.resolved.seal import seal_lines
from pyplan.errors import PlanError
from pyplan.files import check_not_input, write_atomic
from pyplan.problem.ir import Problem
from pyplan.problem.schedule import Schedule

if TYPE_CHECKING:
    from pyplan.solver import Solution

__all__ = ["FORMAT", "format_rate", "render_resolved", "write_resolved"]

FORMAT = 1


def _flow(items) -> str:
    return "[" + ", ".join(str(x) for x in items) + "]"


def _entry(problem: Problem, schedule: Schedule, block: int, mb: int, shown_mb: int) -> str:
    return f"{problem.blocks[block].name}@{shown_mb} {schedule.start_of(block, mb)}"


def format_rate(x: float) -> str:
    return f"{x:.4f}"


def _float(x: float) -> str:
    """A float as YAML reads it back: repr, with a decimal point before an exponent (YAML 1.1
    reads 1e-300 as a string)."""
    text = repr(float(x))
    return text.replace("e", ".0e", 1) if "e" in text and "." not in text else text


_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./@-]*")
_STR = "tag:yaml.org,2002:str"


def _scalar(text: str) -> str:
    """A string as YAML reads it back: plain when it reads as itself (not as a number, true,
    null or a date), double-quoted otherwise."""
    if _PLAIN.fullmatch(text) and \
            yaml.SafeLoader.resolve(yaml.SafeLoader, yaml.ScalarNode, text, (True, False)) == _STR:
        return text
    return _quoted(text)


def _quoted(text: str) -> str:
    """A double-quoted YAML string: JSON's escapes, and escapes for the characters YAML does
    not allow in a file or reads as line breaks (other controls, U+2028/9, surrogates of
    undecodable file names, the byte order mark, U+FFFE/F)."""
    out = []
    for ch in json.dumps(text, ensure_ascii=False):
        code = ord(ch)
        if 0x7F <= code <= 0x9F or 0xD800 <= code <= 0xDFFF or \
                code in (0x2028, 0x2029, 0xFEFF, 0xFFFE, 0xFFFF):
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def render_resolved(solution: Solution, plan_rel: str | None) -> str:
    """The resolved plan text for a Solution (deterministic: same solution, same bytes)."""
    schedule: Schedule = solution.schedule
    problem = schedule.problem
    n = problem.num_micro_batches
    rep = schedule.repetend
    lines = [
        f"# Resolved by pyplan {__version__} from {plan_rel or 'a plan'}; do not edit, re-run "
        "`pyplan solve`.",
        "# Entries are \"block@micro-batch start\": each device runs its entries in order, each",
        "# block as early as its inputs, devices and order allow.",
        f"pyplan_resolved: {FORMAT}",
        f"plan: {_scalar(plan_rel)}" if plan_rel else "plan: null",
        f"spec_sha256: {problem.spec_sha256}",
        f"name: {_scalar(problem.name)}",
        f"task: {'training' if problem.training else 'inference'}",
        f"devices: {problem.num_devices}",
        f"micro_batches: {n}",
        f"memory: {'null' if problem.memory_capacity is None else problem.memory_capacity}",
        f"memory_unit: {'bytes' if problem.memory_is_size else 'plan'}",
    ]
    if problem.device_memory:  # devices that differ (the block times include their speeds)
        lines.append("device_memory: [" + ", ".join("null" if c is None else str(c)
                                                    for c in problem.device_memory) + "]")
    if problem.device_speed:
        lines.append("device_speed: [" + ", ".join(repr(s) for s in problem.device_speed) + "]")
    lines += [
        "blocks:",
    ]
    for b in problem.blocks:
        extra = f", weights: {b.weights}" if b.weights else ""
        extra += f", workspace: {b.workspace}" if b.workspace else ""
        extra += f", update: {b.update}" if b.update else ""
        if b.recompute != "never":  # times and memory below already include the choice
            extra += (f", recompute: {b.recompute}, recompute_memory: {b.recompute_memory}, "
                      f"recomputed: {'true' if b.recomputed else 'false'}")
            extra += f", rematerialised: {b.rematerialised}" if b.recomputed else ""
        lines.append(f"  - {{name: {_scalar(b.name)}, kind: {b.kind}, time: {b.time}, "
                     f"memory: {b.memory}{extra}, devices: {_flow(b.devices)}}}")
    lines.append("dependencies:" if problem.edges else "dependencies: []")
    for e in problem.edges:
        delay = problem.transfer.get(e)
        lines.append(f"  - [{_scalar(problem.blocks[e[0]].name)}, "
                     f"{_scalar(problem.blocks[e[1]].name)}"
                     + (f", {delay}]" if delay else "]"))
    if problem.rules:
        lines.append("order_rules:")
        for r in problem.rules:
            lines.append(f"  - {_quoted(r.text)}")
    if problem.model is not None:
        m = problem.model
        builder = (f"blocks: {_quoted(m.blocks)}" if m.blocks is not None else
                   f"module: {_quoted(m.module)}, stages: {{" +
                   ", ".join(f"{_scalar(name)}: [{', '.join(_quoted(u) for u in units)}]"
                             for name, units in m.stages) + "}"
                   + (f", cut: {m.cut}" if m.cut != "chain" else "")
                   + (f", layer_returns: {m.layer_returns}" if m.layer_returns != "tensor" else "")
                   + ("" if m.ties is None else ", ties: [" + ", ".join(
                       f"{{parameter: {_quoted(p)}, stages: [{', '.join(map(_scalar, st))}]}}"
                       for p, st in m.ties) + "]")
                   + ("" if m.vocab_parallel is None else
                      f", vocab_parallel: {{embedding: {_quoted(m.vocab_parallel[0])}, "
                      f"head: {_quoted(m.vocab_parallel[1])}}}")
                   + ("" if m.weights is None else f", weights: {_quoted(m.weights)}")
                   + ("" if m.optimizer is None else f", optimizer: {m.optimizer}"))
        lines.append(f"model: {{{builder}, data: {_quoted(m.data)}, loss: {_quoted(m.loss)}"
                     + (f", path: {_quoted(m.path)}" if m.path else "") + "}")
    if problem.time_unit_ms is not None:
        lines.append(f"time_unit_ms: {_float(problem.time_unit_ms)}")
    mesh = problem.mesh
    if mesh.data_parallel > 1 or mesh.tensor > 1:
        shard = str(mesh.shard).lower() if type(mesh.shard) is bool else mesh.shard
        plan = ", ".join(f"{_quoted(k)}: {v}" for k, v in mesh.tensor_plan)
        lines.append(f"mesh: {{data: {mesh.data}, shard: {shard}, sync: {mesh.sync}"
                     + (f", tensor: {mesh.tensor}, priced: {mesh.priced}"
                        if mesh.tensor > 1 else "")
                     + (", sequence: false" if mesh.tensor > 1 and not mesh.sequence else "")
                     + (f", tensor_plan: {{{plan}}}" if plan else "") + "}")
    lines += [
        f"status: {solution.status}",
        f"origin: {solution.origin}",
        f"makespan: {schedule.makespan}",
        f"lower_bound: {solution.lower_bound}",
        f"bubble_rate: {format_rate(schedule.bubble_rate)}",
        f"peak_memory: {_flow(schedule.peak_memory)}",
    ]
    if rep is None:
        lines.append("repetend: null")
    else:
        start, end = schedule.repetend_window()
        lines += [
            "repetend:",
            f"  micro_batches: {rep.num_micro_batches}",
            f"  period: {rep.period}",
            f"  period_lower_bound: {solution.period_bound}",
            f"  period_status: {solution.period_status}",
            f"  bubble_rate: {format_rate(rep.bubble_rate)}",
            f"  indices: {_flow(rep.indices)}",
            f"  count: {schedule.repetend_count}",
            f"  start: {start}",
            f"  end: {end}",
        ]
    lines.append("schedule:")
    shift = n - (rep.num_micro_batches if rep else 0)
    parts = [("warmup", schedule.warmup, 0)]
    if rep is not None:
        parts.append(("repetend", tuple(tuple((b, rep.indices[b]) for b in order)
                                        for order in rep.orders), 0))
        parts.append(("cooldown", schedule.cooldown, shift))
    for title, orders, offset in parts:
        lines.append(f"  {title}:")
        for d, order in enumerate(orders):
            if not order:
                lines.append(f"    {d}: []")
                continue
            lines.append(f"    {d}:")
            for b, m in order:
                shown = m - n + offset if title == "cooldown" else m
                lines.append(f"      - {_entry(problem, schedule, b, m + offset, shown)}")
    if schedule.syncs:
        lines.append("gradient_syncs:  # \"stage start\" per device, in order")
        for d in range(problem.num_devices):
            lines.append(f"  {d}:")
            lines += [f"    - {problem.blocks[x.layer].name} {x.start}"
                      for x in schedule.syncs if x.device == d]
    lines.append("baselines:" if solution.baselines else "baselines: {}")
    for name, base in solution.baselines.items():
        if not base.applicable:
            lines.append(f"  {name}: {_quoted(f'not applicable: {base.reason}')}")
            continue
        extra = "" if base.fits_memory else f", exceeds_memory: {max(base.peak_memory)}"
        lines.append(f"  {name}: {{makespan: {base.makespan}, bubble_rate: "
                     f"{format_rate(base.bubble_rate)}{extra}}}")
    text = "\n".join(lines) + "\n"
    return text + "\n".join(seal_lines(text)) + "\n"


def write_resolved(solution: Solution, out_path: str | Path) -> Path:
    """Write atomically; the plan path inside is relative to the output file."""
    out = Path(out_path)
    source = solution.schedule.problem.source_path
    if source and Path(source).is_file():
        check_not_input(out, source)  # the plan is the user's; its resolved plan is derived
    plan_rel = None
    if source and Path(source).is_file():  # a plan given as text has no file to point at
        try:
            plan_rel = Path(os.path.relpath(Path(source).resolve(),
                                            out.resolve().parent)).as_posix()
        except ValueError:
            plan_rel = Path(source).resolve().as_posix()
        try:
            plan_rel.encode("utf-8")
        except UnicodeEncodeError:  # bytes the file system could not decode
            raise PlanError(f"the path of the plan, {plan_rel!r}, is not UTF-8 text, so the "
                            "resolved plan cannot record it", hint="rename the plan file",
                            file=str(source)) from None
    write_atomic(out, render_resolved(solution, plan_rel))
    return out
