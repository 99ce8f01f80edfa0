"""How the command line names an interrupt: Ctrl-C, or SIGTERM raised as Terminated. A leaf (no
imports of normswap), read by the entry point before anything heavy is imported and by the group."""

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
