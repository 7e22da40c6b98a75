"""Bearer tokens from configuration; read-only tokens may only read."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request, Response
from starlette.middleware.base import RequestResponseEndpoint

from hsx.api.problems import problem_response
from hsx.config import parse_tokens

OPEN_PATHS = {"/healthz", "/"}
# The dashboard's files hold no data: the browser loads them before it has a token to send.
OPEN_PREFIXES = ("/dashboard/",)
READ_METHODS = {"GET", "HEAD", "OPTIONS"}
# Actions that only read, though they are POSTs: read-only tokens may run them.
READ_ACTION_SUFFIXES = ("/verify",)


def install(app: FastAPI, spec: str) -> None:
    tokens = parse_tokens(spec)
    if not tokens:
        return

    def role_of(presented: str) -> str | None:
        found = None
        for token, role in tokens.items():  # compare with every token, in constant time each
            if hmac.compare_digest(token.encode(), presented.encode()):
                found = role
        return found

    @app.middleware("http")
    async def _auth(request: Request, call_next: RequestResponseEndpoint) -> Response:
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        role = role_of(presented.strip()) if scheme.lower() == "bearer" and presented else None
        if request.url.path in OPEN_PATHS or request.url.path.startswith(OPEN_PREFIXES):
            request.state.role = role  # /healthz shows its details only to a token
            return await call_next(request)
        if role is None:
            return problem_response(
                401,
                "Unauthorized",
                "a valid bearer token is required",
                "/problems/unauthorized",
                {"WWW-Authenticate": 'Bearer realm="hsx"'},
            )
        reads = request.method in READ_METHODS or request.url.path.endswith(READ_ACTION_SUFFIXES)
        if role == "read" and not reads:
            return problem_response(403, "Forbidden", "this token may only read", "/problems/forbidden")
        request.state.role = role  # GET /v1/token tells the caller
        return await call_next(request)
