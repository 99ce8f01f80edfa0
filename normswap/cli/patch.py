"""`normswap patch`: swap every norm for a fused kernel, prove each module equivalent, re-save."""

from __future__ import annotations

import sys

import click

from normswap.backends import BACKENDS
from normswap.cli.main import (
    ProgressBars,
    cli,
    device_option,
    emit,
    json_option,
    model_epilog,
    report_console,
)
from normswap.dtypes import RUN_DTYPES

# What patch_checkpoint's messages (and those of what it runs) call its options here: the flags
# they came from.
OPTION_NAMES = {"impl": "--impl", "out": "--out", "in_place": "--in-place", "only": "--only",
                "exclude": "--exclude", "dtype": "--dtype", "force": "--force", "max_shard_size": "--max-shard-size",
                "rms": "--rms", "fuse_residual": "--fuse-residual", "evaluation": "--eval",
                "max_length": "--eval-max-length", "max_tokens": "--eval-max-tokens", "text_field": "--eval-text-field"}


@cli.command("patch", epilog=model_epilog())
@click.argument("model")
@click.option("--impl", type=click.Choice(BACKENDS), default="triton", show_default=True,
              help="Implementation of the replacement norms.")
@click.option("--out", "out", default=None, metavar="DIR",
              help="Save the patched checkpoint here (refused if it exists, unless --force).")
@click.option("--in-place", is_flag=True, help="Replace MODEL's own directory (atomically, after the check).")
@click.option("--only", default=None, metavar="REGEX", help="Patch only norms whose path matches.")
@click.option("--exclude", default=None, metavar="REGEX", help="Leave norms whose path matches alone.")
@click.option("--dtype", type=click.Choice(RUN_DTYPES), default=None,
              help="Load the weights in this dtype (default: the checkpoint's).")
@device_option
@click.option("--strict", is_flag=True, help="Fail on a norm-like module the registry does not recognise.")
@click.option("--force", is_flag=True, help="Replace an existing --out directory.")
@click.option("--max-shard-size", default="5GB", show_default=True, metavar="SIZE",
              help="Largest safetensors shard: 5GB, 500MB or a number of bytes.")
@click.option("--rms/--no-rms", "use_rms", default=True, show_default=True,
              help="Run LayerNorms that `normswap convert` made zero-mean as RMS norms.")
@click.option("--fuse-residual", is_flag=True,
              help="Also fuse each residual add into the norm that reads the sum (one kernel call).")
@click.option("--eval", "eval_path", default=None, metavar="PATH",
              help="After patching, diff the patched model against the original on this text (see `normswap diff`).")
@click.option("--eval-max-length", type=int, default=None, help="Window length for --eval (default: the model's context); needs --eval.")
@click.option("--eval-max-tokens", type=int, default=None, help="Score only the first T tokens of --eval's text; needs --eval.")
@click.option("--eval-text-field", default=None, metavar="FIELD",
              help="The field of a .jsonl --eval that holds the text (default: text); needs --eval.")
