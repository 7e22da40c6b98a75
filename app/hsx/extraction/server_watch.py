"""Watching the model server: whether it is ready, whether its settings allow whole dumps, which
layers it captures, and when it restarted.

A server that went away is trusted again only once /health says it is ready, and its settings are
read again then: a restarted server may capture other layers or name its dumps differently.
Settings that silently break dumps are detected here, never assumed away.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.backends.capture import (
    PLUGIN_INFO_FILE,
    Capture,
    CaptureProblem,
    ServerLimits,
    decide,
    describe_model,
    read_plugin_info,
)
from hsx.backends.dumps import DumpRejected, DumpRoot
from hsx.backends.extract import Expectation, Extractor
from hsx.backends.response import ResponseExtractor
from hsx.backends.sglang import BackendRejected, BackendUnavailable, SGLangClient
from hsx.backends.vllm import VLLMClient, VLLMExtractor, read_vllm_info, vllm_capture
from hsx.config import Settings
from hsx.extraction.backoff import Backoff
from hsx.identity import Identity
from hsx.matching import model_key

log = logging.getLogger("hsx.writer")

# The probe: a few tokens every vocabulary has.
PROBE_IDS = [1, 2, 3, 4]

# Hidden states from dumps in the dump root, from the server's answers, or from vLLM's files.
SampleExtractor = Extractor | ResponseExtractor | VLLMExtractor

SERVER_RECHECK_S = 60.0


@dataclass(frozen=True)
class ServerVerdict:
    """What a check of the server found, as the writer's status: ready, waiting or refusing."""

    state: str
    reason: str | None = None
    server: dict[str, Any] | None = None  # when ready: what /healthz shows of the server


