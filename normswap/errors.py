"""Errors that the command line turns into one line on stderr and exit code 2."""

import re
from collections.abc import Iterable, Mapping, Sequence


class NormswapError(Exception):
    """A user-facing failure: bad input, an unavailable backend, a failed verification.

    The message is one line, complete on its own; no traceback is shown for it.
    """


class BadInputError(NormswapError, ValueError):
    """An argument of the right kind with a value normswap cannot use (a dtype name it does not
    know, a negative token id, a model on the meta device where weights are needed). Also a
    ValueError, so library callers that catch that keep working."""


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


def option_labels(options: Iterable[str], option_names: Mapping[str, str] | None) -> dict[str, str]:
    """What messages call each of `options`: its library parameter name, or the name option_names
    gives it (a command line passes the flag it took the value from: {"batch": "--batch"}), so a
    library caller and a command-line user each read the name they wrote."""
    return {k: k for k in options} | dict(option_names or {})


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
