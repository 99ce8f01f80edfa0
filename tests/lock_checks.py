"""Helper shared by the lock tests: wait until a run is blocked in flock on a file, so that a test
of what happens when the holder lets go really has a waiter (a sleep may end before it gets there
on a loaded machine, and the test would pass without the race it is about)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def wait_until_someone_waits_on(path: Path, timeout: float = 60) -> None:
    """Until /proc/locks lists a blocked request (`->`) on the file now at `path` (Linux; elsewhere
    a short sleep)."""
    ino = os.stat(path).st_ino
    if not Path("/proc/locks").exists():
        time.sleep(0.5)
        return
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for line in Path("/proc/locks").read_text().splitlines():
            f = line.split()
            if len(f) > 6 and f[1] == "->" and f[6].rsplit(":", 1)[-1] == str(ino):
                return
        time.sleep(0.01)
    raise AssertionError(f"nobody waited on {path} within {timeout}s")
