"""The service's tensor route and shard downloads over damaged shards, on SQLite and PostgreSQL (FastAPI's
TestClient over create_app, no writer; the jobs stored through the repository with hsx's own shard writer,
then their files edited): HEAD answers from the shard's header and metadata and decodes nothing; a shard that
fails a check is a 500 shard-damaged problem naming the shard, the layer and the sample, in bounded memory;
a shard file that is no longer what its record says is never served under its recorded ETag."""

from __future__ import annotations

import hashlib
import tracemalloc

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from hsx.api.app import create_app
from hsx.config import Settings
from hsx.db.engine import make_engine, session_factory
from hsx.db.models import SampleRow
from hsx.storage import planes
from tests.support.api import migrated, problem
from tests.support.damage import Shard, crafted_block, flip_byte, set_scale
from tests.support.stored import stored_job

HIDDEN = 64


@pytest.fixture
def service(tmp_path, database_url):
    """The API (no writer) on a fresh database of each kind, and sessions on that database."""
    (tmp_path / "input").mkdir()
    settings = Settings(
        database_url=database_url,
        output_root=tmp_path / "output",
        input_root=tmp_path / "input",
        dump_root=tmp_path / "dumps",
        backend_url="http://127.0.0.1:9",
        run_writer=False,
        api_tokens="",
    )
    migrated(settings)
    engine = make_engine(database_url)
    with TestClient(create_app(settings)) as api:
        yield api, session_factory(engine), settings.output_root
    engine.dispose()


def damaged(resp, shard: str, layer: str | None, sample: str | None, problem_text: str) -> dict:
    body = problem(resp, 500)
    assert body["type"] == "/problems/shard-damaged" and body["shard"] == shard
    assert body.get("layer") == layer and body.get("sample_id") == sample
    assert problem_text in body["detail"] and "hsx verify" in body["detail"]
    return body


def test_head_answers_from_metadata_and_get_refuses_a_damaged_frame(service, monkeypatch):
    api, sessions, root = service
    job_id, manifest, _ = stored_job(sessions, root, encoding="lossless")
    url = f"/v1/jobs/{job_id}/tensors/s-2"
    sound = api.get(url)
    assert sound.status_code == 200
    entry = manifest.sample("s-2")
    path = root / job_id / entry.shard
    start, end = Shard(path).frame("layer_5", 0, 0)
    flip_byte(path, (start + end) // 2)
    decodes = []
    real = planes.decompress
    monkeypatch.setattr(planes, "decompress", lambda *a: decodes.append(1) or real(*a))
    head = api.head(url)
    assert head.status_code == 200 and decodes == [], "HEAD decodes nothing"
    assert int(head.headers["content-length"]) == len(sound.content)
    assert head.headers["content-disposition"] == sound.headers["content-disposition"]
    body = damaged(api.get(url), entry.shard, "layer_5", "s-2", "checksum")
    assert body["detail"].startswith(f"job {job_id}: {entry.shard}, layer_5, sample 's-2': block 0 (rows 0..30)")
    assert decodes, "GET decodes"
    assert api.get(f"/v1/jobs/{job_id}/tensors/s-0").status_code == 200, "other shards still answer"


def test_a_crafted_block_is_refused_by_head_and_get_in_bounded_memory(service):
    api, sessions, root = service
    job_id, manifest, _ = stored_job(sessions, root, encoding="lossless")
    entry = manifest.sample("s-1")
    shard = Shard(root / job_id / entry.shard)
    crafted_block(shard, "layer_4", 4 * 2**20, HIDDEN, 2)  # 512 MiB if decoded, in a file of a few KB
    shard.save()
    url = f"/v1/jobs/{job_id}/tensors/s-1"
    tracemalloc.start()
    try:
        for resp in (api.head(url), api.get(url), api.get(url)):
            assert resp.status_code == 500
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, f"{peak / 2**20:.0f} MiB"
    damaged(api.get(url), entry.shard, "layer_4", "s-1", "layer_4.rows covers rows 0..4194304, the shard holds 90")


def test_an_fp8_scale_no_writer_makes_is_refused(service):
    api, sessions, root = service
    job_id, manifest, _ = stored_job(sessions, root, encoding="fp8")
    entry = manifest.sample("s-0")
    set_scale(root / job_id / entry.shard, "layer_8", 3, -2.0)
    damaged(api.get(f"/v1/jobs/{job_id}/tensors/s-0"), entry.shard, "layer_8", "s-0", "row 3's scale is -2.0")
    assert api.head(f"/v1/jobs/{job_id}/tensors/s-0").status_code == 200, "a scale is data: HEAD reads none"


def test_a_recorded_offset_the_shard_disagrees_with_is_refused(service):
    api, sessions, root = service
    job_id, manifest, _ = stored_job(sessions, root)
    with sessions.begin() as s:
        s.execute(
            update(SampleRow).where(SampleRow.job_id == job_id, SampleRow.sample_id == "s-1").values(shard_offset=0)
        )
    entry = manifest.sample("s-1")
    for resp in (api.get(f"/v1/jobs/{job_id}/tensors/s-1"), api.head(f"/v1/jobs/{job_id}/tensors/s-1")):
        assert resp.status_code == 500
    damaged(
        api.get(f"/v1/jobs/{job_id}/tensors/s-1"),
        entry.shard,
        None,
        "s-1",
        "recorded at rows 0..50, but the shard places it at 40..90",
    )


def test_a_shard_is_served_only_as_what_its_record_says(service):
    api, sessions, root = service
    job_id, manifest, _ = stored_job(sessions, root, lengths=(40, 50, 30, 20, 10))
    first, second, third = manifest.shards
    url = f"/v1/jobs/{job_id}/shards/"
    sound = api.get(url + third.name)
    assert sound.status_code == 200 and sound.headers["etag"] == f'"{hashlib.sha256(sound.content).hexdigest()}"'
    assert api.head(url + third.name).headers["etag"] == sound.headers["etag"]
    flip_byte(root / job_id / first.name, first.bytes // 2)  # the same size, other bytes
    with open(root / job_id / second.name, "ab") as f:
        f.write(b"\0" * 8)
    for resp in (
        api.get(url + first.name),
        api.head(url + first.name),
        api.get(url + first.name, headers={"Range": "bytes=0-9"}),
    ):
        assert resp.status_code == 500 and "etag" not in resp.headers
    damaged(api.get(url + first.name), first.name, None, None, f"its record's {first.sha256}: it changed since")
    damaged(
        api.get(url + second.name),
        second.name,
        None,
        None,
        f"holds {second.bytes + 8} bytes, its record {second.bytes}",
    )
    assert api.get(url + third.name).content == sound.content
