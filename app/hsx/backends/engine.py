"""The engine interface: all the writer and the API know of a model server, whatever its kind.

An engine (hsx.sources.Source names each) is one kind of model server and the way hsx takes a sample's
hidden states from it; each lives in a module of its own under hsx/backends/engines/. An Engine is bound
to what one look at its server found (its Capture) and is replaced, never changed, at the next look:

- `discover(look)`: whether the server is ready and, when the look is auto, whether it is this engine's;
  what it captures (layers, the model, the proof its dumps will carry, its boot id); CaptureProblem
  when it cannot give whole samples, saying what to change;
- `limits(server)`: what the server accepts (its longest prompt, its vocabulary) and what it captures,
  for checking submitted samples;
- `extract(...)`: send one sample and return its validated dump, staged, with its proof (`Dump.identity`);
- `probe()`: one small request the way samples go, before any sample is spent on the server; a server that
  stops answering at it (its engine died) is ServerDown, with what may kill this engine (`down_hint`);
- `restarted(before)`: whether the server restarted since an earlier look;
- `regenerates`: whether the server's /generate can write a conversation's answers anew, a sampling seed
  included (hsx.chat.regenerate);
- `concurrent`, `leftovers()`: whether several requests may run at once; what requests whose answer was
  never read leave in the dump root.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

from hsx.backends.dumps import Dump, DumpRejected, DumpRoot
from hsx.backends.http import BackendRejected, BackendUnavailable, HttpBackend
from hsx.dtypes import DTYPES, HIDDEN_STATE_DTYPES
from hsx.identity import Identity
from hsx.sources import Source
from hsx.storage.encoding import encoding_of

DEFAULT_RID_PREFIX = "hsx-"
# The probe: tokens every vocabulary has, 16 of them: vLLM 0.32's CPU build in bfloat16 lost its worker to
# SIGILL when a 4-token prompt was its first request (AMX instructions before the process had asked Linux
# for AMX; deploy/vllm/README.md), and took 16 as a first request.
PROBE_IDS = list(range(1, 17))

Client = TypeVar("Client", bound=HttpBackend)
Read = TypeVar("Read")


class CaptureProblem(Exception):
    """The server cannot give whole per-sample hidden states as it runs; the message says why and what to change."""


class ServerDown(BackendUnavailable):
    """The model server stopped answering during hsx's probe request: its engine died, or the server exited. Not
    a matter of layers or dump roots: the message says so, and what may kill this engine."""


# How long /health is waited for after a failed probe: the server just answered, or has gone.
HEALTH_AFTER_PROBE_S = 10.0


@dataclass(frozen=True)
class Expectation:
    """What a sample's dump must be: its job's layers, hidden size and dtype, where the job has them."""

    layers: list[int] | None = None
    hidden_size: int | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class Limits:
    """What the model server accepts: ids below vocab_size, at most max_tokens per prompt; and what it
    captures, for a job's size estimate. None: not known."""

    vocab_size: int | None = None
    max_tokens: int | None = None
    layers: list[int] | None = None
    hidden_size: int | None = None
    dtype: str | None = None

    def bytes_per_token(self, job_layers: list[int] | None, encoding: str = "raw") -> int | None:
        """Shard bytes per token: every captured layer's row as `encoding` stores it, plus int64
        input_ids and loss_mask."""
        layers = job_layers or self.layers
        if not layers or not self.hidden_size or self.dtype not in HIDDEN_STATE_DTYPES:
            return None
        return len(layers) * encoding_of(encoding).stored_row_bytes(DTYPES[self.dtype], self.hidden_size) + 16


def count(value: Any) -> int | None:
    """A limit a server's answer gives, kept only when it is a positive integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True)
class Capture:
    """What one look at the server found: what the writer needs to take a sample's hidden states from it."""

    layers: list[int] | None  # the layers the server gives; None: not said (a job's own list is trusted)
    model: dict[str, Any]  # the model as a manifest records it (hsx.manifest.MODEL_KEYS, final_layer)
    layers_from: str  # where the layers come from, for /healthz and refusals
    # Why the layers are someone's word that hsx cannot check against the server, where they are (said at start
    # and in /healthz); None where the server itself says which layers its dumps hold.
    layers_unverified: str | None = None
    name_by: str | None = None  # how the server names its dumps in the root ("counter" or "rid"), where it does
    rid_prefix: str = DEFAULT_RID_PREFIX  # every request id hsx sends starts with it
    boot_id: str | None = None
    hidden_size: int | None = None  # the width of one layer's rows, where the server says it before a dump
    dtype: str | None = None  # the rows' dtype, where the server says it before a dump
    # What each dump will prove (hsx.identity) as far as the server says before the first one; None: not said.
    identity: Identity | None = None
    # What to change on the server when it gives less than EAGLE-3's layers (a plugin that did not load,
    # flags left out), as far as the server's own answers tell; shown where a job waits for other layers.
    hint: str | None = None
    # Whether the server applies a request's sampling seed (SGLang only with --enable-deterministic-inference).
    applies_seed: bool = False


