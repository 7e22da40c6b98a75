"""Which rank and worker reads which sample, in which order (hsx.training.plan): disjoint and complete,
the same count on every rank, the same order however the feed arrives, a shuffle that is seeded and
bounded, and a position that is safe to acknowledge."""

from __future__ import annotations

import itertools
import random

import pytest

from hsx.training.plan import FeedSample, FeedShard, Order, Split


def feed(sizes: list[int]) -> list[FeedShard]:
    shards, k = [], 0
    for seq, n in enumerate(sizes, start=1):
        samples = tuple(FeedSample(f"s{k + i}", i * 10, 10) for i in range(n))
        shards.append(FeedShard(seq, f"shard-{seq:06d}.safetensors", n * 100, "0" * 64, samples))
        k += n
    return shards


def run(shards: list[FeedShard], split: Split, *, pieces: list[int] | None = None, **kw) -> list[tuple[str, bool]]:
    """What one reader yields, the feed given in pieces (yielding between them, as a follower does)."""
    order = Order(split, **kw)
    out = []
    for shard in shards:
        order.add(shard)
        while (item := order.next()) is not None:
            out.append((item.sample.id, item.repeat))
    order.end()
    while (item := order.next()) is not None:
        out.append((item.sample.id, item.repeat))
    assert order.done and order.safe_seq() == shards[-1].seq
    return out


def ranks(shards, world, workers, **kw):
    return {r: [run(shards, Split(r, world, w, workers), **kw) for w in range(workers)] for r in range(world)}


@pytest.mark.parametrize("world, workers", [(1, 1), (2, 1), (2, 2), (3, 2), (4, 3)])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("buffer", [0, 5])
def test_ranks_share_every_sample_once_and_yield_as_many_each(world, workers, drop_last, buffer):
    shards = feed([3, 5, 1, 4, 7, 2, 6])  # 28 samples
    n = 28
    got = ranks(shards, world, workers, drop_last=drop_last, shuffle_buffer=buffer, seed=3)
    per_rank = {r: [x for w in got[r] for x in w] for r in got}
    counts = {len(v) for v in per_rank.values()}
    assert counts == {n // world if drop_last else -(-n // world)}
    real = [sid for v in per_rank.values() for sid, repeat in v if not repeat]
    assert len(real) == len(set(real))  # none twice
    if drop_last:
        assert len(set(real)) == n - n % world  # fewer than world_size dropped
    else:
        assert set(real) == {f"s{i}" for i in range(n)}
        repeats = [sid for v in per_rank.values() for sid, repeat in v if repeat]
        assert len(repeats) == (world - n % world) % world and set(repeats) <= set(real)


def test_the_order_is_the_same_however_the_feed_arrives():
    shards = feed([4, 4, 4, 4, 3])
    split = Split(1, 2, 0, 1)
    whole = run(shards, split, shuffle_buffer=4, seed=9)
    # the same shards added one by one with items taken in between, or all before taking any
    order = Order(split, shuffle_buffer=4, seed=9)
    for shard in shards:
        order.add(shard)
    order.end()
    late = []
    while (item := order.next()) is not None:
        late.append((item.sample.id, item.repeat))
    assert late == whole


def test_the_shuffle_depends_on_seed_and_epoch_and_stays_within_its_buffer():
    shards = feed([10] * 6)
    split = Split()
    plain = [sid for sid, _ in run(shards, split)]
    assert plain == [f"s{i}" for i in range(60)]
    a = [sid for sid, _ in run(shards, split, shuffle_buffer=8, seed=1)]
    assert sorted(a) == sorted(plain) and a != plain
    assert a == [sid for sid, _ in run(shards, split, shuffle_buffer=8, seed=1)]
    assert a != [sid for sid, _ in run(shards, split, shuffle_buffer=8, seed=2)]
    assert a != [sid for sid, _ in run(shards, split, shuffle_buffer=8, seed=1, epoch=2)]
    # an item never comes out earlier than the buffer's size allows
    for position, sid in enumerate(a):
        assert int(sid[1:]) <= position + 8


def test_a_rank_holds_back_only_what_its_row_does_not_complete_yet():
    split = Split(0, 2)
    order = Order(split)
    order.add(feed([3])[0])  # s0 s1 | s2 : s2's row waits for its second sample
    assert [order.next().sample.id for _ in range(1)] == ["s0"] and order.next() is None
    assert order.safe_seq() == 0  # s2 (shard 1) is not yielded yet
    order.end()  # the feed ends: drop_last drops s2
    assert order.next() is None and order.safe_seq() == 1


def test_the_safe_position_never_passes_a_sample_still_to_come():
    shards = feed([2, 3, 2, 5, 1, 4])
    rng = random.Random(5)
    for world, workers, drop_last, buffer in itertools.product((1, 2, 3), (1, 2), (True, False), (0, 3)):
        split = Split(rng.randrange(world), world, rng.randrange(workers), workers)
        order = Order(split, drop_last=drop_last, shuffle_buffer=buffer)
        later: list[int] = []
        positions = []
        for shard in shards:
            order.add(shard)
            while (item := order.next()) is not None:
                later.append(item.shard.seq)
                positions.append(order.safe_seq())
        order.end()
        while (item := order.next()) is not None:
            later.append(item.shard.seq)
            positions.append(order.safe_seq())
        for i, safe in enumerate(positions):
            assert all(seq > safe for seq in later[i + 1 :]), (world, workers, drop_last, buffer)


def test_a_split_outside_its_ranks_or_workers_is_refused():
    with pytest.raises(ValueError, match="rank 2"):
        Split(2, 2)
    with pytest.raises(ValueError, match="worker 1"):
        Split(0, 1, 1, 1)
    order = Order(Split())
    order.add(feed([1, 1])[1])
    with pytest.raises(ValueError, match="forward only"):
        order.add(feed([1])[0])
