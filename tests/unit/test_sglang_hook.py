"""The plugin's hook logic with batches shaped like SGLang 0.5.23's, holding CPU tensors.

Dumps are read back with hsx's own reader (hsx.backends.dumps), as the service reads them.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hsx.backends.dumps import DumpRejected, identify, ids_sha256, read_meta, validate
from hsx.identity import Identity
from hsx_sglang.capture import PrefillCapture, start_capture
from hsx_sglang.dumpdir import PLUGIN_INFO_FILE, TEMP_PREFIX, HostDump
from hsx_sglang.layers import eagle3_layers
from hsx_sglang.settings import PluginSettings, SettingsError, settings_from_env
from tests.support.sglang.standins import GenerationBatchResult, LogitsProcessorOutput, Req, ScheduleBatch

NUM_LAYERS = 32
HIDDEN = 8
LAYERS = eagle3_layers(NUM_LAYERS)  # aux 2, 16, 29 and L = 32
BOOT_ID = "boot-test"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def prompt(n: int, first: int = 100) -> list[int]:
    return list(range(first, first + n))


def prefill(
    reqs: list[Req], lens: list[int], dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> tuple[ScheduleBatch, GenerationBatchResult]:
    """A batch and its result as SGLang hands them to process_batch_result_prefill with aux capture
    on: every request's extend rows one after the other, the aux layers side by side."""
    tokens = sum(lens)
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(tokens, len(LAYERS.aux) * HIDDEN, generator=g).to(dtype)
    last = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    output = LogitsProcessorOutput(
        next_token_logits=torch.zeros(len(reqs), 16), hidden_states=aux, last_hidden_states=last
    )
    return ScheduleBatch(reqs=reqs), GenerationBatchResult(logits_output=output, extend_input_len_per_req=list(lens))


def expected_rows(result: GenerationBatchResult, start: int, stop: int) -> dict[int, torch.Tensor]:
    output = result.logits_output
    assert output is not None and output.hidden_states is not None and output.last_hidden_states is not None
    rows = {
        layer: output.hidden_states[start:stop, k * HIDDEN : (k + 1) * HIDDEN] for k, layer in enumerate(LAYERS.aux)
    }
    rows[LAYERS.final] = output.last_hidden_states[start:stop]
    return rows


def read_dump(
    root: Path, rid: str, covered_ids: list[int], dtype: str = "bfloat16"
) -> tuple[dict, dict[int, torch.Tensor]]:
    """Read a dump as the service does: done, meta, identity, shapes and dtype; then its values."""
    d = root / f"req_{rid}"
    meta = read_meta(d)
    assert identify(d, meta, covered_ids, rid) in (Identity.IDS, Identity.RID)
    validate(d, meta, expect_layers=LAYERS.all, expect_hidden=HIDDEN, expect_dtype=dtype)
    tensors = load_file(str(d / "hidden_states.safetensors"))
    return meta, {int(name.removeprefix("layer_")): t for name, t in tensors.items()}


def settings(root: Path, max_pending: int = 2) -> PluginSettings:
    return PluginSettings(dump_root=root, rid_prefix="hsx-", max_pending=max_pending)


def started(root: Path, *, rank: int = 0, max_pending: int = 2) -> PrefillCapture:
    return start_capture(
        settings(root, max_pending),
        layers=LAYERS,
        boot_id=BOOT_ID,
        attn_tp_rank=rank,
        hidden_size=HIDDEN,
        dtype="bfloat16",
        sglang_version="0.5.23",
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "sglang_hs"


@pytest.fixture
def capture(root: Path) -> Iterator[PrefillCapture]:
    cap = started(root)
    yield cap
    cap.writer.close()


def dump_dirs(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.name != PLUGIN_INFO_FILE} if root.exists() else set()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_each_hsx_request_gets_its_own_rows_and_no_other_request_is_dumped(
    capture: PrefillCapture, root: Path, dtype: torch.dtype
) -> None:
    reqs = [
        Req("hsx-1-0-t1", prompt(5, 10)),
        Req("client-7", prompt(3, 20)),
        Req(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0]),
        Req("hsx-1-1-t1", prompt(7, 30)),
        Req(uuid.uuid4().hex, prompt(4, 40)),
        Req("hsx-2-0-t3", prompt(2, 50)),
    ]
    lens = [len(r.origin_input_ids) for r in reqs]
    batch, result = prefill(reqs, lens, dtype)

    assert capture.capture(batch, result, 0) == ["hsx-1-0-t1", "hsx-1-1-t1", "hsx-2-0-t3"]
    capture.writer.join()

    assert dump_dirs(root) == {"req_hsx-1-0-t1", "req_hsx-1-1-t1", "req_hsx-2-0-t3"}
    bounds = np.concatenate(([0], np.cumsum(lens))).tolist()
    for i in (0, 3, 5):
        req = reqs[i]
        meta, layers = read_dump(root, req.rid, req.origin_input_ids, DTYPE_NAMES[dtype])
        assert meta == {
            "num_tokens": lens[i],
            "layers": [2, 16, 29, 32],
            "hidden_size": HIDDEN,
            "dtype": DTYPE_NAMES[dtype],
            "rid": req.rid,
            "boot_id": BOOT_ID,
            "cached_tokens": 0,
            "input_ids_sha256": ids_sha256(req.origin_input_ids),
        }
        expected = expected_rows(result, bounds[i], bounds[i + 1])
        assert sorted(layers) == sorted(expected)
        for layer, values in expected.items():
            assert torch.equal(layers[layer], values), f"{req.rid} layer {layer}"


