"""`normswap diff A B --data PATH` and `normswap diff A --patched IMPL --data PATH`: two models
scored on the same windows (see normswap.evaluate.diff_models). With --patched, B is A with its
norms swapped in memory; nothing is saved."""

from __future__ import annotations

import click

from normswap.backends import BACKENDS
from normswap.cli.main import ProgressBars, cli, emit, json_option, model_epilog
from normswap.cli.ppl import OPTION_NAMES as EVAL_OPTION_NAMES
from normswap.cli.ppl import describe_windows, eval_options, named_model

# What diff_checkpoints' messages and its settings' call their options here: the flags they came from.
OPTION_NAMES = {**EVAL_OPTION_NAMES, "patched": "--patched"}


@cli.command(epilog=model_epilog("A, B"))
@click.argument("model_a", metavar="A")
@click.argument("model_b", metavar="[B]", required=False)
@click.option("--patched", type=click.Choice(BACKENDS), default=None,
              help="Compare A with A patched in memory by this implementation.")
@eval_options
@json_option
def diff(model_a, model_b, patched, data_path, text_field, max_length, stride, max_tokens, batch_size, dtype,
         recorded_impl, as_json) -> None:
    """Perplexity and next-token distributions of A against B (or against A --patched IMPL).

    Both models read the same windows, tokenised with A's tokenizer. A directory `normswap patch
    --out` wrote runs the patch its normswap.json records (--impl: with another
    implementation)."""
    from normswap.api import EvalSettings, diff_checkpoints

    settings = EvalSettings(data_path, text_field, max_length, stride, max_tokens, batch_size, OPTION_NAMES)
    with ProgressBars({"diff": "tok"}) as bars:
        result = diff_checkpoints(model_a, model_b, settings=settings, patched=patched, impl=recorded_impl,
                                  dtype=dtype, progress=bars, option_names=OPTION_NAMES)
    emit(result.to_dict(), as_json, render_diff)


def render_diff(d: dict) -> None:
    """The human form of a diff result (also printed by `normswap patch --eval`)."""
    click.echo(f"A: {named_model(d['model_a'], d.get('impl_a'))}\nB: {named_model(d['model_b'], d.get('impl_b'))}\n"
               f"on {d['data']} ({d['dtype']})")
    click.echo(f"perplexity     A {d['ppl_a']:.4f}   B {d['ppl_b']:.4f}   "
               f"delta {d['delta_ppl']:+.4g} ({100 * d['relative_delta']:+.4g}%)")
    click.echo(f"KL(A||B)       mean {d['kl_mean']:.3g}   max {d['kl_max']:.3g} nats/token")
    click.echo(f"top-1 agree    {100 * d['top1_agreement']:.2f}%   max |logit A - logit B| "
               f"{d['max_abs_logit_diff']:.3g}")
    click.echo(describe_windows(d))
    if d.get("noise_floor"):
        click.echo(d["noise_floor"]["verdict"])

