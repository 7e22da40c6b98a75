"""The tiny random Llama the real-engine tests serve: made here with transformers (no download), saved
in the dtype a test asks for, head_dim 64 (vLLM's CPU attention refuses smaller heads)."""

from __future__ import annotations

from pathlib import Path

import torch

HIDDEN, NUM_LAYERS, VOCAB = 256, 8, 1000


def make_model(folder: Path, dtype: str = "float32", hidden: int = HIDDEN) -> torch.nn.Module:
    """A tiny random Llama saved in `dtype`; returned in float32 with the saved weights' values."""
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
        torch_dtype=dtype,
    )
    m = LlamaForCausalLM(config).eval()
    m.to(getattr(torch, dtype)).save_pretrained(folder)
    return m.float()
