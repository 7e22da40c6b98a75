"""The lossless encoding's codec: a block of rows split into byte planes, each plane one zstd frame.

Plane p holds byte p (0: the least significant) of every value of the block, in order. The planes
differ in how much they can be squeezed: a bfloat16's high byte (its sign and most of its exponent)
takes about 2.7 bits a value in hidden states, its low byte (the last exponent bit and the mantissa)
about 8. What zstd gains on such planes is its Huffman coding of literals; repeated strings are rare,
so it runs its fast strategy with a tiny match table (PARAMETERS): as small as level 1's frames, or a
little smaller, at two to three times its speed on the development VM, each plane about as small as
its byte distribution allows. A plane given its own frame keeps its own code table, which one frame
across planes would mix. Measured against zstd and zlib over the raw bytes, Blosc2's byte- and
bit-shuffle filters in front of zstd and LZ4, and lzma over planes: docs/performance.md, "Encodings".

Each frame records its content size and carries zstd's content checksum (a 32-bit xxhash of the
plane), which zstd checks as it decompresses: a byte changed inside a frame fails its block's decoding
instead of changing values unseen. Frames written before they carried checksums still read; they are
checked where their header says they have one.

zstd comes from the `zstandard` package; Python 3.14's `compression.zstd` reads the same frames.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

# strategy 1 (fast), one probe into a 64-entry table, matches of 7 bytes or more, a 128 KiB window;
# the content size and checksum in every frame
PARAMETERS = zstandard.ZstdCompressionParameters(
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
    strategy=1,
    write_content_size=1,
    write_checksum=1,
)

_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    # One per thread: a (de)compressor holds its own working memory and is not to be shared.
    compressor: zstandard.ZstdCompressor | None = getattr(_local, "compressor", None)
    if compressor is None:
        compressor = _local.compressor = zstandard.ZstdCompressor(compression_params=PARAMETERS)
    return compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    decompressor: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    return decompressor


def _unsigned(itemsize: int) -> np.dtype:
    return np.dtype(f"<u{itemsize}")


def compress(rows: np.ndarray, itemsize: int) -> list[bytes]:
    """Rows (uint8 [rows, row bytes], values of `itemsize` bytes) as one zstd frame per byte plane."""
    # Planes cut by shifting whole values (about twice as fast as copying every itemsize-th byte).
    values = np.ascontiguousarray(rows).reshape(-1).view(_unsigned(itemsize))
    compressor = _compressor()
    frames = []
    for p in range(itemsize):
        plane = (values >> values.dtype.type(8 * p)).astype(np.uint8) if p else values.astype(np.uint8)
        frames.append(compressor.compress(plane.data))
    return frames


def decompress(frames: list[np.ndarray], itemsize: int, nbytes: int) -> np.ndarray:
    """The `nbytes` of values the frames (uint8 arrays) of one block hold, as uint8 [nbytes]. Each frame's
    header must declare its plane's nbytes / itemsize bytes before anything is decompressed (so no frame
    takes more memory than its block needs), hold one whole frame and nothing after it, and match its
    checksum where it carries one; a frame that does not is a ValueError naming its plane."""
    if len(frames) != itemsize or nbytes % itemsize:
        raise ValueError(f"a block of {nbytes} bytes of {itemsize}-byte values has {len(frames)} planes")
    count = nbytes // itemsize
    planes = []
    decompressor = _decompressor()
    for p, frame in enumerate(frames):
        data = frame.data
        try:
            declared = zstandard.get_frame_parameters(data).content_size
        except zstandard.ZstdError as exc:
            raise ValueError(f"byte plane {p}: not a zstd frame header ({exc})") from exc
        if declared != count:
            shown = "no size" if declared == zstandard.CONTENTSIZE_UNKNOWN else f"{declared} bytes"
            raise ValueError(f"byte plane {p} declares {shown}, expected {count}")
        try:
            decoded = decompressor.decompress(data, max_output_size=count, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise ValueError(f"byte plane {p}: not a sound zstd frame ({exc})") from exc
        if len(decoded) != count:
            raise ValueError(f"byte plane {p} holds {len(decoded)} bytes, expected {count}")
        planes.append(np.frombuffer(decoded, dtype=np.uint8))
    # Values put together by shifts, the most significant plane first (faster than strided byte copies).
    values = planes[-1].astype(_unsigned(itemsize))
    for plane in reversed(planes[:-1]):
        values <<= values.dtype.type(8)
        values |= plane
    return values.view(np.uint8)


def has_checksum(frame: np.ndarray) -> bool:
    """Whether a frame's header says it carries zstd's content checksum (False for one without a header)."""
    try:
        return bool(zstandard.get_frame_parameters(frame.data).has_checksum)
    except zstandard.ZstdError:
        return False
