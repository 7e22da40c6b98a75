"""RFC 9457 problem details: every error the API returns is application/problem+json."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

PROBLEM_MEDIA_TYPE = "application/problem+json"


class ProblemError(Exception):
    """A business error that carries its HTTP status and problem fields."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        type_: str | None = None,
        title: str | None = None,
        headers: dict[str, str] | None = None,
        **extra,
    ):
        super().__init__(detail)
        self.status = status
        self.headers = headers
        self.detail = detail
        self.type = type_ or f"/problems/{HTTPStatus(status).phrase.lower().replace(' ', '-')}"
        self.title = title or HTTPStatus(status).phrase
        self.extra = extra


class InvalidInput(ProblemError):
    def __init__(self, errors: list[dict], detail: str | None = None):
        first = errors[0]
        where = f"sample {first['sample_index']} " if first.get("sample_index") is not None else ""
        super().__init__(
            422,
            detail or f"{len(errors)} invalid field(s); first: {where}{first['field']}: {first['message']}",
            type_="/problems/invalid-input",
            title="Invalid input",
            errors=errors,
        )


class NotFound(ProblemError):
    def __init__(self, what: str):
        super().__init__(404, f"{what} not found")


def problem_response(
    status: int, title: str, detail: str, type_: str, headers: dict | None = None, **extra
) -> JSONResponse:
    body = {"type": type_, "title": title, "status": status, "detail": detail, **extra}
    return JSONResponse(body, status_code=status, media_type=PROBLEM_MEDIA_TYPE, headers=headers)


def errors_from_pydantic(errs) -> list[dict]:
    """Pydantic errors as problem entries; a sample's errors name its index and field."""
    errors = []
    for err in errs:
        loc = [p for p in err.get("loc", ()) if p != "body"]
        entry: dict = {"field": ".".join(str(p) for p in loc) or "body", "message": err.get("msg", "invalid")}
        if len(loc) >= 2 and loc[0] == "samples" and isinstance(loc[1], int):
            entry["sample_index"] = loc[1]
            entry["field"] = ".".join(str(p) for p in loc[2:]) or "sample"
        errors.append(entry)
    return errors or [{"field": "body", "message": "invalid request"}]


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
    @app.exception_handler(ProblemError)
    async def _problem(_: Request, exc: ProblemError):
        return problem_response(exc.status, exc.title, exc.detail, exc.type, exc.headers, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        err = InvalidInput(errors_from_pydantic(exc.errors()))
        return problem_response(err.status, err.title, err.detail, err.type, **err.extra)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        phrase = HTTPStatus(exc.status_code).phrase
        slug = phrase.lower().replace(" ", "-")
        return problem_response(
            exc.status_code, phrase, str(exc.detail), f"/problems/{slug}", getattr(exc, "headers", None)
        )

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    async def _database(_: Request, exc: Exception):
        # A database that is restarting or unreachable is a temporary condition the client can
        # retry, not a server bug; nothing was stored (the transaction rolled back).
        return problem_response(
            503,
            "Service Unavailable",
            f"database unavailable: {type(exc.orig).__name__}",
            "/problems/database-unavailable",
            {"Retry-After": "2"},
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        return problem_response(500, "Internal Server Error", f"unexpected {type(exc).__name__}", "/problems/internal")
