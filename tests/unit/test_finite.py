"""FiniteCheck agrees with numpy's isfinite on every 16-bit pattern and on the edges of wider floats."""

from __future__ import annotations

import numpy as np
import pytest

from hsx.storage.finite import FiniteCheck

ALL_16_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def _finite_bfloat16(bits: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32.
    return np.isfinite((bits.astype(np.uint32) << 16).view(np.float32))


@pytest.mark.parametrize(
    ("dtype", "finite"),
    [("bfloat16", _finite_bfloat16), ("float16", lambda bits: np.isfinite(bits.view(np.float16)))],
)
def test_every_16_bit_pattern_alone_and_among_finite_values(dtype, finite):
    check = FiniteCheck(dtype)
    expected = finite(ALL_16_BITS)
    filler = np.full(1000, ALL_16_BITS[expected][123], dtype=np.uint16)  # some finite value
    for bits, ok in zip(ALL_16_BITS, expected):
        values = filler.copy()
        values[517] = bits
        assert check(memoryview(values).cast("B")) == bool(ok), f"{dtype} 0x{int(bits):04x}"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_wider_floats(dtype):
    check = FiniteCheck(dtype)
    info = np.finfo(dtype)
    finite = np.array(
        [0.0, -0.0, 1.5, -2.25, info.max, info.min, info.tiny, -info.tiny, info.smallest_subnormal], dtype
    )
    assert check(finite.tobytes())
    nan_bits = np.array([np.nan, -np.nan], dtype).view(f"<u{finite.itemsize}")
    signalling = nan_bits[0] ^ (1 << (info.nmant - 1)) | 1  # quiet bit cleared, some mantissa bit set
    for bad in [np.inf, -np.inf, np.nan, -np.nan, np.array([signalling]).view(dtype)[0]]:
        values = finite.copy()
        values[4] = bad
        assert not check(values.tobytes()), f"{dtype} {bad!r}"


def test_empty_buffer_is_finite():
    assert FiniteCheck("bfloat16")(b"")
