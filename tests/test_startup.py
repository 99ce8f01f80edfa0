"""How long a command takes when its work is small: `--help`, a mistyped option and a missing
argument are answered before anything heavy is imported.

Each case runs the console script's own code, `from normswap.cli import main; main()`, in a fresh
interpreter and asks which heavy packages it imported: torch alone is 1-2 s of import (4-6 s on a
loaded machine), where the help itself takes 70 ms."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from normswap.cli import cli

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "triton", "accelerate", "numpy", "safetensors")

# Says on stderr, after the run, which of HEAVY it imported (an atexit handler: main() ends by
# raising SystemExit).
_DRIVER = f"""
import atexit, sys
atexit.register(lambda: sys.stderr.write(
    "\\nheavy imports: " + ",".join(m for m in {HEAVY!r} if m in sys.modules) + "\\n"))
from normswap.cli import main
sys.argv = ["normswap", *sys.argv[1:]]
main()
"""


def _run(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _DRIVER, *args], env=env, capture_output=True, text=True,
                       timeout=300)
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("heavy imports:")]
    assert len(said) == 1, p.stderr[-3000:]
    heavy = said[0].removeprefix("heavy imports:").strip()
    return p, heavy.split(",") if heavy else []


COMMANDS = sorted(cli.commands)


def test_every_command_is_covered():
    # the list is the group's, so a new command is held to the same rule
    assert {"bench", "convert", "demo", "diff", "experiment", "patch", "ppl", "scan", "tune"} <= set(COMMANDS)


@pytest.mark.parametrize("args", [["--help"], ["--version"], []] + [[c, "--help"] for c in COMMANDS],
                         ids=lambda a: " ".join(a) or "no-args")
def test_help_imports_nothing_heavy(args):
    """`normswap --help` took 1.4 s (normswap.cli.bench imported normswap.bench, and with it torch,
    for two constants) and `normswap COMMAND --help` 2 s (the group imported transformers before
    click read the command's arguments)."""
    p, heavy = _run(*args)
    assert p.returncode == (2 if not args else 0), p.stderr[-3000:]  # no command at all: the help, exit 2
    assert ("normswap, version" if args == ["--version"] else "Usage: normswap") in (p.stdout + p.stderr)
    assert heavy == [], f"normswap {' '.join(args)} imported {heavy}"


@pytest.mark.parametrize("command", COMMANDS)
def test_a_mistyped_option_imports_nothing_heavy(command):
    p, heavy = _run(command, "--no-such-option")
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.startswith("normswap: error: No such option '--no-such-option'"), p.stderr[-3000:]
    assert heavy == [], f"normswap {command} --no-such-option imported {heavy}"


def test_a_bad_choice_and_a_missing_argument_import_nothing_heavy():
    p, heavy = _run("bench", "m", "--dtype", "fp8")
    assert p.returncode == 2 and "Invalid value for '--dtype'" in p.stderr, p.stderr[-3000:]
    assert heavy == []
    p, heavy = _run("patch")
    assert p.returncode == 2 and "Missing argument 'MODEL'" in p.stderr, p.stderr[-3000:]
    assert heavy == []


def test_the_driver_sees_a_heavy_import():
    """The check can fail: a command that runs imports torch and transformers, and the driver says so."""
    p, heavy = _run("scan", "/no/such/model")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "transformers" in heavy and "torch" in heavy
