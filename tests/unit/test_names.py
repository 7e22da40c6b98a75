"""The one limit on ids and names: its length, its character rule, and the pattern the OpenAPI document
states for it, which must say what the code enforces."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from hsx.api.app import create_app
from hsx.config import Settings
from hsx.names import JOB_ID_FORM, MAX_LENGTH, PATTERN, bad_character, could_be_stored, shown
from hsx.wire import JobCreate, SampleIn


def test_the_pattern_says_what_the_rule_enforces():
    pattern = re.compile(PATTERN)  # ECMA-262's \uXXXX escapes read the same in Python
    for code in [*range(0x300), 0x2028, 0xFFFD, 0x1F600]:
        ch = chr(code)
        assert bool(pattern.fullmatch(f"a{ch}b")) == (bad_character(f"a{ch}b") is None), hex(code)
    assert "surrogate" in (bad_character("a\ud800") or "")


def test_lengths_are_counted_in_characters():
    assert could_be_stored("\U0001f600" * MAX_LENGTH) and not could_be_stored("x" * (MAX_LENGTH + 1))
    assert not could_be_stored("a\x00") and not could_be_stored("a\n")
    assert shown("x" * 5000) == f"{'x' * 40!r}... (5000 characters)" and shown("ab") == "'ab'"


@pytest.mark.parametrize("value,stored", [("a/b", "a/b"), (7, "7"), (-(2**63), str(-(2**63))), ("é" * 200, "é" * 200)])
def test_sample_ids_are_stored_as_text(value, stored):
    assert SampleIn.model_validate({"id": value, "input_ids": [1]}).id == stored


@pytest.mark.parametrize("value", ["", "x" * 201, "a\x00", "a\nb", 2**63, True, 1.0, []])
def test_sample_ids_outside_the_rule_are_one_clear_error(value):
    with pytest.raises(ValidationError) as exc:
        SampleIn.model_validate({"id": value, "input_ids": [1]})
    assert [e["loc"] for e in exc.value.errors()] == [("id",)]


def test_the_openapi_document_states_the_limits(tmp_path):
    doc = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'hsx.db'}")).openapi()
    schemas = doc["components"]["schemas"]
    string_id = schemas["SampleIn"]["properties"]["id"]["anyOf"][0]
    assert string_id == {"type": "string", "minLength": 1, "maxLength": MAX_LENGTH, "pattern": PATTERN}
    name = schemas["JobCreate"]["properties"]["name"]["anyOf"][0]
    assert name["maxLength"] == MAX_LENGTH and name["pattern"] == PATTERN
    assert schemas["JobCreate"]["properties"]["input_path"]["anyOf"][0]["pattern"] == PATTERN
    params = 0
    for path, operations in doc["paths"].items():
        for op in operations.values():
            for p in op.get("parameters", []):
                # the commit feed's `after` is a position (an integer), not a name
                feed_position = (path, p["name"]) == ("/v1/jobs/{job_id}/shards", "after")
                if p["name"] in ("job_id", "sample_id", "name", "after") and not feed_position:
                    params += 1
                    # A jobs page's cursor is a job id (or nothing), a stricter rule than the characters'.
                    job_cursor = (path, p["name"]) == ("/v1/jobs", "after")
                    assert p["schema"]["pattern"] == (f"^({JOB_ID_FORM})?$" if job_cursor else PATTERN), (path, p)
                    text = p["schema"]["anyOf"][0] if "anyOf" in p["schema"] else p["schema"]
                    assert text["maxLength"] == MAX_LENGTH, (path, p)
            if path.startswith("/v1/jobs"):
                assert "application/problem+json" in op["responses"]["422"]["content"], path
            feed = [p for p in op.get("parameters", []) if (path, p["name"]) == ("/v1/jobs/{job_id}/shards", "after")]
            assert all(p["schema"]["type"] == "integer" and p["schema"]["minimum"] == 0 for p in feed), feed
    assert params >= 15
    JobCreate.model_validate({"name": "x" * MAX_LENGTH, "samples": [{"input_ids": [1]}]})
