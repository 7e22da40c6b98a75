"""What the model server accepts, for validating submitted samples (cached, best effort), asked of the
engine the service is set to use (hsx.backends.limits)."""

from __future__ import annotations

import threading
import time

from hsx import backends
from hsx.backends.dumps import DumpRoot
from hsx.backends.engine import Limits, Server
from hsx.backends.http import BackendRejected, BackendUnavailable
from hsx.config import Settings

TTL_S = 30.0
FAILURE_TTL_S = 5.0
ASK_TIMEOUT_S = 2.0


class BackendInfo:
    def __init__(self, settings: Settings):
        self._server = Server(
            settings.backend_url,
            DumpRoot(settings.dump_root),
            settings.resolved_staging_dir(),
            timeout_s=ASK_TIMEOUT_S,
        )
        self._choice = settings.source
        self._lock = threading.Lock()
        self._limits = Limits()
        self._expires = 0.0

    def limits(self) -> Limits:
        """Vocabulary size, prompt length limit and what the server captures, as its engine tells them.

        When the server cannot be asked, the limits are unknown and only the model-independent
        checks apply; the server itself still refuses what it cannot take, as a failed attempt.
        """
        with self._lock:
            if time.monotonic() < self._expires:
                return self._limits
            try:
                self._limits = backends.limits(self._server, self._choice)
                self._expires = time.monotonic() + TTL_S
            except (BackendUnavailable, BackendRejected, ValueError):
                self._limits = Limits()
                self._expires = time.monotonic() + FAILURE_TTL_S
            return self._limits
