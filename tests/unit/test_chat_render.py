"""Conversations rendered with real transformers tokenizers and chat templates saved by the tests (no
download): the ids are transformers' own, the loss mask covers exactly what the assistant writes."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from hsx.chat.formats import ConversationError
from hsx.chat.render import ChatTemplate, ChatTemplateError
from tests.support import chat

transformers = pytest.importorskip("transformers")

TWO_TURNS = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "answer one"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "answer two"},
]
CONVERSATIONS = {
    "one turn": TWO_TURNS[:2],
    "two turns": TWO_TURNS,
    "system first": [{"role": "system", "content": "Be brief."}, *TWO_TURNS],
    "ends with the user": TWO_TURNS[:3],
    "user only": TWO_TURNS[:1],
    "padded and unicode": [
        {"role": "user", "content": "  héllo — ünïcode 😀 \n"},
        {"role": "assistant", "content": "  answer one ✓\n\n"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
    ],
}
# (template, style) by name; the generation-marker and rewriting ones have tests of their own
TEMPLATES = {
    "llama3": (chat.LLAMA3, "llama3"),
    "chatml": (chat.CHATML, "chatml"),
    "default system": (chat.CHATML_DEFAULT_SYSTEM, "chatml"),
    "llama3 generation": (chat.LLAMA3_GENERATION, "llama3"),
}
EOT = {
    "llama3": "<|eot_id|>",
    "chatml": "<|im_end|>",
    "default system": "<|im_end|>",
    "llama3 generation": "<|eot_id|>",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-tokenizers")
    out = {}
    for name, (template, style) in TEMPLATES.items():
        eos = ["<|end_of_text|>", "<|eot_id|>"] if style == "llama3" else None
        out[name] = chat.save_chat_tokenizer(root / name.replace(" ", "-"), template, style=style, generation_eos=eos)
    for name, template in (("drops reasoning", chat.CHATML_DROPS_REASONING), ("alternating", chat.CHATML_ALTERNATING)):
        out[name] = chat.save_chat_tokenizer(root / name.replace(" ", "-"), template, style="chatml")
    return out


@pytest.fixture(scope="module")
def templates(folders):
    return {name: ChatTemplate.load(folder) for name, folder in folders.items()}


@pytest.fixture(scope="module")
def reference(folders):
    """The same folders loaded by transformers alone: what the ids and text must equal."""
    return {
        name: transformers.AutoTokenizer.from_pretrained(str(f), local_files_only=True) for name, f in folders.items()
    }


def runs(tokenizer, rendered) -> list[str]:
    """The text of each run of consecutive loss-mask ones, special tokens included."""
    mask = np.concatenate([[0], rendered.loss_mask, [0]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(mask))
    return [tokenizer.decode(rendered.input_ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=list(CONVERSATIONS))
@pytest.mark.parametrize("name", TEMPLATES, ids=list(TEMPLATES))
def test_ids_and_text_are_transformers_own(templates, reference, name, conversation):
    messages = CONVERSATIONS[conversation]
    rendered = templates[name].render(messages)
    assert rendered.input_ids.dtype == np.int32 and rendered.loss_mask.dtype == np.uint8
    assert rendered.input_ids.shape == rendered.loss_mask.shape
    assert rendered.input_ids.tolist() == chat.apply_chat_template_ids(reference[name], messages)
    assert rendered.text == reference[name].apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize("name", TEMPLATES, ids=list(TEMPLATES))
def test_the_mask_covers_each_answer_and_its_end_of_turn_token_only(templates, reference, name):
    rendered = templates[name].render(TWO_TURNS)
    eot = EOT[name]
    assert runs(reference[name], rendered) == [f"answer one{eot}", f"answer two{eot}"]
    masked = reference[name].decode(rendered.input_ids[rendered.loss_mask == 1].tolist())
    assert masked == f"answer one{eot}answer two{eot}"


def test_the_default_system_prompt_is_rendered_and_left_out_of_the_loss(templates, reference):
    rendered = templates["default system"].render(TWO_TURNS)
    assert rendered.text.startswith(f"<|im_start|>system\n{chat.DEFAULT_SYSTEM_PROMPT}<|im_end|>\n")
    assert runs(reference["default system"], rendered) == ["answer one<|im_end|>", "answer two<|im_end|>"]


def test_template_whitespace_is_not_the_assistants(templates, reference):
    """Llama 3's template trims contents; ChatML's keeps them, and its newline after <|im_end|> is the template's."""
    padded = CONVERSATIONS["padded and unicode"]
    assert runs(reference["llama3"], templates["llama3"].render(padded)) == ["answer one ✓<|eot_id|>", "<|eot_id|>"]
    chatml = templates["chatml"].render(padded)
    assert runs(reference["chatml"], chatml) == ["  answer one ✓\n\n<|im_end|>", "<|im_end|>"]
    assert chatml.text.endswith("<|im_end|>\n")
    assert chatml.loss_mask[-1] == 0, "the trailing newline is the template's"


