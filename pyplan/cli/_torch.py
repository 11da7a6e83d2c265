"""Commands that need torch import it through here, so a missing torch is one line."""

from __future__ import annotations

from pyplan.errors import RunError

__all__ = ["require_torch"]


def require_torch(command: str) -> None:
    """Import pyplan's runtime (and with it torch), or raise a one-line RunError."""
    try:
        import pyplan.runtime  # noqa: F401
        import torch.distributed.run  # noqa: F401
    except ImportError as exc:
        raise RunError(f"pyplan {command} needs torch ({exc})",
                       hint='install a pinned torch: pip install "torch==2.13.0" ".[run]"') \
            from None
