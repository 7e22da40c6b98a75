"""Which engine takes an SGLang-style server, and what it makes of what the server says (hsx.backends.sglang
and its two engines, hsx.backends.engines.sglang_dumps and .sglang_answers), and the exact conversion of
answered numbers to the model's dtype (sglang_answers.exact)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx import backends
from hsx.backends.dumps import DumpRejected, DumpRoot
from hsx.backends.engine import CaptureProblem, Engine, Server
from hsx.backends.engines.sglang_answers import AnswersEngine, exact
from hsx.backends.engines.sglang_dumps import DumpsEngine
from hsx.backends.model import describe_model
from hsx.backends.sglang import Said, SGLangEngine, read_plugin_info
from hsx.sources import AUTO, Source

STOCK = {
    "version": "0.5.23",
    "dtype": "auto",
    "disable_radix_cache": False,
    "chunked_prefill_size": -1,
    "enable_return_hidden_states": False,
    "return_hidden_states_mode": None,
    "enable_return_aux_hidden_states": False,
    "return_aux_hidden_state_layer_ids": None,
}
AUX = {"enable_return_aux_hidden_states": True, "return_hidden_states_mode": "full"}
PLUGIN = {"format": "hsx-plugin/1", "name_by": "rid", "rid_prefix": "run7-", "layers": [2, 16, 29, 32], "boot_id": "b"}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"num_hidden_layers": 32, "hidden_size": 4096, "torch_dtype": "bfloat16"})
    )
    return d


def stock(model_dir: Path, **changes) -> dict:
    return {**STOCK, "model_path": str(model_dir), **changes}


def decide(choice: str, name_by: str, server_info: dict, model_info: dict, *, plugin_info, dump_root: Path) -> Engine:
    """The engine hsx takes for what the server says: the one chosen, or with auto the first SGLang engine in
    the registry's order that takes the server (what hsx.backends.discover does, without the HTTP reads)."""
    server = Server("http://127.0.0.1:9", DumpRoot(dump_root), dump_root / "staging", name_by=name_by)
    said = Said(model_info, server_info, plugin_info)
    chosen = AUTO if choice == AUTO else Source(choice)
    for cls in backends.engines_for(chosen):
        if issubclass(cls, SGLangEngine) and (engine := cls.of(server, said, auto=chosen == AUTO)) is not None:
            return engine
    raise AssertionError("no SGLang engine took the server")


def test_a_server_that_describes_its_dumps_is_read_as_it_says(tmp_path):
    info = {"hs_dump": {"name_by": "rid", "layers": [2, 4, 5, 8], "boot_id": "x"}, "disable_radix_cache": True}
    engine = decide("auto", "auto", info, {}, plugin_info=None, dump_root=tmp_path)
    capture = engine.capture
    assert (engine.source, capture.name_by, capture.layers, capture.boot_id) == ("dumps", "rid", [2, 4, 5, 8], "x")
    assert isinstance(engine, DumpsEngine) and not engine.plugin and capture.rid_prefix == "hsx-"


def test_a_server_that_says_nothing_is_a_patched_one_naming_by_counter(tmp_path):
    engine = decide("auto", "auto", {}, {}, plugin_info=None, dump_root=tmp_path)
    assert (engine.source, engine.capture.name_by, engine.capture.layers) == ("dumps", "counter", None)
    assert not engine.concurrent and engine.regenerates


def test_the_plugin_description_wins_over_the_answers(tmp_path, model_dir):
    engine = decide("auto", "auto", stock(model_dir, **AUX), {}, plugin_info=PLUGIN, dump_root=tmp_path)
    capture = engine.capture
    assert (engine.source, capture.name_by, capture.layers) == ("dumps", "rid", [2, 16, 29, 32])
    assert isinstance(engine, DumpsEngine) and engine.plugin, "its requests ask for logprobs (the plugin's row counts)"
    assert capture.rid_prefix == "run7-" and engine.concurrent


def test_a_plugin_description_beside_a_server_without_aux_capture_is_refused(tmp_path, model_dir):
    with pytest.raises(CaptureProblem, match="--enable-return-aux-hidden-states"):
        decide(
            "auto",
            "auto",
            stock(model_dir, enable_return_hidden_states=True),
            {},
            plugin_info=PLUGIN,
            dump_root=tmp_path,
        )


