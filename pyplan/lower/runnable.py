"""What solve accepts, `pyplan run --dry-run` accepts too: a plan with a model: section is
checked for what the runtime needs of its blocks when the plan is read, at its model: key."""

from __future__ import annotations

from pathlib import Path

from pyplan.errors import PlanError
from pyplan.lower import check_runnable
from pyplan.problem import Problem
from pyplan.planfile import load_yaml

__all__ = ["check_model"]


def check_model(problem: Problem) -> None:
    """A plan with a model: section is one `pyplan run` can run (one last forward block whose
    output goes to the loss, backward blocks derived), or PlanError at its model: key: what
    solve accepts, run --dry-run accepts too."""
    if problem.model is None:
        return
    try:
        check_runnable(problem)
    except PlanError as exc:
        path = problem.source_path
        try:
            source = load_yaml(path) if path and Path(path).is_file() else None
        except PlanError:
            source = None
        if source is not None and source.sha256 == problem.spec_sha256:
            raise source.error(("model",), exc.message, exc.hint, key=True) from None
        raise
