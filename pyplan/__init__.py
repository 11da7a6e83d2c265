"""pyplan: plan, solve and run pipeline-parallel schedules for deep-learning training and
inference."""

from __future__ import annotations

import os
import sys

from pyplan._version import __version__


def _borrow_core() -> None:
    """Python started in a source checkout (its root is on sys.path first) imports this
    folder, which has no compiled core unless it was built in place: take the core of the
    pyplan installed in the environment (`pip install .` put it in site-packages), so the
    repository's root works as any other folder does."""
    from importlib.machinery import EXTENSION_SUFFIXES

    def has_core(folder: str) -> bool:
        return any(os.path.isfile(os.path.join(folder, "_core" + suffix))
                   for suffix in EXTENSION_SUFFIXES)

    here = os.path.dirname(os.path.abspath(__file__))
    if has_core(here):
        return
    for entry in sys.path:
        folder = os.path.join(os.path.abspath(entry or os.curdir), "pyplan")
        if folder != here and has_core(folder):
            __path__.append(folder)  # noqa: F821 (the package's own search path)
            return


_borrow_core()

# The Python API (pyplan/api.py), imported on first use so that `import pyplan` stays cheap.
_API = ("Baseline", "PartitionPlan", "Plan", "ResolvedPlan", "Solution", "load_plan",
        "load_resolved", "partition_plans", "solve", "templates", "with_overrides")
_ERRORS = ("InfeasibleError", "PlanError", "PyplanError")
_TORCH = ("partition_model",)  # needs torch (pyplan.measure.partitioner)
__all__ = ["__version__", *_API, *_ERRORS, *_TORCH]


def __getattr__(name: str):
    if name in _API:
        from pyplan import api
        return getattr(api, name)
    if name in _ERRORS:
        from pyplan import errors
        return getattr(errors, name)
    if name in _TORCH:
        from pyplan.measure import partitioner
        return getattr(partitioner, name)
    raise AttributeError(f"module 'pyplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
