"""Trace events in the Chrome / Perfetto Trace Event Format, one track per device: what a
solved schedule exports (pyplan.export.chrome) and what `pyplan run --trace` records share
this one format, so that the two line up in ui.perfetto.dev or chrome://tracing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pyplan.files import write_atomic

__all__ = ["TraceEvent", "chrome_trace", "write_chrome_trace"]


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


def write_chrome_trace(path: str | Path, trace: dict) -> None:
    write_atomic(path, json.dumps(trace, separators=(",", ":")) + "\n")
