"""Request and response bodies of the HTTP API: the wire models.

The bottom floor shared by the routes (hsx.api), what they call (hsx.service) and the client (hsx.sdk), so
that each of them reads one definition of every body and none imports another for it. It imports only
hsx.states, hsx.names, hsx.layers, hsx.lengths and hsx.dtypes."""

from __future__ import annotations

import enum
import json
from datetime import datetime, timezone
from typing import Annotated, Any, Literal, TypeVar, overload

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetPydanticSchema,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError, core_schema

from hsx import dtypes, lengths
from hsx.layers import (
    ANY_LAYERS,
    DEFAULT_LAYER_SET,
    LAYER_SETS,
    MAX_LAYER_INDEX,
    MAX_LAYERS,
    LayerSetName,
    parse_choice,
)
from hsx.names import MAX_LENGTH, PATTERN, Name, PlainText, SampleId
from hsx.sources import Source
from hsx.states import JobState, SampleState


def _one_of(states: type[enum.Enum]) -> GetPydanticSchema:
    """Checked as one of the values, then made the member. The field's type stays `str` (which the
    members are) so that FastAPI adds no component for the enum: the document lists the values where
    a state is used, as it always has."""
    values = core_schema.literal_schema([s.value for s in states])
    return GetPydanticSchema(lambda _type, _handler: core_schema.no_info_after_validator_function(states, values))


# A relative file name, under the character rule of ids and names, no longer than Linux's PATH_MAX (the
# input root adds to it; the file system refuses what is then too long, see intake.resolve_input_path).
MAX_INPUT_PATH = 4096
InputPath = Annotated[PlainText, Field(max_length=MAX_INPUT_PATH, json_schema_extra={"pattern": PATTERN})]

JobStateValue = Annotated[str, _one_of(JobState)]
# How a job's shards store hidden states (hsx.dtypes), named here too: the API's query parameters and the
# CLI's flags take the choices from the wire models.
Encoding = dtypes.Encoding
SampleStateValue = Annotated[str, _one_of(SampleState)]


# Token ids are stored as int32.
MAX_TOKEN_ID = 2**31 - 1
# The intake (hsx.service.intake) checks these rules with messages that name the sample; the schema
# states them too, so that the document says which bodies are valid.


def _integers_only(value: Any) -> Any:
    """A list cut after its first element that is not an integer, so that pydantic reports that one
    (as `<field>.<index>`) and no other: a million mistyped elements would otherwise be a million
    errors, about 1 KB of memory each, for a 422 nobody reads. A list of integers is left whole."""
    if isinstance(value, list):
        for i, v in enumerate(value):
            if type(v) is not int:
                return value[: i + 1]
    return value


IntList = Annotated[list[StrictInt], BeforeValidator(_integers_only)]


