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


def test_normswaps_warnings_are_one_line_and_other_packages_keep_pythons_form(capsys, monkeypatch):
    """The commands' showwarning: a warning raised in normswap's code is `normswap: warning: ...`
    (a line break in it escaped); one from another package goes to the showwarning that was in place,
    where it came from being part of what it says; under a launcher, rank 1 says none of normswap's."""
    from pathlib import Path

    import normswap
    from normswap.cli.main import one_line_warnings

    passed_on = []
    show = one_line_warnings(lambda *args: passed_on.append(args))
    ours = str(Path(normswap.__file__).parent / "experiment" / "recipe.py")
    theirs = str(Path(json.__file__))
    show(UserWarning("normswap: finetune.steps (4)\nis short"), UserWarning, ours, 309)
    show(UserWarning("a deprecation"), FutureWarning, theirs, 12, None, "source line")
    assert capsys.readouterr().err == "normswap: warning: finetune.steps (4)\\nis short\n"
    assert len(passed_on) == 1 and passed_on[0][1:4] == (FutureWarning, theirs, 12)
    monkeypatch.setenv("RANK", "1")
    show(UserWarning("said by rank 0"), UserWarning, ours, 309)
    assert capsys.readouterr().err == "" and len(passed_on) == 1
