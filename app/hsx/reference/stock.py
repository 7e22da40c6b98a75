"""Stock mode (`--stock-sglang`): the reference model behind SGLang 0.5.23's HTTP behaviour, with
dumps written by the hsx-sglang plugin's own hook code, or none at all.

What follows SGLang 0.5.23 (read from its source; deploy/sglang/README.md has the paths):

- /generate: `rid` is optional (a uuid4 hex otherwise); a string rid of a batch becomes
  "{rid}_{i}"; a rid still in flight is refused with 400 "Duplicate request ID detected: ...".
  `return_hidden_states` and `return_logprob` are a bool or a batch's list of them (the API
  contract refuses anything else, "last" included, with 400 "invalid type: ..."); hidden states
  are refused (400) beyond what the server's mode allows. `meta_info.hidden_states` in mode full
  is a list: the prefill rows
  `[extend_len][W]` (the tokens not served from the prefix cache; with chunked prefill only the
  last chunk's), then one `[W]` row per decode step, cut to the completion's length, so
  `max_new_tokens` 0 gives `[]`; a server in mode "last" gives the last of those rows, `[W]`. W is the hidden size
  (the post-norm last layer), or three times it with aux capture on (the three aux layers side by
  side, ascending). `extra_key` namespaces the prefix cache; `meta_info.cached_tokens` counts hits.
- The warm-up (unless --skip-server-warmup): `input_ids` [10, 11, 12] with max_new_tokens 8, as
  SGLang sends with --skip-tokenizer-init. /health and /health_generate run `input_ids` [0] with
  max_new_tokens 1 and rid HEALTH_CHECK_<uuid>.
- /get_model_info, /model_info, /get_server_info, /server_info use SGLang's field names (server
  arguments as resolved: aux capture resets `speculative_algorithm` to None and sets
  `return_hidden_states_mode` to full; no `hs_dump`).
- The plugin loads as SGLang loads plugins: when `hsx_sglang` is installed and the
  SGLANG_PLUGINS allowlist (if set) names `hsx_dump`; without HSX_DUMP_ROOT it stays idle. It is
  started with a processor and execution features built from these server arguments, then every
  prefill batch goes through its AROUND hook as SGLang's batch result processor would pass it: the
  batch's requests (rid, whole prompt, cached tokens, chunk counter), the per-request extend
  lengths (only when some request of the batch returns hidden states or logprobs, as in SGLang), the aux
  layers side by side and the post-norm last layer, rows of all requests concatenated.

Differences that remain: every sequence runs alone (batch 1, so rows equal a plain transformers
forward bit for bit) and the rows are then concatenated into one batch per /generate call;
decoding is greedy and decode-step rows come from one forward over prompt + completion; there is
no tokenizer (`text` is refused, as with --skip-tokenizer-init), no streaming, no logprobs in the answer
(`return_logprob` is taken, only for the extend lengths it makes SGLang fill), no
overlap scheduler, no CUDA, and the prefix cache is an exact-token trie that never evicts. The
chunked prefill size defaults to -1 (off), where SGLang picks a size from the GPU's memory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from hsx.reference.common import ForwardResult
from hsx.reference.faults import PrefixCache
from hsx.reference.server import BadRequest, RidsInFlight, check_ids, log, parse_extra_keys, parse_max_new_tokens

if TYPE_CHECKING:
    from hsx.reference.model import ModelRunner

SGLANG_VERSION = "0.5.23"
WARMUP_INPUT_IDS = [10, 11, 12]  # SGLang's warm-up with --skip-tokenizer-init
PLUGIN_ENTRY_POINT = "hsx_dump"
# SGLang names the capture convention with --speculative-algorithm; DFLASH and DSPARK need explicit
# layer ids and a draft model's conventions, which the reference server does not model.
AUX_CAPTURE_METHODS = {"EAGLE3": "eagle3"}

# SGLang's CaptureHiddenMode order: NULL < LAST < FULL.
MODES = {None: 0, "last": 1, "full": 2}


class StockError(ValueError):
    """Server arguments SGLang 0.5.23 refuses at start."""


@dataclass
class StockArgs:
    """The SGLang server arguments stock mode honours, named as SGLang names them."""

    model_path: str
    dtype: str
    host: str = "127.0.0.1"
    port: int = 30000
    skip_server_warmup: bool = False
    disable_radix_cache: bool = False
    chunked_prefill_size: int = -1
    enable_return_hidden_states: bool = False
    return_hidden_states_mode: str | None = None
    enable_return_aux_hidden_states: bool = False
    speculative_algorithm: str | None = None
    return_aux_hidden_state_layer_ids: list[int] | None = None

    def check(self) -> None:
        """SGLang's start-up checks of these arguments (its messages, shortened)."""
        if self.return_hidden_states_mode not in (None, "last", "full"):
            raise StockError("return_hidden_states_mode must be one of: None, 'last', or 'full'.")
        if not self.enable_return_aux_hidden_states:
            if self.return_aux_hidden_state_layer_ids is not None:
                raise StockError("--return-aux-hidden-state-layer-ids requires --enable-return-aux-hidden-states.")
            return
        method = (self.speculative_algorithm or "").upper()
        if method not in AUX_CAPTURE_METHODS:
            raise StockError(
                "--enable-return-aux-hidden-states needs --speculative-algorithm EAGLE3 to name the capture "
                f"convention, got {self.speculative_algorithm!r}."
            )
        ids = self.return_aux_hidden_state_layer_ids
        if ids is not None and (not ids or min(ids) < 0 or len(set(ids)) != len(ids)):
            raise StockError(f"--return-aux-hidden-state-layer-ids must be non-empty, non-negative, unique: {ids}")

    @property
    def hidden_mode(self) -> str | None:
        """The server's maximum return_hidden_states mode, as SGLang resolves it."""
        if self.return_hidden_states_mode is not None:
            return self.return_hidden_states_mode
        if self.enable_return_hidden_states or self.enable_return_aux_hidden_states:
            return "full"
        return None

    @property
    def capture_method(self) -> str | None:
        """`get_exec().features.aux_hidden_state_capture`: the aux capture convention, or None."""
        if not self.enable_return_aux_hidden_states:
            return None
        return AUX_CAPTURE_METHODS[(self.speculative_algorithm or "").upper()]

    def resolved(self) -> dict[str, Any]:
        """The arguments as /server_info reports them, after SGLang's resolution."""
        return {
            "model_path": self.model_path,
            "dtype": self.dtype,
            "host": self.host,
            "port": self.port,
            "skip_tokenizer_init": True,
            "skip_server_warmup": self.skip_server_warmup,
            "disable_radix_cache": self.disable_radix_cache,
            "chunked_prefill_size": self.chunked_prefill_size,
            # A given mode turns the legacy flag on; aux capture only raises the mode to full.
            "enable_return_hidden_states": self.enable_return_hidden_states
            or self.return_hidden_states_mode is not None,
            "return_hidden_states_mode": self.hidden_mode,
            "enable_return_aux_hidden_states": self.enable_return_aux_hidden_states,
            # With aux capture the flag only names the convention; SGLang resets it so no draft runs.
            "speculative_algorithm": None if self.enable_return_aux_hidden_states else self.speculative_algorithm,
            "return_aux_hidden_state_layer_ids": self.return_aux_hidden_state_layer_ids,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
        }


