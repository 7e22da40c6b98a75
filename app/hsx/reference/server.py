"""SGLang-compatible HTTP API over the reference model; every forward request writes one dump."""

from __future__ import annotations

import functools
import re
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from hsx.reference.common import ForwardResult, HiddenStates
from hsx.reference.dumper import Dumper
from hsx.reference.faults import (
    BadDumper,
    FaultInjector,
    PrefixCache,
    SequencePlan,
    add_admin_routes,
    mark_done_late,
    other_ids,
)

if TYPE_CHECKING:  # the model module imports transformers, which synthetic mode never needs
    from hsx.reference.model import ModelRunner

DUMP_PROTOCOL = 1
DEFAULT_MAX_NEW_TOKENS = 16  # SGLang's default
# SGLang's warm-up prompt ("The capital city of France is") in Llama-2 token ids.
WARMUP_INPUT_IDS = [1, 450, 7483, 4272, 310, 3444, 338]
WARMUP_MAX_NEW_TOKENS = 8
READY_MESSAGE = "The server is fired up and ready to roll!"
SAFE_RID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


def log(message: str) -> None:
    print(f"[hsx-ref] {message}", flush=True)


class BadRequest(Exception):
    """A client error, answered as SGLang does: 400 with {"error": {"message": ...}}."""


@dataclass
class ServerSettings:
    dump_root: Path  # absolute
    name_by: str  # "counter" or "rid"
    host: str = "127.0.0.1"
    port: int = 30000
    skip_server_warmup: bool = False
    enable_return_hidden_states: bool = False


@dataclass
class GenerateRequest:
    sequences: list[list[int]]
    rids: list[str]
    is_batch: bool
    max_new_tokens: int
    return_hidden_states: bool
    extra_keys: list[str | None]  # per sequence: SGLang's prefix-cache namespace


