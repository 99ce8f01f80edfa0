"""Norm kernel benchmark: every available backend side by side, against the device's copy bandwidth.

    python benchmarks/kernels.py                      # full grid on the CUDA device, JSON to benchmarks/results/
    python benchmarks/kernels.py --ops rms_norm --dtypes bf16 --passes fwd
    python benchmarks/kernels.py --dry-run            # tiny CPU shapes: checks the plumbing, measures nothing useful

Measures the device copy bandwidth first (dst.copy_(src), bytes read + written), then forward and
forward+backward of rms_norm and layer_norm for each backend, bf16 and fp32, rows {4096, 32768} x
hidden {1024 .. 262144} plus 512 x 4096; with --residual, the fused residual add + norm. Times come
from CUDA-graph replays (triton's do_bench_cudagraph) by default, `--timing events` for CUDA
events; a case the chosen method cannot time is an `error` row with the reason, never silently
timed another way. Inside the timed region the case rotates over several input sets totalling
>= 4x the L2 cache, so shapes that fit in L2 are not measured L2-warm.

GB/s counts the bytes each pass moves as separate kernels must move them (quack's convention):
    fwd      x (+ residual) and weight (+ bias) read; y (+ h) written
    bwd      the saved input (x, or h) and dy (+ dh) and weight read; dx, dweight (+ dbias) written
             (x and the residual get one gradient, written once)
    fwd+bwd  fwd + bwd: x is counted twice (read by the forward and again by the backward)
Saved statistics (rstd, mean) and fp32 partial sums are not counted. Shapes that do not fit in
device memory are rows with skip "oom (skipped)"; combinations a backend refuses are skip "n/a:
<reason>"; any other failure of one backend on one shape is skip "error: <message>" and the run goes
on. Every row, measured or not, is kept in the JSON (schema in benchmarks/README.md). The `compile`
backend is compiled afresh, with static shapes, for every case (dynamo reset per case): inductor's
best case, and no recompile limit. Re-running on the same device and day merges rows into the same
file (a new measurement of the same key replaces the old one), so the grid can be measured in
parts; the file is rewritten after every shape, so a run stopped by a time limit keeps what it
measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import re
import sys
import tempfile
from pathlib import Path

import torch

# This checkout's normswap, also where another copy is installed (a second clone, a worktree): a
# script measures the kernels of the tree it is in.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from normswap import jsonsafe  # noqa: E402
from normswap.dtypes import DTYPES, RUN_DTYPES  # noqa: E402
from normswap.fileio import write_text_atomic  # noqa: E402

# The case, the timer and the grid are the library's (the launch tuner times with them too).
from normswap.kernels.timing import (  # noqa: E402
    HIDDEN,
    ROWS,
    SMALL_SHAPE,
    first_line,
    fits,
    l2_bytes,
    make_case,
    time_us,
)

RESULTS = Path(__file__).resolve().parent / "results"
# Backends whose kernels only take CUDA tensors: never part of a CPU dry run.
CUDA_ONLY = ("liger", "quack")
# The distribution each backend comes from, for the per-file versions.
PACKAGES = {"triton": "triton", "torch": "torch", "compile": "torch", "liger": "liger-kernel",
            "quack": "quack-kernels", "reference": "normswap"}
ROW_KEY = ("op", "pass", "dtype", "M", "N", "residual", "impl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="rms_norm,layer_norm", help="comma list (default rms_norm,layer_norm)")
    p.add_argument("--passes", default="fwd,fwd+bwd", help="comma list (default fwd,fwd+bwd)")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma list (default bf16,fp32)")
    p.add_argument("--impls", default=None, help="comma list; default: every available backend")
    p.add_argument("--rows", default=None, help="comma list of row counts (default 4096,32768)")
    p.add_argument("--hidden", default=None, help="comma list of hidden sizes (default 1024..262144)")
    p.add_argument("--no-small", action="store_true", help="leave out the 512x4096 shape")
    p.add_argument("--residual", action="store_true",
                   help="time the fused residual add + norm, norm(x + residual) and h = x + residual, "
                        "instead of the plain norm (rows keep both apart: residual true/false)")
    p.add_argument("--timing", choices=("graph", "events"), default="graph",
                   help="CUDA-graph replays (default; host overhead excluded) or CUDA events")
    p.add_argument("--casting", default="gemma",
                   help="rms casting mode; gemma with offset 0 is one fp32 product and one cast, the "
                        "arithmetic every backend runs natively")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<device>-<date>.json)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: plumbing check only")
    return p.parse_args(argv)


def csv(s, cast=str):
    return [cast(v) for v in s.split(",") if v.strip()]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ----------------------------------------------------------------------------------------------
# Provenance


def package_versions(impls) -> dict[str, str | None]:
    out = {}
    for impl in impls:
        try:
            out[impl] = importlib.metadata.version(PACKAGES.get(impl, impl))
        except importlib.metadata.PackageNotFoundError:
            out[impl] = None
    return out


# ----------------------------------------------------------------------------------------------
# Timing


def copy_bandwidth(device: str, timing: str) -> float:
    """GB/s of a large device-to-device copy (read + write)."""
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        nbytes = int(min(1 << 30, free // 4))
    else:
        nbytes = 1 << 24
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), device, timing, reps=5)
    return 2 * nbytes / (us * 1e-6) / 1e9


# ----------------------------------------------------------------------------------------------
# Cases


def shapes(args):
    rows = csv(args.rows, int) if args.rows else list(ROWS)
    hidden = csv(args.hidden, int) if args.hidden else list(HIDDEN)
    out = [(m, n) for m in rows for n in hidden]
    if not args.no_small and SMALL_SHAPE not in out:
        out.insert(0, SMALL_SHAPE)
    return out


# ----------------------------------------------------------------------------------------------
# Output


def print_table(rows, impls, copy_gbs, file=sys.stdout):
    """One line per (op, pass, dtype, M, N, residual); per backend: us and % of copy bandwidth."""
    key = lambda r: (r["op"], r["pass"], r["dtype"], r["M"], r["N"], r["residual"])  # noqa: E731
    grouped: dict = {}
    for r in rows:
        grouped.setdefault(key(r), {})[r["impl"]] = r
    head = (f"{'op':<10} {'pass':<7} {'dtype':<5} {'M':>6} {'N':>7} {'res':<3} | "
            + " | ".join(f"{i:>17}" for i in impls))
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s   cells: time in us (GB/s as % of copy)", file=file)
    print(head, file=file)
    print("-" * len(head), file=file)
    for k in sorted(grouped):
        cells = []
        for impl in impls:
            r = grouped[k].get(impl)
            if r is None:
                cells.append(f"{'-':>17}")
            elif "skip" in r:
                cells.append(f"{r['skip'].split(':')[0][:17]:>17}")
            else:
                cells.append(f"{r['us']:>10.1f} ({100 * r['gbs'] / copy_gbs:>3.0f}%)")
        print(f"{k[0]:<10} {k[1]:<7} {k[2]:<5} {k[3]:>6} {k[4]:>7} {'yes' if k[5] else 'no':<3} | "
              + " | ".join(cells), file=file)


def read_previous(path: Path) -> dict | None:
    """The document an earlier run left at path, None when there is none; ValueError with the
    reason when the file there is not one this script wrote (asked before anything is measured:
    --out MODEL/config.json must not be replaced by the rows, nor a malformed file found only when
    the first shape's rows are written)."""
    if not path.exists():
        return None
    try:
        doc = jsonsafe.read(path)
    except OSError as e:
        raise ValueError(e.strerror or e.__class__.__name__) from None
    except ValueError as e:
        raise ValueError(f"malformed JSON: {e}") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("rows"), list) and all(isinstance(r, dict) for r in doc["rows"])):
        raise ValueError("no list of result rows")
    return doc


