"""Chrome / Perfetto trace JSON (the Trace Event Format), one track per device.

A solved schedule is exported in model time units (one unit shown as one microsecond);
`pyplan run --trace` writes the same format with measured microseconds, so the two line up in
ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

from pyplan.errors import PlanError
from pyplan.problem.schedule import Schedule
from pyplan.files.trace import TraceEvent, chrome_trace, write_chrome_trace

MAX_EVENTS = 1_000_000  # block executions in one trace (about 150 MB of JSON)

__all__ = ["memory_counters", "schedule_events", "schedule_trace", "sync_events",
           "transfer_events", "write_chrome_trace"]


def schedule_events(schedule: Schedule) -> list[TraceEvent]:
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


def sync_events(schedule: Schedule) -> list[dict]:
    """Gradient synchronisations across data-parallel replicas, on a track per device beside
    its compute track (they run on their own stream)."""
    problem = schedule.problem
    events = []
    for d in sorted({x.device for x in schedule.syncs}):
        track = problem.num_devices + d
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": track,
                    "args": {"name": f"device {d} gradient sync"}},
                   {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": track,
                    "args": {"sort_index": d + 0.5}}]
    for x in schedule.syncs:
        events.append({"name": f"sync {problem.blocks[x.layer].name}", "cat": "sync", "ph": "X",
                       "pid": 0, "tid": problem.num_devices + x.device, "ts": x.start,
                       "dur": x.end - x.start, "args": {"replicas": problem.mesh.data}})
    return events


def transfer_events(schedule: Schedule) -> list[dict]:
    """Each transfer between devices: a slice on a track per sending device (they overlap the
    compute: a separate stream) and a flow arrow from the producing block to the consumer."""
    problem = schedule.problem
    k, D = len(problem.blocks), problem.num_devices
    events, senders = [], set()
    flow = 0
    for m in range(problem.num_micro_batches):
        for (a, c), delay in sorted(problem.transfer.items()):
            if schedule.start[m * k + a] < 0 or schedule.start[m * k + c] < 0:
                continue
            src, dst = problem.blocks[a], problem.blocks[c]
            sender = src.devices[0]
            receiver = next(q for q in dst.devices if q not in src.devices)
            end = schedule.end_of(a, m)
            senders.add(sender)
            name = f"{src.name}@{m} -> {dst.name}"
            events += [
                {"name": name, "cat": "transfer", "ph": "X", "pid": 0, "tid": 2 * D + sender,
                 "ts": end, "dur": delay, "args": {"to_device": receiver, "micro_batch": m}},
                {"name": "transfer", "cat": "transfer", "ph": "s", "id": flow, "pid": 0,
                 "tid": sender, "ts": schedule.start_of(a, m)},
                {"name": "transfer", "cat": "transfer", "ph": "f", "bp": "e", "id": flow,
                 "pid": 0, "tid": receiver, "ts": schedule.start_of(c, m)}]
            flow += 1
    for d in sorted(senders):
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": 2 * D + d,
                    "args": {"name": f"device {d} transfers out"}},
                   {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": 2 * D + d,
                    "args": {"sort_index": d + 0.75}}]
    return events


def memory_counters(schedule: Schedule) -> list[dict]:
    """Counter ("C") events: each device's memory after every block start, where it changes
    (the running sum of block memory in the device's order)."""
    problem = schedule.problem
    events = []
    for d in range(problem.num_devices):
        level = problem.static_memory[d]  # the weights, resident from the start
        events.append({"name": f"memory device {d}", "ph": "C", "pid": 0, "ts": 0,
                       "args": {"memory": level}})
        for b, _, start, _ in schedule.entries(d):
            if problem.blocks[b].memory:
                level += problem.blocks[b].memory
                events.append({"name": f"memory device {d}", "ph": "C", "pid": 0, "ts": start,
                               "args": {"memory": level}})
    return events


def schedule_trace(schedule: Schedule) -> dict:
    """A solved schedule as a trace: one track per device, one event per block execution on a
    device (a block on several devices appears on each), plus a memory counter per device."""
    problem = schedule.problem
    blocks = sum(map(len, schedule.orders))
    if blocks > MAX_EVENTS:
        raise PlanError(f"the trace would hold {blocks:,} block events, more than chrome "
                        f"exports ({MAX_EVENTS:,}): trace viewers cannot open it",
                        hint="solve fewer micro-batches with --micro-batches")
    trace = chrome_trace(schedule_events(schedule), title=problem.name,
                         time_unit="model time units (shown as microseconds)",
                         num_devices=problem.num_devices)
    trace["traceEvents"] += (memory_counters(schedule) + sync_events(schedule)
                             + transfer_events(schedule))
    trace["otherData"].update({"makespan": schedule.makespan,
                               "bubble_rate": schedule.bubble_rate,
                               "peak_memory": list(schedule.peak_memory),
                               "memory_capacity": problem.memory_capacity})
    if problem.device_memory:
        trace["otherData"]["device_memory"] = list(problem.device_memory)
    if problem.device_speed:
        trace["otherData"]["device_speed"] = list(problem.device_speed)
    return trace
