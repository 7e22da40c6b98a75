"""A chat sample as a dataset line carries it, read into one list of {"role", "content"} messages.

Two layouts are read:

- OpenAI's: `{"messages": [{"role": "user", "content": "..."}, ...]}`, roles `system`, `user` and
  `assistant`;
- ShareGPT's: `{"conversations": [{"from": "human", "value": "..."}, ...]}`, `from` one of the names in
  SHAREGPT_ROLES (`human`, `gpt`, ...); an element may also use `role` and `content` as OpenAI's do.

A conversation without an assistant turn is read as it is: rendered, its loss mask is all zero under the
`assistant` and `last_assistant` policies (hsx.chat.render). Whether such a sample is worth keeping is
the caller's policy, not this module's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypedDict

from typing_extensions import NotRequired  # typing's from Python 3.11


class Message(TypedDict):
    role: str
    content: str
    # A regenerated assistant turn's end: stop (the model wrote an end-of-turn id) or length (cut at
    # max_new_tokens). Templates ignore it.
    finish: NotRequired[str]


ROLES = ("system", "user", "assistant")
# ShareGPT's speaker names, as the datasets in that layout spell them, and the role each one is.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "model": "assistant",
}


class ConversationError(ValueError):
    """A conversation hsx cannot render: `field` names where (`messages[2].role`), `message` says why."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type[ConversationError], tuple[str, str]]:
        # Rendered in worker processes and sent back pickled: rebuild from both fields, not from args.
        return (type(self), (self.field, self.message))


def conversation_of(obj: Mapping[str, Any]) -> list[Message] | None:
    """The conversation in one sample's JSON object, or None when it has neither `messages` nor
    `conversations`. Raises ConversationError when the one it has is not a conversation."""
    if "messages" in obj and "conversations" in obj:
        raise ConversationError("messages", "a sample holds either messages or conversations, not both")
    if "messages" in obj:
        return _read(obj["messages"], "messages", _openai_message)
    if "conversations" in obj:
        return _read(obj["conversations"], "conversations", _sharegpt_message)
    return None


def _read(turns: Any, field: str, read_one: Callable[[Mapping[str, Any], str], Message]) -> list[Message]:
    if not isinstance(turns, list):
        raise ConversationError(field, f"must be a list of messages, got {_kind(turns)}")
    if not turns:
        raise ConversationError(field, "is empty; a conversation holds at least one message")
    out: list[Message] = []
    for i, turn in enumerate(turns):
        where = f"{field}[{i}]"
        if not isinstance(turn, Mapping):
            raise ConversationError(where, f"must be an object, got {_kind(turn)}")
        out.append(read_one(turn, where))
    return out


def _openai_message(turn: Mapping[str, Any], where: str) -> Message:
    role = _string(turn, "role", where)
    if role not in ROLES:
        raise ConversationError(f"{where}.role", f"{role!r} is not a role; expected one of {', '.join(ROLES)}")
    return {"role": role, "content": _string(turn, "content", where)}


def _sharegpt_message(turn: Mapping[str, Any], where: str) -> Message:
    if "from" in turn:
        speaker_key, content_key = "from", "value"
    elif "role" in turn:
        speaker_key, content_key = "role", "content"
    else:
        raise ConversationError(where, 'needs "from" and "value" (or "role" and "content")')
    speaker = _string(turn, speaker_key, where)
    role = SHAREGPT_ROLES.get(speaker.lower())
    if role is None:
        names = ", ".join(SHAREGPT_ROLES)
        raise ConversationError(f"{where}.{speaker_key}", f"{speaker!r} is not a speaker; expected one of {names}")
    return {"role": role, "content": _string(turn, content_key, where)}


def _string(turn: Mapping[str, Any], key: str, where: str) -> str:
    if key not in turn:
        raise ConversationError(f"{where}.{key}", "is missing")
    value = turn[key]
    if not isinstance(value, str):
        raise ConversationError(f"{where}.{key}", f"must be a string, got {_kind(value)}")
    return value


# JSON's kinds as a message names them; bool before int, which it subclasses.
_KINDS: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (bool, "a boolean"),
    ((int, float), "a number"),
    (str, "a string"),
    (list, "a list"),
    (Mapping, "an object"),
)


def _kind(value: Any) -> str:
    """A JSON value's kind, as a message names it."""
    if value is None:
        return "null"
    return next((name for kind, name in _KINDS if isinstance(value, kind)), type(value).__name__)
