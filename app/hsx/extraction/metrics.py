"""In-process counters of the writer, rendered in Prometheus text format by GET /metrics."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RATE_WINDOW_S = 60.0


class WriterMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.attempts: Counter[tuple[str, str]] = Counter()  # (outcome, reason code)
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.tokens_extracted = 0
        self.samples_staged = 0
        self.bytes_staged = 0
        self._recent: deque[tuple[float, int]] = deque()

    def backend_latency(self, seconds: float) -> None:
        with self._lock:
            self.latency_sum += seconds
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self.latency_counts[i] += 1
                    break
            else:
                self.latency_counts[-1] += 1

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
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if t >= now - RATE_WINDOW_S]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1.0)
        return sum(n for _, n in recent) / span

    def render(self) -> list[str]:
        with self._lock:
            lines = [
                "# HELP hsx_attempts_total Sample attempts by outcome and reason code; an ok attempt whose "
                "values the shard writer finds NaN or Inf counts again as outcome rejected.",
                "# TYPE hsx_attempts_total counter",
            ]
            for (outcome, code), n in sorted(self.attempts.items()):
                lines.append(f'hsx_attempts_total{{outcome="{outcome}",reason="{code}"}} {n}')
            lines += [
                "# HELP hsx_backend_request_seconds Time from request to validated dump, per attempt.",
                "# TYPE hsx_backend_request_seconds histogram",
            ]
            cumulative = 0
            for bound, n in zip(LATENCY_BUCKETS, self.latency_counts):
                cumulative += n
                lines.append(f'hsx_backend_request_seconds_bucket{{le="{bound}"}} {cumulative}')
            cumulative += self.latency_counts[-1]
            lines.append(f'hsx_backend_request_seconds_bucket{{le="+Inf"}} {cumulative}')
            lines.append(f"hsx_backend_request_seconds_sum {self.latency_sum}")
            lines.append(f"hsx_backend_request_seconds_count {cumulative}")
            lines += [
                "# HELP hsx_tokens_extracted_total Tokens validated and staged by this writer.",
                "# TYPE hsx_tokens_extracted_total counter",
                f"hsx_tokens_extracted_total {self.tokens_extracted}",
                "# HELP hsx_bytes_staged_total Hidden-state bytes staged by this writer.",
                "# TYPE hsx_bytes_staged_total counter",
                f"hsx_bytes_staged_total {self.bytes_staged}",
            ]
        lines += [
            "# HELP hsx_tokens_per_second Tokens extracted per second over the last minute.",
            "# TYPE hsx_tokens_per_second gauge",
            f"hsx_tokens_per_second {self.tokens_per_second():.3f}",
        ]
        return lines
