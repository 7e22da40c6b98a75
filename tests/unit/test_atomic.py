"""Files that appear whole or not at all: FileBatch (an export's files) and the temporary names."""

from __future__ import annotations

import os

import pytest

from hsx.storage.atomic import TEMP_NAME, FileBatch, atomic_file, temp_path


def listing(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_batch_shows_its_files_only_once_committed(tmp_path):
    batch = FileBatch()
    for name in ("a.bin", "sub/b.bin", "sub/deeper/c.bin"):
        with batch.file(tmp_path / name) as f:
            f.write(name.encode())
    # written, not yet committed: only temporary names, none of them a final one
    names = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert len(names) == 3 and all(TEMP_NAME.match(n) for n in names)
    assert batch.commit() == 3
    assert listing(tmp_path) == ["a.bin", "sub", "sub/b.bin", "sub/deeper", "sub/deeper/c.bin"]
    assert (tmp_path / "sub/deeper/c.bin").read_bytes() == b"sub/deeper/c.bin"
    assert batch.commit() == 0  # nothing pending: a second commit renames nothing


def test_a_file_that_fails_leaves_nothing_and_discard_drops_the_rest(tmp_path):
    batch = FileBatch()
    with batch.file(tmp_path / "kept.bin") as f:
        f.write(b"kept")
    assert batch.commit() == 1
    with batch.file(tmp_path / "pending.bin") as f:
        f.write(b"pending")
    with pytest.raises(RuntimeError), batch.file(tmp_path / "broken.bin") as f:
        f.write(b"half")
        raise RuntimeError("encoder failed")
    batch.discard()
    assert listing(tmp_path) == ["kept.bin"]
    assert batch.commit() == 0


def test_a_committed_file_replaces_an_old_one_whole(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"old")
    batch = FileBatch()
    with batch.file(tmp_path / "x.bin") as f:
        f.write(b"new")
    assert (tmp_path / "x.bin").read_bytes() == b"old"
    batch.commit()
    assert (tmp_path / "x.bin").read_bytes() == b"new"


def test_temporary_names_are_recognised_in_both_spellings(tmp_path):
    assert TEMP_NAME.match(temp_path(tmp_path / "m.json").name)
    assert TEMP_NAME.match(f".m.json.tmp-{os.getpid()}")
    assert not TEMP_NAME.match("m.json") and not TEMP_NAME.match(".m.json.tmp-x")
    with atomic_file(tmp_path / "m.json") as f:
        f.write(b"{}")
        assert [p.name for p in tmp_path.iterdir()] == [temp_path(tmp_path / "m.json").name]
    assert listing(tmp_path) == ["m.json"]
