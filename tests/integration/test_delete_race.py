"""Two deletes of one finished job racing on Postgres, made deterministic: the loser finds the job gone
(404), not "not finished" (409). On Postgres a request reads the job, then locks it; another request's
delete can commit in between. (SQLite runs one writing transaction at a time, so it cannot race.)"""

from __future__ import annotations

import numpy as np
import pytest

from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.db.models import JobRow
from hsx.service import jobs as service
from hsx.service.errors import NotFound
from hsx.states import JobState

pytestmark = pytest.mark.postgres


def test_a_delete_that_loses_the_race_finds_the_job_gone(postgres_url, tmp_path, monkeypatch):
    engine = make_engine(postgres_url)
    upgrade(engine)
    sessions = session_factory(engine)
    try:
        ids = np.arange(1, 4, dtype="<i4").tobytes()
        with sessions.begin() as s:
            builder = repo.JobBuilder(s, name="race", layers=None)
            builder.add([repo.NewSample("a", ids, None, 3)])
            job_id = builder.finish().id
            s.get(JobRow, job_id).state = JobState.CANCELLED

        read = service.get_job

        def read_then_lose_the_race(*, session, job_id):
            job = read(session=session, job_id=job_id)
            with sessions.begin() as other:  # the other request deletes and commits meanwhile
                assert repo.delete_job(other, job_id) is True
            return job

        monkeypatch.setattr(service, "get_job", read_then_lose_the_race)
        with sessions() as session, pytest.raises(NotFound):
            service.delete_job(session=session, job_id=job_id, output_root=tmp_path, delete_files=False)
    finally:
        engine.dispose()
