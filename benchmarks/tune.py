"""Measure the launch table (normswap/kernels/launch_table.json) on a CUDA device.

    python benchmarks/tune.py                                   # every key of the benchmark grid
    python benchmarks/tune.py --ops rms_norm --dtypes bf16 --passes fwd --hidden 4096,65536
    python benchmarks/tune.py --budget 240 --out OUT/table.json --report OUT/tune.md --commit SHA

For each key of the benchmark grid (op, pass, dtype, hidden size, row-count bucket: the shapes of
benchmarks/kernels.py, rows 4096 and 32768 in the bucket of many rows, 512 x 4096 in the bucket
of few), in priority order (bf16 before fp32, rms_norm before layer_norm, forward before backward,
the grid's hidden sizes in order):
1. candidates: the static heuristics' tile first (the baseline), then its neighbours: half and
   twice the tile, half and twice the warps, the backward's pipelining depth one less and one
   more, and across the whole-row / split-row boundary the other layout (`candidates`);
2. the static check: each candidate is planned and compiled for sm_90 exactly as
   benchmarks/kernel_static.py checks the committed table (kernel_static.check_tile: the timed
   variant and the same with the fused residual; no spills, 16-byte row accesses, split rows
   co-resident); compiles run in parallel worker processes;
3. agreement: its outputs (y; for the backward dx, dweight, dbias) on random inputs equal the
   baseline's within a few units in the last place of the dtype (a different tile changes the
   reduction order, never the result beyond rounding);
4. timing: benchmarks/kernels.py's own case and timer (CUDA-graph replays, rotating input sets of
   >= 4x the L2 size) at each of the key's row counts; "bwd" keys time forward + backward with
   the forward's tile fixed;
5. the winner: the lowest geometric mean of (time / baseline time) over the row counts, taken
   only when it beats the baseline by more than MIN_GAIN (so noise never moves a choice); the
   runner-up is kept in the entry.

The table is rewritten (atomically) after every key, as is the markdown report of winners against
the static choice, so a run stopped by its time limit keeps every key it finished; keys already in
the table for this GPU's architecture are skipped (--retune measures them again). Needs a CUDA
device: elsewhere it exits 2 with one line and writes nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import math
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import kernel_static  # noqa: E402  (benchmarks/kernel_static.py)
import kernels as kernel_bench  # noqa: E402  (benchmarks/kernels.py)

# A candidate replaces the baseline only when faster by more than this (geometric mean over the
# key's row counts): timing noise must not move a launch choice, and with it the output's bits.
MIN_GAIN = 0.02
# Keys are not started with less time left than this (a guess: no key has been timed on a GPU yet;
# a key cut by the budget is simply not written).
MIN_KEY_S = 25.0
# Worker processes of the static check (compiles for sm_90 and ptxas runs; CPU only).
STATIC_WORKERS = 8
# The agreement rule's bound on y and dx, in units in the last place of the dtype: a different
# reduction order moves a result by an ulp or so; a wrong tile (rows skipped, columns mixed) by O(1).
AGREE_ULPS = 4
# Row counts the agreement check runs at (at most this, within the key's bucket: agree_rows).
AGREE_ROWS = 512


def bucket_label(m: int) -> str:
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T

    return T.bucket_labels(C.ROW_BUCKETS)[C.row_bucket(m)]


def grid_keys(ops, passes, dtypes, hidden=None) -> list[dict]:
    """The benchmark grid's table keys in priority order, each with the grid's row counts in its
    bucket: {"op", "pass", "dtype", "hidden", "rows", "row_counts"}. The bucket of many rows comes
    before that of few (only 512 x 4096 is in it), hidden sizes in the grid's order."""
    from normswap.kernels import launch_table as T

    shapes = [(m, n) for m in kernel_bench.ROWS for n in kernel_bench.HIDDEN] + [kernel_bench.SMALL_SHAPE]
    if hidden:
        shapes = [(m, n) for m, n in shapes if n in hidden]
    labels = sorted({bucket_label(m) for m, _ in shapes}, key=lambda s: s.startswith("<="))
    ns = sorted({n for _, n in shapes})
    out = []
    for dtype in dtypes:
        for op in ops:
            for pass_ in passes:
                for label in labels:
                    for n in ns:
                        ms = sorted(m for m, n2 in shapes if n2 == n and bucket_label(m) == label)
                        if ms:
                            out.append({"op": op, "pass": pass_, "dtype": dtype, "hidden": T.hidden_bucket(n),
                                        "rows": label, "row_counts": ms})
    return out


