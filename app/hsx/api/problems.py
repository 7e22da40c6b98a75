"""RFC 9457 problem details: every error the API returns is application/problem+json, the service's
business errors (hsx.service.errors) as they describe themselves."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hsx.api.responses import NewlineJSONResponse
from hsx.service.errors import InvalidInput, ServiceError
from hsx.storage.output_root import OutputRootMismatch

PROBLEM_MEDIA_TYPE = "application/problem+json"

log = logging.getLogger("hsx.api")


def problem_response(
    status: int, title: str, detail: str, type_: str, headers: Mapping[str, str] | None = None, **extra: Any
) -> JSONResponse:
    body = {"type": type_, "title": title, "status": status, "detail": detail, **extra}
    return NewlineJSONResponse(body, status_code=status, media_type=PROBLEM_MEDIA_TYPE, headers=headers)


def http_problem(exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (404 for no route, 405, ...) as problems."""
    phrase = HTTPStatus(exc.status_code).phrase
    slug = phrase.lower().replace(" ", "-")
    return problem_response(exc.status_code, phrase, str(exc.detail), f"/problems/{slug}", exc.headers)


PROBLEM_SCHEMA = {
    "type": "object",
    "description": "RFC 9457 problem details",
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sample_index": {"type": "integer"},
                    "line": {"type": "integer"},
                    "sample_id": {"type": "string"},
                    "field": {"type": "string"},
                    "message": {"type": "string"},
                },
            },
        },
    },
    "required": ["type", "title", "status", "detail"],
}


def install(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _problem(_: Request, exc: ServiceError) -> JSONResponse:
        return problem_response(exc.status, exc.title, exc.detail, exc.type, exc.headers, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = InvalidInput.from_pydantic(exc.errors())
        return problem_response(err.status, err.title, err.detail, err.type, **err.extra)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_problem(exc)

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    async def _database(_: Request, exc: DBAPIError) -> JSONResponse:
        # A database that is restarting or unreachable is a temporary condition the client can
        # retry, not a server bug; nothing was stored (the transaction rolled back).
        return problem_response(
            503,
            "Service Unavailable",
            f"database unavailable: {type(exc.orig).__name__}",
            "/problems/database-unavailable",
            {"Retry-After": "2"},
        )

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _: ClientDisconnect) -> JSONResponse:
        # The client went away before its body was whole: nothing was stored (the transaction rolled
        # back) and nobody is left to read an answer. Routine for a client, so a line, not a traceback.
        log.info("%s %s: the client disconnected before its request body was whole", request.method, request.url.path)
        return problem_response(
            400, "Bad Request", "the client disconnected before the request body was whole", "/problems/disconnected"
        )

    @app.exception_handler(OutputRootMismatch)
    async def _output_root(_: Request, exc: OutputRootMismatch) -> JSONResponse:
        # Writing a manifest found the output root gone from under the service (a file system that
        # dropped away): the action rolled back, and can be sent again once the folder is back.
        return problem_response(503, "Service Unavailable", str(exc), "/problems/output-root-unavailable")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return problem_response(500, "Internal Server Error", f"unexpected {type(exc).__name__}", "/problems/internal")


def problem_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The problem answers a route documents: `codes`, and those every route may give (401, 403, 422, 503)."""
    text = {
        400: "Malformed request: a Range header that cannot be read, or a body that is not UTF-8 JSON",
        401: "Missing or unknown token",
        403: "Not allowed",
        404: "Not found",
        409: "Not allowed in this state",
        410: "A shard the job recorded is no longer in the output root",
        413: "Body (or one NDJSON line) too large",
        415: "Unsupported media type",
        416: "Range not satisfiable",
        422: "Invalid input",
        500: "A shard on disk fails a check on what it holds, or is no longer the file its record describes "
        "(/problems/shard-damaged)",
        503: "Database or output root unavailable, every database connection for requests taken for "
        "--connection-wait-s, or (creation) too many large bodies at once; retry after Retry-After seconds",
        507: "Not enough room on the output volume",
    }
    schema = {"$ref": "#/components/schemas/Problem"}
    return {
        c: {"description": text[c], "content": {PROBLEM_MEDIA_TYPE: {"schema": schema}}}
        for c in (401, 403, 422, 503, *codes)  # 422: every route takes a parameter (see hsx.api.params)
    }
