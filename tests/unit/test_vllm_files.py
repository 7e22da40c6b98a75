"""What hsx takes from vLLM's hidden-states files (hsx.backends.engines.vllm), on real files: the token ids
prove the file is the sample's, the layers come out one tensor each, the file is read only once its
writer lets go of the lock, and a file named outside the dump root or for another request is refused."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from hsx.backends.dumps import DumpRejected, DumpRoot, validate, write_dump
from hsx.backends.engine import CaptureProblem, Server
from hsx.backends.engines.vllm import (
    VLLM_INFO_FILE,
    VLLM_INFO_FORMAT,
    VLLMEngine,
    lock_path,
    read_rows,
    read_vllm_info,
    shared_lock,
    vllm_capture,
)
from hsx.manifest import post_norm_layers
from hsx.storage.safetensors_raw import encode_header

IDS = [5, 17, 33, 2, 91]


def write_file(path: Path, ids: list[int], rows: np.ndarray) -> None:
    """A file as vLLM's connector writes it: hidden_states [tokens, layers, hidden] and token_ids."""
    hidden = np.ascontiguousarray(rows, dtype="<f4")
    token_ids = np.asarray(ids, dtype="<i8")
    header = encode_header([("hidden_states", "F32", hidden.shape), ("token_ids", "I64", token_ids.shape)], {})
    path.write_bytes(header + hidden.tobytes() + token_ids.tobytes())
    lock_path(path).touch()


def rows_for(n: int, layers: int = 3, hidden: int = 8) -> np.ndarray:
    return np.arange(n * layers * hidden, dtype=np.float32).reshape(n, layers, hidden)


def test_the_rows_are_read_only_for_the_samples_own_token_ids(tmp_path):
    path = tmp_path / "cmpl-hsx-a-0.safetensors"
    write_file(path, IDS, rows_for(len(IDS)))
    rows, dtype = read_rows(path, IDS, [2, 4, 8])
    assert dtype == "float32" and rows.shape == (5, 3, 8)
    with pytest.raises(DumpRejected) as other:
        read_rows(path, [*IDS[:-1], 92], [2, 4, 8])
    assert other.value.code == "not_ours"
    with pytest.raises(DumpRejected) as shape:
        read_rows(path, IDS, [2, 4])
    assert shape.value.code == "wrong_shape"


def test_each_layer_is_staged_as_its_own_tensor(tmp_path):
    rows = rows_for(len(IDS))
    meta = {"num_tokens": 5, "layers": [2, 4, 8], "hidden_size": 8, "dtype": "float32", "rid": "r", "cached_tokens": 0}
    write_dump(tmp_path / "staged", meta, [np.ascontiguousarray(rows[:, j, :]) for j in range(3)])
    dump = validate(tmp_path / "staged", meta, expect_layers=[2, 4, 8])
    for j, i in enumerate([2, 4, 8]):
        span = dump.layers[i]
        got = np.frombuffer(span.read() if hasattr(span, "read") else span, dtype="<f4").reshape(5, 8)
        assert np.array_equal(got, rows[:, j, :])


def test_the_file_is_read_once_its_writer_lets_go_of_the_lock(tmp_path):
    path = tmp_path / "cmpl-x-0.safetensors"
    with pytest.raises(DumpRejected) as absent, shared_lock(path, 0.05):
        pass
    assert absent.value.code == "dump_timeout"
    lock_path(path).touch()
    writer = os.open(lock_path(path), os.O_RDWR)
    fcntl.flock(writer, fcntl.LOCK_EX)
    started = time.monotonic()
    with pytest.raises(DumpRejected), shared_lock(path, 0.2):
        pass
    assert time.monotonic() - started >= 0.2
    os.close(writer)  # the writer is done
    with shared_lock(path, 0.2):
        pass


def test_a_file_named_outside_the_root_or_for_another_request_is_refused(tmp_path):
    server = Server("http://127.0.0.1:9", DumpRoot(tmp_path), tmp_path / "staging", dump_wait_s=0.1)
    engine = VLLMEngine(server, vllm_capture(info([2, 4, 8]), tmp_path), model="m")
    cases = {
        "outside_root": {"kv_transfer_params": {"hidden_states_path": "/etc/cmpl-hsx-a-0.safetensors"}},
        "not_ours": {"kv_transfer_params": {"hidden_states_path": str(tmp_path / "cmpl-hsx-b-0.safetensors")}},
        "no_dump": {"choices": []},
    }
    for code, answer in cases.items():
        with pytest.raises(DumpRejected) as exc:
            engine._named_file(answer, "hsx-a")
        assert exc.value.code == code
    assert engine._named_file(cases["not_ours"], "hsx-b").name == "cmpl-hsx-b-0.safetensors"


def info(layers: list[int]) -> dict[str, object]:
    return {
        "format": VLLM_INFO_FORMAT,
        "layers": layers,
        "num_hidden_layers": 8,
        "hidden_size": 256,
        "dtype": "float32",
        "model_path": "/nowhere",
        "boot_id": "b1",
    }


def test_the_connectors_file_describes_the_capture_and_the_final_layer_before_the_norm(tmp_path):
    with pytest.raises(CaptureProblem, match=VLLM_INFO_FILE):
        vllm_capture(read_vllm_info(tmp_path), tmp_path)
    (tmp_path / VLLM_INFO_FILE).write_text(json.dumps(info([8, 2, 4, 2])))
    capture = vllm_capture(read_vllm_info(tmp_path), tmp_path)
    assert capture.layers == [2, 4, 8] and capture.name_by is None
    assert capture.model["final_layer"] == "pre_norm" and capture.model["num_hidden_layers"] == 8
    engine = VLLMEngine(Server("http://127.0.0.1:9", DumpRoot(tmp_path), tmp_path / "staging"), capture, model="m")
    assert engine.source == "vllm" and engine.concurrent and not engine.regenerates
    assert post_norm_layers([2, 4, 8], 8, "pre_norm") == []
    assert post_norm_layers([2, 4, 8], 8, None) == [8]
