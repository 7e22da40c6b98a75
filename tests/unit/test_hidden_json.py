"""The streaming parser of SGLang's `/generate` answer with hidden states (hsx.backends.hidden_json).

Answers are built the way a server builds them: `json.dumps` of a dict holding `tensor.tolist()` of
bf16 values, written compact (as orjson writes), with json's default separators, and indented. Every
answer is fed in chunks of several sizes, and the array must equal the source bit for bit.
"""

from __future__ import annotations

import gc
import json
import random
import re
import tracemalloc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from hsx.backends.hidden_json import HiddenStatesAnswerParser, HiddenStatesJSONError, parse_hidden_states_answer

ROWS, WIDTH = 6, 40
CHUNK_SIZES = [1, 7, 4096, None]  # None: the whole answer as one chunk
COMPACT = {"separators": (",", ":")}  # what orjson writes
FORMATS = {"compact": COMPACT, "default": {}, "indented": {"indent": 2}}


def bf16_rows(rows: int = ROWS, width: int = WIDTH, seed: int = 0) -> list[list[float]]:
    """Hidden states as a server has them: bf16 values, widened to float for `tolist()`. A few
    values that print differently are planted: signed zero, whole numbers, tiny (exponent notation)
    and large ones."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, width, generator=g).bfloat16()
    planted = [-0.0, 0.0, 3.0, -1.5, 1e-05, 2.0**-130, -3.0e38, 65504.0, 1.1920928955078125e-07]
    flat = values.view(-1)
    for i, v in enumerate(planted[: flat.numel()]):
        flat[i * 3 % flat.numel()] = v
    return values.float().tolist()


def expected_array(values: list[list[float]]) -> np.ndarray:
    return np.array(values, dtype=np.float64).astype(np.float32)


def make_answer(
    values: list[list[float]] | None = None,
    *,
    decode_rows: list[list[float]] | None = None,
    hidden_first: bool = False,
    meta_first: bool = False,
    text: str = "Paris",
    extra_meta: dict | None = None,
) -> dict:
    """An answer as SGLang's /generate gives it, keys in the order asked for."""
    values = bf16_rows() if values is None else values
    hidden = [values, *(decode_rows or [])]
    meta: dict = {"id": "hsx-0123", "finish_reason": {"type": "length", "length": 1}}
    if hidden_first:
        meta = {"hidden_states": hidden, **meta}
    meta.update({"prompt_tokens": len(values), "completion_tokens": 1, "cached_tokens": 0, **(extra_meta or {})})
    if not hidden_first:
        meta["hidden_states"] = hidden
    meta["e2e_latency"] = 0.25
    if meta_first:
        return {"meta_info": meta, "text": text, "output_ids": [17]}
    return {"text": text, "output_ids": [17], "meta_info": meta}


def encode(answer, fmt: str = "compact") -> bytes:
    return json.dumps(answer, **FORMATS[fmt]).encode()


def chunked(data: bytes, size: int | None) -> Iterator[bytes]:
    if size is None:
        yield data
        return
    for i in range(0, len(data), size):
        yield data[i : i + size]


def parse(data: bytes, size: int | None = 4096, rows: int = ROWS, width: int = WIDTH):
    return parse_hidden_states_answer(chunked(data, size), rows=rows, width=width)


def without_hidden(answer: dict) -> dict:
    copy = json.loads(json.dumps(answer))
    copy["meta_info"]["hidden_states"] = None
    return copy


def row_text(row: list) -> bytes:
    return ("[" + ",".join(str(v) if isinstance(v, str) else json.dumps(v) for v in row) + "]").encode()


def with_value(r: int, c: int, text: str, values: list[list[float]] | None = None) -> tuple[bytes, int]:
    """A compact answer whose value [r][c] is written as `text`, and where row r starts."""
    values = bf16_rows() if values is None else values
    data = encode(make_answer(values))
    row = values[r]
    start = data.index(row_text(row))
    return data.replace(row_text(row), row_text([*row[:c], text, *row[c + 1 :]]), 1), start


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def assert_rejected(data: bytes, pattern: str, rows: int = ROWS, width: int = WIDTH) -> HiddenStatesJSONError:
    """The answer is refused, whatever the chunking, with a message matching `pattern`."""
    messages = set()
    for size in (1, 7, None):
        with pytest.raises(HiddenStatesJSONError, match=pattern) as caught:
            parse(data, size, rows=rows, width=width)
        messages.add(str(caught.value))
    assert len(messages) == 1, messages  # the same verdict and the same byte, however the body arrives
    return caught.value


