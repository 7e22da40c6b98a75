"""A writer on a real database with the request loop's part played by hand: the test claims samples,
stages real dumps and tells the flusher, which writes real shards. The writer's own request loops find no
model server and claim nothing."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from hsx.config import Settings
from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.extraction.output_root import shared_output_root
from hsx.extraction.writer import Writer
from hsx.matching import Serves
from hsx.reference.dumper import Dumper
from hsx.states import TERMINAL_JOB_STATES

HIDDEN, LAYERS, TOKENS = 64, [1, 2], 8
SAMPLE_BYTES = TOKENS * HIDDEN * 2 * len(LAYERS)  # bfloat16
PER_SHARD = 5


def hidden_states(idx: int, nan: bool = False) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(idx)
    out = {i: torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16) for i in LAYERS}
    if nan:
        out[LAYERS[-1]][3, 5] = float("nan")
    return out


class Stack:
    """A writer on a real database, and the request loop's part played by hand."""

    def __init__(self, tmp: Path, database_url: str, **settings):
        self.settings = Settings(
            backend_url="http://127.0.0.1:9",  # nothing listens: the writer's request loops claim nothing
            dump_root=tmp / "dumps",
            output_root=tmp / "output",
            database_url=database_url,
            shard_max_bytes=PER_SHARD * SAMPLE_BYTES,
            **settings,
        )
        self.engine = make_engine(database_url)
        upgrade(self.engine)
        self.sessions = session_factory(self.engine)
        with self.sessions.begin() as s:
            shared_output_root(s, self.settings.output_root, mark=True)
        self.writer = Writer(self.settings, self.sessions)
        self.writer.acquire()
        self.flusher = self.writer._flusher
        self.started = False

    def start(self) -> None:
        self.writer.start_thread()
        self.started = True

    def stop(self) -> None:
        if self.started:
            self.writer.stop()
        else:
            self.writer.root.release()
        self.engine.dispose()

    def job(self, n: int, options: dict | None = None) -> str:
        ids = np.arange(1, TOKENS + 1, dtype="<i4").tobytes()
        samples = [repo.NewSample(f"s{i:03d}", ids, None, TOKENS) for i in range(n)]
        with self.sessions.begin() as s:
            job = repo.create_job(s, name=None, layers=LAYERS, samples=samples)
            job.options = options
            return job.id

    def claim(self) -> repo.Claimed:
        with self.sessions.begin() as s:
            c = repo.claim_next(s, self.writer.identity)
        assert c is not None
        return c

    def stage(self, c: repo.Claimed, *, nan: bool = False, tell: bool = True) -> None:
        """What the request loop does with a validated dump: stage it, commit, tell the flusher."""
        dumper = Dumper(self.writer.staging / c.job_id, boot_id="b", dtype_name="bfloat16", hidden_size=HIDDEN)
        ids = np.frombuffer(c.input_ids, dtype="<i4").tolist()
        path = dumper.write(
            f"{c.idx:09d}-t{c.try_number}", rid="r", counter=0, input_ids=ids, hidden_states=hidden_states(c.idx, nan)
        )
        model = {"layers": LAYERS, "hidden_size": HIDDEN, "dtype": "bfloat16"}
        with self.sessions.begin() as s:
            repo.set_job_model_info(s, c.job_id, model, Serves.of(LAYERS, {"model_path": "/m"}))
            assert repo.mark_staged(
                s,
                c,
                writer=self.writer.identity,
                staged_path=str(path),
                observed_tokens=TOKENS,
                dump_key="k",
                boot_id="b",
                identity="ids",
            )
        if tell:
            self.flusher.staged(c.job_id, c.sample_pk, SAMPLE_BYTES)
            self.flusher.settle(c.job_id)

    def extract(self, n: int, **kw) -> None:
        for _ in range(n):
            self.stage(self.claim(), **kw)

    def state(self, job_id: str):
        with self.sessions() as s:
            return repo.get_job(s, job_id)

    def wait(self, what, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = what()
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"{what} never held")

    def finished(self, job_id: str):
        return self.wait(lambda: (job := self.state(job_id)).state in TERMINAL_JOB_STATES and job)

    def shards(self, job_id: str) -> list[tuple[str, int]]:
        with self.sessions() as s:
            return sorted((sh.name, sh.num_samples) for sh in repo.job_shards(s, job_id))
