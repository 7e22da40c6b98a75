"""The first tokens of a long text (hsx.chat.prefix), with tokenizers of each family the tests can train
here: the first tokens it gives are the whole text's, id and characters alike, and far less of the text is
tokenized than the whole; a short text, or no count needed, is tokenized whole."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest

from hsx.chat.prefix import CHARS_PER_TOKEN, MIN_CHARS, first_tokens
from tests.support import chat

tokenizers = pytest.importorskip("tokenizers")

# Llama 3's pre-tokenizer pattern: words, numbers of up to three digits, punctuation runs, whitespace.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def byte_level_bpe():
    """GPT-2's and Qwen's kind: a byte-level pre-tokenizer splits words, BPE merges within each."""
    return chat.train_tokenizer(vocab_size=600)


def llama3_bpe():
    """Llama 3's kind: its regex splits the text, bytes are mapped after, BPE merges within each piece."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=chat.SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(chat.corpus(), trainer)
    return tokenizer


def sentencepiece_bpe():
    """Llama 2's and Mistral's kind: no pre-tokenizer at all (spaces become '▁' in the normalizer), so BPE
    merges across the whole text, with bytes as a fallback for characters it never saw."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=900, special_tokens=["<unk>", *chat.SPECIALS, *bytes_], show_progress=False
    )
    tokenizer.train_from_iterator(chat.corpus(), trainer)
    return tokenizer


def unigram():
    """T5's and Gemma's kind: a unigram model, its best segmentation of each word found over the whole word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=500, special_tokens=["<unk>", *chat.SPECIALS], unk_token="<unk>", show_progress=False
    )
    tokenizer.train_from_iterator(chat.corpus(), trainer)
    return tokenizer


def wordpiece():
    """BERT's kind: lower-cased and accents stripped first (offsets map back through that), words split
    on spaces and punctuation, each word into its longest known pieces."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=500, special_tokens=["[UNK]", *chat.SPECIALS], show_progress=False)
    tokenizer.train_from_iterator(chat.corpus(), trainer)
    return tokenizer


KINDS = {
    "byte-level BPE": byte_level_bpe,
    "Llama 3 BPE": llama3_bpe,
    "SentencePiece BPE": sentencepiece_bpe,
    "unigram": unigram,
    "WordPiece": wordpiece,
}


@functools.cache
def texts(seed: int = 0) -> dict[str, str]:
    """Texts of 60,000 to 120,000 characters that cut badly: prose, one word of letters with no space, runs
    of spaces and newlines, digits, CJK and emoji, and the templates' special tokens every few hundred."""
    rng = random.Random(seed)
    words = chat.made_up_words(500, seed)
    prose = " ".join(rng.choice(words) for _ in range(16_000))
    return {
        "prose": prose,
        "no space": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(80_000)),
        "whitespace runs": "".join(
            rng.choice(words) + " " * rng.randint(1, 40) + "\n" * rng.randint(0, 3) for _ in range(6_000)
        ),
        "digits": "".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) + rng.choice(" ,.") for _ in range(12_000)),
        "cjk and emoji": "".join(rng.choice("模型的回答是这样😀🙂 ✓é") for _ in range(60_000)),
        "special tokens": "".join(
            f"<|start_header_id|>user<|end_header_id|>\n\n{' '.join(rng.choices(words, k=40))}<|eot_id|>"
            for _ in range(400)
        ),
    }


class Counted:
    """A tokenizer's encode as hsx.chat.prefix takes it, counting the characters it was given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chars = 0

    def __call__(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        self.chars += len(text)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, dtype=np.int32), np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)


# WordPiece gives a word of over 100 characters one unknown token, as long as the word: every cut changes
# it, so the prefixes never agree and the whole text is tokenized.
WHOLE = {("WordPiece", "no space")}


@pytest.fixture(scope="module", params=list(KINDS), ids=list(KINDS))
def kind(request):
    """(its name, the tokenizer, each text's whole tokenization)."""
    tokenizer = KINDS[request.param]()
    return request.param, tokenizer, {name: Counted(tokenizer)(text) for name, text in texts().items()}


@pytest.mark.parametrize("need", [1, 100, 1000])
def test_the_first_tokens_are_the_whole_texts_and_the_rest_is_not_tokenized(kind, need):
    kind_name, tokenizer, wholes = kind
    for name, text in texts().items():
        whole_ids, whole_offsets = wholes[name]
        encode = Counted(tokenizer)
        first = first_tokens(encode, text, need)
        assert first.ids.tolist() == whole_ids[: len(first.ids)].tolist(), name
        assert first.offsets.tolist() == whole_offsets[: len(first.ids)].tolist(), name
        if (kind_name, name) in WHOLE:
            assert first.whole and len(first.ids) == len(whole_ids), name
            continue
        assert not first.whole and len(first.ids) >= need, name
        assert encode.chars < len(text), (name, encode.chars)
        if name != "whitespace runs":  # more than CHARS_PER_TOKEN characters a token there: more doublings
            # the first two prefixes hold enough: 3 times the first prefix's characters are tokenized
            assert encode.chars <= 3 * max(need * CHARS_PER_TOKEN, MIN_CHARS), (name, encode.chars)


def test_a_short_text_or_no_count_needed_is_tokenized_whole(kind):
    _, tokenizer, _ = kind
    text = texts()["prose"]
    for need, part in ((None, text), (1000, text[: 2 * 1000 * CHARS_PER_TOKEN])):
        encode = Counted(tokenizer)
        first = first_tokens(encode, part, need)
        assert first.whole and encode.chars == len(part)
        assert first.ids.tolist() == Counted(tokenizer)(part)[0].tolist()


def test_prefixes_that_keep_disagreeing_end_in_the_whole_text():
    """An encode whose tokens all change with the cut (a stand-in for a text a tokenizer merges from end to
    end) never agrees: the doubling goes on to the whole text, whose tokens are its own."""

    def encode(text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = np.full(len(text), len(text) % 1000, dtype=np.int32)
        return ids, np.stack([np.arange(len(text)), np.arange(1, len(text) + 1)], axis=1).astype(np.int64)

    text = "x" * 100_000
    first = first_tokens(encode, text, 10)
    assert first.whole and len(first.ids) == len(text) and first.ids[0] == len(text) % 1000
