"""Waits between tries that double each time, so an outage is polled often at first, then gently."""

from __future__ import annotations


class Backoff:
    def __init__(self, first_s: float = 0.5, most_s: float = 10.0) -> None:
        self.first_s = first_s
        self.most_s = most_s
        self._next_s = first_s

    def next(self) -> float:
        """Seconds to wait before this try; the wait after it doubles, up to most_s."""
        wait = self._next_s
        self._next_s = min(wait * 2, self.most_s)
        return wait

    def reset(self) -> None:
        self._next_s = self.first_s
