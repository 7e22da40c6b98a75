"""A conversation turned into the target model's token ids and a loss mask, with the model's own chat
template and tokenizer (transformers, imported only when a template is loaded: `pip install
'hsx-server[chat]'`).

The ids are exactly `tokenizer.apply_chat_template(messages, tokenize=True)`'s: the template's text,
tokenized once without added special tokens. The loss mask is 1 on what the assistant produces, each
assistant turn's content and its end-of-turn token (`<|eot_id|>`, `<|im_end|>`), and 0 on system and
user turns and on the template's own text (headers, the newline after `<|im_end|>`); hsx.chat.spans
finds those characters from the renderings alone, so any template will do, and the fast tokenizer's
offsets say which tokens they became.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from hsx.chat.formats import ConversationError, Message
from hsx.chat.pool import ordered_map
from hsx.chat.prefix import first_tokens
from hsx.chat.spans import assistant_spans, token_mask, turn_span

# assistant: every assistant turn; all: every token; last_assistant: the last assistant turn only
LossPolicy = Literal["assistant", "all", "last_assistant"]
LOSS_POLICIES: tuple[LossPolicy, ...] = get_args(LossPolicy)
INSTALL_HINT = "pip install 'hsx-server[chat]'"
# A conversation whose rendering says which tokens end an assistant turn.
_PROBE: list[Message] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]


class ChatTemplateError(Exception):
    """A tokenizer folder that cannot render conversations: missing, no chat template, no fast tokenizer,
    or transformers not installed."""


@dataclass(frozen=True)
class Rendered:
    input_ids: np.ndarray  # int32, one per token
    loss_mask: np.ndarray  # uint8, 1 where the loss applies
    text: str  # what the template rendered, the text the ids tokenize
    # every token of the text; False: rendered with a limit, the text's first tokens only (more than limit)
    whole: bool = True


class ChatTemplate:
    """A model's chat template and tokenizer, loaded from its folder with no network."""

    def __init__(self, tokenizer: Any, folder: Path):
        self._tokenizer = tokenizer
        self.folder = folder
        self.template: str = tokenizer.get_chat_template()
        # what the template writes after an assistant turn's content (Llama 3's <|eot_id|>)
        self.end_of_turn_ids: list[int] = _end_of_turn_ids(self, tokenizer)
        # end-of-turn ids generation should stop at
        self.eos_ids: list[int] = _stop_ids(self.end_of_turn_ids, tokenizer, folder)
        self._eos = frozenset(self.eos_ids)

    @classmethod
    def load(cls, tokenizer_path: str | Path) -> ChatTemplate:
        """The tokenizer and chat template in `tokenizer_path` (a model's folder or its tokenizer's)."""
        folder = Path(tokenizer_path)
        if not folder.is_dir():
            raise ChatTemplateError(f"{folder}: no such folder; give the folder of the model's tokenizer")
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ChatTemplateError(f"chat templates need transformers: {INSTALL_HINT} ({exc})") from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, ImportError) as exc:
            # ImportError too: transformers 4.x, finding no tokenizer, may fail on an optional package
            # (protobuf) it would have tried next.
            raise ChatTemplateError(f"{folder}: cannot load a tokenizer from this folder: {exc}") from exc
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"{folder}: the tokenizer has no chat template (chat_template.jinja, or chat_template in "
                "tokenizer_config.json)"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ChatTemplateError(
                f"{folder}: the tokenizer is not a fast one (no tokenizer.json), and the loss mask needs the "
                "character offsets only a fast tokenizer gives"
            )
        try:
            return cls(tokenizer, folder)
        except MemoryError:
            raise
        except Exception as exc:  # the template is a program that came with the model: it may raise anything
            raise ChatTemplateError(
                f"{folder}: the chat template fails on a two-turn conversation: {type(exc).__name__}: {exc}"
            ) from exc

    def render(self, messages: list[Message], loss: LossPolicy = "assistant", limit: int | None = None) -> Rendered:
        """The conversation's ids and loss mask. With `limit`, the most tokens the sample may keep, the mask
        is exact for its first limit + 1 tokens (what a length policy reads) and zero after them: the turns
        past them, which would cost the most to find, are not looked for; and a text longer than those tokens
        need is tokenized only so far (hsx.chat.prefix): its first tokens, more than limit, the ids the
        whole text's tokenization starts with (`whole` False). Raises ConversationError for a conversation
        the template refuses or whose assistant turns cannot be found (hsx.chat.spans)."""
        if loss not in LOSS_POLICIES:
            raise ValueError(f"unknown loss policy {loss!r}; expected one of {', '.join(LOSS_POLICIES)}")
        text = self.text(messages, generation_prompt=False)
        tokens = first_tokens(self._encode, text, None if limit is None else limit + 1)
        ids = tokens.ids
        if loss == "all":
            mask = np.ones(len(ids), dtype=np.uint8)
        else:
            offsets = tokens.offsets
            # a turn starting at or after the end of token `limit` marks none of the tokens up to it
            before = int(offsets[limit, 1]) if limit is not None and len(offsets) > limit else None
            last_only = loss == "last_assistant"
            spans = assistant_spans(self._render_text, messages, text, last_only=last_only, before=before)
            mask = token_mask(offsets, spans)
        return Rendered(input_ids=ids, loss_mask=mask, text=text, whole=tokens.whole)

    def continuation(self, messages: list[Message], *, generation_prompt: bool, limit: int | None = None) -> list[int]:
        """The ids of what the template writes after the last assistant turn of `messages` (after its content
        and end of turn, where hsx.chat.spans ends the turn) through the end of their rendering, with the
        generation prompt if asked; the whole rendering when no assistant turn is there. Regenerated
        conversations are these pieces with the model's own ids between them (hsx.chat.regenerate). With
        `limit`, a piece longer than that is tokenized only so far: its first ids, more than limit."""
        text = self.text(messages, generation_prompt=generation_prompt)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        start = 0
        if turns:
            _, start = turn_span(self._render_text, messages, text, turns[-1])
        tokens = first_tokens(self._encode, text[start:], None if limit is None else limit + 1)
        return [int(i) for i in tokens.ids]

    def decode(self, ids: list[int]) -> str:
        """Generated ids as the assistant turn's text: up to the first end-of-turn id, special tokens left out."""
        end = next((k for k, token in enumerate(ids) if token in self._eos), len(ids))
        return str(self._tokenizer.decode(list(ids[:end]), skip_special_tokens=True))

    def text(self, messages: list[Message], *, generation_prompt: bool) -> str:
        """The template's text for `messages`."""
        if not messages:
            raise ConversationError("messages", "is empty; a conversation holds at least one message")
        from jinja2 import TemplateError

        try:
            out = self._tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation_prompt
            )
        except TemplateError as exc:  # the template's raise_exception(...) among them
            raise ConversationError("messages", f"the chat template refused the conversation: {exc}") from exc
        except MemoryError:  # the process's memory, not the conversation's fault alone (hsx.chat.process)
            raise
        except Exception as exc:  # anything else the template's code raised on these messages
            raise ConversationError(
                "messages", f"the chat template fails on the conversation: {type(exc).__name__}: {exc}"
            ) from exc
        return str(out)

    def _render_text(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.text(messages, generation_prompt=generation_prompt)

    def _encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """The ids of `text`, tokenized with no special tokens added, and each one's [start, end) characters."""
        encoded = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoded["input_ids"], dtype=np.int32)
        return ids, np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    @functools.cached_property
    def fingerprint(self) -> str:
        """16 hex digits naming what renders a sample: the template's text, the tokenizer (its full
        definition, vocabulary and merges included) and its special tokens. Worked out when first read."""
        tok = self._tokenizer
        parts = {
            "template": self.template,
            "tokenizer": hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest(),
            "size": len(tok),
            "special": {k: str(v) for k, v in sorted(tok.special_tokens_map.items())},
            "eos_ids": self.eos_ids,
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _stop_ids(end_of_turn: list[int], tokenizer: Any, folder: Path) -> list[int]:
    """The ids that end an assistant turn: the special tokens the template writes after a turn's content,
    then the tokenizer's eos, then generation_config.json's eos ids (Llama 3.1 lists three)."""
    ids = list(end_of_turn)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    ids += _generation_config_eos(folder)
    return list(dict.fromkeys(ids))


def _end_of_turn_ids(template: ChatTemplate, tokenizer: Any) -> list[int]:
    """The special tokens between the end of a probe answer's content and the end of its turn."""
    try:
        text = template.text(_PROBE, generation_prompt=False)
        spans = assistant_spans(template._render_text, _PROBE, text, last_only=True)
    except ConversationError:
        return []  # a template that refuses the probe: the tokenizer's word only
    start, end = spans[0]
    content = _PROBE[-1]["content"]
    at = text.rfind(content, start, end)
    if at < 0:
        return []
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    tail = text[at + len(content) : end]
    return [i for i in tokenizer(tail, add_special_tokens=False)["input_ids"] if i in special]


def _generation_config_eos(folder: Path) -> list[int]:
    try:
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    values = eos if isinstance(eos, list) else [eos]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


# The template a worker process loaded once (render_many with workers > 1).
_WORKER_TEMPLATE: ChatTemplate | None = None


def render_many(
    template_path: str | Path,
    conversations: Iterable[list[Message]],
    loss: LossPolicy = "assistant",
    workers: int = 1,
) -> Iterator[Rendered | ConversationError]:
    """Each conversation rendered, in order; a conversation that cannot be gives its ConversationError in
    its place. With workers > 1 the renders run in that many processes, each loading the template once.
    Raises ChatTemplateError (before any result) when the template cannot be loaded."""
    if loss not in LOSS_POLICIES:
        raise ValueError(f"unknown loss policy {loss!r}; expected one of {', '.join(LOSS_POLICIES)}")
    template = ChatTemplate.load(template_path)  # in this process too, so that a bad folder fails here
    if workers <= 1:
        return (_render_one(template, messages, loss) for messages in conversations)
    return ordered_map(
        functools.partial(_render_batch, loss=loss),
        conversations,
        workers=workers,
        initializer=_load_in_worker,
        initargs=(str(template_path),),
    )


def _render_one(template: ChatTemplate, messages: list[Message], loss: LossPolicy) -> Rendered | ConversationError:
    try:
        return template.render(messages, loss)
    except ConversationError as exc:
        return exc


def _load_in_worker(template_path: str) -> None:
    global _WORKER_TEMPLATE  # noqa: PLW0603 - one template per worker process, loaded by its initializer
    _WORKER_TEMPLATE = ChatTemplate.load(template_path)


def _render_batch(batch: list[list[Message]], loss: LossPolicy) -> list[Rendered | ConversationError]:
    assert _WORKER_TEMPLATE is not None, "the worker's initializer loads the template"
    return [_render_one(_WORKER_TEMPLATE, messages, loss) for messages in batch]
