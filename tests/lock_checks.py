"""Helpers shared by the lock tests: a thread that holds a lock for a block, and a wait until a run
is blocked in flock on a file, so that a test of what happens when the holder lets go really has
a waiter (a sleep may end before it gets there on a loaded machine, and the test would pass
without the race it is about)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from normswap.fileio import path_lock


@contextlib.contextmanager
def held_by_a_thread(path: Path, *, wait: bool) -> Iterator[threading.Event]:
    """A thread takes path_lock(path, wait=wait) and holds it until the block ends; the block gets
    the event the thread sets once it holds the lock."""
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with path_lock(path, wait=wait):
            inside.set()
            leave.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        yield inside
    finally:
        leave.set()
        holder.join(60)


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
