"""Two job creations that each need 60% of the output volume's free space, racing: the one that checks
second sees the first one's estimate and is refused (507), on both databases. On Postgres the second
check waits for the first creation's transaction (an advisory lock); on SQLite the second creation's
transaction waits to begin."""

from __future__ import annotations

import shutil
import threading
import time

from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.service.errors import InsufficientStorage
from hsx.service.intake import DiskCheck


def create(sessions, disk: DiskCheck, needed: int, name: str) -> None:
    """What intake.store does for one job, in one transaction."""
    with sessions.begin() as s:
        builder = repo.JobBuilder(s, name=name, layers=None)
        disk.check(s, needed, job_id=builder.job.id)
        builder.job.estimated_bytes = needed
        builder.add([repo.NewSample("a", b"\x01\x00\x00\x00", None, 1)])
        builder.finish()


def test_the_second_of_two_racing_creations_sees_the_first(database_url, tmp_path):
    engine = make_engine(database_url)
    upgrade(engine)
    sessions = session_factory(engine)
    disk = DiskCheck(tmp_path, "refuse")
    needed = int(shutil.disk_usage(tmp_path).free * 0.6)
    outcome: list[BaseException | None] = []
    try:
        first = sessions()
        first.begin()
        builder = repo.JobBuilder(first, name="first", layers=None)
        disk.check(first, needed, job_id=builder.job.id)  # fits: nothing else is active
        builder.job.estimated_bytes = needed
        builder.add([repo.NewSample("a", b"\x01\x00\x00\x00", None, 1)])
        builder.finish()

        def second() -> None:
            try:
                create(sessions, disk, needed, "second")
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        racer = threading.Thread(target=second)
        racer.start()
        time.sleep(1.0)
        assert outcome == [], "the second creation decided before the first one's estimate was committed"
        first.commit()
        first.close()
        racer.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], InsufficientStorage), outcome
        with sessions() as s:
            assert [j.name for j in repo.list_jobs(s, state=None, after=None, limit=10)] == ["first"]
    finally:
        engine.dispose()
