"""Checked samples, packed, waiting for the rest of their request.

A job's samples are all checked before any is stored, and a body may take minutes to arrive. They
wait here rather than in an open database transaction, which on SQLite would hold the one write
lock (and on Postgres a transaction) for as long as the client takes to send: the transaction that
stores them starts once the whole request is read and checked, and only copies packed rows.

The first MEMORY_BYTES stay in memory; beyond that the spool is an unnamed temporary file (in
$TMPDIR), so a request holds little memory whatever its size. Its samples take about 4 bytes per
token there, less than their JSON text.
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Generator, Iterator

from hsx.db.repository import NewSample
from hsx.states import SampleState

MEMORY_BYTES = 8 * 1024 * 1024
WRITE_BYTES = 256 * 1024
# sample id bytes, tokens, whether a loss mask follows (one byte per token), the state's index in
# _STATES, conversation bytes, reason bytes, the tokens before a cut (0: not cut); then the id, the
# int32 input ids, the mask, the conversation's JSON and the reason.
_HEADER = struct.Struct("<IIBBIII")
_STATES = (SampleState.QUEUED, SampleState.PREPARING, SampleState.SKIPPED)


class SampleSpool:
    def __init__(self) -> None:
        self._file = tempfile.SpooledTemporaryFile(max_size=MEMORY_BYTES)  # noqa: SIM115 - the spool's own, closed by close()
        self._pending = bytearray()  # records not yet written: one write per WRITE_BYTES, not three a sample
        self.count = 0
        self.tokens = 0
        self.preparing = 0  # conversations, whose tokens are counted once they are rendered

    def add(self, sample: NewSample) -> None:
        sid = sample.sample_id.encode()
        mask = sample.loss_mask
        conversation = (sample.conversation or "").encode()
        reason = (sample.reason or "").encode()
        pending = self._pending
        pending += _HEADER.pack(
            len(sid),
            sample.num_tokens,
            mask is not None,
            _STATES.index(sample.state),
            len(conversation),
            len(reason),
            sample.truncated_from or 0,
        )
        pending += sid
        pending += sample.input_ids
        if mask is not None:
            pending += mask
        pending += conversation
        pending += reason
        if len(pending) >= WRITE_BYTES:
            self._write()
        self.count += 1
        if sample.state == SampleState.QUEUED:
            self.tokens += sample.num_tokens
        self.preparing += sample.state == SampleState.PREPARING

    def batches(self, size: int) -> Iterator[list[NewSample]]:
        """Every sample, in the order added, `size` at a time."""
        batch: list[NewSample] = []
        for sample in self._records(with_data=True):
            batch.append(sample)
            if len(batch) >= size:
                yield batch
                batch = []
        if batch:
            yield batch

    def has_sample_id(self, sample_id: str) -> bool:
        """Whether a sample with this id was added (a scan: for the rare check a digest cannot settle)."""
        records = self._records(with_data=False)
        try:
            return any(s.sample_id == sample_id for s in records)
        finally:
            records.close()

    def close(self) -> None:
        self._file.close()

    def _write(self) -> None:
        self._file.write(self._pending)
        self._pending.clear()

    def _records(self, *, with_data: bool) -> Generator[NewSample, None, None]:
        self._write()
        f = self._file
        end = f.tell()
        f.seek(0)
        try:
            while f.tell() < end:
                sid_len, tokens, has_mask, state, conv_len, reason_len, cut = _HEADER.unpack(f.read(_HEADER.size))
                sid = f.read(sid_len).decode()
                ids_len = tokens * 4 if _STATES[state] == SampleState.QUEUED else 0
                data_len = ids_len + (tokens if has_mask else 0) + conv_len + reason_len
                if not with_data:
                    f.seek(data_len, 1)
                    yield NewSample(sid, b"", None, tokens, _STATES[state])
                    continue
                ids = f.read(ids_len)
                mask = f.read(tokens) if has_mask else None
                conversation = f.read(conv_len).decode() if conv_len else None
                reason = f.read(reason_len).decode() if reason_len else None
                yield NewSample(sid, ids, mask, tokens, _STATES[state], conversation, reason, cut or None)
        finally:
            f.seek(end)