# -- well-formed answers -----------------------------------------------------------------------


@pytest.mark.parametrize("size", CHUNK_SIZES)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_values_are_exact_whatever_the_chunks(fmt, size):
    values = bf16_rows()
    answer = make_answer(values)
    data = encode(answer, fmt)
    assert b"e-" in data and b"e+38" in data and b"-0.0" in data  # the planted spellings are there
    got_answer, array = parse(data, size)
    assert_same_bits(array, expected_array(values))
    assert got_answer == without_hidden(answer)


def test_the_recipe_of_a_real_server():
    """torch.randn(...).bfloat16().float().tolist(), as the server's tensor is turned into JSON."""
    values = torch.randn(17, 96, generator=torch.Generator().manual_seed(3)).bfloat16().float().tolist()
    _, array = parse(encode(make_answer(values)), 1000, rows=17, width=96)
    assert torch.equal(torch.from_numpy(array), torch.tensor(values, dtype=torch.float32))


@pytest.mark.parametrize("hidden_first", [True, False])
@pytest.mark.parametrize("meta_first", [True, False])
def test_key_order_does_not_matter(hidden_first, meta_first):
    answer = make_answer(hidden_first=hidden_first, meta_first=meta_first)
    data = encode(answer)
    assert (data.index(b'"hidden_states"') < data.index(b'"prompt_tokens"')) == hidden_first
    assert (data.index(b'"meta_info"') < data.index(b'"text"')) == meta_first
    for size in (1, 7, None):
        got, array = parse(data, size)
        assert got == without_hidden(answer)
        assert list(got) == list(answer)
        assert_same_bits(array, expected_array(bf16_rows()))


def test_strings_that_look_like_structure_are_only_strings():
    tricky = 'say "hi" \\ [[1.0, 2.0]], {"hidden_states": [[0]]} \\"hidden_states\\": ] } \\\\" \u00e9\U0001f600'
    answer = make_answer(
        text=tricky,
        extra_meta={
            "note": '"hidden_states": [[',
            "tags": ["hidden_states", "]]", "\\"],
            "nested": {"hidden_states": [[9.0]]},
        },
    )
    answer["hidden_states"] = "not this one either"  # a top-level key of that name is not meta_info's
    for fmt in FORMATS:
        for size in (1, 7, None):
            got, array = parse(encode(answer, fmt), size)
            assert got == without_hidden(answer)
            assert got["text"] == tricky
            assert got["meta_info"]["nested"] == {"hidden_states": [[9.0]]}
            assert_same_bits(array, expected_array(bf16_rows()))


def test_a_key_spelled_with_escapes_is_still_the_key():
    data = encode(make_answer()).replace(b'"hidden_states"', b'"hidden\\u005fstates"')
    got, array = parse(data, 5)
    assert got["meta_info"]["hidden_states"] is None
    assert_same_bits(array, expected_array(bf16_rows()))


@pytest.mark.parametrize("size", [1, 7, None])
def test_decode_rows_after_element_0_are_skipped(size):
    decode = [[0.5] * WIDTH, [float("nan"), 1.0, -2.5, float("inf")], []]  # a decode step's NaN is not refused
    answer = make_answer(decode_rows=decode)
    data = encode(answer, "default")
    assert b"NaN" in data
    got, array = parse(data, size)
    assert got == without_hidden(answer)
    assert_same_bits(array, expected_array(bf16_rows()))


@pytest.mark.parametrize("size", [1, 7, None])
def test_a_batch_answer_of_one(size):
    answer = make_answer()
    got, array = parse(b" \n" + encode([answer]) + b"\n", size)
    assert got == without_hidden(answer)
    assert_same_bits(array, expected_array(bf16_rows()))