def aux_layers(args: StockArgs, num_hidden_layers: int) -> list[int]:
    """The aux layers in HF numbering: SGLang's default [2, L//2, L-3], or each explicit id + 1."""
    if not args.enable_return_aux_hidden_states:
        return []
    ids = args.return_aux_hidden_state_layer_ids
    layers = sorted({2, num_hidden_layers // 2, num_hidden_layers - 3} if ids is None else {i + 1 for i in ids})
    if layers[0] < 1 or layers[-1] >= num_hidden_layers:
        raise StockError(f"aux layers {layers} are outside 1..{num_hidden_layers - 1}")
    return layers


def max_req_input_len(runner: ModelRunner) -> int:
    """The longest prompt SGLang takes: its longest request (the context length less one, with room
    for no more tokens than that) less five (scheduler: max_req_len - 5)."""
    return runner.max_position_embeddings - 1 - 5


def request_mode(value: Any) -> str | None:
    """One return_hidden_states value as a mode. SGLang's scheduler would take the string "last" too,
    but its API contract (srt/entrypoints/api_contract.py) refuses anything but a bool first."""
    if value is True:
        return "full"
    if value is False:
        return None
    raise BadRequest(not_bool_or_list(value))


def not_bool_or_list(value: Any) -> str:
    return f"invalid type: {_contract_type(value)}, expected a value or an array of values for BoolOrList"


def request_flags(body: dict[str, Any], key: str, n: int, is_batch: bool) -> list[bool]:
    """A bool-or-list-of-bools field (return_logprob) per sequence, refused as the API contract refuses it."""
    raw = body.get(key, False)
    values = raw if isinstance(raw, list) and is_batch and len(raw) == n else [raw] * n
    for v in values:
        if not isinstance(v, bool):
            raise BadRequest(
                f"invalid type: {_contract_type(v)}, expected a value or an array of values for BoolOrList"
            )
    return list(values)


def _contract_type(value: Any) -> str:
    """How the API contract's deserializer names a value of the wrong type."""
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, (int, float)):
        return f"{'integer' if isinstance(value, int) else 'floating point'} `{value}`"
    return "map" if isinstance(value, dict) else "null" if value is None else "sequence"


@dataclass
class StockRequest:
    sequences: list[list[int]]
    rids: list[str]
    is_batch: bool
    max_new_tokens: int
    modes: list[str | None]  # per sequence
    extra_keys: list[str | None]
    logprobs: list[bool]  # per sequence: return_logprob


def parse_stock_generate(body: Any, runner: ModelRunner, server_mode: str | None) -> StockRequest:
    """A /generate body as stock SGLang reads it; BadRequest where SGLang refuses it."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    sequences, is_batch = _stock_sequences(body, runner)
    n = len(sequences)
    rids = _stock_rids(body.get("rid"), n, is_batch)
    modes = _stock_modes(body.get("return_hidden_states", False), n, is_batch, server_mode)
    max_new_tokens = parse_max_new_tokens(body)
    return StockRequest(
        sequences,
        rids,
        is_batch,
        max_new_tokens,
        modes,
        parse_extra_keys(body.get("extra_key"), n, is_batch),
        request_flags(body, "return_logprob", n, is_batch),
    )


def _stock_sequences(body: dict[str, Any], runner: ModelRunner) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether the body is a batch (a list of such lists)."""
    if body.get("text") is not None or body.get("input_embeds") is not None:
        raise BadRequest("this server runs with --skip-tokenizer-init: send input_ids")
    raw = body.get("input_ids")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("input_ids is required: a list of token ids or a list of such lists")
    is_batch = isinstance(raw[0], list)
    max_len = max_req_input_len(runner)
    sequences = [
        check_ids(ids, f"input_ids[{n}]" if is_batch else "input_ids", runner.vocab_size, max_len)
        for n, ids in enumerate(raw if is_batch else [raw])
    ]
    return sequences, is_batch


def _stock_rids(rid: Any, n: int, is_batch: bool) -> list[str]:
    """One rid per sequence: generated, numbered from the one given, or the batch's list; never twice the same."""
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]
    elif is_batch and isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) for r in rid):
        rids = list(rid)
    else:
        raise BadRequest("The rid should be a string or a list of strings with the same length as the batch.")
    duplicates = sorted({r for r in rids if rids.count(r) > 1})
    if duplicates:
        raise BadRequest(f"Duplicate request IDs detected within the request: {duplicates}")
    return rids


