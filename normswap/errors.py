"""Errors that the command line turns into one line on stderr and exit code 2."""

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar


class NormswapError(Exception):
    """A user-facing failure: bad input, an unavailable backend, a failed verification.

    The message is one line, complete on its own; no traceback is shown for it.
    """


class BadInputError(NormswapError, ValueError):
    """An argument of the right kind with a value normswap cannot use (a dtype name it does not
    know, a negative token id, a model on the meta device where weights are needed). Also a
    ValueError, so library callers that catch that keep working."""


class EveryProcessError(NormswapError):
    """A failure every process of a launch (`accelerate launch`, torchrun) stops for at once, as
    the processes agreed (normswap.experiment.processes): the main process says it, the command line
    leaves it unsaid on the others (it came once per process)."""


class UnknownNormError(NormswapError):
    """A norm-like module that the registry does not recognise (raised under --strict)."""


def require_bool(name: str, value) -> bool:
    """`value` when it is True or False: a flag given "no" (truthy) would silently mean yes."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return value


def named_twice(names: Sequence[str]) -> list[str]:
    """The names given more than once, sorted (for "X named twice"): a list of implementations,
    modes or arms names each once; a repeat is a typo'd second name, never a request to run one twice."""
    return sorted({n for n in names if names.count(n) > 1})


# The option names in effect: what the running entry point's caller calls each of its options
# (using_option_names). A module deep in a call names an option in a message without every
# function on the way taking the mapping: option_labels reads it from here.
_IN_EFFECT: ContextVar[Mapping[str, str] | None] = ContextVar("normswap_option_names", default=None)


def option_labels(options: Iterable[str], option_names: Mapping[str, str] | None = None) -> dict[str, str]:
    """What messages call each of `options`: its library parameter name, or the name option_names
    gives it (a command line passes the flag it took the value from: {"batch": "--batch"}), so a
    library caller and a command-line user each read the name they wrote. Names option_names
    leaves out are those the entry point running now was given (using_option_names), if any."""
    in_effect = _IN_EFFECT.get() or {}
    return {k: in_effect.get(k, k) for k in options} | _names(option_names)


def _names(option_names) -> dict[str, str]:
    """option_names as a dict; a TypeError naming it for anything but a mapping of str to str
    (option_names=5 was "'int' object is not iterable", from inside dict())."""
    if option_names is None:
        return {}
    if not isinstance(option_names, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in option_names.items()):
        raise TypeError("option_names: expected a mapping of parameter names to what messages call them "
                        f"({{'only': '--only'}}), got {option_names!r}")
    return dict(option_names)


@contextmanager
def using_option_names(option_names: Mapping[str, str] | None) -> Iterator[None]:
    """Within the block, messages name options as option_names says (on top of the names an outer
    entry point gave). A public entry point with options passes its full labels
    (option_labels(ITS_OPTIONS, option_names)), so what it calls sees its caller's names: patch_checkpoint's
    library caller reads `force=True` from checkpoint.staged_dir, the CLI's user `--force`."""
    token = _IN_EFFECT.set({**(_IN_EFFECT.get() or {}), **_names(option_names)})
    try:
        yield
    finally:
        _IN_EFFECT.reset(token)


def is_flag(label: str) -> bool:
    """Whether an option's label is a command line's flag (--force) rather than a parameter name."""
    return label.startswith("-")


def way_out(option: str, value, otherwise: str) -> str | None:
    """What a message deep in a call suggests: setting `option` to `value` in the caller's spelling
    when the entry point it called has that option (--no-rms, rms=False: using_option_names);
    `otherwise`, the way of the function raising it (patch(model, ...)'s rms_forms), when it was
    called directly; None (suggest nothing) under an entry point without that option: `normswap
    diff` has no --exclude, and its user never wrote patch's filter_fn."""
    in_effect = _IN_EFFECT.get()
    if not in_effect:
        return otherwise
    label = in_effect.get(option)
    return option_setting(label, value) if label else None


class Metavar(str):
    """A stand-in for a value the user chooses (DIR, REGEX), written as it is in either spelling."""

    def __repr__(self) -> str:
        return str(self)


def option_setting(label: str, value) -> str:
    """How a caller gives the option messages call `label` a value, in the caller's own spelling:
    a command line's `--force`, `--no-rms`, `--out DIR`, `--impl torch`; a library call's
    `force=True`, `rms=False`, `out=DIR`, `impl='torch'`."""
    if not is_flag(label):
        return f"{label}={value!r}"
    if value is True:
        return label
    if value is False:
        return "--no-" + label.removeprefix("--")
    return f"{label} {value}"


# Library messages that point at output the user never sees (transformers' load report is
# logged, and the CLI silences the log).
_NOISE = re.compile(r"\s*For details look at the above report!?\s*")
_LONGEST = 400


def one_line(error: BaseException) -> str:
    """The whole reason an exception gives, as one line: its lines joined (a validation error's
    reason is on its second line), an OSError as 'FILE: the operating system's reason', never
    cut at the first line break. Very long messages are shortened to their start."""
    if isinstance(error, OSError) and error.strerror:
        where = ": ".join(str(f) for f in (error.filename, error.filename2) if f is not None)
        return f"{where}: {error.strerror}" if where else error.strerror
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    text = _NOISE.sub(" ", text).strip()
    if not text:
        return error.__class__.__name__
    return text if len(text) <= _LONGEST else text[:_LONGEST - 1] + "…"
