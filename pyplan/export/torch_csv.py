"""torch.distributed.pipelining's schedule CSV: write a schedule as one, read one back.

The format is what torch's `_PipelineScheduleRuntime._load_csv` reads (format "compute_only"):
one row per rank, each cell an action `{stage}{F|B|I|W}{micro-batch}` (`0F1`: stage 0's forward
of micro-batch 1) and an empty cell a step in which the rank starts nothing. Stages are numbered
along the forward pass from 0; torch learns which rank runs a stage from the row it is in. `B` is
a whole backward; a split backward is `I` (input gradient) and later `W` (weight gradient).

A plan maps onto torch stages when its forward blocks form one chain of single-device blocks
(stage s is the s-th in dependency order) and each has its backward NAME.b (`B`, or `I` when the
plan splits off NAME.w, which is `W`), with no other blocks or dependencies: torch passes
activations only from stage s to s + 1 and gradients back. Interleaved placements simply put
several stages on one rank. Written actions sit in the column of their start step (the gcd of
the block times), so the rows read as a timeline; torch and `read_torch_csv` skip empty cells.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path

from pyplan.errors import PlanError
from pyplan.export._layout import time_step
from pyplan.files import read_capped, write_atomic
from pyplan.problem import BACKWARD, FORWARD, WEIGHT, Problem
from pyplan.problem.schedule import Instance, Schedule
from pyplan.planfile.plan import MAX_MICRO_BATCHES
from pyplan.planfile.source import MAX_FILE_BYTES

__all__ = ["TorchCsv", "TorchStage", "read_torch_csv", "render_torch_csv", "torch_csv_rows",
           "torch_stages", "write_torch_csv"]

_COMPUTE = re.compile(r"(\d+)(F|B|I|W)(\d+)")
# Communication and FSDP actions of torch's "compute_comms" CSVs: pyplan's dependencies already
# stand for them, so reading skips them.
_OTHER = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
MAX_CELLS = 20_000_000  # cells (ranks x steps) a written CSV may have
_HINT = ("torch-csv needs one chain of single-device stages, each with its backward; "
         "export svg or chrome instead")


@dataclass(frozen=True)
class TorchStage:
    """One torch stage: its blocks and the rank (= device) that runs it."""

    index: int
    rank: int
    forward: int
    backward: int
    weight: int | None  # the W half when the plan splits the backward


def torch_stages(problem: Problem) -> tuple[TorchStage, ...]:
    """The plan's blocks as torch stages; PlanError naming the block when they do not fit."""
    blocks, by_name = problem.blocks, problem.by_name

    def fail(why: str, hint: str = _HINT) -> PlanError:
        return PlanError(f"{problem.name} cannot be a torch.distributed.pipelining schedule: "
                         f"{why}", hint=hint)

    if not problem.training:
        raise fail("it is an inference plan, and torch's schedule runtime needs a backward for "
                   "every stage", "torch-csv is for training plans")
    for b in blocks:
        if len(b.devices) > 1:
            raise fail(f"block '{b.name}' runs on devices {list(b.devices)} at once, but a torch "
                       "stage runs on one rank")
        if b.kind not in (FORWARD, BACKWARD, WEIGHT):
            raise fail(f"block '{b.name}' is of kind {b.kind}; torch stages have only forward "
                       "and backward work")
    forwards = [b.index for b in blocks if b.kind == FORWARD]
    succ = {f: [c for a, c in problem.edges if a == f and blocks[c].kind == FORWARD]
            for f in forwards}
    heads = [f for f in forwards if not any(f in s for s in succ.values())]
    if len(heads) != 1:
        names = ", ".join(f"'{blocks[h].name}'" for h in heads)
        raise fail(f"the forward blocks form {len(heads)} chains (starting at {names}), but "
                   "torch's stages form one")
    chain = heads
    while succ[chain[-1]]:
        if len(succ[chain[-1]]) > 1:
            raise fail(f"forward block '{blocks[chain[-1]].name}' feeds several blocks, but a "
                       "torch stage feeds only the next one")
        chain.append(succ[chain[-1]][0])
    if len(chain) != len(forwards):
        raise fail("the forward blocks join, but torch's stages form one chain")

    stages, expected = [], set()
    for s, f in enumerate(chain):
        name = blocks[f].name
        b, w = by_name.get(f"{name}.b"), by_name.get(f"{name}.w")
        if b is None or blocks[b].kind != BACKWARD:
            raise fail(f"forward block '{name}' has no backward block '{name}.b'",
                       "every torch stage runs a backward for each micro-batch")
        if w is not None and blocks[w].kind != WEIGHT:
            w = None
        stages.append(TorchStage(s, blocks[f].devices[0], f, b, w))
        for part in (b, w):
            if part is not None and blocks[part].devices != blocks[f].devices:
                raise fail(f"block '{blocks[part].name}' runs on another device than "
                           f"'{name}', but a torch stage runs on one rank")
        expected |= {(f, b)} | ({(b, w), (f, w)} if w is not None else set())
    used = {i for st in stages for i in (st.forward, st.backward, st.weight) if i is not None}
    for b in blocks:
        if b.index not in used:
            raise fail(f"block '{b.name}' is not the forward or backward of a stage")
    required = {(chain[s], chain[s + 1]) for s in range(len(chain) - 1)}
    required |= {(stages[s + 1].backward, stages[s].backward) for s in range(len(chain) - 1)}
    required |= {(chain[-1], stages[-1].backward)}
    required |= {(st.backward, st.weight) for st in stages if st.weight is not None}
    for a, c in problem.edges:
        if (a, c) not in required | expected:
            raise fail(f"block '{blocks[a].name}' feeds '{blocks[c].name}', but torch passes "
                       "activations only to the next stage and gradients only back")
    missing = sorted(required - set(problem.edges))
    if missing:
        a, c = missing[0]
        raise fail(f"block '{blocks[a].name}' does not feed '{blocks[c].name}', but torch "
                   "sends every stage's result to its neighbour")
    for d in range(problem.num_devices):
        if not any(st.rank == d for st in stages):
            raise fail(f"device {d} runs no stage, but every torch rank needs one")
    return tuple(stages)


