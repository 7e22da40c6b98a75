"""What the model server accepts, for validating submitted samples (cached, best effort)."""

from __future__ import annotations

import threading
import time

from hsx.backends.sglang import BackendRejected, BackendUnavailable, SGLangClient
from hsx.service.intake import Limits

TTL_S = 30.0
FAILURE_TTL_S = 5.0


class BackendInfo:
    def __init__(self, base_url: str):
        self.base_url = base_url.rstrip("/")
        self._client = SGLangClient(self.base_url, timeout_s=2.0)
        self._lock = threading.Lock()
        self._limits = Limits()
        self._expires = 0.0

    def limits(self) -> Limits:
        """Vocabulary size and prompt length limit from the server's model and server info.

        When the server cannot be asked, the limits are unknown and only the model-independent
        checks apply; the server itself still refuses what it cannot take, as a failed attempt.
        """
        with self._lock:
            if time.monotonic() < self._expires:
                return self._limits
            try:
                model = self._client.model_info()
                server = self._client.server_info()
                max_tokens = server.get("max_req_input_len") or model.get("max_position_embeddings")
                dump = server.get("hs_dump") or {}
                self._limits = Limits(
                    vocab_size=model.get("vocab_size"),
                    max_tokens=max_tokens,
                    layers=dump.get("layers"),
                    hidden_size=model.get("hidden_size"),
                    dtype=dump.get("dtype") or model.get("dtype"),
                )
                self._expires = time.monotonic() + TTL_S
            except (BackendUnavailable, BackendRejected, ValueError):
                self._limits = Limits()
                self._expires = time.monotonic() + FAILURE_TTL_S
            return self._limits
