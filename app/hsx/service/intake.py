"""Turn submitted samples into stored rows: inline JSON, a JSONL file under the input root, or an
NDJSON body streamed line by line.

Every sample is checked, and the good ones spooled (hsx.service.spool), before a transaction starts;
the job and its samples are then inserted in one transaction, so a refused request stores nothing and
a slow upload holds no database lock. Errors name the sample index (and line) and the field.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError
from sqlalchemy.orm import Session

from hsx.backends.engine import Limits
from hsx.chat.formats import ConversationError, conversation_of
from hsx.db.locks import hold_disk_budget
from hsx.db.models import JobRow
from hsx.db.repository import JobBuilder, NewSample, add_consumer, pending_output_bytes
from hsx.lengths import kept_tokens
from hsx.names import shown
from hsx.service.errors import FieldError, InsufficientStorage, InvalidInput, OutsideInputRoot, Where
from hsx.service.json_body import cut_turns
from hsx.service.lines import LineSplitter, LineTooLongError
from hsx.service.spool import SampleSpool
from hsx.states import SampleState
from hsx.wire import MAX_TOKEN_ID, MAX_TURNS, NO_LOSS_TOKENS, JobOptions, SampleIn, parse_body

if TYPE_CHECKING:
    from _hashlib import HASH

MAX_ERRORS = 50
BATCH = 2000
READ_BYTES = 1024 * 1024
_ID_DIGEST_KEY = os.urandom(16)


class Ingest:
    """Check samples one by one and spool the good ones; nothing touches the database until `store`.

    The job's options decide what a sample that breaks a rule costs: the whole request (reject, the
    default), or only that sample, stored as skipped with the reason (skip; a too-long one may also be
    truncated)."""

    def __init__(self, limits: Limits, options: JobOptions | None = None):
        self.limits = limits
        self.options = options or JobOptions()
        self.errors: list[FieldError] = []
        self.count = 0
        self.spool = SampleSpool()
        # 8-byte keyed digests of the ids seen: duplicate detection without holding every id string.
        # The key is per process, so ids cannot be chosen to collide and force the slow check.
        self.seen: set[bytes] = set()
        lengths = [n for n in (self.options.max_length, limits.max_tokens) if n is not None]
        self.max_tokens = min(lengths) if lengths else None
        self.too_long = False  # whether the sample being checked is over the limit under `reject`

    def feed(self, index: int, item: SampleIn | list[FieldError], where: Where) -> None:
        self.count += 1
        if isinstance(item, list):  # parse errors, already shaped as error entries
            self._invalid(index, None, item)
        else:
            row = self._check(index, item, where)
            if row is not None and not self.errors:
                self.spool.add(row)
        if len(self.errors) >= MAX_ERRORS:
            raise InvalidInput(self.errors[:MAX_ERRORS])

    def finish(self) -> SampleSpool:
        """The spooled samples once every one passed; raises InvalidInput otherwise."""
        if self.errors:
            raise InvalidInput(self.errors[:MAX_ERRORS])
        if self.count == 0:
            raise InvalidInput([{"field": "samples", "message": "a job needs at least one sample"}])
        return self.spool

    def close(self) -> None:
        self.spool.close()

    def _is_duplicate(self, sid: str) -> bool:
        digest = hashlib.blake2b(sid.encode(), digest_size=8, key=_ID_DIGEST_KEY).digest()
        if digest not in self.seen:
            self.seen.add(digest)
            return False
        # A digest seen before: compare the real ids.
        return self.spool.has_sample_id(sid)

    def _invalid(self, index: int, sid: str | None, errors: list[FieldError]) -> None:
        """A sample that breaks a rule: the request's errors, or a skipped sample that says why."""
        if self.options.on_invalid == "reject":
            self.errors.extend(errors)
            return
        reason = "invalid: " + "; ".join(f"{e.get('field', 'sample')}: {e['message']}" for e in errors)
        if sid is None or self._is_duplicate(sid):
            sid = self._free_id(f"invalid-{index}")
        if not self.errors:
            self.spool.add(NewSample(sid, b"", None, 0, SampleState.SKIPPED, reason=reason))

    def _free_id(self, sid: str) -> str:
        """`sid`, or with ~ appended until no sample of the request has it."""
        while self._is_duplicate(sid):
            sid += "~"
        return sid

    def _check(self, index: int, sample: SampleIn, where: Where) -> NewSample | None:
        sid = sample.id if sample.id is not None else str(index)
        errors: list[FieldError] = []

        def err(field: str, message: str) -> None:
            errors.append({"sample_index": index, **where, "sample_id": sid, "field": field, "message": message})

        self.too_long = False
        if sample.input_ids is None:
            row = self._conversation(sid, sample, err)
        else:
            row = self._tokens(sid, sample.input_ids, sample.loss_mask, err)
        duplicate = self._is_duplicate(sid)
        if duplicate:
            err("id", f"duplicate sample id {sid!r}")
        if self.too_long:
            self.errors.extend(errors)
        elif errors:
            self._invalid(index, None if duplicate else sid, errors)
        return None if errors else row

    def _conversation(self, sid: str, sample: SampleIn, err: Callable[[str, str], None]) -> NewSample | None:
        field = "messages" if sample.messages is not None else "conversations"
        try:
            turns = conversation_of({field: sample.conversation})
        except ConversationError as exc:
            err(exc.field, exc.message)
            return None
        return NewSample(sid, b"", None, 0, SampleState.PREPARING, conversation=json.dumps(turns))

    def _tokens(
        self, sid: str, ids: list[int], mask: list[int] | None, err: Callable[[str, str], None]
    ) -> NewSample | None:
        if self.options.regenerate is not None:
            err("input_ids", "a job that regenerates answers takes conversations (messages), not token ids")
            return None
        arrays = self._arrays(ids, mask, err)
        if arrays is None:
            return None
        id_array, mask_array = arrays
        limit = self.max_tokens
        if limit is not None and len(ids) > limit:
            policy = self.options.length_policy
            if policy == "skip":
                return NewSample(sid, b"", None, 0, SampleState.SKIPPED, reason=f"too_long: {self._too_long(len(ids))}")
            if policy == "reject":
                self.too_long = True  # refused whatever on_invalid says: length has its own policy
                err("input_ids", self._too_long(len(ids)))
                return None
            kept = kept_tokens(mask_array, limit, policy)
            id_array = id_array[:kept]
            mask_array = None if mask_array is None else mask_array[:kept]
            if mask_array is not None and not mask_array.any():
                why = (
                    f"{NO_LOSS_TOKENS}: cut from {len(ids)} to {kept} tokens (at most {limit}), no token of the "
                    "loss mask is left"
                )
                return NewSample(sid, b"", None, 0, SampleState.SKIPPED, reason=why)
        packed_mask = None if mask_array is None or mask_array.all() else mask_array.tobytes()
        cut = len(ids) if len(id_array) < len(ids) else None
        return NewSample(sid, id_array.tobytes(), packed_mask, len(id_array), truncated_from=cut)

    def _arrays(
        self, ids: list[int], mask: list[int] | None, err: Callable[[str, str], None]
    ) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The ids (int32) and mask (uint8) when both are valid; else None, with the errors said."""
        vocab = self.limits.vocab_size or MAX_TOKEN_ID + 1
        id_array = _in_range(ids, 0, vocab, "<i4")
        if not ids:
            err("input_ids", "must hold at least one token id")
        elif id_array is None:
            pos = next(i for i, t in enumerate(ids) if t < 0 or t >= vocab)
            err(f"input_ids.{pos}", f"token id {ids[pos]} is outside [0, {vocab}) of the model's vocabulary")
        mask_array = None if mask is None else _in_range(mask, 0, 2, np.uint8)
        if mask is not None:
            if len(mask) != len(ids):
                err("loss_mask", f"has {len(mask)} values, input_ids has {len(ids)}")
                return None
            if mask_array is None:
                err("loss_mask", "values must be 0 or 1")
        if id_array is None or not ids or (mask is not None and mask_array is None):
            return None
        return id_array, mask_array

    def _too_long(self, n: int) -> str:
        which = (
            "max_length"
            if self.options.max_length is not None and self.max_tokens == self.options.max_length
            else "the model server's limit"
        )
        return f"{n} tokens exceed {which} of {self.max_tokens}"


# Up to this many values, the builtins' min and max cost less than numpy's per-call overhead.
_SHORT = 64


def _in_range(values: list[int], lo: int, hi: int, dtype: type | str) -> np.ndarray | None:
    """The values as an array of `dtype` when every one lies in [lo, hi), else None. Long lists are
    checked by numpy: the builtins' two passes over Python ints cost more than one conversion."""
    if len(values) <= _SHORT:
        if values and (min(values) < lo or max(values) >= hi):
            return None
        return np.asarray(values, dtype=dtype)
    try:
        wide = np.asarray(values, dtype=np.int64)
    except OverflowError:  # beyond int64, so beyond any range checked here
        return None
    return wide.astype(dtype) if wide.min() >= lo and wide.max() < hi else None


