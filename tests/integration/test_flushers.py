"""The writer's shard flushers against a real database and real staged dumps: several flushers write
each sample once in gap-free numbered shards, a job ends with one small shard (its last samples wait
for the request still running), the time bound writes a smaller shard while samples are still queued,
a shard that could not be written takes no number, and a job's encoding is what its shards store and
its manifest records, layer by layer, from the database.

The test plays the request loop's part (claim, stage a dump, tell the flusher); the writer's own
request loops find no model server and claim nothing."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from hsx.manifest import load_manifest, read_sample
from hsx.storage.encoding import encoding_of
from hsx.storage.shards import shard_name
from hsx.training import HiddenStateDataset
from tests.support.writer_stack import HIDDEN, LAYERS, PER_SHARD, TOKENS, Stack, hidden_states


@pytest.fixture
def stacks(tmp_path, database_url):
    made: list[Stack] = []

    def make(**settings) -> Stack:
        stack = Stack(tmp_path / f"w{len(made)}", database_url, **settings)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.stop()


def assert_stored_once(stack: Stack, job_id: str, n: int) -> None:
    folder = stack.settings.output_root / job_id
    manifest = load_manifest(folder)
    assert [s.id for s in manifest.samples] == [f"s{i:03d}" for i in range(n)], "every sample stored once"
    # numbered without gaps, and listed in the order recorded: the commit feed's 1, 2, ...
    assert sorted(sh.name for sh in manifest.shards) == [shard_name(i) for i in range(len(manifest.shards))]
    assert [sh.seq for sh in manifest.shards] == list(range(1, len(manifest.shards) + 1))
    assert {p.name for p in folder.glob("*.safetensors")} == {sh.name for sh in manifest.shards}
    for i in range(n):
        got = read_sample(folder, manifest, f"s{i:03d}")
        for layer, truth in hidden_states(i).items():
            assert torch.equal(got[f"layer_{layer}"], truth), (i, layer)


def test_several_flushers_write_staged_samples_once_in_full_gap_free_shards(stacks, caplog):
    stack = stacks(flushers=3)
    job_id = stack.job(8 * PER_SHARD)
    # Staged before the writer starts (as after a crash): eight full shards wait for three flushers.
    stack.extract(8 * PER_SHARD, tell=False)
    with caplog.at_level(logging.INFO, logger="hsx.writer"):
        stack.start()
        job = stack.finished(job_id)
    assert job.state == "succeeded" and job.n_succeeded == 8 * PER_SHARD
    assert stack.shards(job_id) == [(shard_name(i), PER_SHARD) for i in range(8)]
    assert_stored_once(stack, job_id, 8 * PER_SHARD)
    writers = {r.threadName for r in caplog.records if " wrote shard-" in r.getMessage()}
    assert len(writers) >= 2 and all(t.startswith("hsx-flusher-") for t in writers), writers
    assert not any(stack.writer.staging.glob(f"{job_id}/*")), "staged dumps are removed once in a shard"


def test_the_last_samples_wait_for_the_request_still_running_and_end_in_one_small_shard(stacks):
    stack = stacks(flushers=2, shard_max_wait_s=600)
    stack.start()
    job_id = stack.job(2 * PER_SHARD + 3)
    stack.extract(2 * PER_SHARD + 2)
    last = stack.claim()  # nothing is queued now; this request is still running
    stack.flusher.wake()
    stack.wait(lambda: len(stack.shards(job_id)) == 2)
    time.sleep(1.5)  # several turns of every flusher
    assert stack.shards(job_id) == [(shard_name(0), PER_SHARD), (shard_name(1), PER_SHARD)]
    assert stack.state(job_id).n_staged == 2, "the two staged samples wait for the running one"
    stack.stage(last)
    job = stack.finished(job_id)
    assert job.state == "succeeded"
    assert stack.shards(job_id) == [(shard_name(0), PER_SHARD), (shard_name(1), PER_SHARD), (shard_name(2), 3)]
    assert_stored_once(stack, job_id, 2 * PER_SHARD + 3)


def test_the_time_bound_writes_a_smaller_shard_while_samples_are_still_queued(stacks):
    stack = stacks(flushers=2, shard_max_wait_s=0.5)
    stack.start()
    job_id = stack.job(4 * PER_SHARD)
    stack.extract(2)
    stack.wait(lambda: stack.shards(job_id) == [(shard_name(0), 2)])
    assert stack.state(job_id).n_queued == 4 * PER_SHARD - 2
    stack.extract(4 * PER_SHARD - 2)
    assert stack.finished(job_id).state == "succeeded"
    assert_stored_once(stack, job_id, 4 * PER_SHARD)


def test_a_shard_that_could_not_be_written_takes_no_number(stacks):
    stack = stacks(flushers=2, shard_max_wait_s=600)
    stack.start()
    job_id = stack.job(PER_SHARD + 1)
    stack.extract(1)
    stack.stage(stack.claim(), nan=True)  # found when its shard is written: that attempt fails
    stack.extract(PER_SHARD - 2)  # a full shard's worth: written, and refused for the NaN
    stack.wait(lambda: stack.state(job_id).n_queued == 2)
    assert stack.shards(job_id) == [], "nothing stored with the sample that failed"
    stack.extract(2)  # the failed sample again (index 1 comes first), then the last one
    assert stack.finished(job_id).state == "succeeded"
    # Numbered as they are recorded: the last shard may be on disk before the full one written beside it.
    assert sorted(n for _, n in stack.shards(job_id)) == [1, PER_SHARD]
    assert_stored_once(stack, job_id, PER_SHARD + 1)


@pytest.mark.parametrize("encoding", ["lossless", "fp8"])
def test_a_jobs_encoding_is_what_its_shards_store_and_its_manifest_records(stacks, encoding):
    stack = stacks(flushers=2, shard_max_wait_s=600)
    stack.start()
    job_id = stack.job(PER_SHARD + 2, {"encoding": encoding})
    stack.stage(stack.claim(), nan=True)  # refused while its shard is encoded: that attempt fails
    stack.extract(PER_SHARD + 1)
    stack.wait(lambda: stack.state(job_id).n_queued == 1)
    stack.extract(1)  # the refused sample again
    assert stack.finished(job_id).state == "succeeded"
    folder = stack.settings.output_root / job_id
    manifest = load_manifest(folder)
    assert manifest.encoding == encoding
    assert [s.id for s in manifest.samples] == [f"s{i:03d}" for i in range(PER_SHARD + 2)]
    for shard in manifest.shards:
        with open(folder / shard.name, "rb") as f:
            header = f.read(8 + int.from_bytes(f.read(8), "little"))
        assert all(name.encode() in header for i in LAYERS for name in encoding_of(encoding).tensor_names(f"layer_{i}"))
    # per layer, added up over the shards the database recorded
    assert [e.layer for e in manifest.encoded_layers] == LAYERS
    for e in manifest.encoded_layers:
        assert e.raw_bytes == (PER_SHARD + 2) * TOKENS * HIDDEN * 2
        assert 0 < e.bytes < e.raw_bytes
        assert (e.max_error is None) if encoding == "lossless" else (0 < e.mean_error < e.max_error <= 1 / 28 + 2**-7)
    ds = HiddenStateDataset(folder, aux_layers=[LAYERS[0]], last_layer=LAYERS[1])
    for k, item in enumerate(ds):
        truth = hidden_states(k)
        for layer, got in ((LAYERS[0], item["aux_hidden_state"]), (LAYERS[1], item["hidden_state"])):
            assert got.dtype == torch.bfloat16
            if encoding == "lossless":
                assert torch.equal(got, truth[layer])
            else:
                largest = truth[layer].float().abs().amax(dim=1, keepdim=True)
                assert float(((got.float() - truth[layer].float()).abs() / largest).max()) <= 1 / 28 + 2**-7
