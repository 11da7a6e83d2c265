"""Command-line interface: `main` parses and dispatches; one module per subcommand."""

from pyplan.cli.main import main

__all__ = ["main"]