@dataclass(frozen=True)
class DiskCheck:
    """Does the output volume hold this job on top of what active jobs still have to write?"""

    output_root: Path
    mode: str  # refuse | warn | off

    def check(self, session: Session, needed: int, *, job_id: str) -> str | None:
        """Whether job `job_id`, needing `needed` bytes, fits: None when it does; a warning text in warn
        mode; raises InsufficientStorage in refuse mode. The job's own row may already be flushed
        as an active job: its bytes are `needed`, never part of what the others still have to write."""
        if self.mode == "off":
            return None
        hold_disk_budget(session)  # another creation's check waits for this job's estimate
        root = self.output_root
        while not root.exists():
            root = root.parent
        free = shutil.disk_usage(root).free
        pending = pending_output_bytes(session, besides=job_id)
        if needed + pending <= free:
            return None
        text = (
            f"the job needs about {needed:,} bytes and active jobs {pending:,} more, but the output volume "
            f"({self.output_root}) has {free:,} bytes free"
        )
        if self.mode == "warn":
            return text
        raise InsufficientStorage(text, needed=needed, pending=pending, free=free)


def parse_sample(index: int, text: bytes | bytearray, where: Where) -> tuple[int, SampleIn | list[FieldError], Where]:
    """One sample's JSON text (a JSONL line, or one element of an inline `samples` array) as a sample,
    or as the errors that say why it is not one. The text is parsed and checked in one pass by
    pydantic's JSON parser, once a conversation too long or mistyped to be one is cut short
    (json_body.cut_turns): one error, whatever the length of the list."""
    try:
        return index, parse_body(SampleIn, cut_turns(text), strict=True), where
    except ValidationError as exc:
        return index, _field_errors(index, where, exc), {}