def _stock_modes(raw: Any, n: int, is_batch: bool, server_mode: str | None) -> list[str | None]:
    """Each sequence's return_hidden_states mode, none beyond what the server was launched with."""
    if isinstance(raw, list):
        if not is_batch or len(raw) != n:
            raise BadRequest("The length of return_hidden_states should be equal to the batch size.")
        modes = [request_mode(m) for m in raw]
    else:
        modes = [request_mode(raw)] * n
    if max(MODES[m] for m in modes) > MODES[server_mode]:
        if server_mode is not None:
            raise BadRequest(
                f"The requested return_hidden_states mode exceeds the server maximum `{server_mode}`. "
                "Please launch with `--return-hidden-states-mode full` to allow return_hidden_states=True."
            )
        raise BadRequest(
            "The server is not configured to return hidden states. Please set `--return-hidden-states-mode last`, "
            "`--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag."
        )
    return modes


@dataclass
class PrefillReq:
    """A request as the plugin's hook reads it from SGLang's batch (`Req`)."""

    rid: str
    origin_input_ids: list[int]
    cached_tokens: int
    inflight_middle_chunks: int = 0
    is_retracted: bool = False

    def finished(self) -> bool:
        return False


@dataclass
class PrefillPass:
    """One request's rows of one forward pass (a chunk of its prompt, or all of what was not cached)."""

    req: PrefillReq
    start: int
    stop: int
    # Whether the request returns hidden states or logprobs: only then does SGLang fill the batch's
    # per-request extend lengths (scheduler: `return_logprob or return_hidden_states`).
    fills_lens: bool
    hidden: dict[int, torch.Tensor] = field(repr=False, default_factory=dict)  # layer -> [T, H], the whole prompt


