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
largest magnitude, and less where values are smaller. `quantize` measures it as it rounds, on the
scaled values (where a row's largest magnitude is 448).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def row_scales(values: np.ndarray) -> np.ndarray:
    """One float32 scale per row of `values` (float32 [rows, n]): its largest magnitude / 448, stepped
    down by one ulp where 448 x scale would not be a finite float32 (rows near float32's largest)."""
    largest = np.abs(values).max(axis=1)
    scales = largest / np.float32(FP8_MAX)
    with np.errstate(over="ignore"):
        overflow = ~np.isfinite(scales * np.float32(FP8_MAX))
    if overflow.any():
        scales[overflow] = np.nextafter(scales[overflow], np.float32(0))
    return scales


@dataclass(frozen=True)
class Quantized:
    """Rows as fp8: codes, scales, and how far the codes' values are from the rows' (each value's error
    relative to its row's largest magnitude: the largest, and their sum over `values` values)."""

    codes: np.ndarray  # uint8 [rows, n]
    scales: np.ndarray  # float32 [rows]
    max_error: float
    error_sum: float
    values: int


def quantize(values: np.ndarray) -> Quantized:
    """float32 [rows, n] as fp8 codes and scales, with the errors they make."""
    scales = row_scales(values)
    scaled = values / np.where(scales > 0, scales, np.float32(1))[:, None]
    tiny = scales < np.finfo(np.float32).tiny  # a subnormal scale may push a value past 448
    if tiny.any():
        scaled[tiny] = np.clip(scaled[tiny], -FP8_MAX, FP8_MAX)
    bits = scaled.view(_U32)
    magnitude = bits & _U32(0x7FFFFFFF)
    rounded = magnitude >> _U32(20)
    rounded &= _U32(1)
    rounded += magnitude
    rounded += _U32(0x7FFFF)
    rounded &= _U32(0xFFF00000)  # |value| rounded to 3 mantissa bits: float32 bits of an e4m3fn value
    # Errors in the scaled values, where a row's largest magnitude is 448: relative to it, / 448.
    error = magnitude.view(np.float32) - rounded.view(np.float32)
    rounded >>= _U32(20)
    rounded -= _EXPONENT_SHIFT  # wraps below 2**-6, where the codes are set again just after
    if magnitude.min(initial=_SMALLEST_NORMAL) < _SMALLEST_NORMAL:  # one pass; the mask only where needed
        small = magnitude < _SMALLEST_NORMAL
        below = np.abs(scaled[small])
        steps = np.rint(below * np.float32(512))
        rounded[small] = steps.astype(_U32)
        error[small] = below - steps / np.float32(512)
    sign = bits >> _U32(24)
    sign &= _U32(0x80)
    rounded |= sign
    np.abs(error, out=error)
    worst = float(error.max()) / FP8_MAX if error.size else 0.0
    # numpy sums float32 pairwise: accurate enough for a mean, and no float64 copy
    return Quantized(rounded.astype(np.uint8), scales, worst, float(error.sum()) / FP8_MAX, error.size)


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """uint8 codes [rows, n] and their float32 scales [rows] as float32 values [rows, n]."""
    values = np.take(CODE_VALUES, codes)  # twice as fast as indexing CODE_VALUES[codes]
    values *= scales[:, None]
    return values
