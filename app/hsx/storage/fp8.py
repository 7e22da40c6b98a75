"""The fp8 encoding's arithmetic: float8_e4m3fn codes with one float32 scale per row, in numpy alone.

A row's scale is its largest absolute value / 448 (e4m3fn's largest finite value), so the row's
values divided by it lie in [-448, 448]; each is rounded to the nearest e4m3fn value, ties to even,
which is bit for bit what torch's `(x / scale).to(torch.float8_e4m3fn)` gives (the tests hold the two
to it). A value is `code's value x scale`. A row of zeros has scale 0 and codes 0.

Rounding works on float32 bits: a normal e4m3fn value keeps 3 of float32's 23 mantissa bits (add
half of what is dropped, less one unless the kept part is odd, then cut: round half to even, the carry
running into the exponent as it should); below 2**-6, e4m3fn's values are the multiples of 2**-9,
where rounding is numpy's rint (half to even too).

The error of a value is at most half a step of the e4m3fn grid where it lies: for the largest values of
a row (256..448 x scale) that is 16 x scale, so every value's error is at most 1/28 of its row's
largest magnitude, and less where values are smaller. `errors` measures it as rows are encoded.
"""

from __future__ import annotations

import numpy as np

FP8_MAX = 448.0
_U32 = np.uint32
_SMALLEST_NORMAL = _U32(0x3C800000)  # 2**-6 as float32 bits: below it e4m3fn steps by 2**-9
_EXPONENT_SHIFT = _U32((127 - 7) << 3)  # float32's exponent bias less e4m3fn's, in place below 3 mantissa bits


def _code_values() -> np.ndarray:
    """Every code's value (float32 [256]; the two NaN codes, 0x7F and 0xFF, NaN)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    normal = (1 + mantissa / 8) * np.exp2(exponent - 7.0)
    values = sign * np.where(exponent == 0, mantissa * 2.0**-9, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


CODE_VALUES = _code_values()


def is_nan(codes: np.ndarray) -> np.ndarray:
    """Which codes are NaN (e4m3fn has no infinity)."""
    return (codes & np.uint8(0x7F)) == np.uint8(0x7F)


def row_scales(values: np.ndarray) -> np.ndarray:
    """One float32 scale per row of `values` (float32 [rows, n]): its largest magnitude / 448, stepped
    down by one ulp where 448 x scale would not be a finite float32 (rows near float32's largest)."""
    largest = np.maximum(values.max(axis=1), -values.min(axis=1))
    scales = largest / np.float32(FP8_MAX)
    with np.errstate(over="ignore"):
        overflow = ~np.isfinite(scales * np.float32(FP8_MAX))
    if overflow.any():
        scales[overflow] = np.nextafter(scales[overflow], np.float32(0))
    return scales


def quantize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, n] as (uint8 codes [rows, n], float32 scales [rows])."""
    scales = row_scales(values)
    scaled = values / np.where(scales > 0, scales, np.float32(1))[:, None]
    np.clip(scaled, -FP8_MAX, FP8_MAX, out=scaled)  # a tiny (subnormal) scale may push a value past 448
    bits = scaled.view(_U32)
    magnitude = bits & _U32(0x7FFFFFFF)
    rounded = magnitude >> _U32(20)
    rounded &= _U32(1)
    rounded += magnitude
    rounded += _U32(0x7FFFF)
    rounded >>= _U32(20)
    rounded -= _EXPONENT_SHIFT  # wraps below 2**-6, where the codes are set again just after
    codes = rounded.astype(np.uint8)
    small = magnitude < _SMALLEST_NORMAL
    if small.any():
        codes[small] = np.rint(np.abs(scaled[small]) * np.float32(512)).astype(np.uint8)
    codes |= np.signbit(scaled).view(np.uint8) << np.uint8(7)
    return codes, scales


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """uint8 codes [rows, n] and their float32 scales [rows] as float32 values [rows, n]."""
    values = np.take(CODE_VALUES, codes)  # twice as fast as indexing CODE_VALUES[codes]
    values *= scales[:, None]
    return values


def errors(values: np.ndarray, decoded: np.ndarray, scales: np.ndarray) -> tuple[float, float, int]:
    """How far `decoded` is from `values` (both float32 [rows, n], encoded with `scales`), each value's
    error relative to the largest magnitude of its row (448 x its scale): (the largest, their sum, how
    many values). A row of zeros has none."""
    diff = decoded - values
    np.abs(diff, out=diff)
    largest = scales.astype(np.float64) * FP8_MAX
    per_row = np.where(largest > 0, largest, 1.0)
    worst = diff.max(axis=1) / per_row if diff.size else np.zeros(1)
    total = diff.sum(axis=1, dtype=np.float64) / per_row
    return float(worst.max()), float(total.sum()), int(diff.size)