def test_answers_give_the_aux_layers_or_the_last_one(tmp_path, model_dir):
    engine = decide("auto", "auto", stock(model_dir, **AUX), {}, plugin_info=None, dump_root=tmp_path)
    aux = engine.capture
    assert (engine.source, aux.layers, aux.hidden_size, aux.dtype) == ("response", [2, 16, 29], 4096, "bfloat16")
    assert isinstance(engine, AnswersEngine) and engine.concurrent and aux.name_by is None
    explicit = decide(
        "auto",
        "auto",
        stock(model_dir, **AUX, return_aux_hidden_state_layer_ids=[1, 15, 28]),
        {},
        plugin_info=None,
        dump_root=tmp_path,
    ).capture
    assert explicit.layers == [2, 16, 29], "SGLang's ids name the layer whose input is taken: HF layer id + 1"
    last = decide(
        "auto",
        "auto",
        stock(model_dir, enable_return_hidden_states=True, dtype="float16"),
        {},
        plugin_info=None,
        dump_root=tmp_path,
    ).capture
    assert (last.layers, last.dtype) == ([32], "float16")


@pytest.mark.parametrize(
    ("config", "runs_in"),
    [
        ({"torch_dtype": "bfloat16"}, "bfloat16"),
        ({"dtype": "float16"}, "float16"),
        ({"torch_dtype": "float32"}, "float16"),
        ({}, "float16"),
        ({"torch_dtype": "float32", "model_type": "gemma2"}, "bfloat16"),
    ],
)
def test_dtype_auto_is_what_sglang_runs_the_checkpoint_in(tmp_path, config, runs_in):
    """SGLang downcasts a float32 checkpoint under --dtype auto: recording float32 would mislabel float16 values."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8, **config}))
    capture = decide(
        "auto",
        "auto",
        stock(d, enable_return_hidden_states=True, dtype="auto"),
        {},
        plugin_info=None,
        dump_root=tmp_path,
    ).capture
    assert capture.dtype == runs_in


def test_answers_need_every_row_and_a_readable_config(tmp_path, model_dir):
    with pytest.raises(CaptureProblem, match="does not return every prompt row"):
        decide(
            "response",
            "auto",
            stock(model_dir, return_hidden_states_mode="last"),
            {},
            plugin_info=None,
            dump_root=tmp_path,
        )
    with pytest.raises(CaptureProblem, match=r"config\.json"):
        decide("auto", "auto", stock(tmp_path / "elsewhere", **AUX), {}, plugin_info=None, dump_root=tmp_path)


def test_chunked_prefill_is_refused_whatever_the_source(tmp_path, model_dir):
    for source in ("auto", "dumps", "response"):
        with pytest.raises(CaptureProblem, match="--chunked-prefill-size -1"):
            decide(
                source,
                "auto",
                stock(model_dir, **AUX, chunked_prefill_size=8192),
                {},
                plugin_info=None,
                dump_root=tmp_path,
            )


def test_an_unreadable_plugin_description_is_a_problem_not_a_guess(tmp_path):
    assert read_plugin_info(tmp_path) is None
    (tmp_path / "hsx-plugin.json").write_text("{not json")
    with pytest.raises(CaptureProblem, match="unreadable"):
        read_plugin_info(tmp_path)
    (tmp_path / "hsx-plugin.json").write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(CaptureProblem, match="hsx-plugin/1"):
        read_plugin_info(tmp_path)


def test_the_model_is_described_by_the_server_then_its_config(tmp_path):
    d = tmp_path / "gemma"
    d.mkdir()
    # A multimodal checkpoint keeps the language model's numbers in text_config.
    text = {"model_type": "gemma3_text", "num_hidden_layers": 34, "hidden_size": 2560, "rms_norm_eps": 1e-6}
    (d / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text, "vocab_size": 262208}))
    stock_info = {"model_path": str(d), "model_type": "gemma3"}  # stock SGLang's /get_model_info
    assert describe_model(stock_info, {}) == {
        "model_path": str(d),
        "model_type": "gemma3",
        "num_hidden_layers": 34,
        "hidden_size": 2560,
        "rms_norm_eps": 1e-6,
        "vocab_size": 262208,
    }
    # a model_path not readable here: what the server says, the rest unknown
    remote = {"model_path": "org/Model-8B", "num_hidden_layers": 32, "vocab_size": 128256}
    assert describe_model(remote, {"model_path": "org/Model-8B"}) == {
        "model_path": "org/Model-8B",
        "model_type": None,
        "num_hidden_layers": 32,
        "hidden_size": None,
        "rms_norm_eps": None,
        "vocab_size": 128256,
    }


def test_answered_numbers_convert_exactly_or_not_at_all():
    values = torch.randn(5, 8).bfloat16()
    as_float = values.float().numpy()
    assert exact(as_float, "bfloat16").tobytes() == values.view(torch.int16).numpy().tobytes()
    halves = torch.randn(5, 8).half()
    assert exact(halves.float().numpy(), "float16").tobytes() == halves.numpy().tobytes()
    assert exact(as_float, "float32").tobytes() == as_float.tobytes()
    off = as_float.copy()
    off[2, 3] = np.nextafter(off[2, 3], np.float32(np.inf))
    for dtype in ("bfloat16", "float16"):
        with pytest.raises(DumpRejected, match="not_exact"):
            exact(off, dtype)
