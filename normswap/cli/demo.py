"""`normswap demo`: the main job on the embedded default model (no hub, no GPU needed).

It makes the library calls the real commands make, and shows each as the command a user would
type: scan the norms, patch them with the Triton kernels (the CPU interpreter when there is no
GPU), verify every module, and diff the perplexity of the original and the patched model."""

from __future__ import annotations

import click

from normswap.backends import BACKENDS
from normswap.cli import patch
from normswap.cli.main import ProgressBars, cli, emit, json_option

# What the library's messages call the demo's own option. What its patch step's messages name (a way
# out such as --exclude REGEX) is the patch command's (patch.OPTION_NAMES): the demo shows that command.
OPTION_NAMES = {"max_tokens": "--max-tokens"}


@cli.command()
@click.option("--impl", type=click.Choice(BACKENDS), default="triton", show_default=True,
              help="Implementation to patch with.")
@click.option("--max-tokens", type=int, default=512, show_default=True, help="Tokens of the demo text to score.")
@json_option
def demo(impl: str, max_tokens: int, as_json: bool) -> None:
    """Scan, patch (--impl triton) and perplexity-diff the embedded SmolLM2-135M."""
    from normswap import api
    from normswap import scan as scanning
    from normswap.choices import DEFAULT_MODEL
    from normswap.cli.patch import render as render_patch
    from normswap.cli.scan import render as render_scan
    from normswap.cli.scan import warn_unknown

    # Before the scan: a --max-tokens the library refuses is one line naming the flag as typed.
    evaluation = api.demo_evaluation(max_tokens, option_names=OPTION_NAMES)
    click.echo(f"\n$ normswap scan {DEFAULT_MODEL}", err=True)
    with ProgressBars() as bars:  # the built-in model's first use converts it (~20 s): say so
        doc = scanning.scan(DEFAULT_MODEL, warn=False, progress=bars)
    warn_unknown(doc)
    if not as_json:
        render_scan(doc)
    click.echo(f"\n$ normswap patch {DEFAULT_MODEL} --impl {impl} --eval {evaluation.data} "
               f"--eval-max-length {evaluation.max_length} --eval-max-tokens {evaluation.max_tokens}", err=True)
    with ProgressBars({"patch": "module", "diff": "tok"}, labels={"patch": f"patch+verify ({impl})"}) as bars:
        result = api.patch_checkpoint(DEFAULT_MODEL, impl, evaluation=evaluation, progress=bars,
                                      option_names=patch.OPTION_NAMES)
    if as_json:
        emit({"scan": doc, "patch": result.to_dict()}, True, render_patch)
    else:
        render_patch(result.to_dict())
