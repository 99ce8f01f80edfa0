"""The group, and what every command shares: one-line errors with exit code 2, and --json."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

import normswap  # noqa: F401  (decides TRITON_INTERPRET before anything imports triton)
from normswap._env import launched_main
from normswap.cli.signals import EndingAtOnce, interruption, received_interrupt
from normswap.errors import EveryProcessError, NormswapError
from normswap.jsonsafe import finite_or_null
from normswap.progress import ProgressBars  # noqa: F401  (every command draws the library's progress with it)

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a tool that SIGPIPE ended


def _stdout_is_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (`normswap scan M | head -1`): poll reports an
    error on its write end. A BrokenPipeError from any other pipe is a real failure."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or no real stdout (a test runner's)
        return False


def _exit_if_stdout_closed(error: OSError) -> None:
    """A reader that stopped early is no error: end quietly like a Unix tool that SIGPIPE ended
    (Python ignores SIGPIPE, so the write raised instead). Stdout becomes /dev/null, so the
    interpreter's final flush of what is still buffered does not raise again (the Python docs'
    note on SIGPIPE). Returns for any other error."""
    if not (isinstance(error, BrokenPipeError) and _stdout_is_closed()):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(EXIT_STDOUT_CLOSED)


def report_console(**kwargs):
    """A rich Console for a command's report. Rich answers a closed stdout by exiting with 1, the
    internal-error code, without a word: here the BrokenPipeError goes on to the group, which
    exits as for any other write to a closed stdout."""
    return _report_console_class()(**kwargs)


@functools.cache
def _report_console_class() -> type:
    # Built on first use, once: importing rich costs a command that prints no report its start-up time.
    from rich.console import Console

    class ReportConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    return ReportConsole


def _usage_line(e: click.UsageError) -> str:
    # A mistyped option is bad input like any other: one line, not click's usage + hint + error.
    if isinstance(e, click.exceptions.NoArgsIsHelpError):
        return e.format_message()  # no command at all: the help itself, as it is laid out
    hint = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
    if isinstance(e, click.NoSuchOption) and e.possibilities and e.ctx is not None:
        # click suggests from every spelling the parser knows, an old or hidden one included
        # (`bench --imp`: "Did you mean one of: '--impl', '--impls'"): offer only those --help shows.
        # The close ones picked here: up to click 8.3, NoSuchOption lists every possibility it is given.
        from difflib import get_close_matches  # here: the start-up imports nothing it need not (0849d85)

        close = get_close_matches(e.option_name, _shown_long_spellings(e.ctx))
        e = click.NoSuchOption(e.option_name, e.message, close, e.ctx)
    message = e.format_message()
    if isinstance(e, click.MissingParameter):
        # click lays a missing choice's values out as "Choose from:\n\ta,\n\tb": its own line
        # breaks, not a user's, so they become spaces rather than an escaped "\n\t".
        message = message.replace("\n\t", " ")
    return f"normswap: error: {_escaped(message)}{hint}"


def _escaped(message: str) -> str:
    # The contract is one line: a path the user gave may hold a line break, shown as \n.
    return message.replace("\r", "\\r").replace("\n", "\\n")


_PACKAGE = Path(normswap.__file__).resolve().parent


def one_line_warnings(python_form: Callable) -> Callable:
    """A warnings.showwarning for the commands: a warning normswap raises is one line,
    `normswap: warning: ...`, as scan's are; Python's form (`/path/runner.py:295: UserWarning: ...`
    and the source line below it) names our code, not what the user can do. Warnings from other
    packages keep Python's form (`python_form`, the showwarning in place before): where they come
    from is part of what they say. Under a launcher (`accelerate launch -m normswap experiment`)
    every process runs the command and would say the same warning: only rank 0 says normswap's."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        try:
            ours = Path(filename).resolve().is_relative_to(_PACKAGE)
        except (OSError, ValueError):
            ours = False
        if ours:
            if launched_main():
                _warning_line(message)
        else:
            python_form(message, category, filename, lineno, file, line)

    return show


