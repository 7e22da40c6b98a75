"""Watching the model server: whether it is ready, whether its settings allow whole dumps, which
layers it captures, and when it restarted.

A server that went away is trusted again only once /health says it is ready, and its settings are
read again then: a restarted server may capture other layers or name its dumps differently.
Settings that silently break dumps are detected here, never assumed away.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hsx.backends.capture import Capture, CaptureProblem, decide, describe_model, read_plugin_info
from hsx.backends.dumps import DumpRoot
from hsx.backends.extract import Extractor
from hsx.backends.response import ResponseExtractor
from hsx.backends.sglang import BackendRejected, BackendUnavailable, SGLangClient
from hsx.config import Settings
from hsx.extraction.backoff import Backoff
from hsx.identity import Identity
from hsx.matching import model_key

log = logging.getLogger("hsx.writer")

# Hidden states from dumps in the dump root, or from the server's answers.
SampleExtractor = Extractor | ResponseExtractor

SERVER_RECHECK_S = 60.0


@dataclass(frozen=True)
class ServerVerdict:
    """What a check of the server found, as the writer's status: ready, waiting or refusing."""

    state: str
    reason: str | None = None
    server: dict | None = None  # when ready: what /healthz shows of the server


class ServerWatch:
    def __init__(self, settings: Settings, client: SGLangClient, root: DumpRoot, staging: Path):
        self.settings = settings
        self.client = client
        self.root = root
        self.staging = staging
        # None until a check finds the server ready, and again from the moment it is seen to go away.
        self.extractor: SampleExtractor | None = None
        self.model_info: dict = {}
        self.layers: list[int] | None = None  # the layers the server captures; None: not said
        self.capture: Capture | None = None
        self.backoff = Backoff()
        # The weakest proof of identity among the dumps taken from this server (hsx.identity), or
        # what the server says of its dumps before the first one is taken.
        self.identity: Identity | None = None
        self._boot_id: str | None = None
        self._outage = False
        self._checked_at = 0.0
        self._lock = threading.Lock()
        self._identity_lock = threading.Lock()  # not _lock: a check, which holds that, notes what the server says

    @property
    def usable(self) -> bool:
        return self.extractor is not None

    def ensure(self) -> tuple[SampleExtractor | None, ServerVerdict | None]:
        """The extractor for the server as last checked, checking it first when that is due (none
        usable yet, or the last check older than SERVER_RECHECK_S); with the verdict of that check,
        None when no check ran."""
        extractor = self.extractor
        if extractor is not None and not self._check_due():
            return extractor, None
        with self._lock:
            extractor = self.extractor
            if extractor is not None and not self._check_due():
                return extractor, None
            verdict = self._check()
            return self.extractor, verdict

    def lost(self) -> None:
        """A request found the server gone: nothing is sent until /health says it is back."""
        self.extractor, self._outage = None, True

    def proved(self, identity: Identity | None) -> bool:
        """Note what proved a dump its sample's; True when that is weaker than anything before, which
        /healthz must then show. The first dump that proves only its token count is warned about."""
        if identity is None:
            return False
        with self._identity_lock:
            if self.identity is not None and self.identity.rank <= identity.rank:
                return False
            self.identity = identity
        if identity == Identity.COUNT:
            log.warning(
                "dumps in %s carry neither input ids (input_ids.safetensors or meta input_ids_sha256) nor the "
                "request's rid (meta rid): hsx tells a sample's dump from another request's only by its token "
                "count, which holds only while nothing but hsx sends requests to %s (identity: count)",
                self.root.path,
                self.settings.backend_url,
            )
        return True

    def _check_due(self) -> bool:
        return time.monotonic() - self._checked_at >= SERVER_RECHECK_S

    def _check(self) -> ServerVerdict:
        try:
            if self._outage:
                # A restarting server answers some endpoints before it is ready; /health says when.
                self.client.health()
            model_info = self.client.model_info()
            server_info = self.client.server_info()
        except (BackendUnavailable, BackendRejected) as exc:
            self.lost()
            return ServerVerdict("waiting", f"model server not ready: {exc}")
        try:
            capture = decide(
                self.settings.source,
                self.settings.name_by,
                server_info,
                model_info,
                read_plugin_info(self.root.path),
                self.root.path,
            )
        except CaptureProblem as exc:
            self.extractor = None
            return ServerVerdict("refusing", str(exc))
        boot_id = capture.boot_id
        if self._boot_id and boot_id and boot_id != self._boot_id:
            log.warning("model server restarted (boot id %s -> %s); settings re-read", self._boot_id, boot_id)
        self._boot_id = boot_id
        self.capture = capture
        self.layers = capture.layers
        self.proved(capture.identity)
        self.model_info = describe_model(model_info, server_info)
        if capture.source == "response":
            self.extractor = ResponseExtractor(self.client, self.staging, capture)
        else:
            self.extractor = Extractor(
                self.client,
                self.root,
                self.staging,
                capture,
                dump_wait_s=self.settings.dump_wait_s,
                settle_s=self.settings.dump_settle_s,
            )
        self._outage = False
        self._checked_at = time.monotonic()
        self.backoff.reset()
        server = {
            "url": self.settings.backend_url,
            "source": capture.source,
            "name_by": capture.name_by if capture.source == "dumps" else None,
            "boot_id": boot_id,
            "model_path": model_info.get("model_path"),
            "model_key": model_key(self.model_info),
            "layers": self.layers,
            "layers_from": capture.how,
            "identity": self.identity,
        }
        return ServerVerdict("ready", server=server)