class PluginHost:
    """The hsx-sglang plugin in this process, fed as SGLang's hook registry would feed it."""

    def __init__(self, hooks: Any, processor: Any, aux: list[int], final: int):
        self.hooks = hooks
        self.processor = processor
        self.aux = aux
        self.final = final

    @classmethod
    def load(cls, args: StockArgs, runner: ModelRunner, aux: list[int]) -> PluginHost | None:
        """The plugin as SGLang would load it here, or None where SGLang would run without it."""
        allowed = os.environ.get("SGLANG_PLUGINS")
        if allowed is not None and PLUGIN_ENTRY_POINT not in [n.strip() for n in allowed.split(",")]:
            log(f"plugin {PLUGIN_ENTRY_POINT} not in SGLANG_PLUGINS; no dumps")
            return None
        try:
            from hsx_sglang.plugin import SchedulerHooks
            from hsx_sglang.settings import SettingsError, settings_from_env, shared_boot_id
        except ImportError:
            if os.environ.get("HSX_DUMP_ROOT"):
                raise StockError(
                    "HSX_DUMP_ROOT is set but the hsx-sglang plugin is not installed (pip install ./deploy/sglang)"
                ) from None
            log("the hsx-sglang plugin is not installed; no dumps")
            return None
        try:
            settings = settings_from_env(os.environ)
        except SettingsError as exc:
            raise StockError(str(exc)) from None
        if settings is None:
            log("HSX_DUMP_ROOT is not set: the hsx-sglang plugin is idle; no dumps")
            return None
        hooks = SchedulerHooks(settings, shared_boot_id(os.environ))
        processor = SimpleNamespace(
            is_generation=True,
            model_config=SimpleNamespace(
                num_hidden_layers=runner.num_hidden_layers, hidden_size=runner.hidden_size, dtype=runner.dtype
            ),
        )
        features = SimpleNamespace(
            aux_hidden_state_capture=args.capture_method,
            return_aux_hidden_state_layer_ids=args.return_aux_hidden_state_layer_ids,
        )
        hooks.start(processor, features, 0)
        return cls(hooks, processor, aux, runner.num_hidden_layers)

    def prefill_batch(self, passes: list[PrefillPass]) -> None:
        """One prefill batch's result through the plugin's AROUND hook."""
        lens = [p.stop - p.start for p in passes]
        aux = None
        if self.aux:
            aux = torch.cat([torch.cat([p.hidden[i][p.start : p.stop] for i in self.aux], dim=1) for p in passes])
        last = torch.cat([p.hidden[self.final][p.start : p.stop] for p in passes])
        result = SimpleNamespace(
            extend_input_len_per_req=lens if any(p.fills_lens for p in passes) else None,
            logits_output=SimpleNamespace(hidden_states=aux, last_hidden_states=last, next_token_logits=None),
            copy_done=None,
        )
        batch = SimpleNamespace(reqs=[p.req for p in passes])
        self.hooks.around_prefill(lambda *_: None, self.processor, batch, result)

    def join(self) -> None:
        """Wait until every queued dump is written (tests; SGLang never waits)."""
        capture = self.hooks.capture
        if capture is not None:
            capture.writer.join()


