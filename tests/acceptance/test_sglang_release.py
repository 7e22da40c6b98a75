"""The plugin against the SGLang release it supports, read from the release's wheel (never imported).

A release that moves or changes a name the plugin relies on fails here with that name; what is
checked is listed in release_check.py and deploy/sglang/README.md.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from tests.support.sglang import release_check
from tests.support.sglang.wheels import sglang_wheel


def test_the_supported_release_has_everything_the_plugin_relies_on(supported_wheel: Path) -> None:
    problems = release_check.problems(supported_wheel)
    assert problems == [], "SGLang 0.5.23 does not fit the plugin:\n" + "\n".join(problems)


def test_the_launch_command_checked_is_the_readmes() -> None:
    flags = release_check.readme_launch_flags()
    assert {
        "--model-path",
        "--enable-return-aux-hidden-states",
        "--speculative-algorithm",
        "--return-aux-hidden-state-layer-ids",
        "--chunked-prefill-size",
        "--disable-radix-cache",
        "--disable-prefill-cuda-graph",
        "--skip-server-warmup",
        "--skip-tokenizer-init",
    } <= set(flags)


def test_a_release_that_moves_a_name_fails_with_that_name(supported_wheel: Path, tmp_path: Path) -> None:
    moved = _rewrite_wheel(
        supported_wheel,
        tmp_path / "sglang-moved.whl",
        {
            "sglang/srt/layers/logits_processor.py": ("last_hidden_states", "final_hidden_states"),
            "sglang/srt/managers/schedule_batch.py": ("inflight_middle_chunks", "chunks_in_flight"),
            "sglang/srt/arg_groups/fields/serving.py": ("skip_server_warmup", "no_server_warmup"),
            "sglang/srt/managers/io_struct.py": ("extra_key", "cache_namespace"),
            "sglang/srt/managers/tokenizer_manager.py": ("Duplicate request ID detected", "Request ID reused"),
            "sglang/srt/managers/scheduler_components/batch_result_processor.py": (
                "def process_batch_result_prefill(",
                "def process_prefill_batch_result(",
            ),
        },
    )
    problems = release_check.problems(moved)
    for name in (
        "sglang.srt.layers.logits_processor.LogitsProcessorOutput.last_hidden_states: missing",
        "sglang.srt.managers.schedule_batch.Req.inflight_middle_chunks: missing",
        "sglang.launch_server --skip-server-warmup: no such flag",
        f"{release_check.plugin.PREFILL_TARGET}: missing",
        "sglang.srt.managers.io_struct.GenerateReqInput.extra_key: missing",
        "sglang.srt.managers.tokenizer_manager: a rid in flight is no longer refused",
    ):
        assert name in problems


def test_the_older_release_0_5_14_does_not_fit() -> None:
    """0.5.14 has the plugin mechanism and the hook target, but no aux capture to dump."""
    problems = release_check.problems(sglang_wheel("0.5.14"))
    assert "sglang.launch_server --enable-return-aux-hidden-states: no such flag" in problems
    assert "sglang.srt.layers.logits_processor.LogitsProcessorOutput.last_hidden_states: missing" in problems
    assert not [p for p in problems if p.startswith(release_check.plugin.PROCESSOR_CLASS)]
    assert not [p for p in problems if p.startswith("sglang.srt.plugins")]


def _rewrite_wheel(source: Path, target: Path, edits: dict[str, tuple[str, str]]) -> Path:
    """A copy of the wheel with a textual replacement in some files (every occurrence)."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            data = old.read(info)
            if info.filename in edits:
                before, after = edits[info.filename]
                assert before.encode() in data, f"{info.filename} has no {before!r}"
                data = data.replace(before.encode(), after.encode())
            new.writestr(info.filename, data)
    return target
