"""`normswap ppl MODEL --data PATH`: sliding-window perplexity (see normswap.evaluate)."""

from __future__ import annotations

from collections.abc import Callable

import click

from normswap.backends import BACKENDS
from normswap.cli.main import ProgressBars, cli, emit, json_option, model_epilog
from normswap.dtypes import RUN_DTYPES

# What evaluate_checkpoint's messages and its settings' call their options here: the flags of
# eval_options they came from (--max-length, --text-field, --impl, ...).
OPTION_NAMES = {k: "--" + k.replace("_", "-") for k in ("max_length", "stride", "max_tokens", "batch_size",
                                                         "text_field", "impl", "dtype")}


def eval_options(f: Callable) -> Callable:
    """The options `ppl` and `diff` share: what to read, how to cut it into windows, and how to load the models."""
    options = [
        click.option("--data", "data_path", required=True, metavar="PATH",
                     help="A text file (or .gz), a .jsonl file (or .jsonl.gz), a directory of .txt files, or a saved `datasets` dataset."),
        click.option("--text-field", default="text", show_default=True, metavar="FIELD",
                     help="The field holding the text in .jsonl rows and datasets."),
        click.option("--max-length", type=int, default=None,
                     help="Window length in tokens (default and cap: the model's context)."),
        click.option("--stride", type=int, default=None, help="Tokens between window starts (default: half the window)."),
        click.option("--max-tokens", type=int, default=None, help="Score only the first T tokens of the data."),
        click.option("--batch-size", type=int, default=1, show_default=True, help="Windows per forward pass."),
        click.option("--dtype", type=click.Choice(RUN_DTYPES), default=None,
                     help="Load the weights in this dtype (default: the checkpoint's)."),
        click.option("--impl", "recorded_impl", type=click.Choice(BACKENDS), default=None,
                     help="Run the patch a directory's normswap.json records with this implementation instead "
                          "(e.g. torch where the recorded one cannot run)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def named_model(name: str, impl: str | None) -> str:
    """A model's name, and the impl normswap runs its norms with when the name does not already
    say it (`A --patched IMPL` does; a directory whose normswap.json records a patch does not)."""
    return name if impl is None or name.endswith(f" {impl}") else f"{name} (its normswap.json's patch, run with {impl})"


def describe_windows(d: dict) -> str:
    return (f"{d['tokens']} scored tokens in {d['windows']} window{'s' * (d['windows'] != 1)} "
            f"of up to {d['max_length']} tokens, stride {d['stride']}")


@cli.command(epilog=model_epilog())
@click.argument("model")
@eval_options
@json_option
def ppl(model, data_path, text_field, max_length, stride, max_tokens, batch_size, dtype, recorded_impl,
        as_json) -> None:
    """Perplexity of MODEL on the text at PATH (sliding window, the transformers recipe).

    A directory `normswap patch --out` wrote runs the patch its normswap.json records (--impl: with
    another implementation)."""
    from normswap.api import EvalSettings, evaluate_checkpoint

    settings = EvalSettings(data_path, text_field, max_length, stride, max_tokens, batch_size, OPTION_NAMES)
    with ProgressBars({"perplexity": "tok"}) as bars:
        result = evaluate_checkpoint(model, settings, impl=recorded_impl, dtype=dtype, progress=bars,
                                     option_names=OPTION_NAMES)

    def render(d: dict) -> None:
        click.echo(f"{named_model(d['model'], d['impl'])} on {d['data']} ({d['dtype']}): perplexity {d['ppl']:.4f} "
                   f"(NLL {d['nll']:.4f} nats/token)")
        click.echo(describe_windows(d))

    emit(result.to_dict(), as_json, render)
