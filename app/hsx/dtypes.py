"""The tensor dtypes hsx reads and writes, by the names the dump protocol, manifests and torch use.

Each entry says how the dtype appears in a safetensors header, how many bytes one value takes, and
how numpy reads its bytes: numpy has no bfloat16, so bfloat16 values are read as their uint16 bit
patterns (enough to move them and to test them for NaN and Inf; see hsx.storage.finite). The table
imports neither numpy nor torch: the service and the SDK use it without torch, and the torch dtype
is looked up only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    name: str  # "bfloat16", as torch, the dump protocol and manifests spell it
    code: str  # safetensors' header code, "BF16"
    itemsize: int
    numpy: str  # the numpy dtype its bytes are read as (np.dtype accepts it)
    exponent_bits: int = 0  # float formats: the width of the exponent field

    @property
    def is_float(self) -> bool:
        return self.exponent_bits > 0

    @property
    def torch(self) -> torch.dtype:
        import torch

        return getattr(torch, self.name)


_ALL = (
    DType("bfloat16", "BF16", 2, "<u2", exponent_bits=8),
    DType("float16", "F16", 2, "<f2", exponent_bits=5),
    DType("float32", "F32", 4, "<f4", exponent_bits=8),
    DType("float64", "F64", 8, "<f8", exponent_bits=11),
    DType("int64", "I64", 8, "<i8"),
    DType("int32", "I32", 4, "<i4"),
    DType("int16", "I16", 2, "<i2"),
    DType("int8", "I8", 1, "i1"),
    DType("uint8", "U8", 1, "u1"),
    DType("bool", "BOOL", 1, "?"),
    # The codes of the fp8 encoding (hsx.storage.fp8), read as their bytes: a format shards store, never
    # one hidden states arrive in, so it has no exponent width here and counts as no float format (its
    # NaN test and its values are hsx.storage.fp8's, not hsx.storage.finite's).
    DType("float8_e4m3fn", "F8_E4M3", 1, "u1"),
)
DTYPES: dict[str, DType] = {d.name: d for d in _ALL}
DTYPES_BY_CODE: dict[str, DType] = {d.code: d for d in _ALL}

# What model servers dump hidden states in, and so what a shard's layers hold.
HIDDEN_STATE_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")

# How a job's shards store those values: as they came, losslessly compressed (bit for bit), or as
# float8_e4m3fn with a float32 scale per row. The names alone, for the API's models; what each one is
# lives in hsx.storage.encoding, whose registry holds exactly these, in this order (a test holds it to them).
Encoding = Literal["raw", "lossless", "fp8"]
ENCODINGS: tuple[str, ...] = get_args(Encoding)


def sglang_auto_dtype(config: dict[str, Any]) -> str:
    """What SGLang 0.5.23 runs a checkpoint in under `--dtype auto` (srt/configs/model_config.py,
    _get_and_verify_dtype): the checkpoint's dtype (float32 where it names none), except that float32
    is downcast, to bfloat16 for Gemma models and to float16 for every other."""
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype in ("float32", "float"):
        return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"
    return str(dtype)
