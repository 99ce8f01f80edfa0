"""Strict JSON both ways: `loads`/`read` for every JSON file a user hands normswap (a model's
config, a safetensors header, a --data .jsonl, an --out folder left by an earlier run, a launch
table), `finite_or_null` for what every --json and every written results.json goes through."""

from __future__ import annotations

import json
import math
import os
from typing import Any

# Deeper than any file normswap reads (configs nest a few levels) and far below the ~1,000 levels
# at which Python's json raises RecursionError: a file that parses just under that limit still
# exhausts the stack later, in whatever walks it (transformers' config code, our own checks).
MAX_DEPTH = 100


def loads(data: str | bytes | bytearray) -> Any:
    """json.loads, with every way the input can be malformed raised as a ValueError whose message
    is a short reason on one line: bytes that are not UTF-8 ("not UTF-8: invalid byte at offset
    N"), text that is not JSON (json's own message: what it expected, line and column), or nesting
    deeper than MAX_DEPTH. json itself raises UnicodeDecodeError (a ValueError, but with a message
    about codecs) and, past ~1,000 levels, RecursionError, which is no ValueError at all: callers
    that turned ValueError into a bad-input line let it escape as an internal error."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")  # RFC 8259: JSON exchanged between systems is UTF-8
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8: invalid byte at offset {e.start}") from None
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None
    except ValueError as e:  # JSONDecodeError, or an integer past Python's digit limit
        raise ValueError(" ".join(str(e).split())) from None
    # Only text with more brackets than the limit can nest past it: the walk is skipped for almost
    # every file (str.count runs in C).
    if data.count("[") + data.count("{") > MAX_DEPTH and _deeper_than(value, MAX_DEPTH):
        raise ValueError(_TOO_DEEP)
    return value


def read(path: str | os.PathLike) -> Any:
    """The parsed JSON file at path: OSError when it cannot be read, ValueError (loads) when it
    is not well-formed JSON."""
    with open(path, "rb") as f:
        return loads(f.read())


def read_or_refuse(path: str | os.PathLike, remedy: str = "", what: str = "JSON") -> Any:
    """read(path), a failure raised as bad input naming the file and the reason: "PATH: cannot
    read (reason)" or "PATH: malformed WHAT (reason)", then "; REMEDY" when one is given (what the
    user can do). `what` names the file's role where that says more than "JSON" (config.json)."""
    from normswap.errors import NormswapError

    tail = f"; {remedy}" if remedy else ""
    try:
        return read(path)
    except OSError as e:  # a permission error is not a malformed file
        raise NormswapError(f"{path}: cannot read ({e.strerror or e.__class__.__name__}){tail}") from None
    except ValueError as e:
        raise NormswapError(f"{path}: malformed {what} ({e}){tail}") from None


_TOO_DEEP = f"nested too deeply: more than {MAX_DEPTH} levels"


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` levels: one level at a time, a loop and not
    recursion (the point is not to need the stack a deep value would take)."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        level = [c for node in level for c in (node.values() if isinstance(node, dict) else node)
                 if isinstance(c, (dict, list))]
        if not level:
            return False
    return bool(level)


def finite_or_null(value: Any) -> Any:
    """NaN and ±inf as null: Python's json writes them as bare NaN/Infinity, which strict JSON
    parsers reject (e.g. a perplexity that overflowed)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value
