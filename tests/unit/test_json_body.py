"""Reading an application/json job body sample by sample (hsx.service.json_body): the elements found
are exactly the array's, whatever the JSON's spacing, strings and escapes; what is not JSON, or not a
job request, is refused with the field it concerns."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from hsx.service.errors import InvalidInput
from hsx.service.json_body import MAX_DEPTH, cut_turns, job_request
from hsx.wire import MAX_TURNS, SampleIn

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


TURN = {"role": "user", "content": 'a "turn" with [brackets] and {braces}'}


@pytest.mark.parametrize(
    "sample,kept",
    [
        ({"id": "t", "messages": [TURN, TURN, 1, TURN, 2]}, [TURN, TURN, 1]),
        ({"messages": [[1, 2], TURN]}, [[1, 2]]),
        ({"conversations": ["x"] * 1000, "source": "kept as it is"}, ["x"]),
        ({"id": 1, "messages": [TURN] * (MAX_TURNS + 50)}, [TURN] * (MAX_TURNS + 1)),
    ],
)
@pytest.mark.parametrize("dump", [{}, {"separators": (",", ":")}, {"indent": 2}])
def test_a_conversation_is_cut_where_the_model_stops_reading_it(sample, kept, dump):
    cut = json.loads(cut_turns(json.dumps(sample, **dump).encode()))
    key = "messages" if "messages" in sample else "conversations"
    assert cut == {**sample, key: kept}


@pytest.mark.parametrize(
    "text",
    [
        json.dumps({"id": "t", "messages": [TURN] * MAX_TURNS}).encode(),
        json.dumps({"input_ids": [1, 2], "note": "messages"}).encode(),
        b'{"messages": [1, 2',
        b'["messages", 1]',
        b'{"messages": "not a list"}',
    ],
)
def test_what_needs_no_cut_or_cannot_be_walked_is_left_as_it_is(text):
    assert cut_turns(text) == text


def test_the_cut_text_gives_the_error_the_whole_list_gives():
    for sample in ({"messages": [1] * 100_000}, {"messages": [TURN] * 10_000}, {"conversations": [TURN, None]}):
        errors = _errors(json.dumps(sample).encode())
        assert errors == _errors(cut_turns(json.dumps(sample).encode())) and len(errors) == 1


def _errors(text: bytes) -> list[tuple[tuple, str]]:
    with pytest.raises(ValidationError) as exc:
        SampleIn.model_validate_json(text, strict=True)
    return [(e["loc"], e["msg"]) for e in exc.value.errors()]


def test_elements_of_any_nesting_with_brackets_quotes_and_escapes_in_strings():
    """Random samples whose strings hold brackets, quotes and backslashes: the walk steps over strings
    by counting quotes between brackets, and must find exactly the elements the JSON has."""
    rng = random.Random(20261204)
    chars = ["a", "[", "]", "{", "}", '"', "\\", ",", " ", "é", "\n", ":"]

    def text() -> str:
        return "".join(rng.choice(chars) for _ in range(rng.randrange(8)))

    def value(depth: int = 0) -> object:
        r = rng.random()
        if depth > 4 or r < 0.3:
            return rng.choice([1, -2.5, True, None, text(), text(), [], {}])
        if r < 0.65:
            return [value(depth + 1) for _ in range(rng.randrange(5))]
        return {text(): value(depth + 1) for _ in range(rng.randrange(5))}

    for _ in range(3000):
        samples = [value() for _ in range(rng.randrange(1, 4))]
        dump = rng.choice([{}, {"separators": (",", ":")}, {"indent": 1}, {"ensure_ascii": False}])
        _, elements = job_request(json.dumps({"samples": samples}, **dump).encode())
        assert [json.loads(t) for _, t in elements] == samples


def test_nesting_deeper_than_the_parser_reads_is_refused_by_the_walk():
    deep = b'{"samples": [{"input_ids": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    with pytest.raises(InvalidInput) as exc:
        list(job_request(deep)[1])
    assert f"nested more than {MAX_DEPTH} deep" in exc.value.detail
    _, elements = job_request(json.dumps({"samples": [{"x": [[[[1]]]] * 3, "input_ids": [1]}]}).encode())
    assert [json.loads(t) for _, t in elements] == [{"x": [[[[1]]]] * 3, "input_ids": [1]}]
