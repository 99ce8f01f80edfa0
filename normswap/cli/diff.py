"""`normswap diff A B --data PATH` and `normswap diff A --patched IMPL --data PATH`: two models
scored on the same windows (see normswap.evaluate.diff_models). With --patched, B is A with its
norms swapped in memory; nothing is saved."""

from __future__ import annotations

import click

from normswap.cli.main import cli, emit, json_option
from normswap.cli.ppl import describe_windows, eval_options, window_settings
from normswap.errors import NormswapError


@cli.command()
@click.argument("model_a", metavar="A")
@click.argument("model_b", metavar="[B]", required=False)
@click.option("--patched", "impl", metavar="IMPL", default=None,
              help="Compare A with A patched in memory by this implementation (e.g. triton).")
@eval_options
@json_option
def diff(model_a, model_b, impl, data_path, text_field, max_length, stride, max_tokens, batch_size, dtype,
         as_json) -> None:
    """Perplexity and next-token distributions of A against B (or against A --patched IMPL).

    Both models read the same windows, tokenised with A's tokenizer."""
    from normswap.backends import get_backend
    from normswap.data import open_corpus
    from normswap.evaluate import check_before_loading, diff_models, patched_copy
    from normswap.loading import load_config, load_model, load_tokenizer, parse_dtype, resolve

    if (model_b is None) == (impl is None):
        raise NormswapError("give either a second model B or --patched IMPL (exactly one)")
    settings = window_settings(max_length, stride, max_tokens, batch_size)
    corpus = open_corpus(data_path, text_field)
    if impl is not None:
        get_backend(impl)  # an unavailable implementation fails before anything loads
    source_a = resolve(model_a)
    source_b = resolve(model_b) if model_b is not None else None
    tokenizer = load_tokenizer(source_a)
    if source_b is not None:
        _check_same_tokenizer(tokenizer, source_b)
    config_a = load_config(source_a)
    config_b = load_config(source_b) if source_b is not None else config_a
    check_before_loading([config_a, config_b], tokenizer, corpus, text_field=text_field, **settings)
    torch_dtype = parse_dtype(dtype)
    a = load_model(source_a, dtype=torch_dtype, config=config_a)
    b = load_model(source_b, dtype=torch_dtype, config=config_b) if source_b is not None else patched_copy(a, impl)
    result = diff_models(a, b, tokenizer, corpus, **settings)
    data = {"model_a": model_a, "model_b": model_b if model_b is not None else f"{model_a} --patched {impl}",
            "data": data_path, "dtype": str(next(a.parameters()).dtype).removeprefix("torch."),
            **result.to_dict()}

    emit(data, as_json, render_diff)


def _check_same_tokenizer(tokenizer_a, source_b) -> None:
    """Both models read A's token ids: B must map them to the same strings, or the numbers compare
    unrelated predictions (same-sized vocabularies would not even fail the logit-width check)."""
    from normswap.loading import load_tokenizer

    try:
        tokenizer_b = load_tokenizer(source_b)
    except NormswapError:
        return  # B ships no tokenizer (a bare re-save of A's weights): it reads A's ids by design
    if tokenizer_a.get_vocab() != tokenizer_b.get_vocab():
        raise NormswapError(f"A and B have different tokenizers ({len(tokenizer_a)} vs {len(tokenizer_b)} "
                            f"tokens, or the same tokens numbered differently); a diff needs one tokenizer")


def render_diff(d: dict) -> None:
    """The human form of a diff result (also printed by `normswap patch --eval`)."""
    click.echo(f"A: {d['model_a']}\nB: {d['model_b']}\non {d['data']} ({d['dtype']})")
    click.echo(f"perplexity     A {d['ppl_a']:.4f}   B {d['ppl_b']:.4f}   "
               f"delta {d['delta_ppl']:+.4g} ({100 * d['relative_delta']:+.4g}%)")
    click.echo(f"KL(A||B)       mean {d['kl_mean']:.3g}   max {d['kl_max']:.3g} nats/token")
    click.echo(f"top-1 agree    {100 * d['top1_agreement']:.2f}%   max |logit A - logit B| "
               f"{d['max_abs_logit_diff']:.3g}")
    click.echo(describe_windows(d))
