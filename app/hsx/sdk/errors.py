"""Typed exceptions, built from the service's application/problem+json (RFC 9457) answers."""

from __future__ import annotations

import contextlib
from typing import Any

import httpx


class HsxError(Exception):
    """An error answer from the service (or, with status 0, a failure the client detected itself).

    `status`, `type`, `title`, `detail` and `errors` (per-sample entries: sample_index, line, sample_id, field,
    message) come from the problem body; `problem` is the whole body.
    """

    def __init__(self, status: int, problem: dict[str, Any] | None = None):
        problem = dict(problem or {})
        self.status = status
        self.problem = problem
        self.type: str = problem.get("type") or "about:blank"
        self.title: str = problem.get("title") or ""
        self.detail: str = problem.get("detail") or ""
        errors = problem.get("errors")
        self.errors: list[dict[str, Any]] = errors if isinstance(errors, list) else []
        super().__init__(str(self))

    def __str__(self) -> str:
        head = f"HTTP {self.status}" if self.status else "error"
        return f"{head}: {self.title}: {self.detail}" if self.detail else f"{head}: {self.title}"


class Unauthorized(HsxError):
    """401: no bearer token, or an unknown one."""


class Forbidden(HsxError):
    """403: the token may not do this (a read-only token asked to write)."""


class NotFound(HsxError):
    """404: no such job, sample or shard."""


class Conflict(HsxError):
    """409: not allowed in the job's or sample's current state."""


class Gone(HsxError):
    """410: a shard the job recorded is no longer in the service's output root: deleted or moved
    (`problem["missing_shards"]` names them), or deleted by retention once every consumer had read it
    (`deleted_by_retention`; `problem["deleted_shards"]` names them)."""

    @property
    def deleted_by_retention(self) -> bool:
        return self.type == "/problems/shard-deleted"


class PayloadTooLarge(HsxError):
    """413: the request body, or one sample in it (the problem names its `line` or `sample_index`), is over
    the service's limit."""


class InvalidInput(HsxError):
    """422: the request was refused and nothing was stored; `errors` names each bad sample and field."""


class ServerError(HsxError):
    """5xx: the service failed."""


class Unavailable(ServerError):
    """503: the service cannot answer now (its database is restarting or unreachable, every database
    connection its requests may use stayed taken while this one waited, or it is taking in as many large job
    bodies as it takes at once); nothing was changed, so the same request can be sent again (after the
    answer's Retry-After seconds). `wait()` keeps polling through it."""


class ChecksumMismatch(HsxError):
    """A downloaded shard's sha256 differs from the manifest's (status 0: found by the client)."""

    def __init__(self, name: str, expected: str, got: str):
        self.name, self.expected, self.got = name, expected, got
        super().__init__(
            0,
            {
                "type": "/problems/checksum-mismatch",
                "title": "Checksum mismatch",
                "detail": f"{name}: sha256 {got} differs from the manifest's {expected}",
            },
        )


BY_STATUS: dict[int, type[HsxError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    413: PayloadTooLarge,
    422: InvalidInput,
    503: Unavailable,
}


def error_for(status: int, problem: dict[str, Any]) -> HsxError:
    cls = BY_STATUS.get(status) or (ServerError if status >= 500 else HsxError)
    return cls(status, problem)


def error_from_response(resp: httpx.Response) -> HsxError:
    """The typed error for an error response whose body has been read."""
    problem: Any = None
    with contextlib.suppress(ValueError):  # not JSON: described from the status line and text below
        problem = resp.json()
    if not isinstance(problem, dict) or not problem:
        problem = {"title": resp.reason_phrase, "detail": resp.text[:500]}
    problem.setdefault("status", resp.status_code)
    return error_for(resp.status_code, problem)
