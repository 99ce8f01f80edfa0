"""The `normswap` command line: a Click group, one module per command.

Commands build configs and call the library; they hold no logic of their own.

`main` is the console entry point. It imports nothing heavy before it can answer Ctrl-C: an
interrupt at any moment (start-up imports included) prints one line and exits 130, and so does
one during the interpreter's shutdown after a finished run (atexit handlers of torch and tqdm).
"""

import os
import signal
import sys

EXIT_INTERRUPTED = 130


def _interrupted(*_args) -> None:
    try:
        sys.stderr.write("normswap: interrupted\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_INTERRUPTED)


def main() -> None:
    try:
        from normswap.cli.main import run

        _register_commands()
        run()
    except KeyboardInterrupt:
        _interrupted()
    except SystemExit:
        # Done: what is left is the interpreter's shutdown. The output is flushed first, since an
        # interrupt from here on ends the process without Python's own flush.
        try:
            sys.stdout.flush()
        except (KeyboardInterrupt, OSError):
            pass
        signal.signal(signal.SIGINT, _interrupted)
        raise


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
