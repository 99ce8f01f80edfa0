"""Norm kernel benchmark: every available backend side by side, against the device's copy bandwidth.

    python benchmarks/kernels.py                      # full grid on the CUDA device, JSON to benchmarks/results/
    python benchmarks/kernels.py --ops rms_norm --dtypes bf16 --passes fwd
    python benchmarks/kernels.py --dry-run            # tiny CPU shapes: checks the plumbing, measures nothing useful

Measures the device copy bandwidth first (dst.copy_(src), bytes read + written), then forward and
forward+backward of rms_norm and layer_norm for each backend, bf16 and fp32, rows {4096, 32768} x
hidden {1024 .. 262144} plus 512 x 4096. GPU times come from CUDA-graph replays (triton's
do_bench_cudagraph), so host overhead is not counted; a backend whose launch cannot be captured is
timed with CUDA events instead (marked `~` in the table).

GB/s counts the minimal bytes of a pass (each input read once, each output written once):
    fwd      x + weight (+ bias) read, y written
    fwd+bwd  the fwd bytes plus dy read and dx, dweight (+ dbias) written (x and weight count once)
Shapes that do not fit in device memory for a pass/dtype/backend are skipped and marked `oom`;
combinations a backend refuses (e.g. quack's LayerNorm has no backward) are marked `n/a`; any other
failure of one backend on one shape (e.g. Liger refusing rows wider than 65,536) is marked `error`,
its message goes to stderr, and the run goes on. The `compile` backend is compiled afresh, with
static shapes, for every shape (dynamo reset per case): inductor's best case, and no recompile limit.
The JSON schema:
    {"device", "torch", "triton", "copy_gbs", "rows": [{"op", "pass", "dtype", "M", "N", "impl", "us", "gbs"}]}
Re-running on the same device and day merges rows into the same file (a new measurement of the
same op/pass/dtype/shape/impl replaces the old one), so the grid can be measured in parts; the file
is rewritten after every shape, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
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
# Backends whose kernels only take CUDA tensors: never part of a CPU dry run.
CUDA_ONLY = ("liger", "quack")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="rms_norm,layer_norm")
    p.add_argument("--passes", default="fwd,fwd+bwd")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--impls", default=None, help="comma list; default: every available backend")
    p.add_argument("--rows", default=None, help="comma list of row counts (default 4096,32768)")
    p.add_argument("--hidden", default=None, help="comma list of hidden sizes (default 1024..262144)")
    p.add_argument("--no-small", action="store_true", help="leave out the 512x4096 shape")
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
# Timing


def time_us(fn, device: str, reps: int) -> tuple[float, bool]:
    """Mean time of one fn() call in microseconds, and whether CUDA-graph replay timed it."""
    if device != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6, False
    import triton.testing

    fn()  # compile / autotune outside the measurement
    torch.cuda.synchronize()
    # The capture allocates from a private pool: blocks cached by the warm-up calls would otherwise
    # stay reserved beside it and turn the largest shapes that fit into spurious OOMs.
    torch.cuda.empty_cache()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3, True
    except Exception:  # noqa: BLE001 - not capturable (or no room for the capture's pool): fall back
        # to events (host overhead included); an OOM there too is a real one and propagates.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3, False


def copy_bandwidth(device: str) -> float:
    """GB/s of a large device-to-device copy (read + write)."""
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        nbytes = int(min(1 << 30, free // 4))
    else:
        nbytes = 1 << 24
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us, _ = time_us(lambda: dst.copy_(src), device, reps=5)
    return 2 * nbytes / (us * 1e-6) / 1e9


# ----------------------------------------------------------------------------------------------
# Cases


def make_case(op, pass_, be, m, n, dtype, device, casting):
    """(callable, minimal bytes) for one measurement; allocates its tensors."""
    grad = pass_ == "fwd+bwd"
    e = torch.finfo(dtype).bits // 8
    x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=grad)
    w = (1 + 0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_(grad)
    b = (0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_(grad) if op == "layer_norm" else None
    params = 1 if b is None else 2
    fwd_bytes = 2 * m * n * e + params * n * e
    if op == "rms_norm":
        def forward():
            return be.rms_norm(x, w, 1e-6, 0.0, casting)
    else:
        def forward():
            return be.layer_norm(x, w, b, 1e-5)
    if not grad:
        def run():
            with torch.no_grad():
                return forward()
        return run, fwd_bytes
    dy = torch.randn(m, n, device=device, dtype=dtype)
    inputs = (x, w) if b is None else (x, w, b)

    def run_fwd_bwd():
        return torch.autograd.grad(forward(), inputs, dy)
    # The rule, each input read once and each output written once over the whole pass:
    # x and the params are already counted in fwd_bytes; the backward adds dy read, dx and grads written.
    bwd_bytes = 2 * m * n * e + params * n * e
    return run_fwd_bwd, fwd_bytes + bwd_bytes


def shapes(args):
    rows = csv(args.rows, int) if args.rows else list(ROWS)
    hidden = csv(args.hidden, int) if args.hidden else list(HIDDEN)
    out = [(m, n) for m in rows for n in hidden]
    if not args.no_small and SMALL_SHAPE not in out:
        out.insert(0, SMALL_SHAPE)
    return out


def fits(m, n, dtype, pass_, device) -> bool:
    """Cheap pre-check: the pass's own tensors (x, y; plus dy, dx for the backward) must fit."""
    if device != "cuda":
        return True
    tensors = 2 if pass_ == "fwd" else 5
    free, _ = torch.cuda.mem_get_info()
    return tensors * m * n * (torch.finfo(dtype).bits // 8) < 0.9 * free


# ----------------------------------------------------------------------------------------------
# Output


def print_table(rows, impls, copy_gbs, file=sys.stdout):
    """One line per (op, pass, dtype, M, N); per backend: us and % of copy bandwidth."""
    key = lambda r: (r["op"], r["pass"], r["dtype"], r["M"], r["N"])  # noqa: E731
    grouped: dict = {}
    for r in rows:
        grouped.setdefault(key(r), {})[r["impl"]] = r
    head = f"{'op':<10} {'pass':<7} {'dtype':<5} {'M':>6} {'N':>7} | " + " | ".join(f"{i:>17}" for i in impls)
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
                cells.append(f"{r['skip']:>17}")
            else:
                mark = "" if r.get("graph", True) else "~"
                cells.append(f"{mark}{r['us']:>9.1f} ({100 * r['gbs'] / copy_gbs:>3.0f}%)")
        print(f"{k[0]:<10} {k[1]:<7} {k[2]:<5} {k[3]:>6} {k[4]:>7} | " + " | ".join(cells), file=file)


def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    """Merge into an existing file of the same device (same key replaces), write atomically."""
    keep = [{k: r[k] for k in ("op", "pass", "dtype", "M", "N", "impl", "us", "gbs")} for r in rows if "skip" not in r]
    key = lambda r: (r["op"], r["pass"], r["dtype"], r["M"], r["N"], r["impl"])  # noqa: E731
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("device") == meta["device"]:
            fresh = {key(r) for r in keep}
            keep = [r for r in old.get("rows", []) if key(r) not in fresh] + keep
    doc = dict(meta, rows=sorted(keep, key=key))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


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
    copy_gbs = copy_bandwidth(device)
    meta = {"device": device_name, "torch": torch.__version__, "triton": triton.__version__, "copy_gbs": copy_gbs}
    print(f"{device_name}: copy bandwidth {copy_gbs:.0f} GB/s", file=sys.stderr)
    if args.out:
        out = Path(args.out)
    elif args.dry_run:  # results/ holds GPU measurements only
        out = Path(tempfile.gettempdir()) / "normswap-kernels-dry-run.json"
    else:
        out = RESULTS / f"{slug(device_name)}-{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}.json"

    from normswap.errors import NormswapError

    reps = 3 if device == "cpu" else 0
    rows: list[dict] = []
    grid = [(op, p, dn, m, n) for op in csv(args.ops) for p in csv(args.passes) for dn in dtypes
            for (m, n) in shapes(args)]
    for i, (op, pass_, dname, m, n) in enumerate(grid, 1):
        dtype = dtypes[dname]
        print(f"[{i}/{len(grid)}] {op} {pass_} {dname} {m}x{n}", file=sys.stderr)
        for impl in impls:
            row = {"op": op, "pass": pass_, "dtype": dname, "M": m, "N": n, "impl": impl}
            if not fits(m, n, dtype, pass_, device):
                row["skip"] = "oom (skipped)"
                rows.append(row)
                continue
            try:
                if impl == "compile":
                    dynamo.reset()
                fn, nbytes = make_case(op, pass_, backends[impl], m, n, dtype, device, args.casting)
                us, graphed = time_us(fn, device, reps)
                row.update(us=us, gbs=nbytes / (us * 1e-6) / 1e9, graph=graphed)
            except torch.OutOfMemoryError:
                row["skip"] = "oom"
            except NormswapError:
                row["skip"] = "n/a"
            except Exception as e:  # noqa: BLE001 - one backend failing one shape must not end the run
                row["skip"] = "error"
                print(f"  {impl} failed on {op} {pass_} {dname} {m}x{n}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
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
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import normswap  # noqa: F401 - decides TRITON_INTERPRET before anything imports triton
    raise SystemExit(main())
