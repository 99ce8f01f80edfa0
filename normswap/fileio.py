"""Writing a file so that no reader, and no other writer, ever sees it half-written: the one
atomic text write every results file, manifest and launch table goes through, and the umask that
files made through temporary names are given back."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


def umask() -> int:
    """The process umask (only readable by setting it: set and restored at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through a temporary file of its own in the same folder, renamed into
    place. Its own name: two writers of one path (two `normswap tune` on one user table, two
    benches into one results file) must never share a temporary name, or one renames the other's
    half-written file into place and then finds its own gone. The file keeps its mode; a new one
    gets what a plain open would give it (0666 less the umask), not mkstemp's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