def _field_errors(index: int, where: Where, exc: ValidationError) -> list[FieldError]:
    return [
        {"sample_index": index, **where, "field": ".".join(str(p) for p in e["loc"]) or "sample", "message": e["msg"]}
        for e in exc.errors()
    ]


class JsonlReader:
    """JSONL fed in chunks into an Ingest, blank lines skipped: the sample index counts samples, the
    line number counts lines. Raises LineTooLongError for a line over `max_line` bytes."""

    def __init__(self, ingest: Ingest, max_line: int, digest: HASH | None = None):
        self.ingest = ingest
        self.digest = digest  # also given every byte, for a streamed body's Idempotency-Key check
        self.lines = LineSplitter(max_line)
        self.index = 0

    def feed(self, chunks: list[bytes]) -> None:
        for chunk in chunks:
            if self.digest is not None:
                self.digest.update(chunk)
            self._take(self.lines.feed(chunk))

    def end(self) -> None:
        self._take(self.lines.end())

    def _take(self, lines: list[tuple[int, bytes]]) -> None:
        for lineno, line in lines:
            if not line or line.isspace():
                continue
            self.ingest.feed(*parse_sample(self.index, line, {"line": lineno}))
            self.index += 1


def ingest_file(ingest: Ingest, path: Path, max_line: int, relative: str) -> None:
    """A JSONL or Parquet file under the input root (`relative`, as the request named it), read a block
    at a time."""
    if path.suffix.lower() == ".parquet":
        ingest_parquet(ingest, path, relative, max_line)
        return
    reader = JsonlReader(ingest, max_line)
    try:
        f = open(path, "rb")  # noqa: SIM115 - opened apart from the `with` below: only its OSError is unreadable
    except OSError as exc:
        raise _unreadable(relative, _why(exc)) from None
    try:
        with f:
            while block := f.read(READ_BYTES):
                reader.feed([block])
        reader.end()
    except LineTooLongError as exc:
        message = f"line {exc.lineno} is longer than the limit of {exc.limit} bytes (--max-sample-bytes)"
        raise InvalidInput([{"line": exc.lineno, "field": "input_path", "message": message}]) from None


