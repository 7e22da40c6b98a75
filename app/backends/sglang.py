"""HTTP client for the subset of SGLang's native API that extraction uses."""

from __future__ import annotations

from dataclasses import dataclass

import httpx


class BackendUnavailable(Exception):
    """The model server cannot be reached or is not ready; nothing about the sample is wrong."""


class BackendRejected(Exception):
    """The model server answered the request with an error about the request itself."""


@dataclass(frozen=True)
class GenerateResult:
    rid: str
    prompt_tokens: int
    cached_tokens: int
    meta_info: dict


class SGLangClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=5.0))

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in (502, 503, 504):
            raise BackendUnavailable(f"{method} {path}: HTTP {resp.status_code}")
        if resp.status_code >= 400:
            raise BackendRejected(f"{method} {path}: HTTP {resp.status_code}: {resp.text[:500]}")
        return resp

    def health(self) -> None:
        """Raises BackendUnavailable until the server says it is ready (SGLang: 503 while starting)."""
        self._request("GET", "/health")

    def model_info(self) -> dict:
        return self._request("GET", "/get_model_info").json()

    def server_info(self) -> dict:
        return self._request("GET", "/get_server_info").json()

    def prefill(self, input_ids: list[int], rid: str) -> GenerateResult:
        """One prefill-only forward (`max_new_tokens` 0): the request whose dump we collect."""
        body = {"input_ids": input_ids, "rid": rid, "sampling_params": {"max_new_tokens": 0}}
        data = self._request("POST", "/generate", json=body).json()
        if isinstance(data, list):
            data = data[0]
        meta = data.get("meta_info", {})
        return GenerateResult(
            rid=str(meta.get("id", rid)),
            prompt_tokens=int(meta.get("prompt_tokens", -1)),
            cached_tokens=int(meta.get("cached_tokens", 0) or 0),
            meta_info=meta,
        )
