"""Clear-and-scan: find this request's dump among whatever a counter-naming server wrote to the root.

A completed dump that carries the sample's ids, or the rid hsx sent, proves itself and is taken at
once. One that carries neither proves only its token count, and is evidence only when nothing else
can be the sample's dump:

- every dump present has completed or been rejected: a dump still being written may be ours (its
  `done` can come long after the reply) while a foreign one of the same length completes first;
- the root has been still for `settle_s`: a server that writes dumps after it replies (an
  asynchronous writer) may not have started ours yet; a new dump in that window is waited for too;
- it is then the only one of the sample's length: two are an ambiguity, never a guess.

A dump already in the root when the request was sent is someone else's: a server writes a
request's dump only once it has the request. Whatever is not settled within `wait_s` of the reply
is a failed attempt with its reason, retried like any other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.backends.dumps import DumpRejected, DumpRoot, identify, read_meta
from hsx.identity import Identity

POLL_S = 0.005
# With no dump still being written and every completed one rejected, waiting longer cannot help.
GIVE_UP_S = 1.0
# What a reason lists at most of the dumps it names.
NAMED = 5

EntryKey = tuple[str, int]  # (name, inode): a name the server reuses after a restart is another dump


@dataclass(frozen=True)
class Found:
    path: Path
    meta: dict[str, Any]
    identity: Identity


def snapshot(root: DumpRoot) -> frozenset[EntryKey]:
    """The dumps in the root now: taken just before the request is sent, they are none of its own."""
    return frozenset(k for k in (_key(d) for d in root.entries()) if k is not None)


def _key(d: Path) -> EntryKey | None:
    try:
        return d.name, d.stat().st_ino
    except FileNotFoundError:
        return None


@dataclass
class RootScan:
    """One attempt's search of the root, polled until it finds the dump or gives up."""

    root: DumpRoot
    input_ids: list[int]
    rid: str
    before: frozenset[EntryKey]
    wait_s: float
    settle_s: float
    started: float = field(default_factory=time.monotonic)
    _found: dict[EntryKey, Found] = field(default_factory=dict)
    _rejected: dict[EntryKey, str] = field(default_factory=dict)
    _seen: frozenset[tuple[EntryKey, bool]] = frozenset()  # each dump, and whether it is still pending
    _changed_at: float = 0.0

    def __post_init__(self) -> None:
        self._changed_at = self.started

    def run(self) -> Found:
        while True:
            found = self.poll()
            if found is not None:
                return found
            time.sleep(POLL_S)

    def poll(self) -> Found | None:
        """The dump, None to look again, or DumpRejected."""
        present, pending = self._look()
        now = time.monotonic()
        matches = [self._found[k] for k in present if k in self._found]
        proven = [m for m in matches if m.identity != Identity.COUNT]
        if len(proven) > 1:
            raise DumpRejected("ambiguous", f"{len(proven)} completed dumps match this sample: {_names(proven)}")
        if proven:
            return proven[0]
        if len(matches) > 1:
            raise DumpRejected(
                "ambiguous",
                f"{len(matches)} completed dumps have this sample's {len(self.input_ids)} tokens and carry neither "
                f"input ids nor a rid to tell them apart: {_names(matches)}",
            )
        if matches and not pending and now - self._changed_at >= self.settle_s:
            return matches[0]
        waited = now - self.started
        if waited > self.wait_s:
            raise self._timeout(waited, matches, pending)
        if not matches and not pending and self._rejected and waited > GIVE_UP_S:
            raise DumpRejected("no_dump", f"no completed dump matched after {waited:.1f}s ({self._why()})")
        return None

    def _look(self) -> tuple[list[EntryKey], list[str]]:
        """The root's dumps (not those there before the request) and the names of those not complete;
        notes when that picture last changed."""
        present: list[EntryKey] = []
        pending: list[str] = []
        for d in self.root.entries():
            key = _key(d)
            if key is None or key in self.before:
                continue
            present.append(key)
            if not (d / "done").exists():
                pending.append(d.name)
            elif key not in self._found and key not in self._rejected:
                self._examine(key, d)
        seen = frozenset((k, k[0] in pending) for k in present)
        if seen != self._seen:
            self._seen, self._changed_at = seen, time.monotonic()
        return present, pending

    def _examine(self, key: EntryKey, d: Path) -> None:
        try:
            meta = read_meta(d)
            self._found[key] = Found(d, meta, identify(d, meta, self.input_ids, self.rid))
        except DumpRejected as exc:
            self._rejected[key] = exc.reason

    def _timeout(self, waited: float, matches: list[Found], pending: list[str]) -> DumpRejected:
        if pending:
            still = ", ".join(sorted(pending)[:NAMED])
            held = f"; {_names(matches)} has this sample's length but no ids: not taken" if matches else ""
            return DumpRejected(
                "incomplete", f"{len(pending)} dump(s) still without done {waited:.1f}s after the reply: {still}{held}"
            )
        if matches:  # the root never stood still for settle_s: new dumps kept coming
            return DumpRejected(
                "ambiguous",
                f"dumps kept appearing for {waited:.1f}s after the reply, so {_names(matches)} (no ids) cannot be "
                "told from a dump still to come",
            )
        return DumpRejected("no_dump", f"no completed dump matched after {waited:.1f}s ({self._why()})")

    def _why(self) -> str:
        seen = "; ".join(f"{k[0]}: {v}" for k, v in sorted(self._rejected.items())[:NAMED])
        return f"rejected: {seen}" if seen else "none in the root"


def _names(found: list[Found]) -> str:
    return ", ".join(sorted(f.path.name for f in found)[:NAMED])
