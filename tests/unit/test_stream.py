"""HiddenStateStream over a finished job's folder: the Dataset's items, every rank and DataLoader worker
its own share, as many per rank, epochs, the contract checked first, and a resume that yields exactly
the items after the saved state, in the order of a run never interrupted (a plain loop and torchdata's
StatefulDataLoader)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from hsx.training import Expect, HiddenStateDataset, HiddenStateStream
from tests.support.jobs import make_job

N = 23


@pytest.fixture(scope="module", params=["raw", "lossless", "fp8"])
def job(request, tmp_path_factory):
    return make_job(
        tmp_path_factory.mktemp(request.param),
        num_samples=N,
        samples_per_shard=4,
        encoding=request.param,
        model={"model_path": "/models/tiny-llama", "num_hidden_layers": 8},
        post_norm_layers=[8],
    )


def ids(items) -> list[str]:
    return [it["id"] for it in items]


def test_items_are_the_datasets_items(job):
    dataset = HiddenStateDataset(job.job_dir)
    items = list(HiddenStateStream(job.job_dir))
    assert ids(items) == dataset.sample_ids  # no shuffle: feed order, which is the manifest's here
    for got, want in zip(items, dataset, strict=True):
        assert got.keys() == want.keys()
        for key in ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state"):
            assert torch.equal(got[key], want[key]), (got["id"], key)


@pytest.mark.parametrize("world, workers", [(2, 0), (2, 2), (3, 2)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_and_workers_read_disjoint_shares_of_equal_size(job, world, workers, drop_last):
    per_rank = {}
    for rank in range(world):
        stream = HiddenStateStream(
            job.job_dir, rank=rank, world_size=world, drop_last=drop_last, shuffle_buffer=3, seed=1
        )
        loader = DataLoader(stream, batch_size=None, num_workers=workers)
        per_rank[rank] = ids(loader)
    assert len({len(v) for v in per_rank.values()}) == 1  # DDP needs the same count on every rank
    seen = Counter(sid for v in per_rank.values() for sid in v)
    if drop_last:
        assert len(per_rank[0]) == N // world and max(seen.values()) == 1
        assert N - len(seen) < world
    else:
        assert len(per_rank[0]) == -(-N // world) and set(seen) == {s.id for s in job.samples}
        assert sum(seen.values()) - N == (world - N % world) % world  # the repeats, fewer than world_size


def test_epochs_read_everything_again_in_a_new_order(job):
    items = ids(HiddenStateStream(job.job_dir, epochs=3, shuffle_buffer=5, seed=4))
    assert len(items) == 3 * N
    first, second, third = items[:N], items[N : 2 * N], items[2 * N :]
    assert sorted(first) == sorted(second) == sorted(third) == sorted(s.id for s in job.samples)
    assert first != second != third


def test_a_plain_loop_resumes_exactly_after_its_saved_state(job):
    kw = {"shuffle_buffer": 4, "seed": 7, "epochs": 2}
    whole = ids(HiddenStateStream(job.job_dir, **kw))
    for stop in (0, 1, 9, N, N + 5, 2 * N - 1):
        stream = HiddenStateStream(job.job_dir, **kw)
        it = iter(stream)
        before = [next(it)["id"] for _ in range(stop)]
        state = json.loads(json.dumps(stream.state_dict()))  # a JSON-able token, as a checkpoint keeps it
        resumed = HiddenStateStream(job.job_dir, **kw)
        resumed.load_state_dict(state)
        assert before + ids(resumed) == whole, stop


def test_stateful_dataloader_with_workers_resumes_exactly(job):
    kw = {"shuffle_buffer": 3, "seed": 2, "rank": 1, "world_size": 2}
    whole = ids(StatefulDataLoader(HiddenStateStream(job.job_dir, **kw), batch_size=None, num_workers=2))
    loader = StatefulDataLoader(HiddenStateStream(job.job_dir, **kw), batch_size=None, num_workers=2)
    it = iter(loader)
    before = [next(it)["id"] for _ in range(5)]
    state = loader.state_dict()
    del it, loader
    resumed = StatefulDataLoader(HiddenStateStream(job.job_dir, **kw), batch_size=None, num_workers=2)
    resumed.load_state_dict(state)
    assert before + ids(resumed) == whole


def test_the_contract_is_checked_before_the_first_item(job):
    HiddenStateStream(job.job_dir, expect={"layers": "eagle3", "dtype": "bfloat16", "model": "tiny-llama"})
    HiddenStateStream(job.job_dir, expect=Expect(layers=[2, 8], hidden_size=16))
    with pytest.raises(ValueError, match="post-norm, and eagle3_pre_norm reads it pre-norm"):
        HiddenStateStream(job.job_dir, expect={"layers": "eagle3_pre_norm"})
    with pytest.raises(ValueError, match=r"dtype: the job's is bfloat16, expected float16.*hidden_size"):
        HiddenStateStream(job.job_dir, expect={"dtype": "float16", "hidden_size": 4096})
    with pytest.raises(ValueError, match="model: the job's is '/models/tiny-llama'"):
        HiddenStateStream(job.job_dir, expect={"model": "Llama-3.1-8B"})
    with pytest.raises(ValueError, match="unknown"):
        HiddenStateStream(job.job_dir, expect={"layer": "eagle3"})


def test_a_state_from_another_stream_is_refused(job):
    stream = HiddenStateStream(job.job_dir, world_size=2, rank=0, seed=1)
    state = stream.state_dict()
    for other in ({"world_size": 4, "rank": 0, "seed": 1}, {"world_size": 2, "rank": 1, "seed": 1}, {"seed": 2}):
        kw = {"world_size": 2, "rank": 0, **other}
        with pytest.raises(ValueError, match="saved by another stream"):
            HiddenStateStream(job.job_dir, **kw).load_state_dict(state)
    with pytest.raises(ValueError, match="not a HiddenStateStream state"):
        stream.load_state_dict({"format": "something else"})


def test_a_state_saved_with_other_worker_counts_is_refused(job):
    loader = StatefulDataLoader(HiddenStateStream(job.job_dir), batch_size=None, num_workers=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it, loader
    tokens = [t for t in _tokens(state)]
    assert tokens and all(t["num_workers"] == 2 for t in tokens)
    stream = HiddenStateStream(job.job_dir)
    stream.load_state_dict(tokens[0])
    with pytest.raises(ValueError, match="saved with 2 DataLoader workers"):
        next(iter(stream))


def _tokens(state):
    if isinstance(state, dict):
        if state.get("format") == "hsx-stream/1":
            yield state
            return
        for v in state.values():
            yield from _tokens(v)


def test_a_rank_acknowledges_only_what_none_of_its_workers_still_needs(job):
    """rank_position replays each worker's order over the feed: a worker whose token was taken before the
    last shards came, or that never yielded anything, is placed where it really is."""
    kw = {"rank": 0, "world_size": 2, "shuffle_buffer": 2}
    # a manifest written without the feed: its shards are numbered in the order it lists them
    seq_of = {s.name: s.seq or n for n, s in enumerate(job.manifest.shards, start=1)}
    last = len(seq_of)
    loader = StatefulDataLoader(HiddenStateStream(job.job_dir, **kw), batch_size=None, num_workers=2)
    stream = HiddenStateStream(job.job_dir, **kw)
    assert stream.rank_position({}) == (1, 0)  # nothing read yet
    it = iter(loader)
    taken = [next(it)["id"] for _ in range(3)]
    epoch, seq = stream.rank_position(loader.state_dict())
    rest = [x["id"] for x in it]
    shard_of = {s.id: s.shard for s in job.manifest.samples}
    assert epoch == 1 and seq < min(seq_of[shard_of[i]] for i in rest)  # nothing still to come is released
    assert taken and stream.rank_position(loader.state_dict()) == (1, last)  # the end: everything
