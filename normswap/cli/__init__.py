"""The `normswap` command line: a Click group, one module per command.

Commands build configs and call the library; they hold no logic of their own.

`main` is the console entry point. Before it can answer Ctrl-C, what the console script imports
(normswap, normswap.cli and the leaves they read) imports no module the interpreter has not loaded
already: an interrupt there, in a module's import, ended the process with a traceback (and by the
signal: exit -2), a window of 35 ms idle, several times that on a loaded machine.
An interrupt at any moment after (start-up imports included) prints one line and exits 130, and so does
one during the interpreter's shutdown after a finished run (atexit handlers of torch and tqdm),
up to its last moments (see main).
A finished run ends the process itself, after every step of Python's shutdown but its teardown of
every module (_exit_without_teardown: 0.8 s idle, several seconds under load, for no output).
SIGTERM (`kill`, `timeout`, a batch scheduler's cancel, `docker stop`) is an interrupt too, so the
same clean-up runs (a staging directory and lock file removed): one line, exit 143.
"""

# Not signal.py, which start-up has not loaded (cli.signals says why): the built-in module under it.
import _signal as signal
import os
import sys

from normswap.cli.signals import (
    end_at_once,
    exit_now,
    interruption,
    raise_interrupt,
    resending_lost_interrupts,
)


def _handle(signals, handler) -> None:
    for signum in signals:
        signal.signal(signum, handler)


