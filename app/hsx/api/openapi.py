"""The OpenAPI document: FastAPI's, plus the problem+json schema (every 422 included), the create
body's schema (the route reads its body itself, to stream NDJSON), the links from a created job to
what can be done with it and, when tokens are configured, bearer security."""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from hsx.api.problems import PROBLEM_MEDIA_TYPE, PROBLEM_SCHEMA
from hsx.wire import JobCreate

# Operations on a created job, by operationId (a route's function name; see `operation_id`).
JOB_OPERATIONS = (
    "get_job",
    "job_events",
    "list_samples",
    "get_manifest",
    "cancel_job",
    "retry_job",
    "verify",
    "delete_job",
)
# (operation, status) -> {link name: (target operation, its parameters as runtime expressions)}
LINKS: dict[tuple[str, str], dict[str, tuple[str, dict[str, str]]]] = {
    ("create_job", "202"): {op: (op, {"job_id": "$response.body#/id"}) for op in JOB_OPERATIONS},
    ("list_samples", "200"): {
        op: (op, {"job_id": "$request.path.job_id", "sample_id": "$response.body#/data/0/id"})
        for op in ("get_sample", "get_sample_tensors")
    },
}


def operation_id(route: APIRoute) -> str:
    """A route's operationId: its function's name (create_job, get_job, ...; get_job_head for HEAD)."""
    return route.name


def install(app: FastAPI, *, bearer: bool) -> None:
    """Serve `document(app, bearer=...)`, built once, as the app's OpenAPI document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, bearer=bearer)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document(app: FastAPI, *, bearer: bool) -> dict[str, Any]:
    """The app's OpenAPI document."""
    with warnings.catch_warnings():
        # A GET route also answers HEAD: FastAPI gives both operations the route's id, and warns;
        # the HEAD one is renamed below.
        warnings.filterwarnings("ignore", message="Duplicate Operation ID")
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Problem"] = PROBLEM_SCHEMA
    components.setdefault("JobCreate", JobCreate.model_json_schema(ref_template="#/components/schemas/{model}"))
    for name, sub in components["JobCreate"].pop("$defs", {}).items():
        components.setdefault(name, sub)
    for path in schema["paths"].values():
        for method, op in path.items():
            _invalid_input_is_a_problem(op)
            if method == "head":
                op["operationId"] += "_head"
    operations = {op["operationId"]: op for path in schema["paths"].values() for op in path.values()}
    # FastAPI's own error schemas describe answers the service never gives.
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for (source, status), links in LINKS.items():
        operations[source]["responses"][status]["links"] = {
            name: {"operationId": target, "parameters": parameters} for name, (target, parameters) in links.items()
        }
    if bearer:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
    return schema


def _invalid_input_is_a_problem(operation: dict[str, Any]) -> None:
    """A 422 is a problem document (hsx.api.problems), not FastAPI's default validation error."""
    answer = operation["responses"].get("422")
    if answer is not None:
        answer["content"] = {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}
        answer["description"] = "Invalid input"