class StockEngine:
    """Runs /generate batches one at a time: each sequence's forward, then the batch through the plugin."""

    def __init__(self, runner: ModelRunner, args: StockArgs, plugin: PluginHost | None):
        self.runner = runner
        self.args = args
        self.plugin = plugin
        self.aux = aux_layers(args, runner.num_hidden_layers)
        self.final = runner.num_hidden_layers
        self.cache = None if args.disable_radix_cache else PrefixCache()
        self.rids = RidsInFlight()
        self._lock = threading.Lock()

    def generate(self, req: StockRequest, *, cacheable: bool = True) -> list[dict[str, Any]]:
        with self.rids.claim(req.rids), self._lock:
            started = time.monotonic()
            results, passes = [], []
            for rid, ids, key, mode, logprob in zip(req.rids, req.sequences, req.extra_keys, req.modes, req.logprobs):
                cache = self.cache if cacheable else None
                cached = cache.match(ids, key) if cache is not None else 0
                # Decoding stops at the context length, as in SGLang.
                n = min(req.max_new_tokens, self.runner.max_position_embeddings - len(ids))
                result = self.runner.run(ids, n)
                if cache is not None:
                    cache.insert(ids, key)
                result.cached_tokens = cached
                results.append(result)
                passes.extend(self._passes(PrefillReq(rid, ids, cached), result, mode is not None or logprob))
            self._through_plugin(passes)
            replies = [
                self._reply(rid, ids, result, mode, passes)
                for rid, ids, result, mode in zip(req.rids, req.sequences, results, req.modes)
            ]
            ms = 1000 * (time.monotonic() - started)
            log(f"batch rids={req.rids} prompts={[len(s) for s in req.sequences]} {ms:.0f}ms")
            return replies

    def _passes(self, req: PrefillReq, result: ForwardResult, fills_lens: bool) -> list[PrefillPass]:
        """The forward passes of one request: one for what the cache did not serve, or one per chunk."""
        hidden = {i: t for i, t in result.hidden_states.items() if isinstance(t, torch.Tensor)}
        total, step = len(req.origin_input_ids), self.args.chunked_prefill_size
        step = step if step > 0 else total
        bounds = [(a, min(a + step, total)) for a in range(req.cached_tokens, total, step)]
        passes = []
        for n, (a, b) in enumerate(bounds):
            chunk_req = req if n == len(bounds) - 1 else PrefillReq(req.rid, req.origin_input_ids, req.cached_tokens, 1)
            passes.append(PrefillPass(chunk_req, a, b, fills_lens, hidden))
        return passes

    def _through_plugin(self, passes: list[PrefillPass]) -> None:
        if self.plugin is None:
            return
        # A middle chunk is a forward pass of its own; the batch holds every request's last pass.
        for p in passes:
            if p.req.inflight_middle_chunks:
                self.plugin.prefill_batch([p])
        self.plugin.prefill_batch([p for p in passes if not p.req.inflight_middle_chunks])

    def _rows(self, hidden: dict[int, torch.Tensor], start: int, stop: int) -> torch.Tensor:
        """What SGLang's logits output holds as `hidden_states`: the aux layers side by side, or layer L."""
        if self.aux:
            return torch.cat([hidden[i][start:stop] for i in self.aux], dim=1)
        return hidden[self.final][start:stop]

    def _decode_rows(self, ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """Rows of the decode steps: the positions of every output token but the last."""
        if len(output_ids) < 2:
            return torch.empty(0)
        full = self.runner.run(ids + output_ids[:-1], 0)
        hidden = {i: t for i, t in full.hidden_states.items() if isinstance(t, torch.Tensor)}
        return self._rows(hidden, len(ids), len(ids) + len(output_ids) - 1)

    def _reply(
        self, rid: str, ids: list[int], result: ForwardResult, mode: str | None, passes: list[PrefillPass]
    ) -> dict[str, Any]:
        n = len(result.output_ids)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(ids),
            "completion_tokens": n,
            "cached_tokens": result.cached_tokens,
            "weight_version": "default",
        }
        if mode is not None and n > 0:
            final = next(p for p in passes if p.req.rid == rid and not p.req.inflight_middle_chunks)
            prefill = self._rows(final.hidden, final.start, final.stop).float()
            decode = self._decode_rows(ids, result.output_ids).float()
            if mode == "full":
                meta["hidden_states"] = [prefill.tolist(), *decode.tolist()][:n]
            else:
                meta["hidden_states"] = (decode[-1] if len(decode) else prefill[-1]).tolist()
        elif mode == "full":
            meta["hidden_states"] = []  # SGLang cuts the list to the completion's length: nothing
        return {"text": "", "output_ids": result.output_ids, "meta_info": meta}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_stock_app(engine: StockEngine, ready: threading.Event) -> FastAPI:
    app = FastAPI(title="hsx reference server (stock SGLang 0.5.23)")

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc))

    _add_generate_routes(app, engine, ready)
    _add_info_routes(app, engine, started=time.time())

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        if engine.cache is not None:
            engine.cache.clear()
        return PlainTextResponse("Cache flushed.")

    return app


