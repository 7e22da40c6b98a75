"""Hidden states in the answer itself: a stock SGLang without the plugin, started with
`--enable-return-hidden-states` (layer L) or `--enable-return-aux-hidden-states` (the three aux layers).

The request asks for `return_hidden_states: true`; SGLang answers the prompt's rows as JSON numbers in
`meta_info.hidden_states[0]` (`[tokens][k * hidden]`: the three aux layers side by side with aux capture,
else layer L). The answer is parsed as it arrives, straight into one array (hsx.backends.hidden_json),
converted to the model's dtype (every number must be exactly a value of that dtype, or the answer is
refused), and staged as a dump directory like any other, so the rest of the writer cannot tell where it
came from. The server does not say its layer count or hidden size: hsx reads them from config.json in
its model_path, which must be a checkpoint readable here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hsx.backends.dumps import Dump, DumpRejected, ids_sha256, stage_dump
from hsx.backends.engine import Capture, CaptureProblem, Expectation, Server
from hsx.backends.hidden_json import HiddenStatesJSONError, parse_hidden_states_answer
from hsx.backends.model import describe_model, read_model_config
from hsx.backends.sglang import Said, SGLangEngine, check_answer, parse_answer
from hsx.dtypes import HIDDEN_STATE_DTYPES, sglang_auto_dtype
from hsx.identity import Identity
from hsx.sources import Source


class AnswersEngine(SGLangEngine):
    source = Source.RESPONSE

    def __init__(self, server: Server, capture: Capture):
        if capture.layers is None or capture.hidden_size is None or capture.dtype is None:
            raise ValueError("hidden states in answers need their layers, hidden size and dtype")
        super().__init__(server, capture)
        self.layers: list[int] = capture.layers
        self.hidden_size: int = capture.hidden_size
        self.dtype: str = capture.dtype

    @classmethod
    def of(cls, server: Server, said: Said, *, auto: bool) -> AnswersEngine | None:
        """The engine for what the server says; with auto, None unless the server returns every prompt row
        and neither it nor the plugin describes dumps."""
        said.check_whole_prompts()
        if auto and (said.described_dumps is not None or said.plugin_info is not None or not said.returns_rows):
            return None
        return cls(server, _capture(said, server))

    def extract(self, input_ids: list[int], *, rid: str, staged_name: str, expect: Expectation) -> Dump:
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
            self.server.staging / staged_name,
            meta,
            blocks,
            Identity.RESPONSE,
            expect_layers=expect.layers,
            expect_hidden=expect.hidden_size,
            expect_dtype=expect.dtype,
        )


def _capture(said: Said, server: Server) -> Capture:
    server_info, model_info = said.server_info, said.model_info
    if not said.returns_rows:
        raise CaptureProblem(
            "the server does not return every prompt row's hidden states: restart it with "
            "--enable-return-hidden-states (layer L) or --enable-return-aux-hidden-states --speculative-algorithm "
            "EAGLE3 (the three aux layers), or install the hsx-sglang plugin"
        )
    model_path = server_info.get("model_path") or model_info.get("model_path")
    config = read_model_config(model_path) or {}
    num_layers = model_info.get("num_hidden_layers") or config.get("num_hidden_layers")
    hidden_size = model_info.get("hidden_size") or config.get("hidden_size")
    if not isinstance(num_layers, int) or not isinstance(hidden_size, int):
        raise CaptureProblem(
            f"cannot tell the model's hidden size and layer count: hsx reads them from config.json in the server's "
            f"model_path ({model_path!r}), which is not a checkpoint directory readable here"
        )
    if server_info.get("enable_return_aux_hidden_states"):
        ids = server_info.get("return_aux_hidden_state_layer_ids")
        layers = sorted({2, num_layers // 2, num_layers - 3} if ids is None else {int(i) + 1 for i in ids})
        layers_from = (
            "the server's answers (aux capture gives only the three aux layers; the plugin's dumps add layer L)"
        )
        hint = (
            f"its aux capture is on, but no hsx-sglang plugin described its dumps in {server.root.path}: the plugin "
            "did not load (SGLANG_PLUGINS must name it exactly, hsx_dump; SGLang's log says 'hsx-sglang: active' "
            "when it loads) or its HSX_DUMP_ROOT is not this writer's --dump-root; without it the answers hold "
            "only the three aux layers, not layer L"
        )
    else:
        layers = [num_layers]
        layers_from = "the server's answers (without aux capture only layer L, after the final norm)"
        hint = (
            "it returns layer L only (--enable-return-hidden-states): EAGLE-3's aux layers need "
            "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 and the hsx-sglang plugin"
        )
    return Capture(
        layers=layers,
        model=describe_model(model_info, server_info),
        layers_from=layers_from,
        hidden_size=hidden_size,
        dtype=_model_dtype(server_info, config),
        identity=Identity.RESPONSE,
        hint=hint,
        applies_seed=said.applies_seed,
    )


def _model_dtype(server_info: dict[str, Any], config: dict[str, Any]) -> str:
    """The dtype of the server's hidden states: its --dtype, or with auto what SGLang makes of the
    checkpoint's (sglang_auto_dtype)."""
    dtype = server_info.get("dtype")
    if dtype in (None, "auto"):
        dtype = sglang_auto_dtype(config)
    dtype = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
    if dtype not in HIDDEN_STATE_DTYPES:
        raise CaptureProblem(f"the model's dtype {dtype!r} is not one of {', '.join(HIDDEN_STATE_DTYPES)}")
    return dtype


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
