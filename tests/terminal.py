"""A Python script run in a pseudo-terminal for tests: its own session with the pty as its
controlling terminal, as a shell in a terminal window runs a command, so terminal signals
(Ctrl-C) and terminal settings (`stty tostop`) reach it as they would reach a user's run."""

from __future__ import annotations

import os
import pty
import select
import sys
import time


def run_in_terminal(
    script: str,
    *args: str,
    keys_after: tuple[bytes, bytes, float] | None = None,
    timeout_s: float = 120.0,
) -> tuple[str, int]:
    """Run `python -c script args...` in a new pty; its output (stdout and stderr, as the
    terminal shows them) and its exit code. `keys_after` = (marker, keys, delay): once the
    output shows `marker`, wait `delay` seconds and type `keys` (b"\\x03" is Ctrl-C)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: exec at once (nothing of the test process runs here)
        try:
            os.execv(sys.executable, [sys.executable, "-c", script, *args])
        finally:
            os._exit(127)
    out, deadline = b"", time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if keys_after is not None and keys_after[0] in out:
                time.sleep(keys_after[2])
                os.write(fd, keys_after[1])
                keys_after = None
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # the child closed the terminal: it exited
                    break
                if not chunk:
                    break
                out += chunk
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    return out.decode(errors="replace"), os.waitstatus_to_exitcode(status)