@pytest.mark.parametrize("name", TEMPLATES, ids=list(TEMPLATES))
def test_last_assistant_and_all(templates, reference, name):
    last = templates[name].render(TWO_TURNS, "last_assistant")
    assert runs(reference[name], last) == [f"answer two{EOT[name]}"]
    every = templates[name].render(TWO_TURNS, "all")
    assert every.loss_mask.tolist() == [1] * len(every.input_ids)
    assert every.input_ids.tolist() == last.input_ids.tolist()


@pytest.mark.parametrize("loss", ["assistant", "last_assistant"])
def test_no_assistant_turn_gives_an_all_zero_mask(templates, loss):
    rendered = templates["llama3"].render(CONVERSATIONS["user only"], loss)
    assert len(rendered.input_ids) > 0
    assert not rendered.loss_mask.any()


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=list(CONVERSATIONS))
def test_the_mask_equals_transformers_assistant_mask_from_generation_markers(templates, reference, conversation):
    messages = CONVERSATIONS[conversation]
    ours = templates["llama3 generation"].render(messages)
    theirs = reference["llama3 generation"].apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ours.input_ids.tolist() == list(theirs["input_ids"])
    assert ours.loss_mask.tolist() == list(theirs["assistant_masks"])


@pytest.mark.parametrize("name", TEMPLATES, ids=list(TEMPLATES))
def test_the_prompt_for_a_turn_is_the_ids_before_it_and_the_templates_continuation(templates, reference, name):
    template = templates[name]
    rendered = template.render(TWO_TURNS)
    first_turn_end = int(rendered.loss_mask.argmax() + rendered.loss_mask[rendered.loss_mask.argmax() :].argmin())
    for i, before in ((1, []), (3, rendered.input_ids[:first_turn_end].tolist())):
        prompt = before + template.continuation(TWO_TURNS[:i], generation_prompt=True)
        assert prompt == chat.apply_chat_template_ids(reference[name], TWO_TURNS[:i], add_generation_prompt=True)
        assert rendered.input_ids[: len(prompt)].tolist() == prompt
        assert rendered.loss_mask[len(prompt) - 1] == 0 and rendered.loss_mask[len(prompt)] == 1
    # After the last turn: what the template writes after its end of turn (ChatML's newline), nothing else.
    last_end = len(rendered.loss_mask) - int(rendered.loss_mask[::-1].argmax())
    assert template.continuation(TWO_TURNS, generation_prompt=False) == rendered.input_ids[last_end:].tolist()


