"""`normswap demo`: the main job on the embedded default model (no hub, no GPU needed).

It strings the real commands together, so the demo shows exactly what a user would see:
scan the norms, patch them with the Triton kernels (the CPU interpreter when there is no GPU),
verify every module, and diff the perplexity of the original and the patched model."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import click

from normswap.cli.main import cli, json_option

DEMO_TEXT = Path(__file__).resolve().parent.parent / "data" / "genesis-kjv.txt"


@cli.command()
@click.option("--impl", default="triton", show_default=True, help="Implementation to patch with.")
@click.option("--max-tokens", type=int, default=512, show_default=True, help="Tokens of the demo text to score.")
@json_option
@click.pass_context
def demo(ctx: click.Context, impl: str, max_tokens: int, as_json: bool) -> None:
    """Scan, patch (--impl triton) and perplexity-diff the embedded SmolLM2-135M."""
    from normswap.evaluate import check_window_options
    from normswap.loading import DEFAULT_MODEL

    # the demo's own option, named as the user typed it (it feeds patch's --eval-max-* options)
    check_window_options(None, None, max_tokens, names={"max_tokens": "--max-tokens"})
    steps = [
        ("scan", dict(model=DEFAULT_MODEL)),
        ("patch", dict(model=DEFAULT_MODEL, impl=impl, eval_path=str(DEMO_TEXT), eval_max_length=min(256, max_tokens),
                       eval_max_tokens=max_tokens)),
    ]
    results = {}
    for name, kwargs in steps:
        click.echo(f"\n$ normswap {name} {_args(kwargs)}", err=True)
        command = cli.get_command(ctx, name)
        if not as_json:
            ctx.invoke(command, **kwargs)
            continue
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            ctx.invoke(command, as_json=True, **kwargs)
        results[name] = json.loads(buffer.getvalue())
    if as_json:
        sys.stdout.write(json.dumps(results, indent=2, default=str) + "\n")


def _args(kwargs: dict) -> str:
    names = {"eval_path": "--eval", "eval_max_length": "--eval-max-length", "eval_max_tokens": "--eval-max-tokens"}
    parts = [str(kwargs["model"])]
    for key, value in kwargs.items():
        if key != "model":
            parts.append(f"{names.get(key, '--' + key.replace('_', '-'))} {value}")
    return " ".join(parts)
