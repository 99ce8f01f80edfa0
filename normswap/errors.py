"""Errors that the command line turns into one line on stderr and exit code 2."""


class NormswapError(Exception):
    """A user-facing failure: bad input, an unavailable backend, a failed verification.

    The message is one line, complete on its own; no traceback is shown for it.
    """


class UnknownNormError(NormswapError):
    """A norm-like module that the registry does not recognise (raised under --strict)."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (or its class name when it has none): library
    errors often run to many lines, and a NormswapError must stay one."""
    text = str(error).strip()
    return text.splitlines()[0] if text else error.__class__.__name__
