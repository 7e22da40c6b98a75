"""Service settings, each from an `hsx serve` flag, an HSX_* environment variable or its default (in that
order). The descriptions are the flags' help (`hsx serve --help`)."""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from hsx.layers import check_layers, parse_layers
from hsx.sources import AUTO, Source, SourceChoice, source_help

TOKEN_ROLES = ("write", "read")


def parse_tokens(spec: str) -> dict[str, str]:
    """ "tok1,tok2:read" -> {"tok1": "write", "tok2": "read"}; "" -> {} (no tokens: no authentication).

    Anything doubtful is an error, never a guess: a role other than read or write (a mistyped one must
    not grant write access), an empty token, a token listed twice, or a list that holds no token."""
    if not spec:
        return {}
    tokens: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        token, colon, role = part.partition(":")
        token, role = token.strip(), role.strip() if colon else "write"
        if not token:
            raise ValueError(f"{part!r} has no token before the colon")
        if role not in TOKEN_ROLES:
            raise ValueError(f"unknown role {role!r} for a token; use TOKEN (may write) or TOKEN:read (may only read)")
        if token in tokens:
            raise ValueError("a token is listed twice; list each token once, with one role")
        tokens[token] = role
    if not tokens:
        raise ValueError(f"{spec!r} lists no token; give TOKEN or TOKEN:read items, or leave it unset for no tokens")
    return tokens


MiB = 1024 * 1024

# Each shard flusher reads, checks and hashes on one core, then waits while the disk takes its writes:
# two per core keep both the cores and the disk busy. More than this many rarely find a disk that takes
# them all, and each holds up to a shard's worth of staging while it writes.
FLUSHERS_PER_CORE = 2
MAX_DEFAULT_FLUSHERS = 8


