"""How long a command takes to start and to end when its work is small.

Start-up: `--help`, a mistyped option and a missing argument are answered before anything heavy
is imported. Each case runs the console script's own code, `from normswap.cli import main;
main()`, in a fresh interpreter and asks which heavy packages it imported: torch alone is 1-2 s of
import (4-6 s on a loaded machine), where the help itself takes 70 ms.

Exit: a finished run ends without the interpreter's teardown of every module (0.8 s idle, 4-6 s
under load, after the report), and loses nothing to it: every atexit handler, the threads still
running, the C library's buffered output (normswap.cli._exit_without_teardown)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny

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


# ---- the exit ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("startup") / "llama"
    save_tiny("llama", d)
    return d


# What a finished run must not lose: an atexit handler registered before main() (as coverage's is,
# from a .pth file) and one a library registers during the command; a non-daemon thread that is
# still working when the command has returned (it waits for the main thread to stop, as Python's
# shutdown marks it, then writes a file); output buffered on a piped stdout by Python and by the C
# library (from atexit handlers: after the report). And a
# global's __del__, which only the interpreter's teardown runs: it must not run, or the run took
# the slow way out. The library's hooks go in as transformers is first imported (in the command).
_FINISHED_RUN = """
import atexit, os, sys, threading, time
OUT = sys.argv[1]
atexit.register(os.write, 2, b"atexit: registered before main\\n")
class Global:
    def __del__(self, write=os.write):
        write(2, b"teardown ran\\n")
marker = Global()
def late_writer():
    while threading.main_thread().is_alive():
        time.sleep(0.01)
    time.sleep(0.3)
    with open(os.path.join(OUT, "thread.txt"), "w") as f:
        f.write("written after the command returned")
class During:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers":
            sys.meta_path.remove(self)
            import ctypes
            atexit.register(os.write, 2, b"atexit: registered during the command\\n")
            atexit.register(ctypes.CDLL(None).printf, b"printed by C after the report\\n")
            atexit.register(lambda: sys.stdout.write("written to sys.stdout after the report\\n"))
            threading.Thread(target=late_writer).start()
        return None
