"""Chat samples read from OpenAI's `messages` and ShareGPT's `conversations`, and every way one can be wrong."""

from __future__ import annotations

import pickle

import pytest

from hsx.chat.formats import SHAREGPT_ROLES, ConversationError, conversation_of


def test_openai_messages_are_read_as_they_are_and_extra_keys_are_dropped():
    obj = {
        "id": "s1",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello", "name": "ann"},
            {"role": "assistant", "content": "answer one"},
        ],
    }
    assert conversation_of(obj) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "answer one"},
    ]


def test_sharegpt_speakers_become_roles():
    speakers = list(SHAREGPT_ROLES)
    obj = {"conversations": [{"from": s, "value": f"said by {s}"} for s in speakers]}
    got = conversation_of(obj)
    assert got == [{"role": SHAREGPT_ROLES[s], "content": f"said by {s}"} for s in speakers]
    assert {m["role"] for m in got} == {"system", "user", "assistant"}


def test_sharegpt_takes_role_and_content_keys_and_any_case():
    obj = {
        "conversations": [
            {"role": "user", "content": "hello"},
            {"from": "GPT", "value": "answer one"},
            {"from": "Human", "value": "again"},
        ]
    }
    assert conversation_of(obj) == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "again"},
    ]


def test_a_sample_without_a_conversation_is_none():
    assert conversation_of({"id": "s1", "input_ids": [1, 2, 3]}) is None


def test_a_conversation_without_an_assistant_turn_is_read():
    assert conversation_of({"messages": [{"role": "user", "content": "hello"}]}) == [
        {"role": "user", "content": "hello"}
    ]


@pytest.mark.parametrize(
    "obj, field, message",
    [
        ({"messages": "hello"}, "messages", "must be a list of messages, got a string"),
        ({"messages": {"role": "user"}}, "messages", "must be a list of messages, got an object"),
        ({"conversations": None}, "conversations", "must be a list of messages, got null"),
        ({"messages": []}, "messages", "is empty; a conversation holds at least one message"),
        ({"conversations": []}, "conversations", "is empty; a conversation holds at least one message"),
        ({"messages": [{"role": "user", "content": "a"}, 7]}, "messages[1]", "must be an object, got a number"),
        ({"conversations": [["human", "hi"]]}, "conversations[0]", "must be an object, got a list"),
        (
            {"messages": [{"role": "robot", "content": "a"}]},
            "messages[0].role",
            "'robot' is not a role; expected one of system, user, assistant",
        ),
        ({"messages": [{"role": "tool", "content": "a"}]}, "messages[0].role", "'tool' is not a role"),
        ({"messages": [{"role": 1, "content": "a"}]}, "messages[0].role", "must be a string, got a number"),
        ({"messages": [{"content": "a"}]}, "messages[0].role", "is missing"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "is missing"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", "must be a string, got null"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
            "messages[0].content",
            "must be a string, got a list",
        ),
        ({"messages": [{"role": "user", "content": True}]}, "messages[0].content", "must be a string, got a boolean"),
        (
            {"conversations": [{"from": "human", "value": "a"}, {"from": "alien", "value": "b"}]},
            "conversations[1].from",
            "'alien' is not a speaker; expected one of system, human, user, gpt",
        ),
        ({"conversations": [{"role": "robot", "content": "b"}]}, "conversations[0].role", "'robot' is not a speaker"),
        (
            {"conversations": [{"speaker": "human", "text": "a"}]},
            "conversations[0]",
            'needs "from" and "value" (or "role" and "content")',
        ),
        ({"conversations": [{"from": "gpt"}]}, "conversations[0].value", "is missing"),
        ({"conversations": [{"from": "gpt", "value": 3}]}, "conversations[0].value", "must be a string, got a number"),
        (
            {"messages": [{"role": "user", "content": "a"}], "conversations": [{"from": "human", "value": "a"}]},
            "messages",
            "a sample holds either messages or conversations, not both",
        ),
    ],
)
def test_every_malformed_conversation_names_its_field(obj, field, message):
    with pytest.raises(ConversationError) as caught:
        conversation_of(obj)
    assert caught.value.field == field
    assert message in caught.value.message
    assert str(caught.value) == f"{field}: {caught.value.message}"


def test_a_conversation_error_survives_pickling_as_worker_processes_send_it():
    error = pickle.loads(pickle.dumps(ConversationError("messages[3].role", "'robot' is not a role")))
    assert isinstance(error, ConversationError)
    assert (error.field, error.message) == ("messages[3].role", "'robot' is not a role")
