"""pyplan: plan, solve and run pipeline-parallel schedules for deep-learning training and
inference."""

from __future__ import annotations

from pyplan._version import __version__

# The Python API (pyplan/api.py), imported on first use so that `import pyplan` stays cheap.
_API = ("Baseline", "PartitionPlan", "Plan", "ResolvedPlan", "Solution", "load_plan",
        "load_resolved", "partition_plans", "solve", "templates", "with_overrides")
_ERRORS = ("InfeasibleError", "PlanError", "PyplanError")
__all__ = ["__version__", *_API, *_ERRORS]


def __getattr__(name: str):
    if name in _API:
        from pyplan import api
        return getattr(api, name)
    if name in _ERRORS:
        from pyplan import errors
        return getattr(errors, name)
    raise AttributeError(f"module 'pyplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
