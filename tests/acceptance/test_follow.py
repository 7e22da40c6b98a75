"""Training while a job extracts, against the real service (on SQLite and on Postgres) and the synthetic
reference server with a prefill time, so that the job runs for seconds and records many small shards:

- a follower started before the job's first shard reads every stored sample exactly once per epoch, two
  epochs, and the same tensors as the Dataset over the finished job;
- trainer processes SIGKILLed at random and resumed from their last checkpoint yield, checkpoint by
  checkpoint, exactly the order of a run never interrupted;
- two ranks of two DataLoader workers each read disjoint, complete shares of equal size;
- a byte flipped on the way (a proxy that corrupts a shard's download) is fetched again, never yielded;
- retention acked with two consumers and max_unread_bytes: extraction waits for them, the folder stays
  within the limit plus a shard, and each shard is deleted only once both have read it;
- the service killed and started again while a follower reads: the feed goes on, no gap, no repeat.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hsx.sdk import HsxClient
from hsx.sdk.aio import AsyncHsxClient
from hsx.training import HiddenStateDataset, HiddenStateStream
from tests.support.flipping_proxy import FlippingProxy
from tests.support.procs import Process, start_synthetic
from tests.support.stack import start_service

HIDDEN, LAYERS_L, VOCAB, TOKENS = 64, 8, 1000, 48
SAMPLE_BYTES = TOKENS * 4 * HIDDEN * 2 + TOKENS * 16  # four bf16 layers, ids and mask
SHARD_BYTES = 4 * SAMPLE_BYTES


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def stack(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"follow-{request.param}")
    url = f"sqlite:///{tmp / 'hsx.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_module_url")
    ref, ref_url = start_synthetic(
        tmp,
        hidden=HIDDEN,
        num_layers=LAYERS_L,
        vocab=VOCAB,
        dump_root=tmp / "dumps",
        extra=["--prefill-us-per-token", "1500", "--skip-server-warmup"],
    )
    svc = Stack(tmp, url, ref_url)
    yield svc
    svc.stop()
    ref.stop()


class Stack:
    """The service beside the synthetic server, started again on the same port when a test kills it."""

    def __init__(self, tmp: Path, database_url: str, ref_url: str):
        self.tmp, self.database_url, self.ref_url = tmp, database_url, ref_url
        self.svc = self._start(port=None)

    def _start(self, port: int | None):
        extra = ["--shard-max-bytes", str(SHARD_BYTES), "--shard-max-wait-s", "1", "--flushers", "2"]
        return start_service(
            self.tmp, self.database_url, backend_url=self.ref_url, dump_root=self.tmp / "dumps", extra=extra, port=port
        )

    @property
    def url(self) -> str:
        return self.svc.url

    def restart(self) -> None:
        port = int(self.url.rsplit(":", 1)[1])
        self.svc.proc.kill(signal.SIGKILL)
        self.svc.client.close()
        self.svc = self._start(port)

    def job(self, n: int, **options) -> str:
        rng = random.Random(n)
        samples = [{"id": f"s{i:04d}", "input_ids": [rng.randrange(1, VOCAB) for _ in range(TOKENS)]} for i in range(n)]
        resp = self.svc.post_job({"samples": samples, **options})
        assert resp.status_code == 202, resp.text
        return resp.json()["id"]

    def folder(self, job_id: str) -> Path:
        return self.svc.output_root / job_id

    def stop(self) -> None:
        self.svc.stop()


def trainer(stack: Stack, job: str, tmp: Path, name: str, *args: str) -> Process:
    cmd = [sys.executable, "-m", "tests.support.follow_trainer", "--url", stack.url, "--job", job]
    cmd += ["--log", str(tmp / f"{name}.log"), "--checkpoint", str(tmp / f"{name}.ckpt")]
    cmd += ["--cache", str(tmp / "cache"), *args]
    return Process(cmd, tmp / f"{name}.out")


def finished(proc: Process, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while proc.proc.poll() is None:
        assert time.monotonic() < deadline, proc.log()[-3000:]
        time.sleep(0.2)
    assert proc.proc.returncode == 0, proc.log()[-3000:]


def committed(log: Path) -> list[str]:
    """The items a trainer's log says it yielded for good. Each run starts with `RESUME n`, n the items its
    checkpoint counts: of the run before, the items up to that checkpoint stand (the rest, read after it,
    come again); a run that ends with DONE stands whole."""
    out: list[str] = []
    current: list[str] = []
    for line in log.read_text().splitlines():
        if line.startswith("RESUME "):
            n = int(line.split()[1])
            out += current[: n - len(out)]
            current = []
            assert len(out) == n, "a run resumes from what the runs before it read up to its checkpoint"
        elif line.startswith("CKPT "):
            out += current
            current = []
            assert int(line.split()[1]) == len(out), "a checkpoint counts exactly the items before it"
        elif line == "DONE":
            out += current
            current = []
        else:
            current.append(line.split()[0])
    return out


def test_a_follower_started_first_reads_every_sample_once_per_epoch(stack, tmp_path):
    job = stack.job(24)
    with HsxClient(stack.url) as hsx:
        stream = HiddenStateStream(hsx, job, epochs=2, cache_dir=tmp_path / "cache", wait_s=2)
        items = []
        first_at = None
        for item in stream:
            first_at = first_at or time.monotonic()
            items.append(item)
        final = hsx.get_job(job)
    assert final.state == "succeeded" and final.counts.succeeded == 24
    ids = [it["id"] for it in items]
    assert len(ids) == 48 and sorted(ids[:24]) == sorted(ids[24:]) == [f"s{i:04d}" for i in range(24)]
    dataset = {it["id"]: it for it in HiddenStateDataset(stack.folder(job))}
    for it in items:
        want = dataset[it["id"]]
        for key in ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state"):
            assert torch.equal(it[key], want[key]), (it["id"], key)
    assert not any((tmp_path / "cache").rglob("*.safetensors"))  # every download deleted once read


def test_trainers_killed_at_random_resume_exactly_where_they_checkpointed(stack, tmp_path):
    job = stack.job(60)
    args = ["--shuffle", "5", "--seed", "3", "--every", "4", "--item-sleep", "0.03", "--consumer", "train"]
    rng = random.Random(11)
    log = tmp_path / "killed.log"
    for _ in range(4):
        proc = trainer(stack, job, tmp_path, "killed", *args)
        time.sleep(rng.uniform(1.0, 3.0))
        proc.kill(signal.SIGKILL)
    finished(trainer(stack, job, tmp_path, "killed", *args))
    got = committed(log)

    whole = tmp_path / "whole"
    whole.mkdir()
    finished(trainer(stack, job, whole, "whole", *args[:-2]))
    assert got == committed(whole / "whole.log")  # exactly once, in the uninterrupted order
    assert sorted(got) == [f"s{i:04d}" for i in range(60)]
    with HsxClient(stack.url) as hsx:
        assert hsx.consumer(job, "train").read_seq == hsx.list_shards(job).committed


def test_two_ranks_of_two_workers_share_a_running_job(stack, tmp_path):
    """Rank 0 downloads its shards over HTTP, rank 1 reads them from the job's folder (a shared file system);
    both acknowledge, from their StatefulDataLoader's state, under one consumer of two ranks."""
    job = stack.job(30, consumers=["ddp"])
    split = ["--world-size", "2", "--workers", "2", "--every", "5", "--consumer", "ddp"]
    ranks = [
        trainer(stack, job, tmp_path, "rank0", "--rank", "0", *split),
        trainer(stack, job, tmp_path, "rank1", "--rank", "1", "--files", str(stack.folder(job)), *split),
    ]
    for proc in ranks:
        finished(proc)
    shares = [committed(tmp_path / f"rank{r}.log") for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == 15
    assert sorted(shares[0] + shares[1]) == [f"s{i:04d}" for i in range(30)]
    with HsxClient(stack.url) as hsx:
        consumer = hsx.consumer(job, "ddp")
        assert consumer.world_size == 2 and [r.rank for r in consumer.ranks] == [0, 1]
        assert consumer.read_seq == hsx.list_shards(job).committed  # the last checkpoint came after the last item


def test_a_byte_flipped_on_the_way_is_fetched_again_never_yielded(stack, tmp_path):
    job = stack.job(12)
    with HsxClient(stack.url) as hsx:
        hsx.wait(job, timeout=120)
        dataset = {it["id"]: it for it in HiddenStateDataset(stack.folder(job))}
    with FlippingProxy(stack.url, flips=2) as proxy, HsxClient(proxy.url) as hsx:
        items = list(HiddenStateStream(hsx, job, cache_dir=tmp_path / "cache"))
        assert proxy.flipped == 2  # two downloads came corrupted
    assert sorted(it["id"] for it in items) == sorted(dataset)
    for it in items:
        assert torch.equal(it["hidden_state"], dataset[it["id"]]["hidden_state"])


def test_retention_and_back_pressure_keep_the_folder_within_its_limit(stack, tmp_path):
    limit = 3 * SHARD_BYTES
    job = stack.job(40, consumers=["a", "b"], retention="acked", max_unread_bytes=limit)
    folder = stack.folder(job)
    high, waited = [0], [False]
    stop = threading.Event()

    def watch() -> None:
        with HsxClient(stack.url) as hsx:
            while not stop.is_set():
                size = sum(p.stat().st_size for p in folder.glob("shard-*.safetensors") if p.exists())
                high[0] = max(high[0], size)
                waited[0] = waited[0] or "waiting for consumers" in (hsx.get_job(job).waiting_reason or "")
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    slow = ["--every", "2", "--item-sleep", "0.15"]
    try:
        procs = [trainer(stack, job, tmp_path, name, "--consumer", name, *slow) for name in ("a", "b")]
        for proc in procs:
            finished(proc)
    finally:
        stop.set()
        watcher.join()
    for name in ("a", "b"):
        assert sorted(committed(tmp_path / f"{name}.log")) == [f"s{i:04d}" for i in range(40)]
    assert waited[0], "extraction never waited for the consumers"
    # the limit, plus the shard each of the writer's two flushers may be writing
    assert high[0] <= limit + 2 * SHARD_BYTES, (high[0], limit)
    with HsxClient(stack.url) as hsx:
        shards = hsx.list_shards(job).data
    assert shards and all(s.deleted for s in shards) and not list(folder.glob("shard-*"))


def test_the_feed_goes_on_across_a_service_restart(stack, tmp_path):
    job = stack.job(40)
    proc = trainer(stack, job, tmp_path, "through", "--every", "3", "--item-sleep", "0.05")
    log = tmp_path / "through.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):  # it reads, the job still runs
        assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()[-3000:]
        time.sleep(0.1)
    stack.restart()
    finished(proc)
    got = committed(tmp_path / "through.log")
    assert sorted(got) == [f"s{i:04d}" for i in range(40)] and len(got) == len(set(got))


def test_hsx_follow_mirrors_the_shards_as_they_come_and_goes_on_where_it_was(stack, tmp_path):
    job = stack.job(20)
    mirror = tmp_path / "mirror"
    cmd = [sys.executable, "-m", "hsx.cli", "follow", job, "--url", stack.url, "--download", str(mirror), "--json"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = first.stdout.readline()  # the first shard, mirrored while the job runs
    first.kill()
    first.wait()
    assert json_line(line)["seq"] == 1 and json_line(line)["downloaded"]
    assert (mirror / ".follow-position").read_text().strip() == "1"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    seqs = [json_line(x)["seq"] for x in done.stdout.splitlines()]
    assert seqs == list(range(2, len(seqs) + 2))  # went on after the first, none twice
    dataset = HiddenStateDataset(mirror)  # a complete job folder, manifest.json last
    assert sorted(dataset.sample_ids) == [f"s{i:04d}" for i in range(20)]
    with HsxClient(stack.url) as hsx:
        assert [s.seq for s in hsx.follow_shards(job)] == list(range(1, len(seqs) + 2))
        assert [s.name for s in hsx.follow_shards(job, after=len(seqs))] == [hsx.list_shards(job).data[-1].name]


def test_the_async_client_follows_the_feed_too(stack):
    job = stack.job(8)

    async def follow() -> list[int]:
        async with AsyncHsxClient(stack.url) as hsx:
            return [s.seq async for s in hsx.follow_shards(job, wait=5)]

    seqs = asyncio.run(follow())
    with HsxClient(stack.url) as hsx:
        assert seqs == list(range(1, hsx.list_shards(job).committed + 1)) and hsx.get_job(job).state == "succeeded"


def json_line(line: str) -> dict:
    return json.loads(line)
