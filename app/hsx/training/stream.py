"""A PyTorch IterableDataset that follows a job while it runs: its items come as the job's shards are
recorded, every rank and DataLoader worker reads its own share (hsx.training.plan), an epoch ends when
the job has ended and its last shard was read, and a trainer killed at any point resumes from the state
it saved with its checkpoint, yielding exactly the items after it.

    stream = HiddenStateStream(HsxClient(url), job_id, consumer="train-a", shuffle_buffer=256)
    loader = StatefulDataLoader(stream, batch_size=None, num_workers=2)   # torchdata
    for step, item in enumerate(loader):
        ...
        if step % 1000 == 0:
            state = loader.state_dict()
            save(checkpoint, state)          # the resume token goes with the checkpoint,
            stream.ack(state)                # and only then is it acknowledged

Where the shards come from:
- a finished job's folder (its manifest.json): `HiddenStateStream("/data/hsx/job_x")`;
- the service (`HsxClient`), its feed followed as the job runs: each worker downloads the shards it
  reads into `cache_dir` (sha256 checked, fetched again when it does not match), and deletes each once
  read; or with `files=` the job's folder on a shared file system, the feed alone coming over HTTP.

Items are HiddenStateDataset's: input_ids, loss_mask, aux_hidden_state, hidden_state, id.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch
from torch.utils.data import IterableDataset, get_worker_info

from hsx.layers import LAYER_SETS
from hsx.manifest import Manifest, ManifestHeader, ManifestSample, load_manifest
from hsx.training.dataset import HiddenStateItem, item_keys, make_item, pick_layers, torch_dtype
from hsx.training.plan import FeedSample, FeedShard, Order, Split
from hsx.training.reader import ShardReader

log = logging.getLogger("hsx.training")

STATE_FORMAT = "hsx-stream/1"
# A shard whose download does not match its sha256 is fetched again this many times before the stream fails.
FETCH_TRIES = 3


class FeedClient(Protocol):
    """What the stream asks of the service: hsx.sdk.HsxClient is one."""

    def list_shards(self, job: str, *, after: int = 0, limit: int = 1000, wait: float = 0) -> Any: ...

    def download_shard(
        self, job: str, name: str, dest: Path | None = None, *, sha256: str | None = None, size: int | None = None
    ) -> Path: ...

    def get_job(self, job: str) -> Any: ...

    def register_consumer(self, job: str, name: str) -> Any: ...

    def ack(
        self, job: str, name: str, seq: int, *, rank: int = 0, world_size: int = 1, epoch: int = 1, epochs: int = 1
    ) -> Any: ...


@dataclass(frozen=True)
class Expect:
    """What the trainer needs of the job, checked before its first item: a layer set's name (eagle3,
    eagle3_pre_norm, dflash, ...: its layers and its side of the final norm) or layer ids; the
    model (its path as the manifest records it, or that path's last part); the dtype; the hidden size."""

    layers: str | list[int] | None = None
    model: str | None = None
    dtype: str | None = None
    hidden_size: int | None = None

    @classmethod
    def of(cls, expect: Expect | Mapping[str, Any] | None) -> Expect:
        if expect is None or isinstance(expect, Expect):
            return expect or cls()
        unknown = set(expect) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"expect: unknown {sorted(unknown)}; it takes {sorted(cls.__dataclass_fields__)}")
        return cls(**expect)

    def differences(self, header: ManifestHeader) -> list[str]:
        """What of this the job's manifest does not give, one line each."""
        found: list[str] = []
        model = header.model or {}
        if self.layers is not None:
            found += _layer_differences(self.layers, header)
        path = str(model.get("model_path") or "")
        if self.model is not None and self.model not in (path, path.rstrip("/").rsplit("/", 1)[-1]):
            found.append(f"model: the job's is {path or 'not recorded'!r}, expected {self.model!r}")
        if self.dtype is not None and header.dtype != self.dtype:
            found.append(f"dtype: the job's is {header.dtype}, expected {self.dtype}")
        if self.hidden_size is not None and header.hidden_size != self.hidden_size:
            found.append(f"hidden_size: the job's is {header.hidden_size}, expected {self.hidden_size}")
        return found

    def requested_differences(self, asked: Any) -> list[str]:
        """What the job's own request already rules out, before it has stored anything: a set that reads
        layer L on the other side of the final norm from every set the job asked for."""
        wanted = LAYER_SETS.get(self.layers) if isinstance(self.layers, str) else None
        names = [asked] if isinstance(asked, str) else [a for a in asked or [] if isinstance(a, str)]
        sides = {LAYER_SETS[n].final_layer for n in names if n in LAYER_SETS}
        if wanted is not None and sides and wanted.final_layer not in sides:
            return [f"layers: the job asked for layer set {', '.join(names)}, expected {self.layers}"]
        return []