def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    """Merge into an existing file of the same device (same key replaces), write atomically."""
    key = lambda r: tuple(r.get(k) for k in ROW_KEY)  # noqa: E731
    keep = list(rows)
    old = read_previous(path)
    if old is not None and old.get("device") == meta["device"]:
        fresh = {key(r) for r in keep}
        keep = [r for r in old["rows"] if key(r) not in fresh] + keep
    doc = dict(meta, rows=sorted(keep, key=lambda r: tuple(str(v) for v in key(r))))
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    # The short names only (RUN_DTYPES): rows are keyed by the name as given, and merge with the
    # rows of earlier runs by it.
    unknown = [d for d in csv(args.dtypes) if d not in RUN_DTYPES]
    if unknown:
        print(f"benchmarks/kernels.py: unknown dtype {unknown[0]!r}; choose from {', '.join(RUN_DTYPES)}",
              file=sys.stderr)
        return 2
    dtypes = {d: DTYPES[d] for d in csv(args.dtypes)}
    if args.dry_run:
        device = "cpu"
        args.rows = args.rows or "4,8"
        args.hidden = args.hidden or "16,48"
        args.no_small = True
    elif not torch.cuda.is_available():
        print("benchmarks/kernels.py: no CUDA device here; it measures GPU bandwidth "
              "(use --dry-run for a CPU plumbing check)", file=sys.stderr)
        return 2
    else:
        device = "cuda"

    import triton  # after normswap's TRITON_INTERPRET decision (normswap.backends imports normswap first)

    from normswap.backends import available_backends, get_backend

    avail = available_backends()
    if args.dry_run:
        for name in CUDA_ONLY:
            avail[name] = avail.get(name) or "its kernels take CUDA tensors only (not part of a --dry-run)"
    if args.impls:
        impls = csv(args.impls)
        bad = [i for i in impls if avail.get(i, "unknown backend") is not None]
        if bad:
            print("benchmarks/kernels.py: " + "; ".join(f"{i}: {avail.get(i, 'unknown backend')}" for i in bad),
                  file=sys.stderr)
            return 2
    else:
        impls = [n for n, why in avail.items() if why is None]
        if args.dry_run:
            impls = [i for i in impls if i != "compile"]  # inductor on CPU: ~30 s per graph
        for n, why in avail.items():
            if why is not None:
                print(f"  (backend {n} not measured: {why})", file=sys.stderr)
    backends = {i: get_backend(i) for i in impls}
    dynamo = None
    if "compile" in impls:
        from torch import _dynamo as dynamo

        # Static shapes, compiled afresh per case (reset below): a graph made dynamic by the
        # previous shapes would time a generic kernel, and a static recompile per shape would run
        # into dynamo's recompile limit.
        dynamo.config.automatic_dynamic_shapes = False

    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu-dry-run"
    timing = args.timing if device == "cuda" else "host"
    copy_gbs = copy_bandwidth(device, args.timing)
    l2 = l2_bytes(device)
    from normswap._version import git_commit
    from normswap.kernels import _common, launch_table

    # The interpreter never reads the table (its own tiles).
    arch = _common.device_arch(torch.device("cuda", torch.cuda.current_device())) if device == "cuda" else "interpreter"
    user_table = launch_table.user_path()
    meta = {"device": device_name, "torch": torch.__version__, "triton": triton.__version__,
            "commit": git_commit(), "versions": package_versions(impls), "copy_gbs": copy_gbs,
            "l2_bytes": l2, "launch_table": launch_table.stamp(arch),
            # normswap tune's table on this machine, if any: its entries measured on this device win
            "user_launch_table": None if user_table is None else launch_table.stamp(arch, user_table)}
    print(f"{device_name}: copy bandwidth {copy_gbs:.0f} GB/s", file=sys.stderr)
    if args.out:
        out = Path(args.out)
    elif args.dry_run:  # results/ holds GPU measurements only
        out = Path(tempfile.gettempdir()) / "normswap-kernels-dry-run.json"
    else:
        out = RESULTS / f"{slug(device_name)}-{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}.json"

    try:
        read_previous(out)
    except ValueError as e:
        print(f"benchmarks/kernels.py: {out} exists and is not a kernel benchmark result ({e}); write elsewhere "
              "(--out)", file=sys.stderr)
        return 2
    from normswap.errors import NormswapError

    reps = 3 if device == "cpu" else 0
    residuals = (True,) if args.residual else (False,)
    rows: list[dict] = []
    grid = [(op, p, dn, m, n, res) for op in csv(args.ops) for p in csv(args.passes) for dn in dtypes
            for (m, n) in shapes(args) for res in residuals]
    for i, (op, pass_, dname, m, n, res) in enumerate(grid, 1):
        dtype = dtypes[dname]
        print(f"[{i}/{len(grid)}] {op} {pass_} {dname} {m}x{n}{' +residual' if res else ''}", file=sys.stderr)
        for impl in impls:
            row = {"op": op, "pass": pass_, "dtype": dname, "M": m, "N": n, "residual": res, "impl": impl,
                   "casting": args.casting if op == "rms_norm" else None, "timing": timing}
            if not fits(m, n, dtype, pass_, res, device):
                row["skip"] = "oom (skipped)"
                rows.append(row)
                continue
            fn = None
            try:
                if impl == "compile":
                    dynamo.reset()
                fn, nbytes, sets = make_case(op, pass_, backends[impl], m, n, dtype, device, args.casting, res, l2)
                us = time_us(fn, device, args.timing, reps) / sets
                row.update(us=us, gbs=nbytes / (us * 1e-6) / 1e9, bytes=nbytes, sets=sets)
            except torch.OutOfMemoryError:
                row["skip"] = "oom"
            except NormswapError as e:
                row["skip"] = f"n/a: {str(e).splitlines()[0] if str(e) else ''}"
            except Exception as e:  # noqa: BLE001 - one backend failing one shape must not end the run
                row["skip"] = f"error: {first_line(e)}"
                print(f"  {impl} failed on {op} {pass_} {dname} {m}x{n}: {first_line(e)}", file=sys.stderr)
            finally:
                fn = None  # noqa: F841 - release the case's tensors before the next one
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
        write_json(out, meta, rows)  # after every shape: a run cut short keeps what it measured

    print_table(rows, impls, copy_gbs)
    write_json(out, meta, rows)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
