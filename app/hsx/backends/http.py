"""What every model-server client shares: one HTTP connection pool, and errors sorted into the
server's (BackendUnavailable: not reachable or not ready, nothing about the sample is wrong) and the
request's (BackendRejected: the server refused what was sent)."""

from __future__ import annotations

from typing import Any

import httpx


class BackendUnavailable(Exception):
    """The model server cannot be reached or is not ready; nothing about the sample is wrong."""


class BackendRejected(Exception):
    """The model server answered the request with an error about the request itself."""


class HttpBackend:
    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=5.0))

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        self._raise_for_status(resp, method, path)
        return resp

    @staticmethod
    def _raise_for_status(resp: httpx.Response, method: str, path: str) -> None:
        if resp.status_code in (502, 503, 504):
            raise BackendUnavailable(f"{method} {path}: HTTP {resp.status_code}")
        if resp.status_code >= 400:
            raise BackendRejected(f"{method} {path}: HTTP {resp.status_code}: {resp.text[:500]}")

    def health(self) -> None:
        """Raises BackendUnavailable until the server says it is ready (503 while it starts)."""
        self._request("GET", "/health")
