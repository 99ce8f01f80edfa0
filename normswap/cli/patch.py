"""`normswap patch`: swap every norm for a fused kernel, prove each module equivalent, re-save."""

from __future__ import annotations

import copy
import os
import sys
import tempfile
from pathlib import Path

import click

from normswap.backends import backend_names
from normswap.cli.main import cli, emit, json_option
from normswap.errors import NormswapError

IMPLS = backend_names()


def _bar(desc: str, total: int | None = None, unit: str = "step"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)


def _check_writable(target: Path) -> None:
    """Fail before the (long) load when the destination's directory cannot take a new entry."""
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        probe = tempfile.mkdtemp(prefix=f".{target.name}.normswap-probe-", dir=parent)
        os.rmdir(probe)
    except OSError as e:
        raise NormswapError(f"cannot write to {parent}: {e.strerror or e}") from None


@cli.command("patch")
@click.argument("model")
@click.option("--impl", type=click.Choice(IMPLS), default="triton", show_default=True,
              help="Implementation of the replacement norms.")
@click.option("--out", "out", default=None, metavar="DIR",
              help="Save the patched checkpoint here (refused if it exists, unless --force).")
@click.option("--in-place", is_flag=True, help="Replace MODEL's own directory (atomically, after the check).")
@click.option("--only", default=None, metavar="REGEX", help="Patch only norms whose path matches.")
@click.option("--exclude", default=None, metavar="REGEX", help="Leave norms whose path matches alone.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
              help="Load the weights in this dtype (default: the checkpoint's).")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda|cuda:N",
              help="Where the model runs; auto: the CUDA device when there is one.")
@click.option("--strict", is_flag=True, help="Fail on a norm-like module the registry does not recognise.")
@click.option("--force", is_flag=True, help="Replace an existing --out directory.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors shard.")
@click.option("--rms/--no-rms", "use_rms", default=True, show_default=True,
              help="Run LayerNorms that `normswap convert` made zero-mean as RMS norms.")
@click.option("--fuse-residual", is_flag=True,
              help="Also fuse each residual add into the norm that reads the sum (one kernel call).")
@click.option("--eval", "eval_path", default=None, metavar="PATH",
              help="After patching, diff the patched model against the original on this text (see `normswap diff`).")
@click.option("--eval-max-length", type=int, default=None, help="Window length for --eval (default: the model's context).")
@click.option("--eval-max-tokens", type=int, default=None, help="Score only the first T tokens of --eval's text.")
@json_option
def patch_cmd(model, impl, out, in_place, only, exclude, dtype, device, strict, force, max_shard_size, use_rms,
              fuse_residual, eval_path, eval_max_length, eval_max_tokens, as_json):
    """Swap every norm in MODEL for an IMPL module, verify each one, report; optionally save.

    Without --out/--in-place nothing is written. A module that fails verification stops the
    command (exit 2, nothing saved) unless --exclude leaves it alone.

    Report columns: err orig / err new = max |output - float64 value| of the original module and
    of the replacement on the same probe inputs; Δerr ulp = (err new - err orig) in units of the
    dtype's ulp at the largest output (pass needs <= 1; negative: the replacement is closer).

    With --eval PATH the patched model is also scored against an untouched copy of the original
    (perplexity of both, KL, top-1 agreement); the copy doubles the memory the model takes.

    With --fuse-residual each residual add is computed by the kernel of the norm that reads the
    sum (within a layer and across layers); the fused output is checked against the unfused patch,
    and the manifest records the pairs so that normswap.load fuses them again.
    """
    from normswap.backends import get_backend
    from normswap.checkpoint import check_out_target, save_patched, target_lock
    from normswap.loading import load_config, load_model, parse_device, parse_dtype, resolve
    from normswap.manifest import rms_forms
    from normswap.swap import VerificationError, patch, regex_filter

    if out is not None and in_place:
        raise NormswapError("--out and --in-place are exclusive; pick one")
    filter_fn = regex_filter(only, exclude)
    device = parse_device(device)
    get_backend(impl)  # an unavailable implementation fails before the model is loaded
    source = resolve(model)
    config = load_config(source)  # read once: the checks below and the load use it (a GGUF's takes seconds)
    target = None
    if in_place:
        if source.gguf_file or not Path(model).expanduser().is_dir():
            raise NormswapError(f"--in-place rewrites a local safetensors model directory; {model} is not one "
                                "(use --out DIR)")
        target = source.path
        _refuse_lossy_in_place(source, config, parse_dtype(dtype))
        # a second --in-place run on this directory is refused before it loads anything
        click.get_current_context().with_resource(target_lock(target))
    elif out is not None:
        target = check_out_target(out, source.path, force, "patched", "use --in-place for that")
    if target is not None:
        _check_writable(target)
    evaluation = _prepare_eval(eval_path, eval_max_length, eval_max_tokens, source, config)

    import transformers

    transformers.utils.logging.disable_progress_bar()  # ours are on stderr; one bar per stage
    transformers.utils.logging.set_verbosity_error()
    with _bar(f"load {model}", 1) as bar:
        m = load_model(source, dtype=parse_dtype(dtype), device=device, config=config)
        bar.update(1)

    from normswap import walk

    n = sum(1 for f in walk.find_norms(m, warn=False)
            if f.spec is not None and (filter_fn is None or filter_fn(None, f.path)))
    if n == 0 and filter_fn is not None:
        raise NormswapError(f"--only/--exclude leave no recognised norm to patch in {model}")
    original = copy.deepcopy(m) if evaluation else None
    forms = rms_forms(source.path) if use_rms and not source.gguf_file else {}
    try:
        with _bar(f"patch+verify ({impl})", n, "module") as bar:
            report = patch(m, impl, filter_fn=filter_fn, strict=strict, rms_forms=forms,
                           progress=lambda _p: bar.update(1), fuse_residual=fuse_residual)
    except VerificationError as e:
        emit(_payload(e.report, model, None, device=device), as_json, _render)
        raise
    eval_result = None
    if evaluation:
        from normswap.evaluate import diff_models

        corpus, tokenizer, settings = evaluation
        eval_result = diff_models(original, m, tokenizer, corpus, **settings).to_dict()
        eval_result.update(model_a=model, model_b=f"{model} --impl {impl}", data=eval_path,
                           dtype=str(next(m.parameters()).dtype).removeprefix("torch."))
        del original
    saved = None
    if target is not None:
        with _bar("save", 4) as bar:
            saved = save_patched(m, report, target, source=source, replace=in_place or force,
                                 max_shard_size=max_shard_size, progress=lambda _s: bar.update(1))
    emit(_payload(report, model, saved, eval_result, device), as_json, _render)


