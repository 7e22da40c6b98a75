"""A bounded schemathesis run over the whole OpenAPI document: no 5xx, no response off its schema."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.stack import start_service

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
EXAMPLES_PER_OPERATION = 25


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    svc = start_service(tmp, f"sqlite:///{tmp / 'hsx.db'}", extra=["--no-writer"])
    # One real job so that generated requests sometimes reach a stored job.
    svc.post_job({"samples": [{"id": "a", "input_ids": [1, 2, 3]}]})
    yield svc
    svc.stop()


def test_every_operation_conforms_to_its_schema(service):
    # The schemathesis pytest plugin does not run under this pytest; drive hypothesis directly.
    schema = schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    failures: dict[str, str] = {}
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def run(case):
            case.call_and_validate(checks=CHECKS)

        try:
            run()
        except Exception as exc:  # collect every operation's failure, then report them together
            failures[operation.label] = f"{type(exc).__name__}: {exc}"[:2000]
    assert operations >= 12
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