def _whole(value: Any) -> Any:
    """3.0 as 3: JSON Schema's "integer" includes it (see parse_body), for bodies FastAPI reads itself."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer as JSON Schema has it (3 or 3.0); a string or a boolean is still refused.
WholeNumber = Annotated[StrictInt, BeforeValidator(_whole)]
TOKEN_IDS_SCHEMA: JsonDict = {"minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}}
LOSS_MASK_SCHEMA: JsonDict = {
    "anyOf": [{"type": "array", "items": {"type": "integer", "enum": [0, 1]}}, {"type": "null"}]
}
LAYERS_SCHEMA: JsonDict = {
    "anyOf": [
        {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_LAYERS,
            "uniqueItems": True,
            "items": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": MAX_LAYER_INDEX},
                    {"type": "string", "enum": list(LAYER_SETS)},
                ]
            },
        },
        {"type": "string", "enum": [*LAYER_SETS, ANY_LAYERS]},
        {"type": "null"},
    ]
}
# Exactly one of the two sources, as `JobCreate._one_source` requires (null counts as absent); examples.
JOB_CREATE_SCHEMA: JsonDict = {
    "oneOf": [
        {
            "required": ["samples"],
            "properties": {"samples": {"type": "array", "minItems": 1}, "input_path": {"type": "null"}},
        },
        {"required": ["input_path"], "properties": {"input_path": {"type": "string"}, "samples": {"type": "null"}}},
    ],
    "examples": [
        {
            "name": "demo",
            "samples": [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [4, 5], "loss_mask": [0, 1]}],
        },
    ],
}


# The most messages (turns) a conversation sample may hold, whatever their length: rendering and span
# finding work turn by turn, and a conversation longer than any a chat model is trained on is a mistake
# (or an attack) rather than a sample. More is an invalid sample: a 422, or skipped under on_invalid=skip.
MAX_TURNS = 512


def _turns(value: Any) -> Any:
    """A conversation's turns cut where pydantic would find the first fault, so that it reports that one
    and no other: after the first turn that is not an object (`messages.<index>`), else one error for a
    list longer than MAX_TURNS. The scan stops after MAX_TURNS + 1 turns, so a list of millions costs
    no more than one of MAX_TURNS. (hsx.service.json_body cuts a sample's JSON text the same way before
    it is parsed, so that such a list is not even built.)"""
    if not isinstance(value, list):
        return value
    for i, turn in enumerate(value[: MAX_TURNS + 1]):
        if not isinstance(turn, dict):
            return value[: i + 1]
    if len(value) > MAX_TURNS:
        raise PydanticCustomError(
            "too_many_turns",
            "holds more than {most} messages: a conversation holds at most {most}",
            {"most": MAX_TURNS},
        )
    return value


Turns = Annotated[
    list[dict[str, Any]], BeforeValidator(_turns), Field(json_schema_extra={"minItems": 1, "maxItems": MAX_TURNS})
]


# What a conversation sample may carry besides its turns: other keys of a dataset's records (a source,
# a score) are ignored rather than refused, so that ShareGPT and UltraChat files load as they are.
_CONVERSATION_KEYS = frozenset({"id", "messages", "conversations", "input_ids", "loss_mask"})
MESSAGES_DESCRIPTION = (
    "a conversation, OpenAI style: [{role: system|user|assistant, content: text}...], 1 to "
    f"{MAX_TURNS} messages; rendered into input_ids and a loss mask with the model's own chat template before "
    "extraction (see the job's `loss` and `tokenizer`)"
)
CONVERSATIONS_DESCRIPTION = (
    f"a conversation, ShareGPT style: [{{from: system|human|gpt, value: text}}...], 1 to {MAX_TURNS} messages; "
    "as `messages`"
)


class SampleIn(BaseModel):
    """One sample: token ids (with an optional loss mask), or a conversation to render."""

    model_config = ConfigDict(extra="forbid")

    id: SampleId | None = Field(
        None,
        description=f"unique within the job; default: the sample's index. A string of 1 to {MAX_LENGTH} characters "
        "without control characters, or a 64-bit integer (stored as its decimal text)",
    )
    input_ids: IntList | None = Field(
        None,
        description="prompt token ids, at least one, each below the model's vocabulary size",
        json_schema_extra=TOKEN_IDS_SCHEMA,
    )
    loss_mask: IntList | None = Field(
        None,
        description="0/1 per token, as many as input_ids; default all 1",
        json_schema_extra=LOSS_MASK_SCHEMA,
    )
    messages: Turns | None = Field(None, description=MESSAGES_DESCRIPTION)
    conversations: Turns | None = Field(None, description=CONVERSATIONS_DESCRIPTION)

    @model_validator(mode="before")
    @classmethod
    def _dataset_record(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("messages" in data or "conversations" in data):
            return {k: v for k, v in data.items() if k in _CONVERSATION_KEYS}
        return data

    @model_validator(mode="after")
    def _one_form(self) -> SampleIn:
        given = [f for f in ("input_ids", "messages", "conversations") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of input_ids, messages or conversations")
        if self.loss_mask is not None and self.input_ids is None:
            raise ValueError("loss_mask goes with input_ids; a conversation's mask comes from the job's `loss`")
        return self

    @property
    def conversation(self) -> list[dict[str, Any]] | None:
        """The turns as given, in whichever of the two styles."""
        return self.messages if self.messages is not None else self.conversations


LengthPolicy = lengths.LengthPolicy
InvalidPolicy = Literal["reject", "skip"]
LossPolicy = Literal["assistant", "all", "last_assistant"]
MAX_NEW_TOKENS = 32768


# The reason code of a sample skipped because no token of its loss mask is left (after the length policy, or
# a conversation with no assistant turn): a trainer would learn nothing from it.
NO_LOSS_TOKENS = "no_loss_tokens"


# A seed the servers would ignore (hsx.matching.ignores_seed): refuse the job, or run it with a warning.
SeedIgnored = Literal["refuse", "warn"]


class RegenerateOptions(BaseModel):
    """Regenerate every assistant turn with the model server before extraction. Numbers are strict, as
    every number of a job's body: `"8"` or `true` is refused, not read as 8 or 1."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: StrictInt = Field(..., ge=1, le=MAX_NEW_TOKENS, description="the longest answer generated per turn")
    temperature: StrictFloat = Field(default=0.0, ge=0, le=10, description="0: greedy")
    top_p: StrictFloat = Field(default=1.0, gt=0, le=1)
    seed: StrictInt | None = Field(
        default=None, ge=0, le=2**63 - 1, description="sampling seed, for answers that can be redone"
    )
    seed_ignored: SeedIgnored = Field(
        default="refuse",
        description="a seed with a temperature above 0 where the servers that may regenerate ignore seeds (SGLang "
        "without --enable-deterministic-inference): refuse the job (422 at creation; it waits while no writer "
        "has said), or warn: run it, its answers not redone by the seed, the job's `warning` saying so",
    )
    concurrency: StrictInt = Field(default=8, ge=1, le=256, description="generation requests in flight per writer")