def test_chunks_may_be_any_bytes_like_object():
    data = encode(make_answer())
    pieces = [bytearray(data[:100]), memoryview(data)[100:2000], data[2000:]]
    _, array = parse_hidden_states_answer(pieces, rows=ROWS, width=WIDTH)
    assert_same_bits(array, expected_array(bf16_rows()))


def test_the_incremental_parser_is_the_same_parser():
    data = encode(make_answer())
    parser = HiddenStatesAnswerParser(rows=ROWS, width=WIDTH)
    for piece in chunked(data, 333):
        parser.feed(piece)
    answer, array = parser.finish()
    assert answer["meta_info"]["prompt_tokens"] == ROWS
    assert_same_bits(array, expected_array(bf16_rows()))


def test_decimal_text_is_rounded_once_to_float64_then_to_float32():
    """Long and awkward decimals (many digits, exponents, halfway cases between two float32 values)
    convert exactly as Python's float() and then float32 do: one rounding to float64, then one to
    float32, never a direct rounding to float32."""
    rnd = random.Random(7)
    texts = []
    for _ in range(ROWS * WIDTH):
        whole = str(rnd.randint(0, 999))
        fraction = "".join(rnd.choice("0123456789") for _ in range(rnd.randint(1, 24)))
        exponent = rnd.choice(["", "", f"e{rnd.randint(-45, 35)}", f"E+{rnd.randint(0, 9)}", "e-05"])
        texts.append(f"{rnd.choice(['', '-'])}{whole}.{fraction}{exponent}")
    # Exactly halfway between two float32 neighbours: float32 rounds to even.
    for i, v in enumerate(np.array([1.0, 3.14159, 1e-3, 65504.0], dtype=np.float32)):
        texts[i] = repr((float(v) + float(np.nextafter(v, np.float32(np.inf)))) / 2)
    # Just above the halfway point 1 + 2**-24: float64 rounds it to the halfway point, which float32
    # then rounds down to 1.0; rounded straight to float32 it would have gone up.
    texts[4] = "1.0000000596046447753906250000000001"
    rows = [texts[r * WIDTH : (r + 1) * WIDTH] for r in range(ROWS)]
    hidden = "[" + ",".join("[" + ",".join(row) + "]" for row in rows) + "]"
    data = ('{"text":"","meta_info":{"hidden_states":[' + hidden + "]}}").encode()
    _, array = parse(data, 64)
    want = np.array([[float(t) for t in row] for row in rows], dtype=np.float64).astype(np.float32)
    assert_same_bits(array, want)
    assert array[0, 4] == np.float32(1.0)


# -- refused answers ---------------------------------------------------------------------------


def test_wrong_row_count():
    data = encode(make_answer())
    assert_rejected(data, r"has 6 rows, expected 7", rows=7)
    assert_rejected(data, r"more than the 5 rows expected \(row 5 at byte \d+\)", rows=5)


def test_ragged_row():
    values = bf16_rows()
    values[2] = values[2][:-1]
    values[3] = values[3] + [1.0]  # same total count: each row is checked, not only the sum
    data = encode(make_answer(values))
    at = data.index(row_text(values[2]))
    assert_rejected(data, rf"hidden_states\[0\]\[2\] \(row starts at byte {at}\) has 39 values, expected 40")


def test_width_mismatch():
    assert_rejected(encode(make_answer()), r"\[0\]\[0\] .* has 40 values, expected 41", width=41)
    assert_rejected(encode(make_answer()), r"\[0\]\[0\] .* has 40 values, expected 8", width=8)


def test_empty_hidden_states_max_new_tokens_0():
    answer = make_answer()
    answer["meta_info"]["hidden_states"] = []
    assert_rejected(encode(answer), r"meta_info.hidden_states is empty .*max_new_tokens 0")


def test_hidden_states_twice():
    data = encode(make_answer())
    twice = data.replace(b'"e2e_latency":0.25', b'"hidden_states":[[[1.0]]]', 1)
    assert_rejected(twice, rf"meta_info.hidden_states appears twice \(byte {twice.rindex(b'hidden_states') + 14}\)")


