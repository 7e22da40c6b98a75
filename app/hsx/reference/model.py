"""Load the causal LM and run one sequence: prefill hidden states plus a greedy decode."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

# Re-exported: callers import these from here.
from hsx.reference.common import DTYPES, ForwardResult, dtype_name

EMBEDDED_MODEL_PATH = "hsx-embedded-tiny-llama"


def embedded_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )


def _embedded_model(dtype: str) -> PreTrainedModel:
    # fork_rng keeps the fixed seed from leaking into the caller's random state.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(embedded_config())
    # The weights are defined as their bf16 values, so every --dtype serves the same model.
    model = model.bfloat16()
    if dtype != "auto":
        # PreTrainedModel.to is typed through functools.wraps, which mypy cannot call as a bound method.
        model = model.to(DTYPES[dtype])  # type: ignore[arg-type]
    return model


def parse_device(device: str) -> torch.device:
    """A torch device this machine has, or ValueError saying why not."""
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from exc
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available (torch.cuda.is_available() is False)")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return parsed


def load_model(path: str | None, dtype: str = "auto", device: str = "cpu") -> tuple[PreTrainedModel, str]:
    """The model in eval mode on `device` and the path to report; `path=None` means the embedded tiny Llama."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto or one of {sorted(DTYPES)}")
    target = parse_device(device)
    if path is None:
        model, reported = _embedded_model(dtype), EMBEDDED_MODEL_PATH
    else:
        torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
        # transformers renamed torch_dtype to dtype in 4.56; older releases silently ignore `dtype`.
        key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **{key: torch_dtype})
        reported = str(path)
    if target.type != "cpu":
        model = model.to(target)  # type: ignore[arg-type]  # see _embedded_model
    return model.eval(), reported


class ModelRunner:
    """Runs one sequence at a time (batch 1, no padding), so a prefill equals a plain HF forward bit for bit,
    on the device the model is on."""

    def __init__(self, model: PreTrainedModel, model_path: str, layers: list[int]):
        self.model = model
        self.model_path = model_path
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.num_hidden_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.max_position_embeddings = int(getattr(config, "max_position_embeddings", 4096))
        self.dtype = model.dtype
        self.device = model.device
        self.dtype_name = dtype_name(model.dtype)
        bad = [i for i in layers if not 0 <= i <= self.num_hidden_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range 0..{self.num_hidden_layers}")
        self.layers = sorted(set(layers))
        # Only the last position's logits feed the decode; a [T, vocab] tensor is waste on long prompts.
        self._logits_kwargs = (
            {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        )

    def run(self, input_ids: list[int], max_new_tokens: int) -> ForwardResult:
        """Hidden states come back in host memory, wherever the model runs: the dumper writes them
        from there. The last layer is copied only if a reply asks for it."""
        with torch.inference_mode():
            ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
            out = self.model(input_ids=ids, output_hidden_states=True, **self._logits_kwargs)
            hidden = {i: out.hidden_states[i][0].contiguous().cpu() for i in self.layers}
            final = out.hidden_states[self.num_hidden_layers][0]
            output_ids = self._greedy_decode(out, max_new_tokens)
        if self.device.type == "cpu":
            return ForwardResult(hidden_states=hidden, final_hidden=final, output_ids=output_ids)
        return ForwardResult(hidden_states=hidden, final_hidden=None, output_ids=output_ids, final_hidden_fn=final.cpu)

    def _greedy_decode(self, prefill_out: Any, max_new_tokens: int) -> list[int]:
        """The next tokens after the prefill's output (transformers' CausalLMOutputWithPast), by argmax."""
        output_ids: list[int] = []
        out = prefill_out
        while len(output_ids) < max_new_tokens:
            next_id = int(out.logits[0, -1].argmax())
            output_ids.append(next_id)
            if len(output_ids) == max_new_tokens:
                break
            out = self.model(
                input_ids=torch.tensor([[next_id]], dtype=torch.long, device=self.device),
                past_key_values=out.past_key_values,
                **self._logits_kwargs,
            )
        return output_ids
