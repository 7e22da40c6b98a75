"""Training-side access to a job's hidden states: a PyTorch Dataset and the layer conventions.

from hsx.training import HiddenStateDataset        # needs torch (the [training] extra)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsx.training.dataset import HiddenStateDataset

__all__ = ["HiddenStateDataset"]


def __getattr__(name: str) -> Any:
    # Lazy: hsx.training.layers is used without torch; only the Dataset needs it.
    if name == "HiddenStateDataset":
        from hsx.training.dataset import HiddenStateDataset

        return HiddenStateDataset
    raise AttributeError(f"module 'hsx.training' has no attribute {name!r}")
