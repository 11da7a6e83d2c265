"""`pyplan` entry point: parse arguments, dispatch to a subcommand, map errors to exit codes."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from pyplan._version import __version__
from pyplan.options.numbers import name_numbers
from pyplan.options.environment import check_environment
from pyplan.errors import EXIT_INTERRUPTED, PlanError, PyplanError, exit_now
from pyplan.export import FORMATS as EXPORTS

__all__ = ["entry", "main"]

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as shells report it

# subcommand -> module in pyplan.cli; each module has add_arguments(parser) and run(args) -> int
_COMMANDS = {
    "validate": ("validate", "check plans and print a one-line summary of each"),
    "solve": ("solve", "search a schedule and write PLAN.resolved.yaml"),
    "show": ("show", "draw a schedule as a timeline in the terminal"),
    "export": ("export", "write a schedule or the plan's layout: " + ", ".join(EXPORTS)),
    "import": ("import_", "evaluate a torch.distributed.pipelining schedule CSV on a plan"),
    "run": ("run", "execute a resolved plan under torchrun (one process per device)"),
    "profile": ("profile", "measure block times and memory of a plan's model"),
    "partition": ("partition", "profile a PyTorch model and cut it into pipeline stages: a plan"),
    "consolidate": ("consolidate", "write a checkpoint of pyplan run as the whole model's state "
                                   "dict"),
    "plan": ("plan", "plan a training run on a cluster that is not here: layout, schedule, "
                     "time, memory"),
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its usage errors one line like every other error (exit 2)."""

    def error(self, message: str):
        raise PlanError(message, hint=f"{self.prog} --help")


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with `command`, only that subcommand's module is imported (each
    pulls in what it needs: z3, torch, the exporters), which keeps a command's start fast."""
    parser = _Parser(
        prog="pyplan",
        description="Plan, solve and run pipeline-parallel schedules.")
    parser.add_argument("--version", action="version", version=f"pyplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=_Parser)
    for name, (module, help_text) in _COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module)
        if command in (None, name):
            _load(module).add_arguments(sub_parser)
            name_numbers(sub_parser)
    return parser


def _load(module: str):
    return importlib.import_module(f"pyplan.cli.{module}")


def _core_problem() -> PyplanError | None:
    """Why the compiled core cannot be imported, as one line (a source tree without a build
    shadows the installed package when Python starts in it with -m)."""
    try:
        from pyplan import _core  # noqa: F401
    except ImportError as exc:
        where = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return PyplanError(
            f"pyplan's compiled core (pyplan._core) cannot be imported from {where}: {exc}",
            hint="in a source tree, run the installed `pyplan` command (not python -m pyplan) "
                 "or start from another folder; or build it here: pip install -e .")
    return None


def catch_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt once (the commands say "interrupted", exit 130). A
    second SIGINT (a rank gets the terminal's and torchrun's) while the first unwinds would
    land anywhere, in a weakref callback as a printed traceback or in the error report
    itself: it ends the process at once, with the same code."""
    def interrupted(signum, frame) -> None:
        signal.signal(signal.SIGINT, lambda *_: exit_now(EXIT_INTERRUPTED))
        sys.unraisablehook = lambda _: None  # objects cut off mid-construction complain
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, interrupted)


def entry() -> None:
    """The `pyplan` command: main()'s exit code. A rank under torchrun leaves without Python's
    teardown (pyplan.comm.leave says why), and so does a launcher whose workers have
    ended (pyplan.cli.launch: the teardown of torch would cost it a second of CPU)."""
    catch_interrupts()
    code = main()
    if "RANK" in os.environ and "torch.distributed" in sys.modules:
        from pyplan.comm import leave

        leave(code)
    launcher = sys.modules.get("pyplan.cli.launch")
    if launcher is not None and launcher.launched:
        exit_now(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 run failed, 2 bad input, 3 infeasible)."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        problem = _core_problem()
        if problem is not None:
            raise problem
        args = _parser(command if command in _COMMANDS else None).parse_args(argv)
        check_environment(args.command)
        return _load(args._module).run(args)
    except PyplanError as exc:
        # One write: under torchrun every rank shares stderr, and print() writes the newline
        # separately (stderr is unbuffered when it is a pipe), so lines would interleave.
        sys.stderr.write(exc.report())
        return exc.exit_code
    except BrokenPipeError:
        # `pyplan show ... | head` closed our stdout: stop quietly, like other Unix tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        # Objects cut off mid-construction (a Z3 context, say) complain when collected at
        # exit; after an interrupt that is noise.
        sys.unraisablehook = lambda _: None
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