def test_a_chunked_request_is_refused(capture: PrefillCapture, root: Path, caplog: pytest.LogCaptureFixture) -> None:
    reqs = [
        Req("hsx-middle", prompt(10), inflight_middle_chunks=1),  # a middle chunk: 4 of its 10 tokens
        Req("hsx-last", prompt(10)),  # the last chunk: its final 3 tokens
        Req("hsx-whole", prompt(6)),
    ]
    batch, result = prefill(reqs, [4, 3, 6])
    with caplog.at_level(logging.WARNING, logger="hsx_sglang"):
        assert capture.capture(batch, result, 0) == ["hsx-whole"]
    capture.writer.join()

    assert dump_dirs(root) == {"req_hsx-whole"}
    _, layers = read_dump(root, "hsx-whole", prompt(6))
    assert torch.equal(layers[LAYERS.final], expected_rows(result, 7, 13)[LAYERS.final])
    refusals = {r.getMessage() for r in caplog.records}
    assert any("hsx-middle" in m and "middle chunk" in m for m in refusals)
    assert any("hsx-last" in m and "covers 3 of 10 prompt tokens" in m for m in refusals)


def test_cached_tokens_are_recorded_and_the_reader_rejects_the_partial_dump(
    capture: PrefillCapture, root: Path
) -> None:
    ids = prompt(9)
    batch, result = prefill([Req("hsx-cached", ids, cached_tokens=4)], [5])
    capture.capture(batch, result, 0)
    capture.writer.join()

    d = root / "req_hsx-cached"
    meta = read_meta(d)
    assert meta["cached_tokens"] == 4
    assert meta["num_tokens"] == 5
    assert meta["input_ids_sha256"] == ids_sha256(ids)  # the whole prompt's
    assert load_file(str(d / "input_ids.safetensors"))["input_ids"].tolist() == ids[4:]  # the rows' tokens
    with pytest.raises(DumpRejected) as rejected:
        validate(d, meta, expect_layers=LAYERS.all, expect_hidden=HIDDEN, expect_dtype="bfloat16")
    assert rejected.value.code == "cached_tokens"


def test_other_attention_tp_ranks_write_nothing(root: Path) -> None:
    cap = started(root, rank=1)
    try:
        batch, result = prefill([Req("hsx-a", prompt(3)), Req("hsx-b", prompt(2))], [3, 2])
        assert cap.capture(batch, result, 1) == []
        cap.writer.join()
        assert not root.exists()  # not even hsx-plugin.json
    finally:
        cap.writer.close()


def test_rank_zero_alone_dumps(capture: PrefillCapture, root: Path) -> None:
    batch, result = prefill([Req("hsx-a", prompt(3))], [3])
    assert capture.capture(batch, result, 2) == []
    capture.writer.join()
    assert dump_dirs(root) == set()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda result: setattr(result, "extend_input_len_per_req", None), "return_logprob"),
        (lambda result: setattr(result.logits_output, "last_hidden_states", None), "no aux or no last hidden states"),
        (lambda result: setattr(result.logits_output, "hidden_states", None), "no aux or no last hidden states"),
        (
            lambda result: setattr(result.logits_output, "hidden_states", result.logits_output.hidden_states[[2, 4]]),
            "not a full capture",
        ),
        (
            lambda result: setattr(result.logits_output, "hidden_states", result.logits_output.hidden_states[:, :8]),
            "expected 3 layers x 8",
        ),
    ],
)
def test_a_batch_without_the_rows_of_every_request_is_refused(
    capture: PrefillCapture,
    root: Path,
    caplog: pytest.LogCaptureFixture,
    change: Callable[[GenerationBatchResult], None],
    reason: str,
) -> None:
    batch, result = prefill([Req("hsx-a", prompt(3)), Req("hsx-b", prompt(2))], [3, 2])
    change(result)
    with caplog.at_level(logging.WARNING, logger="hsx_sglang"):
        assert capture.capture(batch, result, 0) == []
    capture.writer.join()
    assert dump_dirs(root) == set()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all(reason in m for m in messages), messages


def test_a_rid_that_cannot_name_a_directory_is_refused(capture: PrefillCapture, root: Path) -> None:
    batch, result = prefill([Req("hsx-../../escape", prompt(3)), Req("hsx-fine", prompt(2))], [3, 2])
    assert capture.capture(batch, result, 0) == ["hsx-fine"]
    capture.writer.join()
    assert dump_dirs(root) == {"req_hsx-fine"}
    assert not (root.parent / "escape").exists()


