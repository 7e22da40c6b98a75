"""One stored sample's tensors as a small safetensors file, cut from its shard.

The rows are copied as bytes, and an encoded layer's decoded with numpy (hsx.storage.mapped), so the
service needs no tensor library (bfloat16 included): the answer holds what a raw shard would, input_ids,
loss_mask and layer_<i> in the job's dtype, whatever the job's encoding (a lossless layer bit for bit).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session

from hsx.db import repository as repo
from hsx.db.models import SampleRow
from hsx.manifest import job_dir
from hsx.names import shown
from hsx.service.errors import NotFound, NotStored, ShardsMissing
from hsx.service.jobs import get_job
from hsx.states import SampleState
from hsx.storage.mapped import MappedShard
from hsx.storage.safetensors_raw import encode_header


def sample_tensors(*, session: Session, job_id: str, sample_id: str, output_root: Path) -> tuple[SampleRow, bytes]:
    """The stored sample and its input_ids, loss_mask and layer_<i> rows as one safetensors file."""
    job = get_job(session=session, job_id=job_id)
    sample = repo.get_sample(session, job_id, sample_id)
    if sample is None:
        raise NotFound(f"sample {shown(sample_id)}")
    if sample.state != SampleState.SUCCEEDED or sample.shard is None or sample.shard_offset is None:
        raise NotStored(sample_id, sample.state)
    layers = (job.model_info or {}).get("layers", [])
    shard = job_dir(output_root, job_id) / sample.shard
    if not shard.is_file():
        raise ShardsMissing(job_id, [sample.shard])
    data = cut_rows(
        shard,
        ["input_ids", "loss_mask"] + [f"layer_{i}" for i in layers],
        sample.shard_offset,
        sample.num_tokens,
        metadata={"sample_id": sample.sample_id, "job_id": job_id},
    )
    return sample, data


def cut_rows(shard: Path, names: list[str], start: int, count: int, *, metadata: dict[str, str]) -> bytes:
    """Rows start .. start + count of each named tensor in `shard` (layers decoded), as one safetensors
    file; a shard that cannot give them is a ValueError that says why."""
    mapped = MappedShard(shard)
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    parts: list[bytes] = []
    for name in names:
        layout = mapped.layout(name)
        parts.append(mapped.rows(name, start, start + count).tobytes())
        entries.append((name, layout.dtype, (count, *layout.shape[1:])))
    return encode_header(entries, metadata) + b"".join(parts)
