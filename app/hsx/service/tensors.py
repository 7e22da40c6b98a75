"""One stored sample's tensors as a small safetensors file, cut from its shard's raw bytes.

The rows are copied as bytes, never decoded, so the service needs no tensor library (bfloat16
included) and answers with exactly what the shard holds.
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
from hsx.storage.safetensors_raw import SafetensorsFormatError, encode_header, read_index


def sample_tensors(*, session: Session, job_id: str, sample_id: str, output_root: Path) -> tuple[SampleRow, bytes]:
    """The stored sample and its input_ids, loss_mask and layer_<i> rows as one safetensors file."""
    job = get_job(session=session, job_id=job_id)
    sample = repo.get_sample(session, job_id, sample_id)
    if sample is None:
        raise NotFound(f"sample {shown(sample_id)}")
    if sample.state != SampleState.SUCCEEDED or sample.shard is None or sample.shard_offset is None:
        raise NotStored(sample_id, sample.state)
    layers = (job.model_info or {}).get("layers", [])
    try:
        data = cut_rows(
            job_dir(output_root, job_id) / sample.shard,
            ["input_ids", "loss_mask"] + [f"layer_{i}" for i in layers],
            sample.shard_offset,
            sample.num_tokens,
            metadata={"sample_id": sample.sample_id, "job_id": job_id},
        )
    except FileNotFoundError:
        raise ShardsMissing(job_id, [sample.shard]) from None
    return sample, data


def cut_rows(shard: Path, names: list[str], start: int, count: int, *, metadata: dict[str, str]) -> bytes:
    """Rows start .. start + count of each named tensor in `shard`, as one safetensors file."""
    spans = read_index(shard)
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    parts: list[bytes] = []
    with open(shard, "rb") as f:
        for name in names:
            if name not in spans:
                raise SafetensorsFormatError(f"{shard.name}: no tensor {name}")
            span = spans[name]
            if not span.shape or start + count > span.shape[0]:
                raise SafetensorsFormatError(
                    f"{shard.name}: {name} {list(span.shape)} has no rows {start}..{start + count}"
                )
            rows = span.read_rows(f.fileno(), start, start + count)
            if len(rows) != count * span.row_bytes:
                raise SafetensorsFormatError(f"{shard.name}: truncated tensor data")
            entries.append((name, span.dtype, (count, *span.shape[1:])))
            parts.append(rows)
    return encode_header(entries, metadata) + b"".join(parts)
