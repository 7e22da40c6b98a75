"""Query strings must be UTF-8 once percent-decoded: Starlette decodes them with replacement, so a
name sent as `%FF` would be stored as U+FFFD, a value the client never sent."""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

from fastapi import FastAPI, Request, Response
from starlette.middleware.base import RequestResponseEndpoint

from hsx.api.problems import problem_response


def install(app: FastAPI) -> None:
    @app.middleware("http")
    async def _utf8_query(request: Request, call_next: RequestResponseEndpoint) -> Response:
        bad = _not_utf8(request.scope.get("query_string", b""))
        if bad is not None:
            return problem_response(
                422,
                "Invalid input",
                f"the query parameter {bad!r} is not UTF-8 once percent-decoded",
                "/problems/invalid-input",
                errors=[{"field": bad, "message": "not UTF-8 once percent-decoded"}],
            )
        return await call_next(request)


def _not_utf8(raw: bytes) -> str | None:
    """The name of the first parameter whose name or value is not UTF-8, or None."""
    for part in raw.split(b"&"):
        name, _, value = part.partition(b"=")
        try:
            key = unquote_to_bytes(name.replace(b"+", b" ")).decode("utf-8")
        except UnicodeDecodeError:
            return name.decode("ascii", "replace")
        try:
            unquote_to_bytes(value.replace(b"+", b" ")).decode("utf-8")
        except UnicodeDecodeError:
            return key
    return None