Retention = Literal["keep", "acked"]
MAX_CONSUMERS = 64
ConsumerName = Annotated[Name, Field(min_length=1, description="a consumer's name, unique within its job")]


class JobOptions(BaseModel):
    """How a job's samples become what is extracted: its length and invalid-sample policies, how
    conversation samples are rendered (and regenerated), and how its hidden states are stored."""

    model_config = ConfigDict(extra="forbid")

    max_length: StrictInt | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description="the most tokens a sample may have (the model server's limit applies too)",
    )
    length_policy: LengthPolicy = Field(
        default="reject",
        description="a sample over max_length (or the server's limit): truncate (keep its first tokens), "
        "truncate_turns (keep its whole turns: cut after the last assistant turn that ends within the limit; "
        "a mask of ones throughout is cut as under truncate), skip (not extracted, counted as skipped with the "
        "reason) or reject (the whole request is refused; a conversation, whose length is known only once "
        "rendered, fails instead)",
    )
    on_invalid: InvalidPolicy = Field(
        default="reject",
        description="an invalid sample (a bad line, token id or conversation): reject the whole request, or skip it "
        "(counted as skipped with the reason)",
    )
    loss: LossPolicy = Field(
        default="assistant",
        description="a conversation's loss mask: 1 on what the assistant produces (each turn's content and "
        "end-of-turn token), on its last turn only, or on all tokens",
    )
    tokenizer: Annotated[PlainText, Field(max_length=MAX_INPUT_PATH, json_schema_extra={"pattern": PATTERN})] | None = (
        Field(
            default=None,
            description="a folder with the tokenizer and chat template that render conversations, readable where the "
            "writers run: an absolute path under one of the service's tokenizer roots (--tokenizer-roots), or the "
            "model path a worker's server reports (else a 422); default: the model path the model server reports",
        )
    )
    regenerate: RegenerateOptions | None = Field(
        default=None, description="replace every assistant turn with the model's own answer before extraction"
    )
    encoding: Encoding = Field(
        default="raw",
        description="how the shards store hidden states: raw (as the model server gave them), lossless (zstd over "
        "byte planes, bit for bit; about 0.7x the bytes of bfloat16) or fp8 (float8_e4m3fn with a float32 scale "
        "per row of each layer, about 0.5x; each value within 1/28 of its row's largest magnitude). Readers "
        "decode; input_ids and loss_mask stay exact",
    )

    consumers: Annotated[list[ConsumerName], Field(max_length=MAX_CONSUMERS)] | None = Field(
        default=None,
        description="consumers registered with the job (each a trainer that acknowledges what it has read, "
        "POST /v1/jobs/{id}/consumers/{name}/acks); more can be registered later",
    )
    retention: Retention = Field(
        default="keep",
        description="keep every shard (keep), or delete a shard's file once every consumer has read it for the "
        "last time (acked; needs consumers); the feed and the manifest keep its record, marked deleted",
    )
    max_unread_bytes: StrictInt | None = Field(
        default=None,
        ge=1,
        le=2**62,
        description="back-pressure: while the job's shards not yet read by every consumer, and its staged samples, "
        "reach this many bytes, writers extract none of its samples (needs consumers; at least one shard, "
        "--shard-max-bytes)",
    )

    @model_validator(mode="after")
    def _consumers_for_feed_options(self) -> JobOptions:
        if self.consumers is not None and len(set(self.consumers)) != len(self.consumers):
            raise ValueError("consumers: each name once")
        if not self.consumers:
            if self.retention == "acked":
                raise ValueError("retention acked deletes what every consumer has read: name the consumers too")
            if self.max_unread_bytes is not None:
                raise ValueError("max_unread_bytes waits for consumers to read: name the consumers too")
        return self

    def is_default(self) -> bool:
        return self == JobOptions()


