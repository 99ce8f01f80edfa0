"""Import a script of benchmarks/ (not a package) as a module, for the tests that drive one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"normswap_benchmarks_{name}", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
