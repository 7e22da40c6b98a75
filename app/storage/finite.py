"""NaN and Inf found by integer arithmetic on a tensor's raw bytes, chunk by chunk.

A float value is NaN or infinite exactly when its bits, sign cleared, are at least the all-ones
exponent (equal: infinite; above: NaN), so one integer max per chunk finds any. No tensor library
is needed, bfloat16 included, and the shard writer runs it on each chunk while that chunk is hashed
and written: the bytes are read once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hsx.dtypes import DTYPES, DType

SCRATCH_VALUES = 1 << 20  # values per reduction: bounds the scratch buffer, not the tensor


@dataclass(frozen=True)
class FloatBits:
    """A float format seen as unsigned integers."""

    uint: np.dtype
    magnitude: int  # everything but the sign bit
    exponent: int  # the all-ones exponent: infinity's bits

    @classmethod
    def of(cls, dtype: DType) -> FloatBits:
        if not dtype.is_float:
            raise ValueError(f"{dtype.name} is not a float format")
        bits = 8 * dtype.itemsize
        mantissa_bits = bits - 1 - dtype.exponent_bits
        return cls(
            np.dtype(f"<u{dtype.itemsize}"),
            (1 << (bits - 1)) - 1,
            ((1 << dtype.exponent_bits) - 1) << mantissa_bits,
        )

    def nan_and_inf(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Masks of the NaN and the infinite values among `values` (raw bits of this format)."""
        magnitude = values.view(self.uint) & self.magnitude
        return magnitude > self.exponent, magnitude == self.exponent


class FiniteCheck:
    """Checks buffers of one dtype; keeps one scratch buffer for all of them."""

    def __init__(self, dtype: str):
        self.bits = FloatBits.of(DTYPES[dtype])
        self._scratch = np.empty(0, dtype=self.bits.uint)

    def __call__(self, buffer: bytes | memoryview) -> bool:
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
