"""Errors a user can cause, each mapped to one exit code and printed as one line.

Plan errors print as ``FILE:LINE:COL: error: MESSAGE (hint: HINT)`` so editors and CI logs can jump
to the spot; a plan with several independent mistakes (schema violations) reports up to
MAX_REPORTED of them, one line each, in file order. Internal bugs are not wrapped: they keep
their traceback.
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import NoReturn

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INFEASIBLE",
    "EXIT_INTERRUPTED",
    "EXIT_PREEMPTED",
    "EXIT_RUN_FAILED",
    "MAX_REPORTED",
    "InfeasibleError",
    "PlanError",
    "PyplanError",
    "RunError",
    "UserCodeError",
    "describe_exception",
    "did_you_mean",
]

EXIT_RUN_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 75
"""`pyplan run` stopped early on request (SIGTERM, SIGUSR1, --max-time), its state saved with
--save: the same command line continues (--resume auto). sysexits.h's EX_TEMPFAIL, "try again
later"; not 143 (128 + SIGTERM), which shells and schedulers also report for a process the
signal killed with nothing saved."""
MAX_REPORTED = 10


class PyplanError(Exception):
    """Root of every error a user can cause; carries the process exit code."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, hint: str | None = None,
                 file: str | None = None, line: int = 1, column: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.file = file
        self.line = line
        self.column = column
        self.others: list[PyplanError] = []
        """Further independent errors of the same input, after this one (MAX_REPORTED in all)."""

    def report(self) -> str:
        """This error and the others, one line each."""
        return "".join(f"{e}\n" for e in [self, *self.others][:MAX_REPORTED])

    def __str__(self) -> str:
        text = f"error: {self.message}"
        if self.hint:
            text += f" (hint: {self.hint})"
        if self.file is not None:
            text = f"{self.file}:{self.line}:{self.column}: {text}"
        # One line, whatever a user-written value inside the message contains.
        return text.replace("\r", "\\r").replace("\n", "\\n")


class PlanError(PyplanError):
    """A plan or resolved plan that cannot be read, is invalid, or is stale (exit 2)."""


class InfeasibleError(PyplanError):
    """A valid plan that admits no schedule, e.g. too little memory (exit 3)."""

    exit_code = EXIT_INFEASIBLE


class RunError(PyplanError):
    """`pyplan run` failed: a rank died, a check failed, or the world does not fit (exit 1)."""

    exit_code = EXIT_RUN_FAILED


class TimeLimitError(PyplanError):
    """The user's code measured by pyplan went past its time limit (exit 2): raised into the
    user's code, so each `except Exception` that calls the model lets it through."""


class UserCodeError(RunError):
    """The user's own code (the model's factory, forward, data or loss) failed or returned what
    pyplan cannot take (exit 2): the message names the function, the unit or micro-batch."""

    exit_code = EXIT_BAD_INPUT


class OsExit(SystemExit):
    """os._exit called by the user's code where pyplan refuses it (pyplan.measure.limits
    .users_code): caught wherever a SystemExit of the user's code is."""


def describe_exception(exc: BaseException) -> str:
    """An exception the user's code raised, in a few words: "ValueError: first line"."""
    if isinstance(exc, OsExit):
        return f"OsExit({exc.code!r}) (it called os._exit)"
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}) (it called sys.exit)"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def did_you_mean(word: str, choices) -> str | None:
    """A "did you mean 'x'?" hint for a misspelt name, or None."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None


def exit_now(code: int) -> NoReturn:
    """End the process with exit code `code` once stdout and stderr are flushed, without
    Python's teardown (a rank: pyplan.comm.leave; a launcher whose workers ended:
    pyplan.cli.launch)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a closed pipe: nothing more to say
            pass
    os._exit(code)
