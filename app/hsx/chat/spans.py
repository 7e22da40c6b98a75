"""Where each assistant turn lies in a rendered conversation, found from the renderings themselves, and
which tokens those characters became.

The template is a black box: no generation markers (`{% generation %}`) are needed. Assistant turn i
starts where the rendering of the turns before it, with the generation prompt, ends (that prompt is the
header a model is given to write the turn), and ends where the rendering of the conversation through it
ends, less the whitespace a template puts after the end-of-turn token (ChatML's newline after
`<|im_end|>`). Both renderings must be the start of the whole conversation's: a template that renders
earlier turns differently once later ones follow (one that drops the reasoning of older answers, say)
leaves no place to find the turn in, and the conversation is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hsx.chat.formats import ConversationError, Message

# (messages, add_generation_prompt) -> the template's text for them
RenderText = Callable[[list[Message], bool], str]
Span = tuple[int, int]  # characters [start, end) of the rendered text


def assistant_spans(
    render_text: RenderText, messages: list[Message], text: str, *, last_only: bool, before: int | None = None
) -> list[Span]:
    """The character spans of the assistant turns (only the last one's with `last_only`) in `text`, the
    rendering of the whole of `messages`; with `before`, only those of the turns that start before that
    character. Each turn costs a rendering of the conversation up to it, so the cost grows with the square
    of the turns: a sample that will be cut needs only the turns its kept part holds."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if last_only:
        turns = turns[-1:]
    spans = []
    for i in turns:
        span = turn_span(render_text, messages, text, i)
        if before is not None and span[0] >= before:
            break
        spans.append(span)
    return spans


def turn_span(render_text: RenderText, messages: list[Message], text: str, i: int) -> Span:
    """The character span of assistant turn `i` (its content and end of turn) in `text`."""
    if i == 0:
        raise ConversationError(
            "messages[0]",
            "the conversation opens with an assistant turn: no prompt comes before it, so the template cannot "
            "say where the turn starts; begin with a system or user message",
        )
    before = render_text(messages[:i], True)
    through = text if i == len(messages) - 1 else render_text(messages[: i + 1], False)
    for prefix, what in (
        (before, "the turns before it (with the generation prompt)"),
        (through, "the conversation up to and including it"),
    ):
        if not text.startswith(prefix):
            raise ConversationError(
                f"messages[{i}]",
                f"the chat template renders {what} differently from the start of the whole conversation "
                "(it rewrites earlier turns once later ones follow), so this assistant turn's tokens cannot "
                "be told apart",
            )
    start, end = len(before), len(through.rstrip())
    return start, max(start, end)


def token_mask(offsets: np.ndarray, spans: Sequence[Span]) -> np.ndarray:
    """1 for each token whose characters (`offsets`, one [start, end) row per token) overlap a span, else
    0: a token that straddles a span's edge belongs to the turn, as transformers' assistant mask has it."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not len(offsets):
        return mask
    starts, ends = offsets[:, 0], offsets[:, 1]
    for a, b in spans:
        if b > a:
            mask[(starts < b) & (ends > a)] = 1
    return mask
