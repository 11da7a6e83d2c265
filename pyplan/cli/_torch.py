"""Commands that need torch import it through here, so a missing torch is one line."""

from __future__ import annotations

import warnings

from pyplan.errors import RunError

__all__ = ["require_torch"]


def require_torch(command: str, *, runtime: bool = True) -> None:
    """Import pyplan's runtime (and with it torch), or only torch's launcher (runtime=False:
    all that `pyplan run --nproc-per-node` needs itself), or raise a one-line RunError."""
    try:
        with warnings.catch_warnings():
            # torch warns at import when numpy is absent (as in pyplan.run)
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy",
                                    category=UserWarning)
            import torch  # noqa: F401
            import torch.distributed.run  # noqa: F401
        if runtime:
            import pyplan.runtime  # noqa: F401
    except ImportError as exc:
        raise RunError(f"pyplan {command} needs torch ({exc})",
                       hint='install a pinned torch: pip install "torch==2.13.0" ".[run]"') \
            from None
