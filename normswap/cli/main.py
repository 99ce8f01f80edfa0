"""The group, and what every command shares: one-line errors with exit code 2, and --json."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

import normswap  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)
from normswap.errors import NormswapError
from normswap.jsonsafe import finite_or_null

EXIT_BAD_INPUT = 2


class NormswapGroup(click.Group):
    """Turns every NormswapError into one line on stderr and exit code 2 (no traceback)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except NormswapError as e:
            click.echo(f"normswap: error: {e}", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except click.UsageError as e:
            # A mistyped option is bad input like any other: one line, not click's usage + hint + error.
            hint = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
            click.echo(f"normswap: error: {e.format_message()}{hint}", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            click.echo("normswap: interrupted", err=True)
            ctx.exit(130)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:
            if os.environ.get("NORMSWAP_DEBUG"):
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            click.echo(
                f"normswap: internal error: {e.__class__.__name__}: {first} "
                "(set NORMSWAP_DEBUG=1 for the traceback)",
                err=True,
            )
            ctx.exit(1)


@click.group(cls=NormswapGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(normswap.__version__, prog_name="normswap")
def cli() -> None:
    """Find, swap, fold and measure the normalization layers of Hugging Face models."""


def json_option(f: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")(f)


def emit(data: dict, as_json: bool, render: Callable[[dict], None]) -> None:
    """Print `data` as one JSON document, or hand it to the command's human renderer."""
    if as_json:
        sys.stdout.write(json.dumps(finite_or_null(data), indent=2, default=str, allow_nan=False) + "\n")
    else:
        render(data)


def main() -> None:
    cli(prog_name="normswap")
