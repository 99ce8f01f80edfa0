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
    worse than the original) or no original ran.

    In half precision (results.json's `noise_floor`) each row also says whether the arm's final
    evaluation lies within the dtype's noise floor (`within_noise`, `noise_kl_ratio`,
    `noise_verdict`: normswap.evaluate.judge_noise's); None in float32."""
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
               "recovered": None, **_noise_columns(last)}
        if training and transform.startswith("approx") and reference is not None:
            gap_start = first["nll"] - start
            gap_end = last["nll"] - _final(reference)["nll"]
            row["recovered"] = 1.0 - gap_end / gap_start if gap_start > 1e-9 else None
        rows.append(row)
    return rows


def _noise_columns(evaluation: dict) -> dict:
    noise = evaluation.get("noise_floor") or {}
    return {"within_noise": noise.get("within"), "noise_kl_ratio": noise.get("kl_ratio"),
            "noise_verdict": noise.get("verdict")}


def _fmt(v, spec: str, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return format(v, ("+" if signed else "") + spec)


def count_noun(n: int, noun: str) -> str:
    """1 step, 2 steps; 1 process, 2 processes (the reports' and the trainer's messages)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


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
    ft = result["recipe"].get("finetune")
    if ft and any(parse_arm(name)[1] for name in result["arms"]):
        # What the trained arms ran, from the values used (the description is the recipe file's
        # prose: after --set finetune.steps=4 it still said 100 steps).
        # Each trained arm's process count (arms finished by calls launched differently, e.g. one
        # arm under `accelerate launch`, differ in sequences per step); an arm result written
        # before they were recorded counts as this call's.
        here = (result.get("environment") or {}).get("num_processes") or 1
        by_arm = {name: arm.get("num_processes") or here for name, arm in result["arms"].items()
                  if parse_arm(name)[1]}
        counts = sorted(set(by_arm.values()))
        per_step = " or ".join(str(ft["batch_size"] * ft["grad_accum"] * n) for n in counts)
        processes = count_noun(counts[0], "process") if len(counts) == 1 else " or ".join(map(str, counts)) + \
            " processes; " + "; ".join(f"{n}: {', '.join(a for a, k in by_arm.items() if k == n)}" for n in counts)
        warmup = f"after {count_noun(ft['warmup_steps'], 'warm-up step')}" if ft["warmup_steps"] else "no warm-up"
        lines += [f"Fine-tuning: {count_noun(ft['steps'], 'step')} of {per_step} "
                  f"sequences × {ft['seq_len']} tokens ({ft['batch_size']} per micro-batch × {ft['grad_accum']} "
                  f"accumulated × {processes}), {ft['optimizer']} at lr {ft['lr']:g} "
                  f"({ft['schedule']}, {warmup}), {ft['dtype']}; evaluated every "
                  f"{count_noun(ft['eval_every'], 'step') if ft['eval_every'] > 1 else 'step'}.", ""]
    ev = result["eval"]
    floor = result.get("noise_floor")
    lines += [f"Held-out text: {ev['tokens']} tokens, windows of {ev['max_length']} (stride {ev['stride']}). "
              f"KL: the mean KL(original‖arm) per token, in nats; top-1: the share of tokens whose most likely "
              f"next token is the original's; both against the original model{' in float32' if floor else ''}.", ""]
    if floor:
        lines += [f"Every arm runs in {floor['dtype']}; {floor['description']} (float32 perplexity "
                  f"{floor['ppl_reference']:.4f}). An arm is within the {floor['dtype']} noise while its KL to "
                  f"float32 is at most {floor['limit']:g}x the original's.", ""]
    noise_head, noise_rule = (f" vs {floor['dtype']} noise |", "---|") if floor else ("", "")
    lines += ["| arm | steps | ppl at step 0 | final ppl | Δ vs original | Δ vs original+ft | KL(original‖arm) | top-1 | "
              f"recovered |{noise_head}",
              f"|---|---:|---:|---:|---:|---:|---:|---:|---:|{noise_rule}"]
    for r in rows:
        noise = ""
        if floor:
            noise = (" – |" if r["within_noise"] is None else
                     f" {'within' if r['within_noise'] else 'OUTSIDE'} ({_fmt(r['noise_kl_ratio'], '.3g')}x) |")
        lines.append(
            f"| {r['arm']} | {r['steps']} | {_fmt(r['ppl_start'], '.4f')} | {_fmt(r['ppl'], '.4f')} | "
            f"{_fmt(r['delta_vs_original'], '.4f', True)} | {_fmt(r['delta_vs_original_ft'], '.4f', True)} | "
            f"{_fmt(r['kl_mean'], '.2e')} | {_fmt(r['top1_agreement'], '.2%')} | "
            f"{_fmt(r['recovered'], '.1%')} |{noise}")
    if floor:
        lines += ["", f"Final evaluation of each arm against the {floor['dtype']} noise floor:", ""]
        lines += [f"- {r['noise_verdict'] or r['arm'] + ': not judged'}" for r in rows]
    # The control summary_rows took: without original+ft the trained arms were measured against the
    # untrained original, while this line said original+ft and "trained the same way".
    if "original+ft" in result["arms"]:
        control, compared = "original+ft", ("each model compared with the original trained the same way (100 %: as "
                                            "good as the fine-tuned control; over 100 %: better; below 0: the gap grew)")
    else:
        control, compared = "original", ("against the untrained original: original+ft did not run, so what "
                                         "fine-tuning alone does to the loss is counted as recovered (100 %: as "
                                         "good as the original; below 0: the gap grew)")
    lines += ["", f"recovered (trained approximate arms): 1 − (final nll − final nll of {control}) / (nll at step 0 "
              f"− nll of original), the share of the approximation's loss gap that training took back, {compared}; "
              "– where the arm started no worse than the original."]
    return "\n".join(lines) + "\n"


def results_csv(result: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    noise = bool(result.get("noise_floor"))  # half precision: each evaluation judged against it
    w.writerow(["arm", "step", *METRICS, "train_loss", *(("within_noise", "noise_kl_ratio") if noise else ())])
    for name, arm in result["arms"].items():
        losses = arm.get("losses", [])
        for e in arm["evals"]:
            loss = losses[e["step"] - 1] if 0 < e["step"] <= len(losses) else ""
            judged = e.get("noise_floor") or {}
            extra = (judged.get("within", ""), judged.get("kl_ratio", "")) if noise else ()
            w.writerow([name, e["step"], *(e.get(m) for m in METRICS), loss, *extra])
    return buf.getvalue()


def plot_curves(result: dict, file) -> None:
    """curves.png: curves_figure(result), saved as PNG to `file` (a path or a binary file)."""
    curves_figure(result).savefig(file, dpi=120, format="png")


def curves_figure(result: dict):
    """Eval perplexity (log scale) and KL(original‖arm) against the fine-tuning step, one line per
    arm; untrained arms are horizontal dashed lines at their step-0 value. A matplotlib Figure.

    Made without pyplot: pyplot would need a backend (switching a notebook's to Agg stopped its
    plots showing) and would keep every figure open until closed; a notebook still shows this one."""
    import matplotlib
    import matplotlib.ticker
    from matplotlib.figure import Figure

    arms = result["arms"]
    last = max([e["step"] for a in arms.values() for e in a["evals"]] + [1])
    fig = Figure(figsize=(12, 4.8))
    ax_ppl, ax_kl = fig.subplots(1, 2)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
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
    floor = result.get("noise_floor")
    who = "float32 original" if floor else "original"
    ax_kl.set(xlabel="fine-tuning step", ylabel=f"mean KL({who} ‖ arm), nats/token", title=f"distance from the {who}")
    # Log scale down to the decade of the smallest distance drawn (only an exact 0 sits on the
    # linear part at the bottom): with a fixed 1e-3 an arm 1e-5 from the original (approx-bias) was
    # drawn at 0, on top of `exact`'s 1e-13, hiding the difference the experiment measures.
    # (An evaluation that is not finite, null once in results.json, is not drawn and decides nothing.)
    kls = [e.get("kl_mean") for a in arms.values() for e in a["evals"]]
    if floor:
        kls.append(floor["original"]["kl_mean"])
    positive = [kl for kl in kls if kl is not None and 0 < kl < math.inf]
    linthresh = min([1e-3, *(10.0 ** math.floor(math.log10(kl)) for kl in positive)])
    if floor and floor["original"]["kl_mean"] > 0:
        # The half-precision floor and its limit as lines.
        kl = floor["original"]["kl_mean"]
        ax_kl.axhline(kl, color="grey", linestyle=":", label=f"{floor['dtype']} noise floor")
        ax_kl.axhline(floor["limit"] * kl, color="grey", linestyle="-.", linewidth=0.8,
                      label=f"{floor['limit']:g}x the floor")
        ax_kl.legend(fontsize=8)
    ax_kl.set_yscale("symlog", linthresh=linthresh)
    ax_kl.set_ylim(bottom=0)  # a KL is never negative: no empty half below 0
    # Steps are whole numbers (no tick at step 0.5): the evaluated steps when they are few, else round ones.
    evaluated = sorted({e["step"] for a in arms.values() for e in a["evals"]} | {last})
    for ax in (ax_ppl, ax_kl):
        if len(evaluated) <= 12:
            ax.set_xticks(evaluated)
        else:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    ax_ppl.legend(fontsize=8)
    fig.suptitle(result["recipe"]["name"])
    fig.tight_layout()
    return fig


def report_files(plot: bool) -> tuple[str, ...]:
    """The files write_reports(plot=plot) writes into OUT: curves.png only with plot and the
    `experiment` extra (matplotlib) installed."""
    with_plot = plot and importlib.util.find_spec("matplotlib") is not None
    return ("results.json", "results.csv", "summary.md") + (("curves.png",) if with_plot else ())


def write_reports(result: dict, out: Path, plot: bool = True) -> dict[str, str]:
    """Write the four report files, each atomically as every normswap output file is
    (fileio.replaced_atomically: a link in their place is written through)."""
    from normswap.fileio import replaced_atomically

    files = {"results.json": json.dumps(finite_or_null(result), indent=1) + "\n", "results.csv": results_csv(result),
             "summary.md": summary_markdown(result)}
    written = {}
    for name, text in files.items():
        with replaced_atomically(out / name, "wb") as f:
            f.write(text.encode("utf-8"))
        written[name] = str(out / name)
    if plot and "curves.png" not in report_files(plot):
        written["curves.png"] = None  # the `experiment` extra (matplotlib) is not installed
    elif plot:
        with replaced_atomically(out / "curves.png", "wb") as f:
            plot_curves(result, f)
        written["curves.png"] = str(out / "curves.png")
    return written
