"""An idle writer asks the database for work ever less often, up to once every IDLE_POLL_MAX_S per
request slot however many slots it runs, and still finds a job that another process created (which
cannot wake it) within that bound. Real parts: a synthetic reference server in rid mode (eight
requests in flight, so eight slots), a writer on a real database (SQLite and Postgres); the claims
are counted with SQLAlchemy's own statement hook."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from hsx.config import Settings
from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.extraction.output_root import shared_output_root
from hsx.extraction.request_loop import IDLE_POLL_MAX_S
from hsx.extraction.writer import Writer
from hsx.manifest import load_manifest, read_sample
from hsx.reference.synthetic import synthetic_hidden_states
from hsx.states import TERMINAL_JOB_STATES
from tests.support.procs import Process, free_port, synthetic_server_args

HIDDEN, NUM_LAYERS, VOCAB, LAYERS, SLOTS = 64, 4, 1000, [1, 3], 8
RAMP_S, WINDOW_S = 5.0, 6.0  # the backoff reaches its bound within RAMP_S; claims are counted after it


def is_claim(statement: str) -> bool:
    """The claim's first statement: the oldest job with queued samples this writer may take."""
    return statement.lstrip().startswith("SELECT jobs.id") and "ORDER BY jobs.id" in statement


def wait_for_end(sessions: sessionmaker[Session], job_id: str, timeout: float) -> str:
    """The job's state once it ended, or the state it is in when `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sessions() as s:
            job = repo.get_job(s, job_id)
            if job.state in TERMINAL_JOB_STATES:
                break
        time.sleep(0.1)
    return job.state


def assert_stored(folder: Path, ids: list[list[int]]) -> None:
    """Sample s<i> of the job in `folder` holds ids[i] and its synthetic hidden states."""
    manifest = load_manifest(folder)
    for i, x in enumerate(ids):
        stored = read_sample(folder, manifest, f"s{i}")
        assert stored["input_ids"].tolist() == x
        expected = synthetic_hidden_states(x, LAYERS, HIDDEN, torch.bfloat16)
        for layer in LAYERS:
            assert torch.equal(stored[f"layer_{layer}"], expected[layer]), (i, layer)


def test_an_idle_writer_polls_ever_less_and_still_finds_a_job_created_elsewhere(tmp_path: Path, database_url):
    port = free_port()
    server = Process(
        synthetic_server_args(
            hidden=HIDDEN,
            num_layers=NUM_LAYERS,
            vocab=VOCAB,
            dump_root=tmp_path / "dumps",
            port=port,
            extra=["--name-by", "rid", "--max-batch", str(SLOTS), "--layers", ",".join(map(str, LAYERS))],
        ),
        tmp_path / "server.log",
    )
    engine = make_engine(database_url)
    writer = None
    try:
        server.wait_http(f"http://127.0.0.1:{port}/health")
        settings = Settings(
            backend_url=f"http://127.0.0.1:{port}",
            dump_root=tmp_path / "dumps",
            output_root=tmp_path / "output",
            database_url=database_url,
            max_in_flight=SLOTS,
        )
        upgrade(engine)
        sessions = session_factory(engine)
        with sessions.begin() as s:
            shared_output_root(s, settings.output_root, mark=True)
        claims: list[float] = []

        @event.listens_for(engine, "before_cursor_execute")
        def count(conn, cursor, statement, parameters, context, executemany):
            if is_claim(statement):
                claims.append(time.monotonic())

        writer = Writer(settings, sessions)
        writer.acquire()
        writer.start_thread()
        started = time.monotonic()
        time.sleep(RAMP_S + WINDOW_S)
        window = [t for t in claims if t >= started + RAMP_S]
        assert claims, "the idle writer looked for work"
        # Polling every 0.2 s, eight slots would ask about 240 times in the window.
        bound = SLOTS * (WINDOW_S / IDLE_POLL_MAX_S + 1)
        assert len(window) <= bound, f"{len(window)} claims in {WINDOW_S} s of idling ({len(claims)} in all)"

        # A job created by another process: nothing wakes this writer, its next poll finds the job.
        ids = [[(7 * i + j) % VOCAB + 1 for j in range(5 + i)] for i in range(6)]
        samples = [repo.NewSample(f"s{i}", np.asarray(x, "<i4").tobytes(), None, len(x)) for i, x in enumerate(ids)]
        with sessions.begin() as s:
            job_id = repo.create_job(s, name=None, layers=LAYERS, samples=samples).id
        created = time.monotonic()
        state = wait_for_end(sessions, job_id, timeout=60)
        assert state == "succeeded", state
        first = min(t for t in claims if t >= created)
        assert first - created <= IDLE_POLL_MAX_S + 1.0, "found within the poll bound"
        assert_stored(settings.output_root / job_id, ids)
    finally:
        if writer is not None:
            writer.stop()
        engine.dispose()
        server.stop()
