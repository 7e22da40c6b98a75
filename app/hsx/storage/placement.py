"""Where a shard's own `__metadata__` places its samples, against which a manifest's placement is checked.

The shard writer records the samples' ids (`sample_ids`) and first rows (`offsets`, in order, the first
0) in each shard's metadata; sample k holds rows offsets[k] .. offsets[k + 1] (the last one to the
shard's end). Readers take a sample's rows from there and refuse a manifest (or database record) that
places it elsewhere: an edited offset would otherwise hand out another sample's rows as this one's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hsx.storage.errors import ShardError


@dataclass(frozen=True)
class Placement:
    """Each sample's rows, start..stop, as its shard's metadata places it."""

    rows: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, metadata: dict[str, str], total: int) -> Placement:
        """What a shard of `total` rows says of its samples; ShardError where its metadata does not
        place them (missing, not JSON, or offsets that do not cut its rows into samples in order)."""
        if "sample_ids" not in metadata or "offsets" not in metadata:
            raise ShardError("its __metadata__ does not place its samples (sample_ids, offsets)")
        try:
            ids, offsets = json.loads(metadata["sample_ids"]), json.loads(metadata["offsets"])
        except json.JSONDecodeError as exc:
            raise ShardError(f"its __metadata__'s sample_ids or offsets are not JSON ({exc})") from None
        if (
            not isinstance(ids, list)
            or not isinstance(offsets, list)
            or len(ids) != len(offsets)
            or len(set(map(str, ids))) != len(ids)
            or not all(isinstance(i, str) for i in ids)
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise ShardError("its __metadata__'s sample_ids and offsets are not a list of distinct ids and their rows")
        stops = [*offsets[1:], total]
        if (offsets and offsets[0] != 0) or any(a >= b for a, b in zip(offsets, stops)):
            raise ShardError(f"its __metadata__'s offsets {offsets} do not cut its {total} rows into samples in order")
        return cls({sid: (start, stop) for sid, start, stop in zip(ids, offsets, stops)})

    def rows_of(self, sample_id: str, offset: int, num_tokens: int) -> tuple[int, int]:
        """The sample's rows start..stop; ShardError unless they are `offset` .. `offset + num_tokens`
        (what the manifest or the database says)."""
        found = self.rows.get(sample_id)
        if found is None:
            raise ShardError("the shard does not hold this sample", sample=sample_id)
        if found != (offset, offset + num_tokens):
            raise ShardError(
                f"recorded at rows {offset}..{offset + num_tokens}, but the shard places it at {found[0]}..{found[1]}",
                sample=sample_id,
            )
        return found
