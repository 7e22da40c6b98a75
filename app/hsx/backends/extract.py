"""One sample's extraction against the server and its dump root, with no database involved.

Counter-named dumps: clear the root (we own it), send one request, find the one completed `req_*`
that can only be ours (hsx.backends.scan), move it out, validate. Rid-named dumps: the request
names its own directory, so only that directory is read.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from hsx.backends.capture import Capture
from hsx.backends.dumps import Dump, DumpRejected, DumpRoot, identify, move_out, read_meta, validate
from hsx.backends.scan import POLL_S, EntryKey, Found, RootScan, snapshot
from hsx.backends.sglang import GenerateResult, SGLangClient
from hsx.identity import Identity


@dataclass(frozen=True)
class Expectation:
    layers: list[int] | None = None
    hidden_size: int | None = None
    dtype: str | None = None


def check_answer(result: GenerateResult, num_tokens: int) -> None:
    """The answer must be for the whole prompt, none of it served from the prefix cache."""
    if result.cached_tokens:
        raise DumpRejected("cached_tokens", f"server served {result.cached_tokens} prompt tokens from its cache")
    if result.prompt_tokens != num_tokens:
        raise DumpRejected(
            "server_token_count", f"server reports {result.prompt_tokens} prompt tokens, sample has {num_tokens}"
        )


class Extractor:
    def __init__(
        self,
        client: SGLangClient,
        root: DumpRoot,
        staging: Path,
        capture: Capture,
        *,
        dump_wait_s: float,
        settle_s: float,
    ):
        self.client = client
        self.root = root
        self.staging = staging
        self.capture = capture
        self.name_by = capture.name_by
        self.dump_wait_s = dump_wait_s
        self.settle_s = settle_s

    def extract(self, input_ids: list[int], *, rid: str, staged_name: str, expect: Expectation) -> Dump:
        """Run the request and return its validated dump, moved to `staging/staged_name`.

        Raises DumpRejected (a failed attempt with a reason), or BackendUnavailable /
        BackendRejected from the client.
        """
        before: frozenset[EntryKey] = frozenset()
        if self.name_by == "rid":
            shutil.rmtree(self.root.rid_dir(rid), ignore_errors=True)
        else:
            self.root.clear()
            before = snapshot(self.root)
        result = self.client.prefill(input_ids, rid, asks=self.capture.asks)
        check_answer(result, len(input_ids))
        if self.name_by == "rid":
            found = self._find_rid(rid, input_ids)
        else:
            found = RootScan(self.root, input_ids, rid, before, wait_s=self.dump_wait_s, settle_s=self.settle_s).run()
        dest = move_out(found.path, self.staging / staged_name)
        try:
            dump = validate(
                dest,
                found.meta,
                expect_layers=expect.layers,
                expect_hidden=expect.hidden_size,
                expect_dtype=expect.dtype,
            )
            dump.key, dump.identity = found.path.name, found.identity
            return dump
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise

    def _find_rid(self, rid: str, input_ids: list[int]) -> Found:
        d = self.root.rid_dir(rid)
        deadline = time.monotonic() + self.dump_wait_s
        while not (d / "done").exists():
            if time.monotonic() > deadline:
                shutil.rmtree(d, ignore_errors=True)
                state = "incomplete" if d.exists() else "absent"
                raise DumpRejected("no_dump", f"{d.name} still {state} {self.dump_wait_s:.0f}s after the reply")
            time.sleep(POLL_S)
        meta = read_meta(d)
        try:
            proof = identify(d, meta, input_ids, rid)
        except DumpRejected:
            shutil.rmtree(d, ignore_errors=True)
            raise
        # The directory's name is the rid this request was sent with: proof enough without ids.
        return Found(d, meta, Identity.RID if proof == Identity.COUNT else proof)
