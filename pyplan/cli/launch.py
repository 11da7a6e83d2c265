"""`pyplan run --nproc-per-node D`: start the workers through torch's launcher, as torchrun would
(the same rendezvous and multi-node options, log lines and exit codes), from a warm process.

torchrun starts each worker as a new interpreter, and every one of them imports torch,
torch._dynamo and pyplan's runtime again: about 2 s of CPU per rank before it does anything.
Here the launcher starts a forkserver that imports them once, and torch's launcher forks each
worker from it (its own option: a script run in the same interpreter, --run-path, with
--start-method forkserver); each worker then runs pyplan/cli/worker.py with its torchrun
environment. The forkserver is single-threaded Python (fork from it is safe), started with the
launcher's environment and stopped when the run ends, and its imports come from the installed
package: it starts with the working directory off sys.path (PYTHONSAFEPATH), so a source tree
without a build cannot shadow it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from pyplan.options.numbers import whole
from pyplan.cli._torch import require_torch
from pyplan.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, PlanError, RunError

__all__ = ["LAUNCH_NUMBERS", "LAUNCH_OPTIONS", "PRELOAD", "check_processes", "forkserver", "launch", "launched",
           "worker_environment"]

# torchrun options passed through by `pyplan run --nproc-per-node` (multi-node rendezvous):
# (metavar, help).
LAUNCH_OPTIONS = {
    "nnodes": ("N", "machines taking part, N or MIN:MAX (default 1)"),
    "node-rank": ("N", "this machine's rank among them (static rendezvous; c10d assigns them)"),
    "rdzv-backend": ("NAME", "rendezvous backend: static (torchrun's default) or c10d"),
    "rdzv-endpoint": ("HOST:PORT", "where the machines meet"),
    "rdzv-id": ("ID", "the job's id, the same on every machine"),
    "master-addr": ("ADDR", "with --rdzv-backend static: the address of node rank 0"),
    "master-port": ("PORT", "with --rdzv-backend static: its port (default 29500)"),
    "max-restarts": ("N", "restart the workers this many times after a failure (default 0)"),
    "log-dir": ("DIR", "write each worker's output to files in this folder"),
}
LAUNCH_NUMBERS = {"node-rank": whole(0, 4095), "master-port": whole(1, 65535),
                  "max-restarts": whole(0, 1000)}
"""The launcher's options that are numbers: their ranges."""

# What every worker imports anyway: once, in the forkserver.
# (pyplan.runtime first: it imports torch without torch's warning about a missing numpy)
PRELOAD = ["pyplan.runtime", "torch._dynamo", "torch.multiprocessing.spawn",
           "torch.distributed.elastic.multiprocessing.api", "torch.distributed.checkpoint",
           "pyplan.cli.main", "pyplan.cli.run", "pyplan.run.binding",
           "pyplan.train.session"]

WORKER = str(Path(__file__).with_name("worker.py"))

launched = False
"""Whether this process has launched workers (and waited for them)."""

# Set for the forkserver's own start only; each worker takes it off (worker_environment).
SAFE_PATH_MARK = "PYPLAN_FORKSERVER_SAFE_PATH"


def check_processes(args: argparse.Namespace, needed: int, layout: str, command: str) -> None:
    """PlanError unless --nproc-per-node (times --nnodes) starts the `needed` processes of the
    plan (`layout`, `command`: what it runs on and how to launch it); an elastic --nnodes
    MIN:MAX is left to the ranks."""
    if args.nproc_per_node < 1:
        raise PlanError("--nproc-per-node must be at least 1")
    nodes = (args.nnodes or "1").split(":")
    if len(nodes) > 2 or not all(n.isdigit() and int(n) >= 1 for n in nodes):
        raise PlanError(f"--nnodes {args.nnodes!r} is not a number of machines N or MIN:MAX")
    if len(set(nodes)) == 1 and args.nproc_per_node * int(nodes[0]) != needed:
        machines = f" on {args.nnodes} machines" if args.nnodes else ""
        raise PlanError(f"the plan needs {needed} processes ({layout}), --nproc-per-node "
                        f"{args.nproc_per_node}{machines} starts "
                        f"{args.nproc_per_node * int(nodes[0])}",
                        hint=f"launch it with: {command}")