def _reopen_closed_std_streams() -> None:
    """A standard stream closed at start-up (`normswap ... >&-`, a daemon's) is /dev/null from here
    on. Python leaves sys.stdout None there, so writing the report was an internal error with a
    traceback, even after the work was done; and the next file opened would take descriptor 1,
    where whatever a library prints would be written into it (a weights file being saved)."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: `fd` itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115  (the stream for the process)


def main() -> None:
    # Start-up, imports only: nothing is written yet, so an interrupt ends the process at once.
    # Raised as an exception it could land inside a C extension's initialisation (numpy's, under
    # torch's import), which turns it into an ImportError or leaves the module half made: an
    # internal error or a traceback (exit 1) in place of 'normswap: interrupted'.
    # A signal ignored by whoever started us stays ignored (as Python leaves an ignored SIGINT): a
    # shell script's background job ('normswap ... &') ignores SIGINT so that a Ctrl-C meant for the
    # script's foreground command does not end it; set here unconditionally, it did end it.
    ours = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) != signal.SIG_IGN]
    _handle(ours, end_at_once)
    program = _is_the_program(sys._getframe(1))
    _reopen_closed_std_streams()
    try:
        from normswap.cli.main import run

        _register_commands()
        # The command: raised where the program is, so that its clean-ups run (a staging folder,
        # a lock file, the folders made for --out)
        _handle(ours, raise_interrupt)
        sys.unraisablehook = resending_lost_interrupts(sys.unraisablehook)
        run()
    except KeyboardInterrupt as e:
        exit_now(*interruption(e))
    except SystemExit as done:
        # Done: what is left is the interpreter's shutdown. The output is flushed first, since an
        # interrupt from here on ends the process without Python's own flush.
        try:
            sys.stdout.flush()
        except (KeyboardInterrupt, OSError):
            pass
        # These run until the process ends (_exit_without_teardown), or, where that cannot be,
        # until Python switches its signal handling off (after the atexit handlers and its own
        # flush of stdout and stderr); a signal later than that takes the default action, with no
        # line: acceptable, since the run has finished by then (every write published, every lock
        # released, the output flushed) and the shell still reports 130 or 143.
        _handle(ours, end_at_once)
        if program:
            _exit_without_teardown(done.code)
        raise


def _is_the_program(caller) -> bool:
    """Whether main(), called from `caller` (a frame), is the program: called at the top level of
    the console script, of `python -m normswap` (under runpy's frames) or of `python -c`, so that
    nothing but the interpreter's exit runs after it. Not so under a profiler (`python -m cProfile
    -m normswap`, whose statistics are printed after main() returns), a debugger, or a program or
    test that calls main() from a function. Nor where the call may be inside a try or with block
    of the caller's: `try: main() except SystemExit: ...` at a script's top level (one that runs
    several commands in turn) goes on after main(), and ending the process there ended the script
    after its first command, silently and with exit 0."""
    if caller.f_code.co_name != "<module>" or _has_a_handler(caller.f_code):
        return False
    frame = caller.f_back
    while frame is not None:
        if frame.f_globals.get("__name__") != "runpy":
            return False
        frame = frame.f_back
    return True


def _has_a_handler(code) -> bool:
    """Whether `code` has a try or with block anywhere (then the call to main() may be inside one:
    not the program, for the slow exit rather than a lost script). Python 3.11+ lists them in the
    code's exception table, 3.10 opens each with a SETUP_ instruction."""
    table = getattr(code, "co_exceptiontable", None)
    if table is not None:
        return bool(table)
    import dis

    return any(i.opname.startswith("SETUP_") for i in dis.get_instructions(code))


def _exit_without_teardown(code) -> None:
    """End the finished program as Python would, without its teardown of every module: the
    interpreter's own steps up to it (non-daemon threads joined, every atexit handler run, in
    Python's order, those registered before main() included: accelerate's and tracker's, logging's,
    coverage's; stdout and stderr flushed; the C library's buffered output flushed, as exit(3)
    does), then os._exit. The teardown that is skipped destroys the modules' objects one by one and
    garbage-collects torch's and transformers' few hundred thousand objects: 0.8 s idle after
    `normswap scan smollm2-135m` (over 90% of it in the collector), 4-6 s on a loaded machine, between
    the report and the shell's prompt, for no output: at that point no normswap file is open (every
    write closed and renamed into place, every lock released in its `finally`), and Python does
    not promise to run the __del__ of what is still alive then.
    Returns, for Python's own shutdown, wherever a step is missing here: an exit code that is not a
    number (Python prints it), `python -i`, an interpreter without threading._shutdown or
    atexit._run_exitfuncs (the calls the interpreter itself makes), a C library that cannot be
    reached to flush."""
    if not (code is None or isinstance(code, int)) or sys.flags.inspect:
        return
    import atexit

    threading = sys.modules.get("threading")  # not imported: no thread was started
    join_threads = getattr(threading, "_shutdown", None) if threading else (lambda: None)
    run_atexit = getattr(atexit, "_run_exitfuncs", None)
    if join_threads is None or run_atexit is None:
        return
    join_threads()
    run_atexit()
    status = code or 0
    for stream in (sys.stdout, sys.stderr):
        # As Python's own final flush: a stream set to None or closed (by an atexit handler, a
        # library) is passed over, not a failed flush (exit 120 where Python exits 0).
        if stream is None or getattr(stream, "closed", False):
            continue
        try:
            stream.flush()
        except Exception as e:
            status = 120  # what Python exits with when its own final flush fails
            if stream is sys.stdout:  # and says why (for stderr it cannot)
                _say_ignored(e, stream)
    ctypes = sys.modules.get("ctypes")  # not imported: no C library's output to flush
    if ctypes is not None:
        try:
            ctypes.CDLL(None).fflush(None)
        except (OSError, AttributeError, TypeError):  # none by that name: Windows' LoadLibrary takes no None (TypeError)
            return
    os._exit(status)


def _say_ignored(error: BaseException, stream) -> None:
    """What Python writes to stderr when its final flush of stdout fails (its unraisable hook's
    'Exception ignored in: ...' and the error), for a failure it would have said."""
    import traceback

    try:
        sys.stderr.write(f"Exception ignored in: {stream!r}\n")
        sys.stderr.writelines(traceback.format_exception_only(error))
        sys.stderr.flush()
    except Exception:  # stderr gone too: nothing left to say it on
        pass


def _register_commands() -> None:
    # Each import registers its command on the group.
    from normswap.cli import bench, convert, demo, diff, experiment, patch, ppl, scan, tune  # noqa: F401


def __getattr__(name: str):
    # `from normswap.cli import cli` (tests, embedding programs): the group with every command.
    if name == "cli":
        from normswap.cli.main import cli

        _register_commands()
        return cli
    raise AttributeError(f"module 'normswap.cli' has no attribute {name!r}")
