"""The hostile sweep (benchmarks/hostile_sweep.py) in the test suite: every bad input to every
command must exit 2 with one clear line, nothing on stdout (unless the contract allows a report),
no traceback or warning, and every input directory unchanged. In-process and on tiny models, so
all of it runs (about 15 s)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sweep_module():
    spec = importlib.util.spec_from_file_location("hostile_sweep", ROOT / "benchmarks" / "hostile_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hostile_sweep"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


SWEEP = _sweep_module()


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    import transformers

    transformers.utils.logging.set_verbosity_error()  # quiet while the fixtures are built
    made = SWEEP.fixtures(tmp_path_factory.mktemp("hostile"))
    # The commands must quiet transformers themselves: a config warning beside the error line is
    # a defect the sweep has to see.
    transformers.utils.logging.set_verbosity_warning()
    return made


NAMES = [c.name for c in SWEEP.cases(SWEEP.fixtures_stub())]


def test_the_sweep_covers_every_command_with_at_least_60_inputs():
    listed = SWEEP.cases(SWEEP.fixtures_stub())
    commands = {str(c.args[0]) for c in listed}
    assert len(listed) >= 60 and len(set(NAMES)) == len(NAMES)
    assert {"scan", "patch", "convert", "ppl", "diff", "demo", "bench", "experiment"} <= commands


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_is_clean(fx, name):
    (case,) = [c for c in SWEEP.cases(fx) if c.name == name]
    inputs = [p for p in fx["root"].iterdir() if p.is_dir() and p.name != "out"]
    outcome = SWEEP.run_case(case, inputs)
    out = fx["root"] / "out"
    written = out.exists()
    if written:
        import shutil

        shutil.rmtree(out)
    assert outcome.clean and not written, (case.name, outcome.problems, outcome.error_line)
