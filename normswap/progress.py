"""Progress of long work, without drawing anything: the library calls progress(stage, done, total)
and the command line draws the bars (normswap.cli.main.ProgressBars). Library users who pass
progress=True to perplexity / diff_models / convert_directory get a tqdm bar on stderr instead."""

from __future__ import annotations

import sys
from collections.abc import Callable

# progress(stage, done, total): `done` units of `stage` finished, out of `total` (None: unknown).
ProgressFn = Callable[[str, int, "int | None"], None]


class _CallbackBar:
    """The part of tqdm's interface the library uses, forwarded to a ProgressFn."""

    def __init__(self, progress: ProgressFn, stage: str, total: int | None):
        self.progress, self.stage, self.total, self.done = progress, stage, total, 0
        progress(stage, 0, total)

    def update(self, n: int = 1) -> None:
        self.done += n
        self.progress(self.stage, self.done, self.total)

    def close(self) -> None:
        return None

    def __enter__(self) -> _CallbackBar:
        return self

    def __exit__(self, *exc) -> None:
        return None


def bar(progress: bool | ProgressFn | None, stage: str, total: int | None, **tqdm_kwargs):
    """A bar for `stage`: the callback's when progress is callable, a tqdm bar on stderr when it is
    True, a silent one otherwise."""
    if callable(progress):
        return _CallbackBar(progress, stage, total)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=stage, file=sys.stderr, disable=not progress, dynamic_ncols=True,
                leave=False, **tqdm_kwargs)


def step(progress: ProgressFn | None, stage: str, done: int, total: int | None) -> None:
    """One call of the callback, when there is one."""
    if progress is not None:
        progress(stage, done, total)