def _refuse_lossy_in_place(source, config, dtype) -> None:
    """--in-place saves in the dtype the model was loaded in: with another --dtype it would
    rewrite the user's only copy of the weights (fp32 -> bf16 cannot be undone)."""
    if dtype is None:
        return
    import torch

    stored = getattr(config, "dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if isinstance(stored, torch.dtype) and stored != dtype:
        name = str(stored).removeprefix("torch.")
        raise NormswapError(f"--in-place with --dtype would rewrite the {name} weights of {source.ref} as "
                            f"{str(dtype).removeprefix('torch.')}; save the conversion with --out DIR instead")


def _prepare_eval(path, max_length, max_tokens, source, config):
    """Check --eval's text and options before the (long) load; None when --eval is not given."""
    if path is None:
        return None
    from normswap.cli.ppl import window_settings
    from normswap.data import open_corpus
    from normswap.evaluate import check_before_loading
    from normswap.loading import load_tokenizer

    settings = window_settings(max_length, None, max_tokens, 1)
    corpus, tokenizer = open_corpus(path, "text"), load_tokenizer(source)
    check_before_loading([config], tokenizer, corpus, **settings)
    return corpus, tokenizer, settings


def _payload(report, model: str, saved: Path | None, eval_result: dict | None = None,
             device: str | None = None) -> dict:
    data = {"model": model, **report.to_dict(), "device": device or "cpu"}
    data["saved_to"] = str(saved) if saved else None
    data["eval"] = eval_result
    return data


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _render(data: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    stream = sys.stderr if not data["ok"] else sys.stdout
    # Off a terminal (CI logs, pipes) rich would squeeze the table into 80 columns; don't.
    console = Console(file=stream, highlight=False, width=None if stream.isatty() else 200)
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
        console.print(f"whole model: max |Δ{mc['kind']}| {_fmt(mc['max_abs_diff'])} "
                      f"(limit {mc['rtol']:g} x {_fmt(mc['max_abs_value'])}){agree}: "
                      f"{'pass' if mc['passed'] else 'FAIL'}")
    fused = data.get("fuse_residual")
    if fused:
        fc = fused["model_check"]
        check = (f"; fused vs unfused max |Δ{fc['kind']}| {_fmt(fc['max_abs_diff'])}: "
                 f"{'pass' if fc['passed'] else 'FAIL'}") if fc else ""
        console.print(f"residual adds fused into their norms: {fused['fused']} writers{check}")
        for u in fused["unfused"]:
            console.print(f"  left unfused: {u['writer']}: {u['reason']}")
    if data.get("eval"):
        from normswap.cli.diff import render_diff

        console.print("perplexity diff, original (A) vs patched (B):")
        render_diff(data["eval"])
    if data["saved_to"]:
        console.print(f"saved to {data['saved_to']} (stock checkpoint + normswap.json; reload check passed)")
    elif data["ok"]:
        console.print("nothing saved (pass --out DIR or --in-place to save)")