def test_a_template_that_rewrites_earlier_turns_is_refused_for_those_conversations(templates, reference):
    template = templates["drops reasoning"]
    plain = template.render(TWO_TURNS)
    assert runs(reference["drops reasoning"], plain) == ["answer one<|im_end|>", "answer two<|im_end|>"]
    reasoning = [TWO_TURNS[0], {"role": "assistant", "content": "<think>hmm</think>answer one"}, *TWO_TURNS[2:]]
    with pytest.raises(ConversationError) as caught:
        template.render(reasoning)
    assert caught.value.field == "messages[1]"
    assert "rewrites earlier turns" in caught.value.message
    # Only the last turn is looked for under last_assistant, and it is rendered as it stands.
    assert runs(reference["drops reasoning"], template.render(reasoning, "last_assistant")) == ["answer two<|im_end|>"]


def test_a_conversation_the_template_refuses_is_a_conversation_error(templates):
    with pytest.raises(ConversationError) as caught:
        templates["alternating"].render([TWO_TURNS[0], TWO_TURNS[0]])
    assert caught.value.field == "messages"
    assert "the chat template refused the conversation: Conversation roles must alternate" in caught.value.message


def test_an_opening_assistant_turn_and_an_empty_conversation_are_refused(templates):
    with pytest.raises(ConversationError) as caught:
        templates["llama3"].render(TWO_TURNS[1:])
    assert caught.value.field == "messages[0]"
    assert "opens with an assistant turn" in caught.value.message
    with pytest.raises(ConversationError, match="is empty"):
        templates["llama3"].render([])
    with pytest.raises(ValueError, match="unknown loss policy 'every'"):
        templates["llama3"].render(TWO_TURNS, "every")  # type: ignore[arg-type]


def test_end_of_turn_ids_come_from_the_template_then_the_eos_then_the_generation_config(templates, reference):
    llama, chatml = reference["llama3"], reference["chatml"]
    eot, end = llama.convert_tokens_to_ids("<|eot_id|>"), llama.convert_tokens_to_ids("<|end_of_text|>")
    assert templates["llama3"].eos_ids == [eot, end]  # generation_config.json lists both again
    assert templates["chatml"].eos_ids == [chatml.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]


def test_decode_stops_at_the_end_of_turn_and_leaves_special_tokens_out(templates, reference):
    tokenizer = reference["llama3"]
    ids = tokenizer.encode("<|start_header_id|>answer one", add_special_tokens=False)
    junk = tokenizer.encode("<|eot_id|>more text", add_special_tokens=False)
    assert templates["llama3"].decode(ids + junk) == "answer one"
    assert templates["llama3"].decode(ids) == "answer one"
    assert templates["llama3"].decode([]) == ""


def test_the_fingerprint_names_template_and_tokenizer(tmp_path, folders, templates):
    fingerprints = {name: t.fingerprint for name, t in templates.items()}
    assert all(re.fullmatch(r"[0-9a-f]{16}", f) for f in fingerprints.values())
    assert len(set(fingerprints.values())) == len(fingerprints), "each template renders differently"
    assert ChatTemplate.load(folders["llama3"]).fingerprint == fingerprints["llama3"]
    bigger = chat.save_chat_tokenizer(
        tmp_path / "bigger", chat.LLAMA3, vocab_size=420, generation_eos=["<|end_of_text|>", "<|eot_id|>"]
    )
    assert ChatTemplate.load(bigger).fingerprint != fingerprints["llama3"], "another vocabulary"
    more_stops = chat.save_chat_tokenizer(tmp_path / "more-stops", chat.LLAMA3, generation_eos=["<|im_end|>"])
    assert ChatTemplate.load(more_stops).fingerprint != fingerprints["llama3"], "other stop ids"


def test_a_folder_that_cannot_render_says_why(tmp_path, folders):
    with pytest.raises(ChatTemplateError, match="no such folder"):
        ChatTemplate.load(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ChatTemplateError, match="cannot load a tokenizer from this folder"):
        ChatTemplate.load(tmp_path / "empty")
    plain = transformers.AutoTokenizer.from_pretrained(str(folders["chatml"]), local_files_only=True)
    plain.chat_template = None
    plain.save_pretrained(str(tmp_path / "no-template"))
    for leftover in (tmp_path / "no-template").glob("chat_template*"):
        leftover.unlink()
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate.load(tmp_path / "no-template")


