"""Training-side access to a job's hidden states: a PyTorch Dataset over its shards (the layer
conventions it follows are hsx.layers').

from hsx.training import HiddenStateDataset        # needs torch (the [training] extra)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsx.training.dataset import HiddenStateDataset

__all__ = ["HiddenStateDataset"]


def __getattr__(name: str) -> Any:
    # Lazy: torch is loaded when the Dataset is asked for, not when the package is imported.
    if name == "HiddenStateDataset":
        from hsx.training.dataset import HiddenStateDataset

        return HiddenStateDataset
    raise AttributeError(f"module 'hsx.training' has no attribute {name!r}")
