"""Progress of long work, without drawing anything: the library calls progress(stage, done, total)
and the command line draws the bars (ProgressBars). Library users who pass
progress=True to perplexity / diff_models / convert_directory get a bar on stderr instead.

Every bar normswap draws comes from stderr_bar: a redrawn tqdm bar on a terminal, plain lines
anywhere else (a log file, a pipe, CI), where a redrawn bar is a run of carriage returns that
shows as one garbled line, or as hundreds."""

from __future__ import annotations

import sys
import time
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


def require_progress_fn(progress: ProgressFn | None) -> None:
    """A function or None, where the library takes no bar of its own (patch, load, the checkpoint
    calls): anything else was called at the first stage ("'int' object is not callable", naming
    nothing), or only once every weight had loaded."""
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: expected a function (stage, done, total) or None, got {type(progress).__name__} "
                        "(normswap.progress.ProgressBars() draws the commands' bars)")


def bar(progress: bool | ProgressFn | None, stage: str, total: int | None, **tqdm_kwargs):
    """A bar for `stage`: the callback's when progress is callable, a tqdm bar on stderr when it is
    True, a silent one otherwise."""
    if callable(progress):
        return _CallbackBar(progress, stage, total)
    if progress is not None and not isinstance(progress, bool):  # "no" would draw a bar
        raise TypeError(f"progress: expected True, False or a function (stage, done, total), got {progress!r}")
    return stderr_bar(total=total, desc=stage, disable=not progress, **tqdm_kwargs)


# Seconds between two progress lines of one stage when stderr is not a terminal: a line per update
# would flood a log (a perplexity run updates per batch), none until the end looks like a hang.
LINE_INTERVAL = 10.0


def stderr_bar(*, total: int | None, desc: str, unit: str = "step", unit_scale: bool = False, initial: int = 0,
               disable: bool = False):
    """A progress bar on stderr: tqdm's on a terminal; elsewhere a _LineBar. disable: a silent one."""
    from tqdm.auto import tqdm

    if disable or isatty(sys.stderr) or _notebook(tqdm):
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale, file=sys.stderr,
                    disable=disable, dynamic_ncols=True, leave=False)
    return _LineBar(total, desc, unit, unit_scale, initial)


def isatty(stream) -> bool:
    """Whether `stream` is a terminal; False for one that cannot say (closed, or no isatty)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _notebook(auto_tqdm) -> bool:
    """Jupyter: its stderr is no terminal, but tqdm.auto draws a widget there, which stays."""
    return any(c.__module__ == "tqdm.notebook" for c in auto_tqdm.__mro__)


def _write_line(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: progress is never worth failing the work for
        pass


class _LineBar:
    """The part of tqdm's interface normswap uses, written as whole lines: one when the stage
    starts, one at most every LINE_INTERVAL seconds while it runs, one when it ends (with the
    time it took)."""

    def __init__(self, total: int | None, desc: str, unit: str, unit_scale: bool, initial: int):
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.n, self.postfix, self.closed, self.reported = initial, "", False, None
        self.start = self.last = time.monotonic()
        self._write(f"{desc} ...")

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= LINE_INTERVAL:
            self.last, self.reported = now, self.n
            self._write(self._status(now))

    def set_postfix(self, refresh: bool = True, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.reported != self.n:  # the last line did not already give this count
                self._write(self._status(time.monotonic()))

    def _status(self, now: float) -> str:
        if self.unit_scale:  # bytes, in tqdm's (decimal) units: 1.50MB/4.00MB
            from tqdm import tqdm

            done = "/".join(tqdm.format_sizeof(n, self.unit, 1000) for n in (self.n, self.total) if n is not None)
        else:
            done = f"{self.n}/{self.total} {self.unit}" if self.total is not None else f"{self.n} {self.unit}"
        line = f"{self.desc}: {done}, {now - self.start:.1f} s"
        return f"{line}, {self.postfix}" if self.postfix else line

    def _write(self, line: str) -> None:
        _write_line(line)

    def __enter__(self) -> _LineBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ProgressBars:
    """A ProgressFn drawing the library's progress(stage, done, total) calls as bars on stderr
    (stderr_bar's), one bar per stage (a new stage closes the previous bar): what the commands pass
    as `progress`, and what a library stage run under another's name passes (labels={"perplexity":
    "pretrain: held-out perplexity"}). Use as a context manager: the last bar closes.

    units: stage -> what it counts ("module", "tok", "B"); labels: stage -> the bar's title;
    announce: stage -> a line written to stderr when the stage starts."""

    def __init__(self, units: dict[str, str] | None = None, labels: dict[str, str] | None = None,
                 announce: dict[str, str] | None = None):
        self.units, self.announce = units or {}, announce or {}
        self.labels = {"reference": "load float32 reference (noise floor)", **(labels or {})}
        self.stage: str | None = None
        self.bar = None

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        if stage != self.stage:
            self.close()
            if stage in self.announce:
                _write_line(self.announce[stage])
            unit = self.units.get(stage, "step")
            # initial: a stage may start part-way through a count (bench's "<variant> <mode>" stages
            # share one count of measurements)
            self.bar = stderr_bar(total=total, initial=done, desc=self.labels.get(stage, stage), unit=unit,
                                  unit_scale=unit == "B")
            self.stage = stage
        self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.stage = None, None

    def __enter__(self) -> ProgressBars:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def step(progress: ProgressFn | None, stage: str, done: int, total: int | None) -> None:
    """One call of the callback, when there is one."""
    if progress is not None:
        progress(stage, done, total)
