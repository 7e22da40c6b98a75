"""What the regeneration client sends (SGLang's names) and what it makes of answers a real server gives
only when something is wrong; tests/acceptance/test_chat_regenerate.py runs it against the reference server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hsx.chat import ChatTemplate, RegenerationError, Sampling, regenerate
from hsx.chat.regenerate import cut_at_stop
from tests.support import chat

pytest.importorskip("transformers")

MESSAGES = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "answer one"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "answer two"},
]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return ChatTemplate.load(chat.save_chat_tokenizer(tmp_path_factory.mktemp("chat") / "llama3", chat.LLAMA3))


def run_against(answer, template, sampling=None):
    """regenerate() against a server that answers every /generate with `answer(body)`; the bodies it got."""
    bodies = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return answer(bodies[-1])

    async def go():
        async with httpx.AsyncClient(base_url="http://server", transport=httpx.MockTransport(handle)) as client:
            return await regenerate(client, template, MESSAGES, sampling or Sampling(max_new_tokens=8))

    return asyncio.run(go()), bodies


def test_the_request_carries_the_prompt_and_sglangs_sampling_names(template):
    eot = template.eos_ids[0]
    answers = iter([[65, 66, eot, 67], [68, 69]])
    (new, generated), bodies = run_against(
        lambda body: httpx.Response(200, json={"text": "", "output_ids": next(answers), "meta_info": {}}),
        template,
        Sampling(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=11),
    )
    assert generated == [[65, 66, eot], [68, 69]], "cut after the first end-of-turn id, as SGLang stops"
    assert new[1]["content"] == template.decode([65, 66]) and new[3]["content"] == template.decode([68, 69])
    params = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "stop_token_ids": template.eos_ids}
    assert bodies[0] == {
        "input_ids": template.render_prompt(MESSAGES[:1]),
        "sampling_params": {**params, "sampling_seed": 11},
    }
    assert bodies[1]["input_ids"] == template.render_prompt([MESSAGES[0], new[1], MESSAGES[2]])
    assert "sampling_seed" not in Sampling(max_new_tokens=1).params([])


@pytest.mark.parametrize(
    "response, message",
    [
        (httpx.Response(200, json={"text": "hi"}), "without a list of output_ids"),
        (httpx.Response(200, json={"output_ids": [1, "2"]}), "without a list of output_ids"),
        (httpx.Response(200, json=[{"output_ids": [1]}]), "without a list of output_ids"),
        (httpx.Response(200, text="<html>"), "a body that is not JSON"),
        (httpx.Response(503, json={"error": {"message": "busy"}}), "/generate answered 503: .*busy"),
    ],
)
def test_an_answer_without_generated_ids_is_a_regeneration_error(template, response, message):
    with pytest.raises(RegenerationError, match=message):
        run_against(lambda body: response, template)


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 7], [9]) == [5, 6, 7]
    assert cut_at_stop([5, 9, 7, 9], [9, 8]) == [5, 9]
    assert cut_at_stop([], [9]) == []
