"""SVG timeline, like the papers' figures: one row per device, forward and backward blocks in
their colours numbered by micro-batch, a bar over each repetition of the repetend, and each
device's memory curve underneath (memory changes only when a block starts)."""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from pyplan.export._layout import device_chunks, memory_steps, repetitions
from pyplan.fileio import write_atomic
from pyplan.problem import BACKWARD, FORWARD, WEIGHT
from pyplan.schedule import Schedule

__all__ = ["render_svg", "write_svg"]

# (fill, text colour) per kind; the second pair tells a device's second stage apart.
_COLOURS = {
    FORWARD: (("#4e79a7", "#fff"), ("#a0cbe8", "#000")),
    BACKWARD: (("#59a14f", "#fff"), ("#8cd17d", "#000")),
    WEIGHT: (("#b6992d", "#fff"), ("#f1ce63", "#000")),
    "other": (("#b07aa1", "#fff"), ("#d4a6c8", "#000")),
}
_NAMES = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight gradient", "other": "other"}
_LEFT, _RIGHT, _ROW, _GAP, _MEM = 86, 24, 24, 4, 40
_FONT = "font-family=\"Helvetica, Arial, sans-serif\""


def _scale(makespan: int) -> float:
    """Pixels per time unit: about 1100 px wide, but at least 4 px per unit."""
    return max(4.0, min(32.0, 1100 / max(makespan, 1)))


def _tick(makespan: int, scale: float) -> int:
    for base in (1, 2, 5, 10, 20, 25, 50, 100, 200, 500, 1000, 2000, 5000, 10000):
        if base * scale >= 40:
            return base
    return makespan


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def render_svg(schedule: Schedule) -> str:
    """The picture as an SVG document (deterministic: same schedule, same bytes)."""
    problem = schedule.problem
    D, makespan = problem.num_devices, schedule.makespan
    scale = _scale(makespan)
    width = _LEFT + makespan * scale + _RIGHT
    x = lambda t: _num(_LEFT + t * scale)  # noqa: E731
    out: list[str] = []

    out.append(f'<text x="{_LEFT}" y="18" font-size="14" font-weight="bold" {_FONT}>'
               f"{escape(problem.name)}: {problem.num_micro_batches} micro-batches on {D} "
               f"devices, makespan {makespan}, bubble {schedule.bubble_rate:.1%}</text>")

    # Repetition bars in two lanes: consecutive repetitions overlap (compaction).
    y = 30
    spans = repetitions(schedule)
    if spans:
        rep = schedule.repetend
        out.append(f'<text x="{_LEFT - 6}" y="{y + 12}" font-size="11" text-anchor="end" '
                   f'{_FONT}>repetend</text>')
        for j, (start, end) in enumerate(spans):
            lane = y + (j % 2) * 9
            out.append(f'<rect class="repetition" x="{x(start)}" y="{lane}" '
                       f'width="{_num((end - start) * scale)}" height="7" rx="2" '
                       f'fill="{"#f28e2b" if j % 2 == 0 else "#ffbe7d"}">'
                       f"<title>repetition {j + 1} of {len(spans)}: t={start}..{end} (period "
                       f"{rep.period}, {rep.num_micro_batches} micro-batches)</title></rect>")
        y += 24

    chunks = device_chunks(problem)
    top = y
    for d in range(D):
        row = top + d * (_ROW + _GAP)
        out.append(f'<text x="{_LEFT - 6}" y="{row + _ROW / 2 + 4}" font-size="12" '
                   f'text-anchor="end" {_FONT}>device {d}</text>')
        out.append(f'<rect x="{x(0)}" y="{row}" width="{_num(makespan * scale)}" '
                   f'height="{_ROW}" fill="#f4f4f4"/>')
        for b, m, start, end in schedule.entries(d):
            block = problem.blocks[b]
            kind = block.kind if block.kind in _COLOURS else "other"
            fill, ink = _COLOURS[kind][chunks[(d, b)] % 2]
            shared = len(block.devices) > 1
            w = (end - start) * scale
            out.append(
                f'<rect class="block {kind}{" shared" if shared else ""}" data-device="{d}" '
                f'data-block={quoteattr(block.name)} data-mb="{m}" x="{x(start)}" y="{row}" '
                f'width="{_num(w)}" height="{_ROW}" fill="{fill}" stroke="#fff" '
                f'stroke-width="{1 if scale >= 6 else 0.5}"'
                + (' stroke-dasharray="3 2"' if shared else "")
                + f"><title>{escape(block.name)}@{m} on device {d}: t={start}..{end}, memory "
                f"{block.memory:+d}</title></rect>")
            label = str(m)
            if w >= 7 * len(label) + 3:
                out.append(f'<text x="{_num(_LEFT + (start + end) / 2 * scale)}" '
                           f'y="{row + _ROW / 2 + 4}" font-size="11" text-anchor="middle" '
                           f'fill="{ink}" pointer-events="none" {_FONT}>{label}</text>')
    y = top + D * (_ROW + _GAP)

    tick = _tick(makespan, scale)
    out.append(f'<line x1="{x(0)}" y1="{y}" x2="{x(makespan)}" y2="{y}" stroke="#888"/>')
    for t in list(range(0, makespan, tick)) + [makespan]:
        out.append(f'<line x1="{x(t)}" y1="{y}" x2="{x(t)}" y2="{y + 4}" stroke="#888"/>')
        if t == makespan or makespan - t >= tick / 2:
            out.append(f'<text x="{x(t)}" y="{y + 15}" font-size="10" text-anchor="middle" '
                       f'fill="#555" {_FONT}>{t}</text>')
    y += 30

    y = _memory(out, schedule, y, scale)
    y = _legend(out, problem, y)
    height = y + 8
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_num(width)}" '
            f'height="{_num(height)}" viewBox="0 0 {_num(width)} {_num(height)}">\n'
            f"<title>{escape(problem.name)} schedule</title>\n"
            f'<rect width="100%" height="100%" fill="#fff"/>\n')
    return head + "\n".join(out) + "\n</svg>\n"


def _memory(out: list[str], schedule: Schedule, y: float, scale: float) -> float:
    """One step curve per device, on a shared scale, with the capacity as a dashed line."""
    problem = schedule.problem
    show = problem.show_memory
    capacity = problem.memory_capacity
    curves = [memory_steps(schedule, d) for d in range(problem.num_devices)]
    low = min(min(level for _, level in c) for c in curves)
    high = max([max(level for _, level in c) for c in curves] + [capacity or 0, 1])
    span = max(high - min(low, 0), 1)
    out.append(f'<text x="{_LEFT}" y="{y}" font-size="12" font-weight="bold" {_FONT}>memory '
               f"per device" + (f" (capacity {escape(show(capacity))})" if capacity else "")
               + "</text>")
    y += 8
    for d, steps in enumerate(curves):
        base = y + _MEM
        level_y = lambda v: _num(base - (v - min(low, 0)) / span * _MEM)  # noqa: E731
        points = []
        for i, (t, level) in enumerate(steps):
            if i:
                points.append(f"{_num(_LEFT + t * scale)},{level_y(steps[i - 1][1])}")
            points.append(f"{_num(_LEFT + t * scale)},{level_y(level)}")
        points.append(f"{_num(_LEFT + schedule.makespan * scale)},{level_y(steps[-1][1])}")
        peak = schedule.peak_memory[d]
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