class JobCreate(JobOptions):
    model_config = ConfigDict(extra="forbid", json_schema_extra=JOB_CREATE_SCHEMA)

    name: Name | None = Field(None, description=f"at most {MAX_LENGTH} characters, without control characters")
    samples: list[SampleIn] | None = Field(None, description="the samples, inline")
    input_path: InputPath | None = Field(
        None,
        description="a JSONL or Parquet file (one sample per line or row) relative to the service's input root",
    )
    layers: list[StrictInt] | str | None = Field(
        None,
        description="what the job's trainer reads: a named set (default eagle3: "
        + "; ".join(f"{name}: {s.description}" for name, s in LAYER_SETS.items())
        + f"; {ANY_LAYERS}: whatever the server captures, kept from the first stored sample), a list of layers "
        '(ascending), or a list of sets and layers (e.g. ["eagle3", "dflash"]: their union is captured once, '
        "each layer stored once, each set read back by name). Only workers whose server captures them run the "
        "job; it waits meanwhile, saying what it needs",
        json_schema_extra=LAYERS_SCHEMA,
    )

    @model_validator(mode="after")
    def _one_source(self) -> JobCreate:
        if (self.samples is None) == (self.input_path is None):
            raise ValueError("give exactly one of samples or input_path")
        return self

    @field_validator("layers", mode="before")
    @classmethod
    def _layers_shape(cls, v: Any) -> Any:
        """One error under `layers` for any bad shape (hsx.layers.parse_choice names the sets there are): left
        to a union, pydantic would report each of its branches, a huge list's elements each. A list of sets
        comes back as the one key the job keeps (eagle3+dflash)."""
        if v is None:
            return v
        if isinstance(v, list):
            if len(v) > MAX_LAYERS:
                raise ValueError(f"layers must list at most {MAX_LAYERS} layers, each at most {MAX_LAYER_INDEX}")
            v = _integers(v)  # 3.0 is an integer, as parse_body reads it elsewhere
        return parse_choice(v)


class Counts(BaseModel):
    total: int
    preparing: int = Field(0, description="conversations waiting to be rendered (and regenerated)")
    queued: int
    running: int
    staged: int = Field(description="validated and waiting for their shard to be written")
    succeeded: int
    failed: int
    cancelled: int
    skipped: int = Field(0, description="left out by the job's length or invalid-sample policy, with the reason")
    truncated: int = Field(
        0,
        description="cut to max_length (or the server's limit) by the truncate policy, whatever their state now "
        "(not a state: not part of total's sum); each says its length before (truncated_from)",
    )


class Tokens(BaseModel):
    total: int = Field(description="tokens to extract (conversations count once rendered)")
    done: int = Field(description="in written shards")
    staged: int = Field(description="validated, waiting for their shard")