def _actions(stages: tuple[TorchStage, ...]) -> dict[int, tuple[int, str]]:
    """block -> (stage, action letter)."""
    out = {}
    for st in stages:
        out[st.forward] = (st.index, "F")
        out[st.backward] = (st.index, "B" if st.weight is None else "I")
        if st.weight is not None:
            out[st.weight] = (st.index, "W")
    return out


def torch_csv_rows(schedule: Schedule) -> list[list[str]]:
    """One row per rank; each action in the column of its start step, other cells empty."""
    problem = schedule.problem
    action = _actions(torch_stages(problem))
    unit = time_step(problem)
    cells = problem.num_devices * (schedule.makespan // unit)
    if cells > MAX_CELLS:
        raise PlanError(f"the schedule spans {schedule.makespan // unit:,} steps on "
                        f"{problem.num_devices:,} ranks, {cells:,} cells, more than torch-csv "
                        f"writes ({MAX_CELLS:,})", hint="solve fewer micro-batches with "
                        "--micro-batches")
    rows = []
    for d in range(problem.num_devices):
        entries = schedule.entries(d)
        cells = [""] * (1 + max((start // unit for _, _, start, _ in entries), default=-1))
        for b, m, start, _ in entries:
            stage, letter = action[b]
            cells[start // unit] = f"{stage}{letter}{m}"
        rows.append(cells)
    return rows


def render_torch_csv(schedule: Schedule) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(torch_csv_rows(schedule))
    return out.getvalue()


def write_torch_csv(path: str | Path, schedule: Schedule) -> None:
    write_atomic(path, render_torch_csv(schedule))


@dataclass(frozen=True)
class TorchCsv:
    orders: list[list[Instance]]
    """Per device, (block, micro-batch) in the file's order."""
    num_micro_batches: int
    where: dict[Instance, tuple[int, int]]
    """The line and column of every action, for errors about the schedule."""


def read_torch_csv(path: str | Path, problem: Problem) -> TorchCsv:
    """The orders of a torch schedule CSV, checked against the plan (PlanError pointing at the
    row and column)."""
    stages = torch_stages(problem)
    try:
        raw = read_capped(path, MAX_FILE_BYTES + 1)  # at most the limit: /dev/zero, pipes
        lines = raw.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PlanError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise PlanError(f"the file is larger than {MAX_FILE_BYTES // 2**20} MiB, the limit for "
                        "schedule CSVs", file=str(path))
    while lines and not lines[-1].strip():
        lines.pop()
    if len(lines) != problem.num_devices:
        raise PlanError(f"{len(lines)} rows, but the plan has {problem.num_devices} devices",
                        hint="write one row per rank; torch's rank r is pyplan's device r",
                        file=str(path), line=max(len(lines), 1))
    where: dict[Instance, tuple[int, int]] = {}
    orders: list[list[Instance]] = []
    for r, line in enumerate(lines):
        order: list[Instance] = []
        column = 1
        try:
            cells = next(csv.reader([line]), [])
        except csv.Error as exc:  # a NUL, an unclosed quote, a field past csv's limit
            raise PlanError(f"not a CSV row: {exc}", file=str(path), line=r + 1) from None
        for cell in cells:
            at = (r + 1, column + len(cell) - len(cell.lstrip()))
            column += len(cell) + 1
            text = cell.strip()
            overlap = _OVERLAP.fullmatch(text)
            for part in (overlap.group(1).split(";") if overlap else [text]):
                for inst in _instances(part.strip(), stages, problem, r, path, at):
                    if inst in where:
                        block = problem.blocks[inst[0]]
                        raise PlanError(f"{part.strip()} runs {block.name}@{inst[1]} again "
                                        f"(first on line {where[inst][0]}, column "
                                        f"{where[inst][1]})", file=str(path), line=at[0],
                                        column=at[1])
                    where[inst] = at
                    order.append(inst)
        orders.append(order)
    if not where:
        raise PlanError("the schedule has no actions", file=str(path))
    n = 1 + max(m for _, m in where)
    action = _actions(stages)
    for m in range(n):
        for st in stages:
            for b in (st.forward, st.backward, st.weight):
                if b is not None and (b, m) not in where:
                    stage, letter = action[b]
                    raise PlanError(f"micro-batch {m} never runs {problem.blocks[b].name} "
                                    f"(action {stage}{letter}{m})",
                                    hint=f"every stage runs every micro-batch 0..{n - 1}",
                                    file=str(path))
    return TorchCsv(orders, n, where)


def _instances(text: str, stages, problem: Problem, rank: int, path, at) -> list[Instance]:
    if not text or _OTHER.fullmatch(text):
        return []

    def fail(message: str, hint: str | None = None) -> PlanError:
        return PlanError(message, hint=hint, file=str(path), line=at[0], column=at[1])

    match = _COMPUTE.fullmatch(text)
    if match is None:
        shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text):,} characters)"
        raise fail(f"'{shown}' is not a torch action",
                   "write STAGE, F|B|I|W, MICRO-BATCH like 0F1, 3B0, 2I4, 2W4")
    if max(len(match.group(1)), len(match.group(3))) > 9:
        raise fail(f"{text[:40]}...: a stage or micro-batch number of "
                   f"{max(len(match.group(1)), len(match.group(3))):,} digits",
                   f"micro-batches go up to {MAX_MICRO_BATCHES - 1:,}")
    s, kind, m = int(match.group(1)), match.group(2), int(match.group(3))
    if m >= MAX_MICRO_BATCHES:
        raise fail(f"{text} names micro-batch {m:,}, beyond the supported "
                   f"{MAX_MICRO_BATCHES - 1:,}")
    if s >= len(stages):
        raise fail(f"{text} names stage {s}, but the plan has {len(stages)} stages "
                   f"(0..{len(stages) - 1})")
    st = stages[s]
    name = problem.blocks[st.forward].name
    if st.rank != rank:
        raise fail(f"{text} runs stage {s} ('{name}') on rank {rank}, but the plan places it "
                   f"on device {st.rank}", "torch's rank r is pyplan's device r")
    if kind in "IW" and st.weight is None:
        raise fail(f"{text} splits the backward of stage {s}, but the plan has one backward "
                   f"block '{name}.b'", "split it with training.backward.weight_time_ratio")
    blocks = {"F": [st.forward], "I": [st.backward], "W": [st.weight],
              "B": [st.backward] + ([st.weight] if st.weight is not None else [])}[kind]
    return [(b, m) for b in blocks]