@json_option
def patch_cmd(model, impl, out, in_place, only, exclude, dtype, device, strict, force, max_shard_size, use_rms,
              fuse_residual, eval_path, eval_max_length, eval_max_tokens, eval_text_field, as_json):
    """Swap every norm in MODEL for an IMPL module, verify each one, report; optionally save.

    Without --out/--in-place nothing is written. A module that fails verification stops the
    command (exit 2, nothing saved) unless --exclude leaves it alone.

    Report columns: err orig / err new = max |output - float64 value| of the original module and
    of the replacement on the same probe inputs; Δerr ulp = (err new - err orig) in units of the
    dtype's ulp at the largest output (pass needs <= 1; negative: the replacement is closer).

    With --eval PATH the patched model is also scored against an untouched copy of the original
    (perplexity of both, KL, top-1 agreement); the copy doubles the memory the model takes. A
    folder an earlier patch --out wrote is patched afresh from its stock weights, and --eval
    compares with it as it loads (its recorded patch), as ppl and diff score it.

    With --fuse-residual each residual add is computed by the kernel of the norm that reads the
    sum (within a layer and across layers); the fused output is checked against the unfused patch,
    and the manifest records the pairs so that normswap.load fuses them again.
    """
    from normswap.api import EvalSettings, patch_checkpoint
    from normswap.swap import VerificationError

    evaluation = None
    window = {"--eval-max-length": eval_max_length, "--eval-max-tokens": eval_max_tokens,
              "--eval-text-field": eval_text_field}
    given = [flag for flag, value in window.items() if value is not None]
    if eval_path is None and given:
        # they shape what --eval reads: alone they would be ignored, and a typo'd command run unchecked
        raise click.UsageError(f"{given[0]} only applies to --eval PATH; add --eval or drop {given[0]}")
    if eval_path is not None:
        evaluation = EvalSettings(eval_path, eval_text_field or "text", max_length=eval_max_length,
                                  max_tokens=eval_max_tokens, option_names=OPTION_NAMES)
    try:
        with ProgressBars({"patch": "module", "diff": "tok"}, labels={"patch": f"patch+verify ({impl})"}) as bars:
            result = patch_checkpoint(model, impl, out=out, in_place=in_place, only=only, exclude=exclude,
                                      dtype=dtype, device=device, strict=strict, force=force,
                                      max_shard_size=max_shard_size, rms=use_rms, fuse_residual=fuse_residual,
                                      evaluation=evaluation, progress=bars, option_names=OPTION_NAMES)
    except VerificationError as e:
        if e.result is not None:
            emit(e.result.to_dict(), as_json, render)
        raise
    emit(result.to_dict(), as_json, render)


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def render(data: dict) -> None:
    from rich.table import Table

    from normswap.verify import describe_model_check

    stream = sys.stderr if not data["ok"] else sys.stdout
    # Off a terminal (CI logs, pipes) rich would squeeze the table into 80 columns; don't.
    console = report_console(file=stream, highlight=False, width=None if stream.isatty() else 200)
    table = Table(title=f"normswap patch {data['model']} --impl {data['impl']} ({data['dtype']})")
    for col in ("path", "class", "impl", "eps", "dtype", "err orig", "err new", "Δerr ulp", "result"):
        table.add_column(col, justify="right" if col in ("eps", "err orig", "err new", "Δerr ulp") else "left")
    for m in data["modules"]:
        c = m["check"]
        eps = repr(m["spec"]["eps"]) if m["spec"] else "-"  # exact: eps must match to the bit
        if c is None:
            table.add_row(m["path"], m["class"], "-", eps, "-", "-", "-", "-", f"{m['status']}: {m['reason']}")
            continue
        result = "pass" if c["passed"] else "FAIL: " + "; ".join(c["failures"])
        if c.get("notes"):
            result += " (" + "; ".join(c["notes"]) + ")"
        margin = c["worst_margin_ulps"]
        cls = m["class"] + (f" as {m['runs_as']}" if m["rms_form"] else "")
        table.add_row(m["path"], cls, c["impl"], repr(c["eps"]), c["dtype"],
                      _fmt(c["max_err_original"]), _fmt(c["max_err_replacement"]),
                      "-" if margin is None else f"{margin:+.2f}", result)
    console.print(table)
    counts = ", ".join(f"{v} {k}" for k, v in data["counts"].items() if v)
    console.print(f"modules: {counts}; largest error vs float64: original {_fmt(data['max_err_original'])}, "
                  f"replacement {_fmt(data['max_err_replacement'])}")
    mc = data["model_check"]
    if mc:
        agree = f", argmax agreement {mc['argmax_agreement']:.1%}" if mc["argmax_agreement"] is not None else ""
        # each output on its own scale: a ViTModel's pooler output is limited by its own magnitude
        console.print(f"whole model: {describe_model_check(mc)}{agree}: {'pass' if mc['passed'] else 'FAIL'}")
    fused = data.get("fuse_residual")
    if fused:
        fc = fused["model_check"]
        check = (f"; fused vs unfused {describe_model_check(fc)}: "
                 f"{'pass' if fc['passed'] else 'FAIL'}") if fc else ""
        console.print(f"residual adds fused into their norms: {fused['fused']} writers{check}")
        for u in fused["unfused"]:
            console.print(f"  left unfused: {u['writer']}: {u['reason']}")
    if data.get("eval"):
        from normswap.cli.diff import render_diff

        # A is the model as MODEL loads: a folder an earlier patch wrote runs its recorded patch
        baseline = "as it loads" if data["eval"].get("impl_a") else "original"
        console.print(f"perplexity diff, {baseline} (A) vs patched (B):")
        render_diff(data["eval"])
    if data["saved_to"]:
        console.print(f"saved to {data['saved_to']} (stock checkpoint + normswap.json; reload check passed)")
    elif data["ok"]:
        console.print("nothing saved (pass --out DIR or --in-place to save)")
