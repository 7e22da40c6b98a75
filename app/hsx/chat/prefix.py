"""The first tokens of a long text, without tokenizing the rest of it.

A sample over its length limit keeps at most its first `limit` tokens, and its length policy reads one
more (hsx.lengths): tokenizing the text past them costs time and memory for tokens nobody keeps (a 4 MB
turn is millions of tokens, and their ids and offsets over a gigabyte). No count of characters bounds
from below the tokens they hold (one token may cover a long run of spaces or dashes), so the text is
tokenized by prefixes that double in length until two in a row agree on more tokens than are needed.

Why agreement is the test: a tokenizer splits its text at its special tokens, then into words (its
pre-tokenizer), and merges or segments within each word, so cutting the text changes only the tokens near
the cut. A token that two cuts, one twice as far into the text as the other, both give with the same id
and characters lies before what either cut changed, and the whole text is one more cut, farther still.
Both cuts must fall outside what they would cut alike: a special token (two cuts inside one both see
plain text) or a word; so the first cut is at least MIN_CHARS in, longer than any special token or real
word. A text with no place to split for a long way (a run of thousands of characters with no space, or a
tokenizer without a pre-tokenizer) may change further back: the prefixes then disagree, and the doubling
goes on, up to the whole text; only a word longer than the first cut, whose first tokens both cuts give
alike and the whole word not, would escape the test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# text -> (ids, offsets): int32 [n] and int64 [n, 2], each token's [start, end) characters of the text
Encode = Callable[[str], tuple[np.ndarray, np.ndarray]]

# The first prefix's characters per token needed: more than tokenizers average on prose, code or CJK
# text (2-5), so that on nearly any text the first two prefixes hold enough tokens.
CHARS_PER_TOKEN = 8
# The shortest first prefix: two cuts agree on nothing they both fall inside, a special token (`<|eot_id|>`,
# split off before anything else) or a word, so they are never closer than any of those is long but a
# word of thousands of characters.
MIN_CHARS = 4096


@dataclass(frozen=True)
class Tokens:
    ids: np.ndarray  # int32
    offsets: np.ndarray  # int64 [n, 2]
    whole: bool  # every token of the text; False: its first ones only, at least the number needed


def first_tokens(encode: Encode, text: str, need: int | None) -> Tokens:
    """`text`'s tokens by `encode`: all of them when `need` is None or the text is short enough that a
    prefix would save little; else at least its first `need` tokens, each as the whole text's tokenization
    has it (more when the prefixes agree on more)."""
    size = len(text) if need is None else max(need * CHARS_PER_TOKEN, MIN_CHARS)
    if 2 * size >= len(text):
        return _whole(encode, text)
    shorter = encode(text[:size])
    while 2 * size < len(text):
        size *= 2
        longer = encode(text[:size])
        agreed = _agreed(shorter, longer)
        if need is not None and agreed >= need:
            ids, offsets = longer
            return Tokens(ids[:agreed], offsets[:agreed], whole=False)
        shorter = longer
    return _whole(encode, text)


def _whole(encode: Encode, text: str) -> Tokens:
    ids, offsets = encode(text)
    return Tokens(ids, offsets, whole=True)


def _agreed(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> int:
    """How many leading tokens `a` and `b` share, id and characters alike."""
    n = min(len(a[0]), len(b[0]))
    same = (a[0][:n] == b[0][:n]) & (a[1][:n] == b[1][:n]).all(axis=1)
    differ = np.flatnonzero(~same)
    return int(differ[0]) if len(differ) else n