def default_flushers() -> int:
    """Two shard flushers per core this process may run on, at most MAX_DEFAULT_FLUSHERS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(FLUSHERS_PER_CORE * cores, MAX_DEFAULT_FLUSHERS))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HSX_", extra="ignore")

    backend_url: str = Field("http://127.0.0.1:30000", description="base URL of the model server (SGLang or vLLM)")
    dump_root: Path = Field(
        Path("/dev/shm/sglang_hs"),
        description="the directory the model server writes dumps to; this service must be its only reader",
    )
    staging_dir: Path | None = Field(
        None,
        description="where validated dumps wait for their shard, on the dump root's file system so that moving a "
        "dump is a rename; unset: a sibling of the dump root named <dump_root>.hsx-staging",
    )
    output_root: Path = Field(
        Path("hsx-data/output"),
        description="shards and manifest.json go under <output_root>/<job id>/; every service on one database "
        "must use the same folder (its .hsx-output-root.json mark is checked at start)",
    )
    input_root: Path = Field(
        Path("hsx-data/input"),
        description="jobs may name JSONL input files under this folder only (created at start when missing)",
    )
    database_url: str = Field(
        "sqlite:///hsx-data/hsx.db", description="SQLAlchemy URL: sqlite:///path.db or postgresql://user@host/db"
    )
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, description="port to listen on")
    shard_max_bytes: int = Field(
        256 * 1024 * 1024,
        description="a job's shard is written once its staged samples reach this size; the job's last, smaller "
        "shard once no sample of it is queued or still running here",
    )
    shard_max_wait_s: float = Field(
        10.0,
        description="while a job has queued samples, a staged sample waits at most this long for its shard (then "
        "what is staged goes to a smaller one, so that a slow extraction keeps the disk busy)",
    )
    flushers: int = Field(
        default_flushers(),
        ge=1,
        description="threads writing shards at once, each a shard of its own (sha256 and all); the default is "
        f"{FLUSHERS_PER_CORE} per core available to the process, at most {MAX_DEFAULT_FLUSHERS}",
    )
    max_attempts: int = Field(3, description="attempts per sample before it is failed")
    cancel_batch: int = Field(
        10_000,
        ge=1,
        description="a cancelled job's queued samples are cancelled in the background, this many per "
        "transaction, so that no cancel holds the database for long whatever the job's size",
    )
    dump_wait_s: float = Field(
        30.0, description="how long to wait for a dump's `done` marker after the model server replied"
    )
    dump_settle_s: float = Field(
        0.05,
        ge=0,
        description="counter-named dumps that carry neither input ids nor a rid: how long the dump root must stay "
        "still (no new dump, none still being written) before the one dump of the sample's length is taken; this "
        "covers a server that writes a dump shortly after it replies, and is paid once per such sample",
    )
    request_timeout_s: float = Field(600.0, description="HTTP timeout for one /generate request")
    prepare_timeout_s: float = Field(
        60.0,
        gt=0,
        description="the longest one conversation may take to render with its chat template (in a process of its "
        "own); a conversation that takes longer fails with reason prepare_timeout, and a template that takes "
        "longer to load fails its job",
    )
    prepare_max_mb: int = Field(
        2048,
        ge=256,
        description="the most memory, in MiB, the process that renders conversations with their chat templates may "
        "hold, its libraries included (about 290 MiB once transformers and a tokenizer are loaded); a render that "
        "needs more fails its sample with reason prepare_memory (the process is started anew for the next), and a "
        "template that needs more to load fails its job; 2048 holds a 4 MB turn tokenized whole",
    )
    source: SourceChoice = Field(AUTO, description=source_help())
    name_by: str = Field("auto", description="dump naming: auto (ask the server), counter or rid")
    capture_layers: str = Field(
        "",
        description="vLLM with its own hidden-states connector (ExampleHiddenStatesConnector), which writes no "
        "hsx-vllm.json: the layers it captures, comma-separated, ascending, in hsx's numbering, which is vLLM's: "
        "its eagle_aux_hidden_state_layer_ids sorted, e.g. 2,4,5,8 (vLLM writes them in ascending order whatever "
        "order the launch gives); unset: the layers come from the hsx-vllm.json that hsx's connector writes, and "
        "where both are there they must agree",
    )
    max_json_bytes: int = Field(64 * MiB, description="largest application/json request body")
    max_ndjson_bytes: int = Field(16 * 1024 * MiB, description="largest streamed application/x-ndjson job body")
    max_sample_bytes: int = Field(
        8 * MiB,
        description="longest JSON text of one sample: a line of an application/x-ndjson body (longer: 413 naming "
        "the line), an element of an inline samples array (413 naming the sample) or a line of a JSONL input file "
        "(422); also the most data one row of a Parquet input file may hold, uncompressed (422 naming the row); "
        "8 MiB holds about a million token ids with their loss mask",
    )
    large_body_bytes: int = Field(
        8 * MiB, description="a job creation whose body is larger than this counts against --max-large-bodies"
    )
    max_large_bodies: int = Field(
        2,
        description="how many job creations with a body over --large-body-bytes are taken in (received, checked "
        "and stored) at once; another is refused at once with 503 and Retry-After, so that memory and the "
        "database are not swamped",
    )
    body_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a job creation whose body sends nothing for this long is answered 408 and dropped, its "
        "large-body slot freed: a stalled upload holds nothing for long",
    )
    body_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="a job creation's body must have arrived whole within this long (else 408), however steadily "
        "it trickles in",
    )
    connection_wait_s: float = Field(
        5.0,
        ge=0,
        description="a request that finds every database connection the API's requests may use taken waits this "
        "long for one, in line, then is answered 503 with Retry-After (0: at once); /healthz and /metrics have "
        "connections of their own and never wait behind requests, and event streams take one only for each check",
    )
    max_in_flight: int = Field(
        4, description="rid mode: requests in flight at once (counter-named dumps always take one at a time)"
    )
    disk_check: str = Field(
        "refuse",
        description="when a new job's estimated size does not fit on the output volume: refuse (507), warn "
        "(recorded in the job) or off",
    )
    api_tokens: str = Field(
        "",
        description="comma-separated bearer tokens, each TOKEN or TOKEN:read (TOKEN:write is the same as TOKEN); "
        "when set, every endpoint but /healthz and the dashboard's page and files (/, /dashboard/) needs one, and "
        ":read tokens may only read; any other role, or a list without a token, stops the service from starting",
    )
    lease_s: float = Field(
        30.0,
        description="the writer's lease on the queue, renewed every third of it: a writer silent for longer "
        "(dead, paused, cut off from the database) loses its running and staged samples to the queue, and "
        "nothing it does afterwards is recorded",
    )
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="hsx worker only: serve GET /metrics (Prometheus) and GET /healthz (200 while its writer is "
        "ready or waiting, else 503) on this port; unset: no port (hsx serve has both on its API port)",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="hsx worker only: the address --metrics-port listens on; 0.0.0.0 (or the node's address) for "
        "a Prometheus on another host or a container probe from outside",
    )
    tokenizer_roots: str = Field(
        "",
        description="comma-separated folders under which a job's `tokenizer` may name a folder (an absolute path; "
        "the model path a writer's server reports is always allowed, any other is refused at creation with a 422); "
        "give the API and every worker the same list: the API checks the path as written, a writer again once "
        "its symbolic links are followed; unset: only the model path",
    )
    run_writer: bool = Field(
        True,
        description="run the single writer for the dump root in this process; without it the process serves "
        "the API only, and another process must run the writer",
    )

    @field_validator("source", mode="before")
    @classmethod
    def _known_source(cls, value: object) -> object:
        choices = (AUTO, *Source)
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    @field_validator("capture_layers")
    @classmethod
    def _ascending_layers(cls, value: str) -> str:
        parse_layer_list(value)
        return value

    @field_validator("tokenizer_roots")
    @classmethod
    def _absolute_roots(cls, value: str) -> str:
        for root in _listed(value):
            if not os.path.isabs(root):
                raise ValueError(f"{root!r} is not an absolute path; name each tokenizer root from /")
        return value

    @field_validator("api_tokens")
    @classmethod
    def _valid_tokens(cls, value: str) -> str:
        parse_tokens(value)
        return value

    def capture_layer_list(self) -> list[int] | None:
        """--capture-layers as a list; None when unset."""
        return parse_layer_list(self.capture_layers)

    def tokenizer_root_list(self) -> list[str]:
        """The tokenizer roots, each absolute and without `.` or `..` (as written: a symbolic link in one
        is the operator's to name)."""
        return [os.path.normpath(root) for root in _listed(self.tokenizer_roots)]

    def resolved_staging_dir(self) -> Path:
        if self.staging_dir is not None:
            return self.staging_dir
        root = self.dump_root.resolve()
        return root.with_name(root.name + ".hsx-staging")


def parse_layer_list(spec: str) -> list[int] | None:
    """ "2,4,5,8" -> [2, 4, 5, 8]; "" -> None. Anything but ascending, unique, non-negative layer numbers written
    as hsx.layers.parse_layers takes them is an error: a server's files hold each layer once, ascending, and a
    list in another order would label them wrongly."""
    if not spec:
        return None
    layers = parse_layers(spec)  # its errors name the list
    try:
        return check_layers(layers)
    except ValueError as exc:
        raise ValueError(f"{spec!r}: {exc}") from None


def _listed(spec: str) -> list[str]:
    return [part.strip() for part in spec.split(",") if part.strip()]


def tokenizer_refusal(tokenizer: str, roots: Sequence[str], model_paths: Collection[str]) -> str | None:
    """Why a job may not name `tokenizer` (a folder for its writers to load), or None when it may: the
    model path a writer's server reports, or an absolute path that, `..` taken lexically, lies under one
    of `roots` (Settings.tokenizer_root_list). Only the text is read, never the file system: the folder
    is the writers' to load, on their hosts, and a refusal must not tell whether something exists on
    any. A writer checks the folder again with its symbolic links followed (tokenizer_within_roots)."""
    if tokenizer in model_paths:
        return None
    where = (
        f"under one of the service's tokenizer roots (--tokenizer-roots: {', '.join(roots)})"
        if roots
        else "under a tokenizer root, and this service names none (--tokenizer-roots)"
    )
    if not os.path.isabs(tokenizer):
        return f"must be an absolute path {where}, or the model path a worker's server reports"
    path = os.path.normpath(tokenizer)
    if not any(_within(path, root) for root in roots):
        return f"must be a folder {where}, or the model path a worker's server reports"
    return None


def tokenizer_within_roots(folder: str, roots: Sequence[str]) -> bool:
    """Whether `folder`, its symbolic links followed, lies under one of `roots` (theirs followed too):
    what a writer checks before it loads a job's tokenizer that is not its server's model path."""
    real = os.path.realpath(folder)
    return any(_within(real, os.path.realpath(root)) for root in roots)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