class Attempts(BaseModel):
    """A job's attempts so far, counted as each one ends: how many were retried, and why."""

    total: int = Field(description="attempts that ended, whatever their outcome (those running are not counted)")
    ok: int = Field(description="attempts that gave the sample's hidden states")
    retried: int = Field(description="attempts that failed and left the sample another (outcome `retry`)")
    failed: int = Field(description="the last attempts of samples that failed (outcome `failed`)")
    interrupted: int = Field(
        description="attempts given back without spending the sample's budget (the model server or the writer "
        "went away during it)"
    )
    by_reason: dict[str, int] = Field(
        description="retried and failed attempts by reason code: the part of the attempt's reason before its "
        "first ':' (`no_dump`, `wrong_shape`, `non_finite`, ...), as GET /metrics counts them",
    )
    waiting_retry: int = Field(
        description="queued samples that were tried before (after a retried or interrupted attempt, or a retry "
        "asked for), waiting for their next attempt",
    )


class JobOut(BaseModel):
    id: str
    object: Literal["job"] = "job"
    name: str | None
    state: JobStateValue
    error: str | None = Field(description="why the job failed as a whole, e.g. the server captures other layers")
    warning: str | None = Field(
        None, description="what the job ran without that it asked for, e.g. a sampling seed its server ignored"
    )
    waiting_reason: str | None = Field(None, description="why an active job makes no progress right now")
    created_at: datetime
    prepared_at: datetime | None = Field(
        None,
        description="when its last conversation left `preparing` (rendered with the chat template, its answers "
        "regenerated when the job asks): null for a job of token ids, and while conversations wait to be prepared",
    )
    started_at: datetime | None = Field(description="when its first sample was claimed")
    cancel_requested_at: datetime | None = Field(
        description="when it was cancelled: it stays `cancelling` while its queued samples are cancelled in the "
        "background and those in flight are stored"
    )
    finished_at: datetime | None = Field(
        description="when it reached succeeded (every sample not skipped is stored), partial (some stored, some "
        "failed), failed (none stored, or the job could not run) or cancelled"
    )
    elapsed_s: float | None = Field(
        None, description="seconds from its creation to its end (finished_at), or to now while it has not ended"
    )
    preparing_s: float | None = Field(
        None,
        description="seconds its conversations took to be prepared, from its creation to prepared_at (to now while "
        "some wait); null for a job of token ids. Extraction starts with the first conversation prepared, so it "
        "may overlap extracting_s",
    )
    extracting_s: float | None = Field(
        None,
        description="seconds from its first claimed sample (started_at) to its end, or to now; null before a "
        "sample is claimed",
    )
    counts: Counts
    tokens: Tokens
    attempts: Attempts = Field(description="attempts by outcome and retries by reason, counted as attempts end")
    rate_tokens_per_s: float | None
    eta_s: float | None = Field(
        description="seconds left at the present rate; null before any rate, and while cancelling"
    )
    shards_written: int
    estimated_bytes: int | None = Field(
        description="bytes its shards will take; null when the server's shape was unknown at creation"
    )
    disk_warning: str | None = Field(description="set when the output volume looked too small at creation")
    layers: list[int | str] | LayerSetName | None = Field(
        description="what it asked for: a list of layers, a named set (eagle3, eagle3_pre_norm, dflash, "
        "dflash_pre_norm, last, last_pre_norm, any), or a list of sets and layers; null from a job created before "
        "jobs said it"
    )
    model: dict[str, Any] | None
    options: JobOptions = Field(
        default_factory=lambda: JobOptions.model_validate({}),
        description="its length, invalid and rendering policies, and its encoding",
    )
    manifest_url: str


# A job's fields that move with the clock alone: whoever reports a job as it changes (the events stream,
# `hsx status --watch --json`) leaves them out of the comparison, or a running job would change every second.
CLOCK_FIELDS = frozenset({"rate_tokens_per_s", "eta_s", "elapsed_s", "preparing_s", "extracting_s"})


class JobPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobOut]
    has_more: bool
    next_after: str | None = Field(description="pass as ?after= for the next page")


