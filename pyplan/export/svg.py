"""SVG timeline, like the papers' figures: one row per device, forward and backward blocks in
their colours numbered by micro-batch, a bar over each repetition of the repetend, and each
device's memory curve underneath (memory changes only when a block starts)."""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from pyplan.errors import PlanError
from pyplan.export._layout import device_chunks, memory_steps, repetitions, time_step
from pyplan.files import write_atomic
from pyplan.problem import BACKWARD, FORWARD, WEIGHT
from pyplan.problem.schedule import Schedule
from pyplan.planfile.units import count

__all__ = ["render_svg", "write_svg"]

# (fill, text colour) per kind; the second pair tells a device's second stage apart.
_COLOURS = {
    FORWARD: (("#4e79a7", "#fff"), ("#a0cbe8", "#000")),
    BACKWARD: (("#59a14f", "#fff"), ("#8cd17d", "#000")),
    WEIGHT: (("#b6992d", "#fff"), ("#f1ce63", "#000")),
    "other": (("#b07aa1", "#fff"), ("#d4a6c8", "#000")),
}
_NAMES = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight gradient", "other": "other"}
_LEFT, _RIGHT, _ROW, _GAP, _MEM = 86, 40, 24, 4, 40
_FONT = "font-family=\"Helvetica, Arial, sans-serif\""


MAX_WIDTH = 2_000_000  # pixels: wider pictures are refused (export chrome instead)
MAX_BLOCKS = 200_000  # blocks drawn


def _scale(makespan: int, step: int = 1) -> float:
    """Pixels per time unit: about 1100 px wide, but at least 4 px per step (the gcd of the
    block times, so that the shortest block is visible)."""
    return max(4.0 / step, min(32.0, 1100 / max(makespan, 1)))


def _tick(makespan: int, scale: float) -> int:
    for base in (1, 2, 5, 10, 20, 25, 50, 100, 200, 500):
        if base * scale >= 40:
            return base
    base = 1000
    while base * scale < 40:  # (1000, 2000, 5000, 10000, ...: labels about 40 px apart)
        for factor in (1, 2, 5):
            if base * factor * scale >= 40:
                return base * factor
        base *= 10
    return base


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def render_svg(schedule: Schedule) -> str:
    """The picture as an SVG document (deterministic: same schedule, same bytes)."""
    problem = schedule.problem
    scale = _scale(schedule.makespan, time_step(problem))
    blocks = sum(map(len, schedule.orders))
    if blocks > MAX_BLOCKS or _LEFT + schedule.makespan * scale > MAX_WIDTH:
        raise PlanError(f"the picture would draw {blocks:,} blocks over "
                        f"{schedule.makespan * scale:,.0f} pixels, more than svg draws "
                        f"({MAX_BLOCKS:,} blocks, {MAX_WIDTH:,} pixels)",
                        hint="export chrome (a trace viewer zooms), or solve fewer "
                        "micro-batches with --micro-batches")
    out = [f'<text x="{_LEFT}" y="18" font-size="14" font-weight="bold" {_FONT}>'
           f"{escape(problem.name)}: {count(problem.num_micro_batches, 'micro-batch')} on "
           f"{count(problem.num_devices, 'device')}, makespan {schedule.makespan}, bubble "
           f"{schedule.bubble_rate:.1%}</text>"]
    y: float = 30
    for section in (_repetitions, _devices, _syncs, _axis, _memory):
        y = section(out, schedule, y, scale)
    y = _legend(out, problem, y) + 8
    width = _LEFT + schedule.makespan * scale + _RIGHT
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_num(width)}" '
            f'height="{_num(y)}" viewBox="0 0 {_num(width)} {_num(y)}">\n'
            f"<title>{escape(problem.name)} schedule</title>\n"
            f'<rect width="100%" height="100%" fill="#fff"/>\n')
    return head + "\n".join(out) + "\n</svg>\n"


