"""hsx: hidden-state extraction service.

from hsx import HsxClient                          # the SDK (sync); AsyncHsxClient for asyncio
from hsx.training import HiddenStateDataset        # needs the [training] extra (torch)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsx.sdk import AsyncHsxClient, HsxClient, HsxError

__all__ = ["AsyncHsxClient", "HsxClient", "HsxError"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing one of hsx's modules (the migrations, the CLI) does not load the SDK.
    if name in __all__:
        import hsx.sdk

        return getattr(hsx.sdk, name)
    raise AttributeError(f"module 'hsx' has no attribute {name!r}")
