"""Strict JSON from result dicts: what every --json and every written results.json goes through."""

from __future__ import annotations

import math
from typing import Any


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
