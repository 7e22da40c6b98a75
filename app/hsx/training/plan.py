"""Which sample each trainer rank and DataLoader worker reads, in which order: a pure function of the
job's commit feed, so that every rank agrees without talking to the others and a resumed trainer finds
its place by replaying the feed's records, without reading a tensor.

The feed's samples are numbered k = 0, 1, ... in feed order (shards by seq, samples in shard order).
Sample k belongs to rank k % world_size; a rank's workers split its shards, the shard of seq s going
to worker (s - 1) % num_workers. So every rank's share differs by at most one sample at any point.

Every rank yields the same number of items per epoch (a DDP trainer hangs otherwise): the samples of
each complete row of world_size samples, and for the last, partial row, `drop_last` drops it (fewer
than world_size samples) or, without `drop_last`, the ranks it leaves out each repeat one of its
samples. A sample is therefore released only once its row is complete, or once the feed is: a rank
holds back at most its last sample while the job still runs.

Released items go through a shuffle buffer of `shuffle_buffer` items (0: none): once it is full, each
new item takes the place of one drawn from it; at the epoch's end it is drawn empty. Each draw is a hash
of (seed, epoch, rank, worker, draw number), so the order is the same for a resumed run as for one that
was never interrupted, and a new epoch shuffles anew.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class FeedSample:
    id: str
    offset: int
    num_tokens: int


@dataclass(frozen=True)
class FeedShard:
    """One record of the commit feed."""

    seq: int
    name: str
    bytes: int
    sha256: str
    samples: tuple[FeedSample, ...]
    deleted: bool = False


@dataclass(frozen=True)
class Item:
    """A sample to yield: the k-th of the epoch's feed, or a repeat of it that evens the ranks out."""

    k: int
    shard: FeedShard
    index: int
    repeat: bool = False

    @property
    def sample(self) -> FeedSample:
        return self.shard.samples[self.index]


@dataclass(frozen=True)
class Split:
    """Where a reader stands among the trainer's ranks and its rank's DataLoader workers."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0 .. world_size - 1 ({self.world_size})")
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker {self.worker} is not in 0 .. num_workers - 1 ({self.num_workers})")

    def owns(self, shard: FeedShard) -> bool:
        return (shard.seq - 1) % self.num_workers == self.worker


def draw(seed: int, epoch: int, split: Split, n: int) -> int:
    """The n-th draw of one reader in one epoch: splitmix64 over its coordinates, stateless."""
    x = 0
    for part in (seed, epoch, split.rank, split.worker, n):
        x = (x ^ (part & MASK64)) + 0x9E3779B97F4A7C15 & MASK64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
        x ^= x >> 31
    return x


@dataclass
class Order:
    """One reader's items in one epoch, in the order it yields them, as the feed's shards come in."""

    split: Split
    epoch: int = 1
    seed: int = 0
    shuffle_buffer: int = 0
    drop_last: bool = True
    total: int = 0  # samples the feed has shown so far (every rank's)
    last_seq: int = 0
    ended: bool = False
    _pending: deque[Item] = field(default_factory=deque)  # this reader's, their row not complete yet
    _row: list[Item] = field(default_factory=list)  # the current, incomplete row's samples (any rank's)
    _buffer: list[Item] = field(default_factory=list)
    _ready: deque[Item] = field(default_factory=deque)
    _draws: int = 0

    def add(self, shard: FeedShard) -> None:
        """The feed's next shard (by seq)."""
        if self.ended or shard.seq <= self.last_seq:
            raise ValueError(f"shard seq {shard.seq} after {self.last_seq}: the feed goes forward only")
        world, mine = self.split.world_size, self.split.owns(shard)
        for index in range(len(shard.samples)):
            k = self.total
            self.total += 1
            item = Item(k, shard, index)
            if k % world == 0:
                self._row = []
            self._row.append(item)
            if mine and k % world == self.split.rank:
                self._pending.append(item)
        self.last_seq = shard.seq
        while self._pending and self.total >= (self._pending[0].k // world + 1) * world:
            self._offer(self._pending.popleft())

    def end(self) -> None:
        """The feed is complete: the last row is dropped or evened out, and the buffer drawn empty."""
        if self.ended:
            return
        self.ended = True
        world = self.split.world_size
        missing = world - self.total % world if self.total % world else 0
        if not self.drop_last:
            while self._pending:
                self._offer(self._pending.popleft())
            kept = len(self._row)
            if missing and self.split.rank >= kept:
                source = self._row[(self.split.rank - kept) % kept]
                if self.split.owns(source.shard):
                    self._offer(Item(source.k, source.shard, source.index, repeat=True))
        self._pending.clear()
        while self._buffer:
            self._ready.append(self._take(len(self._buffer)))

    def next(self) -> Item | None:
        """The next item to yield, or None until more of the feed (or its end) comes."""
        return self._ready.popleft() if self._ready else None

    @property
    def done(self) -> bool:
        return self.ended and not self._ready

    def safe_seq(self) -> int:
        """Every shard up to this seq has nothing left that this reader will still yield this epoch."""
        waiting = [*self._pending, *self._buffer, *self._ready]
        if self._row_may_repeat():
            waiting.append(self._row[0])  # a rank left out of the last row repeats one of its samples
        return min(it.shard.seq for it in waiting) - 1 if waiting else self.last_seq

    def needed(self) -> set[str]:
        """The shards whose rows this reader still has to read this epoch (as far as the feed has come)."""
        names = {it.shard.name for it in (*self._pending, *self._buffer, *self._ready)}
        if self._row_may_repeat():
            names.update(it.shard.name for it in self._row)
        return names

    def shards_held(self) -> list[FeedShard]:
        """The shards of the items this reader holds, by seq: what it reads next."""
        held = {it.shard.name: it.shard for it in (*self._ready, *self._buffer, *self._pending)}
        return sorted(held.values(), key=lambda s: s.seq)

    def _row_may_repeat(self) -> bool:
        """Whether the incomplete row may turn out the last, whose samples the ranks it leaves out repeat."""
        return not self.drop_last and not self.ended and self.total % self.split.world_size != 0

    def _offer(self, item: Item) -> None:
        if self.shuffle_buffer <= 0:
            self._ready.append(item)
            return
        self._buffer.append(item)
        if len(self._buffer) > self.shuffle_buffer:
            self._ready.append(self._take(len(self._buffer)))

    def _take(self, size: int) -> Item:
        j = draw(self.seed, self.epoch, self.split, self._draws) % size
        self._draws += 1
        self._buffer[j], self._buffer[-1] = self._buffer[-1], self._buffer[j]
        return self._buffer.pop()
