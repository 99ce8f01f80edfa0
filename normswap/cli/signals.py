"""How the command line names an interrupt: Ctrl-C, or SIGTERM raised as Terminated. A leaf (no
imports of normswap), read by the entry point before anything heavy is imported and by the group."""

# _signal, the built-in module under signal.py: read before the entry point can answer Ctrl-C, and
# signal.py is not loaded at start-up (it brings enum and functools): an interrupt in its import
# was a traceback. Its numbers and handlers are the same, as plain ints.
import os
import sys
from _signal import SIGINT, SIGTERM, getsignal, signal

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM raised where the program is, like Ctrl-C's KeyboardInterrupt: every `finally` and
    context manager on the way out runs. The default action ends the process on the spot and
    leaves a model-sized staging directory and the target's lock file behind."""


def interruption(error: BaseException) -> tuple[str, int]:
    """The line and exit code for an interrupt: Ctrl-C, or SIGTERM (Terminated)."""
    if isinstance(error, Terminated):
        return "normswap: terminated", EXIT_TERMINATED
    return "normswap: interrupted", EXIT_INTERRUPTED


# The interrupts this process has received through raise_interrupt, as the exceptions it raised.
_RECEIVED: list[KeyboardInterrupt] = []


def raise_interrupt(signum: int, _frame=None) -> None:
    """The command line's handler for SIGINT and SIGTERM while a command runs: KeyboardInterrupt (or
    Terminated) raised where the program is, so every clean-up on the way out runs, and remembered.
    A library may catch it on its way and raise another error in its place: an import interrupted
    inside a C extension's initialisation (numpy's) comes out as an ImportError, which transformers'
    lazy import of a model class turns into "Could not import module 'GPT2LMHeadModel'"; a run that
    then fails was interrupted, not broken (received_interrupt)."""
    error = Terminated() if signum == SIGTERM else KeyboardInterrupt()
    _RECEIVED.append(error)
    raise error


def resending_lost_interrupts(previous):
    """A sys.unraisablehook for the command line, around `previous`: an interrupt raise_interrupt
    raised where Python cannot pass an exception on (a __del__, a weakref callback: regex's
    Group.__del__ runs often under transformers' lazy imports) is not printed as 'Exception
    ignored in ...' with a traceback, after which the run went on as if Ctrl-C had not been
    pressed: the signal is sent again 50 ms later, when the program is elsewhere (if it is in such
    a place again, this repeats). Anything else goes to `previous`."""

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        if isinstance(error, KeyboardInterrupt) and any(error is e for e in _RECEIVED):
            import threading  # loaded by then (torch imports it): not before the entry point answers

            timer = threading.Timer(0.05, os.kill, (os.getpid(), SIGTERM if isinstance(error, Terminated) else SIGINT))
            timer.daemon = True  # the run may end first: nothing then to interrupt
            timer.start()
            return
        previous(unraisable)

    return hook


def received_interrupt() -> KeyboardInterrupt | None:
    """The first interrupt raise_interrupt raised in this process, None when none came."""
    return _RECEIVED[0] if _RECEIVED else None


def exit_now(line: str, code: int) -> None:
    """Say `line` and end the process at once with `code`: for a moment where nothing needs
    cleaning up (nothing written yet, or everything already done)."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


def end_at_once(signum: int, _frame=None) -> None:
    """The handler for SIGINT and SIGTERM while nothing needs cleaning up: one line, and the exit."""
    exit_now(*interruption(Terminated() if signum == SIGTERM else KeyboardInterrupt()))


class EndingAtOnce:
    """`with EndingAtOnce():` the signals answered by raise_interrupt end the process at once
    (end_at_once) for the block, then are raised again. For imports before a command has done
    anything: raised there, an interrupt may land in a __del__ (regex's, under transformers'
    import), where Python prints 'Exception ignored ... KeyboardInterrupt' and goes on, so the
    run carried on to exit 0 as if Ctrl-C had not been pressed. (No contextlib: this module is
    read before the entry point answers signals, and contextlib is not loaded by then.)"""

    def __enter__(self) -> None:
        self._ours = [s for s in (SIGINT, SIGTERM) if getsignal(s) is raise_interrupt]
        for s in self._ours:
            signal(s, end_at_once)

    def __exit__(self, *_exc) -> None:
        for s in self._ours:
            signal(s, raise_interrupt)
