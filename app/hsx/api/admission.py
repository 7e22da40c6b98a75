"""How many requests may use the database at once, and what the others do meanwhile.

The API's engine holds at most a fixed number of connections (hsx.db.engine). A request that needs one
takes a slot here first, on the event loop, where waiting holds neither a thread nor a connection: a route
that takes a session (hsx.api.deps), a job creation for its database steps, each check of an event stream.
There are fewer slots than connections (the rest are the API's background work's), so a request holding a
slot never waits on the pool. Without the slots every worker thread could sit in the pool's queue while the
requests that held the connections waited for a thread to finish their answers: the whole API stood still
until the pool gave up after 30 s, with 500s.

A request that finds every slot taken waits in line up to `--connection-wait-s`, first come first served,
then is answered 503 with Retry-After (hsx.service.errors.Busy). A stream or a long poll takes a slot for
each check only, never for its whole wait, and checks hold at most half the slots at once: however many
streams are open, short requests keep the other half.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from hsx.service.errors import Busy


class Admission:
    """The slots of one process's requests (the event loop is their only user)."""

    def __init__(self, slots: int, wait_s: float):
        if slots < 2:
            raise ValueError(f"{slots} slots: requests need at least 2 (one for checks, one for the rest)")
        self.slots = slots
        self.wait_s = wait_s
        self.retry_after_s = max(1, math.ceil(wait_s))
        self._slots = anyio.Semaphore(slots)
        self._checks = anyio.Semaphore(slots // 2)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """A slot for one request's database work, held until the block ends; Busy when none is free
        within the wait."""
        with anyio.move_on_after(self.wait_s) as waited:
            await _take(self._slots)
        if waited.cancelled_caught:
            raise self._busy("requests")
        try:
            yield
        finally:
            self._slots.release()

    @asynccontextmanager
    async def check(self) -> AsyncIterator[None]:
        """A slot for one check of a stream or a long poll, among the half of the slots checks may hold,
        held until the block ends; Busy when none is free within the wait (a stream may skip that check)."""
        with anyio.move_on_after(self.wait_s) as waited:
            await _take(self._checks)
            try:
                await _take(self._slots)
            except BaseException:
                self._checks.release()
                raise
        if waited.cancelled_caught:
            raise self._busy("streams")
        try:
            yield
        finally:
            self._slots.release()
            self._checks.release()

    def _busy(self, what: str) -> Busy:
        return Busy(
            f"every database connection this service's {what} may use was taken for {self.wait_s:g} s "
            "(--connection-wait-s); send the request again after Retry-After seconds",
            self.retry_after_s,
        )


async def _take(semaphore: anyio.Semaphore) -> None:
    """A free slot at once, even with no time left to wait; else a place in line (cancelled with the wait)."""
    try:
        semaphore.acquire_nowait()
    except anyio.WouldBlock:
        await semaphore.acquire()
