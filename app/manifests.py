"""Build a job's manifest from the database and write it next to the shards."""

from __future__ import annotations

from pathlib import Path

from hsx.db import repository as repo
from hsx.db.models import JobRow
from hsx.storage.manifest import MANIFEST_FORMAT
from sqlalchemy.orm import Session


def job_dir(output_root: Path, job_id: str) -> Path:
    return Path(output_root) / job_id


def manifest_document(session: Session, job: JobRow, state: str | None = None) -> dict:
    info = job.model_info or {}
    return {
        "format": MANIFEST_FORMAT,
        "job_id": job.id,
        "name": job.name,
        "state": state or job.state,
        "model": {k: info.get(k) for k in ("model_path", "num_hidden_layers", "vocab_size")},
        "layers": info.get("layers", job.layers),
        "hidden_size": info.get("hidden_size"),
        "dtype": info.get("dtype"),
        "shard_layout": {
            "input_ids": "int64 [T]",
            "loss_mask": "int64 [T]",
            "layer_<i>": "dtype [T, hidden_size]",
            "sample_rows": "offset .. offset + num_tokens",
        },
        "num_samples": job.num_samples,
        "num_stored": job.n_succeeded,
        "shards": [
            {
                "name": s.name,
                "bytes": s.bytes,
                "sha256": s.sha256,
                "num_samples": s.num_samples,
                "num_tokens": s.num_tokens,
            }
            for s in repo.job_shards(session, job.id)
        ],
        "samples": [
            {"id": r.sample_id, "shard": r.shard, "offset": r.shard_offset, "num_tokens": r.num_tokens}
            for r in repo.iter_stored_samples(session, job.id)
        ],
    }
