"""What the regeneration client sends (SGLang's names) and how it builds the sample from the ids the server
generated, against answers made here (a server that stops or runs to max_new_tokens on demand, or answers
wrongly); tests/acceptance/test_chat_regenerate.py runs it against the reference server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hsx.chat import ChatTemplate, RegenerationError, Sampling, TemplateRenderer, regenerate
from hsx.chat.regenerate import GenerationUnavailable, cut_at_stop
from tests.support import chat

pytest.importorskip("transformers")

MESSAGES = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "answer one"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "answer two"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat.save_chat_tokenizer(tmp_path_factory.mktemp("chat") / "llama3", chat.LLAMA3)


@pytest.fixture(scope="module")
def template(folder):
    return ChatTemplate.load(folder)


def run_against(answer, template, sampling=None, loss="assistant", messages=MESSAGES, limit=None):
    """regenerate() against a server that answers every /generate with `answer(body)`; the bodies it got."""
    bodies = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return answer(bodies[-1])

    async def go():
        async with httpx.AsyncClient(base_url="http://server", transport=httpx.MockTransport(handle)) as client:
            renderer = TemplateRenderer(template)
            return await regenerate(client, renderer, messages, sampling or Sampling(max_new_tokens=8), loss, limit)

    return asyncio.run(go()), bodies


def answering(*outputs):
    answers = iter(outputs)
    return lambda body: httpx.Response(200, json={"text": "", "output_ids": next(answers), "meta_info": {}})


def test_the_sample_holds_the_generated_ids_between_the_templates_pieces(template, folder):
    eot = template.end_of_turn_ids[0]
    new, bodies = run_against(
        answering([65, 66, eot, 67], [68, 69, eot]),
        template,
        Sampling(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=11),
    )
    reference = chat.reference_tokenizer(folder)
    first_prompt = chat.apply_chat_template_ids(reference, MESSAGES[:1], add_generation_prompt=True)
    params = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "stop_token_ids": template.eos_ids}
    assert bodies[0] == {"input_ids": first_prompt, "sampling_params": {**params, "sampling_seed": 11}}
    # The second prompt is the first, the ids generated (cut after the end-of-turn id, as SGLang stops), and
    # the template's text between the turns: never the first answer's text encoded again.
    between = template.continuation([*MESSAGES[:1], new.messages[1], MESSAGES[2]], generation_prompt=True)
    assert bodies[1]["input_ids"] == first_prompt + [65, 66, eot] + between
    assert new.input_ids.tolist() == bodies[1]["input_ids"] + [68, 69, eot]
    mask = [0] * len(first_prompt) + [1, 1, 1] + [0] * len(between) + [1, 1, 1]
    assert new.loss_mask.tolist() == mask
    assert new.messages[1] == {"role": "assistant", "content": template.decode([65, 66]), "finish": "stop"}
    assert new.messages[3]["finish"] == "stop" and [m["role"] for m in new.messages] == [m["role"] for m in MESSAGES]
    assert "sampling_seed" not in Sampling(max_new_tokens=1).params([])


def test_a_turn_cut_at_max_new_tokens_is_closed_by_the_template_outside_the_loss(template):
    eot = template.end_of_turn_ids[0]
    new, bodies = run_against(answering([70, 71], [72, eot]), template, Sampling(max_new_tokens=2))
    first = len(bodies[0]["input_ids"])
    assert bodies[1]["input_ids"][first : first + 3] == [70, 71, eot]
    assert new.loss_mask.tolist()[first : first + 3] == [1, 1, 0]
    assert [new.messages[1]["finish"], new.messages[3]["finish"]] == ["length", "stop"]


def test_loss_policies_mark_the_last_turn_only_or_everything(template):
    eot = template.end_of_turn_ids[0]
    last, bodies = run_against(answering([65, eot], [66, eot]), template, loss="last_assistant")
    second = len(bodies[1]["input_ids"])
    assert last.loss_mask.tolist() == [0] * second + [1, 1]
    everything, _ = run_against(answering([65, eot], [66, eot]), template, loss="all")
    assert everything.loss_mask.all()


def test_generation_stops_once_the_sample_is_over_the_limit(template):
    eot = template.end_of_turn_ids[0]
    prompt = len(template.continuation(MESSAGES[:1], generation_prompt=True))
    new, bodies = run_against(answering([65, 66, 67, 68]), template, limit=prompt + 2)
    assert len(bodies) == 1, "the second turn is not generated: the sample is cut before it"
    assert bodies[0]["sampling_params"]["max_new_tokens"] == 3, "no more than the limit needs"
    assert [m["role"] for m in new.messages] == ["user", "assistant"]
    assert len(new.input_ids) > prompt + 2 and eot in new.input_ids.tolist()


@pytest.mark.parametrize(
    "response, message",
    [
        (httpx.Response(200, json={"text": "hi"}), "without a list of output_ids"),
        (httpx.Response(200, json={"output_ids": [1, "2"]}), "without a list of output_ids"),
        (httpx.Response(200, json=[{"output_ids": [1]}]), "without a list of output_ids"),
        (httpx.Response(200, text="<html>"), "a body that is not JSON"),
        (httpx.Response(400, json={"error": {"message": "bad"}}), "/generate answered 400: .*bad"),
    ],
)
def test_an_answer_without_generated_ids_is_a_regeneration_error(template, response, message):
    with pytest.raises(RegenerationError, match=message):
        run_against(lambda body: response, template)


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_server_not_ready_is_unavailable_not_the_conversations_error(template, status):
    """As for a sample's request (hsx.backends.http): the preparer gives the conversation back unspent."""
    with pytest.raises(GenerationUnavailable, match=f"POST /generate: HTTP {status}"):
        run_against(lambda body: httpx.Response(status, json={"error": {"message": "busy"}}), template)


def test_a_server_that_cannot_be_reached_is_unavailable(template):
    def refuse(body):
        raise httpx.ConnectError("connection refused")

    with pytest.raises(GenerationUnavailable, match="POST /generate: ConnectError: connection refused"):
        run_against(refuse, template)


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 7], [9]) == [5, 6, 7]
    assert cut_at_stop([5, 9, 7, 9], [9, 8]) == [5, 9]
    assert cut_at_stop([], [9]) == []
