"""Answers to requests that no route takes, as problems, with what the client needs to go on.

- 404 for a path that a route names but for a trailing slash: a 307 redirect to it, with a relative
  Location. Starlette's own redirect (redirect_slashes) writes an absolute URL built from the request's
  Host header, which the client, or anyone in front of the service, chooses: a redirect to anywhere.
- 405: `Allow` lists every method the path takes; Starlette's lists only the first matching route's.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import RedirectResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from hsx.api.problems import http_problem


def install(app: FastAPI, routers: list[APIRouter]) -> None:
    """`routers`: those the app includes. Needs the app built with redirect_slashes=False, so that an
    unknown path reaches the 404 handler."""

    def routes() -> list[BaseRoute]:
        # The app's own routes (the docs) and the included routers' routes, each with its full path.
        return [r for r in app.router.routes if hasattr(r, "methods")] + [r for rr in routers for r in rr.routes]

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: StarletteHTTPException) -> Response:
        location = slash_twin(routes(), request)
        if location is None:
            return http_problem(exc)
        return RedirectResponse(location, status_code=307)

    @app.exception_handler(405)
    async def _method_not_allowed(request: Request, exc: StarletteHTTPException) -> Response:
        allowed = sorted(
            {m for route in routes() if route.matches(request.scope)[0] != Match.NONE for m in _methods(route)}
        )
        detail = f"{request.method} is not allowed here; allowed: {', '.join(allowed)}"
        return http_problem(StarletteHTTPException(405, detail, headers={"Allow": ", ".join(allowed)}))


def _methods(route: object) -> set[str]:
    return getattr(route, "methods", None) or set()


def slash_twin(routes: list[BaseRoute], request: Request) -> str | None:
    """The relative URL of the route this path names but for a trailing slash, if there is one."""
    scope = request.scope
    path: str = scope["path"]
    if path == "/":
        return None
    twin = {**scope, "path": path[:-1] if path.endswith("/") else path + "/"}
    if not any(route.matches(twin)[0] != Match.NONE for route in routes):
        return None
    raw: bytes = scope.get("raw_path") or path.encode()
    raw = raw[:-1] if raw.endswith(b"/") else raw + b"/"
    location = scope.get("root_path", "") + raw.decode("latin-1")
    if scope.get("query_string"):
        location += "?" + scope["query_string"].decode("latin-1")
    # Only a path on this service: "//host/..." would be read as another host.
    return location if location.startswith("/") and not location.startswith("//") else None
