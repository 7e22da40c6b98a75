"""NaN and Inf found by integer arithmetic on a tensor's raw bytes, chunk by chunk.

A float value is NaN or infinite exactly when its bits, sign cleared, are at least the all-ones
exponent (equal: infinite; above: NaN). Read as signed integers, the positive ones are the largest
values there are; read as unsigned, the negative ones are (sign and all-ones exponent set). So two
integer maxima over the raw bytes find any, with no scratch copy: the shard writer runs them on each
chunk while that chunk is hashed and written, and they cost about what reading it twice from cache
costs. No tensor library is needed, bfloat16 included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hsx.dtypes import DTYPES, DType


@dataclass(frozen=True)
class FloatBits:
    """A float format seen as integers."""

    uint: np.dtype
    magnitude: int  # everything but the sign bit
    exponent: int  # the all-ones exponent: infinity's bits
    sign: int

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
            1 << (bits - 1),
        )

    @property
    def sint(self) -> np.dtype:
        return np.dtype(f"<i{self.uint.itemsize}")

    def nan_and_inf(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Masks of the NaN and the infinite values among `values` (raw bits of this format)."""
        magnitude = values.view(self.uint) & self.magnitude
        return magnitude > self.exponent, magnitude == self.exponent


class FiniteCheck:
    """Checks buffers of one dtype."""

    def __init__(self, dtype: str):
        self.bits = FloatBits.of(DTYPES[dtype])

    def __call__(self, buffer: bytes | memoryview) -> bool:
        """Whether every value in `buffer` (raw bytes of this dtype) is finite."""
        if not len(buffer):
            return True
        positive = np.frombuffer(buffer, dtype=self.bits.sint).max()  # +Inf / +NaN: at least the exponent
        negative = np.frombuffer(buffer, dtype=self.bits.uint).max()  # -Inf / -NaN: at least sign | exponent
        return int(positive) < self.bits.exponent and int(negative) < (self.bits.sign | self.bits.exponent)
