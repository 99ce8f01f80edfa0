"""`normswap ppl MODEL --data PATH`: sliding-window perplexity (see normswap.evaluate)."""

from __future__ import annotations

from collections.abc import Callable

import click

from normswap.cli.main import cli, emit, json_option


def eval_options(f: Callable) -> Callable:
    """The options `ppl` and `diff` share: what to read and how to cut it into windows."""
    options = [
        click.option("--data", "data_path", required=True, metavar="PATH",
                     help="A text file, a .jsonl file, a directory of .txt files, or a saved `datasets` dataset."),
        click.option("--text-field", default="text", show_default=True,
                     help="The field holding the text in .jsonl rows and datasets."),
        click.option("--max-length", type=int, default=None,
                     help="Window length in tokens (default and cap: the model's context)."),
        click.option("--stride", type=int, default=None, help="Tokens between window starts (default: half the window)."),
        click.option("--max-tokens", type=int, default=None, help="Score only the first T tokens of the data."),
        click.option("--batch-size", type=int, default=1, show_default=True, help="Windows per forward pass."),
        click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
                     help="Load the weights in this dtype (default: the checkpoint's)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def window_settings(max_length, stride, max_tokens, batch_size, names: dict | None = None) -> dict:
    """Check the window options before any model is loaded; return them as perplexity() kwargs.
    names: the flags they came from, when not ppl/diff's own (--max-length, ...)."""
    from normswap.evaluate import CLI_NAMES, check_window_options

    names = CLI_NAMES | (names or {})
    check_window_options(max_length, stride, max_tokens, batch_size, names)
    return dict(max_length=max_length, stride=stride, max_tokens=max_tokens, batch_size=batch_size,
                option_names=names)


def describe_windows(d: dict) -> str:
    return (f"{d['tokens']} scored tokens in {d['windows']} window{'s' * (d['windows'] != 1)} "
            f"of up to {d['max_length']} tokens, stride {d['stride']}")


@cli.command()
@click.argument("model")
@eval_options
@json_option
def ppl(model, data_path, text_field, max_length, stride, max_tokens, batch_size, dtype, as_json) -> None:
    """Perplexity of MODEL on the text at PATH (sliding window, the transformers recipe)."""
    from normswap.data import open_corpus
    from normswap.evaluate import check_before_loading, perplexity
    from normswap.loading import load_config, load_model, load_tokenizer, parse_dtype, resolve

    settings = window_settings(max_length, stride, max_tokens, batch_size)
    corpus = open_corpus(data_path, text_field)
    source = resolve(model)
    tokenizer = load_tokenizer(source)
    config = load_config(source)
    check_before_loading([config], tokenizer, corpus, text_field=text_field, **settings)
    loaded = load_model(source, dtype=parse_dtype(dtype), config=config)
    result = perplexity(loaded, tokenizer, corpus, **settings)
    data = {"model": model, "data": data_path, "dtype": str(next(loaded.parameters()).dtype).removeprefix("torch."),
            **result.to_dict()}

    def render(d: dict) -> None:
        click.echo(f"{d['model']} on {d['data']} ({d['dtype']}): perplexity {d['ppl']:.4f} "
                   f"(NLL {d['nll']:.4f} nats/token)")
        click.echo(describe_windows(d))

    emit(data, as_json, render)
