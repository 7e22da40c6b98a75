"""hsx.cli.progress: a tqdm bar on a terminal (a pseudo-terminal here), plain periodic lines elsewhere, and a
stall shown as an unknown rate and ETA rather than an ETA counting down."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import termios
import time

from hsx.cli.progress import progress


def read_all(fd: int) -> str:
    """What the terminal has been sent so far (read while its other end is still open)."""
    chunks = []
    while select.select([fd], [], [], 0.2)[0]:
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks).decode()


def test_a_terminal_gets_a_bar_redrawn_in_place_with_rate_and_eta():
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 rows, 100 columns
    with open(follower, "w", closefd=True) as tty:
        assert tty.isatty()
        with progress("hsx test", 4 << 20, stream=tty, delay=0) as meter:
            for _ in range(4):
                meter.advance(1 << 20)
                time.sleep(0.15)
        text = read_all(leader)
    os.close(leader)
    assert "\r" in text and "hsx test:" in text and "|" in text  # tqdm's bar, redrawn in place
    assert re.search(r"[\d.]+M/4\.00M", text) and re.search(r"[\d.]+[kM]?B/s", text)
    assert re.search(r"<\d\d:\d\d", text)  # the ETA


def test_elsewhere_lines_come_periodically_and_a_stall_shows_no_eta():
    log = io.StringIO()
    with progress("hsx test", 1000, stream=log, interval=0.05, stall_s=0.3) as meter:
        for _ in range(4):
            meter.advance(100)
            time.sleep(0.05)
        time.sleep(0.8)  # nothing moves
        meter.advance(600)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) >= 5
    assert all(line.startswith("hsx test: ") and "B/0.98kB (" in line for line in lines)
    moving = [line for line in lines if "400B/" in line and "stalled" not in line]
    assert moving and re.search(r"[\d.]+k?B/s, ETA 00:0\d$", moving[0])
    stalled = [line for line in lines if "stalled" in line]
    assert stalled and all("?B/s, ETA ?, stalled" in line for line in stalled)
    # the ETA does not count down through the stall: every line in it says "?"
    assert lines[-1].startswith("hsx test: 0.98kB/0.98kB (100%)") and "stalled" not in lines[-1]


def test_a_quick_operation_and_a_quiet_one_print_nothing():
    log = io.StringIO()
    with progress("hsx test", 10, unit="files", stream=log, interval=5) as meter:
        meter.advance(10)
    with progress("hsx test", 10, unit="files", stream=log, interval=0.01, quiet=True) as meter:
        meter.advance(5)
        time.sleep(0.05)
    assert log.getvalue() == ""


def test_counted_items_and_an_unknown_total():
    log = io.StringIO()
    with progress("hsx export", None, unit="files", stream=log, interval=0.02) as meter:
        meter.moveto(3, 12)
        time.sleep(0.1)
    assert re.match(r"hsx export: 3/12 files \(25%\), ", log.getvalue())
    log = io.StringIO()
    with progress("hsx submit", None, stream=log, interval=0.02) as meter:
        meter.advance(2048)
        time.sleep(0.1)
    assert log.getvalue().startswith("hsx submit: 2.00kB, ")


def test_a_terminal_of_unknown_width_still_gets_a_bar():
    leader, follower = pty.openpty()
    with open(follower, "w", closefd=True) as tty:
        with progress("hsx test", 10, unit="files", stream=tty, delay=0) as meter:
            meter.advance(5)
        text = read_all(leader)
    os.close(leader)
    assert "hsx test:" in text and "0/10 [" in text
