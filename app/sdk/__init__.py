"""Python SDK for the hsx service."""

from app.sdk.client import HsxClient, HsxError

__all__ = ["HsxClient", "HsxError"]
