"""Chat templates run in a process of their own (hsx.chat.process): its renders are the in-process ones, and
no template or conversation can hold its caller: whatever a template raises is that conversation's error, a
render that runs too long, is aborted or needs more memory than the child may hold ends at its bound with
the child killed, and the next request gets a fresh child."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hsx.chat.formats import ConversationError
from hsx.chat.process import RenderFailed, TemplateProcess
from hsx.chat.render import ChatTemplate, ChatTemplateError
from tests.support import chat

# Each test starts template processes and waits out time and memory bounds (35 s in all): --all runs them.
pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

TWO_TURNS = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "answer one"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "answer two"},
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("process-templates")
    return {
        name: chat.save_chat_tokenizer(root / name, template)
        for name, template in (
            ("llama3", chat.LLAMA3),
            ("boom", chat.RAISES_ON_BOOM),
            ("slow", chat.SLOW_ON_SLOW),
            ("grow", chat.EXPANDS_ON_GROW),
            ("repeat", chat.REPEATS_ON_REPEAT),
        )
    }


@pytest.fixture(scope="module")
def process():
    templates = TemplateProcess(timeout_s=20, max_mb=2048)
    yield templates
    templates.close()


def test_renders_equal_the_in_process_ones(process, folders):
    local = ChatTemplate.load(folders["llama3"])
    for loss in ("assistant", "last_assistant", "all"):
        ours, theirs = process.render(str(folders["llama3"]), TWO_TURNS, loss), local.render(TWO_TURNS, loss)
        assert ours.input_ids.tolist() == theirs.input_ids.tolist()
        assert ours.loss_mask.tolist() == theirs.loss_mask.tolist()
    limited = process.render(str(folders["llama3"]), TWO_TURNS, "assistant", limit=8)
    assert limited.loss_mask.tolist() == local.render(TWO_TURNS, "assistant", limit=8).loss_mask.tolist()
    assert limited.loss_mask.sum() < local.render(TWO_TURNS).loss_mask.sum(), "the limit reached the child"
    facts = process.facts(str(folders["llama3"]))
    assert (facts.stop_ids, facts.end_of_turn, facts.fingerprint) == (
        local.eos_ids,
        local.end_of_turn_ids,
        local.fingerprint,
    )
    ids = local.render(TWO_TURNS).input_ids.tolist()[:7]
    assert process.decode(str(folders["llama3"]), ids) == local.decode(ids)
    assert process.continuation(str(folders["llama3"]), TWO_TURNS[:3], generation_prompt=True) == local.continuation(
        TWO_TURNS[:3], generation_prompt=True
    )


def test_a_folder_without_a_tokenizer_is_a_template_error(process, tmp_path):
    with pytest.raises(ChatTemplateError, match="no such folder"):
        process.facts(str(tmp_path / "missing"))


def test_anything_a_template_raises_is_that_conversations_error(process, folders):
    boom = [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]
    with pytest.raises(ConversationError, match="ZeroDivisionError"):
        process.render(str(folders["boom"]), boom, "assistant")
    # The same template renders other conversations, and the process goes on serving.
    assert len(process.render(str(folders["boom"]), TWO_TURNS, "assistant").input_ids) > 0


def test_a_render_over_its_time_is_stopped_and_the_next_one_works(folders):
    templates = TemplateProcess(timeout_s=8, max_mb=2048)
    try:
        slow = [{"role": "user", "content": "slow"}, {"role": "assistant", "content": "x"}]
        templates.facts(str(folders["slow"]))  # started and loaded: the bound below is the render's alone
        started = time.monotonic()
        with pytest.raises(RenderFailed) as caught:
            templates.render(str(folders["slow"]), slow, "assistant")
        assert caught.value.code == "timeout" and "over 8 s" in caught.value.message
        assert time.monotonic() - started < 20  # the bound, and a busy machine's slack
        # The next render starts a new child and loads the template again, neither within its 8 s.
        assert len(templates.render(str(folders["slow"]), TWO_TURNS, "assistant").input_ids) > 0
    finally:
        templates.close()


def test_an_aborted_render_ends_within_a_second(folders):
    templates = TemplateProcess(timeout_s=600, max_mb=2048)
    try:
        templates.facts(str(folders["slow"]))  # loaded: what follows is the render alone
        slow = [{"role": "user", "content": "slow"}, {"role": "assistant", "content": "x"}]
        asked = time.monotonic() + 1.0
        started = time.monotonic()
        with pytest.raises(RenderFailed) as caught:
            templates.render(str(folders["slow"]), slow, "assistant", abort=lambda: time.monotonic() > asked)
        assert caught.value.code == "aborted"
        assert time.monotonic() - started < 5
    finally:
        templates.close()


def test_a_child_that_dies_mid_render_is_a_crash_and_is_started_again(folders):
    templates = TemplateProcess(timeout_s=60, max_mb=2048)
    try:
        templates.facts(str(folders["slow"]))
        child = templates._child
        assert child is not None
        threading.Timer(1.0, os.kill, (child.pid, signal.SIGKILL)).start()
        slow = [{"role": "user", "content": "slow"}, {"role": "assistant", "content": "x"}]
        with pytest.raises(RenderFailed) as caught:
            templates.render(str(folders["slow"]), slow, "assistant")
        assert caught.value.code == "crashed"
        assert len(templates.render(str(folders["slow"]), TWO_TURNS, "assistant").input_ids) > 0
    finally:
        templates.close()


def test_a_long_conversation_with_a_limit_comes_back_as_its_first_tokens(process, folders):
    local = ChatTemplate.load(folders["llama3"])
    long = [{"role": "user", "content": "hello there " * 20_000}, {"role": "assistant", "content": "answer one"}]
    whole = local.render(long)
    cut = process.render(str(folders["llama3"]), long, "assistant", limit=100)
    assert not cut.whole and 100 < len(cut.input_ids) < len(whole.input_ids) // 10
    assert cut.input_ids.tolist() == whole.input_ids[: len(cut.input_ids)].tolist()
    assert process.render(str(folders["llama3"]), TWO_TURNS, "assistant", limit=100).whole
    prompt = process.continuation(str(folders["llama3"]), long[:1], generation_prompt=True, limit=100)
    assert len(prompt) > 100 and prompt == local.continuation(long[:1], generation_prompt=True)[: len(prompt)]


BOUND_MB = 640  # a few hundred MB over what the child holds once started (about 260 MB)


class PeakWatch:
    """What the host gave the child while a render ran, in MiB, read every 20 ms: the most of its own
    memory (RssAnon, what the bound counts) and of its libraries' code mapped from their files (RssFile,
    which the kernel may drop and read again), and its peak resident memory as the kernel kept it (VmHWM)."""

    def __init__(self, pid: int):
        self.pid, self._stop = pid, threading.Event()
        self.peak = {"RssAnon": 0.0, "RssFile": 0.0, "VmHWM": 0.0}
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            for line in status.splitlines():
                key, _, value = line.partition(":")
                if key in self.peak and value.strip():
                    self.peak[key] = max(self.peak[key], int(value.split()[0]) / 1024)
            self._stop.wait(0.02)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.peak


@pytest.mark.parametrize(
    ("name", "said"),
    [("grow", "(MemoryError)"), ("repeat", "(memory allocation of ")],
    ids=["a template that expands its output", "a text whose tokens do not fit"],
)
def test_a_render_past_the_memory_bound_fails_and_the_next_one_works(folders, name, said):
    """A template that doubles its output without end fails in Python (MemoryError); a text that fits but
    whose tokens do not fails in the tokenizer's Rust, whose allocator aborts the child. Either way the render
    fails with the bound in its reason, the host gave the child no more than the bound (and its libraries'
    code), and the next render gets a fresh child."""
    templates = TemplateProcess(timeout_s=120, max_mb=BOUND_MB)
    try:
        templates.facts(str(folders[name]))
        child = templates._child
        assert child is not None
        watch = PeakWatch(child.pid)
        started = time.monotonic()
        with pytest.raises(RenderFailed) as caught:
            conversation = [{"role": "user", "content": name}, {"role": "assistant", "content": "x"}]
            templates.render(str(folders[name]), conversation, "assistant")
        assert time.monotonic() - started < 60
        peak = watch.stop()
        assert peak["RssAnon"] <= BOUND_MB and peak["VmHWM"] <= BOUND_MB + peak["RssFile"], peak
        assert caught.value.code == "memory", caught.value
        assert caught.value.message.startswith(f"rendering took more than the {BOUND_MB} MB the rendering process")
        assert said in caught.value.message
        assert child.poll() is not None, "the child that ran out is gone"
        assert len(templates.render(str(folders[name]), TWO_TURNS, "assistant").input_ids) > 0
        assert templates._child is not None and templates._child.pid != child.pid
    finally:
        templates.close()


def test_a_bound_below_what_the_child_needs_to_start_says_so(folders):
    templates = TemplateProcess(timeout_s=60, max_mb=64)
    try:
        with pytest.raises(RenderFailed) as caught:
            templates.facts(str(folders["llama3"]))
        assert caught.value.code == "memory"
        assert caught.value.message.startswith("starting the rendering process took more than the 64 MB")
        assert "MiB once its libraries are imported" in caught.value.message
    finally:
        templates.close()
