"""One stored sample's tensors as a small safetensors file, cut from its shard.

The rows are copied as bytes, and an encoded layer's decoded with numpy (hsx.storage.mapped), so the
service needs no tensor library (bfloat16 included): the answer holds what a raw shard would, input_ids,
loss_mask and layer_<i> in the job's dtype, whatever the job's encoding (a lossless layer bit for bit).

The file's header and size come from the shard's header and metadata alone (a HEAD reads nothing else);
its rows are read, and decoded, only for the body. Where the shard fails a check (it places the sample
elsewhere than the database does, a layer's index, a frame, a scale), the answer is ShardDamaged.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session

from hsx.db import repository as repo
from hsx.db.models import SampleRow
from hsx.manifest import job_dir
from hsx.names import shown
from hsx.service.errors import NotFound, NotStored, ShardDamaged, ShardsDeleted, ShardsMissing
from hsx.service.jobs import get_job
from hsx.states import SampleState
from hsx.storage.errors import ShardError
from hsx.storage.mapped import MappedShard
from hsx.storage.safetensors_raw import encode_header


class SampleCut:
    """Rows of one sample of the named tensors of a shard, as one safetensors file: `header` and `size`
    from the shard's header and metadata, `body()` reading (and decoding) the rows. A shard that cannot
    give them is a ShardError (or a ValueError for a tensor it does not hold) that says why."""

    def __init__(
        self, shard: Path, names: list[str], sample_id: str, offset: int, count: int, *, metadata: dict[str, str]
    ):
        self.shard = MappedShard(shard)
        self.names = names
        self.start, self.stop = self.shard.place(sample_id, offset, count)
        layouts = [self.shard.layout(name) for name in names]  # each layer's tensors checked, nothing decoded
        self.header = encode_header(
            [(name, layout.dtype, (count, *layout.shape[1:])) for name, layout in zip(names, layouts)], metadata
        )
        self.size = len(self.header) + count * sum(layout.row_bytes for layout in layouts)

    def body(self) -> bytes:
        parts = [self.shard.rows(name, self.start, self.stop).tobytes() for name in self.names]
        return self.header + b"".join(parts)


def sample_tensors(
    *, session: Session, job_id: str, sample_id: str, output_root: Path, read: bool = True
) -> tuple[SampleRow, SampleCut, bytes]:
    """The stored sample, its input_ids, loss_mask and layer_<i> rows as one safetensors file, and that
    file's bytes (empty unless `read`: a HEAD needs the file's size, which its header gives)."""
    job = get_job(session=session, job_id=job_id)
    sample = repo.get_sample(session, job_id, sample_id)
    if sample is None:
        raise NotFound(f"sample {shown(sample_id)}")
    if sample.state != SampleState.SUCCEEDED or sample.shard is None or sample.shard_offset is None:
        raise NotStored(sample_id, sample.state)
    layers = (job.model_info or {}).get("layers", [])
    shard = job_dir(output_root, job_id) / sample.shard
    if not shard.is_file():
        record = repo.get_shard(session, job_id, sample.shard)
        if record is not None and record.deleted_at is not None:
            raise ShardsDeleted(job_id, [sample.shard])
        raise ShardsMissing(job_id, [sample.shard])
    try:
        cut = SampleCut(
            shard,
            ["input_ids", "loss_mask"] + [f"layer_{i}" for i in layers],
            sample.sample_id,
            sample.shard_offset,
            sample.num_tokens,
            metadata={"sample_id": sample.sample_id, "job_id": job_id},
        )
        return sample, cut, cut.body() if read else b""
    except ShardError as exc:
        raise ShardDamaged(job_id, sample.shard, exc.at(sample=sample.sample_id)) from None