class AttemptOut(BaseModel):
    number: int
    worker: str | None = Field(
        None, description="the writer that ran it (host:dump root; `#n` marks one of its in-flight slots)"
    )
    outcome: str | None
    reason: str | None
    started_at: datetime
    finished_at: datetime | None
    dump: str | None
    observed_tokens: int | None
    boot_id: str | None


class SampleOut(BaseModel):
    id: str
    index: int
    state: SampleStateValue
    expected_tokens: int
    observed_tokens: int | None
    attempts: int
    last_error: str | None
    shard: str | None
    offset: int | None
    truncated_from: int | None = Field(
        None,
        description="its token count before the job's length policy cut it to expected_tokens (a conversation "
        "tokenized only as far as its limit needs: the tokens counted, more than the limit); null: not cut",
    )
    attempt_log: list[AttemptOut] | None = None
    messages: list[dict[str, Any]] | None = Field(
        None, description="a conversation sample's turns as rendered (regenerated ones included); single-sample view"
    )


class SamplePage(BaseModel):
    object: Literal["list"] = "list"
    data: list[SampleOut]
    has_more: bool
    next_after: str | None = Field(description="pass as ?after= for the next page")


class FeedSample(BaseModel):
    id: str
    offset: int = Field(description="its first row in every tensor of the shard")
    num_tokens: int = Field(description="its rows: offset .. offset + num_tokens")


class ShardOut(BaseModel):
    name: str
    seq: int = Field(description="its number in the job's commit feed: 1, 2, ... in the order shards were recorded")
    bytes: int
    sha256: str
    num_samples: int
    num_tokens: int
    created_at: datetime
    deleted: bool = Field(
        False, description="retention deleted its file once every consumer had read it; its record stays"
    )
    url: str = Field(description="where to download it (Range and If-None-Match supported)")
    samples: list[FeedSample] = Field(description="its samples, in their order in the shard")


class ShardList(BaseModel):
    """A page of the job's commit feed: the shards recorded after `after`, in the order recorded."""

    object: Literal["list"] = "list"
    job_id: str
    data: list[ShardOut] = Field(description="the shards recorded after `after`, in feed order, at most `limit`")
    after: int = Field(description="the position asked for")
    last_seq: int = Field(description="the last shard's seq in `data`, or `after` if none: pass as ?after= next")
    committed: int = Field(description="how many shards the job has recorded so far")
    has_more: bool = Field(description="shards after last_seq are already recorded (ask again at once)")
    complete: bool = Field(
        description="the job has ended and nothing follows last_seq: the feed is complete (a retry, which queues "
        "its failed samples again or resumes it once cancelled, opens it again: its new shards take the next seqs)"
    )
    job_state: JobStateValue
    header: dict[str, Any] | None = Field(
        None,
        description="the manifest as it stands, without its shard and sample lists (layers, hidden_size, dtype, "
        "encoding, model, final_layer, ...); null until the job's first sample is stored",
    )


MAX_FEED_WAIT_S = 60
MAX_FEED_LIMIT = 10_000


class ConsumerIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: ConsumerName


class AckIn(BaseModel):
    """One rank's position: every shard of the feed up to `seq` read in epoch `epoch` of `epochs`."""

    model_config = ConfigDict(extra="forbid")

    rank: WholeNumber = Field(0, ge=0, lt=1 << 20, description="the acknowledging rank, 0 .. world_size - 1")
    world_size: WholeNumber = Field(1, ge=1, le=1 << 20, description="the trainer's ranks (all say the same)")
    epoch: WholeNumber = Field(1, ge=1, le=1 << 20, description="the epoch it is in, from 1")
    epochs: WholeNumber = Field(1, ge=1, le=1 << 20, description="how many epochs it reads the job")
    seq: WholeNumber = Field(ge=0, le=2**31 - 1, description="every shard up to this seq is read, in this epoch")

    @model_validator(mode="after")
    def _within(self) -> AckIn:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        if self.epoch > self.epochs:
            raise ValueError(f"epoch {self.epoch} is past epochs {self.epochs}")
        return self