def _add_generate_routes(app: FastAPI, engine: StockEngine, ready: threading.Event) -> None:
    """/generate, and the health checks that run a one-token generation through the engine."""
    runner, args = engine.runner, engine.args

    def generate_sync(body: Any) -> Any:
        req = parse_stock_generate(body, runner, args.hidden_mode)
        replies = engine.generate(req)
        return JSONResponse(replies if req.is_batch else replies[0])

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        return await run_in_threadpool(generate_sync, body)

    def health_sync() -> Response:
        if not ready.is_set():
            return Response(status_code=503)
        probe = StockRequest([[0]], [f"HEALTH_CHECK_{uuid.uuid4().hex}"], False, 1, [None], [None], [False])
        engine.generate(probe, cacheable=False)
        return Response(status_code=200)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return await run_in_threadpool(health_sync)


def _add_info_routes(app: FastAPI, engine: StockEngine, *, started: float) -> None:
    """What SGLang says about its model and its settings, each also under its get_* name."""
    runner, args = engine.runner, engine.args

    def model_info() -> dict[str, Any]:
        config = runner.model.config
        return {
            "model_path": runner.model_path,
            "served_model_name": runner.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    def server_info() -> dict[str, Any]:
        return {
            **args.resolved(),
            "max_req_input_len": max_req_input_len(runner),
            "startup_time": started,
            "internal_states": [{}],
            "version": SGLANG_VERSION,
            "frontend": "python",
        }

    for path, handler in (("model_info", model_info), ("server_info", server_info)):
        app.add_api_route(f"/{path}", handler, methods=["GET"])
        app.add_api_route(f"/get_{path}", handler, methods=["GET"])


def start_stock(args: StockArgs, runner: ModelRunner) -> tuple[StockEngine, Callable[[threading.Event], FastAPI]]:
    """The engine and app factory of stock mode; StockError for arguments SGLang would refuse."""
    args.check()
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(levelname)s %(message)s")
    aux = aux_layers(args, runner.num_hidden_layers)
    engine = StockEngine(runner, args, PluginHost.load(args, runner, aux))
    return engine, lambda ready: create_stock_app(engine, ready)
