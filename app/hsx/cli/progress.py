"""Progress of the long commands (download, submit, verify, export), always on stderr: stdout carries results.

On a terminal: a tqdm bar with done/total, rate and ETA, redrawn in place. Elsewhere (a log file, a pipe): a
plain line every HSX_PROGRESS_INTERVAL_S seconds (default 5) with done/total, percentage, rate and ETA; an
operation that ends before the first line is due prints nothing, one that printed lines ends with a last one.
When nothing has moved for STALL_S seconds the rate and ETA show "?" and the line says how long it has been
stalled, instead of an ETA still counting down from the last rate.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from tqdm import tqdm

INTERVAL_ENV = "HSX_PROGRESS_INTERVAL_S"
# For the commands' --help.
PROGRESS_NOTE = (
    "Progress goes to stderr (never with --json or -q): a bar with rate and ETA on a terminal, otherwise a "
    "line every $HSX_PROGRESS_INTERVAL_S seconds (default 5)."
)
DEFAULT_INTERVAL_S = 5.0
STALL_S = 5.0
# The bar is held back this long, so that quick operations leave no flicker on the terminal.
TTY_DELAY_S = 0.5
# How often the terminal bar is redrawn while nothing moves, so that the elapsed time and a stall show.
TTY_REFRESH_S = 1.0
# The log lines, for bytes (n_fmt is a bare number such as 1.50M) and for counted items (unit " files").
LOG_FORMATS = {
    (True, True): "{desc}: {n_fmt}B/{total_fmt}B ({percentage:.0f}%), {rate_fmt}, ETA {remaining}{postfix}",
    (True, False): "{desc}: {n_fmt}B, {rate_fmt}{postfix}",
    (False, True): "{desc}: {n_fmt}/{total_fmt}{unit} ({percentage:.0f}%), {rate_fmt}, ETA {remaining}{postfix}",
    (False, False): "{desc}: {n_fmt}{unit}, {rate_fmt}{postfix}",
}


def log_interval() -> float:
    """Seconds between two log lines: $HSX_PROGRESS_INTERVAL_S, or 5."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


class _StallAwareBar(tqdm):
    """A tqdm bar whose rate (and so its ETA) is unknown once nothing has moved for `stall_s` seconds."""

    def __init__(self, *args: Any, stall_s: float = STALL_S, **kwargs: Any) -> None:
        self.stall_s = stall_s
        self.moved_at: float | None = None
        super().__init__(*args, **kwargs)
        self.moved_at = self._time()

    def update(self, n: float = 1) -> bool | None:
        if n and self.moved_at is not None:
            self.moved_at = self._time()
        return super().update(n)

    def stalled_for(self) -> float:
        """Seconds since the count last moved, 0 while it is moving."""
        if self.moved_at is None:
            return 0.0
        idle = float(self._time() - self.moved_at)
        return idle if idle >= self.stall_s else 0.0

    @property
    def format_dict(self) -> dict[str, Any]:
        values: dict[str, Any] = super().format_dict
        idle = self.stalled_for()
        if idle:
            # tqdm shows a zero rate as "?" and then no ETA: the last rate no longer holds.
            values["rate"] = 0
            values["postfix"] = f"stalled {idle:.0f}s"
        return values


class Meter:
    """What a command reports its progress to; `advance` adds to the count, `moveto` sets it."""

    def __init__(self, bar: _StallAwareBar | None = None) -> None:
        self.bar = bar

    def advance(self, n: int) -> None:
        if self.bar is not None and n:
            self.bar.update(n)

    def moveto(self, done: int, total: int | None = None) -> None:
        """Set the count (and the total, when it becomes known or changes)."""
        if self.bar is None:
            return
        if total is not None and total != self.bar.total:
            self.bar.total = total
        self.advance(done - int(self.bar.n))


class _Ticker(threading.Thread):
    """Calls `tick` every `every` seconds until stopped: what redraws a bar, or writes a log line, while the
    count does not move."""

    def __init__(self, every: float, tick: Callable[[], object]) -> None:
        super().__init__(daemon=True, name="hsx-progress")
        self.every, self.tick = every, tick
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            self.tick()

    def stop(self) -> None:
        self.stopped.set()
        self.join()


class _LogLines:
    """Writes the bar's state as one plain line to `stream`."""

    def __init__(self, bar: _StallAwareBar, stream: TextIO) -> None:
        self.bar, self.stream = bar, stream
        self.lines = 0
        self.lock = threading.Lock()

    def write(self, *, last: bool = False) -> None:
        values = self.bar.format_dict
        if last:
            values["rate"], values["postfix"] = None, None  # tqdm then shows the average over the whole operation
        values["bar_format"] = LOG_FORMATS[values["unit"] == "B", bool(values["total"])]
        with self.lock:
            print(self.bar.format_meter(**values), file=self.stream, flush=True)
            self.lines += 1


def _columns(stream: TextIO) -> int:
    """The terminal's width; 0 where it is not known (a pseudo-terminal nobody has sized)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):
        return 0


@contextmanager
def progress(
    label: str,
    total: int | None,
    *,
    unit: str = "B",
    quiet: bool = False,
    stream: TextIO | None = None,
    interval: float | None = None,
    stall_s: float = STALL_S,
    delay: float = TTY_DELAY_S,
) -> Iterator[Meter]:
    """Show the progress of one operation of `total` units (None: not known) on `stream` (default stderr):
    a bar on a terminal, a line every `interval` seconds (default: log_interval()) elsewhere, nothing when
    `quiet`. Bytes (unit "B") are shown in KiB, MiB, ...; other units as counts."""
    if quiet:
        yield Meter()
        return
    stream = stream if stream is not None else sys.stderr
    on_terminal = stream.isatty()
    # bytes as 1.50MB (tqdm's k, M, G are powers of 1024 here); items as "12 files"
    shown: dict[str, Any] = (
        {"unit": "B", "unit_scale": True, "unit_divisor": 1024} if unit == "B" else {"unit": f" {unit}"}
    )
    options: dict[str, Any] = {"desc": label, "total": total, "stall_s": stall_s, **shown}
    if on_terminal:
        width = {"dynamic_ncols": True} if _columns(stream) else {"ncols": 80}  # tqdm draws nothing at width 0
        bar = _StallAwareBar(file=stream, leave=False, delay=delay, **width, **options)
        ticker = _Ticker(TTY_REFRESH_S, lambda: bar.refresh() if bar.n or bar.total else None)
    else:
        # The bar draws into nothing; it keeps the count and the rate, and the log lines are made from them.
        sink = open(os.devnull, "w")  # noqa: SIM115 - closed below, after the bar
        bar = _StallAwareBar(file=sink, mininterval=0.1, **options)
        lines = _LogLines(bar, stream)
        every = interval if interval is not None else log_interval()
        ticker = _Ticker(every, lines.write)
    started = time.monotonic()
    ticker.start()
    try:
        yield Meter(bar)
    finally:
        ticker.stop()
        # A line was due once the operation outlasted the interval, whether or not the ticker's thread
        # got to run by then (a busy machine): the last line is written either way.
        if not on_terminal and (lines.lines or time.monotonic() - started >= every):
            lines.write(last=True)
        bar.close()
        if not on_terminal:
            sink.close()
