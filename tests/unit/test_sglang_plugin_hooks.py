"""The plugin's entry point and hooks, applied by the SGLang 0.5.23 wheel's own HookRegistry.

SGLang cannot be imported here (CUDA-only), but its hook registry is plain Python: it is loaded
from the wheel, and the modules it patches and the plugin reads are stand-ins at SGLang's module
paths, so `register()`, the AFTER hook on the processor's constructor and the AROUND hook on
process_batch_result_prefill run exactly as SGLang would call them.
"""

from __future__ import annotations

import json
import logging
import sys
import types
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hsx.backends.dumps import read_meta, validate
from hsx_sglang import plugin
from hsx_sglang.dumpdir import PLUGIN_INFO_FILE
from hsx_sglang.settings import ENV_BOOT_ID, ENV_DUMP_ROOT
from tests.support.sglang import standins
from tests.support.sglang.standins import GenerationBatchResult, LogitsProcessorOutput, Req, ScheduleBatch

HIDDEN = 8
MODEL = standins.ModelConfig(num_hidden_layers=32, hidden_size=HIDDEN, dtype=torch.bfloat16)


@dataclass
class FakeSGLang:
    registry: Any  # the wheel's HookRegistry
    processor_class: type
    features: standins.ExecFeatures
    parallel: standins.Parallel

    def written(self) -> None:
        """Wait until the plugin's writer thread has written everything queued."""
        (_, hook, _), *_ = self.registry._hooks[plugin.PREFILL_TARGET]
        capture = hook.__self__.capture
        assert capture is not None
        capture.writer.join()


