"""The Python SDK against the real service and reference server: sync and async clients, typed results and
errors, streaming submission, events, resumable and verified downloads."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
import torch
from safetensors import safe_open

from hsx.sdk import (
    AsyncHsxClient,
    ChecksumMismatch,
    Conflict,
    Forbidden,
    HsxClient,
    HsxError,
    InvalidInput,
    Job,
    Manifest,
    NotFound,
    PayloadTooLarge,
    Sample,
    ServerError,
    Shard,
    Throughput,
    ThroughputPoint,
    TokenInfo,
    Unauthorized,
    Writer,
)
from hsx.sdk.errors import error_from_response
from tests.support.procs import free_port
from tests.support.samples import make_samples
from tests.support.stack import start_stack, stop_stack

WRITE, READ = "sdk-writer", "sdk-reader"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, checkpoint):
    svc, ref = start_stack(
        tmp_path_factory.mktemp("sdk"),
        checkpoint,
        ["--shard-max-bytes", "60000", "--max-json-bytes", "200000", "--api-tokens", f"{WRITE},{READ}:read"],
        reference_extra=["--enable-fault-injection"],
    )
    yield svc, ref
    stop_stack(svc, ref)


@pytest.fixture(scope="module")
def stack(servers):
    return servers[0]


@pytest.fixture(scope="module")
def hsx(stack):
    with HsxClient(stack.url, token=WRITE) as client:
        yield client


@pytest.fixture(scope="module")
def done(hsx):
    """A finished job with several shards, and its samples."""
    samples = make_samples(8, seed=41, lo=20, hi=60)
    job = hsx.create_job(samples, name="sdk-done")
    assert isinstance(job, Job) and job.state == "queued" and job.counts.total == 8
    return hsx.wait(job, timeout=120, poll_s=0.1), samples


def test_typed_results_and_pagination(hsx, done):
    job, samples = done
    assert job.state == "succeeded" and job.counts.succeeded == 8 and job.finished_at is not None
    assert job.tokens.done == sum(len(s["input_ids"]) for s in samples) and job.rate_tokens_per_s > 0
    assert hsx.get_job(job.id) == hsx.get_job(job)  # an id or the Job itself

    listed = list(hsx.iter_samples(job, page_size=3))
    assert [s.id for s in listed] == [s["id"] for s in samples] and all(isinstance(s, Sample) for s in listed)
    page = hsx.list_samples(job, limit=3)
    assert page.has_more and page.next_after == samples[2]["id"] and len(page.data) == 3
    assert hsx.list_samples(job, state="failed").data == []
    one = hsx.get_sample(job, samples[1]["id"])
    assert one.state == "succeeded" and one.attempt_log and one.attempt_log[-1].outcome == "ok"

    jobs = hsx.list_jobs(limit=1)
    assert len(jobs.data) == 1 and isinstance(jobs.data[0], Job)
    assert job.id in {j.id for j in hsx.iter_jobs(state="succeeded", page_size=1)}

    manifest = hsx.manifest(job)
    assert isinstance(manifest, Manifest) and manifest.job_id == job.id and manifest.num_stored == 8
    assert len(manifest.shards) >= 2 and manifest.layers == [2, 4, 5, 8]
    assert {s.id for s in manifest.samples} == {s["id"] for s in samples}
    assert hsx.health().status == "ok"
    report = hsx.verify(job)
    assert report["ok"] is True and not report["shard_faults"] and not report["sample_faults"]


def test_throughput_shards_workers_and_token(stack, hsx, done):
    job, _ = done
    history = hsx.throughput(job, points=10)
    assert isinstance(history, Throughput) and len(history.points) <= 10
    assert sum(p.samples for p in history.points) == 8 and all(isinstance(p, ThroughputPoint) for p in history.points)
    shards = hsx.list_shards(job).data
    assert all(isinstance(s, Shard) for s in shards)
    assert [(s.name, s.sha256) for s in shards] == [(s.name, s.sha256) for s in hsx.manifest(job).shards]
    (writer,) = hsx.health().writers
    assert isinstance(writer, Writer) and writer.state == "ready" and writer.tokens_per_s is not None
    assert hsx.token_info() == TokenInfo(tokens_required=True, role="write")
    with HsxClient(stack.url, token=READ) as reader:
        assert reader.token_info().role == "read"

    async def scenario():
        async with AsyncHsxClient(stack.url, token=READ) as client:
            return (await client.throughput(job)), (await client.list_shards(job)), (await client.token_info())

    history, listed, token = asyncio.run(scenario())
    assert sum(p.tokens for p in history.points) == job.tokens.total
    assert listed.data == shards and token.role == "read"


def test_environment_gives_url_and_token(stack, monkeypatch):
    monkeypatch.setenv("HSX_URL", stack.url)
    monkeypatch.setenv("HSX_TOKEN", READ)
    with HsxClient() as client:
        assert client.base_url == stack.url
        assert client.list_jobs(limit=1).object == "list"
    monkeypatch.delenv("HSX_URL")
    assert HsxClient().base_url == "http://127.0.0.1:8000"


def test_typed_errors(stack, hsx, done):
    job, _ = done
    with pytest.raises(NotFound) as exc:
        hsx.get_job("job_missing")
    assert exc.value.status == 404 and exc.value.title == "Not Found" and "job_missing" in exc.value.detail
    with pytest.raises(NotFound):
        hsx.get_sample(job, "no-such-sample")
    with pytest.raises(Conflict) as exc:
        hsx.cancel(job)
    assert exc.value.status == 409 and exc.value.type == "/problems/invalid-transition"
    with pytest.raises(Conflict):
        hsx.retry(job)

    with pytest.raises(InvalidInput) as exc:
        hsx.create_job(
            [
                {"id": "ok", "input_ids": [1, 2]},
                {"id": "bad", "input_ids": [1, 2], "loss_mask": [1]},
                {"id": "worse", "input_ids": []},
            ]
        )
    err = exc.value
    assert err.status == 422 and err.type == "/problems/invalid-input" and err.title == "Invalid input"
    assert {e["sample_index"] for e in err.errors} == {1, 2}
    assert isinstance(err, HsxError) and "422" in str(err)

    with pytest.raises(PayloadTooLarge):
        hsx.create_job([{"input_ids": [1] * 1000}] * 100)

    with HsxClient(stack.url, token="") as anonymous, pytest.raises(Unauthorized) as exc:
        anonymous.list_jobs()
    assert exc.value.status == 401
    with HsxClient(stack.url, token=READ) as reader:
        assert reader.get_job(job).id == job.id
        with pytest.raises(Forbidden) as exc:
            reader.create_job([{"input_ids": [1]}])
        assert exc.value.status == 403
        with pytest.raises(Forbidden):
            reader.delete(job)

    problem = {"type": "/problems/internal", "title": "Internal Server Error", "status": 503, "detail": "x"}
    assert isinstance(error_from_response(httpx.Response(503, json=problem)), ServerError)
    plain = error_from_response(httpx.Response(502, text="bad gateway"))
    assert isinstance(plain, ServerError) and plain.detail == "bad gateway"


class ChunkReader:
    """A binary file that records every read, to show the upload never reads the file whole."""

    def __init__(self, f: BinaryIO):
        self.f, self.sizes = f, []

    def read(self, n: int = -1) -> bytes:
        self.sizes.append(n)
        return self.f.read(n)


def test_submit_jsonl_streams_and_idempotency(stack, hsx, tmp_path):
    samples = make_samples(4, seed=42)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    with path.open("rb") as f:
        reader = ChunkReader(f)
        job = hsx.submit_jsonl(reader, name="streamed", layers=[2, 4, 5, 8], idempotency_key="sdk-nd", chunk_size=256)
    assert job.name == "streamed" and job.layers == [2, 4, 5, 8] and job.counts.total == 4
    assert len(reader.sizes) > 2 and all(0 < n <= 256 for n in reader.sizes)
    again = hsx.submit_jsonl(path, name="streamed", layers=[2, 4, 5, 8], idempotency_key="sdk-nd")
    assert again.id == job.id

    first = hsx.create_job(samples[:1], idempotency_key="sdk-json")
    assert hsx.create_job(samples[:1], idempotency_key="sdk-json").id == first.id
    with pytest.raises(InvalidInput) as exc:
        hsx.create_job(samples[:2], idempotency_key="sdk-json")
    assert "Idempotency-Key" in exc.value.detail

    odd = [{**samples[0], "id": ".."}, {**samples[1], "id": "a b?#&ü"}]  # ids that need care in a URL path
    (stack.input_root / "server.jsonl").write_text("".join(json.dumps(s) + "\n" for s in odd))
    from_file = hsx.create_job(input_path="server.jsonl", name="server-side")
    seen = []
    final = hsx.wait(from_file, timeout=120, poll_s=0.1, on_progress=seen.append)
    assert final.state == "succeeded" and final.counts.succeeded == 2 and seen[-1] == final
    for s in odd:
        assert hsx.get_sample(final, s["id"]).id == s["id"]
        assert hsx.sample_tensors(final, s["id"])["input_ids"].tolist() == s["input_ids"]
    assert hsx.wait(job, timeout=120).state == "succeeded"


def test_wait_timeout_events_cancel_retry_delete(servers, hsx):
    stack, ref = servers
    big = hsx.create_job(make_samples(30, seed=43, lo=60, hi=120))
    with pytest.raises(TimeoutError):
        hsx.wait(big, timeout=0.3, poll_s=0.1)
    with pytest.raises(Conflict):
        hsx.delete(big)  # not finished
    cancelled = hsx.cancel(big)  # answers at once; the job is cancelled in the background
    assert cancelled.state == "cancelling" and cancelled.cancel_requested_at is not None
    states = [j.state for j in hsx.events(big)]
    assert states[-1] == "cancelled"
    assert hsx.wait(big, timeout=5).state == "cancelled"
    with pytest.raises(Conflict):
        hsx.cancel(big)

    # Every dump comes out a token short: the samples fail with the reason, and fail again on a retry.
    faults = f"{ref.url}/admin/faults"
    httpx.post(faults, json={"bad_dumps": {"probability": 1.0, "kind": "wrong_num_tokens"}}).raise_for_status()
    try:
        failed = hsx.wait(hsx.create_job(make_samples(2, seed=45)), timeout=120, poll_s=0.1)
        assert failed.state == "failed" and failed.counts.failed == 2
        reasons = [s.last_error for s in hsx.iter_samples(failed, state="failed")]
        assert len(reasons) == 2 and all("num_tokens" in r for r in reasons), reasons
        again = hsx.retry(failed)
        assert again.state in ("queued", "running", "failed")
        assert hsx.wait(again, timeout=120, poll_s=0.1).state == "failed"
    finally:
        httpx.delete(faults).raise_for_status()
    assert hsx.wait(hsx.retry(failed), timeout=120, poll_s=0.1).state == "succeeded"

    ok = hsx.wait(hsx.create_job(make_samples(1, seed=46)), timeout=120, poll_s=0.1)
    assert (stack.output_root / ok.id / "manifest.json").exists()
    assert hsx.delete(ok, files=True) is None
    assert not (stack.output_root / ok.id).exists()
    with pytest.raises(NotFound):
        hsx.get_job(ok)


def test_async_client(stack, hsx, tmp_path):
    samples = make_samples(3, seed=47)

    async def scenario():
        async with AsyncHsxClient(stack.url, token=WRITE) as client:
            job = await client.create_job(samples, name="async")
            states = [j.state async for j in client.events(job)]
            assert states[-1] == "succeeded" and len(states) >= 2
            final = await client.wait(job, poll_s=0.1)
            assert final.state == "succeeded" and final == await client.get_job(job.id)
            ids = [s.id async for s in client.iter_samples(job, page_size=2)]
            assert ids == [s["id"] for s in samples]
            assert job.id in [j.id async for j in client.iter_jobs(page_size=2)]
            assert (await client.get_sample(job, samples[0]["id"])).state == "succeeded"
            path = tmp_path / "a.jsonl"
            path.write_text("".join(json.dumps(s) + "\n" for s in samples))
            streamed = await client.submit_jsonl(path, name="async-nd")
            assert streamed.counts.total == 3
            manifest = await client.download_job(job, tmp_path / "dl")
            assert (await client.verify(job))["ok"] is True
            tensors = await client.sample_tensors(job, samples[0]["id"])
            assert tensors["input_ids"].tolist() == samples[0]["input_ids"]
            with pytest.raises(NotFound):
                await client.get_job("job_missing")
            with pytest.raises(Conflict):
                await client.retry(job)
            await client.wait(streamed, poll_s=0.1)
            return manifest

    manifest = asyncio.run(scenario())
    assert {p.name for p in (tmp_path / "dl").iterdir()} == {"manifest.json", *(s.name for s in manifest.shards)}
    assert Manifest.model_validate_json((tmp_path / "dl" / "manifest.json").read_text()) == manifest


class Recorder:
    """httpx event hook: the shard requests a client sends, with their Range header."""

    def __init__(self):
        self.requests: list[tuple[str, str | None]] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> None:
        if "/shards/" in request.url.path:
            with self.lock:
                self.requests.append((request.url.path.rsplit("/", 1)[1], request.headers.get("range")))


def assert_downloads_whole_job(
    client: HsxClient, rec: Recorder, job: Job, manifest: Manifest, sample: dict, out: Path
) -> None:
    """The whole job: every shard and manifest.json; a second run fetches nothing. One sample's
    tensors match its rows in the downloaded shard."""
    got = client.download_job(job, out)
    assert got == manifest
    assert json.loads((out / "manifest.json").read_text())["job_id"] == job.id
    for s in manifest.shards:
        assert hashlib.sha256((out / s.name).read_bytes()).hexdigest() == s.sha256
    rec.requests.clear()
    client.download_job(job, out)
    assert rec.requests == []

    entry = manifest.sample(sample["id"])
    tensors = client.sample_tensors(job, entry.id)
    with safe_open(str(out / entry.shard), framework="pt") as f:
        for key, value in tensors.items():
            assert torch.equal(value, f.get_slice(key)[entry.offset : entry.offset + entry.num_tokens])
    assert tensors["input_ids"].tolist() == sample["input_ids"]
    assert set(tensors) == {"input_ids", "loss_mask", "layer_2", "layer_4", "layer_5", "layer_8"}


def test_download_resumes_with_range_and_verifies_sha256(stack, done, tmp_path):
    job, samples = done
    rec = Recorder()
    with HsxClient(stack.url, token=WRITE, event_hooks={"request": [rec]}) as client:
        manifest = client.manifest(job)
        shard = manifest.shards[0]
        whole = client.download_shard(job, shard.name, tmp_path / "whole.safetensors")
        data = whole.read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard.sha256 and len(data) == shard.bytes

        # an interrupted download: the first 1000 bytes are in the .part file
        target = tmp_path / "resume" / shard.name
        target.parent.mkdir()
        Path(f"{target}.part").write_bytes(data[:1000])
        rec.requests.clear()
        progress = []
        assert (
            client.download_shard(job, shard.name, target.parent, on_progress=lambda *a: progress.append(a)) == target
        )
        assert rec.requests == [(shard.name, "bytes=1000-")]
        assert target.read_bytes() == data and not Path(f"{target}.part").exists()
        assert progress[0] == (shard.name, 1000, shard.bytes) and progress[-1][1:] == (shard.bytes, shard.bytes)

        # already there: nothing is fetched
        rec.requests.clear()
        assert client.download_shard(job, shard.name, target) == target and rec.requests == []

        # a corrupted part: the sha256 differs, nothing is renamed into place, the part is gone
        bad = tmp_path / "bad" / shard.name
        bad.parent.mkdir()
        Path(f"{bad}.part").write_bytes(b"\0" * 1000)
        with pytest.raises(ChecksumMismatch) as exc:
            client.download_shard(job, shard.name, bad, sha256=shard.sha256, size=shard.bytes)
        assert exc.value.expected == shard.sha256 and exc.value.status == 0
        assert not bad.exists() and not Path(f"{bad}.part").exists()
        # ... and the next try starts over and succeeds
        assert client.download_shard(job, shard.name, bad).read_bytes() == data

        # a complete part is verified and renamed without a request; one longer than the shard starts over
        for extra, expected in ((b"", []), (b"x", [(shard.name, None)])):
            dest = tmp_path / f"part{len(extra)}" / shard.name
            dest.parent.mkdir()
            Path(f"{dest}.part").write_bytes(data + extra)
            rec.requests.clear()
            assert client.download_shard(job, shard.name, dest).read_bytes() == data
            assert rec.requests == expected

        assert_downloads_whole_job(client, rec, job, manifest, samples[3], tmp_path / "job")

        with pytest.raises(NotFound):
            client.download_shard(job, "shard-999999.safetensors", tmp_path / "missing")
        with pytest.raises(HsxError):
            client.download_shard(job, "../escape", tmp_path)


def test_wait_polls_through_a_service_that_is_down_until_its_timeout():
    """Connection refused is an outage to wait through, not an error; the timeout still ends it."""
    with (
        HsxClient(f"http://127.0.0.1:{free_port()}", timeout=1) as hsx,
        pytest.raises(TimeoutError, match="not reachable"),
    ):
        hsx.wait("job_nowhere", timeout=0.5, poll_s=0.1)
