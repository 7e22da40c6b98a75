"""fp8: `layer_<i>.fp8` float8_e4m3fn [T, hidden] and `layer_<i>.scale` float32 [T] (hsx.storage.fp8).

A value is its code's value x its row's scale, rounded to the job's dtype. The writer makes every scale
a row's largest magnitude / 448, so finite, never negative, and small enough that 448 x scale is a
finite value of the job's dtype; it never writes e4m3fn's NaN codes. A reader checks both before it
decodes a block: a scale or a code no writer makes is a damaged shard, not a value.
"""

from __future__ import annotations

from functools import cache
from typing import ClassVar

import numpy as np

from hsx.dtypes import DType
from hsx.storage import fp8
from hsx.storage.encoding.base import (
    Encoding,
    LayerDecoder,
    LayerEncoder,
    ShardTensors,
    Tensor,
    TensorSpec,
    block_rows,
    bytes_of,
)
from hsx.storage.errors import ShardError
from hsx.storage.floats import from_float32, to_float32

# The largest error of a value relative to its row's largest magnitude: half a step of e4m3fn's top
# binade (16 / 448). The encoder measures errors in float32 on the scaled values, where it is exact.
MAX_ERROR = 1 / 28


class Fp8Encoder(LayerEncoder):
    def __init__(self, key: str, dtype: DType, hidden_size: int):
        super().__init__(key, dtype, hidden_size)
        self.codes: list[np.ndarray] = []
        self.scales: list[np.ndarray] = []
        self.stats.max_error = 0.0

    def encode(self, rows: np.ndarray) -> fp8.Quantized:
        # The errors are those of the codes' values (x scale, in float32); readers round them to the
        # job's dtype, which adds at most half an ulp of that dtype.
        return fp8.quantize(to_float32(rows, self.dtype))

    def _keep(self, block: fp8.Quantized) -> None:
        self.codes.append(block.codes)
        self.scales.append(block.scales.astype("<f4"))
        rows = block.codes.shape[0]
        self.num_rows += rows
        self.stats.raw_bytes += rows * self.row_bytes
        self.stats.bytes += rows * (self.hidden_size + 4)
        self.stats.max_error = max(self.stats.max_error or 0.0, block.max_error)
        self.stats.error_sum += block.error_sum
        self.stats.values += block.values

    def tensors(self) -> list[Tensor]:
        return [
            (f"{self.key}.fp8", "F8_E4M3", (self.num_rows, self.hidden_size), [bytes_of(c) for c in self.codes]),
            (f"{self.key}.scale", "F32", (self.num_rows,), [bytes_of(s) for s in self.scales]),
        ]


@cache
def largest_scale(dtype: DType) -> np.float32:
    """The largest float32 scale whose 448 x scale, in float32 and then rounded to `dtype`, is finite:
    every scale a writer makes of finite values of `dtype` is at most this."""
    lo, hi = 0, int(np.float32(np.finfo(np.float32).max).view(np.uint32))
    while lo < hi:  # positive float32 values are ordered as their bits
        mid = (lo + hi + 1) // 2
        scale = np.array([mid], dtype=np.uint32).view(np.float32)
        with np.errstate(over="ignore"):
            top = (scale * np.float32(fp8.FP8_MAX)).reshape(1, 1)
            back = to_float32(from_float32(top, dtype), dtype)
        if np.isfinite(back).all():
            lo = mid
        else:
            hi = mid - 1
    return np.array([lo], dtype=np.uint32).view(np.float32)[0]


class Fp8Decoder(LayerDecoder):
    def __init__(self, key: str, tensors: ShardTensors, dtype: DType, hidden_size: int):
        super().__init__(key, dtype, hidden_size, tensors.rows)
        tensors.expect(f"{key}.fp8", "F8_E4M3", (tensors.rows, hidden_size))
        tensors.expect(f"{key}.scale", "F32", (tensors.rows,))
        self.codes = tensors.tensor(f"{key}.fp8").reshape(-1, hidden_size)
        self.scales = tensors.tensor(f"{key}.scale").view("<f4")
        self.largest = largest_scale(dtype)

    def quantized(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= start <= stop <= self.num_rows:
            raise ValueError(f"{self.key} has no rows {start}..{stop}")
        codes, scales = self.codes[start:stop], self.scales[start:stop]
        # `not (scale <= largest)` also holds for NaN; the sign bit catches -0.0 and every negative scale
        bad = np.signbit(scales) | ~(scales <= self.largest)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ShardError(
                f"row {start + row}'s scale is {float(scales[row])!r}: not a scale a writer makes "
                f"(finite, 0 to {float(self.largest):g})"
            )
        # e4m3fn's NaN codes, 0x7F and 0xFF, are the largest a byte holds read as signed and as unsigned:
        # two maxima find either, with no scratch copy
        if codes.size and (codes.max() == 0xFF or codes.view(np.int8).max() == 0x7F):
            nan = (codes & np.uint8(0x7F)) == np.uint8(0x7F)
            row = int(np.flatnonzero(nan.any(axis=1))[0])
            raise ShardError(f"row {start + row} holds a NaN code, which no writer makes")
        return codes, scales

    def _rows(self, start: int, stop: int) -> np.ndarray:
        # Checked at once (a few numpy calls, not a few per block), then decoded a block of rows at a time:
        # the numpy passes run in the processor's cache.
        codes, scales = self.quantized(start, stop)
        out = np.empty((stop - start, self.row_bytes), dtype=np.uint8)
        step = block_rows(self.row_bytes)
        for at in range(0, stop - start, step):
            block = slice(at, at + step)
            out[block] = from_float32(fp8.dequantize(codes[block], scales[block]), self.dtype)
        return out


class Fp8(Encoding):
    name = "fp8"
    fp8_codes = True
    layout: ClassVar[dict[str, str]] = {
        "layer_<i>.fp8": "float8_e4m3fn [T, hidden_size]",
        "layer_<i>.scale": "float32 [T]: a value is fp8 x scale, in dtype",
    }

    def tensor_names(self, key: str) -> list[str]:
        return [f"{key}.fp8", f"{key}.scale"]

    def specs(self, key: str, rows: int, dtype: DType, hidden_size: int) -> dict[str, TensorSpec]:
        return {f"{key}.fp8": TensorSpec("F8_E4M3", (rows, hidden_size)), f"{key}.scale": TensorSpec("F32", (rows,))}

    def stored_row_bytes(self, dtype: DType, hidden_size: int) -> int:
        return hidden_size + 4

    def encoder(self, key: str, dtype: DType, hidden_size: int) -> LayerEncoder:
        return Fp8Encoder(key, dtype, hidden_size)

    def decoder(self, key: str, tensors: ShardTensors) -> LayerDecoder:
        assert tensors.dtype is not None and tensors.hidden_size is not None, "an encoded shard's metadata says them"
        return Fp8Decoder(key, tensors, tensors.dtype, tensors.hidden_size)

    def stats_bytes(self, key: str, shapes: dict[str, tuple[int, ...]], dtype: DType) -> int:
        rows, hidden = shapes[f"{key}.fp8"]
        return rows * (hidden + 4)

    def error_problems(self, max_error: float | None, mean_error: float | None) -> list[str]:
        problems = []
        for name, value in (("max_error", max_error), ("mean_error", mean_error)):
            if value is None or not 0 <= value <= MAX_ERROR:
                problems.append(f"{name} {value} is not an fp8 error: 0 to 1/28 ({MAX_ERROR:.6f})")
        if not problems and mean_error is not None and max_error is not None and mean_error > max_error:
            problems.append(f"mean_error {mean_error} exceeds max_error {max_error}")
        return problems
