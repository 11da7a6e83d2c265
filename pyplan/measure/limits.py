"""The user's code while pyplan measures it (`pyplan partition`, `pyplan profile`): whatever
a unit's forward raises (SystemExit too) or returns that is not tensors is one error line
naming the unit (`guarded`), and a forward that loops for ever or sleeps ends in one error
line instead of holding the command (`time_limit`); whatever ends the process from the user's
code anywhere else (sys.exit, os._exit, a KeyboardInterrupt it raises) is one error line
naming the function that did it (`users_code`).

Two bounds, both blind to other work on the machine: the process's CPU time over the
measurement (a busy machine stretches the wall clock, not the CPU time), and a stretch of wall
time in which the process computes nearly nothing (a sleep, a wait on a lock or a socket; a
process that merely shares the cores with others still gets its share, far above the 1% this
asks). A watchdog thread checks both twice a second and interrupts the main thread with a
signal, which ends a sleep as well as a Python loop, and again at every check until the body
ends (user code that catches the error does not outlast the limit).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from pyplan.errors import (OsExit, PyplanError, TimeLimitError, UserCodeError,
                           describe_exception)

__all__ = ["DEFAULT_SECONDS", "TimeLimitError", "computing_in", "guarded", "idle_seconds",
           "in_compute_dtype", "time_limit", "users_code"]

DEFAULT_SECONDS = 300.0  # CPU seconds per measured unit (or block): generous
_IDLE_SHARE = 0.01       # below this share of one core for the idle stretch: not computing
_TICK = 0.5


def idle_seconds(limit: float) -> float:
    """How long the measured code may compute nearly nothing before it counts as stuck: 10 s,
    longer for a larger limit."""
    return max(10.0, limit / 30)


@contextlib.contextmanager
def time_limit(what: str, limit: float | None, option: str = "--unit-time-limit", *,
               idle: float | None = None):
    """Run the body (which measures `what`, e.g. "unit layers.3") within `limit` CPU seconds
    (math.inf: no CPU bound) and without an idle stretch of `idle` seconds (default
    idle_seconds(limit));
    TimeLimitError otherwise. No bound with `limit` None, or off the main thread (signals
    reach only it)."""
    if limit is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    idle = idle_seconds(limit) if idle is None else idle
    expired: list[str] = []
    stop = threading.Event()
    main = threading.main_thread().ident

    def on_signal(signum, frame):
        if expired and not stop.is_set():
            raise TimeLimitError(expired[0], hint=f"if it is slow, not stuck, raise {option} "
                                 f"(now {limit:g} s of CPU time; the idle bound is 1/30 of "
                                 "it, at least 10 s)")

    def watch():
        start = last_cpu = time.process_time()
        last_wall = previous = time.monotonic()
        while not stop.wait(_TICK):
            cpu, wall = time.process_time(), time.monotonic()
            if wall - previous > 10 * _TICK:  # the process was stopped (^Z): start afresh
                last_cpu, last_wall = cpu, wall
            previous = wall
            if cpu - last_cpu > _IDLE_SHARE * max(wall - last_wall, _TICK):
                last_cpu, last_wall = cpu, wall
            if expired:
                pass
            elif cpu - start > limit:
                expired.append(f"{what} took more than {limit:g} s of CPU time to measure")
            elif wall - last_wall > idle:
                expired.append(f"{what} computed nothing for {idle:g} s while measured (it "
                               "sleeps or waits for something)")
            if expired:  # and at every tick after, until the body ends
                signal.pthread_kill(main, signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, on_signal)
    watchdog = threading.Thread(target=watch, name="pyplan-time-limit", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        stop.set()
        watchdog.join()
        signal.signal(signal.SIGALRM, previous)


_COMPUTE: list = [None]
"""(device type, dtype) the measured forwards run under autocast to (computing_in), or None."""


@contextlib.contextmanager
def computing_in(device, dtype):
    """Measured forwards (`guarded`, `in_compute_dtype`) under autocast to `dtype` while the
    body runs, as `pyplan run --dtype` runs them (None: as they are); as there, autocast's
    casts of the weights are kept throughout (a run casts each once per iteration)."""
    import torch

    if dtype is None:
        yield
        return
    _COMPUTE[0] = (device.type, dtype)
    try:
        with torch.autocast(device.type, dtype=dtype, enabled=False):
            yield
    finally:
        _COMPUTE[0] = None


def in_compute_dtype(fn):
    """fn(*args) under computing_in's autocast (a loss: the run computes it so)."""
    def call(*args):
        with _autocast():
            return fn(*args)
    return call


def _autocast():
    if _COMPUTE[0] is None:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(_COMPUTE[0][0], dtype=_COMPUTE[0][1])


def guarded(module, what: str):
    """module(*args) as the user's code: an exception (SystemExit too) is a UserCodeError
    naming `what` (e.g. "unit layers.3"), and so is an output that is not a tensor or a
    tuple, list or dict of tensors; under computing_in's autocast."""
    from pyplan.comm.values import flatten

    def call(*args):
        try:
            with _autocast():
                out = module(*args)
        except (PyplanError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # noqa: BLE001 - the user's forward failed
            raise UserCodeError(f"{what}: its forward raised {describe_exception(exc)}",
                                hint="call the model on a micro-batch yourself to see "
                                     "where") from None
        flatten(out, what)
        return out
    return call


@contextlib.contextmanager
def users_code(command: str):
    """The body calls the user's code (pyplan partition, pyplan profile): a sys.exit or
    os._exit in it, or a KeyboardInterrupt it raises itself (not Ctrl-C's), is one
    UserCodeError naming the function that did it, not the end of the command. os._exit is
    pyplan's to refuse only in this process (a child the user's code forks ends as it asks)."""
    pid, real_exit = os.getpid(), os._exit
    handler = signal.getsignal(signal.SIGINT)

    def refused(code):
        if os.getpid() != pid:
            real_exit(code)
        raise OsExit(code)

    os._exit = refused
    try:
        yield
    except OsExit as exc:
        raise _ended(exc, f"called os._exit({exc.code!r})", command) from None
    except SystemExit as exc:
        raise _ended(exc, f"called sys.exit({exc.code!r})", command) from None
    except KeyboardInterrupt as exc:
        # Ctrl-C swaps pyplan's handler (pyplan.cli.main.catch_interrupts); with Python's own
        # handler a Ctrl-C cannot be told from the user's raise: an interrupt, as it was.
        if signal.getsignal(signal.SIGINT) is not handler or \
                handler is signal.default_int_handler:
            raise
        raise _ended(exc, "raised KeyboardInterrupt", command) from None
    finally:
        os._exit = real_exit


_OURS = {"pyplan", "torch", "contextlib", "functools", "threading"}


def _ended(exc: BaseException, did: str, command: str) -> UserCodeError:
    """The error for the user's function (the innermost frame outside pyplan, torch and the
    standard library's wrappers) that did `did`."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_frame.f_globals.get("__name__", ""),
                       tb.tb_lineno))
        tb = tb.tb_next
    user = next(((code, line) for code, module, line in reversed(frames)
                 if module.partition(".")[0] not in _OURS), None)
    who = "the user's code" if user is None else \
        f"{getattr(user[0], 'co_qualname', user[0].co_name)} " \
        f"({os.path.basename(user[0].co_filename)}:{user[1]})"
    return UserCodeError(f"{who} {did} while pyplan {command} measured the model; the model's "
                         "code must return or raise, not end the process",
                         hint="raise an exception instead (it is reported with the unit)")
