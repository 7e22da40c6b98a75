"""Clear-and-scan's choice among real dump directories on disk (hsx.backends.scan): a dump that proves
only its token count is taken only when nothing else in the root can be the sample's.

Each test writes the dumps with the reference server's Dumper, in the order a misbehaving server
would, and polls the scan by hand between writes, so no outcome depends on a race."""

from __future__ import annotations

import time

import pytest
import torch

from hsx.backends.dumps import DumpRejected, DumpRoot
from hsx.backends.scan import RootScan, snapshot
from hsx.identity import Identity
from hsx.reference.dumper import Dumper

OURS = [11, 12, 13, 14, 15]
SAME_LENGTH = [21, 22, 23, 24, 25]
HIDDEN = 4
RID = "hsx-job-3-t1"


def write(root: DumpRoot, key: str, ids: list[int], *, rid: str, anonymous: bool = True, done: bool = True) -> None:
    hs = {2: torch.randn(len(ids), HIDDEN).to(torch.bfloat16)}
    dumper = Dumper(root.path, boot_id="b", dtype_name="bfloat16", hidden_size=HIDDEN, anonymous=anonymous)
    dumper.write(key, rid=rid, counter=int(key), input_ids=ids, hidden_states=hs, done=done)


def finish(root: DumpRoot, key: str) -> None:
    (root.path / f"req_{key}" / "done").touch()


def scan(root: DumpRoot, *, settle_s: float = 0.0, wait_s: float = 30.0, before=frozenset()) -> RootScan:
    return RootScan(root, OURS, RID, before, wait_s=wait_s, settle_s=settle_s)


@pytest.fixture
def root(tmp_path) -> DumpRoot:
    r = DumpRoot(tmp_path / "dumps")
    r.path.mkdir()
    return r


def rejected(s: RootScan) -> DumpRejected:
    with pytest.raises(DumpRejected) as exc:
        s.poll()
    return exc.value


def test_a_foreign_dump_that_completes_first_is_not_taken_while_ours_is_still_being_written(root):
    # The reported failure: our req_17 written without `done`, a foreign req_18 of the same length done first.
    write(root, "17", OURS, rid=RID, done=False)
    write(root, "18", SAME_LENGTH, rid="foreign")
    s = scan(root)
    assert s.poll() is None and s.poll() is None, "a dump still being written may be ours"
    finish(root, "17")
    err = rejected(s)
    assert err.code == "ambiguous" and "req_17, req_18" in err.reason


def test_a_dump_still_being_written_when_the_wait_ends_is_a_retry_with_its_name(root):
    write(root, "17", OURS, rid=RID, done=False)
    write(root, "18", SAME_LENGTH, rid="foreign")
    s = scan(root, wait_s=0.05)
    time.sleep(0.06)
    err = rejected(s)
    assert err.code == "incomplete" and "req_17" in err.reason and "req_18" in err.reason


def test_the_only_dump_of_its_length_is_taken_once_the_root_stood_still(root):
    write(root, "4", OURS, rid=RID)
    write(root, "5", [1, 2], rid="health")  # another length: rejected, not in the way
    s = scan(root, settle_s=0.2)
    started = time.monotonic()
    found = None
    while found is None:
        found = s.poll()
        time.sleep(0.01)
    assert found.path.name == "req_4" and found.identity == Identity.COUNT
    assert time.monotonic() - started >= 0.2


def test_a_dump_of_the_same_length_appearing_in_the_settle_window_makes_it_ambiguous(root):
    # An asynchronous writer: the foreign (or our own) dump shows up after the reply.
    write(root, "4", OURS, rid=RID)
    s = scan(root, settle_s=60)
    assert s.poll() is None
    write(root, "5", SAME_LENGTH, rid="foreign", done=False)
    assert s.poll() is None
    finish(root, "5")
    assert rejected(s).code == "ambiguous"


def test_a_dump_of_another_length_in_the_settle_window_restarts_it(root):
    write(root, "4", OURS, rid=RID)
    s = scan(root, settle_s=0.3)
    assert s.poll() is None
    time.sleep(0.2)
    write(root, "5", [1], rid="health")
    assert s.poll() is None
    time.sleep(0.2)
    assert s.poll() is None, "the window counts from the last change"
    time.sleep(0.15)
    found = s.poll()
    assert found is not None and found.path.name == "req_4"


def test_a_dump_there_before_the_request_was_sent_is_never_ours(root):
    write(root, "3", SAME_LENGTH, rid="foreign")
    before = snapshot(root)
    write(root, "4", OURS, rid=RID)
    found = scan(root, before=before).poll()
    assert found is not None and found.path.name == "req_4"


def test_dumps_that_carry_ids_prove_themselves_at_once(root):
    write(root, "4", OURS, rid=RID, anonymous=False)
    write(root, "5", SAME_LENGTH, rid="foreign", anonymous=False)
    write(root, "6", SAME_LENGTH, rid="foreign", anonymous=False, done=False)
    found = scan(root, settle_s=60).poll()
    assert found is not None and found.path.name == "req_4" and found.identity == Identity.IDS


def test_a_rid_in_the_meta_proves_the_dump_and_refuses_another_requests(root):
    dumper = Dumper(root.path, boot_id="b", dtype_name="bfloat16", hidden_size=HIDDEN)
    hs = {2: torch.zeros(len(OURS), HIDDEN).to(torch.bfloat16)}
    for key, rid in (("4", "foreign"), ("5", RID)):
        d = dumper.write(key, rid=rid, counter=int(key), input_ids=SAME_LENGTH, hidden_states=hs)
        (d / "input_ids.safetensors").unlink()
        meta = (d / "meta.json").read_text().replace('"input_ids_sha256"', '"x_sha256"')
        (d / "meta.json").write_text(meta)
    found = scan(root, settle_s=60).poll()
    assert found is not None and found.path.name == "req_5" and found.identity == Identity.RID