class RankOut(BaseModel):
    rank: int
    epoch: int
    epochs: int
    seq: int
    acked_at: datetime


class ConsumerOut(BaseModel):
    object: Literal["consumer"] = "consumer"
    job_id: str
    name: str
    created_at: datetime
    world_size: int | None = Field(description="as its ranks acknowledged; null before the first acknowledgement")
    ranks: list[RankOut] = Field(description="each rank's last acknowledgement")
    read_seq: int = Field(description="every shard up to this seq is read by every rank at least once")
    released_seq: int = Field(description="every shard up to this seq is read for the last time (retention: acked)")
    lag_shards: int = Field(description="recorded shards not yet read by every rank")
    lag_bytes: int = Field(description="their bytes")


class ConsumerList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ConsumerOut]


class ThroughputPoint(BaseModel):
    start: datetime = Field(description="where the window begins")
    seconds: float = Field(description="how much of the window the job was running (the last one may be partial)")
    samples: int = Field(description="samples extracted (validated and staged) in the window")
    tokens: int = Field(description="their tokens")
    tokens_per_s: float = Field(description="tokens / seconds; 0 for a window the job did not run in")


class Throughput(BaseModel):
    object: Literal["throughput"] = "throughput"
    job_id: str
    window_s: int = Field(description="the width of every window, in seconds")
    points: list[ThroughputPoint] = Field(
        description="oldest first, from the job's first extraction to its end (or now), windows without any "
        "extraction included; empty until it has extracted something"
    )


LAYER_SETS_FIELD = (
    f"the named layer sets it serves ({', '.join(LAYER_SETS)}): those its server's layers cover on its side of the "
    "final norm, and the post-norm ones where hsx applies the model's final norm to a pre-norm layer L; a job "
    "asking for them may run here; null until its server said its layers"
)
SERVES_DEFAULT_FIELD = (
    f"whether it may take a job that does not name its layers (the default set, {DEFAULT_LAYER_SET}); false for a "
    "server whose layer L lies before the final norm where hsx cannot apply the norm (then ask for "
    "eagle3_pre_norm); null until its server said its layers"
)


class PreparerOut(BaseModel):
    """A writer's conversation preparer, as the writer last reported it."""

    state: Literal["idle", "preparing", "failing"] = Field(
        description="idle (nothing to prepare), preparing, or failing (its last step raised: `reason` says why; "
        "conversations of the jobs it serves make no progress meanwhile)"
    )
    reason: str | None = Field(None, description="why it is failing")
    prepared: int = Field(
        0, description="conversation samples it moved on (queued, skipped or failed) since it started"
    )


class WriterOut(BaseModel):
    identity: str = Field(description="host:dump root")
    state: str = Field(description="starting, ready, waiting, refusing or stopped")
    reason: str | None = Field(description="why it is not ready")
    server: dict[str, Any] | None = Field(
        description="the model server it extracts from, as last checked (GET /v1/workers "
        "has every writer with its lease)"
    )
    heartbeat_at: datetime
    tokens_per_s: float | None = Field(
        None,
        description="tokens it extracted per second over the last minute, as of its last heartbeat; for this "
        "process's own writer as of now, the figure `writer.tokens_per_s` shows",
    )
    preparer: PreparerOut | None = Field(None, description="its conversation preparer, as of its last heartbeat")
    layer_sets: list[str] | None = Field(None, description=LAYER_SETS_FIELD)
    serves_default: bool | None = Field(None, description=SERVES_DEFAULT_FIELD)


class Health(BaseModel):
    status: Literal["ok", "degraded"] = Field(
        description="ok: the database answers, this process's writer (if any) is ready, and no writer's "
        "conversation preparer is failing; else degraded"
    )
    database: str
    writer: dict[str, Any] | None = Field(
        description="this process's writer, when it runs one: identity, state, reason, server, tokens_per_s, "
        "preparer (with --api-tokens and no token: its state only)"
    )
    writers: list[WriterOut] = Field(
        default_factory=list,
        description="every writer that reported recently (with --api-tokens and no token: none)",
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="what keeps jobs waiting although the service is ok, such as no ready writer giving the "
        f"default layer set ({DEFAULT_LAYER_SET}), with what to ask for instead; `status` stays ok for them, so "
        "probes that read it are not failed by a fleet that works for jobs that name their layers",
    )


