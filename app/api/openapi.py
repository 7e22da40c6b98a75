"""The OpenAPI document: FastAPI's, plus the problem+json schema, the create body's schema (the
route reads its body itself, to stream NDJSON) and, when tokens are configured, bearer security."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from hsx.api.problems import PROBLEM_SCHEMA
from hsx.api.schemas import JobCreate


def install(app: FastAPI, *, bearer: bool) -> None:
    """Serve `document(app, bearer=...)`, built once, as the app's OpenAPI document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, bearer=bearer)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document(app: FastAPI, *, bearer: bool) -> dict[str, Any]:
    """The app's OpenAPI document."""
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Problem"] = PROBLEM_SCHEMA
    components.setdefault("JobCreate", JobCreate.model_json_schema(ref_template="#/components/schemas/{model}"))
    for name, sub in components["JobCreate"].pop("$defs", {}).items():
        components.setdefault(name, sub)
    if bearer:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
    return schema