PARQUET_ROWS = 1024  # rows read at a time, at most
PARQUET_BATCH_BYTES = 4 * 1024 * 1024  # and about this much of their data, as the file's metadata counts it
# Bytes a value of each Parquet type takes once read, at least (a string: its offset).
_VALUE_BYTES = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}


def ingest_parquet(ingest: Ingest, path: Path, relative: str, max_row: int) -> None:
    """A Parquet file, one sample a row (columns as a JSONL line's keys; null is absent), streamed a
    batch of rows at a time. Needs pyarrow (hsx-server[parquet]).

    A compressed file says little of what its rows hold (a row of ten million equal ids is a few
    hundred bytes), so memory is bounded on the rows' data: the metadata's count of values sizes each
    batch (about PARQUET_BATCH_BYTES) and refuses a row group whose rows hold more than `max_row` bytes
    (--max-sample-bytes, as for a JSONL line) each before it is read; a row read over that limit is
    refused before it becomes Python objects; and a conversation's turns past MAX_TURNS are cut in
    Arrow, as a JSON text's are."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        message = "reading Parquet needs pyarrow on the service: pip install 'hsx-server[parquet]'"
        raise InvalidInput([{"field": "input_path", "message": message}]) from None
    try:
        source = pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise _unreadable(relative, f"not a Parquet file ({exc})") from None
    index = 0
    try:
        with source:
            for batch in source.iter_batches(batch_size=_batch_rows(source.metadata, max_row)):
                over = _first_row_over(batch, max_row)
                if over is not None:
                    raise _row_too_large(index + over, 1, max_row)
                for record in _turns_sliced(batch).to_pylist():
                    row = {k: v for k, v in record.items() if v is not None}
                    ingest.feed(*parse_record(index, row, {"row": index}))
                    index += 1
    finally:
        pa.default_memory_pool().release_unused()  # Arrow's allocator keeps what it freed otherwise


def _batch_rows(metadata: Any, max_row: int) -> int:
    """Rows per batch: PARQUET_ROWS, fewer when the row groups' rows hold more than PARQUET_BATCH_BYTES
    / PARQUET_ROWS bytes on average. A row group whose rows hold more than `max_row` on average holds
    a row over the limit: refused unread."""
    widest, first = 0.0, 0
    for group in map(metadata.row_group, range(metadata.num_row_groups)):
        if group.num_rows:
            per_row = _read_bytes(group) / group.num_rows
            if per_row > max_row:
                raise _row_too_large(first, group.num_rows, max_row)
            widest = max(widest, per_row)
        first += group.num_rows
    return max(1, min(PARQUET_ROWS, int(PARQUET_BATCH_BYTES // max(widest, 1.0))))


def _read_bytes(group: Any) -> int:
    """The least a row group's data takes once read: every leaf value's bytes (the metadata counts the
    values of a list column one by one, however well they compress), a string's offset at least."""
    columns = map(group.column, range(group.num_columns))
    return sum(c.num_values * _VALUE_BYTES.get(c.physical_type, 4) for c in columns)


def _row_too_large(first: int, rows: int, limit: int) -> InvalidInput:
    which = f"row {first} holds" if rows == 1 else f"rows {first} to {first + rows - 1} hold, on average,"
    message = f"{which} more than the limit of {limit} bytes (--max-sample-bytes)"
    return InvalidInput([{"row": first, "field": "input_path", "message": message}])