def test_without_transformers_loading_names_the_extra_to_install(tmp_path, folders):
    """hsx.chat imports without transformers; loading a template says which extra brings it."""
    shadow = tmp_path / "site" / "transformers"
    shadow.mkdir(parents=True)
    shadow.joinpath("__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'transformers'\")\n")
    code = (
        "import sys\n"
        "from hsx.chat import ChatTemplate, ChatTemplateError\n"
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules\n"
        "try:\n"
        f"    ChatTemplate.load({str(folders['llama3'])!r})\n"
        "except ChatTemplateError as exc:\n"
        "    print(exc)\n"
    )
    env_path = ":".join([str(tmp_path / "site"), *sys.path])
    proc = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": env_path}, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("chat templates need transformers: pip install 'hsx-server[chat]'")


@pytest.mark.parametrize("name", TEMPLATES, ids=list(TEMPLATES))
def test_a_limit_keeps_the_mask_of_the_kept_tokens_and_looks_for_no_turn_past_them(templates, name, monkeypatch):
    """With `limit` the ids start as the whole render's and the mask is its own for the first limit + 1
    tokens; the turns past them, which cost a rendering of the conversation each, are not looked for, and
    the text past what the limit needs is not tokenized."""
    template = templates[name]
    messages = [
        m for i in range(40) for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"})
    ]
    whole = template.render(messages)
    calls = []
    text = template.text
    monkeypatch.setattr(template, "text", lambda m, **kw: calls.append(len(m)) or text(m, **kw))
    limit = len(whole.input_ids) // 4
    cut = template.render(messages, limit=limit)
    assert len(cut.input_ids) > limit
    assert cut.input_ids.tolist() == whole.input_ids[: len(cut.input_ids)].tolist()
    assert cut.loss_mask[: limit + 1].tolist() == whole.loss_mask[: limit + 1].tolist()
    assert cut.loss_mask[: limit + 1].any() and cut.loss_mask.sum() < whole.loss_mask.sum()
    assert max(calls[1:]) < len(messages) // 2, "turns past the limit were rendered for"
    assert template.render(messages, limit=len(whole.input_ids)).loss_mask.tolist() == whole.loss_mask.tolist()


@pytest.mark.parametrize("name", TEMPLATES, ids=list(TEMPLATES))
@pytest.mark.parametrize("loss", ["assistant", "all"])
def test_a_text_far_longer_than_its_limit_needs_is_tokenized_only_so_far(templates, name, loss, monkeypatch):
    """A turn of 240,000 characters under a limit of 1,000 tokens: the ids are the first of the whole
    render's, more than the limit, with the same mask over the first limit + 1, and only a small part of
    the text is tokenized (hsx.chat.prefix)."""
    template = templates[name]
    messages = [
        {"role": "user", "content": "hello there how are you " * 10_000},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "answer two"},
    ]
    whole = template.render(messages, loss)
    tokenized = []
    encode = template._encode
    monkeypatch.setattr(template, "_encode", lambda text: tokenized.append(len(text)) or encode(text))
    cut = template.render(messages, loss, limit=1000)
    assert whole.whole and not cut.whole and 1000 < len(cut.input_ids) < len(whole.input_ids)
    assert cut.input_ids.tolist() == whole.input_ids[: len(cut.input_ids)].tolist()
    assert cut.loss_mask[:1001].tolist() == whole.loss_mask[:1001].tolist()
    assert cut.text == whole.text and sum(tokenized) < len(whole.text) / 4
    prompt = template.continuation(messages[:1], generation_prompt=True, limit=1000)
    assert len(prompt) > 1000 and prompt == template.continuation(messages[:1], generation_prompt=True)[: len(prompt)]
