"""`hsx jobs` prints a table of jobs, or says that there is none rather than print a bare header."""

from __future__ import annotations

import pytest

from hsx.cli import main
from hsx.cli.client import jobs


class NoJobs:
    def iter_jobs(self, state=None, page_size=100):
        return iter([])


@pytest.fixture
def no_jobs(monkeypatch):
    monkeypatch.setattr(jobs, "run", lambda args, body: body(NoJobs()))


@pytest.mark.parametrize(
    "argv, said", [([], "no jobs\n"), (["--state", "running"], "no running jobs\n"), (["--json"], "[]\n")]
)
def test_no_jobs_is_said_in_words(no_jobs, capsys, argv, said):
    assert main(["jobs", *argv]) == 0
    assert capsys.readouterr() == (said, "")
