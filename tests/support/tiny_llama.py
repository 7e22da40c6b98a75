"""The tiny random Llama the real-engine tests serve: made here with transformers (no download), saved
in the dtype a test asks for, head_dim 64 (vLLM's CPU attention refuses smaller heads)."""

from __future__ import annotations

from pathlib import Path

import torch

HIDDEN, NUM_LAYERS, VOCAB = 256, 8, 1000


def make_model(folder: Path, dtype: str = "float32", hidden: int = HIDDEN, init: float = 0.02) -> torch.nn.Module:
    """A tiny random Llama saved in `dtype`; returned in float32 with the saved weights' values. `init` is the
    weights' standard deviation: transformers' default 0.02 makes a model that repeats one token, 0.1 one whose
    greedy answers vary with their prompt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        initializer_range=init,
        torch_dtype=dtype,
    )
    m = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # A final norm whose weight is not all ones (transformers' initial value): a norm applied with the
        # wrong weight, or none, then shows in every layer L compared.
        m.model.norm.weight.copy_(1 + 0.25 * torch.randn(hidden))
    m.to(getattr(torch, dtype)).save_pretrained(folder)
    return m.float()


def make_chat_model(folder: Path, template: str, *, stop_share: float = 0.25) -> tuple[torch.nn.Module, Path]:
    """The tiny Llama in float32 with a byte-level BPE tokenizer and `template` in its folder, its LM head
    changed so that the end-of-turn token is the greedy choice at about `stop_share` of positions: answers
    then end by themselves as often as they run to max_new_tokens. Returns the model and its folder."""
    from transformers import AutoTokenizer

    from tests.support import chat

    m = make_model(folder, init=0.1)
    chat.save_chat_tokenizer(folder, template, vocab_size=VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    generator = torch.Generator().manual_seed(1)
    contexts = torch.randint(0, len(tokenizer), (32, 24), generator=generator)
    with torch.no_grad():
        last = m.model(contexts).last_hidden_state.reshape(-1, m.config.hidden_size)
        head = m.lm_head.weight
        direction = last.mean(0)
        others = (last @ head.T).max(1).values
        # The smallest scale at which the end-of-turn logit beats every other at `stop_share` of positions.
        need = others / (last @ direction)
        scale = torch.quantile(need[need > 0], stop_share).item()
        head[eot] = direction * scale
    m.save_pretrained(folder)
    return m, folder
