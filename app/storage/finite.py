"""NaN and Inf found by integer arithmetic on a tensor's raw bytes, chunk by chunk.

A float value is NaN or infinite exactly when its bits, sign cleared, are at least the all-ones
exponent, so one integer max per chunk finds any. The service needs no tensor library for it,
and the shard writer runs it on each chunk while that chunk is hashed and written: the bytes
are read once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FloatBits:
    """A float format seen as unsigned integers."""

    uint: type
    magnitude: int  # everything but the sign bit
    exponent: int  # the all-ones exponent: infinity's bits


FLOAT_BITS = {
    "bfloat16": FloatBits(np.uint16, 0x7FFF, 0x7F80),
    "float16": FloatBits(np.uint16, 0x7FFF, 0x7C00),
    "float32": FloatBits(np.uint32, 0x7FFFFFFF, 0x7F800000),
}
SCRATCH_VALUES = 1 << 20  # values per reduction: bounds the scratch buffer, not the tensor


class FiniteCheck:
    """Checks buffers of one dtype; keeps one scratch buffer for all of them."""

    def __init__(self, dtype: str):
        self.bits = FLOAT_BITS[dtype]
        self._scratch = np.empty(0, dtype=self.bits.uint)

    def __call__(self, buffer) -> bool:
        """Whether every value in `buffer` (raw bytes of this dtype) is finite."""
        values = np.frombuffer(buffer, dtype=self.bits.uint)
        if self._scratch.size < min(values.size, SCRATCH_VALUES):
            self._scratch = np.empty(min(values.size, SCRATCH_VALUES), dtype=self.bits.uint)
        for start in range(0, values.size, SCRATCH_VALUES):
            chunk = values[start : start + SCRATCH_VALUES]
            part = self._scratch[: chunk.size]
            np.bitwise_and(chunk, self.bits.magnitude, out=part)
            if part.max() >= self.bits.exponent:
                return False
        return True
