"""Chat templates run in a process of their own (hsx.chat.process): its renders are the in-process ones, and
no template or conversation can hold its caller: whatever a template raises is that conversation's error, a
render that runs too long or is aborted ends at its bound with the child killed, and the next request gets a
fresh child."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from hsx.chat.formats import ConversationError
from hsx.chat.process import RenderFailed, TemplateProcess
from hsx.chat.render import ChatTemplate, ChatTemplateError
from tests.support import chat

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
        for name, template in (("llama3", chat.LLAMA3), ("boom", chat.RAISES_ON_BOOM), ("slow", chat.SLOW_ON_SLOW))
    }


@pytest.fixture(scope="module")
def process():
    templates = TemplateProcess(timeout_s=20)
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
    templates = TemplateProcess(timeout_s=8)
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
    templates = TemplateProcess(timeout_s=600)
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
    templates = TemplateProcess(timeout_s=60)
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
