"""render_many: the same renders, in the same order, in this process and in worker processes, a refused
conversation's error in its place."""

from __future__ import annotations

import itertools
import multiprocessing
import random

import pytest

from hsx.chat.formats import ConversationError
from hsx.chat.render import ChatTemplate, ChatTemplateError, render_many
from tests.support import chat

# Worker processes start with the tokenizer loaded (8 s in all): --all runs them.
pytestmark = pytest.mark.slow

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat.save_chat_tokenizer(tmp_path_factory.mktemp("chat") / "llama3", chat.LLAMA3)


def conversations(n: int) -> list[list[dict[str, str]]]:
    """n conversations of 1-3 exchanges; every 37th is an assistant turn alone, which is refused."""
    rng = random.Random(1)
    out = []
    for k in range(n):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns.append({"role": "user", "content": " ".join(rng.choices(chat.WORDS, k=rng.randint(1, 12)))})
            turns.append({"role": "assistant", "content": " ".join(rng.choices(chat.WORDS, k=rng.randint(1, 12)))})
        out.append(turns[1:2] if k % 37 == 5 else turns)
    return out


def as_comparable(result):
    if isinstance(result, ConversationError):
        return ("error", result.field, result.message)
    return (result.input_ids.tolist(), result.loss_mask.tolist(), result.text)


def test_worker_processes_give_what_one_process_gives_in_order(folder):
    items = conversations(300)
    template = ChatTemplate.load(folder)
    expected = []
    for messages in items:
        try:
            expected.append(as_comparable(template.render(messages, "last_assistant")))
        except ConversationError as exc:
            expected.append(as_comparable(exc))
    assert sum(e[0] == "error" for e in expected) == 8
    one = [as_comparable(r) for r in render_many(folder, iter(items), "last_assistant", workers=1)]
    two = [as_comparable(r) for r in render_many(folder, iter(items), "last_assistant", workers=2)]
    assert one == expected
    assert two == expected


def test_a_reader_that_stops_early_leaves_no_worker_behind(folder):
    before = set(multiprocessing.active_children())
    results = render_many(folder, itertools.repeat(conversations(1)[0]), workers=2)
    first = list(itertools.islice(results, 200))
    results.close()  # the endless input is read no further and the pool is shut down
    assert len(first) == 200 and all(r.input_ids.tolist() == first[0].input_ids.tolist() for r in first)
    assert set(multiprocessing.active_children()) == before


def test_a_bad_folder_fails_at_the_call_before_any_result(tmp_path):
    with pytest.raises(ChatTemplateError, match="no such folder"):
        render_many(tmp_path / "absent", [], workers=2)
    with pytest.raises(ValueError, match="unknown loss policy"):
        render_many(tmp_path / "absent", [], "some", workers=1)  # type: ignore[arg-type]
