"""One writer per dump root on the file system: a second service on the same root refuses to start."""

from __future__ import annotations

from tests.support.stack import start_service


def test_second_service_on_the_same_dump_root_refuses(tmp_path):
    dump_root = tmp_path / "dumps"
    first = start_service(tmp_path / "a", f"sqlite:///{tmp_path / 'a.db'}", dump_root=dump_root)
    try:
        second = start_service(tmp_path / "b", f"sqlite:///{tmp_path / 'b.db'}", dump_root=dump_root, wait=False)
        assert second.proc.proc.wait(timeout=60) == 2
        assert "locked by another process" in second.proc.log()
        assert first.get("/healthz").status_code == 200
    finally:
        first.stop()
    # Once the first is gone, the root is free again.
    third = start_service(tmp_path / "c", f"sqlite:///{tmp_path / 'c.db'}", dump_root=dump_root)
    third.stop()
