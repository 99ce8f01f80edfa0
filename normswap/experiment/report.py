"""results.json, results.csv, summary.md and curves.png from an experiment's arm results."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
from pathlib import Path

from normswap.experiment.recipe import parse_arm
from normswap.jsonsafe import finite_or_null

METRICS = ("ppl", "nll", "kl_mean", "kl_max", "top1_agreement")


def _final(arm: dict) -> dict:
    return arm["evals"][-1]


def summary_rows(arms: dict[str, dict]) -> list[dict]:
    """Per arm: perplexity at step 0 and at the end, Δ against `original` and `original+ft`, KL and
    top-1 against the original, and for the trained approximate arms the share of the gap recovered.

    recovered = 1 - gap_end / gap_start, the share of the approximation's cost that training took
    back: gap_start = the arm's nll at step 0 - the original's, gap_end = the arm's final nll - the
    control's final nll, where the control is `original+ft` when it ran (fine-tuning alone moves
    the loss: comparing with the untouched original would credit the arm with what fine-tuning did
    to every model), else `original`. None where there is no gap to recover (the arm started no
    worse than the original) or no original ran."""
    base = arms.get("original")
    control = arms.get("original+ft")
    reference = control or base
    start = (base or control)["evals"][0]["nll"] if reference else None
    rows = []
    for name, arm in arms.items():
        transform, training = parse_arm(name)
        first, last = arm["evals"][0], _final(arm)
        row = {"arm": name, "steps": arm.get("steps", 0), "ppl_start": first["ppl"], "ppl": last["ppl"],
               "kl_mean": last["kl_mean"], "top1_agreement": last["top1_agreement"],
               "delta_vs_original": last["ppl"] - _final(base)["ppl"] if base else None,
               "delta_vs_original_ft": last["ppl"] - _final(control)["ppl"] if control else None,
               "recovered": None}
        if training and transform.startswith("approx") and reference is not None:
            gap_start = first["nll"] - start
            gap_end = last["nll"] - _final(reference)["nll"]
            row["recovered"] = 1.0 - gap_end / gap_start if gap_start > 1e-9 else None
        rows.append(row)
    return rows


def _fmt(v, spec: str, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return format(v, ("+" if signed else "") + spec)


def summary_markdown(result: dict) -> str:
    rows = summary_rows(result["arms"])
    lines = [f"# {result['recipe']['name']}", ""]
    if result["recipe"].get("description"):
        lines += [result["recipe"]["description"], ""]
    pre = result.get("pretrain")
    if pre:
        lines += [f"Pretrained model: {pre['parameters'] / 1e6:.2f} M parameters, {pre['steps']} steps "
                  f"({pre['tokens_seen'] / 1e6:.2f} M tokens, {pre['train_seconds'] / 60:.1f} min); held-out "
                  f"perplexity {pre['heldout_ppl']:.2f} against a unigram baseline of {pre['unigram_ppl']:.1f}.", ""]
    ev = result["eval"]
    lines += [f"Held-out text: {ev['tokens']} tokens, windows of {ev['max_length']} (stride {ev['stride']}). "
              "KL and top-1 are against the original model.", ""]
    lines += ["| arm | steps | ppl at step 0 | final ppl | Δ vs original | Δ vs original+ft | KL(original‖arm) | top-1 | recovered |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['steps']} | {_fmt(r['ppl_start'], '.4f')} | {_fmt(r['ppl'], '.4f')} | "
            f"{_fmt(r['delta_vs_original'], '.4f', True)} | {_fmt(r['delta_vs_original_ft'], '.4f', True)} | "
            f"{_fmt(r['kl_mean'], '.2e')} | {_fmt(r['top1_agreement'], '.2%')} | "
            f"{_fmt(r['recovered'], '.1%')} |")
    lines += ["", "recovered (trained approximate arms): 1 − (final nll − final nll of original+ft) / (nll at step 0 "
              "− nll of original), the share of the approximation's loss gap that training took back, each model "
              "compared with the original trained the same way (100 %: as good as the fine-tuned control; over "
              "100 %: better; below 0: the gap grew); – where the arm started no worse than the original."]
    return "\n".join(lines) + "\n"


def results_csv(result: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["arm", "step", *METRICS, "train_loss"])
    for name, arm in result["arms"].items():
        losses = arm.get("losses", [])
        for e in arm["evals"]:
            loss = losses[e["step"] - 1] if 0 < e["step"] <= len(losses) else ""
            w.writerow([name, e["step"], *(e.get(m) for m in METRICS), loss])
    return buf.getvalue()


def plot_curves(result: dict, path: Path) -> None:
    """Eval perplexity (log scale) and KL(original‖arm) against the fine-tuning step, one line per
    arm; untrained arms are horizontal dashed lines at their step-0 value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    arms = result["arms"]
    last = max([e["step"] for a in arms.values() for e in a["evals"]] + [1])
    fig, (ax_ppl, ax_kl) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, arm) in enumerate(arms.items()):
        steps = [e["step"] for e in arm["evals"]]
        color = colors[i % len(colors)]
        for ax, key in ((ax_ppl, "ppl"), (ax_kl, "kl_mean")):
            ys = [e[key] for e in arm["evals"]]
            if len(steps) == 1:
                ax.plot([0, last], [ys[0], ys[0]], linestyle="--", color=color, label=name)
            else:
                ax.plot(steps, ys, marker="o", markersize=3, color=color, label=name)
    ax_ppl.set(xlabel="fine-tuning step", ylabel="held-out perplexity", yscale="log", title="perplexity")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _pos: f"{v:g}")  # 55.5, not 5.55×10¹
    ax_ppl.yaxis.set_major_formatter(plain)
    ax_ppl.yaxis.set_minor_formatter(plain)
    ax_kl.set(xlabel="fine-tuning step", ylabel="mean KL(original ‖ arm), nats/token", yscale="symlog",
              title="distance from the original")
    ax_kl.set_yscale("symlog", linthresh=1e-3)
    ax_ppl.legend(fontsize=8)
    fig.suptitle(result["recipe"]["name"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(result: dict, out: Path, plot: bool = True) -> dict[str, str]:
    """Write the four report files (each through a temporary name, renamed into place)."""
    files = {"results.json": json.dumps(finite_or_null(result), indent=1) + "\n", "results.csv": results_csv(result),
             "summary.md": summary_markdown(result)}
    written = {}
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out / name)
        written[name] = str(out / name)
    if plot and importlib.util.find_spec("matplotlib") is None:
        written["curves.png"] = None  # the `experiment` extra (matplotlib) is not installed
    elif plot:
        tmp = out / ".curves.tmp.png"
        plot_curves(result, tmp)
        tmp.replace(out / "curves.png")
        written["curves.png"] = str(out / "curves.png")
    return written
