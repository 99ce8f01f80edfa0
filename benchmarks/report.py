"""REPORT.md and the rms_norm bf16 plot from every kernel-benchmark JSON under benchmarks/results/.

    python benchmarks/report.py                      # benchmarks/results/ -> REPORT.md, rms_norm_bf16.png
    python benchmarks/report.py --results DIR --out DIR

A kernel-benchmark JSON is what benchmarks/kernels.py writes: {"device", "copy_gbs", "rows": [...]},
each measured row {"op", "pass", "dtype", "M", "N", "impl", "us", "gbs"}. Fields newer versions of
kernels.py add are used where present and never required: per file "commit", "versions"/"packages",
"date"; per row "timing" (or "graph": bool), "casting", "residual", and skipped rows (no "us") with
their "skip"/"reason"/"error". One file is one run: ratios between backends are taken only inside a
file, where every backend was timed against the same copy bandwidth on the same machine.

Per (op, pass, dtype[, casting, residual]) and shape, REPORT.md gives each backend's time (µs),
GB/s, % of the file's copy bandwidth, and its speedup over every other backend of the same file
(their time / its time: > 1 means it is faster). A headline table up front gives, per run, triton's
worst shape as a fraction of copy bandwidth and its worst and geometric-mean speedup over each
other backend. `normswap bench` files get a table per file; other evidence files (native test
outcomes, real-model patch reports) are indexed.
Files from `kernels.py --dry-run` (device cpu-dry-run) are not measurements and are left out;
a file marked "fixture" is labelled as one in every heading.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

# This checkout's normswap (its JSON reader), also where another copy is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from normswap import jsonsafe  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PLOT_NAME = "rms_norm_bf16.png"
OURS = "triton"
IMPL_ORDER = ("triton", "torch", "compile", "liger", "quack", "reference")


# ----------------------------------------------------------------------------------------------
# reading


def load_runs(results: Path) -> tuple[list[dict], list[str]]:
    """(kernel runs, notes on files left out), runs sorted by device then date."""
    runs, notes = [], []
    for path in sorted(results.rglob("*.json")):
        try:
            doc = jsonsafe.read(path)
        except (OSError, ValueError) as e:
            notes.append(f"`{path.name}`: not readable JSON ({e})")
            continue
        if not (isinstance(doc, dict) and isinstance(doc.get("rows"), list) and "copy_gbs" in doc
                and all(isinstance(r, dict) and "op" in r for r in doc["rows"])):
            continue  # another benchmark's file (convert, patch reports): indexed separately
        if str(doc.get("device", "")).startswith("cpu-dry-run"):
            notes.append(f"`{path.name}`: a `--dry-run` on CPU, not a measurement")
            continue
        runs.append({"path": path, "doc": doc, "date": _date(doc, path)})
    runs.sort(key=lambda r: (str(r["doc"].get("device")), r["date"], r["path"].name))
    return runs, notes


def _date(doc: dict, path: Path) -> str:
    for text in (str(doc.get("date", "")), path.name):
        m = re.search(r"\d{4}-\d{2}-\d{2}", text)
        if m:
            return m.group(0)
    return "undated"


def variant(row: dict) -> tuple:
    """What a table is about: op, pass, dtype, and the casting mode / fused residual where recorded."""
    extra = []
    if row.get("casting"):
        extra.append(f"casting {row['casting']}")
    if row.get("residual"):
        extra.append("fused residual" if row["residual"] is True else f"residual {row['residual']}")
    return (row["op"], row["pass"], row["dtype"], ", ".join(extra))


def measured(row: dict) -> bool:
    return isinstance(row.get("us"), (int, float)) and row["us"] > 0 and isinstance(row.get("gbs"), (int, float))


def skip_reason(row: dict) -> str:
    return str(row.get("skip") or row.get("reason") or row.get("error") or "not measured")


def timing(row: dict) -> str | None:
    if row.get("timing") or row.get("method"):
        return str(row.get("timing") or row.get("method"))
    if "graph" in row:
        return "graph" if row["graph"] else "events"
    return None


def tables(doc: dict) -> dict[tuple, dict[tuple[int, int], dict[str, dict]]]:
    """{variant: {(M, N): {impl: row}}}"""
    out: dict = {}
    for r in doc["rows"]:
        out.setdefault(variant(r), {}).setdefault((int(r["M"]), int(r["N"])), {})[r["impl"]] = r
    return out


def impls_of(doc: dict) -> list[str]:
    names = {r["impl"] for r in doc["rows"]}
    return [i for i in IMPL_ORDER if i in names] + sorted(names - set(IMPL_ORDER))


def run_title(run: dict) -> str:
    doc = run["doc"]
    label = f"{doc.get('device', 'unknown device')}, {run['date']} (`{run['path'].name}`)"
    return f"FIXTURE, not a measurement: {label}" if doc.get("fixture") else label


# ----------------------------------------------------------------------------------------------
# numbers


def speedups(doc: dict, impl: str, other: str, var: tuple) -> list[tuple[float, tuple[int, int]]]:
    """[(time of other / time of impl, shape)] over the shapes where both were measured."""
    out = []
    for shape, cells in tables(doc).get(var, {}).items():
        a, b = cells.get(impl), cells.get(other)
        if a and b and measured(a) and measured(b):
            out.append((b["us"] / a["us"], shape))
    return out


def headline(runs: list[dict]) -> list[str]:
    lines = []
    for run in runs:
        doc, copy = run["doc"], run["doc"]["copy_gbs"]
        if OURS not in impls_of(doc):
            continue
        others = [i for i in impls_of(doc) if i != OURS]
        head = ["op", "pass", "dtype", f"{OURS}: worst % of copy (M×N)", f"{OURS}: median % of copy"]
        head += [f"vs {o}: worst / geomean" for o in others]
        rows = []
        for var, shapes in sorted(tables(doc).items()):
            fracs = sorted((c[OURS]["gbs"] / copy, s) for s, c in shapes.items() if OURS in c and measured(c[OURS]))
            if not fracs:
                continue
            worst, shape = fracs[0]
            med = fracs[len(fracs) // 2][0] if len(fracs) % 2 else (fracs[len(fracs) // 2 - 1][0] + fracs[len(fracs) // 2][0]) / 2
            cells = [_var_op(var), var[1], var[2], f"{100 * worst:.0f}% ({shape[0]}×{shape[1]})", f"{100 * med:.0f}%"]
            for o in others:
                sp = speedups(doc, OURS, o, var)
                if not sp:
                    cells.append("—")
                    continue
                w, ws = min(sp)
                gm = math.exp(sum(math.log(x) for x, _ in sp) / len(sp))
                cells.append(f"{w:.2f}× ({ws[0]}×{ws[1]}) / {gm:.2f}×")
            rows.append(cells)
        if rows:
            lines += [f"**{run_title(run)}**: copy bandwidth {copy:.0f} GB/s", "", *_md_table(head, rows), ""]
    return lines


def _var_op(var: tuple) -> str:
    return var[0] + (f" ({var[3]})" if var[3] else "")


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def run_section(run: dict) -> list[str]:
    doc = run["doc"]
    copy = doc["copy_gbs"]
    versions = doc.get("versions") or doc.get("packages") or {}
    meta = [f"torch {doc.get('torch', '?')}", f"triton {doc.get('triton', '?')}"]
    meta += [f"{k} {v}" for k, v in sorted(versions.items()) if v and k not in ("torch", "triton")]
    lines = [f"### {run_title(run)}", "",
             f"Copy bandwidth {copy:.0f} GB/s (read + write). {', '.join(meta)}."
             + (f" Commit `{doc['commit']}`." if doc.get("commit") else ""), ""]
    if doc.get("fixture"):
        lines += [f"> {doc['fixture']}", ""]
    impls = impls_of(doc)
    for var, shapes in sorted(tables(doc).items()):
        lines += [f"#### {_var_op(var)} · {var[1]} · {var[2]}", ""]
        head = ["M×N", "backend", "µs", "GB/s", "% copy"] + [f"vs {o}" for o in impls]
        show_timing = any(timing(r) for cells in shapes.values() for r in cells.values())
        if show_timing:
            head.insert(2, "timing")
        rows = []
        for (m, n), cells in sorted(shapes.items()):
            for impl in impls:
                r = cells.get(impl)
                if r is None:
                    continue
                cell = [f"{m}×{n}", impl]
                if show_timing:
                    cell.append(timing(r) or "—")
                if not measured(r):
                    cell += [f"skipped: {skip_reason(r)}", "—", "—"] + ["—"] * len(impls)
                else:
                    cell += [f"{r['us']:.1f}", f"{r['gbs']:.0f}", f"{100 * r['gbs'] / copy:.0f}%"]
                    for o in impls:
                        other = cells.get(o)
                        cell.append("—" if o == impl or not other or not measured(other)
                                    else f"{other['us'] / r['us']:.2f}×")
                rows.append(cell)
        lines += [*_md_table(head, rows), ""]
    return lines


def bench_sections(results: Path, notes: list[str]) -> list[str]:
    """`normswap bench` files (format normswap-bench/1): per file, per mode, every variant's median
    time, tokens/s, peak memory and speedup over the unpatched model of the same file."""
    lines = []
    for path in sorted(results.rglob("*.json")):
        try:
            doc = jsonsafe.read(path)
        except ValueError:
            continue
        if not (isinstance(doc, dict) and str(doc.get("format", "")).startswith("normswap-bench/")):
            continue
        dev = doc.get("device") or {}
        if dev.get("cpu_numbers") or dev.get("type") == "cpu":
            notes.append(f"`{path.name}`: `normswap bench` on a CPU, not a GPU result")
            continue
        cfg = doc.get("config") or {}
        lines += [f"### {dev.get('name', 'unknown device')}: `{cfg.get('model', '?')}` (`{path.name}`)", "",
                  ", ".join(f"{k} {cfg[k]}" for k in ("batch", "seq", "dtype", "compile") if k in cfg)
                  + (f"; {'; '.join(map(str, doc['notes']))}" if doc.get("notes") else ""), ""]
        head = ["mode", "variant", "median ms", "tokens/s", "peak MiB", "vs eager", "timing"]
        rows = []
        for r in sorted(doc.get("rows", []), key=lambda r: (str(r.get("mode")), str(r.get("variant")))):
            if r.get("error"):
                rows.append([str(r.get("mode")), str(r.get("variant")), f"error: {r['error']}", "—", "—", "—", "—"])
                continue
            mem = r.get("peak_memory_bytes")
            rows.append([str(r.get("mode")), str(r.get("variant")), _num(r.get("median_ms"), ".3f"),
                         _num(r.get("tokens_per_s"), ".0f"), _num(mem / 2**20 if mem else None, ".0f"),
                         _num(r.get("speedup"), ".3f", "×"), str(r.get("method") or "—")])
        lines += [*_md_table(head, rows), ""]
    return lines


def _num(x, fmt: str, unit: str = "") -> str:
    return "—" if not isinstance(x, (int, float)) else f"{x:{fmt}}{unit}"


def other_evidence(results: Path, kernel_paths: set[Path], notes: list[str]) -> list[str]:
    lines = []
    for path in sorted(results.rglob("*-tests*.txt")):
        text = path.read_text()
        if "DRY RUN" in text:
            notes.append(f"`{path.name}`: a `gpu.py --dry-run` on CPU, not a GPU result")
            continue
        status = [ln for ln in text.splitlines() if ln.startswith(("## ", "outcomes so far", "pytest: "))]
        lines += [f"- `{path.name}`: " + "; ".join(s.removeprefix("## ") for s in status)]
    for path in sorted(results.rglob("*.json")):
        if path in kernel_paths or "patch" not in path.name:
            continue
        try:
            doc = jsonsafe.read(path)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        if str((doc.get("versions") or {}).get("device", "")).startswith("cpu-dry-run"):
            notes.append(f"`{path.name}`: a `gpu.py --dry-run` on CPU, not a GPU result")
            continue
        rep = doc.get("report") if isinstance(doc.get("report"), dict) else {}
        counts = rep.get("counts") or {}
        bits = [f"`{doc['command']}`" if doc.get("command") else "",
                f"exit {doc['exit']}" if "exit" in doc else "",
                f"device {rep['device']}" if rep.get("device") else "",
                f"ok {rep['ok']}" if "ok" in rep else "",
                f"patched {counts['patched']}" if "patched" in counts else "",
                _eval_summary(rep.get("eval") or {})]
        lines.append(f"- `{path.name}`: " + ", ".join(b for b in bits if b))
    return lines


def _eval_summary(ev: dict) -> str:
    keys = [k for k in ("ppl_a", "ppl_b", "relative_delta", "kl_mean", "top1_agreement") if k in ev]
    return ", ".join(f"{k} {ev[k]:.6g}" if isinstance(ev[k], float) else f"{k} {ev[k]}" for k in keys)


# ----------------------------------------------------------------------------------------------
# the plot


def _plotted(row: dict) -> bool:
    return row["op"] == "rms_norm" and row["dtype"] == "bf16" and not row.get("residual")


def plot(runs: list[dict], path: Path) -> bool:
    """GB/s against hidden size for rms_norm bf16, fwd and fwd+bwd, one line per backend, for the
    most recent run that measured it, at its largest row count; copy bandwidth as the ceiling."""
    chosen = None
    for run in runs:
        if any(_plotted(r) and measured(r) for r in run["doc"]["rows"]):
            if chosen is None or (run["date"], run["path"].name) > (chosen["date"], chosen["path"].name):
                chosen = run
    if chosen is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = chosen["doc"]
    rows = [r for r in doc["rows"] if _plotted(r)]
    m = max(int(r["M"]) for r in rows if measured(r))
    passes = [p for p in ("fwd", "fwd+bwd") if any(r["pass"] == p for r in rows)]
    fig, axes = plt.subplots(1, len(passes), figsize=(6.5 * len(passes), 4.5), squeeze=False)
    for ax, p in zip(axes[0], passes, strict=True):
        for impl in impls_of(doc):
            pts = sorted((int(r["N"]), r["gbs"]) for r in rows
                         if r["pass"] == p and r["impl"] == impl and int(r["M"]) == m and measured(r))
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=impl)
        ax.axhline(doc["copy_gbs"], color="black", linestyle="--", label=f"copy {doc['copy_gbs']:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hidden size N")
        ax.set_ylabel("GB/s (minimal bytes)")
        ax.set_title(f"rms_norm bf16 {p}, M = {m}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(run_title(chosen).replace("`", ""), fontsize=9)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return True


# ----------------------------------------------------------------------------------------------


def build(results: Path, out: Path) -> tuple[Path, Path | None]:
    runs, notes = load_runs(results)
    out.mkdir(parents=True, exist_ok=True)
    plot_path = out / PLOT_NAME
    has_plot = plot(runs, plot_path)
    lines = ["# Benchmark report", "",
             "Written by `python benchmarks/report.py` from the JSON files in this folder; do not edit by hand.",
             "Cells: time in µs, GB/s counting the minimal bytes of the pass (see benchmarks/README.md), that "
             "as a percentage of the run's measured copy bandwidth, and `vs X` = X's time / this backend's "
             "time within the same run (> 1: this backend is faster).", ""]
    if not runs:
        lines += ["No kernel measurements yet: no GPU has run `benchmarks/kernels.py` for this project.", ""]
    else:
        lines += ["## Headline", "", *headline(runs)]
        if has_plot:
            lines += [f"![rms_norm bf16]({PLOT_NAME})", ""]
        lines += ["## Runs", ""]
        for run in runs:
            lines += run_section(run)
    bench = bench_sections(results, notes)
    if bench:
        lines += ["## Model level (`normswap bench`)", "", *bench]
    evidence = other_evidence(results, {r["path"] for r in runs}, notes)
    if evidence:
        lines += ["## Other evidence", "", *evidence, ""]
    if notes:
        lines += ["## Files left out", "", *(f"- {n}" for n in notes), ""]
    report = out / "REPORT.md"
    tmp = report.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines).rstrip("\n") + "\n")
    tmp.replace(report)
    return report, plot_path if has_plot else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="folder of result JSON (default benchmarks/results)")
    p.add_argument("--out", type=Path, default=None, help="where REPORT.md and the plot go (default: --results)")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        print(f"benchmarks/report.py: {args.results}: no such folder", file=sys.stderr)
        return 2
    report, png = build(args.results, args.out or args.results)
    print(f"wrote {report}" + (f" and {png}" if png else " (no rms_norm bf16 measurements: no plot)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
