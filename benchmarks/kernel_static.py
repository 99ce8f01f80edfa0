"""Static quality of the norm kernels on Hopper, without a GPU.

    python benchmarks/kernel_static.py                       # the benchmark grid, table on stdout
    python benchmarks/kernel_static.py --subset ci           # the few variants the CPU test compiles
    python benchmarks/kernel_static.py --hidden 4096 --dtypes bf16 --json
    python benchmarks/kernel_static.py --table               # every sm_90 entry of the launch table
    python benchmarks/kernel_static.py --table --subset ci   # what CI compiles of it
    python benchmarks/kernel_static.py --variants api        # every kernel variant a GPU run can launch
    python benchmarks/kernel_static.py --variants ci         # one of each variant class (CI)

For every kernel launch the library's launch table and heuristics pick on the benchmark grid (hidden
1,024 ... 262,144; bf16 / fp32; with and without weight, bias, residual; forward and backward),
this runs the library's static check (normswap/kernels/static_check.py, which `normswap tune`
holds every candidate tile to): the launch compiled for sm_90 exactly as the launcher would make
it, found by running the library's own launchers on `meta` tensors with launches intercepted (what
is compiled is what the heuristics chose, never a copy of them; SM count for the plan: an H100
SXM's 132), and read back for registers, spills, stack, shared memory, programs per SM, and the
width and source line of every global memory instruction (row elements told from per-row
statistics and scratch by the names on that line). This script is the report over the grid and
the launch table.

`--variants` compiles kernel variants instead of tiles: every distinct constexpr and signature
combination (static_check.variant_cases: casting families, parameter dtypes, per-head parameters,
weight / bias / residual present or not, frozen parameters, dh absent, every row layout and row
bucket; with `api` also residual dtypes, residual_in_fp32 and out_dtype), each compiled once with
ptxas' registers and spills; exit 1 when one fails to plan or compile (what would cost a GPU
session its lease); spills are listed (SPILL lines, "spilled" in the JSON), not failed: the grid
holds the benchmark's tiles to none.

It must run without TRITON_INTERPRET (the interpreter compiles nothing); it sets that itself when
run as a script. Exit status 1 when a variant spills registers or moves row elements in accesses
narrower than 16 bytes at a hidden size that is a multiple of 16 (the CPU test's rule), 2 on bad
arguments or when ptxas is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

# This checkout's normswap, also where another copy is installed (a second clone, a worktree): a
# script measures the kernels of the tree it is in.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The static check itself lives in the library (the tuner needs it); it imports no triton at
# module level, so the interpreter can still be turned off below, before anything compiles.
from normswap import jsonsafe  # noqa: E402
from normswap.dtypes import RUN_DTYPES  # noqa: E402
from normswap.kernels.static_check import (  # noqa: E402
    CP_ASYNC_HINTS_SINCE,
    ROWS,
    SCOPES,
    TABLE_VARIANTS,
    bucket_rows,
    cases,
    check_tile,
    cp_async_hints,
    ptxas_release,
    representatives,
    run,
    sweep,
    tools_missing,
    unhinted_copies,
    variant_cases,
)
from normswap.kernels.timing import HIDDEN  # noqa: E402 - the benchmark grid's hidden sizes

# The grid's variants: (op, weight, bias, residual).
VARIANTS = (
    ("rms_norm", True, False, False), ("rms_norm", True, False, True),
    ("rms_norm", False, False, False), ("rms_norm", False, False, True),
    ("layer_norm", True, True, False), ("layer_norm", True, True, True),
    ("layer_norm", True, False, False), ("layer_norm", False, False, False),
)
# A representative subset for CI (a few compiles each ~1 s): one multi-row tile, one whole-row
# tile, one split row, forward and backward, both ops, with the residual path and the bias.
CI_SUBSET = {
    "hidden": (4096, 65536),
    "dtypes": ("bf16", "fp32"),
    "variants": (("rms_norm", True, False, True), ("layer_norm", True, True, False)),
}


def table_check(path: Path, workdir: Path, progress=None, ci: bool = False) -> tuple[list[dict], list[str]]:
    """check_tile for every entry of a launch-table file planned for this analysis' target (sm_90);
    (result rows, entries not compiled: other architectures, and with `ci` those that are the
    heuristics' own tile). `ci`: what CI compiles, kept to about a second per entry that differs
    from the heuristics (whose tiles the grid run and the ci subset check), in the fused-residual
    variant only (the one with the most live values); the whole check is `--table` alone."""
    from normswap.dtypes import DTYPES
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T

    doc = T.read(path)
    bad = T.problems(doc, C.ROW_BUCKETS)
    if bad:
        raise ValueError("; ".join(bad[:3]))
    results, others, cache = [], [], {}
    todo = [(arch, e) for arch, body in doc["archs"].items() for e in body["entries"]]
    for i, (arch, e) in enumerate(todo, 1):
        if arch != C.PLAN_ARCH:
            others.append(f"{arch} {e['op']} {e['pass']} {e['dtype']} {e['hidden']} {e['rows']}")
            continue
        key = (arch, *T.entry_key(e))
        variants = None
        if ci:
            static = C.heuristic_config(bucket_rows(e["rows"]), e["hidden"], DTYPES[e["dtype"]], e["pass"])
            if C.tile_fields(static) == e["tile"]:
                others.append(f"{arch} {e['op']} {e['pass']} {e['dtype']} {e['hidden']} {e['rows']} (the heuristics' tile)")
                continue
            variants = TABLE_VARIANTS[e["op"]][-1:]
        for r in check_tile(key, e["tile"], workdir, cache, variants):
            results.append(dict(r, entry=list(key)))
        if progress:
            progress(i, len(todo), {"op": e["op"], "pass": e["pass"], "dtype": e["dtype"], "N": e["hidden"]})
    return results, others


def ci_cases() -> list[dict]:
    """The CI subset's cases (what test_kernel_static compiles with the full analysis)."""
    return list(cases(CI_SUBSET["hidden"], CI_SUBSET["dtypes"], CI_SUBSET["variants"], ("fwd", "bwd"), ROWS))


def variants_check(which: str, workdir: Path, progress=None) -> dict:
    """Compile every kernel variant of a scope (static_check.variant_cases: "library", "api"), or
    with "ci" one representative of each variant class of the "api" scope that the CI subset does
    not compile already (static_check.representatives), for sm_90; ptxas' registers and spills and
    any error per variant."""
    import time

    import triton

    t0 = time.perf_counter()
    every = variant_cases("api" if which == "ci" else which)
    classes = None
    if which == "ci":
        picked, every_class = representatives(every, ci_cases())
        classes = len(every_class)
        every = picked
    rows = sweep(every, workdir, on_case=progress)
    return {"target": "sm_90 (H100 limits)", "triton": triton.__version__, "scope": which, "cases": len(every),
            "classes": classes, "variants": len(rows), "seconds": round(time.perf_counter() - t0, 1),
            "failed": sum(1 for r in rows if r["error"]), "spilled": sum(1 for r in rows if r.get("spill_bytes")),
            "results": rows}


def variants_summary(doc: dict) -> str:
    """One line per kernel (variants compiled, failures, spills, registers), then every failure."""
    head = f"{'kernel':<16} {'variants':>8} {'failed':>6} {'spilled':>7} {'regs':>8}"
    classes = f" (one of each of {doc['classes']} variant classes)" if doc["classes"] else ""
    lines = [f"triton {doc['triton']}, {doc['target']}, scope {doc['scope']}: {doc['cases']} cases, "
             f"{doc['variants']} distinct kernel variants{classes} in {doc['seconds']} s", head, "-" * len(head)]
    by: dict = {}
    for r in doc["results"]:
        by.setdefault(r["kernel"] or "(planning)", []).append(r)
    for k, rs in by.items():
        regs = [r["regs"] for r in rs if r.get("regs") is not None]
        lines.append(f"{k:<16} {len(rs):>8} {sum(1 for r in rs if r['error']):>6} "
                     f"{sum(1 for r in rs if r.get('spill_bytes')):>7} "
                     f"{(f'{min(regs)}-{max(regs)}' if regs else '-'):>8}")
    for r in doc["results"]:
        if r["error"] or r.get("spill_bytes"):
            c = r["case"]
            what = r["error"].splitlines()[0][:300] if r["error"] else f"spills {r['spill_bytes']} bytes"
            lines.append(f"{'FAIL' if r['error'] else 'SPILL'} {r['kernel'] or '(planning)'} {c['op']} {c['pass']} "
                         f"{c['dtype']} N={c['N']} rows={c['M']} w={int(c['weight'])} b={int(c['bias'])} "
                         f"res={int(c['residual'])} {c.get('variant')}: {what}")
    return "\n".join(lines)


def hint_note(rows: list[dict], what: str) -> str | None:
    """One line naming how many of the launches / variants stream their pipelined row loads without
    the L2 evict_first hint the kernels ask for (static_check.CP_ASYNC_HINTS_SINCE), or None."""
    import triton

    lost = unhinted_copies(rows)
    if not lost:
        return None
    versions = sorted({r["ptx"]["version"] or "?" for r in lost})
    since = ".".join(map(str, CP_ASYNC_HINTS_SINCE["triton"])), ".".join(map(str, CP_ASYNC_HINTS_SINCE["ptx"]))
    # A triton and PTX that should keep the hint and did not: the rule moved, or the kernels did.
    why = ("UNEXPECTED for this triton and PTX" if any(cp_async_hints(triton.__version__, v) for v in versions)
           else "dropped by this triton and PTX")
    return (f"note: {len(lost)} of {len(rows)} {what} load their rows through cp.async (the pipelined backward) "
            f"without the L2 evict_first hint the kernels ask for: triton {triton.__version__}, PTX "
            f"{', '.join(versions)}: {why} (kept from triton {since[0]} with PTX {since[1]}; "
            f"benchmarks/README.md, Pre-flight)")


def variant_name(r: dict) -> str:
    """w, wb, res, w+res, ... ('plain' for none of them)."""
    parts = [("w" if r["weight"] else "") + ("b" if r["bias"] else ""), "res" if r["residual"] else ""]
    return "+".join(p for p in parts if p) or "plain"


def fmt_widths(d: dict) -> str:
    return " ".join(f"{n}x{b}" for b, n in d.items()) or "-"


def table(results: list[dict]) -> str:
    head = (f"{'op':<10} {'pass':<4} {'dt':<4} {'N':>6} {'var':<7} {'#':>1} {'kernel':<16} {'tile':<22} {'warps':>5} "
            f"{'grid':>7} {'regs':>4} {'spill':>5} {'smem':>6} {'P/SM':>4} {'row loads':<16} {'row stores':<12} "
            f"{'cp.async':>8}  ok")
    lines = [head, "-" * len(head)]
    for r in results:
        tile = ",".join(f"{k.replace('BLOCK_', '')}={int(v) if isinstance(v, bool) else v}" for k, v in r["tile"].items())
        lines.append(
            f"{r['op']:<10} {r['pass']:<4} {r['dtype']:<4} {r['N']:>6} {variant_name(r):<7} {r['launch']:>1} "
            f"{r['kernel'][:16]:<16} {tile[:22]:<22} {r['num_warps']:>5} {','.join(map(str, r['grid'])):>7} "
            f"{r['regs']:>4} {r['spill_bytes']:>5} {r['smem']:>6} {r['programs_per_sm']:>4} "
            f"{fmt_widths(r['row_loads']):<16} {fmt_widths(r['row_stores']):<12} {r['cp_async']:>8}  "
            f"{'ok' if not r['problems'] else 'FAIL'}")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """One line per (op, pass, dtype, N) over its variants (weight/bias/residual) and launches."""
    groups: dict = {}
    for r in results:
        groups.setdefault((r["op"], r["pass"], r["dtype"], r["N"]), []).append(r)
    head = (f"{'op':<10} {'pass':<4} {'dt':<4} {'N':>6} | {'tile (BLOCK_M x BLOCK_N x chunks)':<26} {'warps':>5} "
            f"{'regs':>7} {'spill':>5} {'smem KB':>7} {'P/SM':>5} {'row ld/st widths':<18} {'narrow':>6} {'cp.async':>8} | ok")
    lines = [head, "-" * len(head)]
    for (op, p, dt, n), rs in groups.items():
        tiles = sorted({"x".join(str(int(v)) for v in r["tile"].values()) for r in rs})
        warps = sorted({r["num_warps"] for r in rs})
        widths = sorted({b for r in rs for d in (r["row_loads"], r["row_stores"]) for b in map(int, d)}, reverse=True)
        regs = [r["regs"] for r in rs]
        lines.append(
            f"{op:<10} {p:<4} {dt:<4} {n:>6} | {','.join(tiles)[:26]:<26} {'/'.join(map(str, warps)):>5} "
            f"{min(regs):>3}-{max(regs):<3} {max(r['spill_bytes'] for r in rs):>5} "
            f"{max(r['smem'] for r in rs) / 1024:>7.1f} {min(r['programs_per_sm'] for r in rs):>5} "
            f"{'/'.join(map(str, widths)) + ' bit':<18} {sum(len(r['narrow_row_ops']) for r in rs):>6} "
            f"{max(r['cp_async'] for r in rs):>8} | {'FAIL' if any(r['problems'] for r in rs) else 'ok'}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", default=None, help="comma list (default 1024..262144)")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma list (default bf16,fp32)")
    p.add_argument("--ops", default="rms_norm,layer_norm", help="comma list (default rms_norm,layer_norm)")
    p.add_argument("--passes", default="fwd,bwd", help="comma list (default fwd,bwd)")
    p.add_argument("--rows", type=int, default=ROWS, help="row count the launch plan is made for (default 32768)")
    p.add_argument("--subset", choices=("ci",), default=None, help="the CPU test's representative subset")
    p.add_argument("--json", action="store_true", help="JSON on stdout instead of the table")
    p.add_argument("--summary", action="store_true", help="one line per (op, pass, dtype, hidden)")
    p.add_argument("--render", metavar="JSON", default=None, help="print the tables of a saved --json run")
    p.add_argument("--table", nargs="?", const="", default=None, metavar="PATH",
                   help="check every sm_90 entry of a launch table (default: the package's) instead of the grid")
    p.add_argument("--variants", choices=("ci", *SCOPES), default=None,
                   help="compile every kernel variant a GPU run can launch instead of the grid (library: every "
                        "launch of a patched model; api: also the functional API's options; ci: one of each "
                        "variant class the ci subset leaves out); exit 1 when one fails to plan or compile, "
                        "spills listed")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        try:
            results = jsonsafe.read(args.render)["results"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"kernel_static.py: cannot read {args.render}: {e}", file=sys.stderr)
            return 2
        print(summary(results) if args.summary else table(results))
        return 0
    why = tools_missing()
    if why:
        print(f"kernel_static.py: {why}", file=sys.stderr)
        return 2
    from normswap.kernels import _common as C
    from normswap.kernels import rms_norm as R

    if C.interpreting(R._rms_fwd_kernel):
        print("kernel_static.py: TRITON_INTERPRET is set; unset it (the interpreter compiles nothing)",
              file=sys.stderr)
        return 2
    try:
        if args.subset == "ci":
            hidden, dtypes, variants = CI_SUBSET["hidden"], CI_SUBSET["dtypes"], CI_SUBSET["variants"]
        else:
            hidden = [int(v) for v in args.hidden.split(",")] if args.hidden else HIDDEN
            dtypes = [d for d in args.dtypes.split(",") if d]
            if any(d not in RUN_DTYPES for d in dtypes):
                raise ValueError(f"dtypes must be among {', '.join(RUN_DTYPES)}")
            ops = set(args.ops.split(","))
            variants = [v for v in VARIANTS if v[0] in ops]
    except ValueError as e:
        print(f"kernel_static.py: {e}", file=sys.stderr)
        return 2
    if args.variants:
        def progress_v(i, total, case, rows):
            if i == total or i % 200 == 0:
                print(f"[{i}/{total} cases] {len(rows)} variants", file=sys.stderr)

        with tempfile.TemporaryDirectory() as tmp:
            doc = variants_check(args.variants, Path(tmp), progress_v)
        print(json.dumps(doc, indent=1, default=str) if args.json else variants_summary(doc))
        note = hint_note(doc["results"], "variants")
        if note:
            print(note, file=sys.stderr)
        return 1 if doc["failed"] else 0
    passes = [p for p in args.passes.split(",") if p]
    case_list = list(cases(hidden, dtypes, variants, passes, args.rows))

    def progress(i, total, case):
        print(f"[{i}/{total}] {case['op']} {case['pass']} {case['dtype']} {case['N']}", file=sys.stderr)

    others: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.table is not None:
            from normswap.kernels import launch_table as T

            path = Path(args.table) if args.table else T.PATH
            try:
                results, others = table_check(path, Path(tmp), progress, ci=args.subset == "ci")
            except (OSError, ValueError) as e:
                print(f"kernel_static.py: launch table {path}: {e}", file=sys.stderr)
                return 2
            print(f"launch table {path}: {len({tuple(r['entry']) for r in results})} sm_90 entries checked"
                  + (f"; not compiled: {', '.join(others)}" if others else ""), file=sys.stderr)
        else:
            results = run(case_list, Path(tmp), progress)
    bad = [r for r in results if r["problems"]]
    if args.json:
        import triton

        print(json.dumps({"target": "sm_90 (H100 limits)", "triton": triton.__version__, "ptxas": ptxas_release(90),
                          "rows": args.rows, "results": results, "not_checked": others}, indent=1))
    else:
        shown = [r for r in results if "regs" in r]  # not the launches that could not be planned
        print(summary(shown) if args.summary else table(shown))
        for r in bad:
            print(f"FAIL {r['op']} {r['pass']} {r['dtype']} N={r['N']} {variant_name(r)} launch {r['launch']}: "
                  + " | ".join(r["problems"]))
    note = hint_note(results, "launches")
    if note:
        print(note, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # compile for real; normswap would turn the interpreter on
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    raise SystemExit(main())