class RidsInFlight:
    """The rids of the requests being served: SGLang refuses a request whose rid is still in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()

    @contextmanager
    def claim(self, rids: list[str]) -> Iterator[None]:
        with self._lock:
            busy = [rid for rid in rids if rid in self._in_flight]
            if busy:
                raise BadRequest(f"Duplicate request ID detected: {busy[0]}")
            self._in_flight.update(rids)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.difference_update(rids)


class Engine:
    """Runs forwards and writes their dumps.

    Forwards are serialised under one lock, so counter values, forwards and dumps happen in one
    order; with concurrent=True (synthetic rid mode with --max-batch > 1, where the runner batches
    concurrent callers itself) only the counter is, and requests overlap.

    Optional server-settings faults: prefix_cache (--enable-radix-cache) trims the rows a prompt
    shares with an earlier one from its dump; chunked_prefill_size > 0 dumps a longer prompt as one
    dump per chunk. faults (--enable-fault-injection) draws a SequencePlan per /generate sequence.
    """

    def __init__(
        self,
        runner: ModelRunner,
        dumper: Dumper,
        name_by: str,
        *,
        faults: FaultInjector | None = None,
        prefix_cache: PrefixCache | None = None,
        chunked_prefill_size: int = -1,
        concurrent: bool = False,
    ):
        self.runner = runner
        self.dumper = dumper
        self.name_by = name_by
        self.faults = faults
        self.prefix_cache = prefix_cache
        self.chunked_prefill_size = chunked_prefill_size
        self.concurrent = concurrent
        self.counter = 0
        self._counter_lock = threading.Lock()
        self._forward_lock = threading.Lock()
        self.rids = RidsInFlight()

    @property
    def injector(self) -> FaultInjector:
        """The fault injector, where a fault is acted on: only an injector draws fault plans."""
        if self.faults is None:
            raise RuntimeError("fault injection is off")
        return self.faults

    def claim_rids(self, rids: list[str]) -> AbstractContextManager[None]:
        """Reserve the rids for one request; a rid already in flight would share its dump directory."""
        return self.rids.claim(rids)

    def _next_counter(self) -> int:
        with self._counter_lock:
            counter = self.counter
            self.counter += 1
            return counter

    def _key(self, rid: str, counter: int) -> str:
        return rid if self.name_by == "rid" else str(counter)

    def forward(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        rid: str,
        *,
        plan: SequencePlan | None = None,
        cacheable: bool = False,
        extra_key: str | None = None,
    ) -> ForwardResult:
        """One sequence's forward and its dump(s); `cacheable` for /generate prompts, not health checks."""
        with nullcontext() if self.concurrent else self._forward_lock:
            if plan is not None and plan.crash:
                self.injector.crash(rid)
            before = plan.foreign_before if plan is not None else 0
            after = plan.foreign_after if plan is not None else 0
            health_like = plan is not None and plan.health_like
            for j in range(before):
                self._write_foreign(input_ids, j, health_like=health_like and j == 0)
            result = self._forward(input_ids, max_new_tokens, rid, plan, cacheable, extra_key)
            for j in range(before, before + after):
                write = functools.partial(self._write_foreign, input_ids, j, health_like=health_like and j == 0)
                if plan is not None and plan.foreign_after_reply_s is not None:
                    result.after_reply.append((plan.foreign_after_reply_s, self._serialised(write)))
                else:
                    write()
        return result

    def _serialised(self, action: Callable[[], None]) -> Callable[[], None]:
        """`action`, run under the forward lock when forwards are serialised (after the reply, from a timer)."""

        def run() -> None:
            with nullcontext() if self.concurrent else self._forward_lock:
                action()

        return run

    def _forward(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        rid: str,
        plan: SequencePlan | None,
        cacheable: bool,
        extra_key: str | None,
    ) -> ForwardResult:
        counter = self._next_counter()
        started = time.monotonic()
        cache = self.prefix_cache if cacheable else None
        cached = cache.match(input_ids, extra_key) if cache is not None else 0
        result = self.runner.run(input_ids, max_new_tokens)
        if cache is not None:
            cache.insert(input_ids, extra_key)
        result.cached_tokens = cached
        total = len(input_ids)
        step = self.chunked_prefill_size if self.chunked_prefill_size > 0 else total
        # One forward pass per chunk of the non-cached part; each pass writes a dump of its rows.
        bounds = [(a, min(a + step, total)) for a in range(cached, total, step)]
        keys = []
        for n, (a, b) in enumerate(bounds):
            if n:
                counter = self._next_counter()
            if (a, b) == (0, total):
                ids, hidden = input_ids, result.hidden_states
            else:
                ids, hidden = input_ids[a:b], {i: t[a:b] for i, t in result.hidden_states.items()}
            key = self._key(rid, counter)
            keys.append(key)
            last = n == len(bounds) - 1
            self._write(
                key,
                rid,
                counter,
                input_ids=ids,
                hidden=hidden,
                cached=cached,
                plan=plan if last else None,
                result=result,
            )
        chunks = f" chunks={len(bounds)}" if len(bounds) > 1 else ""
        log(
            f"req_{keys[-1]} counter={counter} rid={rid} prompt={total} cached={cached}{chunks} "
            f"new={len(result.output_ids)} {1000 * (time.monotonic() - started):.0f}ms"
        )
        return result

    def _write(
        self,
        key: str,
        rid: str,
        counter: int,
        *,
        input_ids: list[int],
        hidden: HiddenStates,
        cached: int,
        plan: SequencePlan | None,
        result: ForwardResult,
    ) -> None:
        bad = plan.bad_kind if plan is not None else None
        late = plan.late_done if plan is not None else None
        dumper = BadDumper(self.dumper, bad, self.runner.vocab_size) if bad else self.dumper
        write = functools.partial(
            dumper.write,
            key,
            rid=rid,
            counter=counter,
            input_ids=input_ids,
            hidden_states=hidden,
            cached_tokens=cached,
            done=late is None,
        )
        if plan is not None and plan.late_dump is not None:
            result.after_reply.append((plan.late_dump, lambda: log(f"fault: late dump written: {write()}")))
            self.injector.count("late_dump")
            directory = dumper.dir_for(key)
        else:
            directory = write()
        if bad:
            self.injector.count(f"bad_dump.{bad}")
            log(f"fault: req_{key} written as bad dump {bad}")
        if late is not None:
            result.after_reply.append((late, functools.partial(mark_done_late, directory)))
            self.injector.count("late_done" if late != float("inf") else "never_done")

    def _write_foreign(self, input_ids: list[int], j: int, *, health_like: bool) -> None:
        """Fault: a complete dump of someone else's request, with its own counter value."""
        if health_like:
            ids, rid = [0], f"HEALTH_CHECK_{time.time()}"
        else:
            ids, rid = other_ids(input_ids, self.runner.vocab_size, shift=1 + j), f"foreign-{uuid.uuid4().hex}"
        counter = self._next_counter()
        result = self.runner.run(ids, 0)
        key = self._key(rid, counter)
        self.dumper.write(key, rid=rid, counter=counter, input_ids=ids, hidden_states=result.hidden_states)
        self.injector.count("health_like_dump" if health_like else "foreign_dump")
        log(f"fault: foreign dump req_{key} counter={counter} rid={rid} prompt={len(ids)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_ids(ids: Any, where: str, vocab_size: int, max_len: int) -> list[int]:
    if not isinstance(ids, list):
        raise BadRequest(f"{where} must be a list of token ids")
    if not ids:
        raise BadRequest(f"{where} is empty; send at least one token id")
    if len(ids) > max_len:
        raise BadRequest(f"{where} has {len(ids)} tokens, longer than max_req_input_len {max_len}")
    for token in ids:
        if not _is_int(token):
            raise BadRequest(f"{where} holds {token!r}; token ids must be integers")
        if not 0 <= token < vocab_size:
            raise BadRequest(f"{where} holds token id {token}, outside the vocabulary [0, {vocab_size})")
    return ids


def parse_generate(body: Any, runner: ModelRunner, name_by: str) -> GenerateRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for field in ("text", "input_embeds"):
        if body.get(field) is not None:
            raise BadRequest(f"{field} is not supported by the reference server; send input_ids")
    sequences, is_batch = parse_input_ids(body.get("input_ids"), runner)
    rids = parse_rids(body.get("rid"), len(sequences), is_batch)
    if name_by == "rid":
        check_dump_names(rids)
    max_new_tokens = parse_max_new_tokens(body)
    return_hidden_states = body.get("return_hidden_states", False)
    if not isinstance(return_hidden_states, bool):
        raise BadRequest("return_hidden_states must be a boolean")
    extra_keys = parse_extra_keys(body.get("extra_key"), len(sequences), is_batch)
    return GenerateRequest(sequences, rids, is_batch, max_new_tokens, return_hidden_states, extra_keys)


def parse_input_ids(raw: Any, runner: ModelRunner) -> tuple[list[list[int]], bool]:
    """SGLang's `input_ids`: one sequence of token ids, or a batch of them; (sequences, is_batch)."""
    if raw is None:
        raise BadRequest("input_ids is required")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("input_ids is empty; send a list of token ids or a list of such lists")
    is_batch = isinstance(raw[0], list)
    seqs = raw if is_batch else [raw]
    max_len = runner.max_position_embeddings
    sequences = [
        check_ids(ids, f"input_ids[{n}]" if is_batch else "input_ids", runner.vocab_size, max_len)
        for n, ids in enumerate(seqs)
    ]
    return sequences, is_batch


def parse_rids(rid: Any, n: int, is_batch: bool) -> list[str]:
    """SGLang's `rid`: a string for one sequence, a list of one per sequence for a batch, fresh ids when
    absent; unique within the request."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if is_batch:
        if not isinstance(rid, list):
            raise BadRequest("rid must be a list with one id per sequence for a batch")
        if len(rid) != n:
            raise BadRequest(f"rid has {len(rid)} entries for {n} sequences")
        rids = rid
    else:
        if not isinstance(rid, str):
            raise BadRequest("rid must be a string for a single sequence")
        rids = [rid]
    if not all(isinstance(r, str) for r in rids):
        raise BadRequest("every rid must be a string")
    if len(set(rids)) != len(rids):
        raise BadRequest("duplicate rid within one request")
    return rids


def check_dump_names(rids: list[str]) -> None:
    """In rid mode each rid names a dump directory, so it must be a safe file name."""
    unsafe = [r for r in rids if not SAFE_RID.fullmatch(r)]
    if unsafe:
        raise BadRequest(
            f"rid {unsafe[0]!r} cannot name a dump directory: use 1-200 of [A-Za-z0-9._-], not starting with '.'"
        )


def parse_max_new_tokens(body: dict[str, Any]) -> int:
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise BadRequest("sampling_params must be an object")
    max_new_tokens = sampling.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new_tokens is None:
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise BadRequest(f"sampling_params.max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    return max_new_tokens


def parse_extra_keys(raw: Any, n: int, is_batch: bool) -> list[str | None]:
    """SGLang's `extra_key`: one string for every sequence, or a batch's list of one per sequence."""
    if raw is None or isinstance(raw, str):
        return [raw] * n
    if is_batch and isinstance(raw, list) and len(raw) == n and all(isinstance(k, str) for k in raw):
        return list(raw)
    raise BadRequest("extra_key must be a string, or for a batch a list of one string per sequence")


def dump_identity(anonymous: bool, name_by: str) -> str:
    """What each dump proves to a reader (hsx.identity): its ids, else its rid-named folder, else its size."""
    if not anonymous:
        return "ids"
    return "rid" if name_by == "rid" else "count"


def _reply(rid: str, prompt: list[int], result: ForwardResult, hidden: bool) -> dict[str, Any]:
    n = len(result.output_ids)
    meta = {
        "id": rid,
        "prompt_tokens": len(prompt),
        "completion_tokens": n,
        "cached_tokens": result.cached_tokens,
        "finish_reason": {"type": "length", "length": n},
    }
    if hidden:
        meta["hidden_states"] = result.last_hidden().float().tolist()
    return {"text": "", "output_ids": result.output_ids, "meta_info": meta}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_reference_app(engine: Engine, settings: ServerSettings, ready: threading.Event) -> FastAPI:
    runner = engine.runner

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Every in-flight request holds a worker thread; a batching runner needs more than the default 40.
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, 4 * getattr(runner, "max_batch", 1) + 8)
        yield

    app = FastAPI(title="hsx reference server", lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc))

    _add_generate(app, engine, settings)
    _add_health(app, engine, ready)
    _add_info(app, engine, settings)
    if engine.faults is not None:
        add_admin_routes(app, engine.faults)
    return app


def answer_generate(engine: Engine, settings: ServerSettings, body: Any) -> Any:
    """One /generate request: its forwards and dumps, and SGLang's reply (a list for a batch)."""
    runner, faults = engine.runner, engine.faults
    req = parse_generate(body, runner, settings.name_by)
    hidden = req.return_hidden_states and settings.enable_return_hidden_states
    delay = faults.request_delay() if faults is not None else 0.0
    after_reply: list[tuple[float, Callable[[], None]]] = []
    with engine.claim_rids(req.rids):
        replies = []
        for rid, ids, extra_key in zip(req.rids, req.sequences, req.extra_keys, strict=True):
            # Decoding stops at the context length, as in SGLang.
            n = min(req.max_new_tokens, runner.max_position_embeddings - len(ids))
            plan = faults.plan_sequence() if faults is not None else None
            result = engine.forward(ids, n, rid, plan=plan, cacheable=True, extra_key=extra_key)
            after_reply.extend(result.after_reply)
            replies.append(_reply(rid, ids, result, hidden))
        if delay:
            engine.injector.count("delay")
            log(f"fault: delaying the reply to rid(s) {req.rids} by {delay}s")
            time.sleep(delay)
    if after_reply:
        engine.injector.schedule(after_reply)
    return replies if req.is_batch else replies[0]


def _add_generate(app: FastAPI, engine: Engine, settings: ServerSettings) -> None:
    faults = engine.faults

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        if faults is not None and faults.unavailable_now():
            return _error(503, "the server is unavailable (injected fault)")
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        return await run_in_threadpool(answer_generate, engine, settings, body)


def health_status(engine: Engine, ready: threading.Event) -> Response:
    """/health and /health_generate: 503 until the warm-up is done and while an injected outage lasts."""
    if not ready.is_set():
        return Response(status_code=503)
    if engine.faults is not None and engine.faults.unavailable_now():
        return Response(status_code=503)
    # Like SGLang, a health probe is a real forward, so it consumes a counter value and writes a dump.
    engine.forward([0], 1, f"HEALTH_CHECK_{time.time()}")
    return Response(status_code=200)


def _add_health(app: FastAPI, engine: Engine, ready: threading.Event) -> None:
    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return await run_in_threadpool(health_status, engine, ready)


def model_info(runner: ModelRunner) -> dict[str, Any]:
    """/get_model_info: the model's shape."""
    return {
        "model_path": runner.model_path,
        "is_generation": True,
        "vocab_size": runner.vocab_size,
        "num_hidden_layers": runner.num_hidden_layers,
        "hidden_size": runner.hidden_size,
        "dtype": runner.dtype_name,
        "max_position_embeddings": runner.max_position_embeddings,
    }


def server_info(engine: Engine, settings: ServerSettings) -> dict[str, Any]:
    """/get_server_info: the server's settings and its dump protocol (hs_dump)."""
    runner = engine.runner
    info: dict[str, Any] = {
        "model_path": runner.model_path,
        "disable_radix_cache": engine.prefix_cache is None,
        "chunked_prefill_size": engine.chunked_prefill_size,
        "max_req_input_len": runner.max_position_embeddings,
        "enable_return_hidden_states": settings.enable_return_hidden_states,
        "skip_server_warmup": settings.skip_server_warmup,
        "hs_dump": {
            "protocol": DUMP_PROTOCOL,
            "dump_root": str(settings.dump_root),
            "name_by": settings.name_by,
            "layers": runner.layers,
            "boot_id": engine.dumper.boot_id,
            "dtype": runner.dtype_name,
            # What each dump proves to a reader (hsx.identity): its ids, else its rid-named folder, else its size.
            "identity": dump_identity(engine.dumper.anonymous, settings.name_by),
        },
    }
    if engine.faults is not None:
        info["enable_fault_injection"] = True
    if hasattr(runner, "info"):  # synthetic mode
        info["synthetic"] = runner.info()
    return info


def _add_info(app: FastAPI, engine: Engine, settings: ServerSettings) -> None:
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info(engine.runner)

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return server_info(engine, settings)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        if engine.prefix_cache is not None:
            engine.prefix_cache.clear()
            return PlainTextResponse("Cache flushed.")
        return PlainTextResponse("Cache flushed (the reference server has no cache).")


def _loopback_url(host: str, port: int) -> str:
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _warm_up(
    server: uvicorn.Server, base_url: str, warmup_ids: list[int], ready: threading.Event, failed: threading.Event
) -> None:
    """SGLang's warm-up: once serving, poll our own /get_model_info, then send one /generate."""
    try:
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.05)
        # trust_env=False: a proxy from the environment must not intercept loopback calls.
        with httpx.Client(base_url=base_url, timeout=600.0, trust_env=False) as client:
            deadline = time.monotonic() + 60
            while client.get("/get_model_info").status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("/get_model_info did not answer 200")
                time.sleep(0.1)
            body = {"input_ids": warmup_ids, "sampling_params": {"max_new_tokens": WARMUP_MAX_NEW_TOKENS}}
            response = client.post("/generate", json=body)
            response.raise_for_status()
    except (httpx.HTTPError, RuntimeError) as exc:
        # The server cannot serve its own warm-up, so it is unusable: stop it, as SGLang does.
        log(f"warm-up failed: {exc!r}")
        failed.set()
        server.should_exit = True
        return
    ready.set()
    log(READY_MESSAGE)


