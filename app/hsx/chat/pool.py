"""An order-keeping map over worker processes, for inputs too big to hold: the items go in batches, and
only a few batches per worker are in flight at a time, so memory stays flat however long the input is."""

from __future__ import annotations

import itertools
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

BATCH = 64  # items per task: large enough that a task's pickling and hand-over cost little beside its work
IN_FLIGHT_PER_WORKER = 4


def ordered_map(
    fn: Callable[[list[T]], list[R]],
    items: Iterable[T],
    *,
    workers: int,
    initializer: Callable[..., None],
    initargs: tuple[Any, ...],
    batch: int = BATCH,
) -> Iterator[R]:
    """fn over `items` in `workers` processes, results in the items' order. `fn` takes a batch and gives
    one result per item; `initializer(*initargs)` runs once in each process. Processes are spawned, not
    forked: the caller may be a server with threads, whose locks a fork would copy mid-use."""
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=initializer,
        initargs=initargs,
    )
    pending: deque[Future[list[R]]] = deque()
    try:
        source = iter(items)
        while chunk := list(itertools.islice(source, batch)):
            pending.append(pool.submit(fn, chunk))
            if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        # Also when the caller stops reading early: the batches not started are dropped.
        pool.shutdown(wait=True, cancel_futures=True)
