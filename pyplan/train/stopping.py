"""When `pyplan run` stops before its last step: a preemption signal (SIGTERM, what SLURM and
Kubernetes send before they stop a job, or SIGUSR1, SLURM's `--signal`), `--max-time`, or too
many steps in a row whose loss or gradients were not finite.

A signal only sets a flag (the watchdog's thread notices it even while the main thread waits
inside a collective); every rank reports its flag in the one small gather that ends each step
(Session.progress), so all ranks see the same verdict after the same step and none leaves a
collective half-entered. Then the run saves a checkpoint (with --save) and exits with
EXIT_PREEMPTED. A second signal exits at once: a checkpoint being written is left as its
temporary folder, and the previous one stays intact (saves are renamed into place only once
complete).
"""

from __future__ import annotations

import signal

from pyplan.errors import EXIT_PREEMPTED

__all__ = ["EXIT_PREEMPTED", "SIGNALS", "out_of_time"]

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

def out_of_time(limit: float | None, elapsed: float, step_seconds: float,
                save_seconds: float) -> bool:
    """Whether another step and the save after it could end after `limit` seconds: the next
    step is taken to last as long as the slowest so far, twice over (a margin for noise), and
    the save as long as the longest so far."""
    return limit is not None and elapsed + 2 * step_seconds + save_seconds > limit
