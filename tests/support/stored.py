"""A finished job in a real database, its shards written by hsx's own shard writer: what the service's
routes read, without a model server or a writer running.

`stored_job` creates the job and its samples, takes each through claim and staging as the request loop
does, writes the shards (`write_shard`, the job's encoding), records them as the flusher does
(`commit_shard`) and ends the job with its manifest (`finish_job`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from hsx.db import repository as repo
from hsx.extraction.finishing import finish_job
from hsx.extraction.output_root import shared_output_root
from hsx.manifest import Manifest, job_dir, load_manifest
from hsx.matching import Serves
from hsx.storage.shards import ShardSample, shard_name, write_shard
from tests.support.jobs import Sample, random_samples, raw_bytes


def stored_job(
    sessions: sessionmaker[Session],
    output_root: Path,
    *,
    encoding: str = "raw",
    layers: tuple[int, ...] = (2, 4, 5, 8),
    hidden: int = 64,
    dtype: str = "bfloat16",
    lengths: tuple[int, ...] = (40, 50, 30),
    per_shard: int = 2,
) -> tuple[str, Manifest, list[Sample]]:
    """The finished job's id, its manifest (as written next to its shards) and its samples."""
    samples = random_samples(len(lengths), list(layers), hidden, dtype, lengths=list(lengths))
    new = [
        repo.NewSample(s.id, s.input_ids.numpy().astype("<i4").tobytes(), None, int(s.input_ids.shape[0]))
        for s in samples
    ]
    with sessions.begin() as session:
        shared_output_root(session, output_root, mark=True)
        job = repo.create_job(session, name="stored", layers=list(layers), samples=new)
        job.options = {"encoding": encoding}
        job_id = job.id
    model = {"layers": list(layers), "hidden_size": hidden, "dtype": dtype, "num_hidden_layers": max(layers)}
    claimed: dict[str, repo.Claimed] = {}
    for _ in samples:
        with sessions.begin() as session:
            c = repo.claim_next(session, "test-writer")
            assert c is not None
            repo.set_job_model_info(session, job_id, model, Serves.of(list(layers), {"model_path": "/m"}))
            repo.mark_staged(
                session,
                c,
                writer="test-writer",
                staged_path=str(output_root / "staged"),
                observed_tokens=c.num_tokens,
                dump_key=f"k{c.idx}",
                boot_id="b",
                identity="ids",
            )
            claimed[c.sample_id] = c
    folder = job_dir(output_root, job_id)
    folder.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(samples), per_shard):
        group = samples[start : start + per_shard]
        with sessions.begin() as session:
            number = repo.reserve_shard_number(session, job_id)
        info = write_shard(
            folder / shard_name(number),
            [
                ShardSample(
                    s.id,
                    s.input_ids.numpy().astype(np.int64),
                    s.loss_mask.numpy().astype(np.int64),
                    {i: raw_bytes(s.layers[i]) for i in layers},
                )
                for s in group
            ],
            list(layers),
            dtype,
            hidden,
            encoding,
        )
        stats = None if info.layer_stats is None else {str(i): v.to_json() for i, v in info.layer_stats.items()}
        placed = [(claimed[s.id].sample_pk, off, int(s.input_ids.shape[0])) for s, off in zip(group, info.offsets)]
        with sessions.begin() as session:
            repo.commit_shard(
                session, job_id, name=info.name, nbytes=info.bytes, sha256=info.sha256, placed=placed, layer_stats=stats
            )
    with sessions.begin() as session:
        assert finish_job(session, job_id, output_root) is not None
    return job_id, load_manifest(folder), samples