def _package(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []
    return module


@pytest.fixture
def sglang(supported_wheel: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeSGLang]:
    with zipfile.ZipFile(supported_wheel) as wheel:
        registry_source = wheel.read("sglang/srt/plugins/hook_registry.py")
    registry_module = types.ModuleType("sglang.srt.plugins.hook_registry")
    exec(compile(registry_source, "sglang/srt/plugins/hook_registry.py", "exec"), registry_module.__dict__)

    # A fresh subclass per test: the registry patches the class it resolves.
    @dataclass(kw_only=True, slots=True, frozen=True)
    class SchedulerBatchResultProcessor(standins.SchedulerBatchResultProcessor):
        pass

    module_path, class_name = plugin.PROCESSOR_CLASS.rsplit(".", 1)
    processor_module = types.ModuleType(module_path)
    setattr(processor_module, class_name, SchedulerBatchResultProcessor)

    fake = FakeSGLang(
        registry_module.HookRegistry, SchedulerBatchResultProcessor, standins.ExecFeatures(), standins.Parallel()
    )
    runtime_context = types.ModuleType("sglang.srt.runtime_context")
    runtime_context.__dict__.update(
        get_exec=lambda: types.SimpleNamespace(features=fake.features), get_parallel=lambda: fake.parallel
    )

    for name in ("sglang", "sglang.srt", "sglang.srt.plugins", "sglang.srt.managers", module_path.rsplit(".", 1)[0]):
        monkeypatch.setitem(sys.modules, name, _package(name))
    monkeypatch.setitem(sys.modules, registry_module.__name__, registry_module)
    monkeypatch.setitem(sys.modules, module_path, processor_module)
    monkeypatch.setitem(sys.modules, runtime_context.__name__, runtime_context)
    monkeypatch.setenv(ENV_DUMP_ROOT, str(tmp_path / "sglang_hs"))
    monkeypatch.setenv(ENV_BOOT_ID, "boot-of-this-launch")
    yield fake
    owners = {getattr(hook, "__self__", None) for hooks in fake.registry._hooks.values() for _, hook, _ in hooks}
    for owner in owners:
        if isinstance(owner, plugin.SchedulerHooks) and owner.capture is not None:
            owner.capture.writer.close()
    fake.registry.reset()


def _load_plugins(fake: FakeSGLang) -> None:
    """What sglang.srt.plugins.load_plugins() does with this entry point."""
    plugin.register()
    fake.registry.apply_hooks()


def _batch() -> tuple[ScheduleBatch, GenerationBatchResult]:
    reqs = [
        Req("hsx-9-0-t1", list(range(10, 16))),
        Req("hsx-9-1-t1", list(range(20, 30)), inflight_middle_chunks=1),  # 4 of 10 tokens
        Req("HEALTH_CHECK_0a1b", [0]),
    ]
    lens = [6, 4, 1]
    aux = torch.randn(sum(lens), 3 * HIDDEN).bfloat16()
    last = torch.randn(sum(lens), HIDDEN).bfloat16()
    output = LogitsProcessorOutput(next_token_logits=torch.zeros(3, 16), hidden_states=aux, last_hidden_states=last)
    return ScheduleBatch(reqs=reqs), GenerationBatchResult(logits_output=output, extend_input_len_per_req=lens)


def test_the_hooks_dump_through_sglangs_registry(sglang: FakeSGLang, tmp_path: Path) -> None:
    sglang.features.aux_hidden_state_capture = "eagle3"
    _load_plugins(sglang)
    processor = sglang.processor_class(is_generation=True, model_config=MODEL)
    root = tmp_path / "sglang_hs"

    info = json.loads((root / PLUGIN_INFO_FILE).read_text())
    assert info["layers"] == [2, 16, 29, 32]
    assert info["name_by"] == "rid" and info["rid_prefix"] == "hsx-"
    assert info["boot_id"] == "boot-of-this-launch" and info["dump_root"] == str(root)

    batch, result = _batch()
    assert processor.process_batch_result_prefill(batch, result) is None
    # SGLang's processing ran: the middle chunk's counter went down, the finished request finished
    assert batch.reqs[1].inflight_middle_chunks == 0 and batch.reqs[0].finished()
    sglang.written()

    # read before the processing changed them: the finished request is dumped, the middle chunk is not
    assert {p.name for p in root.glob("req_*")} == {"req_hsx-9-0-t1"}
    d = root / "req_hsx-9-0-t1"
    meta = read_meta(d)
    validate(d, meta, expect_layers=[2, 16, 29, 32], expect_hidden=HIDDEN, expect_dtype="bfloat16")
    assert meta["boot_id"] == "boot-of-this-launch"


def test_explicit_aux_layer_ids_are_named_in_hf_numbering(sglang: FakeSGLang, tmp_path: Path) -> None:
    sglang.features.aux_hidden_state_capture = "eagle3"
    sglang.features.return_aux_hidden_state_layer_ids = [27, 0, 13]
    _load_plugins(sglang)
    sglang.processor_class(is_generation=True, model_config=MODEL)
    assert json.loads((tmp_path / "sglang_hs" / PLUGIN_INFO_FILE).read_text())["layers"] == [1, 14, 28, 32]


def test_without_aux_capture_the_plugin_stays_idle(
    sglang: FakeSGLang, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "sglang_hs"
    root.mkdir()
    (root / PLUGIN_INFO_FILE).write_text("{}")  # from an earlier launch
    _load_plugins(sglang)
    with caplog.at_level(logging.ERROR, logger="hsx_sglang"):
        processor = sglang.processor_class(is_generation=True, model_config=MODEL)
    assert "--enable-return-aux-hidden-states" in caplog.text
    assert not (root / PLUGIN_INFO_FILE).exists()

    batch, result = _batch()
    processor.process_batch_result_prefill(batch, result)
    assert batch.reqs[0].finished()
    assert list(root.iterdir()) == []


def test_other_ranks_neither_describe_nor_dump(sglang: FakeSGLang, tmp_path: Path) -> None:
    sglang.features.aux_hidden_state_capture = "eagle3"
    sglang.parallel.attn_tp_rank = 1
    _load_plugins(sglang)
    processor = sglang.processor_class(is_generation=True, model_config=MODEL)
    batch, result = _batch()
    processor.process_batch_result_prefill(batch, result)
    sglang.written()
    assert not (tmp_path / "sglang_hs").exists()


def test_without_a_dump_root_nothing_is_registered(
    sglang: FakeSGLang, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ENV_DUMP_ROOT)
    with caplog.at_level(logging.INFO, logger="hsx_sglang"):
        _load_plugins(sglang)
    assert "idle" in caplog.text
    assert dict(sglang.registry._hooks) == {}
