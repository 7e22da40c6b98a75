"""Hidden states from dumps an SGLang-style server writes into the dump root.

Two servers write them:

- the reference server, or a patched SGLang, that describes its dumps in its server info (`hs_dump`):
  named as it says; one that says nothing is taken for a patched SGLang naming its dumps by counter;
- stock SGLang with the hsx-sglang plugin, which writes `hsx-plugin.json` into the dump root
  (deploy/sglang/README.md): dumps named by rid, only for rids with its prefix, and only for requests
  whose batch carries per-request row counts (`return_logprob: true` makes SGLang fill them and keeps the
  answer small).

Counter-named dumps: clear the root (we own it), send one request, find the one completed `req_*` that
can only be ours (hsx.backends.scan), move it out, validate; one request at a time. Rid-named dumps: the
request names its own directory, so only that directory is read, and several requests may run at once.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from hsx.backends.dumps import Dump, DumpRejected, identify, move_out, read_meta, validate
from hsx.backends.engine import DEFAULT_RID_PREFIX, Capture, CaptureProblem, Expectation, Server
from hsx.backends.model import describe_model
from hsx.backends.scan import POLL_S, EntryKey, Found, RootScan, snapshot
from hsx.backends.sglang import PLUGIN_INFO_FILE, Said, SGLangEngine, check_answer
from hsx.identity import Identity
from hsx.sources import Source


class DumpsEngine(SGLangEngine):
    source = Source.DUMPS

    def __init__(self, server: Server, capture: Capture, *, plugin: bool = False, flags_hint: str = ""):
        super().__init__(server, capture)
        self.root = server.root
        self.plugin = plugin  # the dumps are the hsx-sglang plugin's
        self._flags_hint = flags_hint  # why a stock server might write no dumps at all, said after a failed probe

    @classmethod
    def of(cls, server: Server, said: Said, *, auto: bool) -> DumpsEngine:
        """The engine for what the server says: its own description of its dumps, else the plugin's, else
        counter-named dumps. It takes any SGLang-style server, so auto tries it after the others."""
        said.check_whole_prompts()
        model = describe_model(said.model_info, said.server_info)
        described = said.described_dumps
        if said.plugin_info is not None and described is None:
            return cls(server, _plugin_capture(said, model, server), plugin=True)
        dump = described or {}
        name_by = server.name_by if server.name_by != "auto" else str(dump.get("name_by", "counter"))
        capture = Capture(
            layers=[int(i) for i in dump["layers"]] if dump.get("layers") else None,
            model=model,
            layers_from="the server's dumps",
            name_by=name_by,
            boot_id=dump.get("boot_id"),
            identity=_said_identity(dump, name_by),
            applies_seed=said.applies_seed,
        )
        return cls(server, capture, flags_hint="" if described else _flags_hint(said))

    @property
    def by_rid(self) -> bool:
        return self.capture.name_by == "rid"

    @property
    def concurrent(self) -> bool:
        return self.by_rid  # counter naming needs the root to itself

    def leftovers(self) -> list[Path]:
        return self.root.entries() if self.by_rid else []

    def extract(self, input_ids: list[int], *, rid: str, staged_name: str, expect: Expectation) -> Dump:
        before: frozenset[EntryKey] = frozenset()
        if self.by_rid:
            shutil.rmtree(self.root.rid_dir(rid), ignore_errors=True)
        else:
            self.root.clear()
            before = snapshot(self.root)
        # The plugin needs the batch's per-request row counts, which SGLang fills when a request asks
        # for logprobs (or hidden states, whose rows would all come back as JSON).
        result = self.client.prefill(input_ids, rid, also_returns="logprob" if self.plugin else None)
        check_answer(result, len(input_ids))
        if self.by_rid:
            found = self._find_rid(rid, input_ids)
        else:
            wait_s, settle_s = self.server.dump_wait_s, self.server.settle_s
            found = RootScan(self.root, input_ids, rid, before, wait_s=wait_s, settle_s=settle_s).run()
        dest = move_out(found.path, self.server.staging / staged_name)
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
        wait_s = self.server.dump_wait_s
        deadline = time.monotonic() + wait_s
        while not (d / "done").exists():
            if time.monotonic() > deadline:
                shutil.rmtree(d, ignore_errors=True)
                state = "incomplete" if d.exists() else "absent"
                raise DumpRejected("no_dump", f"{d.name} still {state} {wait_s:.0f}s after the reply")
            time.sleep(POLL_S)
        meta = read_meta(d)
        try:
            proof = identify(d, meta, input_ids, rid)
        except DumpRejected:
            shutil.rmtree(d, ignore_errors=True)
            raise
        # The directory's name is the rid this request was sent with: proof enough without ids.
        return Found(d, meta, Identity.RID if proof == Identity.COUNT else proof)

    def probe_hint(self) -> str:
        if not self.plugin:
            return self._flags_hint
        return (
            f"; {PLUGIN_INFO_FILE} in the dump root describes the hsx-sglang plugin, but it did not dump the "
            "probe: the file may be left from an earlier launch, or the plugin did not load in this one (the "
            "server's log says 'Failed to load plugin'); start the server with the plugin (SGLANG_PLUGINS="
            f"hsx_dump, HSX_DUMP_ROOT), or remove {PLUGIN_INFO_FILE} to use the server's answers"
        )


def _flags_hint(said: Said) -> str:
    """What a failed probe may mean on a server that neither describes dumps nor has the plugin's file: a
    stock SGLang whose hidden-state options are all off writes nothing and returns no rows."""
    info = said.server_info
    if any(info.get(flag) for flag in ("enable_return_aux_hidden_states", "enable_return_hidden_states")):
        return ""
    if not {"enable_return_aux_hidden_states", "enable_return_hidden_states"} & info.keys():
        return ""  # not an SGLang that says its options: a patched server writes dumps without them
    return (
        "; the server's /get_server_info says both hidden-state options are off (enable_return_aux_hidden_states, "
        "enable_return_hidden_states): launch it with --enable-return-aux-hidden-states --speculative-algorithm "
        "EAGLE3 and the hsx-sglang plugin (SGLANG_PLUGINS=hsx_dump, HSX_DUMP_ROOT set to this writer's --dump-root)"
    )


def _said_identity(described: dict[str, Any], name_by: str) -> Identity | None:
    """What the dumps will prove before the first is read: what a server that describes them (hs_dump)
    says, else at least the rid where they are named by it; None where only the dumps can tell."""
    said = described.get("identity")
    if said in tuple(Identity):
        return Identity(said)
    return Identity.RID if name_by == "rid" else None


def _plugin_capture(said: Said, model: dict[str, Any], server: Server) -> Capture:
    info = said.plugin_info or {}
    if info.get("name_by") != "rid" or (server.name_by not in ("auto", "rid")):
        raise CaptureProblem(f"the hsx-sglang plugin names dumps by rid, but --name-by is {server.name_by}")
    if said.server_info.get("enable_return_aux_hidden_states") is False:
        raise CaptureProblem(
            f"{server.root.path / PLUGIN_INFO_FILE} describes a plugin, but the server does not capture aux "
            "hidden states: restart it with --enable-return-aux-hidden-states --speculative-algorithm EAGLE3"
        )
    return Capture(
        layers=[int(i) for i in info["layers"]],
        model=model,
        layers_from=f"the hsx-sglang plugin's dumps ({PLUGIN_INFO_FILE})",
        name_by="rid",
        rid_prefix=str(info.get("rid_prefix") or DEFAULT_RID_PREFIX),
        boot_id=info.get("boot_id"),
        identity=Identity.RID,
        applies_seed=said.applies_seed,
    )
