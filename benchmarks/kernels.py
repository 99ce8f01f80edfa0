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
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
ROWS = (4096, 32768)
HIDDEN = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
SMALL_SHAPE = (512, 4096)
RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
# Backends whose kernels only take CUDA tensors: never part of a CPU dry run.
CUDA_ONLY = ("liger", "quack")
# Input sets a case rotates over: enough to total ROTATE_L2 x the L2 size, at most MAX_SETS.
ROTATE_L2 = 4
MAX_SETS = 64
# The distribution each backend comes from, for the per-file versions.
PACKAGES = {"triton": "triton", "torch": "torch", "compile": "torch", "liger": "liger-kernel",
            "quack": "quack-kernels", "reference": "normswap"}
ROW_KEY = ("op", "pass", "dtype", "M", "N", "residual", "impl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="rms_norm,layer_norm")
    p.add_argument("--passes", default="fwd,fwd+bwd")
    p.add_argument("--dtypes", default="bf16,fp32")
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


def time_us(fn, device: str, timing: str, reps: int) -> float:
    """Median time of one fn() call in microseconds, by the requested method only (a failure to
    time that way propagates: the caller records it, never falls back to another method)."""
    if device != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    import triton.testing

    fn()  # compile / autotune outside the measurement
    torch.cuda.synchronize()
    if timing == "events":
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    # The capture allocates from a private pool: blocks cached by the warm-up calls would otherwise
    # stay reserved beside it and turn the largest shapes that fit into spurious OOMs.
    torch.cuda.empty_cache()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


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


def l2_bytes(device: str) -> int:
    if device == "cuda":
        return int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 50 << 20))
    return 1 << 20


# ----------------------------------------------------------------------------------------------
# Cases


def pass_bytes(op: str, pass_: str, m: int, n: int, e: int, residual: bool) -> int:
    """Bytes the pass moves as separate forward and backward kernels (see the module docstring)."""
    params = 2 if op == "layer_norm" else 1
    rows = m * n * e
    fwd = (4 if residual else 2) * rows + params * n * e             # x (+r) read, y (+h) written
    if pass_ == "fwd":
        return fwd
    # saved input + dy (+ dh) and the weight read (never the bias: its grad needs none of it),
    # dx and every parameter's grad written. With a residual, x and residual get the same gradient
    # (h = x + residual): one tensor, written once; a second copy is traffic no kernel must move.
    bwd = (4 if residual else 3) * rows + (1 + params) * n * e
    return fwd + bwd


def make_case(op, pass_, be, m, n, dtype, device, casting, residual, l2):
    """(callable over every input set, bytes per set, number of sets); allocates the tensors.

    The callable runs the case once per input set, so that consecutive runs never find their
    inputs in L2: the time of one case is the callable's time over the number of sets."""
    grad = pass_ == "fwd+bwd"
    e = torch.finfo(dtype).bits // 8
    nbytes = pass_bytes(op, pass_, m, n, e, residual)
    sets = max(1, min(MAX_SETS, math.ceil(ROTATE_L2 * l2 / nbytes)))
    if device != "cuda":
        sets = 2
    w = (1 + 0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_(grad)
    b = (0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_(grad) if op == "layer_norm" else None

    def forward(x, r):
        if op == "rms_norm":
            return be.rms_norm(x, w, 1e-6, 0.0, casting, residual=r)
        return be.layer_norm(x, w, b, 1e-5, residual=r)

    inputs = []
    for _ in range(sets):
        x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=grad)
        r = torch.randn(m, n, device=device, dtype=dtype, requires_grad=grad) if residual else None
        dy = torch.randn(m, n, device=device, dtype=dtype) if grad else None
        dh = torch.randn(m, n, device=device, dtype=dtype) if grad and residual else None
        inputs.append((x, r, dy, dh))

    if not grad:
        def run_all():
            with torch.no_grad():
                for x, r, _, _ in inputs:
                    forward(x, r)
        return run_all, nbytes, sets

    params = [t for t in (w, b) if t is not None]

    def run_all():
        for x, r, dy, dh in inputs:
            out = forward(x, r)
            if r is None:
                torch.autograd.grad(out, (x, *params), dy)
            else:
                torch.autograd.grad(out, (x, r, *params), (dy, dh))
    return run_all, nbytes, sets


def shapes(args):
    rows = csv(args.rows, int) if args.rows else list(ROWS)
    hidden = csv(args.hidden, int) if args.hidden else list(HIDDEN)
    out = [(m, n) for m in rows for n in hidden]
    if not args.no_small and SMALL_SHAPE not in out:
        out.insert(0, SMALL_SHAPE)
    return out


def fits(m, n, dtype, pass_, residual, device) -> bool:
    """Cheap pre-check: one input set's own tensors (x, y, +dy, dx; with a residual also r, h, dh,
    dr) must fit."""
    if device != "cuda":
        return True
    tensors = (2 if pass_ == "fwd" else 4) * (2 if residual else 1)
    free, _ = torch.cuda.mem_get_info()
    return tensors * m * n * (torch.finfo(dtype).bits // 8) < 0.9 * free


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


def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    """Merge into an existing file of the same device (same key replaces), write atomically."""
    key = lambda r: tuple(r.get(k) for k in ROW_KEY)  # noqa: E731
    keep = list(rows)
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("device") == meta["device"]:
            fresh = {key(r) for r in keep}
            keep = [r for r in old.get("rows", []) if key(r) not in fresh] + keep
    doc = dict(meta, rows=sorted(keep, key=lambda r: tuple(str(v) for v in key(r))))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
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
    try:
        dtypes = {d: DTYPES[d] for d in csv(args.dtypes)}
    except KeyError as e:
        print(f"benchmarks/kernels.py: unknown dtype {e}; choose from {', '.join(DTYPES)}", file=sys.stderr)
        return 2

    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu-dry-run"
    timing = args.timing if device == "cuda" else "host"
    copy_gbs = copy_bandwidth(device, args.timing)
    l2 = l2_bytes(device)
    from normswap._version import git_commit  # here: __main__ puts the checkout on sys.path first
    from normswap.kernels import _common, launch_table

    # The interpreter never reads the table (its own tiles).
    arch = _common.device_arch(torch.device("cuda", torch.cuda.current_device())) if device == "cuda" else "interpreter"
    meta = {"device": device_name, "torch": torch.__version__, "triton": triton.__version__,
            "commit": git_commit(), "versions": package_versions(impls), "copy_gbs": copy_gbs,
            "l2_bytes": l2, "launch_table": launch_table.stamp(arch)}
    print(f"{device_name}: copy bandwidth {copy_gbs:.0f} GB/s", file=sys.stderr)
    if args.out:
        out = Path(args.out)
    elif args.dry_run:  # results/ holds GPU measurements only
        out = Path(tempfile.gettempdir()) / "normswap-kernels-dry-run.json"
    else:
        out = RESULTS / f"{slug(device_name)}-{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}.json"

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
    sys.path.insert(0, str(ROOT))
    import normswap  # noqa: F401 - decides TRITON_INTERPRET before anything imports triton
    raise SystemExit(main())
