"""HTTP client for the subset of SGLang's native API that extraction uses."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from hsx.backends.http import BackendRejected, BackendUnavailable, HttpBackend

STREAM_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class GenerateResult:
    rid: str
    prompt_tokens: int
    cached_tokens: int
    meta_info: dict[str, Any]


class SGLangClient(HttpBackend):
    def __init__(self, base_url: str, timeout_s: float = 600.0):
        super().__init__(base_url, timeout_s)
        self._old_info_paths = False  # the server knows only /get_model_info and /get_server_info

    def model_info(self) -> dict[str, Any]:
        return self._info("/model_info", "/get_model_info")

    def server_info(self) -> dict[str, Any]:
        return self._info("/server_info", "/get_server_info")

    def _info(self, path: str, deprecated: str) -> dict[str, Any]:
        """SGLang 0.5.23 logs /get_model_info and /get_server_info as deprecated for /model_info and
        /server_info; servers before it (and patched ones) know only the old names. The new name is
        asked first, the old one where the server does not have it, and the answer remembered."""
        if self._old_info_paths:
            return self._request("GET", deprecated).json()
        try:
            resp = self._http.request("GET", path)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"GET {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in (404, 405):
            self._old_info_paths = True
            return self._request("GET", deprecated).json()
        self._raise_for_status(resp, "GET", path)
        return resp.json()

    def prefill(self, input_ids: list[int], rid: str, *, asks: str | None = None) -> GenerateResult:
        """The forward whose hidden states we collect: the prompt and one new token.

        `max_new_tokens` is 1 because SGLang gives a request with 0 its prefill-only path (no hidden
        states). The rid doubles as `extra_key`: unique per attempt, it keeps SGLang's prefix cache
        from serving any of the prompt from an earlier request (`cached_tokens` says if it did).
        """
        data = self._request("POST", "/generate", json=generate_body(input_ids, rid, asks)).json()
        return parse_answer(data, rid)

    @contextmanager
    def generate_stream(self, input_ids: list[int], rid: str, asks: str) -> Iterator[Iterator[bytes]]:
        """The same request, its answer's body as a stream of chunks (hidden states can be gigabytes of JSON)."""
        body = generate_body(input_ids, rid, asks)
        try:
            with self._http.stream("POST", "/generate", json=body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    self._raise_for_status(resp, "POST", "/generate")
                yield self._chunks(resp)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"POST /generate: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _chunks(resp: httpx.Response) -> Iterator[bytes]:
        yield from resp.iter_bytes(STREAM_CHUNK_BYTES)


# What a request asks for besides the token, by Capture.asks:
#   hidden_states  the prompt's rows in the answer (`return_hidden_states: true`, a bool: SGLang's API
#                  contract refuses anything else);
#   logprob        nothing the answer needs, but SGLang fills the per-request row counts the hsx-sglang
#                  plugin reads only for batches that return logprobs or hidden states; logprobs of the
#                  one new token keep the answer a few hundred bytes.
ASKS = {"hidden_states": "return_hidden_states", "logprob": "return_logprob"}


def generate_body(input_ids: list[int], rid: str, asks: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "rid": rid,
        "extra_key": rid,
        "sampling_params": {"max_new_tokens": 1},
    }
    if asks is not None:
        body[ASKS[asks]] = True
    return body


def parse_answer(data: object, rid: str) -> GenerateResult:
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise BackendRejected(f"POST /generate: the answer has no meta_info: {str(data)[:200]}")
    return GenerateResult(
        rid=str(meta.get("id", rid)),
        prompt_tokens=int(meta.get("prompt_tokens", -1)),
        cached_tokens=int(meta.get("cached_tokens", 0) or 0),
        meta_info=meta,
    )
