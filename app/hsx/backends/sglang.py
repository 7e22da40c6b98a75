"""What hsx's two SGLang engines share (hsx.backends.engines.sglang_dumps and .sglang_answers): the client
for the part of SGLang's native API they use, and what they read of the server.

Both read the same answers, once per look (hsx.backends.engine.Look): /model_info and /server_info (the
old /get_model_info and /get_server_info on servers before 0.5.23), and `hsx-plugin.json`, which the
hsx-sglang plugin writes into the dump root (deploy/sglang/README.md). Both refuse chunked prefill, which
would give a prompt's rows in pieces, and both can regenerate answers through /generate.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from hsx.backends.dumps import DumpRejected
from hsx.backends.engine import Capture, CaptureProblem, Engine, Limits, Look, Server, count
from hsx.backends.http import BackendRejected, BackendUnavailable, HttpBackend

STREAM_CHUNK_BYTES = 1 << 20
PLUGIN_INFO_FILE = "hsx-plugin.json"
PLUGIN_INFO_FORMAT = "hsx-plugin/1"


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

    def prefill(self, input_ids: list[int], rid: str, *, also_returns: str | None = None) -> GenerateResult:
        """The forward whose hidden states we collect: the prompt and one new token.

        `max_new_tokens` is 1 because SGLang gives a request with 0 its prefill-only path (no hidden
        states). The rid doubles as `extra_key`: unique per attempt, it keeps SGLang's prefix cache
        from serving any of the prompt from an earlier request (`cached_tokens` says if it did).
        """
        data = self._request("POST", "/generate", json=generate_body(input_ids, rid, also_returns)).json()
        return parse_answer(data, rid)

    @contextmanager
    def generate_stream(self, input_ids: list[int], rid: str, also_returns: str) -> Iterator[Iterator[bytes]]:
        """The same request, its answer's body as a stream of chunks (hidden states can be gigabytes of JSON)."""
        body = generate_body(input_ids, rid, also_returns)
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


# What an answer may also return besides the new token, and the request's flag that asks for it:
#   hidden_states  the prompt's rows in the answer (`return_hidden_states: true`, a bool: SGLang's API
#                  contract refuses anything else);
#   logprob        nothing the answer needs, but SGLang fills the per-request row counts the hsx-sglang
#                  plugin reads only for batches that return logprobs or hidden states; logprobs of the
#                  one new token keep the answer a few hundred bytes.
RETURN_FLAGS = {"hidden_states": "return_hidden_states", "logprob": "return_logprob"}


def generate_body(input_ids: list[int], rid: str, also_returns: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "rid": rid,
        "extra_key": rid,
        "sampling_params": {"max_new_tokens": 1},
    }
    if also_returns is not None:
        body[RETURN_FLAGS[also_returns]] = True
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


def check_answer(result: GenerateResult, num_tokens: int) -> None:
    """The answer must be for the whole prompt, none of it served from the prefix cache."""
    if result.cached_tokens:
        raise DumpRejected("cached_tokens", f"server served {result.cached_tokens} prompt tokens from its cache")
    if result.prompt_tokens != num_tokens:
        raise DumpRejected(
            "server_token_count", f"server reports {result.prompt_tokens} prompt tokens, sample has {num_tokens}"
        )


def read_plugin_info(dump_root: Path) -> dict[str, Any] | None:
    """The plugin's description of its dumps, or None when no plugin writes into this root."""
    path = Path(dump_root) / PLUGIN_INFO_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CaptureProblem(f"{path} is unreadable: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != PLUGIN_INFO_FORMAT:
        raise CaptureProblem(f"{path} is not an {PLUGIN_INFO_FORMAT} description")
    return info


@dataclass(frozen=True)
class Said:
    """What an SGLang-style server says of itself, and the plugin's description in its dump root."""

    model_info: dict[str, Any]
    server_info: dict[str, Any]
    plugin_info: dict[str, Any] | None = None

    @property
    def described_dumps(self) -> dict[str, Any] | None:
        """The dumps a patched SGLang (or the reference server) describes in its server info (`hs_dump`)."""
        return self.server_info.get("hs_dump") or None

    @property
    def applies_seed(self) -> bool:
        """Whether a request's sampling_seed is applied: SGLang 0.5.23 reads it only when launched with
        --enable-deterministic-inference (sampling_batch_info.py); otherwise each run samples anew."""
        return self.server_info.get("enable_deterministic_inference") is True

    @property
    def returns_rows(self) -> bool:
        """Whether the server can answer every prompt row (SGLang's hidden-states mode `full`)."""
        mode = self.server_info.get("return_hidden_states_mode")
        # SGLang's get_server_return_hidden_states_mode: "last" wins, then "full" or the legacy flag.
        return mode != "last" and (mode == "full" or bool(self.server_info.get("enable_return_hidden_states")))

    def check_whole_prompts(self) -> None:
        """CaptureProblem when the server splits prompts into chunks, whose rows would come in pieces."""
        chunk = self.server_info.get("chunked_prefill_size")
        if isinstance(chunk, int) and chunk > 0:
            raise CaptureProblem(
                f"the server splits prompts into chunks of {chunk} tokens (chunked prefill), so a prompt's rows "
                "would come in pieces; restart it with --chunked-prefill-size -1"
            )


class SGLangEngine(Engine):
    """What both SGLang engines do alike: read what the server says, once per look; its limits; regenerate."""

    regenerates = True

    def __init__(self, server: Server, capture: Capture):
        super().__init__(server, capture)
        self.client = server.client(SGLangClient)

    @classmethod
    def discover(cls, look: Look) -> Engine | None:
        return cls.of(look.server, cls.said(look), auto=look.auto)

    @classmethod
    @abstractmethod
    def of(cls, server: Server, said: Said, *, auto: bool) -> Engine | None:
        """The engine for what the server says (no request made); with auto, None unless it takes this server."""

    @staticmethod
    def said(look: Look) -> Said:
        """What the server says now, read once however many SGLang engines look. After an outage /health
        is asked first: a restarting server answers some endpoints before it is ready."""

        def read() -> Said:
            client = look.server.client(SGLangClient)
            if look.after_outage:
                client.health()
            model_info = client.model_info()
            server_info = client.server_info()
            return Said(model_info, server_info, read_plugin_info(look.server.root.path))

        return look.once("sglang", read)

    @classmethod
    def limits(cls, server: Server) -> Limits:
        client = server.client(SGLangClient)
        model = client.model_info()
        info = client.server_info()
        dump = info.get("hs_dump") or {}
        return Limits(
            vocab_size=count(model.get("vocab_size")),
            # the longest request input it takes, else the model's context length
            max_tokens=count(info.get("max_req_input_len") or model.get("max_position_embeddings")),
            layers=dump.get("layers"),
            hidden_size=model.get("hidden_size"),
            dtype=dump.get("dtype") or model.get("dtype"),
        )
