"""Checking samples and spooling the good ones (hsx.service.intake, hsx.service.spool): short and long
lists get the same verdicts, the spool gives back exactly what went in, in order, from memory or disk."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hsx.db.repository import NewSample
from hsx.service.errors import InvalidInput
from hsx.service.intake import Ingest, Limits, parse_sample, resolve_input_path
from hsx.service.spool import MEMORY_BYTES, SampleSpool

VOCAB = 1000


def check(*samples: dict) -> list[NewSample] | list[dict]:
    """The spooled rows when every sample passes, else the error entries."""
    ingest = Ingest(Limits(vocab_size=VOCAB))
    try:
        for i, s in enumerate(samples):
            ingest.feed(*parse_sample(i, json.dumps(s).encode(), {}))
        return [row for batch in ingest.finish().batches(7) for row in batch]
    except InvalidInput as exc:
        return exc.extra["errors"]
    finally:
        ingest.close()


@pytest.mark.parametrize("length", [1, 5, 64, 65, 3000])
def test_short_and_long_lists_get_the_same_verdicts(length):
    ids = [(7 * i) % VOCAB for i in range(length)]
    (row,) = check({"id": "ok", "input_ids": ids, "loss_mask": [(i + 1) % 2 for i in range(length)]})
    assert row.sample_id == "ok" and row.num_tokens == length
    assert np.frombuffer(row.input_ids, "<i4").tolist() == ids
    assert (row.loss_mask is None) == (length == 1)  # all ones is stored as no mask
    for bad, message in ((VOCAB, "outside [0, 1000)"), (-1, "outside"), (2**70, "outside"), (2**40, "outside")):
        errors = check({"input_ids": ids[:-1] + [bad]})
        assert errors[0]["field"] == f"input_ids.{length - 1}" and message in errors[0]["message"], errors
    for bad in (2, -1, 2**70):
        errors = check({"input_ids": ids, "loss_mask": [1] * (length - 1) + [bad]})
        assert errors[0]["field"] == "loss_mask" and errors[0]["message"] == "values must be 0 or 1"


def test_duplicates_are_found_among_spooled_samples():
    samples = [{"id": f"s{i}", "input_ids": [i % VOCAB]} for i in range(5000)] + [{"id": "s1234", "input_ids": [1]}]
    errors = check(*samples)
    assert errors == [
        {"sample_index": 5000, "sample_id": "s1234", "field": "id", "message": "duplicate sample id 's1234'"}
    ]


def test_the_spool_gives_back_what_went_in_from_memory_or_disk():
    rng = np.random.default_rng(0)
    rows = []
    for i in range(400):
        n = int(rng.integers(1, 12000))
        mask = rng.integers(0, 2, n, dtype=np.uint8).tobytes() if i % 3 else None
        rows.append(NewSample(f"id-{i}-ünï/{'x' * (i % 5)}", rng.integers(0, 2**31, n, "<i4").tobytes(), mask, n))
    spool = SampleSpool()
    try:
        for row in rows:
            spool.add(row)
        assert sum(len(r.input_ids) for r in rows) > MEMORY_BYTES  # past what is kept in memory
        assert spool.count == len(rows) and spool.tokens == sum(r.num_tokens for r in rows)
        assert [r for batch in spool.batches(33) for r in batch] == rows
        assert spool.has_sample_id("id-399-ünï/xxxx") and not spool.has_sample_id("id-399")
        spool.add(NewSample("late", b"\x01\x00\x00\x00", None, 1))  # adding after reading goes on at the end
        assert [r.sample_id for batch in spool.batches(1000) for r in batch][-2:] == ["id-399-ünï/xxxx", "late"]
    finally:
        spool.close()


def test_a_missing_input_file_is_named_with_the_input_root(tmp_path):
    root = tmp_path / "input"
    root.mkdir()
    (root / "there.jsonl").write_text("")
    assert resolve_input_path(root, "there.jsonl") == root / "there.jsonl"
    for relative in ("x.jsonl", "sub/x.jsonl"):
        with pytest.raises(InvalidInput) as caught:
            resolve_input_path(tmp_path / "input" / ".", relative)
        [error] = caught.value.extra["errors"]
        assert error == {"field": "input_path", "message": f"no file {relative!r} under the input root {root}"}
