"""Terminal timeline of a schedule: one row per device, one cell per time step.

A block is drawn from its start for its whole duration: a label (kind letter and micro-batch:
F3 forward, B3 backward, W3 weight gradient, O3 other; lowercase when the block runs on several
devices at once; F3' when it is the device's second stage, as in interleaved placements) padded
with its kind's fill ('-', '=', '~', '+'); '.' is idle. One step is the gcd of the block times.
The `rep` row marks where each repetition of the repetend starts.

Long schedules wrap into bands that fit the width. When they would need several bands, whole
periods of the steady state are elided first, but only where the picture provably repeats
(every device runs the same blocks one period later, one micro-batch further on).
"""

from __future__ import annotations

import textwrap

from pyplan.errors import PlanError
from pyplan.export._layout import device_chunks, repetitions, time_step
from pyplan.problem import BACKWARD, FORWARD, WEIGHT
from pyplan.problem.schedule import Schedule
from pyplan.planfile.units import count

__all__ = ["STYLES", "Line", "render_plain", "render_rich", "timeline"]

Line = list[tuple[str, str]]  # (text, style key) segments
STYLES = {  # rich styles in the 16 basic colours; two shades per kind tell chunks apart
    "forward0": "white on blue", "forward1": "black on cyan",
    "backward0": "black on green", "backward1": "black on bright_green",
    "weight0": "black on yellow", "weight1": "black on bright_yellow",
    "other0": "white on magenta", "other1": "black on bright_magenta",
    "idle": "bright_black", "transfer": "cyan", "axis": "dim", "rep": "bold cyan",
    "elided": "bold red",
}
_LETTER = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}
_FILL = {FORWARD: "-", BACKWARD: "=", WEIGHT: "~"}
_SEP = " ~ "  # stands for elided periods


MAX_CELLS = 2_000_000  # devices x steps the grid holds (about 300 MB), else show refuses


