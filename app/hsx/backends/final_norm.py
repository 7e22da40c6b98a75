"""Layer L after the model's final norm, computed by hsx from the layer L a server gives before it.

vLLM's extract_hidden_states takes layer L from the residual stream before the model's final norm; SGLang
and transformers' `hidden_states[L]` take it after. A job whose trainer reads L after the norm (eagle3,
dflash, last) is served from such a server by applying the model's own final norm to each row, as the
model computes it: transformers' RMSNorm of the Llama family,

    x32 = x.float();  n = x32 * rsqrt(mean(x32 ** 2) + eps);  out = weight * n.to(x.dtype)

(the product in the model's dtype, the weight cast to it as loading the model does), with the weight read
from the checkpoint the server reports (that one tensor only: hsx.storage.checkpoint) and eps from its
config (`rms_norm_eps`). An architecture whose final norm is anything else (Gemma's `1 + weight`, OLMo-2's
product before the cast, a LayerNorm with bias) is refused with the reason rather than computed wrongly.
numpy alone: the service runs without torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hsx.dtypes import DTYPES_BY_CODE, DType
from hsx.storage.checkpoint import CheckpointUnreadable, read_tensor
from hsx.storage.floats import from_float32, to_float32
from hsx.storage.safetensors_raw import TensorSpan

# transformers model types whose final norm is the Llama family's RMSNorm above (their modeling files'
# forward is the same, line for line, in transformers 4.57 and 5.x).
RMS_NORM_MODELS = frozenset(
    {
        "llama",
        "mistral",
        "ministral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "phi3",
        "deepseek_v2",
        "deepseek_v3",
        "granite",
        "glm4",
        "smollm3",
    }
)
# Rows normed at a time: bounds the float32 copies a long sample's rows take (4096 rows x 8192 values x 4
# bytes x 3 arrays: 400 MB at most).
BLOCK_ROWS = 4096


class NormUnavailable(Exception):
    """hsx cannot apply this model's final norm; the message says why and what to change."""


@dataclass(frozen=True)
class FinalNorm:
    """The model's final norm, as hsx applies it: where its weight came from, its eps, the weight itself."""

    checkpoint: str
    file: str
    tensor: str
    sha256: str
    eps: float
    weight: np.ndarray = field(compare=False, repr=False)  # float32 [hidden]

    def describe(self) -> dict[str, Any]:
        """What a manifest records of it (`final_norm`)."""
        return {
            "applied_by": "hsx",
            "checkpoint": self.checkpoint,
            "file": self.file,
            "tensor": self.tensor,
            "sha256": self.sha256,
            "eps": self.eps,
        }

    def apply(self, raw: np.ndarray, dtype: DType) -> np.ndarray:
        """Rows of pre-norm values (uint8 [rows, row bytes] of `dtype`) after the norm, as raw rows of `dtype`."""
        x = to_float32(raw, dtype)
        variance = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
        normed = x * (np.float32(1.0) / np.sqrt(variance + np.float32(self.eps)))
        if dtype.name == "float32":
            return from_float32(self.weight * normed, dtype)
        # In the model's dtype: the normed rows rounded, the weight as loaded, their product rounded (the
        # product of two bfloat16 or float16 values is exact in float32, so it is rounded once, as there).
        weight = to_float32(from_float32(self.weight[None, :], dtype), dtype)
        rounded = to_float32(from_float32(normed, dtype), dtype)
        return from_float32(weight * rounded, dtype)

    def apply_in_place(self, span: TensorSpan) -> None:
        """Replace a layer's rows in its file (a staged dump's, hsx's own by then) with them after the norm:
        the same dtype and size, so the file changes nowhere else."""
        dtype = DTYPES_BY_CODE[span.dtype]
        rows, width = span.shape[0], span.row_bytes
        if not rows:
            return
        mapped = np.memmap(span.path, dtype=np.uint8, mode="r+", offset=span.start, shape=(rows, width))
        try:
            for start in range(0, rows, BLOCK_ROWS):
                stop = min(start + BLOCK_ROWS, rows)
                mapped[start:stop] = self.apply(np.ascontiguousarray(mapped[start:stop]), dtype)
            mapped.flush()
        finally:
            del mapped


def load_final_norm(model: dict[str, Any]) -> FinalNorm:
    """The final norm of the model a server describes (hsx.backends.model.describe_model: its path, type,
    hidden size and eps), its weight read from the checkpoint at its path; NormUnavailable otherwise."""
    path, model_type = model.get("model_path"), model.get("model_type")
    hidden, eps = model.get("hidden_size"), model.get("rms_norm_eps")
    if model_type not in RMS_NORM_MODELS:
        raise NormUnavailable(
            f"hsx applies a final norm only where it is transformers' Llama-style RMSNorm (model types "
            f"{', '.join(sorted(RMS_NORM_MODELS))}); this model's type is {model_type or 'not given'}"
        )
    if not isinstance(path, str) or not Path(path).is_dir():
        raise NormUnavailable(
            f"the model's checkpoint {path or '(no path given)'} is not a folder readable where this worker runs, "
            "and hsx reads the final norm's weight from it: make the checkpoint readable here"
        )
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise NormUnavailable(f"{path}/config.json gives no rms_norm_eps: hsx cannot apply the final norm")
    try:
        tensor = read_tensor(path)
    except CheckpointUnreadable as exc:
        raise NormUnavailable(
            f"hsx reads the final norm's weight from the checkpoint, and {exc}: make the checkpoint readable "
            "where this worker runs"
        ) from exc
    dtype = DTYPES_BY_CODE.get(tensor.dtype)
    if dtype is None or dtype.name not in ("bfloat16", "float16", "float32") or tensor.shape != (hidden,):
        raise NormUnavailable(
            f"{tensor.file}:{tensor.name} is {tensor.dtype} {list(tensor.shape)}, not a float vector of the "
            f"hidden size {hidden}"
        )
    weight = to_float32(np.frombuffer(tensor.data, dtype=np.uint8).reshape(1, -1), dtype)[0]
    if not np.isfinite(weight).all():
        raise NormUnavailable(f"{tensor.file}:{tensor.name} holds values that are not finite")
    return FinalNorm(path, os.path.basename(tensor.file), tensor.name, tensor.sha256, float(eps), weight)