def run_server(engine: Engine, settings: ServerSettings) -> int:
    """Serve the reference server's own API until SIGTERM/SIGINT; 1 when the warm-up failed."""
    vocab_size = engine.runner.vocab_size
    return serve(
        lambda ready: create_reference_app(engine, settings, ready),
        host=settings.host,
        port=settings.port,
        skip_server_warmup=settings.skip_server_warmup,
        warmup_ids=[t % vocab_size for t in WARMUP_INPUT_IDS],
    )


def serve(
    app_factory: Callable[[threading.Event], FastAPI],
    *,
    host: str,
    port: int,
    skip_server_warmup: bool,
    warmup_ids: list[int],
) -> int:
    """Serve the app until SIGTERM/SIGINT (uvicorn handles both); 1 when the warm-up failed.
    `app_factory` gets the event that is set once the server is ready (/health answers 200)."""
    ready = threading.Event()
    failed = threading.Event()
    app = app_factory(ready)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=30
    )
    server = uvicorn.Server(config)
    base_url = _loopback_url(host, port)
    if skip_server_warmup:
        ready.set()
        log(f"{READY_MESSAGE} (warm-up skipped)")
    else:
        threading.Thread(
            target=_warm_up, args=(server, base_url, warmup_ids, ready, failed), name="warm-up", daemon=True
        ).start()
    log(f"starting the HTTP server on {base_url}")
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, which would kill the process
    # (or raise KeyboardInterrupt) before main() returns; these handlers absorb that re-raise.
    previous = {
        sig: signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log("shut down")
    return 1 if failed.is_set() else 0
