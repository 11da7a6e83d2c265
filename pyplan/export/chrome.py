"""Chrome / Perfetto trace JSON (the Trace Event Format), one track per device.

A solved schedule is exported in model time units (one unit shown as one microsecond);
`pyplan run --trace` writes the same format with measured microseconds, so the two line up in
ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pyplan.fileio import write_atomic

__all__ = ["TraceEvent", "chrome_trace", "memory_counters", "schedule_events", "schedule_trace",
           "write_chrome_trace"]


@dataclass(frozen=True)
class TraceEvent:
    """One block execution (or communication) on one device."""

    device: int
    name: str          # e.g. "stage0.b@3"
    kind: str          # forward, backward, weight, other, send, recv, wait
    start: float       # microseconds (or model time units)
    duration: float
    micro_batch: int = -1
    phase: str = ""    # warmup, repetend, cooldown (solved schedules)


def chrome_trace(events: list[TraceEvent], *, title: str, time_unit: str,
                 num_devices: int) -> dict:
    """The trace as a JSON-ready dict: complete ("X") events plus track names."""
    trace = []
    for d in range(num_devices):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d,
                      "args": {"name": f"device {d}"}})
        trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": d,
                      "args": {"sort_index": d}})
    trace.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}})
    for e in sorted(events, key=lambda e: (e.start, e.device, e.name)):
        args = {"micro_batch": e.micro_batch}
        if e.phase:
            args["phase"] = e.phase
        trace.append({"name": e.name, "cat": e.kind, "ph": "X", "pid": 0, "tid": e.device,
                      "ts": e.start, "dur": e.duration, "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"producer": "pyplan", "title": title, "time_unit": time_unit}}


def schedule_events(schedule) -> list[TraceEvent]:
    """Every block execution of a solved schedule, in model time units."""
    problem = schedule.problem
    phase = schedule.phase_of
    events = []
    for d in range(problem.num_devices):
        for b, m, start, end in schedule.entries(d):
            block = problem.blocks[b]
            events.append(TraceEvent(d, f"{block.name}@{m}", block.kind, start, end - start, m,
                                     phase.get((b, m), "")))
    return events


def memory_counters(schedule) -> list[dict]:
    """Counter ("C") events: each device's memory after every block start, where it changes
    (the running sum of block memory in the device's order)."""
    problem = schedule.problem
    events = []
    for d in range(problem.num_devices):
        level = 0
        events.append({"name": f"memory device {d}", "ph": "C", "pid": 0, "ts": 0,
                       "args": {"memory": 0}})
        for b, _, start, _ in schedule.entries(d):
            if problem.blocks[b].memory:
                level += problem.blocks[b].memory
                events.append({"name": f"memory device {d}", "ph": "C", "pid": 0, "ts": start,
                               "args": {"memory": level}})
    return events


def schedule_trace(schedule) -> dict:
    """A solved schedule as a trace: one track per device, one event per block execution on a
    device (a block on several devices appears on each), plus a memory counter per device."""
    problem = schedule.problem
    trace = chrome_trace(schedule_events(schedule), title=problem.name,
                         time_unit="model time units (shown as microseconds)",
                         num_devices=problem.num_devices)
    trace["traceEvents"] += memory_counters(schedule)
    trace["otherData"].update({"makespan": schedule.makespan,
                               "bubble_rate": schedule.bubble_rate,
                               "peak_memory": list(schedule.peak_memory),
                               "memory_capacity": problem.memory_capacity})
    return trace


def write_chrome_trace(path: str | Path, trace: dict) -> None:
    write_atomic(path, json.dumps(trace, separators=(",", ":")) + "\n")
