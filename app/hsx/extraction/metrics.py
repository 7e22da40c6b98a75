"""In-process counters of the writer, rendered in Prometheus text format by GET /metrics (the API's, and
an `hsx worker`'s --metrics-port)."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RATE_WINDOW_S = 60.0


def label(value: str) -> str:
    """A label value as the text format writes it: backslash, double quote and line feed escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Histogram:
    """Observations counted in buckets (cumulative when rendered), with their sum. Callers lock."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        cumulative += self.counts[-1]
        lines.append(f'{name}_bucket{{le="+Inf"}} {cumulative}')
        lines.append(f"{name}_sum {self.sum}")
        lines.append(f"{name}_count {cumulative}")
        return lines


class WriterMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.attempts: Counter[tuple[str, str]] = Counter()  # (outcome, reason code)
        self.latency = Histogram()
        self.shard_latency = Histogram()
        self.tokens_extracted = 0
        self.samples_staged = 0
        self.bytes_staged = 0
        self.shards_written = 0
        self.shard_bytes = 0
        self._recent: deque[tuple[float, int]] = deque()

    def backend_latency(self, seconds: float) -> None:
        with self._lock:
            self.latency.observe(seconds)

    def shard_written(self, seconds: float, nbytes: int) -> None:
        """A shard was written (checked, hashed, on disk whole) in `seconds`."""
        with self._lock:
            self.shard_latency.observe(seconds)
            self.shards_written += 1
            self.shard_bytes += nbytes

    def attempt(self, outcome: str, reason: str = "") -> None:
        code = reason.split(":", 1)[0] if reason else ""
        with self._lock:
            self.attempts[(outcome, code)] += 1

    def extracted(self, tokens: int, nbytes: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.tokens_extracted += tokens
            self.samples_staged += 1
            self.bytes_staged += nbytes
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def tokens_per_second(self) -> float:
        """Tokens extracted per second over the last minute, to 3 decimals: the one figure /healthz,
        /metrics and the writer's heartbeat (GET /v1/workers) show."""
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if t >= now - RATE_WINDOW_S]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1.0)
        return round(sum(n for _, n in recent) / span, 3)

    def render(self, tokens_per_s: float | None = None) -> list[str]:
        """The lines; `tokens_per_s`: the rate as the caller read it (so that one answer shows one figure),
        else read now."""
        rate = self.tokens_per_second() if tokens_per_s is None else tokens_per_s
        with self._lock:
            lines = [
                "# HELP hsx_attempts_total Sample attempts by outcome and reason code; an ok attempt whose "
                "values the shard writer finds NaN or Inf counts again as outcome rejected.",
                "# TYPE hsx_attempts_total counter",
            ]
            for (outcome, code), n in sorted(self.attempts.items()):
                lines.append(f'hsx_attempts_total{{outcome="{label(outcome)}",reason="{label(code)}"}} {n}')
            lines += self.latency.render(
                "hsx_backend_request_seconds", "Time from request to validated dump, per attempt."
            )
            lines += self.shard_latency.render(
                "hsx_shard_write_seconds",
                "Time to write one shard: check its values, hash and write it, rename it into place, record it.",
            )
            lines += [
                "# HELP hsx_tokens_extracted_total Tokens validated and staged by this writer.",
                "# TYPE hsx_tokens_extracted_total counter",
                f"hsx_tokens_extracted_total {self.tokens_extracted}",
                "# HELP hsx_samples_staged_total Samples validated and staged by this writer.",
                "# TYPE hsx_samples_staged_total counter",
                f"hsx_samples_staged_total {self.samples_staged}",
                "# HELP hsx_bytes_staged_total Hidden-state bytes staged by this writer.",
                "# TYPE hsx_bytes_staged_total counter",
                f"hsx_bytes_staged_total {self.bytes_staged}",
                "# HELP hsx_shards_written_total Shards this writer wrote.",
                "# TYPE hsx_shards_written_total counter",
                f"hsx_shards_written_total {self.shards_written}",
                "# HELP hsx_shard_bytes_written_total Bytes of the shards this writer wrote.",
                "# TYPE hsx_shard_bytes_written_total counter",
                f"hsx_shard_bytes_written_total {self.shard_bytes}",
            ]
        lines += [
            "# HELP hsx_tokens_per_second Tokens extracted per second over the last minute.",
            "# TYPE hsx_tokens_per_second gauge",
            f"hsx_tokens_per_second {rate:.3f}",
        ]
        return lines
