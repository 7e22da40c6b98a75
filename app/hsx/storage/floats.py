"""Hidden-state rows between their raw bytes and float32, in numpy alone (no tensor library).

numpy has no bfloat16: its values are the upper halves of float32's bits, so widening one is a shift,
and narrowing rounds to nearest, ties to even, by integer arithmetic on the float32 bits, as torch's
`.to(torch.bfloat16)` does. float16 and float32 are numpy's own. The values these convert are finite
(shards refuse NaN and Inf), so neither direction has to carry a NaN's payload.
"""

from __future__ import annotations

import numpy as np

from hsx.dtypes import DType

_U32 = np.uint32


def to_float32(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """Raw rows (uint8 [rows, row bytes]) of a hidden-state dtype as float32 [rows, values per row]."""
    rows = raw.shape[0]
    if dtype.name == "bfloat16":
        wide = raw.view("<u2").astype(_U32)
        wide <<= _U32(16)
        return wide.view("<f4").reshape(rows, -1)
    values = raw.view(dtype.numpy).reshape(rows, -1)
    return values.astype(np.float32) if dtype.name == "float16" else values


def from_float32(values: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 [rows, values per row] as raw rows of `dtype` (uint8 [rows, row bytes]), rounded to
    nearest with ties to even."""
    rows = values.shape[0]
    if dtype.name == "bfloat16":
        bits = values.view(_U32)
        rounded = bits >> _U32(16)
        rounded &= _U32(1)
        rounded += bits
        rounded += _U32(0x7FFF)
        rounded >>= _U32(16)
        return rounded.astype("<u2").view(np.uint8).reshape(rows, -1)
    return values.astype(dtype.numpy).view(np.uint8).reshape(rows, -1)
