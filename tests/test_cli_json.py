"""--json writes strict JSON: non-finite numbers become null."""

import json
import math

from normswap.cli.main import emit, finite_or_null


def test_non_finite_numbers_become_null(capsys):
    data = {"ppl": math.inf, "kl": [1.0, math.nan, -math.inf], "nested": {"x": (2.5, math.nan)}, "n": 3}
    emit(data, True, render=None)
    out = capsys.readouterr().out
    assert "NaN" not in out and "Infinity" not in out
    assert json.loads(out) == {"ppl": None, "kl": [1.0, None, None], "nested": {"x": [2.5, None]}, "n": 3}


def test_finite_values_pass_through_unchanged():
    data = {"a": 1e-300, "b": [0.0, -2.0], "c": "nan", "d": None, "e": True}
    assert finite_or_null(data) == data
