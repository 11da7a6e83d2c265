"""pyplan: plan, solve and run pipeline-parallel schedules for deep-learning training and
inference."""

from __future__ import annotations

try:
    from pyplan import _core  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "pyplan's compiled core (pyplan._core) is missing or does not load: "
        f"{exc}. Build and install the package with `pip install .` (or `pip install -e .` "
        "for development) from the source tree; it needs a C++17 compiler and CMake."
    ) from exc

__version__ = "0.1.0"
__all__ = ["__version__"]