def _warning_line(message) -> None:
    text = str(message).removeprefix("normswap: ")
    try:
        click.echo(f"normswap: warning: {_escaped(text)}", err=True)
    except (OSError, ValueError):  # stderr closed: a warning is never worth failing the work for
        pass


class NormswapCommand(click.Command):
    """Every command (the group's command_class). torch and transformers are imported as the
    command starts, not as the group finds it: there they were imported before click had read
    the command's arguments, so `COMMAND --help` and a mistyped option took 1.5-2 s."""

    def invoke(self, ctx: click.Context) -> Any:
        # Every command's library call imports both (1-2 s idle, 4 s under load): here, before the
        # command has done anything, so that an interrupt in them ends the run at once, as one
        # during start-up does (signals.EndingAtOnce says why a raised one could be lost).
        with EndingAtOnce():
            import torch  # noqa: F401

            quiet_transformers()
            # triton too (where installed): torch._dynamo imports it under transformers' model
            # classes, and an interrupt raised while its native module starts (its enums are made
            # from C++ through nanobind) aborted the process (C++ terminate, SIGABRT, a traceback)
            if importlib.util.find_spec("triton") is not None:
                import triton  # noqa: F401
        return super().invoke(ctx)


class NormswapGroup(click.Group):
    """Turns every NormswapError (and any OSError: a permission, a full disk, an unreadable file)
    into one line on stderr and exit code 2, Ctrl-C into one line and 130; anything else is an
    internal error, one line and exit 1 (NORMSWAP_DEBUG=1 shows the traceback)."""

    command_class = NormswapCommand

    def main(self, args=None, prog_name=None, **extra) -> Any:
        # click's standalone mode would answer Ctrl-C with a blank line + "Aborted!" and exit 1,
        # and a usage error in the group's own options with its usage block: do it ourselves.
        extra.pop("standalone_mode", None)
        try:
            rv = super().main(args, prog_name, standalone_mode=False, **extra)
        except (KeyboardInterrupt, click.Abort) as e:
            line, code = interruption(e)
            click.echo(line, err=True)
            sys.exit(code)
        except click.UsageError as e:
            if launched_main():  # every process of a launch parses the same arguments: said once
                click.echo(_usage_line(e), err=True)
            sys.exit(EXIT_BAD_INPUT)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        # The group's own --help and --version write here, before invoke; click would answer a
        # closed stdout with exit 1 and nothing said.
        try:
            return super().make_context(info_name, args, parent, **extra)
        except OSError as e:
            _exit_if_stdout_closed(e)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with warnings.catch_warnings():
                warnings.showwarning = one_line_warnings(warnings.showwarning)
                return super().invoke(ctx)
        except NormswapError as e:
            _exit_if_interrupted(ctx)
            if launched_main() or not isinstance(e, EveryProcessError):  # else the main process says it
                click.echo(f"normswap: error: {_escaped(str(e))}", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except OSError as e:
            _exit_if_interrupted(ctx)
            _exit_if_stdout_closed(e)
            from normswap.errors import one_line

            click.echo(f"normswap: error: {_escaped(one_line(e))}", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except click.UsageError as e:
            if launched_main():  # every process of a launch parses the same arguments: said once
                click.echo(_usage_line(e), err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except KeyboardInterrupt as e:
            line, code = interruption(e)
            click.echo(line, err=True)
            ctx.exit(code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:
            _exit_if_interrupted(ctx)
            if os.environ.get("NORMSWAP_DEBUG"):
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            click.echo(
                f"normswap: internal error: {e.__class__.__name__}: {first} "
                "(set NORMSWAP_DEBUG=1 for the traceback)",
                err=True,
            )
            ctx.exit(EXIT_INTERNAL)


def _exit_if_interrupted(ctx: click.Context) -> None:
    """A command that fails after an interrupt came was interrupted: a library on the way may have
    turned the KeyboardInterrupt into an error of its own (signals.raise_interrupt)."""
    error = received_interrupt()
    if error is not None:
        line, code = interruption(error)
        click.echo(line, err=True)
        ctx.exit(code)


@click.group(cls=NormswapGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(normswap.__version__, prog_name="normswap")
def cli() -> None:
    """Find, swap, fold and measure the normalization layers of Hugging Face models.

    Exit codes: 0 done; 2 bad input (one line on stderr); 1 internal error; 130 interrupted
    (Ctrl-C); 143 terminated (SIGTERM: cleaned up as for Ctrl-C); 141 stdout closed by its reader
    (`| head`: ended quietly).
    With --json stdout holds one JSON document or nothing (see README: the error contract).

    Writes are staged in a hidden .DIR.normswap-PID-* directory beside the target and renamed into
    place after verification. A run killed with kill -9 leaves that directory (up to the model's
    size) until the next run on the same target removes it; delete it by hand to reclaim the space
    sooner.
    """


def model_epilog(name: str = "MODEL") -> str:
    """What a model argument may be, shown under each command that takes one (patch --help said
    MODEL and nothing more; bench's said "anything `patch` takes")."""
    return (f"{name}: a local directory, a .gguf file, a hub id already in the local Hugging Face cache "
            "(org/name, or an org-less name such as gpt2; normswap never downloads), or smollm2-135m, "
            "the embedded default.")


def json_option(f: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")(f)


class OldSpellings(click.Option):
    """An option whose spellings after the first are its old names: still accepted, left out of
    --help (and so of the README's option lists). A list option is named as the library names its
    parameter, in the plural (bench's --impls and --modes, as tune's --ops and experiment's
    --arms); bench's --impl and --mode, their names before, keep working for the scripts that
    wrote them, as does scan's --no-consumers (--no-readers). Messages name the first spelling, and
    a mistyped option is suggested only the first (_usage_line)."""

    def get_help_record(self, ctx: click.Context):
        shown = copy.copy(self)
        shown.opts = self.opts[:1]
        return click.Option.get_help_record(shown, ctx)


def _shown_long_spellings(ctx: click.Context) -> list[str]:
    """The long spellings of ctx's command's options that --help shows: not a hidden option's, not
    an OldSpellings' old names. A mistyped option is suggested these (click's parser offers the
    long ones only, as here)."""
    spellings = []
    for param in ctx.command.get_params(ctx):
        if isinstance(param, click.Option) and not param.hidden:
            opts = param.opts[:1] if isinstance(param, OldSpellings) else param.opts
            spellings += [o for o in opts + param.secondary_opts if len(o) > 2]  # not -h
    return spellings


def device_option(f: Callable) -> Callable:
    """--device, as patch and bench take it (loading.parse_device reads the value): one spelling,
    one default and one help text, where bench had no `auto` in its help and no default shown."""
    return click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda|cuda:N",
                        help="Where the model runs; auto: the CUDA device when there is one.")(f)


def emit(data: dict, as_json: bool, render: Callable[[dict], None], *, notes: bool = True) -> None:
    """Print `data` as one JSON document, or hand it to the command's human renderer. A write that
    fails (a full disk: `> /dev/full`) says it was stdout: the system's reason alone ("No space
    left on device") read as if the command's own output (a saved model) had failed. A report's
    unused_tensors (what a load dropped that cannot change what the model computes) are said first,
    one note each on stderr, --json or not (notes=False: a refusal's report, whose error line is
    the answer; the JSON keeps them)."""
    for unused in (data.get("unused_tensors") or ()) if notes else ():
        click.echo(f"note: {unused['note']}", err=True)
    try:
        if as_json:
            sys.stdout.write(json.dumps(finite_or_null(data), indent=2, default=str, allow_nan=False) + "\n")
        else:
            render(data)
        sys.stdout.flush()  # what is still buffered fails here, not in the interpreter's last flush
    except OSError as e:
        _exit_if_stdout_closed(e)
        from normswap.errors import one_line

        raise NormswapError(f"could not write the report to stdout: {one_line(e)}") from None


def run() -> None:
    cli(prog_name="normswap")


def quiet_transformers() -> None:
    """Every command: normswap's bars are on stderr, one per stage, and bad input is one line there;
    transformers' own bars and config warnings (a vocab_size of 0 logs three lines before our
    error) would interleave with them. Errors still show."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
