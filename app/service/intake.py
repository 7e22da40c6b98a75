"""Turn submitted samples into stored rows: inline JSON, a JSONL file under the input root, or an
NDJSON body streamed line by line.

Every sample is checked before the transaction commits; any error rolls the whole job back, so a
refused request stores nothing. Errors name the sample index (and line) and the field.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterable, AsyncIterator, Iterable, Iterator

import numpy as np
from hsx.api.schemas import SampleIn
from hsx.db.models import JobRow
from hsx.db.repository import JobBuilder, NewSample, pending_output_bytes
from hsx.dtypes import DTYPES, HIDDEN_STATE_DTYPES
from hsx.names import shown
from hsx.service.errors import InsufficientStorage, InvalidInput, OutsideInputRoot
from pydantic import ValidationError
from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from _hashlib import HASH

MAX_TOKEN_ID = 2**31 - 1
MAX_ERRORS = 50
BATCH = 2000


@dataclass(frozen=True)
class Limits:
    """What the model server accepts: ids below vocab_size, at most max_tokens per prompt."""

    vocab_size: int | None = None
    max_tokens: int | None = None
    # What the server captures, for the job's size estimate.
    layers: list[int] | None = None
    hidden_size: int | None = None
    dtype: str | None = None

    def bytes_per_token(self, job_layers: list[int] | None) -> int | None:
        """Shard bytes per token: every captured layer's row plus int64 input_ids and loss_mask."""
        layers = job_layers or self.layers
        if not layers or not self.hidden_size or self.dtype not in HIDDEN_STATE_DTYPES:
            return None
        return len(layers) * self.hidden_size * DTYPES[self.dtype].itemsize + 16


class Ingest:
    """Check samples one by one and insert them in batches through a JobBuilder."""

    def __init__(
        self,
        session: Session,
        limits: Limits,
        *,
        name: str | None,
        layers: list[int] | None,
        idempotency_key: str | None = None,
        request_sha256: str | None = None,
        disk: DiskCheck | None = None,
    ):
        self.limits = limits
        self.layers = layers
        self.disk = disk
        self.builder = JobBuilder(
            session, name=name, layers=layers, idempotency_key=idempotency_key, request_sha256=request_sha256
        )
        self.errors: list[dict] = []
        self.batch: list[NewSample] = []
        self.count = 0
        # 8-byte digests of the ids seen: duplicate detection without holding every id string.
        self.seen: set[bytes] = set()

    def feed(self, index: int, item: SampleIn | list[dict], where: dict) -> None:
        self.count += 1
        if isinstance(item, list):  # parse errors, already shaped as error entries
            self.errors.extend(item)
        else:
            row = self._check(index, item, where)
            if row is not None:
                self.batch.append(row)
                if len(self.batch) >= BATCH:
                    self._flush()
        if len(self.errors) >= MAX_ERRORS:
            raise InvalidInput(self.errors[:MAX_ERRORS])

    def finish(self) -> JobRow:
        if self.errors:
            raise InvalidInput(self.errors[:MAX_ERRORS])
        if self.count == 0:
            raise InvalidInput([{"field": "samples", "message": "a job needs at least one sample"}])
        self._flush()
        job = self.builder.finish()
        per_token = self.limits.bytes_per_token(self.layers)
        if per_token is not None:
            job.estimated_bytes = per_token * job.tokens_total
            if self.disk is not None:
                job.disk_warning = self.disk.check(self.builder.session, job.estimated_bytes, job_id=job.id)
        return job

    def _flush(self) -> None:
        if not self.errors:
            self.builder.add(self.batch)
        self.batch = []

    def _is_duplicate(self, sid: str) -> bool:
        digest = hashlib.blake2b(sid.encode(), digest_size=8).digest()
        if digest not in self.seen:
            self.seen.add(digest)
            return False
        # A digest seen before: compare the real ids, in the pending batch and in the database.
        return any(s.sample_id == sid for s in self.batch) or self.builder.has_sample_id(sid)

    def _check(self, index: int, sample: SampleIn, where: dict) -> NewSample | None:
        sid = sample.id if sample.id is not None else str(index)
        bad = len(self.errors)

        def err(field: str, message: str) -> None:
            self.errors.append({"sample_index": index, **where, "sample_id": sid, "field": field, "message": message})

        ids = sample.input_ids
        vocab = self.limits.vocab_size or MAX_TOKEN_ID + 1
        if not ids:
            err("input_ids", "must hold at least one token id")
        elif min(ids) < 0 or max(ids) >= vocab:  # builtins over the list: the common, valid case stays in C
            pos = next(i for i, t in enumerate(ids) if t < 0 or t >= vocab)
            err(f"input_ids.{pos}", f"token id {ids[pos]} is outside [0, {vocab}) of the model's vocabulary")
        if self.limits.max_tokens is not None and len(ids) > self.limits.max_tokens:
            err("input_ids", f"{len(ids)} tokens exceed the model server's limit of {self.limits.max_tokens}")
        mask = sample.loss_mask
        if mask is not None:
            if len(mask) != len(ids):
                err("loss_mask", f"has {len(mask)} values, input_ids has {len(ids)}")
            elif mask and (min(mask) < 0 or max(mask) > 1):
                err("loss_mask", "values must be 0 or 1")
        if self._is_duplicate(sid):
            err("id", f"duplicate sample id {sid!r}")
        if len(self.errors) > bad:
            return None
        packed_mask = None if mask is None or all(mask) else np.asarray(mask, dtype=np.uint8).tobytes()
        return NewSample(sid, np.asarray(ids, dtype="<i4").tobytes(), packed_mask, len(ids))


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


def body_items(samples: list[SampleIn]) -> Iterator[tuple[int, SampleIn, dict]]:
    for i, s in enumerate(samples):
        yield i, s, {}


def parse_line(index: int, lineno: int, line: bytes | str) -> tuple[int, SampleIn | list[dict], dict]:
    """One JSONL line as a sample, or as the errors that say why it is not one. The line is parsed
    and checked in one pass by pydantic's JSON parser (no intermediate Python dict)."""
    try:
        return index, SampleIn.model_validate_json(line, strict=True), {"line": lineno}
    except ValidationError as exc:
        return (
            index,
            [
                {
                    "sample_index": index,
                    "line": lineno,
                    "field": ".".join(str(p) for p in e["loc"]) or "sample",
                    "message": e["msg"],
                }
                for e in exc.errors()
            ],
            {},
        )


def numbered_lines(lines: Iterable[bytes | str]) -> Iterator[tuple[int, SampleIn | list[dict], dict]]:
    """Parse JSONL lines, skipping blank ones; sample index counts samples, line counts lines."""
    index = 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        yield parse_line(index, lineno, line)
        index += 1


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
        raise InvalidInput([{"field": "input_path", "message": f"no file {shown(relative)} under the input root"}])
    return path


def file_lines(path: Path, relative: str) -> Iterator[bytes]:
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise _unreadable(relative, _why(exc)) from None
    with f:
        yield from f


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


async def split_lines(chunks: AsyncIterable[bytes], digest: HASH) -> AsyncIterator[bytes]:
    """The lines of a streamed body, which also goes to `digest` as it arrives."""
    rest = b""
    async for chunk in chunks:
        digest.update(chunk)
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield line
    if rest:
        yield rest