@pytest.mark.parametrize("value", [None, "x", 3, {"a": [1]}])
def test_hidden_states_not_a_list(value):
    answer = make_answer()
    answer["meta_info"]["hidden_states"] = value
    assert_rejected(encode(answer), r"meta_info.hidden_states is not a list: it is (null|a string|a number|an object)")


def test_missing_meta_info_or_hidden_states():
    assert_rejected(b'{"text": "x", "output_ids": [1]}', r"no meta_info.hidden_states .*'text': 'x'")
    assert_rejected(b'{"text": "x", "meta_info": {"id": "a"}}', r"no meta_info.hidden_states")
    assert_rejected(b'{"error": {"message": "bad request"}}', r"no meta_info.hidden_states.*bad request")
    # a hidden_states key elsewhere is not the one
    assert_rejected(b'{"hidden_states": [[[1.0]]], "meta_info": {"x": {"hidden_states": [[[1.0]]]}}}', r"no meta")


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
def test_non_finite_values(bad):
    data, row4 = with_value(4, 7, bad)
    pattern = rf"\[0\]\[4\]\[7\] is b'{re.escape(bad)}', not a finite number \(row starts at byte {row4}\)$"
    assert_rejected(data, pattern)


def test_values_beyond_float32():
    data, _ = with_value(1, 2, "1e39")
    assert_rejected(data, r"\[0\]\[1\]\[2\] is b'1e39', out of float32's range")


@pytest.mark.parametrize(
    "bad, pattern",
    [
        ("1.2.3", r"value 5 is b'1.2.3', not a number"),
        ("1e", r"value 5 is b'1e', not a number"),
        ("--1", r"value 5 is b'--1', not a number"),
        ("0x1p3", r"value 5 is b'0x1p3', not a number"),
        ('"1.5"', r"""value 5 is b'"1.5"', not a number"""),
        ("null", r"value 5 is b'null', not a number"),
        ("true", r"value 5 is b'true', not a number"),
        ("", r"value 5 is empty, not a number"),
        ("1 2", r"value 5 is b'1 2', not a number"),
    ],
)
def test_malformed_numbers(bad, pattern):
    data, start = with_value(0, 5, bad)
    error = assert_rejected(data, rf"hidden_states\[0\]\[0\] \(row starts at byte {start}\): " + pattern)
    if bad:
        at = int(re.search(r"not a number \(byte (\d+)\)", str(error)).group(1))
        assert data[at : at + len(bad)] == bad.encode()


def test_empty_fields_and_stray_commas():
    values = bf16_rows()
    first = ",".join(json.dumps(v) for v in values[0])
    data = encode(make_answer())
    assert_rejected(data.replace(first.encode(), first.encode() + b",", 1), r"\[0\]\[0\] .*: value 40 is empty")
    assert_rejected(data.replace(first.encode(), b"," + first.encode(), 1), r"\[0\]\[0\] .*: value 0 is empty")
    assert_rejected(data.replace(b"]]", b"],]", 1), r"hidden_states\[0\] ends with a comma")
    assert_rejected(data.replace(b"],[", b"][", 1), r"no comma before this row")
    assert_rejected(data.replace(b"[[[", b"[[,[", 1), r"a comma before the first row")


def test_element_0_must_be_2d():
    answer = make_answer()
    answer["meta_info"]["hidden_states"] = [[1.0, 2.0], [3.0, 4.0]]  # a decode-only answer: rows of 1-D
    assert_rejected(encode(answer), r"not a 2-D list: found a number where row 0 should start")
    answer["meta_info"]["hidden_states"] = [[[[1.0]] * WIDTH] * ROWS]
    assert_rejected(encode(answer), r"\[0\]\[0\] .* holds a list: element 0 is deeper than 2-D")
    answer["meta_info"]["hidden_states"] = [[[0.5] * WIDTH] * (ROWS - 1) + [{"x": 1}]]
    assert_rejected(encode(answer), r"found an object where row 5 should start")


