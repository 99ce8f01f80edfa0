"""`normswap convert MODEL --to rms --out DIR`: exact LayerNorm → RMSNorm, stock-loadable output."""

from __future__ import annotations

import click

from normswap.cli.main import ProgressBars, cli, emit, json_option, model_epilog, report_console
from normswap.dtypes import STORE_DTYPES

# What convert_checkpoint's messages call its options here: the flags they came from.
OPTION_NAMES = {"out": "--out", "keep_gain": "--keep-gain", "partial": "--partial", "dtype": "--dtype",
                "force": "--force"}


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


def _render(data: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from normswap.manifest import rms_forms

    # Reasons are sentences: give them room when stdout is not a terminal (pipes default to 80).
    # A refusal's table explains the error: it goes to stderr with it (stdout stays empty, as for
    # every bad input; see README, the error contract).
    console = report_console(soft_wrap=False, stderr=bool(data.get("error")),
                      width=None if Console().is_terminal else 160)
    t = Table(title=f"normswap convert --to rms: {data['model']} ({data['arch']})", show_lines=False)
    for col in ("norm", "folded γ", "folded β", "kept β (why)", "RMS (why not)"):
        t.add_column(col, overflow="fold")
    forms = rms_forms(data)
    for n in data["norms"]:
        kept = f"yes: {n['kept_bias_why']}" if n["kept_bias"] else "-"
        if n["baked"]:
            kept = f"baked into the token table (s = {n['bake_scale']:.4g})" if n["bake_scale"] else "baked"
        form = forms.get(n["path"])
        rms = ("yes" + (" (weight kept)" if form.weight else "")) if form else f"no ({n['category']}): {n['why_not']}"
        t.add_row(n["path"], _yes(n["folded_gain"]), _yes(n["folded_bias"]), kept, rms)
    console.print(t)
    console.print("layout: " + (f"normswap/archs/{data['arch_file']}" if data.get("arch_file") else
                                "discovered from the model's forward"))
    s = data["summary"]
    console.print(
        f"{s['converted']}/{s['norms']} norms convertible to RMS; folded γ into readers of {s['folded_gain']}, "
        f"β of {s['folded_bias']}; kept β in {s['kept_bias']}"
    )
    if data.get("untied"):
        console.print(f"untied {data['untied']['head']} from {data['untied']['table']} (tie_word_embeddings: false)")
    v = data.get("verification")
    if v:
        # What the errors are of: the logits, or every output of a model without (a ViTModel's
        # last_hidden_state and pooler_output), each relative to its own largest magnitude (the
        # largest of those errors is shown).
        err = f"{v['max_rel_logit_error']:.3g}"
        what = f"|Δlogit| = {err} of the logit scale" if v["compared"] == "logits" else \
            f"|Δ| of the {v['compared']} = {err} of each one's own largest magnitude"
        console.print(
            f"verified: stock reload max {what} "
            f"(tolerance {v['tolerance']:g}); run as RMSNorms {v['max_rel_logit_error_rms']:.3g} "
            f"(tolerance {v['tolerance_rms']:g})"
        )
    if data.get("saved_to"):
        console.print(f"wrote {data['saved_to']}")
    elif data.get("error"):  # the error line that follows says why: not twice
        console.print("nothing written")


@cli.command(epilog=model_epilog())
@click.argument("model")
@click.option("--to", "target", type=click.Choice(["rms"]), required=True, help="Target norm family.")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="Output directory.")
@click.option("--keep-gain", is_flag=True, help="Leave γ in the norms (fold β only).")
@click.option("--partial", is_flag=True, help="Convert what can be converted; report the rest.")
@click.option("--dtype", type=click.Choice(STORE_DTYPES), default=None,
              help="Store the converted weights in this dtype (default: each tensor keeps its own).")
@click.option("--force", is_flag=True, help="Replace an existing --out directory.")
@json_option
def convert(model: str, target: str, out: str, keep_gain: bool, partial: bool, dtype: str | None,
            force: bool, as_json: bool) -> None:
    """Fold LayerNorm γ/β into the layers that read them and center every writer into the residual
    stream, so each LayerNorm equals an RMSNorm. The output loads in stock transformers with the
    same outputs (logits, or every output of a model without); its normswap.json lists the norms
    that may run as RMSNorm kernels (`normswap patch DIR` then runs them as such: weightless where
    γ was folded)."""

    from normswap.api import ConversionRefused, convert_checkpoint

    announce = {"convert": f"converting {model} into {out} ...",
                "verify": "verifying: the stock reload's outputs against the original's ..."}
    try:
        with ProgressBars({"convert": "B"}, announce=announce) as bars:
            result = convert_checkpoint(model, out, keep_gain=keep_gain, partial=partial, dtype=dtype, force=force,
                                        progress=bars, option_names=OPTION_NAMES)
    except ConversionRefused as e:
        # The per-norm report, then the one error line; no note on stored tensors a load would drop:
        # nothing was loaded, and the refusal is the answer (a rerun that converts says it).
        emit(e.result.to_dict(), as_json, _render, notes=False)
        raise
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    emit(result.to_dict(), as_json, _render)
