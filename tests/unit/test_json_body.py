"""Reading an application/json job body sample by sample (hsx.service.json_body): the elements found
are exactly the array's, whatever the JSON's spacing, strings and escapes; what is not JSON, or not a
job request, is refused with the field it concerns."""

from __future__ import annotations

import json

import pytest

from hsx.service.errors import InvalidInput
from hsx.service.json_body import job_request

SAMPLES = [
    {"id": 'a "quoted" [id] {x}', "input_ids": [1, 2, 3]},
    {"id": "back\\slash\\", "input_ids": [4], "loss_mask": [0]},
    {"id": "ünïcode ]}", "input_ids": [5, 6]},
    {"input_ids": [7] * 1000},
]


@pytest.mark.parametrize("dump", [{}, {"separators": (",", ":")}, {"indent": 3}, {"ensure_ascii": False}])
def test_elements_are_the_samples_array_elements(dump):
    body = json.dumps({"name": "n [x]", "samples": SAMPLES, "layers": [2, 4]}, **dump).encode()
    request, elements = job_request(body)
    assert (request.name, request.layers, request.samples, request.input_path) == ("n [x]", [2, 4], [], None)
    got = list(elements)
    assert [i for i, _ in got] == list(range(len(SAMPLES)))
    assert [json.loads(text) for _, text in got] == SAMPLES


def test_members_in_any_order_and_escaped_names():
    body = b' {"layers": [1], "s\\u0061mples" : [ {"input_ids": [9]} ] , "name": null} \n'
    request, elements = job_request(bytearray(body))
    assert request.layers == [1] and [json.loads(t) for _, t in elements] == [{"input_ids": [9]}]


def test_input_path_requests_have_no_elements():
    request, elements = job_request(b'{"input_path": "x.jsonl"}')
    assert request.input_path == "x.jsonl" and request.samples is None and list(elements) == []


def test_empty_samples():
    request, elements = job_request(b'{"samples": []}')
    assert request.samples == [] and list(elements) == []


def refused(body: bytes) -> dict:
    with pytest.raises(InvalidInput) as exc:
        _, elements = job_request(body)
        list(elements)
    return exc.value.extra["errors"][0]


@pytest.mark.parametrize(
    "body,field",
    [
        (b"", "body"),
        (b"[1]", "body"),
        (b"{nope", "body"),
        (b'{"samples": [1}', "body"),
        (b'{"samples": "unterminated', "body"),
        (b'{"samples": []} trailing', "body"),
        (b'{"samples": [] "name": "x"}', "body"),
        (b'{"samples": [{"input_ids": [1]}} }', "samples"),
        (b'{"samples": [{"input_ids": [1]},]}', "samples"),
        (b'{"samples": [{"input_ids": [1]} {"input_ids": [2]}]}', "samples"),
        (b'{"samples": [], "samples": []}', "samples"),
        (b'{"samples": 5}', "samples"),
        (b'{"samples": [], "input_path": "x"}', "body"),
        (b'{"samples": [], "colour": 1}', "colour"),
        (b'{"samples": [], "layers": [3, 1]}', "layers"),
    ],
)
def test_what_is_not_a_job_request_is_refused(body, field):
    assert refused(body)["field"] == field


def test_a_mismatched_element_is_left_to_the_sample_parser():
    """The walk does not match bracket kinds; the element it hands on is then not valid JSON."""
    _, elements = job_request(b'{"samples": [{"input_ids": [1}], {"input_ids": [2]}]}')
    assert [t for _, t in elements] == [b'{"input_ids": [1}]', b'{"input_ids": [2]}']
