"""Tokenizers with chat templates, made here (no download): a byte-level BPE trained in milliseconds on
made-up text, wrapped as transformers' fast tokenizer and saved with one of the templates below.

The templates are written here after the styles of real ones: Llama 3's headers, ChatML, ChatML with a
default system prompt (as Qwen 2.5's), Llama 3's with `{% generation %}` markers, one that drops the
reasoning of earlier answers (as Qwen 3's), and one that refuses turns out of order (as Mistral's)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPECIALS = LLAMA3_SPECIALS + CHATML_SPECIALS

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
CHATML_DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\n{% endif %}"
) + CHATML
LLAMA3_GENERATION = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_DROPS_REASONING = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{% set content = content.split('</think>')[-1] | trim %}"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_ALTERNATING = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A template whose own code fails on one word of a conversation, with an error Jinja does not know (not a
# TemplateError); one that takes hours on another word; one that doubles its output without end on a
# third; and one whose output on a fourth fits in memory as text (the turn ten million times) but not as
# the tokenizer's tokens.
RAISES_ON_BOOM = "{% for m in messages %}{% if 'boom' in m['content'] %}{{ 1 // 0 }}{% endif %}{% endfor %}" + LLAMA3
SLOW_ON_SLOW = (
    "{% for m in messages %}{% if 'slow' in m['content'] %}"
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{% endif %}{% endfor %}"
) + LLAMA3
EXPANDS_ON_GROW = (
    "{% for m in messages %}{% if 'grow' in m['content'] %}{% set out = namespace(text=m['content']) %}"
    "{% for i in range(64) %}{% set out.text = out.text ~ out.text %}{% endfor %}{{ out.text }}{% endif %}"
    "{% endfor %}"
) + LLAMA3
REPEATS_ON_REPEAT = (
    "{% for m in messages %}{% if 'repeat' in m['content'] %}{{ (m['content'] ~ ' ') * 10000000 }}{% endif %}"
    "{% endfor %}"
) + LLAMA3

# style -> (bos, eos): Llama 3's base eos, Qwen's
STYLES = {"llama3": ("<|begin_of_text|>", "<|end_of_text|>"), "chatml": (None, "<|endoftext|>")}
_TEXT = (
    "answer one two three question hello there how are you the quick brown fox jumps over lazy dog what is a "
    "model token template assistant user system think reasoning because so then"
)
WORDS = tuple(_TEXT.split())


def made_up_words(n: int, seed: int = 0) -> list[str]:
    """The words above and n words of one to three random syllables."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    return list(WORDS) + ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(n)]


def corpus(lines: int = 400, seed: int = 0, words: int = 300) -> list[str]:
    """Made-up text, for the BPE trainer to learn merges from."""
    rng = random.Random(seed)
    pool = made_up_words(words, seed)
    return [
        " ".join(rng.choice(pool) for _ in range(rng.randint(5, 30))) + rng.choice([".", "?", "!\n"])
        for _ in range(lines)
    ]


def train_tokenizer(vocab_size: int = 400, lines: int = 400, words: int = 300) -> Any:
    """A byte-level BPE (as Llama 3's and Qwen's are) with every special token above, `vocab_size` ids
    at most: any byte string round-trips, and offsets are exact."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(lines, words=words), trainer)
    return tokenizer


def save_chat_tokenizer(
    folder: Path,
    template: str,
    *,
    style: str = "llama3",
    vocab_size: int = 400,
    lines: int = 400,
    words: int = 300,
    generation_eos: list[str] | None = None,
) -> Path:
    """A tokenizer folder as a model ships it: tokenizer.json, its config, the chat template, and with
    `generation_eos` a generation_config.json listing those tokens' ids as eos_token_id."""
    from transformers import PreTrainedTokenizerFast

    bos, eos = STYLES[style]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size, lines, words), bos_token=bos, eos_token=eos
    )
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    if generation_eos is not None:
        ids = [fast.convert_tokens_to_ids(t) for t in generation_eos]
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return folder


def apply_chat_template_ids(tokenizer: Any, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    """transformers' own ids for `messages`: a list in 4.x, a BatchEncoding (return_dict=True) in 5.x."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    if not isinstance(out, list):
        out = out["input_ids"]
    return [int(i) for i in out]


def reference_tokenizer(folder: Path) -> Any:
    """transformers' own tokenizer for a folder saved above: the reference hsx's renders are checked against."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