def _repetitions(out: list[str], schedule: Schedule, y: float, scale: float) -> float:
    """A bar over each repetition, in two lanes: consecutive ones overlap (compaction)."""
    spans = repetitions(schedule)
    if not spans:
        return y
    rep = schedule.repetend
    out.append(f'<text x="{_LEFT - 6}" y="{y + 12}" font-size="11" text-anchor="end" '
               f'{_FONT}>repetend</text>')
    for j, (start, end) in enumerate(spans):
        colour = "#f28e2b" if j % 2 == 0 else "#ffbe7d"
        out.append(f'<rect class="repetition" x="{_num(_LEFT + start * scale)}" '
                   f'y="{y + (j % 2) * 9}" width="{_num((end - start) * scale)}" height="7" '
                   f'rx="2" fill="{colour}"><title>repetition {j + 1} of {len(spans)}: '
                   f"t={start}..{end} (period {rep.period}, {rep.num_micro_batches} "
                   "micro-batches)</title></rect>")
    return y + 24


def _devices(out: list[str], schedule: Schedule, y: float, scale: float) -> float:
    """One row per device; a block on several devices is drawn on each (dashed outline)."""
    problem = schedule.problem
    chunks = device_chunks(problem)
    for d in range(problem.num_devices):
        row = y + d * (_ROW + _GAP)
        out.append(f'<text x="{_LEFT - 6}" y="{row + _ROW / 2 + 4}" font-size="12" '
                   f'text-anchor="end" {_FONT}>device {d}</text>')
        out.append(f'<rect x="{_LEFT}" y="{row}" width="{_num(schedule.makespan * scale)}" '
                   f'height="{_ROW}" fill="#f4f4f4"/>')
        for b, m, start, end in schedule.entries(d):
            block = problem.blocks[b]
            kind = block.kind if block.kind in _COLOURS else "other"
            fill, ink = _COLOURS[kind][chunks[(d, b)] % 2]
            shared = len(block.devices) > 1
            w = (end - start) * scale
            out.append(
                f'<rect class="block {kind}{" shared" if shared else ""}" data-device="{d}" '
                f'data-block={quoteattr(block.name)} data-mb="{m}" '
                f'x="{_num(_LEFT + start * scale)}" y="{row}" width="{_num(w)}" '
                f'height="{_ROW}" fill="{fill}" stroke="#fff" '
                f'stroke-width="{1 if scale >= 6 else 0.5}"'
                + (' stroke-dasharray="3 2"' if shared else "")
                + f"><title>{escape(block.name)}@{m} on device {d}: t={start}..{end}, memory "
                f"{block.memory:+d}</title></rect>")
            if w >= 7 * len(str(m)) + 3:  # the number only where it fits
                out.append(f'<text x="{_num(_LEFT + (start + end) / 2 * scale)}" '
                           f'y="{row + _ROW / 2 + 4}" font-size="11" text-anchor="middle" '
                           f'fill="{ink}" pointer-events="none" {_FONT}>{m}</text>')
    return y + problem.num_devices * (_ROW + _GAP)


def _syncs(out: list[str], schedule: Schedule, y: float, scale: float) -> float:
    """Gradient synchronisations across data-parallel replicas: a thin lane per device under
    the devices (they run beside the compute, on their own stream)."""
    if not schedule.syncs:
        return y
    problem = schedule.problem
    for d in range(problem.num_devices):
        lane = y + d * 12
        out.append(f'<text x="{_LEFT - 6}" y="{lane + 9}" font-size="10" text-anchor="end" '
                   f'{_FONT}>sync {d}</text>')
        for x in (x for x in schedule.syncs if x.device == d):
            name = problem.blocks[x.layer].name
            out.append(f'<rect class="sync" data-device="{d}" data-block={quoteattr(name)} '
                       f'x="{_num(_LEFT + x.start * scale)}" y="{lane}" '
                       f'width="{_num((x.end - x.start) * scale)}" height="9" fill="#9c755f">'
                       f"<title>{escape(name)} gradients across {problem.mesh.data} replicas "
                       f"on device {d}: t={x.start}..{x.end}</title></rect>")
    return y + problem.num_devices * 12 + 4


def _axis(out: list[str], schedule: Schedule, y: float, scale: float) -> float:
    makespan = schedule.makespan
    tick = _tick(makespan, scale)
    right = _num(_LEFT + makespan * scale)
    out.append(f'<line x1="{_LEFT}" y1="{y}" x2="{right}" y2="{y}" stroke="#888"/>')
    for t in list(range(0, makespan, tick)) + [makespan]:
        x = _num(_LEFT + t * scale)
        out.append(f'<line x1="{x}" y1="{y}" x2="{x}" y2="{y + 4}" stroke="#888"/>')
        if t == makespan or makespan - t >= tick / 2:  # keep the last tick's label clear
            out.append(f'<text x="{x}" y="{y + 15}" font-size="10" text-anchor="middle" '
                       f'fill="#555" {_FONT}>{t}</text>')
    return y + 30


