"""Prepared conversations stored on SQLite and Postgres alike: a batch whose samples carry no loss mask
at all (loss "all", or only failed and skipped ones) moves like any other, each sample to its own state."""

from __future__ import annotations

import json

import numpy as np
from sqlalchemy import select

from hsx.db import repository as repo
from hsx.db.models import SampleRow
from hsx.states import SampleState

CHAT = json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])


def conversations(n: int) -> list[repo.NewSample]:
    return [repo.NewSample(f"c{i}", b"", None, 0, SampleState.PREPARING, CHAT) for i in range(n)]


def ids(*values: int) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def test_a_batch_without_any_loss_mask_is_stored(sessions):
    with sessions.begin() as s:
        job = repo.create_job(s, name=None, layers=None, samples=conversations(4))
    with sessions.begin() as s:
        batch = repo.claim_preparing(s, job.id, "w", 64)
    assert len(batch) == 4
    prepared = [
        repo.Prepared(batch[0].pk, SampleState.QUEUED, ids(1, 2, 3), None, 3),  # loss "all": no mask stored
        repo.Prepared(batch[1].pk, SampleState.QUEUED, ids(4, 5), None, 2),
        repo.Prepared(batch[2].pk, SampleState.SKIPPED, reason="too_long: 9 tokens exceed max_length of 4"),
        repo.Prepared(batch[3].pk, SampleState.FAILED, reason="invalid: messages[0]: opens with an assistant turn"),
    ]
    with sessions.begin() as s:
        assert repo.store_prepared(s, job.id, "w", prepared) == 4
    with sessions() as s:
        rows = {r.sample_id: r for r in s.execute(select(SampleRow).where(SampleRow.job_id == job.id)).scalars()}
        j = repo.get_job(s, job.id)
    assert [rows[f"c{i}"].state for i in range(4)] == ["queued", "queued", "skipped", "failed"]
    assert rows["c0"].loss_mask is None and bytes(rows["c0"].input_ids) == ids(1, 2, 3)
    assert rows["c2"].last_error.startswith("too_long") and rows["c3"].last_error.startswith("invalid")
    assert (j.n_preparing, j.n_queued, j.n_skipped, j.n_failed, j.tokens_total) == (0, 2, 1, 1, 5)


def test_a_mask_beside_samples_without_one_is_kept(sessions):
    with sessions.begin() as s:
        job = repo.create_job(s, name=None, layers=None, samples=conversations(2))
    with sessions.begin() as s:
        batch = repo.claim_preparing(s, job.id, "w", 64)
    mask = np.asarray([0, 1], dtype=np.uint8).tobytes()
    prepared = [
        repo.Prepared(batch[0].pk, SampleState.QUEUED, ids(7, 8), mask, 2),
        repo.Prepared(batch[1].pk, SampleState.QUEUED, ids(9), None, 1),
    ]
    with sessions.begin() as s:
        repo.store_prepared(s, job.id, "w", prepared)
    with sessions() as s:
        masks = dict(
            s.execute(select(SampleRow.sample_id, SampleRow.loss_mask).where(SampleRow.job_id == job.id)).all()
        )
    assert bytes(masks["c0"]) == mask and masks["c1"] is None
