"""`normswap scan MODEL`: every norm of a model, its spec and its readers (no weights read)."""

from __future__ import annotations

import sys

import click

from normswap.choices import DEFAULT_MODEL
from normswap.cli.main import OldSpellings, ProgressBars, cli, emit, json_option, model_epilog, report_console


@cli.command(epilog=model_epilog())
@click.argument("model", required=False, default=DEFAULT_MODEL)
@click.option("--strict", is_flag=True, help="Fail (exit 2) on a norm-like module normswap does not recognise.")
# --no-consumers: the flag's name before "readers" became the one name (scan said "consumers"), kept for scripts.
@click.option("--no-readers", "--no-consumers", "no_readers", cls=OldSpellings, is_flag=True,
              help="Skip the traced forward that finds which modules read each norm's output "
                   "(and whether convert makes each LayerNorm an RMSNorm).")
@json_option
def scan(model: str, strict: bool, no_readers: bool, as_json: bool) -> None:
    """List every norm in MODEL: path, class, kind, eps, offset, casting, dtype, shape, whether it
    has a weight and a bias, its readers, and for each LayerNorm whether `normswap convert` makes
    it an RMSNorm (and why not); MODEL defaults to smollm2-135m. Built on the meta device: no
    weights are read."""
    from normswap.scan import scan as run_scan

    with ProgressBars() as bars:  # a built-in model's first use converts it (~20 s): say so
        doc = run_scan(model, strict=strict, with_readers=not no_readers, warn=False,
                       progress=bars)
    warn_unknown(doc)
    emit(doc, as_json, render)


def warn_unknown(doc: dict) -> None:
    for u in doc["unknown"]:
        click.echo(f"normswap: warning: {u['path']} ({u['class']}) looks like a norm but is not "
                   f"recognised and will be left alone: {u['reason']}", err=True)


def _short(reader: str, norm_path: str) -> str:
    """A reader's path relative to the norm's parent (q_proj under the same layer reads as
    self_attn.q_proj)."""
    parent = norm_path.rpartition(".")[0]
    if parent and reader.startswith(parent + "."):
        return reader[len(parent) + 1:]
    return reader


def render(doc: dict) -> None:
    from rich.table import Table

    console = report_console(width=None if sys.stdout.isatty() else 220)
    title = f"{doc['model']}: {doc['model_class']} ({doc['model_type']})"
    table = Table(title=title, title_justify="left", show_lines=False)
    for col in ("path", "class", "kind", "eps", "offset", "casting", "dtype", "shape", "weight", "bias",
                "readers", "to rms"):
        table.add_column(col, overflow="fold")
    for n in doc["norms"]:
        # eps exactly, as in the JSON and patch's table: SmolLM2's GGUF stores float32(1e-5),
        # 9.999999747378752e-06, which a rounded "1e-05" would pass off as the config's 1e-5.
        readers = "?" if n["readers"] is None else (
            ", ".join(_short(r, n["path"]) for r in n["readers"]) or "-")
        table.add_row(
            n["path"], n["class"], n["kind"], repr(n["eps"]), f"{n['offset']:g}", n["casting"],
            n["dtype"] or "-", "×".join(map(str, n["shape"])) or "-", _yes(n["has_weight"]), _yes(n["has_bias"]),
            readers, _to_rms(n.get("to_rms")),
        )
    for u in doc["unknown"]:
        table.add_row(u["path"], u["class"], "[red]unknown[/red]", "", "", "", "", "", "", "", u["reason"], "")
    console.print(table)
    s = doc["summary"]
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(s["by_kind"].items())) or "none"
    classes = ", ".join(f"{v} {k}" for k, v in sorted(s["by_class"].items()))
    console.print(f"{s['norms']} norms ({kinds}; {classes}); {s['unknown']} unknown norm-like modules")
    reasons = {}
    for n in doc["norms"]:
        t = n.get("to_rms")
        if t and not t["converts"]:
            reasons.setdefault((t["category"], t["why_not"]), []).append(n["path"])
    conv = s.get("to_rms", {})
    if conv.get("converts") or conv.get("refused"):
        console.print(f"normswap convert --to rms: {conv['converts']} LayerNorms convert, "
                      f"{sum(conv['refused'].values())} refused")
    for (cat, why), paths in reasons.items():
        more = f" (and {len(paths) - 1} more)" if len(paths) > 1 else ""
        console.print(f"  {cat}: {paths[0]}{more}: {why}")
    if doc.get("readers_note"):
        console.print(f"note: {doc['readers_note']}")


def _to_rms(t: dict | None) -> str:
    if t is None:
        return "-"
    return "yes" if t["converts"] else f"no ({t['category']})"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