def _memory(out: list[str], schedule: Schedule, y: float, scale: float) -> float:
    """One step curve per device, on a shared scale, with the capacity as a dashed line."""
    problem = schedule.problem
    show = problem.show_memory
    curves = [memory_steps(schedule, d) for d in range(problem.num_devices)]
    low = min(min(level for _, level in c) for c in curves)
    high = max([max(level for _, level in c) for c in curves] +
               [c or 0 for c in problem.capacities] + [1])
    span = max(high - min(low, 0), 1)
    shown = escape(problem.show_capacity()) if problem.limited else ""
    speeds = f", speeds {escape(problem.show_speeds())}" if problem.show_speeds() else ""
    out.append(f'<text x="{_LEFT}" y="{y}" font-size="12" font-weight="bold" {_FONT}>memory '
               f"per device" + (f" (capacity {shown}{speeds})" if shown else
                                f" ({speeds[2:]})" if speeds else "") + "</text>")
    y += 8
    for d, steps in enumerate(curves):
        base = y + _MEM

        def level_y(v: int, base: float = base) -> str:
            return _num(base - (v - min(low, 0)) / span * _MEM)

        points = []
        for i, (t, level) in enumerate(steps):
            if i:
                points.append(f"{_num(_LEFT + t * scale)},{level_y(steps[i - 1][1])}")
            points.append(f"{_num(_LEFT + t * scale)},{level_y(level)}")
        points.append(f"{_num(_LEFT + schedule.makespan * scale)},{level_y(steps[-1][1])}")
        peak, capacity = schedule.peak_memory[d], problem.capacity_of(d)
        out.append(f'<text x="{_LEFT - 6}" y="{base - _MEM / 2 + 4}" font-size="11" '
                   f'text-anchor="end" {_FONT}>device {d}</text>')
        out.append(f'<rect x="{_LEFT}" y="{y}" width="{_num(schedule.makespan * scale)}" '
                   f'height="{_MEM}" fill="#fafafa" stroke="#ddd"/>')
        if capacity is not None:
            out.append(f'<line class="capacity" x1="{_LEFT}" y1="{level_y(capacity)}" '
                       f'x2="{_num(_LEFT + schedule.makespan * scale)}" '
                       f'y2="{level_y(capacity)}" stroke="#e15759" stroke-dasharray="4 3"/>')
        out.append(f'<polyline class="memory" data-device="{d}" points="{" ".join(points)}" '
                   f'fill="none" stroke="#4e79a7" stroke-width="1.5"><title>device {d}: peak '
                   f"{escape(show(peak))}" + (f" of {escape(show(capacity))}"
                                              if capacity is not None else "")
                   + "</title></polyline>")
        out.append(f'<text x="{_num(_LEFT + schedule.makespan * scale + 4)}" '
                   f'y="{base - _MEM / 2 + 4}" font-size="10" fill="#555" {_FONT}>'
                   f"{escape(show(peak))}</text>")
        y += _MEM + 8
    return y + 6


def _legend(out: list[str], problem, y: float) -> float:
    kinds = [k for k in (FORWARD, BACKWARD, WEIGHT, "other")
             if any((b.kind if b.kind in _COLOURS else "other") == k for b in problem.blocks)]
    x = _LEFT
    for kind in kinds:
        name = "input gradient" if kind == BACKWARD and WEIGHT in kinds else _NAMES[kind]
        out.append(f'<rect x="{x}" y="{y}" width="14" height="14" '
                   f'fill="{_COLOURS[kind][0][0]}"/>')
        out.append(f'<text x="{x + 18}" y="{y + 11}" font-size="11" {_FONT}>{name}</text>')
        x += 30 + 6.5 * len(name)
    notes = "numbers are micro-batches"
    if max(device_chunks(problem).values(), default=0):
        notes += "; lighter: every other stage on a device"
    if any(len(b.devices) > 1 for b in problem.blocks):
        notes += "; dashed: a block on several devices at once"
    out.append(f'<text x="{x}" y="{y + 11}" font-size="11" fill="#555" {_FONT}>{notes}</text>')
    return y + 20


def write_svg(path: str | Path, schedule: Schedule) -> None:
    write_atomic(path, render_svg(schedule))
