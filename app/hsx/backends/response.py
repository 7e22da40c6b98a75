"""One sample's hidden states from the server's answer itself: stock SGLang without the plugin.

The request asks for `return_hidden_states: true`; SGLang answers the prompt's rows as JSON
numbers in `meta_info.hidden_states[0]` (`[tokens][k * hidden]`: the three aux layers side by side
with aux capture, else layer L). The answer is parsed as it arrives, straight into one array
(hsx.backends.hidden_json), converted to the model's dtype (every number must be exactly a value of
that dtype, or the answer is refused), and staged as a dump directory like any other, so the rest of
the writer cannot tell where it came from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hsx.backends.capture import Capture
from hsx.backends.dumps import Dump, DumpRejected, ids_sha256, stage_dump
from hsx.backends.extract import Expectation, check_answer
from hsx.backends.hidden_json import HiddenStatesJSONError, parse_hidden_states_answer
from hsx.backends.sglang import SGLangClient, parse_answer
from hsx.identity import Identity


class ResponseExtractor:
    def __init__(self, client: SGLangClient, staging: Path, capture: Capture):
        if capture.layers is None or capture.hidden_size is None or capture.dtype is None:
            raise ValueError("a response capture needs its layers, hidden size and dtype")
        self.client = client
        self.staging = staging
        self.capture = capture
        self.layers: list[int] = capture.layers
        self.hidden_size: int = capture.hidden_size
        self.dtype: str = capture.dtype

    def extract(self, input_ids: list[int], *, rid: str, staged_name: str, expect: Expectation) -> Dump:
        """Run the request and return its rows, staged at `staging/staged_name` as a validated dump.

        Raises DumpRejected, or BackendUnavailable / BackendRejected from the client."""
        n, width = len(input_ids), len(self.layers) * self.hidden_size
        with self.client.generate_stream(input_ids, rid, "hidden_states") as chunks:
            try:
                answer, rows = parse_hidden_states_answer(chunks, rows=n, width=width)
            except HiddenStatesJSONError as exc:
                raise DumpRejected("bad_answer", str(exc)) from None
        check_answer(parse_answer(answer, rid), n)
        meta = {
            "num_tokens": n,
            "layers": self.layers,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "rid": rid,
            "cached_tokens": 0,
            "input_ids_sha256": ids_sha256(input_ids),
        }
        # The answer's `[tokens, layers * hidden]` rows as one exact block per layer.
        h = self.hidden_size
        blocks = [exact(rows[:, j * h : (j + 1) * h], self.dtype) for j in range(len(self.layers))]
        return stage_dump(
            self.staging / staged_name,
            meta,
            blocks,
            Identity.RESPONSE,
            expect_layers=expect.layers,
            expect_hidden=expect.hidden_size,
            expect_dtype=expect.dtype,
        )


def exact(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as a contiguous little-endian array of `dtype`'s bits; DumpRejected when a
    value is not exactly one of that dtype (then the numbers were not the model's own)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "float32":
        return values.astype("<f4", copy=False)
    if dtype == "bfloat16":
        bits = values.view(np.uint32)
        if np.any(bits & 0xFFFF):
            raise DumpRejected("not_exact", "the answer holds values that are not bfloat16 numbers")
        return (bits >> 16).astype("<u2")
    if dtype == "float16":
        half = values.astype("<f2")
        if not np.array_equal(half.astype(np.float32), values):
            raise DumpRejected("not_exact", "the answer holds values that are not float16 numbers")
        return half
    raise DumpRejected("wrong_dtype", f"cannot store {dtype}")
