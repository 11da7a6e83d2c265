"""A one-line live progress display for long searches (rich, only on a terminal)."""

from __future__ import annotations

import sys
import time

__all__ = ["live_progress"]


class _RichProgress:
    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console(stderr=True)
        self.live = Live(console=self.console, transient=True, refresh_per_second=8)
        self.started = time.monotonic()

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        return self.live.__exit__(*exc)

    def update(self, *, phase: str, n_r=None, candidates: int = 0, best=None, bound=None):
        from rich.text import Text

        parts = [f"[{time.monotonic() - self.started:5.1f}s] {phase}"]
        if n_r is not None:
            parts.append(f"N_R {n_r}")
        parts.append(f"{candidates} candidates")
        if best is not None:
            parts.append(f"best period {best} (bound {bound})")
        self.live.update(Text(" | ".join(parts), style="cyan"))


class _Silent:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, **fields) -> None:
        pass


def live_progress(enabled: bool):
    """A context manager whose .update(...) shows the search state when stderr is a terminal."""
    if enabled and sys.stderr.isatty():
        return _RichProgress()
    return _Silent()