@dataclass(eq=False)
class Server:
    """The model server a writer (or the API) talks to: its URL and its dump root, where validated dumps
    wait for their shard, how long a dump is waited for, how the operator says dumps are named; and the
    HTTP clients the engines speak to it with, one of each kind, kept from one look to the next."""

    url: str
    root: DumpRoot
    staging: Path
    timeout_s: float = 600.0
    dump_wait_s: float = 30.0
    settle_s: float = 0.05
    name_by: str = "auto"  # --name-by: auto (as the server says), counter or rid
    # --capture-layers: what the operator says the server captures, for a server that does not say it itself
    capture_layers: list[int] | None = None
    _clients: dict[type[HttpBackend], HttpBackend] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def client(self, kind: type[Client]) -> Client:
        with self._lock:
            if kind not in self._clients:
                self._clients[kind] = kind(self.url, self.timeout_s)
            return cast(Client, self._clients[kind])

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


@dataclass(eq=False)
class Look:
    """One look at the server: whether any engine that finds its server may take it (auto), whether the
    server was away before it, and what the engines read from the server so far (two engines of one
    kind of server read its answers once)."""

    server: Server
    auto: bool
    after_outage: bool
    _read: dict[str, Any] = field(default_factory=dict, repr=False)

    def once(self, key: str, read: Callable[[], Read]) -> Read:
        if key not in self._read:
            self._read[key] = read()
        return cast(Read, self._read[key])


@dataclass(frozen=True)
class ProbeRefused:
    """Why a probe request gave no usable hidden states: `reason`, for people (it names the probe's own request
    and file), and `cause`, the kind of failure (a DumpRejected code, or "refused"), the same each time the same
    thing goes wrong: a writer probes less often while it stays the same."""

    reason: str
    cause: str


class Engine(ABC):
    """One kind of model server and the way hsx takes hidden states from it, bound to what a look found."""

    source: ClassVar[Source]
    regenerates: ClassVar[bool] = False

    def __init__(self, server: Server, capture: Capture):
        self.server = server
        self.capture = capture

    @classmethod
    @abstractmethod
    def discover(cls, look: Look) -> Engine | None:
        """This engine bound to what the server captures now; None when the look is auto and the server is
        not this engine's. Raises BackendUnavailable (the server is not ready), BackendRejected or
        CaptureProblem (it cannot give whole samples as it runs)."""

    @classmethod
    def limits(cls, server: Server) -> Limits | None:
        """What the server accepts and captures; None when this engine cannot tell. Raises
        BackendUnavailable, BackendRejected or ValueError when the server does not answer."""
        return None

    @property
    def concurrent(self) -> bool:
        """Whether several requests may run at once (not where dumps are found by scanning the root)."""
        return True

    @abstractmethod
    def extract(self, input_ids: list[int], *, rid: str, staged_name: str, expect: Expectation) -> Dump:
        """Run the request and return its validated dump, moved to `staging/staged_name`, with its proof.

        Raises DumpRejected (a failed attempt with a reason), or BackendUnavailable / BackendRejected."""

    def restarted(self, before: Engine) -> bool:
        """Whether the server restarted since `before` was discovered: its boot id changed."""
        was, now = before.capture.boot_id, self.capture.boot_id
        return bool(was and now and was != now)

    def leftovers(self) -> list[Path]:
        """What requests whose answer was never read left in the dump root (gone after a restart or a
        timeout), for the writer to sweep once old enough."""
        return []

    def probe(self) -> ProbeRefused | None:
        """Send one small request the way samples go, before any sample is spent on this server (at start,
        after an outage, after a restart): None when it gave whole hidden states, else why not. A setup that
        refuses every request shows here, as the writer's reason to refuse, instead of as every sample
        failing. BackendUnavailable passes through; a server gone after a failed probe is ServerDown."""
        rid = f"{self.capture.rid_prefix}probe-{uuid.uuid4().hex[:12]}"
        expect = Expectation(layers=self.capture.layers)
        try:
            self.extract(PROBE_IDS, rid=rid, staged_name=f"probe/{rid}", expect=expect)
        except BackendRejected as exc:
            self._raise_if_down(str(exc))
            return ProbeRefused(
                f"the model server refuses hsx's requests ({exc}); nothing is sent until that is fixed", "refused"
            )
        except DumpRejected as exc:
            self._raise_if_down(f"{exc.code}: {exc.reason}")
            return ProbeRefused(
                f"a probe request gave no usable hidden states ({exc.code}: {exc.reason}){self.probe_hint()}",
                exc.code,
            )
        finally:
            shutil.rmtree(self.server.staging / "probe", ignore_errors=True)
        return None

    def _raise_if_down(self, failed: str) -> None:
        """ServerDown when the server no longer answers /health after the probe `failed`: then the probe's failure
        says nothing of the layers or the dump root a probe_hint asks about, and the server's log says why."""
        client = HttpBackend(self.server.url, HEALTH_AFTER_PROBE_S)
        try:
            client.health()
        except (BackendUnavailable, BackendRejected) as exc:
            raise ServerDown(
                f"the model server stopped answering during hsx's probe request: its engine died or the server "
                f"exited (the probe: {failed}; then {exc}); its log says why{self.down_hint()}"
            ) from None
        finally:
            client.close()

    def probe_hint(self) -> str:
        """What a failed probe may mean with this server, to follow its reason ("; ..."), or nothing."""
        return ""

    def down_hint(self) -> str:
        """What is known to kill this server's engine at a first request, to follow ServerDown's reason ("; ..."),
        or nothing."""
        return ""