def agree_rows(row_counts) -> int:
    """Rows the agreement check runs at: few (at most AGREE_ROWS) but inside the bucket of the key's
    row counts. A forced tile answers only for row counts in its own bucket; checked at a count of
    another bucket, both runs would use the heuristics' tile and any candidate would agree."""
    from normswap.kernels import _common as C

    smallest = min(row_counts)
    b = C.row_bucket(smallest)
    return max(min(smallest, AGREE_ROWS), C.ROW_BUCKETS[b - 1] + 1 if b > 0 else 1)


def candidates(pass_: str, dtype: str, hidden: int, m: int) -> list[dict]:
    """Tiles to try for one key, the static heuristics' first. Every tile is valid for the table
    (launch_table.tile_problems) and keeps at least one 16-byte vector of the row tile per thread;
    whether it spills or is too wide to be co-resident is the static check's to say."""
    from normswap.dtypes import DTYPES
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T

    eb = DTYPES[dtype].itemsize
    base = C.heuristic_config(m, hidden, DTYPES[dtype], pass_)
    out = [C.tile_fields(base)]

    def add(block_m, block_n, warps, stages):
        t = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}
        # Each thread holds at least one 16-byte vector of the tile, and at most 32 warps a program.
        if not 1 <= warps <= 32 or block_m * block_n * eb < warps * 32 * 16:
            return
        if T.tile_problems(t, hidden) or t in out:
            return
        out.append(t)

    whole_limit = C.MAX_BLOCK_N if pass_ == "fwd" else C.MAX_BLOCK_N // 2
    if base.chunks == 1:
        elems = base.block_m * base.block_n
        for e in (elems, elems // 2, elems * 2):
            block_m = e // hidden
            if 1 <= block_m <= 256:
                for w in (base.num_warps, base.num_warps // 2, base.num_warps * 2):
                    add(block_m, hidden, w, base.num_stages)
        if pass_ == "bwd":
            for s in (base.num_stages - 1, base.num_stages + 1):
                if s >= 1:
                    add(base.block_m, hidden, base.num_warps, s)
        if hidden >= whole_limit:  # at the boundary: the row split in two and in four
            for chunk in (hidden // 2, hidden // 4):
                add(1, chunk, C.SPLIT_WARPS[pass_], base.num_stages)
    else:
        for chunk in (base.block_n, base.block_n // 2, base.block_n * 2):
            if 1024 <= chunk < hidden:
                for w in (base.num_warps, base.num_warps // 2, base.num_warps * 2):
                    add(1, chunk, w, base.num_stages)
        if hidden <= 2 * whole_limit:  # one program per row, the whole row in its registers
            for w in (16, 32):
                add(1, hidden, w, base.num_stages)
    return out


def static_problems(key: tuple, tile: dict) -> list[str]:
    """kernel_static's verdict on one candidate (planned for sm_90, where the static analysis
    compiles, whatever GPU is timing): the distinct problems over its variants and launches."""
    from normswap.kernels import _common as C

    with tempfile.TemporaryDirectory() as tmp:
        rows = kernel_static.check_tile((C.PLAN_ARCH, *key[1:]), tile, Path(tmp))
    return sorted({p for r in rows for p in r["problems"]})


def score(us: dict, base_us: dict) -> float:
    """Geometric mean of time / baseline time over the row counts both were timed at."""
    common = [m for m in us if m in base_us]
    if not common:
        return math.inf
    return math.exp(sum(math.log(us[m] / base_us[m]) for m in common) / len(common))


def select(trials: list[dict]) -> tuple[dict | None, dict | None]:
    """(winner, runner-up) among timed trials; trials[0] is the baseline. A candidate wins only
    when its score beats the baseline's by more than MIN_GAIN; the runner-up is the best of the
    rest (None when nothing else was timed)."""
    timed = [t for t in trials if t.get("us")]
    if not trials or not trials[0].get("us"):
        return None, None
    base = trials[0]
    ranked = sorted(timed, key=lambda t: score(t["us"], base["us"]))
    best = ranked[0]
    winner = best if best is not base and score(best["us"], base["us"]) < 1 - MIN_GAIN else base
    rest = [t for t in ranked if t is not winner]
    return winner, (rest[0] if rest else None)


def tune_key(key: tuple, row_counts: list[int], tiles: list[dict], static_check, measure, outputs, agree,
             deadline: float = math.inf, log=print) -> tuple[dict | None, list[dict]]:
    """Tune one key. `static_check(tiles) -> [problems per tile]`, `measure(tile, m) -> us`,
    `outputs(tile) -> tensors`, `agree(outs, ref_outs) -> None or why not`: injected, so that the
    selection is testable without a GPU. Returns (the winner's launch-table fields: tile, us,
    static, runner_up; or None) and one trial record per candidate for the report."""
    trials = [{"tile": t, "us": {}, "why": None} for t in tiles]
    for t, probs in zip(trials, static_check(tiles), strict=True):
        if probs and t is not trials[0]:
            t["why"] = "static: " + "; ".join(probs)
    ref = None
    for t in trials:
        if t["why"]:
            continue
        if time.monotonic() > deadline:
            t["why"] = "not measured (time limit)"
            continue
        try:
            outs = outputs(t["tile"])
            if ref is None:
                ref = outs  # trials[0]: the baseline
            else:
                why = agree(outs, ref)
                if why:
                    t["why"] = f"output differs from the baseline's: {why}"
                    continue
            for m in row_counts:
                t["us"][m] = measure(t["tile"], m)
        except Exception as e:  # noqa: BLE001 - one candidate failing must not end the key
            t["why"] = f"error: {kernel_bench.first_line(e)}"
            t["us"] = {}
        log(f"  {fmt_tile(t['tile'])}: " + (t["why"] or ", ".join(f"{m} rows {us:.1f} us" for m, us in t["us"].items())))
        if t is trials[0] and not t["us"]:
            break  # no baseline: nothing can be compared with it
    winner, runner_up = select(trials)
    if winner is None or any(t["why"] == "not measured (time limit)" for t in trials):
        return None, trials  # a key cut short is left to a later run, never chosen from part of its candidates
    return {"tile": winner["tile"], "us": _us(winner), "static": {"tile": trials[0]["tile"], "us": _us(trials[0])},
            "runner_up": None if runner_up is None else {"tile": runner_up["tile"], "us": _us(runner_up)}}, trials


def _us(trial: dict) -> dict:
    return {str(m): round(us, 3) for m, us in trial["us"].items()}


def fmt_tile(t: dict) -> str:
    return f"{t['block_m']}x{t['block_n']} w{t['num_warps']} s{t['num_stages']}"


# ----------------------------------------------------------------------------------------------
# The GPU side: inputs, outputs, timing.


def make_inputs(op: str, pass_: str, dtype: str, m: int, n: int, seed: int = 0, device: str = "cuda"):
    import torch

    from normswap.dtypes import DTYPES

    g = torch.Generator(device=device).manual_seed(seed)
    dt_ = DTYPES[dtype]
    grad = pass_ == "bwd"
    x = torch.randn(m, n, device=device, generator=g).to(dt_).requires_grad_(grad)
    w = (1 + 0.1 * torch.randn(n, device=device, generator=g)).to(dt_).requires_grad_(grad)
    b = (0.1 * torch.randn(n, device=device, generator=g)).to(dt_).requires_grad_(grad) if op == "layer_norm" else None
    dy = torch.randn(m, n, device=device, generator=g).to(dt_) if grad else None
    return x, w, b, dy


def gpu_outputs(key: tuple, tile: dict, m: int, device: str = "cuda") -> list:
    """y (and dx, dweight, dbias for the backward) of the key's plain variant with `tile` forced.
    (device "cpu": the interpreter, which never reads the table; the CPU tests' plumbing check.)"""
    import torch

    from normswap.backends import get_backend
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T

    arch, op, pass_, dtype, hidden, _ = key
    be = get_backend("triton")
    x, w, b, dy = make_inputs(op, pass_, dtype, m, hidden, device=device)
    with T.forced(key, tile, C.ROW_BUCKETS):
        y = be.rms_norm(x, w, 1e-6, 0.0, "gemma") if op == "rms_norm" else be.layer_norm(x, w, b, 1e-5)
        outs = [y.detach()]
        if pass_ == "bwd":
            outs += list(torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy))
    if device == "cuda":
        torch.cuda.synchronize()
    return outs


def gpu_agree(dtype: str):
    """The agreement rule: y and dx within AGREE_ULPS units in the last place of the dtype (relative
    to the element, plus the same absolutely: elements near zero), parameter grads (sums over every row,
    accumulated in fp32 in a different order) within 1e-3 of their largest magnitude."""
    import torch

    from normswap.dtypes import DTYPES

    ulp = torch.finfo(DTYPES[dtype]).eps

    def agree(outs, ref) -> str | None:
        for i, (a, r) in enumerate(zip(outs, ref, strict=True)):
            a, r = a.float(), r.float()
            if not torch.isfinite(a).all():
                return f"output {i} has non-finite values"
            if i < 2:
                bad = ((a - r).abs() > AGREE_ULPS * ulp * (1 + r.abs())).sum().item()
                if bad:
                    return f"output {i}: {bad} elements off by more than {AGREE_ULPS} ulp"
            else:
                err = (a - r).abs().max().item() / max(r.abs().max().item(), 1e-30)
                if err > 1e-3 + 2 * ulp:
                    return f"parameter grad {i - 2}: relative error {err:.2e}"
        return None
    return agree


def gpu_measure(key: tuple, tile: dict, m: int, l2: int, device: str = "cuda") -> float:
    """µs of one case (kernels.py's make_case and time_us: CUDA graphs, rotating inputs). (device
    "cpu": host timing through the interpreter, for the CPU tests' plumbing check only.)"""
    import torch

    from normswap.backends import get_backend
    from normswap.dtypes import DTYPES
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T

    arch, op, pass_, dtype, hidden, _ = key
    bench_pass = "fwd" if pass_ == "fwd" else "fwd+bwd"
    if not kernel_bench.fits(m, hidden, DTYPES[dtype], bench_pass, False, device):
        raise MemoryError(f"{m} x {hidden} does not fit in device memory")
    with T.forced(key, tile, C.ROW_BUCKETS):
        fn, _, sets = kernel_bench.make_case(op, bench_pass, get_backend("triton"), m, hidden, DTYPES[dtype], device,
                                             "gemma", False, l2)
        try:
            return kernel_bench.time_us(fn, device, "graph", 1) / sets
        finally:
            fn = None  # noqa: F841 - release the case's tensors
            if device == "cuda":
                torch.cuda.empty_cache()


def parallel_static(key: tuple, pool):
    def check(tiles):
        return list(pool.map(static_problems, [key] * len(tiles), tiles))
    return check


# ----------------------------------------------------------------------------------------------
# Output


def report(path: Path, meta: dict, done: list[dict]) -> None:
    """Markdown: per key the static choice and the winner with their times, the runner-up, and
    every candidate that was rejected and why."""
    lines = [f"# Launch-table tuning: {meta['device']}", "",
             f"{meta['date']}, commit {meta['commit']}, {meta['arch']}, torch {meta['torch']}, triton {meta['triton']}. "
             "Times: benchmarks/kernels.py's cases (CUDA-graph replays, rotating inputs), µs per call; `bwd` keys "
             f"time forward + backward. A candidate replaces the static choice only when > {MIN_GAIN:.0%} faster "
             "(geometric mean over the row counts).", "",
             "| op | pass | dtype | hidden | rows | static tile | static µs | winner | winner µs | gain | runner-up | rejected |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in done:
        k, e = d["key"], d["entry"]
        rejected = sum(1 for t in d["trials"] if t["why"])
        if e is None:
            lines.append(f"| {' | '.join(map(str, k[1:]))} | - | - | not tuned: "
                         f"{(d['trials'][0]['why'] if d['trials'] else 'no candidate')} | | | | {rejected} |")
            continue
        us = lambda u: " / ".join(f"{v:.1f}" for v in u.values())  # noqa: E731
        gain = 1 - score({int(m): v for m, v in e["us"].items()}, {int(m): v for m, v in e["static"]["us"].items()})
        ru = e["runner_up"]
        lines.append(f"| {' | '.join(map(str, k[1:]))} | {fmt_tile(e['static']['tile'])} | {us(e['static']['us'])} | "
                     f"{fmt_tile(e['tile'])} | {us(e['us'])} | {gain:+.1%} | "
                     f"{fmt_tile(ru['tile']) + ' ' + us(ru['us']) if ru else '-'} | {rejected} |")
    lines += ["", "Rejected candidates:", ""]
    for d in done:
        for t in d["trials"]:
            if t["why"]:
                lines.append(f"- {' '.join(map(str, d['key'][1:]))} {fmt_tile(t['tile'])}: {t['why'][:300]}")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="rms_norm,layer_norm")
    p.add_argument("--passes", default="fwd,bwd")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--hidden", default=None, help="comma list: only these hidden sizes of the grid")
    p.add_argument("--budget", type=float, default=540.0, help="seconds; no key starts with < 25 s left")
    p.add_argument("--out", default=None, help="table to write (default: the package's launch_table.json); "
                   "an existing file is the starting point")
    p.add_argument("--report", default=None, help="markdown report (default: next to --out, .md)")
    p.add_argument("--retune", action="store_true", help="measure keys the table already has again")
    p.add_argument("--commit", default=None, help="the commit the tree is at (no .git on a device copy)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    t0 = time.monotonic()
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/tune.py: needs a CUDA device (it times kernel launches); nothing written", file=sys.stderr)
        return 2
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T
    from normswap.kernels.rms_norm import _rms_fwd_kernel

    if C.interpreting(_rms_fwd_kernel):
        print("benchmarks/tune.py: TRITON_INTERPRET is set; unset it (the interpreter times nothing)", file=sys.stderr)
        return 2
    why = kernel_static.tools_missing()
    if why:
        print(f"benchmarks/tune.py: the static check cannot run: {why}", file=sys.stderr)
        return 2
    csv = kernel_bench.csv
    try:
        ops, passes, dtypes = csv(args.ops), csv(args.passes), csv(args.dtypes)
        hidden = csv(args.hidden, int) if args.hidden else None
        if not set(ops) <= set(T.OPS) or not set(passes) <= set(T.PASSES) or not set(dtypes) <= set(T.DTYPES):
            raise ValueError(f"ops, passes, dtypes must be among {T.OPS}, {T.PASSES}, {T.DTYPES}")
    except ValueError as e:
        print(f"benchmarks/tune.py: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else T.PATH
    report_path = Path(args.report) if args.report else out.with_suffix(".md")
    base_path = out if out.is_file() else T.PATH
    doc = T.read(base_path)
    bad = T.problems(doc, C.ROW_BUCKETS)
    if bad:
        print(f"benchmarks/tune.py: {base_path} is not a valid launch table: {bad[0]}", file=sys.stderr)
        return 2

    from normswap._version import git_commit
    from normswap.dtypes import DTYPES

    arch = C.device_arch(torch.device("cuda", torch.cuda.current_device()))
    import triton

    meta = {"device": torch.cuda.get_device_name(), "arch": arch, "date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}",
            "torch": torch.__version__, "triton": triton.__version__, "commit": args.commit or git_commit()}
    deadline = t0 + args.budget
    l2 = kernel_bench.l2_bytes("cuda")
    keys = grid_keys(ops, passes, dtypes, hidden)
    n_have = len(doc["archs"].get(arch, {}).get("entries", []))
    print(f"{meta['device']} ({arch}): {len(keys)} keys, {n_have} entries already in {base_path.name}", file=sys.stderr)

    def fits(k, m):
        bench_pass = "fwd" if k["pass"] == "fwd" else "fwd+bwd"
        return kernel_bench.fits(m, k["hidden"], DTYPES[k["dtype"]], bench_pass, False, "cuda")

    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
    with concurrent.futures.ProcessPoolExecutor(min(STATIC_WORKERS, os.cpu_count() or 1), mp_context=ctx) as pool:
        done = tune_keys(
            keys, doc, meta, out, report_path, retune=args.retune, deadline=deadline, fits=fits,
            static_check=lambda key: parallel_static(key, pool),
            measure=lambda key: lambda tile, m: gpu_measure(key, tile, m, l2),
            outputs=lambda key, m: lambda tile: gpu_outputs(key, tile, m),
            agree=gpu_agree)
    report(report_path, meta, done)
    tuned = sum(d["entry"] is not None for d in done)
    print(f"{tuned} keys tuned" + (f", written to {out}" if tuned else " (table unchanged)") + f"; report {report_path}",
          file=sys.stderr)
    return 0


def tune_keys(keys, doc, meta, out: Path, report_path: Path, *, retune, deadline, fits, static_check, measure,
              outputs, agree, log=None) -> list[dict]:
    """Tune `keys` (grid_keys) in order into `doc` for meta["arch"], rewriting the table `out`
    and the report after every key. The GPU work comes in as factories of the key (see tune_key):
    static_check(key), measure(key), outputs(key, rows), agree(dtype); fits(k, m) says whether
    m rows fit in memory. Returns what the report shows, one record per key attempted."""
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T

    log = log or (lambda s: print(s, file=sys.stderr))
    arch = meta["arch"]
    have = {tuple(e[f] for f in T.KEY_FIELDS) for e in doc["archs"].get(arch, {}).get("entries", [])}
    done: list[dict] = []
    for i, k in enumerate(keys, 1):
        kt = tuple(k[f] for f in T.KEY_FIELDS)
        if kt in have and not retune:
            continue
        if deadline - time.monotonic() < MIN_KEY_S:
            log(f"stopping: {max(deadline - time.monotonic(), 0):.0f} s left; keys from {i} of {len(keys)} not tuned")
            break
        key = (arch, *kt)
        rows = [m for m in k["row_counts"] if fits(k, m)]
        log(f"[{i}/{len(keys)}] {' '.join(map(str, kt))} (rows {rows or 'none fit in memory'})")
        if not rows:
            continue
        tiles = candidates(k["pass"], k["dtype"], k["hidden"], rows[0])
        entry, trials = tune_key(key, rows, tiles, static_check(key), measure(key),
                                 outputs(key, agree_rows(rows)), agree(k["dtype"]), deadline, log)
        done.append({"key": key, "entry": entry, "trials": trials})
        if entry is not None:
            measured = {f: meta[f] for f in ("device", "date", "torch", "triton", "commit")}
            measured.update(us=entry["us"], static=entry["static"], runner_up=entry["runner_up"])
            doc = T.merge(doc, arch, [dict(zip(T.KEY_FIELDS, kt, strict=True), tile=entry["tile"], measured=measured)])
            T.write(out, doc, C.ROW_BUCKETS)
        report(report_path, meta, done)
    return done


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as kernel_static.py compiles
    import normswap  # noqa: F401 - decides TRITON_INTERPRET before anything imports triton

    raise SystemExit(main())
