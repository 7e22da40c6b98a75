"""The dashboard: one page at / and its files under /dashboard/, shipped inside the package (hsx/dashboard).

The page is a client of the public API like any other (it sends the bearer token the user gives it);
nothing here reads the database, so the page and its files need no token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

FILES = Path(__file__).resolve().parents[1] / "dashboard"
PAGE = "/"
ASSETS = "/dashboard"
# Everything the page loads comes from this service; nothing inline, nothing from elsewhere.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class _Files(StaticFiles):
    """The files, revalidated at every load (a 304 when unchanged): an upgraded service's page never runs
    with a cached older script."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


def install(app: FastAPI) -> None:
    app.mount(ASSETS, _Files(directory=FILES), name="dashboard")

    @app.get(PAGE, include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(
            FILES / "index.html",
            media_type="text/html",
            headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"},
        )