def _layer_differences(want: str | list[int], header: ManifestHeader) -> list[str]:
    have = header.layers or []
    if isinstance(want, list):
        missing = [i for i in want if i not in have]
        return [f"layers: the job captured {have}, without {missing}"] if missing else []
    layer_set = LAYER_SETS.get(want)
    if layer_set is None:
        return [f"layers: {want!r} is no layer set; one of {list(LAYER_SETS)}, or a list of layer ids"]
    num_layers = (header.model or {}).get("num_hidden_layers")
    if not isinstance(num_layers, int):
        return [f"layers: the job's manifest does not record the model's depth, so {want} cannot be checked"]
    if want in header.sets():
        return []
    why = layer_set.fits(num_layers)
    if why is not None:
        return [f"layers: {why}"]
    found = []
    missing = [i for i in layer_set.layers(num_layers) if i not in have]
    if missing:
        found.append(f"layers: the job captured {have}, and {want} needs {layer_set.layers(num_layers)}")
    side = _final_side(header, num_layers)
    if side is not None and num_layers in have and side != layer_set.final_layer:
        other = f"{want}_pre_norm" if side == "pre_norm" else want.removesuffix("_pre_norm")
        found.append(
            f"layers: the job's layer {num_layers} is {side.replace('_', '-')}, and {want} reads it "
            f"{layer_set.final_layer.replace('_', '-')} (ask for the set that matches, e.g. {other})"
        )
    return found


def _final_side(header: ManifestHeader, num_layers: int) -> str | None:
    """Which side of the final norm the job's layer L lies on, as its manifest says (an older one by its
    post-norm layers); None where it does not say."""
    if header.final_layer is not None:
        return header.final_layer
    post = header.post_norm(num_layers)
    return None if post is None else ("post_norm" if post else "pre_norm")


@dataclass(frozen=True)
class _Pick:
    """The layers an item is made of."""

    aux: list[int]
    last: int

    @property
    def keys(self) -> list[str]:
        return item_keys(self.aux, self.last)


@dataclass
class _Position:
    """One reader's place in its current epoch."""

    epoch: int
    emitted: int
    finished: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "emitted": self.emitted, "finished": self.finished}


