"""The solve progress line: rich on a terminal, silent otherwise."""

from __future__ import annotations

from pyplan.cli._progress import _RichProgress, _Silent, live_progress


def test_not_a_terminal_is_silent():
    assert isinstance(live_progress(True), _Silent)  # pytest captures stderr
    assert isinstance(live_progress(False), _Silent)


def test_rich_line_shows_phase_candidates_and_best_vs_bound():
    progress = _RichProgress()
    progress.update(phase="enumeration", n_r=4, candidates=120, best=6, bound=4)
    text = progress.live.renderable.plain
    assert "enumeration | N_R 4 | 120 candidates | best period 6 (bound 4)" in text