class TokenInfo(BaseModel):
    object: Literal["token"] = "token"
    tokens_required: bool = Field(description="whether the service was started with --api-tokens")
    role: Literal["read", "write"] = Field(
        description="what the presented token may do: read (GET and verify only) or write (everything)"
    )


class WorkerOut(BaseModel):
    """A writer (an `hsx worker`, or `hsx serve` with its writer) as it last reported itself."""

    identity: str = Field(description="host:dump root")
    state: str = Field(
        description="starting, ready, waiting, refusing, stopped, or lost (its lease expired and its samples "
        "went back to the queue)"
    )
    reason: str | None = Field(description="why it is not ready")
    backend_url: str | None = Field(description="its model server")
    model_path: str | None = Field(description="the model its server reports")
    model_key: str | None = Field(
        None,
        description="its model's identity (a digest of the model as its server describes it): a job's samples "
        "go only to workers of the model and layers its first stored sample came from",
    )
    layers: list[int] | None = Field(description="the layers its server gives")
    final_layer: str | None = Field(None, description="the side of the final norm its server gives layer L on")
    final_norm: dict[str, Any] | None = Field(
        None, description="the final norm hsx applies to its pre-norm layer L (checkpoint, tensor, sha256, eps)"
    )
    final_norm_problem: str | None = Field(
        None, description="why hsx cannot apply the final norm to its pre-norm layer L, and what to change"
    )
    source: Source | None = Field(
        description=f"the engine it takes hidden states with ({', '.join(Source)}: hsx serve --source)"
    )
    vocab_size: int | None = Field(
        None,
        description="its server's vocabulary: token ids below it (null: not said); a new job's samples are checked "
        "against the tightest of the live workers that may run it",
    )
    max_prompt_tokens: int | None = Field(
        None, description="the longest prompt its server takes, in tokens (null: not said); as vocab_size"
    )
    started_at: datetime
    heartbeat_at: datetime = Field(description="its last heartbeat")
    lease_expires_at: datetime | None = Field(description="when its samples go back to the queue unless it renews")
    lease: int = Field(description="its fencing token: raised each time it registers or its lease is taken over")
    samples_staged: int | None = Field(description="samples it extracted since it started")
    tokens_per_s: float | None = Field(
        description="tokens it extracted per second over the last minute, as of its last heartbeat"
    )
    preparer: PreparerOut | None = Field(None, description="its conversation preparer, as of its last heartbeat")
    layer_sets: list[str] | None = Field(None, description=LAYER_SETS_FIELD)
    serves_default: bool | None = Field(None, description=SERVES_DEFAULT_FIELD)


class WorkerList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WorkerOut]


Body = TypeVar("Body", bound=BaseModel)


def parse_body(model: type[Body], text: bytes | bytearray | str, *, strict: bool | None = None) -> Body:
    """`model` from JSON text. JSON has one kind of number, and JSON Schema's "integer" (what the
    document says these fields are) includes 3.0: when integers written with a zero fraction are
    what the fast parse refused, the text is parsed again with them read as integers."""
    try:
        return model.model_validate_json(text, strict=strict)
    except ValidationError as exc:
        if not any(_integral(e.get("input")) for e in exc.errors()):
            raise
    return model.model_validate(_integers(json.loads(text)), strict=strict)


def _integral(value: object) -> bool:
    return isinstance(value, float) and value.is_integer()


def _integers(value: Any) -> Any:
    """`value` with every integral float in it an int (request bodies have no float fields)."""
    if isinstance(value, list):
        return [_integers(v) for v in value]
    if isinstance(value, dict):
        return {k: _integers(v) for k, v in value.items()}
    return _whole(value)


@overload
def utc(dt: datetime) -> datetime: ...


@overload
def utc(dt: None) -> None: ...


def utc(dt: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    if dt is None or dt.tzinfo is not None:
        return dt
    return dt.replace(tzinfo=timezone.utc)