def _first_row_over(batch: Any, limit: int) -> int | None:
    """The first row of the batch whose data is over `limit` bytes, or None: halves are measured
    only while they are over it, so a batch of small rows costs one measure."""
    if batch.nbytes <= limit:
        return None
    if batch.num_rows <= 1:
        return 0
    half = batch.num_rows // 2
    first = _first_row_over(batch.slice(0, half), limit)
    if first is not None:
        return first
    rest = _first_row_over(batch.slice(half), limit)
    return None if rest is None else half + rest


def _turns_sliced(batch: Any) -> Any:
    """The batch with each list of turns (`messages`, `conversations`) cut after MAX_TURNS + 1: the
    sample is refused for its length, and the rest would only become Python objects."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for key in ("messages", "conversations"):
        at = batch.schema.get_field_index(key)
        kind = batch.schema.field(at).type if at >= 0 else None
        if kind is not None and (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            batch = batch.set_column(at, key, pc.list_slice(batch.column(at), 0, MAX_TURNS + 1))
    return batch


def parse_record(index: int, record: dict[str, object], where: Where) -> tuple[int, SampleIn | list[FieldError], Where]:
    """One sample from an already parsed record (a Parquet row), as parse_sample from JSON text."""
    try:
        return index, SampleIn.model_validate(record, strict=True), where
    except ValidationError as exc:
        return index, _field_errors(index, where, exc), {}


def store(
    session: Session,
    spool: SampleSpool,
    limits: Limits,
    *,
    name: str | None,
    layers: list[int] | str,
    idempotency_key: str | None,
    request_sha256: str,
    disk: DiskCheck | None,
    options: JobOptions | None = None,
) -> JobRow:
    """Insert the job and its checked, spooled samples in the caller's transaction."""
    builder = JobBuilder(
        session,
        name=name,
        layers=layers,
        idempotency_key=idempotency_key,
        request_sha256=request_sha256,
        options=None if options is None or options.is_default() else options.model_dump(exclude_defaults=True),
    )
    # A named set's layers are the server's when it gives that set (else the job waits for one that does).
    listed = layers if isinstance(layers, list) else None
    per_token = limits.bytes_per_token(listed, options.encoding if options is not None else "raw")
    # A conversation's tokens are known once it is rendered: such a job's size is unknown now.
    if per_token is not None and not spool.preparing:
        estimated = per_token * spool.tokens
        # Checked before this job's estimate is set: the volume's other commitments, then this job.
        warning = disk.check(session, estimated, job_id=builder.job.id) if disk is not None else None
        builder.job.estimated_bytes, builder.job.disk_warning = estimated, warning
    if options is not None:
        builder.job.max_unread_bytes = options.max_unread_bytes
    for batch in spool.batches(BATCH):
        builder.add(batch)
    job = builder.finish()
    for consumer in (options.consumers if options is not None else None) or []:
        add_consumer(session, job.id, consumer)
    return job


def resolve_input_path(input_root: Path, relative: str) -> Path:
    """The file `relative` names under the input root; anything outside it is refused, and a name the
    file system cannot follow (too long, a symlink loop) is invalid input."""
    root = Path(input_root).resolve()
    candidate = Path(relative)
    if candidate.is_absolute():
        raise OutsideInputRoot("input_path must be relative to the service's input root")
    try:
        path = (root / candidate).resolve()
        if path != root and root not in path.parents:
            raise OutsideInputRoot("input_path points outside the service's input root")
        found = path.is_file()
    except RuntimeError:  # Python < 3.13 reports a symlink loop so, later ones as OSError(ELOOP)
        raise _unreadable(relative, "its symbolic links form a loop") from None
    except OSError as exc:
        raise _unreadable(relative, _why(exc)) from None
    if not found:
        message = f"no file {shown(relative)} under the input root {root}"
        raise InvalidInput([{"field": "input_path", "message": message}])
    return path


def _why(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "its symbolic links form a loop"
    if exc.errno == errno.ENAMETOOLONG:
        return "it, or a name in it, is longer than the file system allows"
    return exc.strerror or type(exc).__name__


def _unreadable(relative: str, why: str) -> InvalidInput:
    return InvalidInput(
        [{"field": "input_path", "message": f"cannot open {shown(relative)} under the input root: {why}"}]
    )
