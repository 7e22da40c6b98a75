"""How a job's shards store its hidden states: the registry of encodings, raw, lossless and fp8.

`input_ids` and `loss_mask` are int64 [T] in every encoding; what changes is how each captured layer
`layer_<i>` is stored, which one `Encoding` per module says (docs/api.md, "Output format", shows a reader
of each in plain Python):

- raw (raw.py): `layer_<i>` [T, hidden] of the job's dtype.
- lossless (lossless.py): the rows in blocks, each block's byte planes one zstd frame apiece.
- fp8 (fp8.py): float8_e4m3fn codes and a float32 scale per row.

`ENCODINGS` holds one of each, under the names `hsx.dtypes.ENCODINGS` gives the API, in its order;
`encoding_of(name)` finds one. Writing (the shard writer), reading (hsx.storage.mapped, for the Dataset,
the exports, the tensor route), verifying, the manifest's layout and the disk estimate all go through
it: a module outside hsx.storage never tells encodings apart by name. An encoded shard says which
encoding it is in its `__metadata__` (`encoding`, `dtype` of the decoded values, `hidden_size`);
`shard_encoding` reads that back.
"""

from __future__ import annotations

from hsx.dtypes import DTYPES, DType
from hsx.storage.encoding.base import (
    BLOCK_BYTES,
    PLAIN,
    Encoding,
    LayerDecoder,
    LayerEncoder,
    LayerStats,
    ShardTensors,
    TensorSpec,
    block_rows,
)
from hsx.storage.encoding.fp8 import Fp8
from hsx.storage.encoding.lossless import Lossless
from hsx.storage.encoding.raw import Raw
from hsx.storage.errors import ShardError

__all__ = [
    "BLOCK_BYTES",
    "ENCODINGS",
    "PLAIN",
    "Encoding",
    "LayerDecoder",
    "LayerEncoder",
    "LayerStats",
    "ShardTensors",
    "TensorSpec",
    "block_rows",
    "encoding_of",
    "same_encoding",
    "shard_encoding",
]

ENCODINGS: dict[str, Encoding] = {e.name: e for e in (Raw(), Lossless(), Fp8())}


def encoding_of(name: str) -> Encoding:
    """The encoding of this name; ValueError for one this hsx does not know."""
    found = ENCODINGS.get(name)
    if found is None:
        raise ValueError(f"unknown encoding {name!r}; one of {', '.join(ENCODINGS)}")
    return found


def shard_encoding(metadata: dict[str, str]) -> tuple[Encoding, DType | None, int | None]:
    """The encoding a shard's `__metadata__` names (raw where it names none), with the dtype and hidden
    size an encoded shard records (None for raw); ShardError for what this hsx cannot read."""
    name = metadata.get("encoding", Raw.name)
    found = ENCODINGS.get(name)
    if found is None:
        raise ShardError(f"its metadata names encoding {name!r}, which this hsx does not read")
    if not found.encoded:
        return found, None, None
    dtype = DTYPES.get(metadata.get("dtype", ""))
    hidden = metadata.get("hidden_size", "")
    if dtype is None or not dtype.is_float or not hidden.isdigit() or int(hidden) < 1:
        raise ShardError(
            f"its metadata says encoding {found.name!r}, dtype {metadata.get('dtype')!r}, hidden_size "
            f"{hidden!r}: not an encoding this hsx reads"
        )
    return found, dtype, int(hidden)


def same_encoding(metadata: dict[str, str], name: str) -> None:
    """ShardError unless a shard's `__metadata__` says the encoding `name` (the manifest's)."""
    stored = metadata.get("encoding", Raw.name)
    if stored != name:
        raise ShardError(f"the shard is {stored}, the manifest says {name}")