def launch(args: argparse.Namespace, worker_arguments: list[str]) -> int:
    """Start args.nproc_per_node workers running `pyplan *worker_arguments` and wait for them;
    the exit code (2 when the first worker to fail refused its input and said why)."""
    if args.nproc_per_node < 1:
        raise PlanError("--nproc-per-node must be at least 1")
    global launched
    launched = True
    # The forkserver imports while this process imports torch's launcher.
    with forkserver(args.nproc_per_node):
        return _launch(args, worker_arguments)


def _launch(args: argparse.Namespace, worker_arguments: list[str]) -> int:
    require_torch("run", runtime=False)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun
    options = ["--nproc-per-node", str(args.nproc_per_node)]
    given = {o: getattr(args, o.replace("-", "_")) for o in LAUNCH_OPTIONS}
    for option, value in given.items():
        if value is not None:
            options += [f"--{option}", str(value)]
    if all(given[o] is None for o in ("nnodes", "rdzv-endpoint", "master-port", "master-addr")):
        options.append("--standalone")  # one machine: a free port, no fixed 29500
    # SIGUSR1 too (SLURM's --signal): the launcher passes the signal it got on to the workers,
    # which save and stop (pyplan.train.stopping).
    launcher = get_args_parser().parse_args(
        [*options, "--start-method", "forkserver", "--run-path", WORKER,
         "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"])
    # Set apart from the launcher's parser, which would take --log for its own --log-dir.
    launcher.training_script_args = worker_arguments
    try:
        with _quiet_failures():
            torchrun(launcher)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode in (EXIT_BAD_INPUT, EXIT_PREEMPTED):
            return failure.exitcode  # the ranks refused the input, or stopped early with a
            # checkpoint (--max-time), and said so in one line
        code = failure.exitcode
        how = (f"was killed by {signal.Signals(-code).name}"
               if code < 0 and -code in signal.valid_signals() else f"exited with {code}")
        raise RunError(f"the first worker to fail, rank {rank}, {how}",
                       hint="the ranks' own messages are above") from None
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        if exc.sigval in (signal.SIGTERM, signal.SIGUSR1):  # the workers were given the
            return EXIT_PREEMPTED  # signal and torch's shutdown timeout to save and stop
        raise RunError(f"the launcher got signal {exc.sigval.name}") from None
    return 0


@contextlib.contextmanager
def forkserver(workers: int, preload: list[str] = PRELOAD):
    """multiprocessing's forkserver for one launch, preloaded with `preload`, started now with
    this process's environment (and OMP_NUM_THREADS=1 for several workers, as torch's launcher
    sets it: OpenMP reads it once, when torch is imported); stopped at the end."""
    import multiprocessing
    from multiprocessing import forkserver as module

    server = module._forkserver
    if server._forkserver_pid is not None:  # started before, with another environment
        server._stop()
    previous = server._preload_modules
    multiprocessing.set_forkserver_preload(preload)
    added = {} if "PYTHONSAFEPATH" in os.environ else {"PYTHONSAFEPATH": "1",
                                                       SAFE_PATH_MARK: "1"}
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        added["OMP_NUM_THREADS"] = "1"
    os.environ.update(added)
    try:
        module.ensure_running()
    finally:
        for name in added:
            del os.environ[name]
    try:
        yield
    finally:
        if server._forkserver_pid is not None:  # its workers are done: end it without the
            os.kill(server._forkserver_pid, signal.SIGTERM)  # teardown of torch (~0.7 s CPU)
        server._stop()
        multiprocessing.set_forkserver_preload(previous)


def worker_environment() -> None:
    """In a worker forked from `forkserver`: the launcher's environment (PYTHONSAFEPATH only if
    it was set there) and sys.path without the working directory (multiprocessing gave the
    worker the launcher's sys.path), so a source tree does not shadow what the forkserver
    imported."""
    if os.environ.pop(SAFE_PATH_MARK, None):
        os.environ.pop("PYTHONSAFEPATH", None)
    sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]


@contextlib.contextmanager
def _quiet_failures():
    """torch's launcher logs a failed worker with the traceback of its own bookkeeping
    (ProcessExitedException); the line without it is the message."""
    import logging

    def drop_traceback(record: logging.LogRecord) -> bool:
        record.exc_info = record.exc_text = None
        return True

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    logger.addFilter(drop_traceback)
    try:
        yield
    finally:
        logger.removeFilter(drop_traceback)
