"""One output root per database, on SQLite and Postgres: the first service records its folder's
marker, the same folder passes wherever it is mounted, any other folder is refused with the reason."""

from __future__ import annotations

import threading

import pytest

from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.extraction.finishing import finish_job
from hsx.extraction.output_root import shared_output_root
from hsx.storage.output_root import MARKER_NAME, OutputRootMismatch, read_marker


def check(sessions, root, *, mark: bool = True) -> str:
    with sessions.begin() as s:
        return shared_output_root(s, root, mark=mark)


def test_the_first_root_is_marked_and_recorded_and_passes_again(sessions, tmp_path):
    root = tmp_path / "out"
    first = check(sessions, root)
    assert read_marker(root) == first and (root / MARKER_NAME).is_file()
    assert check(sessions, root) == check(sessions, root, mark=False) == first
    # the same folder reached by another path (another host's mount point) is the same root
    (tmp_path / "mnt").symlink_to(root)
    assert check(sessions, tmp_path / "mnt") == first
    with sessions() as s:
        recorded = repo.recorded_output_root(s)
        assert recorded is not None and recorded.root_id == first and recorded.location.endswith(str(root))


def test_another_folder_is_refused_and_left_unmarked(sessions, tmp_path):
    check(sessions, tmp_path / "out")
    with pytest.raises(OutputRootMismatch, match=f"holds no {MARKER_NAME}.*share one output root"):
        check(sessions, tmp_path / "other")
    assert not (tmp_path / "other" / MARKER_NAME).exists()


def test_a_folder_marked_for_another_database_is_refused(sessions, tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'other.db'}")
    upgrade(engine)
    elsewhere = check(session_factory(engine), tmp_path / "elsewhere")
    engine.dispose()
    mine = check(sessions, tmp_path / "out")
    with pytest.raises(OutputRootMismatch, match=f"is marked {elsewhere}.*marked {mine}"):
        check(sessions, tmp_path / "elsewhere")


def test_a_root_whose_marker_is_gone_is_refused_even_when_writing(sessions, tmp_path):
    """A network file system that dropped away leaves its mount point, an empty local folder."""
    root = tmp_path / "out"
    check(sessions, root)
    (root / MARKER_NAME).unlink()
    with pytest.raises(OutputRootMismatch, match=f"holds no {MARKER_NAME}"):
        check(sessions, root)
    # a job's manifest is not written there either
    with sessions.begin() as s:
        job = repo.create_job(s, name=None, layers=None, samples=[repo.NewSample("a", b"\1\0\0\0", None, 1)])
        repo.cancel_job(s, job.id)
        repo.cancel_queued(s, job.id, 10)
    with pytest.raises(OutputRootMismatch), sessions.begin() as s:
        finish_job(s, job.id, root)
    assert not (root / job.id).exists()


@pytest.mark.parametrize("content", ["{broken", '{"format": "other", "id": "x"}'])
def test_an_unreadable_marker_is_refused(sessions, tmp_path, content):
    root = tmp_path / "out"
    root.mkdir()
    (root / MARKER_NAME).write_text(content)
    with pytest.raises(OutputRootMismatch, match=MARKER_NAME):
        check(sessions, root)


def test_services_starting_together_agree_on_one_root(sessions, tmp_path):
    roots = [tmp_path / f"out{i}" for i in range(4)]
    results: list[str] = []
    barrier = threading.Barrier(len(roots))

    def start(root):
        barrier.wait()
        try:
            results.append(check(sessions, root))
        except OutputRootMismatch:
            results.append("refused")

    threads = [threading.Thread(target=start, args=(r,)) for r in roots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r != "refused"]
    assert len(results) == 4 and len(winners) == 1, results
    with sessions() as s:
        recorded = repo.recorded_output_root(s)
        assert recorded is not None and recorded.root_id == winners[0]