class ServerWatch:
    def __init__(
        self, settings: Settings, client: SGLangClient, root: DumpRoot, staging: Path, vllm: VLLMClient | None = None
    ):
        self.settings = settings
        self.client = client
        self.vllm = vllm or VLLMClient(settings.backend_url, settings.request_timeout_s)
        self._vllm_model = ""  # the model name vLLM's requests give
        self.root = root
        self.staging = staging
        # None until a check finds the server ready, and again from the moment it is seen to go away.
        self.extractor: SampleExtractor | None = None
        self.model_info: dict[str, Any] = {}
        self.layers: list[int] | None = None  # the layers the server captures; None: not said
        self.limits = ServerLimits()  # what the server accepts, as last found ready
        self.capture: Capture | None = None
        self.backoff = Backoff()
        # The weakest proof of identity among the dumps taken from this server (hsx.identity), or
        # what the server says of its dumps before the first one is taken.
        self.identity: Identity | None = None
        self._observed = False  # whether `identity` comes from a dump taken, not from what the server says
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

    def proved(self, identity: Identity | None, *, said: bool = False) -> bool:
        """Note what proved a dump its sample's (or, with `said`, what the server says its dumps will
        prove, which holds only until the first dump is taken); True when /healthz must show a new
        value: the first dump's proof, or one weaker than any before. The first `count` is warned about."""
        if identity is None:
            return False
        with self._identity_lock:
            if said and self._observed:
                return False
            if not said and self._observed and self.identity is not None and self.identity.rank <= identity.rank:
                return False
            changed = identity != self.identity
            self.identity, self._observed = identity, self._observed or not said
        if changed and identity == Identity.COUNT:
            log.warning(
                "dumps in %s carry neither input ids (input_ids.safetensors or meta input_ids_sha256) nor the "
                "request's rid (meta rid): hsx tells a sample's dump from another request's only by its token "
                "count, which holds only while nothing but hsx sends requests to %s (identity: count)",
                self.root.path,
                self.settings.backend_url,
            )
        return changed

    def _extractor_for(self, capture: Capture) -> SampleExtractor:
        if capture.source == "vllm":
            return VLLMExtractor(
                self.vllm,
                self.root.path,
                self.staging,
                capture,
                model=self._vllm_model,
                wait_s=self.settings.dump_wait_s,
            )
        if capture.source == "response":
            return ResponseExtractor(self.client, self.staging, capture)
        return Extractor(
            self.client,
            self.root,
            self.staging,
            capture,
            dump_wait_s=self.settings.dump_wait_s,
            settle_s=self.settings.dump_settle_s,
        )

    def _check_due(self) -> bool:
        return time.monotonic() - self._checked_at >= SERVER_RECHECK_S

    def _check(self) -> ServerVerdict:
        read = self._read_vllm if self._serves_vllm() else self._read_sglang
        try:
            found = read()
        except (BackendUnavailable, BackendRejected) as exc:
            self.lost()
            return ServerVerdict("waiting", f"model server not ready: {exc}")
        except CaptureProblem as exc:
            self.extractor = None
            return ServerVerdict("refusing", str(exc))
        return self._take(*found)

    def _serves_vllm(self) -> bool:
        source = self.settings.source
        return source == "vllm" or (source == "auto" and read_vllm_info(self.root.path) is not None)

    def _read_sglang(self) -> tuple[Capture, dict[str, Any], ServerLimits]:
        """The capture, the described model and the limits of an SGLang-style server."""
        if self._outage:
            # A restarting server answers some endpoints before it is ready; /health says when.
            self.client.health()
        model_info = self.client.model_info()
        server_info = self.client.server_info()
        capture = decide(
            self.settings.source,
            self.settings.name_by,
            server_info,
            model_info,
            plugin_info=read_plugin_info(self.root.path),
            dump_root=self.root.path,
        )
        return capture, describe_model(model_info, server_info), ServerLimits.of_sglang(model_info, server_info)

    def _read_vllm(self) -> tuple[Capture, dict[str, Any], ServerLimits]:
        """The same of a vLLM server, from what hsx's connector wrote into the dump root; its prompt may
        take its context length but the one token each request generates."""
        self.vllm.health()
        self._vllm_model, context = self.vllm.model()
        capture, described = vllm_capture(read_vllm_info(self.root.path), self.root.path)
        return capture, described, ServerLimits.said(described.get("vocab_size"), context and context - 1)

    def _take(self, capture: Capture, described: dict[str, Any], limits: ServerLimits) -> ServerVerdict:
        """Use the capture found: probed first when the server is new or restarted."""
        boot_id = capture.boot_id
        restarted = bool(self._boot_id and boot_id and boot_id != self._boot_id)
        if restarted:
            log.warning("model server restarted (boot id %s -> %s); settings re-read", self._boot_id, boot_id)
        probe_due = self.extractor is None or restarted
        self._boot_id = boot_id
        self.capture = capture
        self.layers = capture.layers
        self.proved(capture.identity, said=True)
        self.model_info = described
        self.limits = limits
        extractor = self._extractor_for(capture)
        if probe_due:
            try:
                problem = probe(extractor, self.staging)
            except BackendUnavailable as exc:
                self.lost()
                return ServerVerdict("waiting", f"model server not ready: {exc}")
            if problem is not None:
                self.extractor = None
                return ServerVerdict("refusing", problem)
        self.extractor = extractor
        self._outage = False
        self._checked_at = time.monotonic()
        self.backoff.reset()
        server = {
            "url": self.settings.backend_url,
            "source": capture.source,
            "name_by": capture.name_by if capture.source == "dumps" else None,
            "boot_id": boot_id,
            "model_path": described.get("model_path"),
            "model_key": model_key(self.model_info),
            "layers": self.layers,
            "layers_from": capture.how,
            "identity": self.identity,
            # What the server accepts; registered with the writer, where an API checks samples against it.
            "vocab_size": limits.vocab_size,
            "max_prompt_tokens": limits.max_prompt_tokens,
        }
        return ServerVerdict("ready", server=server)


def probe(extractor: SampleExtractor, staging: Path) -> str | None:
    """Send one small request the way samples go, before any sample is spent on this server (at
    start, after an outage, after a restart): None when it gave whole hidden states, else why not.
    A setup that refuses every request, a plugin that did not load, or an hsx-plugin.json left by an
    earlier launch in front of a server without the plugin all show here, as the writer's reason to
    refuse, instead of as every sample failing. BackendUnavailable passes through."""
    capture = extractor.capture
    rid = f"{capture.rid_prefix}probe-{uuid.uuid4().hex[:12]}"
    try:
        extractor.extract(PROBE_IDS, rid=rid, staged_name=f"probe/{rid}", expect=Expectation(layers=capture.layers))
    except BackendRejected as exc:
        return f"the model server refuses hsx's requests ({exc}); nothing is sent until that is fixed"
    except DumpRejected as exc:
        hint = ""
        if capture.how.startswith("the hsx-sglang plugin"):
            hint = (
                f"; {PLUGIN_INFO_FILE} in the dump root describes the hsx-sglang plugin, but it did not dump the "
                "probe: the file may be left from an earlier launch, or the plugin did not load in this one (the "
                "server's log says 'Failed to load plugin'); start the server with the plugin (SGLANG_PLUGINS="
                f"hsx_dump, HSX_DUMP_ROOT), or remove {PLUGIN_INFO_FILE} to use the server's answers"
            )
        return f"a probe request gave no usable hidden states ({exc.code}: {exc.reason}){hint}"
    finally:
        shutil.rmtree(staging / "probe", ignore_errors=True)
    return None