def test_truncated_answers():
    data = encode(make_answer(decode_rows=[[1.0] * WIDTH]))
    cuts = {
        data.index(b'"Paris') + 3: "inside a string",
        data.index(b"[[[") + 200: r"inside meta_info.hidden_states\[0\], at row 0 of 6",
        data.index(b"]],") + 5: "inside meta_info.hidden_states$",
        len(data) - 1: r"1 container\(s\) still open",
        data.index(b'"hidden_states"') + 16: "inside meta_info.hidden_states$",
    }
    for cut, where in cuts.items():
        assert_rejected(data[:cut], rf"the answer ends early, at byte {cut}: {where}")
    assert_rejected(b"", r"ends early, at byte 0: no JSON value at all")
    assert_rejected(b"  \n", r"ends early, at byte 3: no JSON value at all")


def test_batch_of_two_or_none():
    answer = make_answer()
    two = encode([answer, answer])
    assert_rejected(two, rf"a list of more than one answer \(second one at byte {len(encode(answer)) + 1}\)")
    assert_rejected(b"[]", r"a list of 0 answers; expected one")
    assert_rejected(b"[1]", r"not a JSON object: 1")


def test_not_json_at_all():
    assert_rejected(b"<html>502 Bad Gateway</html>", r"not a JSON object or list: it is '<' at byte 0")
    assert_rejected(b' "just a string"', r"not a JSON object or list: it is a string at byte 1")
    data = encode(make_answer())
    assert_rejected(data + b"{}", rf"data after the end of the answer at byte {len(data)}")
    assert_rejected(data.replace(b"}", b"]", 1), r"'\]' at byte \d+ closes an object")


def test_malformed_skeleton_is_reported_where_it_is_in_the_answer():
    """The skeleton is decoded at the end; its error offsets are the answer's, not the skeleton's."""
    data = encode(make_answer()).replace(b'"e2e_latency":0.25', b'"e2e_latency":tru', 1)
    at = data.index(b"tru")
    assert data.index(b'"hidden_states"') < at  # after the big value, so the offset had to be mapped
    assert_rejected(data, rf"not valid JSON: Expecting value at byte {at}$")
    before = encode(make_answer()).replace(b'"id":"hsx-0123"', b'"id":hsx', 1)
    assert_rejected(before, rf"not valid JSON: Expecting value at byte {before.index(b'hsx')}$")


def test_the_array_is_freed_with_its_last_reference():
    """No reference cycle keeps a (gigabyte-sized) array alive until the garbage collector runs."""
    gc.disable()
    try:
        _, array = parse(encode(make_answer()))
        gone = weakref.ref(array)
        del array
        assert gone() is None
    finally:
        gc.enable()


# -- bounded memory ----------------------------------------------------------------------------


@pytest.mark.slow  # parses a large answer and measures memory: --all runs it
def test_a_large_answer_needs_only_the_array_and_a_few_megabytes():
    """A ~200 MB answer streamed from a generator (never one bytes object): peak traced memory stays
    within the output array plus a few MB."""
    rows, width, distinct = 2300, 8192, 8
    source = torch.randn(distinct, width, generator=torch.Generator().manual_seed(5)).bfloat16().float()
    row_texts = [json.dumps(r, separators=(",", ":")).encode() for r in source.tolist()]
    head = b'{"text":"x","output_ids":[17],"meta_info":{"id":"hsx-big","prompt_tokens":%d,"hidden_states":[[' % rows
    tail = b']],"cached_tokens":0}}'

    def body() -> Iterator[bytes]:
        yield head
        for i in range(rows):
            row = (b"," if i else b"") + row_texts[i % distinct]
            for j in range(0, len(row), 65536):
                yield row[j : j + 65536]
        yield tail

    total = len(head) + len(tail) + sum(len(row_texts[i % distinct]) + 1 for i in range(rows)) - 1
    assert total > 190e6
    tracemalloc.start()
    try:
        answer, array = parse_hidden_states_answer(body(), rows=rows, width=width)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < array.nbytes + 4 * 2**20, f"peak {peak / 2**20:.1f} MiB, array {array.nbytes / 2**20:.1f} MiB"
    assert answer["meta_info"] == {"id": "hsx-big", "prompt_tokens": rows, "hidden_states": None, "cached_tokens": 0}
    want = source.numpy()
    for i in range(0, rows, 97):
        assert_same_bits(array[i], want[i % distinct])
