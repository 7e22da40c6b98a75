"""Training-side access to a job's hidden states: a PyTorch Dataset over a finished job's shards, and a
stream that follows a job while it runs (the layer conventions both follow are hsx.layers').

from hsx.training import HiddenStateDataset, HiddenStateStream        # need torch (the [training] extra)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsx.training.dataset import HiddenStateDataset
    from hsx.training.stream import Expect, HiddenStateStream

__all__ = ["Expect", "HiddenStateDataset", "HiddenStateStream"]


def __getattr__(name: str) -> Any:
    # Lazy: torch is loaded when the Dataset or the stream is asked for, not when the package is imported.
    if name == "HiddenStateDataset":
        from hsx.training.dataset import HiddenStateDataset

        return HiddenStateDataset
    if name in ("HiddenStateStream", "Expect"):
        from hsx.training import stream

        return getattr(stream, name)
    raise AttributeError(f"module 'hsx.training' has no attribute {name!r}")