class _Grid:
    """Per device and step: (block, micro-batch, steps since the block started) or None."""

    def __init__(self, schedule: Schedule) -> None:
        problem = schedule.problem
        self.schedule = schedule
        self.unit = time_step(problem)
        self.steps = schedule.makespan // self.unit
        if problem.num_devices * self.steps > MAX_CELLS:
            raise PlanError(f"the timeline spans {self.steps:,} steps on "
                            f"{count(problem.num_devices, 'device')}, more than show draws "
                            f"({MAX_CELLS:,} cells)", hint="show fewer micro-batches with "
                            "--micro-batches, or export svg or chrome")
        self.cells = [[None] * self.steps for _ in range(problem.num_devices)]
        for d in range(problem.num_devices):
            for b, m, start, end in schedule.entries(d):
                for k in range((end - start) // self.unit):
                    self.cells[d][start // self.unit + k] = (b, m, k)
        # Idle steps while a transfer to the device is on its way (its consumer waits for it).
        self.arriving: set[tuple[int, int]] = set()
        for (a, c), delay in problem.transfer.items():
            for m in range(problem.num_micro_batches):
                if schedule.start_of(a, m) < 0 or schedule.start_of(c, m) < 0:
                    continue
                sent = schedule.end_of(a, m)
                for d in problem.blocks[c].devices:
                    for step in range(sent // self.unit, -(-(sent + delay) // self.unit)):
                        if self.cells[d][step] is None:
                            self.arriving.add((d, step))
        self.chunk = device_chunks(problem)  # primes in labels mark chunks > 0
        self.num_chunks = 1 + max(self.chunk.values(), default=0)
        # The longest label (letter, micro-batch, primes) and one fill character, so that labels
        # of one-step blocks never run together.
        self.width = (2 + len(str(max(problem.num_micro_batches - 1, 0)))
                      + self.num_chunks - 1)

    def text(self, d: int, step: int) -> tuple[str, str]:
        cell = self.cells[d][step]
        if cell is None:
            if (d, step) in self.arriving:
                return ">" * self.width, "transfer"
            return "." * self.width, "idle"
        b, m, k = cell
        block = self.schedule.problem.blocks[b]
        fill = _FILL.get(block.kind, "+")
        chunk = self.chunk[(d, b)]
        style = f"{block.kind if block.kind in _FILL else 'other'}{chunk % 2}"
        if k:
            return fill * self.width, style
        label = _LETTER.get(block.kind, "O") + str(m)
        if len(block.devices) > 1:
            label = label.lower()
        label += "'" * chunk
        return label.ljust(self.width, fill), style

    def elision(self) -> tuple[int, int] | None:
        """(first elided step, number of elided steps) over the longest periodic stretch."""
        rep = self.schedule.repetend
        if rep is None or rep.period % self.unit:
            return None
        p = rep.period // self.unit

        def periodic(s: int) -> bool:
            for row in self.cells:
                a, c = row[s], row[s + p]
                if (a is None) != (c is None) or (a and (a[0], a[1] + 1, a[2]) != c):
                    return False
            return True

        best, run = (0, 0), 0
        for s in range(self.steps - p):
            run = run + 1 if periodic(s) else 0
            if run > best[1]:
                best = (s - run + 1, run)
        first, length = best
        start = first + p  # keep one period of the steady state before the cut
        count = (first + length - start) // p - 1  # and a period after it
        return (start, count * p) if count >= 2 else None


def _tick(unit: int, cell: int, makespan: int) -> int:
    """Ruler spacing in time units: labels at least one cell apart."""
    need = len(str(makespan)) + 2
    for scale in (1, 10, 100, 1000, 10000, 100000):
        for base in (1, 2, 5):
            tick = base * scale
            if tick % unit == 0 and tick // unit * cell >= need:
                return tick
    return makespan


def _columns(grid: _Grid, width: int, compress: bool) -> tuple[list[int | None], tuple | None]:
    columns: list[int | None] = list(range(grid.steps))
    if compress and grid.steps * grid.width > width:
        cut = grid.elision()
        if cut is not None:
            start, length = cut
            columns = columns[:start] + [None] + columns[start + length:]
            return columns, cut
    return columns, None


def timeline(schedule: Schedule, *, width: int = 100, compress: bool = True) -> list[Line]:
    """The timeline and its legend as lines of styled segments, each at most `width` wide
    (unless one cell alone is wider)."""
    problem = schedule.problem
    grid = _Grid(schedule)
    names = [f"d{d}" for d in range(problem.num_devices)]
    prefix = max(len(n) for n in names + ["rep"]) + 2
    columns, cut = _columns(grid, max(1, width - prefix), compress)
    rep_marks = _repetend_marks(schedule, grid)
    tick = _tick(grid.unit, grid.width, schedule.makespan)

    bands: list[list[int | None]] = [[]]
    used = 0
    for col in columns:
        w = len(_SEP) if col is None else grid.width
        if bands[-1] and used + w > width - prefix:
            bands.append([])
            used = 0
        bands[-1].append(col)
        used += w

    title = (f"{problem.name}: {count(problem.num_micro_batches, 'micro-batch')} on "
             f"{count(problem.num_devices, 'device')}")
    lines: list[Line] = [[(part, "")] for part in textwrap.wrap(title, width)] + [[]]
    for i, band in enumerate(bands):
        if i:
            lines.append([])
        lines.append([("t".ljust(prefix), "axis"), (_ruler(band, grid, tick), "axis")])
        for d in range(problem.num_devices):
            line = [(names[d].ljust(prefix), "axis")]
            for col in band:
                line.append((_SEP, "elided") if col is None else grid.text(d, col))
            lines.append(line)
        row = "".join(_SEP if col is None else rep_marks.get(col, " " * grid.width)
                      for col in band)
        if row.strip(_SEP):
            lines.append([("rep".ljust(prefix), "axis"), (row.rstrip(), "rep")])
    lines.append([])
    for text in _legend(schedule, grid, cut):
        lines += [[(part, "")] for part in
                  textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False)]
    return lines


def _ruler(band: list[int | None], grid: _Grid, tick: int) -> str:
    """Time labels at multiples of `tick`, each where its step starts; a label that would touch
    another or run into an elision mark is left out."""
    chars: list[str] = []
    starts = []
    for col in band:
        starts.append(len(chars))
        chars += list(_SEP) if col is None else [" "] * grid.width
    free = 0  # first position the next label may use
    for col, pos in zip(band, starts, strict=True):
        if col is None or col * grid.unit % tick or pos < free:
            continue
        label = str(col * grid.unit)
        end = pos + len(label)
        if end <= len(chars) and all(c == " " for c in chars[pos:end + 1]):
            chars[pos:end] = label
            free = end + 1
    return "".join(chars).rstrip()


def _repetend_marks(schedule: Schedule, grid: _Grid) -> dict[int, str]:
    """Cells of the rep row: '[' at the first repetition's start, '|' at each later one, '-'
    until the last one ends (']')."""
    spans = repetitions(schedule)
    if not spans:
        return {}
    starts = {start // grid.unit for start, _ in spans}
    _, end = schedule.repetend_window()
    last = end // grid.unit - 1
    marks = {}
    first = min(starts)
    for step in range(first, last + 1):
        cell = ("[" if step == first else "|" if step in starts else "-")
        cell = cell.ljust(grid.width, "-")
        marks[step] = cell[:-1] + "]" if step == last else cell
    return marks


def _legend(schedule: Schedule, grid: _Grid, cut: tuple | None) -> list[str]:
    problem = schedule.problem
    kinds = {b.kind for b in problem.blocks}
    names = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight gradient"}
    present = [k for k in names if k in kinds] + (["other"] if kinds - set(names) else [])
    parts = [f"{_LETTER.get(k, 'O')}: {names.get(k, 'other')}" for k in present]
    parts[0] = parts[0].replace(":", "3:", 1) + " of micro-batch 3"
    fills = "/".join(_FILL.get(k, "+") for k in present)
    text = ", ".join(parts) + f"; {fills} continue a block; . idle"
    if any(len(b.devices) > 1 for b in problem.blocks):
        text += "; lowercase: a block on several devices at once"
    if grid.num_chunks > 1:
        text += "; ' marks a device's second stage, '' its third, ..."
    unit = f"{grid.unit} time units" if grid.unit > 1 else "1 time unit"
    lines = [f"{text}; one cell = {unit}"]
    rep = schedule.repetend
    if rep is not None:
        start, end = schedule.repetend_window()
        lines.append(f"rep: repetend of {count(rep.num_micro_batches, 'micro-batch')}, period "
                     f"{rep.period}, {schedule.repetend_count} repetitions from t={start} to "
                     f"t={end} ([ | mark their starts)")
    if cut is not None:
        start, length = cut
        periods = length * grid.unit // rep.period
        lines.append(f"~: {periods} periods elided (t={start * grid.unit}.."
                     f"{(start + length) * grid.unit}); they repeat the period before, each "
                     "one micro-batch later")
    mesh = problem.mesh
    if mesh.data_parallel * mesh.tensor > 1:
        order = f"device x {mesh.data_parallel} + data index" if mesh.data_parallel > 1 \
            else "device"
        if mesh.tensor > 1:
            order = f"({order}) x {mesh.tensor} + tensor index" if mesh.data_parallel > 1 \
                else f"{order} x {mesh.tensor} + tensor index"
        sequence = ", sequence parallel" if mesh.sequence_parallel else ""
        lines.append(f"mesh: {mesh.describe(problem.num_devices)}{sequence}; world rank = "
                     f"{order}")
    if schedule.syncs:
        what = "reduce-scattered" if mesh.shards > 1 else "all-reduced"
        each = ", ".join(f"d{x.device} {problem.blocks[x.layer].name} t={x.start}..{x.end}"
                         for x in schedule.syncs)
        lines.append(f"dp: {mesh.data_parallel} data-parallel ranks; each stage's gradients "
                     f"are {what} across them after its last backward, beside the compute: "
                     f"{each}")
    if problem.transfer:
        lines.append(f"> idle while data is on its way: a transfer takes "
                     f"{problem.show_transfers()} time units "
                     f"({len(problem.transfer)} dependencies between devices; the devices "
                     "stay free to compute meanwhile)")
    if problem.recomputed:
        lines.append("recompute: " + ", ".join(problem.recomputed) + " keep only "
                     "their inputs; the backward reruns the forward first (included in its length)")
    show = problem.show_memory
    capacities = problem.capacities
    peak = " ".join(show(x) + (f"/{show(c)}" if c is not None else "")
                    for x, c in zip(schedule.peak_memory, capacities))
    if problem.show_speeds():
        lines.append(f"device speeds {problem.show_speeds()} (block times on a device are "
                     "divided by its speed)")
    lines.append(f"makespan {schedule.makespan}, bubble {schedule.bubble_rate:.1%}, "
                 f"peak memory {peak}" + ("" if problem.limited else " (no capacity)"))
    return lines


def render_plain(lines: list[Line]) -> str:
    return "\n".join("".join(text for text, _ in line).rstrip() for line in lines) + "\n"


def render_rich(lines: list[Line]):
    """The same lines as one rich Text (rich is imported only when colours are wanted)."""
    from rich.text import Text

    out = Text()
    for i, line in enumerate(lines):
        if i:
            out.append("\n")
        for text, style in line:
            out.append(text, style=STYLES.get(style, ""))
    return out
