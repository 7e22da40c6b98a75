"""One sample's extraction against the server and its dump root, with no database involved.

Counter-named dumps: clear the root (we own it), send one request, wait for the
single completed `req_*` that matches our ids, move it out, validate. Rid-named dumps: the
request names its own directory, so only that directory is read.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from hsx.backends.capture import Capture
from hsx.backends.dumps import Dump, DumpRejected, DumpRoot, identity_mismatch, move_out, read_meta, validate
from hsx.backends.sglang import GenerateResult, SGLangClient

POLL_S = 0.005
# With no dump still being written and every completed one rejected, waiting longer cannot help.
SETTLE_S = 1.0


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
    def __init__(self, client: SGLangClient, root: DumpRoot, staging: Path, capture: Capture, *, dump_wait_s: float):
        self.client = client
        self.root = root
        self.staging = staging
        self.capture = capture
        self.name_by = capture.name_by
        self.dump_wait_s = dump_wait_s

    def extract(self, input_ids: list[int], *, rid: str, staged_name: str, expect: Expectation) -> Dump:
        """Run the request and return its validated dump, moved to `staging/staged_name`.

        Raises DumpRejected (a failed attempt with a reason), or BackendUnavailable /
        BackendRejected from the client.
        """
        if self.name_by == "rid":
            shutil.rmtree(self.root.rid_dir(rid), ignore_errors=True)
        else:
            self.root.clear()
        result = self.client.prefill(input_ids, rid, return_hidden_states=self.capture.return_hidden_states)
        check_answer(result, len(input_ids))
        found, meta = self._find_rid(rid, input_ids) if self.name_by == "rid" else self._find_scan(input_ids)
        key = found.name
        dest = move_out(found, self.staging / staged_name)
        try:
            dump = validate(
                dest, meta, expect_layers=expect.layers, expect_hidden=expect.hidden_size, expect_dtype=expect.dtype
            )
            dump.key = key
            return dump
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise

    def _find_rid(self, rid: str, input_ids: list[int]) -> tuple[Path, dict]:
        d = self.root.rid_dir(rid)
        deadline = time.monotonic() + self.dump_wait_s
        while not (d / "done").exists():
            if time.monotonic() > deadline:
                shutil.rmtree(d, ignore_errors=True)
                state = "incomplete" if d.exists() else "absent"
                raise DumpRejected("no_dump", f"{d.name} still {state} {self.dump_wait_s:.0f}s after the reply")
            time.sleep(POLL_S)
        meta = read_meta(d)
        why = identity_mismatch(d, meta, input_ids)
        if why is None and meta.get("rid") not in (None, rid):
            why = f"meta rid {meta.get('rid')!r} != {rid!r}"
        if why:
            shutil.rmtree(d, ignore_errors=True)
            raise DumpRejected("not_ours", f"{d.name}: {why}")
        return d, meta

    def _find_scan(self, input_ids: list[int]) -> tuple[Path, dict]:
        start = time.monotonic()
        rejected: dict[str, str] = {}
        while True:
            matches: list[tuple[Path, dict]] = []
            entries = self.root.entries()
            pending = 0
            for d in entries:
                if not (d / "done").exists():
                    pending += 1
                    continue
                if d.name in rejected:
                    continue
                try:
                    meta = read_meta(d)
                    why = identity_mismatch(d, meta, input_ids)
                except DumpRejected as exc:
                    why = exc.reason
                if why is None:
                    matches.append((d, meta))
                else:
                    rejected[d.name] = why
            if len(matches) > 1:
                names = ", ".join(sorted(d.name for d, _ in matches))
                raise DumpRejected("ambiguous", f"{len(matches)} completed dumps match this sample: {names}")
            if matches:
                return matches[0]
            waited = time.monotonic() - start
            if waited > self.dump_wait_s or (rejected and not pending and waited > SETTLE_S):
                seen = "; ".join(f"{k}: {v}" for k, v in sorted(rejected.items())[:5]) or "none"
                raise DumpRejected(
                    "no_dump",
                    f"no completed dump matched after {waited:.1f}s ({pending} incomplete; rejected: {seen})",
                )
            time.sleep(POLL_S)
