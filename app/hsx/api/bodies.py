"""A job creation's request body: refused before any of it is read when its declared length or its
content coding cannot be taken, counted as it arrives, and, when large, taken in only a few at a time.

A large body costs memory while it is parsed and a transaction while it is stored; past
`max_large_bodies` of them at once, another is answered 503 with Retry-After straight away rather
than queued, so neither memory nor the write lock is swamped and small requests keep their pace.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.to_thread import run_sync
from fastapi import Request

from hsx.service.errors import BodyTimeout, Busy, ContentTooLarge, UnsupportedBody

RETRY_AFTER_S = 5
# The content coding bodies are read in: none.
IDENTITY = "identity"


class LargeBodies:
    """The large bodies being taken in by this process (the event loop is its only user)."""

    def __init__(self, slots: int, threshold: int):
        self.slots = slots
        self.threshold = threshold
        self.taken = 0

    def take(self) -> None:
        if self.taken >= self.slots:
            raise Busy(
                f"{self.taken} job creations with a body over {self.threshold} bytes are being taken in; "
                f"send this one again after Retry-After seconds",
                RETRY_AFTER_S,
            )
        self.taken += 1

    def give_back(self) -> None:
        self.taken -= 1


class Body:
    """One request's body, read through `chunks()` or `read()`, at most `limit` bytes."""

    def __init__(
        self, request: Request, limit: int, large: LargeBodies, *, idle_timeout_s: float, total_timeout_s: float
    ):
        self.request = request
        self.limit = limit
        self.large = large
        self.idle_timeout_s = idle_timeout_s
        self.total_timeout_s = total_timeout_s
        self.is_large = False
        coding = request.headers.get("content-encoding", IDENTITY)
        codings = [c.strip().lower() for c in coding.split(",") if c.strip()]
        if any(c != IDENTITY for c in codings):
            raise UnsupportedBody(
                f"Content-Encoding {coding!r} is not supported; send the body unencoded",
                headers={"Accept-Encoding": IDENTITY},
            )
        declared = request.headers.get("content-length")
        self.declared = int(declared) if declared and declared.isdigit() else None
        if self.declared is not None:
            self._count(self.declared)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; BodyTimeout when nothing comes for idle_timeout_s, or it is not whole
        after total_timeout_s (a client that stops sending would otherwise hold its slot for ever)."""
        seen = 0
        stream = self.request.stream().__aiter__()
        deadline = time.monotonic() + self.total_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                with anyio.fail_after(min(self.idle_timeout_s, max(left, 0.0))):
                    chunk = await stream.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise BodyTimeout(self._timeout_detail(seen, left <= self.idle_timeout_s)) from None
            seen += len(chunk)
            self._count(seen)
            yield chunk

    def _timeout_detail(self, seen: int, total: bool) -> str:
        of = f" of {self.declared}" if self.declared is not None else ""
        if total:
            return f"the request body was not whole after {self.total_timeout_s:g} s ({seen}{of} bytes arrived)"
        return f"the request body stopped arriving: nothing for {self.idle_timeout_s:g} s after {seen}{of} bytes"

    async def read(self) -> bytearray:
        data = bytearray()
        async for chunk in self.chunks():
            data += chunk
        return data

    def close(self) -> None:
        if self.is_large:
            self.large.give_back()
            self.is_large = False

    def _count(self, size: int) -> None:
        if size > self.limit:
            if self.declared is not None and size == self.declared:
                detail = f"the request body declares {size} bytes (Content-Length), over the limit of {self.limit}"
            else:
                detail = f"the request body is over the limit of {self.limit} bytes"
            raise ContentTooLarge(detail, limit=self.limit)
        if size > self.large.threshold and not self.is_large:
            self.large.take()
            self.is_large = True


@asynccontextmanager
async def job_body(request: Request, limit: int) -> AsyncIterator[Body]:
    """The body of a job creation, its large-body slot (if it takes one) held until the job is stored."""
    large: LargeBodies = request.app.state.large_bodies
    settings = request.app.state.settings
    body = Body(
        request,
        limit,
        large,
        idle_timeout_s=settings.body_idle_timeout_s,
        total_timeout_s=settings.body_timeout_s,
    )
    try:
        yield body
    finally:
        was_large = body.is_large
        body.close()
        if was_large:
            await run_sync(_give_memory_back)


def _give_memory_back() -> None:
    """Return the heap pages freed after a large body to the system. Parsing one frees many blocks
    in the middle of the heap, which glibc otherwise keeps, leaving the process's RSS near its peak."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# glibc gives a block of at least this size a mapping of its own, returned to the system when freed.
MMAP_THRESHOLD = 1024 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def map_large_blocks() -> None:
    """Fix glibc's threshold for a block's own mapping at MMAP_THRESHOLD. Left to itself, glibc raises
    it each time such a block is freed (up to 32 MiB), after which a request's body and its copies
    come from the heap, where a few MB stay behind after every body below --large-body-bytes (any
    number of which may be taken in at once). Fixed, those blocks go back as they are freed."""
    if _MALLOPT is not None:
        _MALLOPT(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


_LIBC = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC), "malloc_trim", None) if _LIBC else None  # glibc only
_MALLOPT = getattr(ctypes.CDLL(_LIBC), "mallopt", None) if _LIBC else None