def test_a_rid_written_again_replaces_its_dump(capture: PrefillCapture, root: Path) -> None:
    for seed in (1, 2):
        batch, result = prefill([Req("hsx-again", prompt(4))], [4], seed=seed)
        capture.capture(batch, result, 0)
        capture.writer.join()
    assert dump_dirs(root) == {"req_hsx-again"}  # and no temporary directory left
    _, layers = read_dump(root, "hsx-again", prompt(4))
    assert torch.equal(layers[LAYERS.final], expected_rows(result, 0, 4)[LAYERS.final])


def test_start_describes_the_capture_and_clears_earlier_launches_temp_dirs(root: Path) -> None:
    (root / f"{TEMP_PREFIX}an-earlier-boot-1a2b3c4d").mkdir(parents=True)
    (root / f"{TEMP_PREFIX}{BOOT_ID}-5e6f7a8b").mkdir()  # another scheduler of this launch, writing
    cap = started(root)
    cap.writer.close()
    assert dump_dirs(root) == {f"{TEMP_PREFIX}{BOOT_ID}-5e6f7a8b"}
    assert json.loads((root / PLUGIN_INFO_FILE).read_text()) == {
        "format": "hsx-plugin/1",
        "plugin": "hsx-sglang",
        "plugin_version": "0.1.0",
        "sglang_version": "0.5.23",
        "protocol": 1,
        "dump_root": str(root),
        "name_by": "rid",
        "rid_prefix": "hsx-",
        "layers": [2, 16, 29, 32],
        "hidden_size": HIDDEN,
        "dtype": "bfloat16",
        "boot_id": BOOT_ID,
    }


def test_a_slow_disk_blocks_the_scheduler_instead_of_growing_memory(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    max_pending, batches = 2, 8
    cap = started(root, max_pending=max_pending)
    disk = threading.Event()
    real_write = cap.writer.dirs.write

    def slow_write(dump: HostDump) -> Path:
        assert disk.wait(30)
        return real_write(dump)

    monkeypatch.setattr(cap.writer.dirs, "write", slow_write)
    alive: list[weakref.ref[torch.Tensor]] = []
    submitted = 0

    def scheduler() -> None:
        nonlocal submitted
        for k in range(batches):
            batch, result = prefill([Req(f"hsx-{k}", prompt(64))], [64], seed=k)
            output = result.logits_output
            assert output is not None and output.hidden_states is not None and output.last_hidden_states is not None
            alive.extend((weakref.ref(output.hidden_states), weakref.ref(output.last_hidden_states)))
            del output
            cap.capture(batch, result, 0)
            submitted += 1
            del batch, result

    thread = threading.Thread(target=scheduler, daemon=True)
    thread.start()
    try:
        # One batch in the writer, max_pending in the queue; the next capture blocks.
        deadline = time.monotonic() + 10
        while cap.writer.pending() < max_pending and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert submitted == max_pending + 1
        assert thread.is_alive()
        assert cap.writer.pending() == max_pending
        gc.collect()
        live_batches = sum(ref() is not None for ref in alive) // 2
        assert live_batches == max_pending + 2  # in the writer, in the queue, and the one being put
    finally:
        disk.set()
    thread.join(30)
    assert not thread.is_alive() and submitted == batches
    cap.writer.join()
    cap.writer.close()
    assert dump_dirs(root) == {f"req_hsx-{k}" for k in range(batches)}
    gc.collect()
    assert all(ref() is None for ref in alive)  # the writer keeps nothing once written


def test_captured_layers_in_hf_numbering() -> None:
    assert eagle3_layers(32).all == [2, 16, 29, 32]
    assert eagle3_layers(32, [28, 1, 15]).aux == (2, 16, 29)  # ids +1, in layer order
    assert eagle3_layers(36, [1, 17, 32]).all == [2, 18, 33, 36]
    with pytest.raises(ValueError):
        eagle3_layers(32, [31])  # would be layer 32 before the final norm, not L


def test_settings_from_the_environment(tmp_path: Path) -> None:
    assert settings_from_env({}) is None
    assert settings_from_env({"HSX_DUMP_ROOT": " "}) is None
    assert settings_from_env({"HSX_DUMP_ROOT": str(tmp_path)}) == PluginSettings(tmp_path, "hsx-", 2)
    assert settings_from_env(
        {"HSX_DUMP_ROOT": str(tmp_path), "HSX_RID_PREFIX": "job7-", "HSX_DUMP_MAX_PENDING": "5"}
    ) == PluginSettings(tmp_path, "job7-", 5)
    for bad in ({"HSX_RID_PREFIX": ""}, {"HSX_RID_PREFIX": "a/b"}, {"HSX_DUMP_MAX_PENDING": "0"}):
        with pytest.raises(SettingsError):
            settings_from_env({"HSX_DUMP_ROOT": str(tmp_path), **bad})
