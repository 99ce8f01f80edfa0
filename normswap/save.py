"""Writing results without ever losing the user's data: everything is written into a temporary
directory beside the target, verified there, and only then renamed into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from normswap.errors import NormswapError


@contextmanager
def atomic_output_dir(target: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `target`; on clean exit, move it into place.

    The caller writes and verifies inside the block; an exception (or a kill) leaves `target`
    untouched and removes the temporary directory. With force, an existing target is replaced:
    it is first renamed aside, so at every instant one complete directory sits at `target`
    or at its aside name, never a half-written one.
    """
    target = Path(target).expanduser().resolve()
    if target.exists() and not force:
        raise NormswapError(f"{target} already exists; pass --force to replace it")
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.normswap-", dir=parent))
    except OSError as e:
        raise NormswapError(f"cannot write to {parent}: {e.strerror or e}") from None
    try:
        yield tmp
        if target.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=parent))
            os.rmdir(aside)
            os.replace(target, aside)
            os.replace(tmp, target)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except OSError as e:
        raise NormswapError(f"cannot write {target}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