sys.meta_path.insert(0, During())
from normswap.cli import main
sys.argv = ["normswap", *sys.argv[2:]]
main()
"""


def test_a_finished_run_ends_without_the_teardown_and_loses_nothing(tiny, tmp_path):
    """The interpreter's teardown after `normswap scan smollm2-135m` took 0.8 s idle and 4-6 s
    under load between the report and the shell's prompt (mostly the garbage collector walking
    torch's and transformers' objects). The run now ends after Python's own steps up to it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONUNBUFFERED", None)  # set, it leaves C's stdout unbuffered: nothing there to flush
    p = subprocess.run([sys.executable, "-c", _FINISHED_RUN, str(tmp_path), "scan", str(tiny), "--json",
                        "--no-readers"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    report, end = json.JSONDecoder().raw_decode(p.stdout)
    assert report["model"] == str(tiny)
    # what Python's last flush and exit(3)'s would have flushed, in their order
    assert p.stdout[end:].split("\n") == ["", "written to sys.stdout after the report", "printed by C after the report", ""]
    assert p.stderr.splitlines() == ["atexit: registered during the command", "atexit: registered before main"]
    assert (tmp_path / "thread.txt").read_text() == "written after the command returned"


def test_an_error_keeps_its_exit_code(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _FINISHED_RUN, str(tmp_path), "scan", str(tmp_path / "none")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    assert lines[0].startswith("normswap: error: ") and "teardown ran" not in lines, lines
    assert (tmp_path / "thread.txt").is_file()


# Put on PYTHONPATH, Python imports it at start-up, before the program: an atexit handler registered
# before normswap's code, and a global whose __del__ says whether the teardown ran.
_SITECUSTOMIZE = """
import atexit, os
atexit.register(os.write, 2, b"atexit: registered at start-up\\n")
class Global:
    def __del__(self, write=os.write):
        write(2, b"teardown ran\\n")
marker = Global()
"""


def marked_env(tmp_path: Path) -> dict:
    """An environment whose Python says on stderr that its start-up's atexit handler ran and, if
    it did, that its teardown ran."""
    d = tmp_path / "site"
    d.mkdir()
    (d / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(d)]))


def test_python_m_normswap_ends_without_the_teardown(tiny, tmp_path):
    p = subprocess.run([sys.executable, "-m", "normswap", "scan", str(tiny), "--json", "--no-readers"],
                       env=marked_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["model"] == str(tiny)
    assert p.stderr.splitlines() == ["atexit: registered at start-up"]


def test_under_a_profiler_main_returns_to_it(tmp_path):
    """main() ends the process only as the program: cProfile prints its statistics after main()
    raises SystemExit, and a run that ended the process there would lose them."""
    p = subprocess.run([sys.executable, "-m", "cProfile", "-m", "normswap", "--version"],
                       env=marked_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("normswap, version") and "function calls" in p.stdout
    assert p.stderr.splitlines() == ["atexit: registered at start-up", "teardown ran"]


# A script that runs several commands in turn, calling main() at its top level and catching the
# SystemExit that ends each: the script is the program, and goes on after each command.
_COMMANDS_IN_TURN = """
import sys
from normswap.cli import main
for args in (["--version"], ["scan", sys.argv[1]]):
    sys.argv = ["normswap", *args]
    try:
        main()
    except SystemExit as e:
        print("exited", e.code, flush=True)
print("every command ran")
"""


def test_a_script_that_catches_the_exit_goes_on(tmp_path):
    """main() called inside a try block at a script's top level ended the whole process after the
    first command (`--version`), exit 0, the script's later commands and lines never run: the
    call was taken for the program's last."""
    p = subprocess.run([sys.executable, "-c", _COMMANDS_IN_TURN, str(tmp_path / "none")],
                       env=marked_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[1:] == ["exited 0", "exited 2", "every command ran"], p.stdout
    assert p.stderr.splitlines()[0].startswith("normswap: error: "), p.stderr


# An atexit handler that leaves stdout closed, or writes to it after the report: Python's final
# flush passes over a closed stream, and says why a failing one failed (exit 120).
_LAST_WRITE = """
import atexit, sys
from normswap.cli import main
atexit.register({handler})
sys.argv = ["normswap", *sys.argv[1:]]
main()
"""


def _last_write(handler: str, stdout, env: dict, *args: str) -> subprocess.CompletedProcess:
    env = dict(env)
    env.pop("PYTHONUNBUFFERED", None)  # set, stdout holds nothing for the final flush
    return subprocess.run([sys.executable, "-c", _LAST_WRITE.format(handler=handler), *args],
                          env=env, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300)


def test_a_stdout_closed_by_an_atexit_handler_is_no_failed_flush(tmp_path):
    """Flushing the closed stdout raised ValueError, taken for a failed final flush: exit 120
    where Python's shutdown, which passes over a closed or None stream, exits 0."""
    env = marked_env(tmp_path)
    for handler in ("lambda: sys.stdout.close()", "lambda: setattr(sys, 'stdout', None)"):
        p = _last_write(handler, subprocess.PIPE, env, "--version")
        assert (p.returncode, p.stdout) == (0, "normswap, version 0.1.0\n"), (handler, p.stderr[-3000:])
        assert "teardown ran" not in p.stderr


def test_a_final_flush_that_fails_is_said_as_python_says_it(tmp_path):
    """Written after the report to a full disk, stdout's final flush failed: exit 120 as Python,
    but nothing said, where Python names the stream and the error."""
    with open("/dev/full", "w") as full:
        p = _last_write("lambda: sys.stdout.write('after the report')", full, marked_env(tmp_path),
                        "scan", str(tmp_path / "none"))
    assert p.returncode == 120, p.stderr[-3000:]
    assert p.stderr.splitlines()[1:] == ["atexit: registered at start-up",  # Python's order: handlers, then flush
                                         "Exception ignored in: <_io.TextIOWrapper name='<stdout>' mode='w' "
                                         "encoding='utf-8'>", "OSError: [Errno 28] No space left on device"], p.stderr


# ctypes as on Windows, where LoadLibrary takes a name and CDLL(None) raises TypeError.
_NO_C_LIBRARY_BY_NONE = """
import ctypes, sys
def CDLL(name, *args, **kwargs):
    raise TypeError("LoadLibrary() argument 1 must be str, not None")
ctypes.CDLL = CDLL
from normswap.cli import main
sys.argv = ["normswap", *sys.argv[1:]]
main()
"""


def test_without_a_c_library_to_flush_python_ends_the_run(tmp_path):
    """Where the C library cannot be named (Windows: TypeError from CDLL(None)), every finished
    run ended in a traceback and exit 1 after its report; Python's own shutdown ends it instead."""
    p = subprocess.run([sys.executable, "-c", _NO_C_LIBRARY_BY_NONE, "--version"], env=marked_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert (p.returncode, p.stdout) == (0, "normswap, version 0.1.0\n"), p.stderr[-3000:]
    assert p.stderr.splitlines() == ["atexit: registered at start-up", "teardown ran"], p.stderr
