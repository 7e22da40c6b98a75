"""The writer thread: copies each request's rows to host memory and writes its dump, off the scheduler thread.

Batches wait in a bounded queue. When it is full the producer (the scheduler's hook) blocks until
the writer takes the next batch: a slow disk slows the server down instead of piling up tensors.
At most `max_pending` batches wait, one is being written, and one more may be waiting to be put.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from hsx_sglang.dumpdir import DumpDirWriter, HostDump

log = logging.getLogger("hsx_sglang")


@dataclass(frozen=True)
class DumpJob:
    """One request's dump as the hook found it: row views of the batch's tensors, on any device."""

    rid: str
    rows: dict[int, torch.Tensor]  # layer -> [num_tokens, hidden_size] view
    prompt_ids: np.ndarray  # int64, the whole prompt
    cached_tokens: int


class DumpWriterThread:
    def __init__(self, dirs: DumpDirWriter, max_pending: int):
        self.dirs = dirs
        self._queue: queue.Queue[list[DumpJob] | None] = queue.Queue(maxsize=max_pending)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._thread = threading.Thread(target=self._run, name="hsx-dump-writer", daemon=True)
        self._thread.start()

    def put(self, jobs: list[DumpJob]) -> None:
        """Queue one batch's dumps; blocks while `max_pending` batches already wait."""
        self._queue.put(jobs)

    def pending(self) -> int:
        """Batches waiting for the writer (not counting the one it is writing)."""
        return self._queue.qsize()

    def join(self) -> None:
        """Wait until every queued dump is written (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while self._write_next():
            pass

    def _write_next(self) -> bool:
        # One batch per call: its tensors are released when the call returns, not kept alive
        # while the thread waits for the next batch.
        jobs = self._queue.get()
        try:
            if jobs is None:
                return False
            for job in jobs:
                try:
                    self.dirs.write(self._to_host(job))
                except Exception:
                    log.exception("hsx-sglang: writing the dump of rid %s failed", job.rid)
            return True
        finally:
            self._queue.task_done()

    def _to_host(self, job: DumpJob) -> HostDump:
        layers = {i: self._copy_to_host(t) for i, t in job.rows.items()}
        return HostDump(rid=job.rid, layers=layers, prompt_ids=job.prompt_ids, cached_tokens=job.cached_tokens)

    def _copy_to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU copy in memory of its own (a view would keep the whole batch's tensor alive)."""
        host = torch.empty(tuple(t.shape), dtype=t.dtype)
        if t.device.type == "cuda":
            # A stream of this thread's own: the copy neither waits for nor delays the forward
            # passes on the scheduler's streams. The hook queues a batch only after SGLang has
            # waited for that batch's results, so its rows are final.
            with torch.cuda.stream(self._stream(t.device)):
                host.copy_(t)
        else:
            host.copy_(t)
        return host

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]