class HiddenStateStream(IterableDataset[HiddenStateItem]):
    """A job's items as its shards are recorded (see the module docstring).

    `source`: a finished job's folder (or its manifest.json), or an `HsxClient` with `job` its id.
    `files`: with a client, the job's folder on a shared file system to read shards from instead of
    downloading them; `cache_dir`: where downloads go (default: a folder under the system's temp folder),
    each worker in its own sub-folder, at most `cache_shards` shards ahead of what it reads.
    `follow`: wait for the shards still to come until the job ends (False: read what is recorded when an
    epoch starts, refused on a running job with several ranks, which could disagree on where it ends).
    `rank`, `world_size`: default from torch.distributed when it is initialised, else 0 and 1.
    `shuffle_buffer`, `seed`: a seeded, bounded shuffle (hsx.training.plan); `epochs`: how many times the
    stream reads the job; `drop_last`: every rank yields as many items an epoch, dropping the last, partial
    row of world_size samples (fewer than world_size items), or without it repeating some of its samples
    (`repeated` counts them). `expect`: an `Expect` (or a dict of its fields) checked before the first item.
    `consumer`: the name this trainer acknowledges under (registered at once); `layer_set`, `aux_layers`,
    `last_layer`, `dtype`: as HiddenStateDataset's. `wait_s`: how long one request for the next shard waits.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | FeedClient,
        job: str | None = None,
        *,
        files: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_shards: int = 2,
        follow: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_buffer: int = 0,
        seed: int = 0,
        epochs: int = 1,
        drop_last: bool = True,
        expect: Expect | Mapping[str, Any] | None = None,
        consumer: str | None = None,
        layer_set: str | None = None,
        aux_layers: list[int] | None = None,
        last_layer: int | None = None,
        dtype: torch.dtype | str | None = None,
        wait_s: float = 30.0,
    ):
        if epochs < 1 or shuffle_buffer < 0 or cache_shards < 1 or not 0 < wait_s <= 60:
            raise ValueError("epochs >= 1, shuffle_buffer >= 0, cache_shards >= 1 and 0 < wait_s <= 60")
        default_rank, default_world = _distributed()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        Split(self.rank, self.world_size)  # checked now, not in a worker
        self.shuffle_buffer, self.seed, self.epochs, self.drop_last = shuffle_buffer, seed, epochs, drop_last
        self.follow, self.wait_s = follow, wait_s
        self.expect = Expect.of(expect)
        self.dtype = torch_dtype(dtype)
        self._layer_set, self._aux_layers, self._last_layer = layer_set, aux_layers, last_layer
        self.consumer = consumer
        self.repeated = 0
        if isinstance(source, (str, os.PathLike)):
            if consumer is not None:
                raise ValueError("a consumer acknowledges to the service: pass the client, and files= for the folder")
            self._client: FeedClient | None = None
            self._manifest: Manifest | None = load_manifest(source, readable=True)
            self.job_id = self._manifest.job_id
            self.files: Path | None = Path(source) if Path(source).is_dir() else Path(source).parent
        else:
            if job is None:
                raise ValueError("with a client, name the job: HiddenStateStream(client, job_id)")
            self._client, self._manifest, self.job_id = source, None, str(getattr(job, "id", job))
            self.files = Path(files) if files is not None else None
        base = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "hsx-stream"
        self.cache_dir = base / self.job_id
        self.cache_shards = cache_shards
        self._client_pid = os.getpid()
        self._complete = False  # whether the feed was complete when last read to its end
        self._resume: dict[int, _Position] = {}
        self._resume_workers: int | None = None
        self._live: _Position | None = None
        self._live_worker = 0
        self._header: ManifestHeader | None = self._manifest
        self._opened_check()
        if self.client is not None and consumer is not None:
            self.client.register_consumer(self.job_id, consumer)

    @property
    def client(self) -> FeedClient | None:
        """The service's client, this process's own: a DataLoader worker forked from the trainer gets a copy
        (HsxClient copies as its URL, token and timeout), so that no two processes share a connection."""
        if self._client is not None and self._client_pid != os.getpid():
            self._client, self._client_pid = copy.copy(self._client), os.getpid()
        return self._client

    # --- what the job is ------------------------------------------------------------------------

    def _opened_check(self) -> None:
        """What can be checked at once: the manifest, or what the job asked for while it stores nothing."""
        header = self._header or self._first_header(wait=0)
        if header is not None:
            self._header = header
            self._check(header)
            return
        assert self.client is not None
        found = self.expect.requested_differences(self.client.get_job(self.job_id).layers)
        if found:
            raise ValueError(f"job {self.job_id} does not match what this trainer expects: " + "; ".join(found))

    def _first_header(self, wait: float) -> ManifestHeader | None:
        assert self.client is not None
        page = self.client.list_shards(self.job_id, after=0, limit=1, wait=wait)
        if page.header is None:
            if page.complete:
                raise ValueError(f"job {self.job_id} ended {page.job_state} without storing a sample")
            if not self.follow:
                raise ValueError(f"job {self.job_id} has stored nothing yet: follow it (follow=True)")
            return None
        return ManifestHeader.model_validate(page.header)

    def _check(self, header: ManifestHeader) -> None:
        found = self.expect.differences(header)
        if found:
            raise ValueError(f"job {self.job_id} does not match what this trainer expects: " + "; ".join(found))
        header.hidden_states()  # the layers, hidden size and a float dtype: ValueError otherwise
        pick_layers(header, self._layer_set, self._aux_layers, self._last_layer)

    def header(self) -> ManifestHeader:
        """The job's manifest header, waiting for the job's first stored sample when there is none yet."""
        while self._header is None:
            self._header = self._first_header(wait=self.wait_s)
            if self._header is not None:
                self._check(self._header)
        return self._header

    # --- the shards -----------------------------------------------------------------------------

    def _shards(self, follow: bool | None = None) -> Iterator[FeedShard]:
        """The feed from its start, in seq order, until it is complete (or, without follow, for now);
        `_complete` says afterwards whether it was."""
        follow = self.follow if follow is None else follow
        self._complete = True
        if self._manifest is not None:
            yield from _manifest_feed(self._manifest)
            return
        assert self.client is not None
        after, complete, failures = 0, False, 0
        while not complete:
            try:
                page = self.client.list_shards(self.job_id, after=after, wait=self.wait_s if follow else 0)
            except Exception as exc:
                if not _transient(exc):
                    raise
                failures += 1
                time.sleep(_backoff(failures))
                continue
            failures = 0
            if not self.follow and not page.complete and self.world_size > 1 and after == 0:
                raise ValueError(
                    f"job {self.job_id} is {page.job_state}: with {self.world_size} ranks each must read it to the "
                    "same end, so follow it (follow=True) or read it once it has ended"
                )
            for shard in page.data:
                yield FeedShard(
                    shard.seq,
                    shard.name,
                    shard.bytes,
                    shard.sha256,
                    tuple(FeedSample(s.id, s.offset, s.num_tokens) for s in shard.samples),
                    shard.deleted,
                )
            after = page.last_seq
            self._complete = page.complete
            complete = page.complete or (not follow and not page.has_more)

    # --- iterating ------------------------------------------------------------------------------

    def _split(self) -> Split:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return Split(self.rank, self.world_size, worker, workers)

    def __iter__(self) -> Iterator[HiddenStateItem]:
        split = self._split()
        if self._resume and self._resume_workers not in (None, split.num_workers):
            raise ValueError(
                f"the state was saved with {self._resume_workers} DataLoader workers, this stream runs with "
                f"{split.num_workers}: resume with as many"
            )
        header = self.header()
        pick = _Pick(*pick_layers(header, self._layer_set, self._aux_layers, self._last_layer))
        start = self._resume.get(split.worker, _Position(1, 0))
        shards = _Shards(self, split)
        self._live_worker = split.worker
        try:
            for epoch in range(start.epoch, self.epochs + 1):
                if start.finished and epoch == start.epoch:
                    continue
                order = Order(split, epoch, self.seed, self.shuffle_buffer, self.drop_last)
                live = self._live = _Position(epoch, 0)
                skip = start.emitted if epoch == start.epoch else 0
                for shard in self._shards():
                    order.add(shard)
                    shards.want(order)
                    yield from self._take(order, live, skip, shards, pick)
                order.end()
                yield from self._take(order, live, skip, shards, pick)
                live.finished = True
                shards.clear()
        finally:
            shards.close()

    def _take(
        self, order: Order, live: _Position, skip: int, shards: _Shards, pick: _Pick
    ) -> Iterator[HiddenStateItem]:
        while (item := order.next()) is not None:
            live.emitted += 1
            if live.emitted <= skip:
                continue  # yielded before the state this stream resumed from
            sample = item.sample
            entry = ManifestSample(
                id=sample.id, shard=item.shard.name, offset=sample.offset, num_tokens=sample.num_tokens
            )
            rows = shards.rows(item.shard, entry, pick.keys)
            self.repeated += item.repeat
            shards.keep(order.needed())
            yield make_item(rows, sample.id, pick.aux, pick.last, self.dtype)

    # --- resuming and acknowledging -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This reader's resume token (JSON-able): save it with the checkpoint. In a DataLoader worker it
        is that worker's; torchdata's StatefulDataLoader gathers them into its own state_dict."""
        split = self._split()
        here = self._live if self._live is not None else self._resume.get(split.worker, _Position(1, 0))
        return {
            "format": STATE_FORMAT,
            "job": self.job_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": split.num_workers,
            "seed": self.seed,
            "shuffle_buffer": self.shuffle_buffer,
            "drop_last": self.drop_last,
            "epochs": self.epochs,
            "workers": {str(split.worker): here.to_json()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a saved token: the next iteration yields exactly the items after it. A token of another
        job, rank, world size, seed, shuffle or epoch count is refused: it would yield other items."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a HiddenStateStream state (format {state.get('format')!r})")
        mine = {
            "job": self.job_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "seed": self.seed,
            "shuffle_buffer": self.shuffle_buffer,
            "drop_last": self.drop_last,
            "epochs": self.epochs,
        }
        differ = [f"{k} {state.get(k)!r} (this stream: {v!r})" for k, v in mine.items() if state.get(k) != v]
        if differ:
            raise ValueError(
                "the state was saved by another stream: " + ", ".join(differ) + "; resume with the same settings "
                "(another world size: start a new consumer, or another epoch over the job)"
            )
        self._resume_workers = int(state["num_workers"])
        for worker, position in state["workers"].items():
            self._resume[int(worker)] = _Position(**position)
        self._live = None

    def ack(self, state: Mapping[str, Any] | None = None) -> Any:
        """Acknowledge this rank's position to the service: `state` is what was just saved with the checkpoint
        (a StatefulDataLoader's state_dict, or this stream's own, the default). Returns the consumer."""
        if self.client is None or self.consumer is None:
            raise ValueError(
                "acknowledging needs the service and a consumer: HiddenStateStream(client, job, consumer=)"
            )
        epoch, seq = self.rank_position(state if state is not None else self.state_dict())
        return self.client.ack(
            self.job_id, self.consumer, seq, rank=self.rank, world_size=self.world_size, epoch=epoch, epochs=self.epochs
        )

    def rank_position(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """(epoch, seq) this rank may acknowledge after `state`: the least, over its workers, of the last shard
        before the first one each still needs. Each worker's place is found by replaying its order over the
        feed as recorded now (no tensor read): a worker's own token was taken at its last item, when it may
        not have seen the shards recorded since, and a worker not in `state` has read nothing."""
        places: dict[int, _Position] = {}
        workers = 1
        for token in _tokens(state):
            if token.get("job") == self.job_id and token.get("rank") == self.rank:
                workers = int(token["num_workers"])
                places.update({int(w): _Position(**p) for w, p in token["workers"].items()})
        shards = list(self._shards(follow=False))
        complete = self._complete
        return min(
            self._safe(Split(self.rank, self.world_size, w, workers), places.get(w), shards, complete)
            for w in range(workers)
        )

    def _safe(self, split: Split, place: _Position | None, shards: list[FeedShard], complete: bool) -> tuple[int, int]:
        place = place or _Position(1, 0)
        order = Order(split, place.epoch, self.seed, self.shuffle_buffer, self.drop_last)
        for shard in shards:
            order.add(shard)
        if complete:
            order.end()
        for _ in range(place.emitted):
            order.next()
        return place.epoch, order.safe_seq()


def _tokens(state: Any) -> Iterator[Mapping[str, Any]]:
    """Every stream state inside a (StatefulDataLoader's) state dict, wherever it sits."""
    if isinstance(state, Mapping):
        if state.get("format") == STATE_FORMAT:
            yield state
            return
        for value in state.values():
            yield from _tokens(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tokens(value)


class _Shards:
    """Where one reader finds the shards' rows: the job's folder, or its own download cache."""

    def __init__(self, stream: HiddenStateStream, split: Split):
        self.stream = stream
        if stream.files is not None:
            self.folder, self.cached = stream.files, False
        else:
            self.folder, self.cached = _own_folder(stream.cache_dir, f"rank{split.rank}-worker{split.worker}"), True
        self.reader = ShardReader(self.folder)
        self.present: dict[str, FeedShard] = {}

    def want(self, order: Order) -> None:
        """Fetch ahead the shards this reader reads next (by seq), up to the cache's size."""
        if not self.cached:
            return
        for shard in order.shards_held():
            if len(self.present) >= self.stream.cache_shards:
                break
            if shard.name not in self.present and not shard.deleted:
                self._fetch(shard)

    def rows(self, shard: FeedShard, entry: ManifestSample, keys: list[str]) -> dict[str, torch.Tensor]:
        if shard.deleted and shard.name not in self.present:
            raise ValueError(
                f"job {self.stream.job_id}: {shard.name} was deleted by retention before this reader read it (its "
                "consumers had all read it): register this trainer as a consumer before the job starts"
            )
        if self.cached and shard.name not in self.present:
            self._fetch(shard)
        return self.reader.sample(entry, keys)

    def _fetch(self, shard: FeedShard) -> None:
        """Download the shard; a copy that does not match its sha256 is fetched again (FETCH_TRIES times at
        most), a service that is away (restarting) is waited for."""
        assert self.stream.client is not None
        mismatches = failures = 0
        while True:
            try:
                self.stream.client.download_shard(
                    self.stream.job_id, shard.name, self.folder / shard.name, sha256=shard.sha256, size=shard.bytes
                )
                break
            except Exception as exc:
                if type(exc).__name__ == "ChecksumMismatch":
                    mismatches += 1
                    if mismatches >= FETCH_TRIES:
                        raise
                    log.warning("%s: the download did not match its sha256; fetching it again", shard.name)
                elif _transient(exc):
                    failures += 1
                    time.sleep(_backoff(failures))
                else:
                    raise
        self.present[shard.name] = shard

    def keep(self, needed: set[str]) -> None:
        """Delete the downloads this reader no longer needs."""
        if not self.cached:
            return
        for name in [n for n in self.present if n not in needed]:
            self.reader.forget(name)
            (self.folder / name).unlink(missing_ok=True)
            del self.present[name]

    def clear(self) -> None:
        self.keep(set())

    def close(self) -> None:
        self.reader.close()
        if self.cached:
            self.clear()
            shutil.rmtree(self.folder, ignore_errors=True)


def _own_folder(cache: Path, name: str) -> Path:
    """A download folder of this process's own under `cache` (two trainers of one job on one host share the
    cache, never a folder); the folders of processes that are gone (killed) are removed first."""
    cache.mkdir(parents=True, exist_ok=True)
    for left in cache.glob("*-pid*"):
        pid = left.name.rsplit("-pid", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
    folder = cache / f"{name}-pid{os.getpid()}"
    folder.mkdir(exist_ok=True)
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to clean
        return True
    return True


def _manifest_feed(manifest: Manifest) -> Iterator[FeedShard]:
    """A finished job's feed, from its manifest: its shards in seq order (an older manifest's, as listed)."""
    by_shard: dict[str, list[FeedSample]] = {}
    for s in manifest.samples:
        by_shard.setdefault(s.shard, []).append(FeedSample(s.id, s.offset, s.num_tokens))
    shards = (
        sorted(manifest.shards, key=lambda s: s.seq or 0) if all(s.seq for s in manifest.shards) else manifest.shards
    )
    for seq, shard in enumerate(shards, start=1):
        samples = sorted(by_shard.get(shard.name, []), key=lambda s: s.offset)
        yield FeedShard(shard.seq or seq, shard.name, shard.bytes, shard.sha256, tuple(samples), shard.deleted)


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _backoff(failures: int) -> float:
    """Seconds before asking a service that is away again: doubling from half a second to ten."""
    return float(min(10.0, 0.25 * 2**failures))


def _transient(exc: Exception) -> bool:
    """A failure the service's restart or a passing overload explains: asked again, not raised."""
    return isinstance(exc, httpx.TransportError) or getattr(exc, "status", None) in (502, 503, 504)
