"""Measure launch tiles on the CUDA device at hand and write them into a launch table: what
`normswap tune` runs (into the user table, per machine) and benchmarks/tune.py runs (into the
committed table, on the project's GPUs).

For each key (op, pass, dtype, hidden-size bucket, row-count bucket), in priority order (bf16
before fp32, rms_norm before layer_norm, forward before backward, hidden sizes in order):
1. candidates: the static heuristics' tile first (the baseline), then its neighbours: half and
   twice the tile, half and twice the warps, the backward's pipelining depth one less and one
   more, and across the whole-row / split-row boundary the other layout (`candidates`);
2. the static check (static_check.check_tile, compiled for the timing GPU's compute capability and
   planned with its SM count and per-SM limits: the timed variant and the same with the fused
   residual; no spills, 16-byte row accesses, split rows co-resident); compiles run in parallel
   worker processes;
3. agreement: its outputs (y; for the backward dx, dweight, dbias) on random inputs equal the
   baseline's within AGREE_ULPS units in the last place of the dtype (a different tile changes the
   reduction order, never the result beyond rounding);
4. timing: the kernel benchmark's own case and timer (timing.py: CUDA-graph replays, rotating input
   sets of >= 4x the L2 size) at each of the key's row counts; "bwd" keys time forward + backward
   with the forward's tile as the tables in use give it;
5. the winner: the lowest geometric mean of (time / baseline time) over the row counts, taken
   only when it beats the baseline by more than MIN_GAIN (so noise never moves a choice); the
   runner-up is kept in the entry.

The table is rewritten (atomically, merged into the file as it is then under a lock on it, so two
tuners of one table keep each other's entries) after every key, as is a markdown report of winners against
the static choice, so a run stopped by its budget keeps every key it finished; keys the table
already has for this device are skipped (`retune` measures them again). The timing happens here,
once; launches only ever read the written file (launch_table.py: why no timing at launch time).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt
import math
import multiprocessing
import os
import re
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from normswap.errors import BadInputError, NormswapError, option_labels
from normswap.fileio import target_path, unwritable, write_text_atomic
from normswap.kernels import launch_table as T

# A candidate replaces the baseline only when faster by more than this (geometric mean over the
# key's row counts): timing noise must not move a launch choice, and with it the output's bits.
MIN_GAIN = 0.02
# Keys are not started with less time left than this (a guess: no key has been timed on a GPU yet;
# a key cut by the budget is simply not written).
MIN_KEY_S = 25.0
# Worker processes of the static check (compiles and ptxas runs; CPU only).
STATIC_WORKERS = 8
# The agreement rule's bound on y and dx, in units in the last place of the dtype: a different
# reduction order moves a result by an ulp or so; a wrong tile (rows skipped, columns mixed) by O(1).
AGREE_ULPS = 4
# Row counts the agreement check runs at (at most this, within the key's bucket: agree_rows).
AGREE_ROWS = 512
# What `tune_launches` tunes unless told otherwise.
DEFAULT_DTYPES = "bf16,fp32"  # in priority order (a comma list, as the command line gives it)
DEFAULT_BUDGET_S = 600.0
# Hidden sizes a user may ask for: the kernels' range (one row of a split-row launch is at most
# this wide in the benchmark grid).
MAX_HIDDEN = 1 << 20


def bucket_label(m: int) -> str:
    from normswap.kernels import _common as C

    return T.bucket_labels(C.ROW_BUCKETS)[C.row_bucket(m)]


def grid_keys(ops, passes, dtypes, hidden=None) -> list[dict]:
    """The table keys to tune, in priority order, each with the row counts timed in its bucket and
    the hidden size timed: {"op", "pass", "dtype", "hidden" (the bucket), "rows", "row_counts", "n"}.
    Without `hidden`: the benchmark grid (timing.py), whose bucket of few rows holds only 512 x
    4096. With `hidden` (a user's model widths, any positive sizes): each at the grid's row counts
    and at 512 rows (decode-sized batches), timed at its own width; of several sizes in one bucket
    the widest is timed. The bucket of many rows comes before that of few."""
    from normswap.kernels.timing import HIDDEN, ROWS, SMALL_SHAPE

    if hidden:
        shapes = [(m, n) for n in hidden for m in (SMALL_SHAPE[0], *ROWS)]
    else:
        shapes = [(m, n) for m in ROWS for n in HIDDEN] + [SMALL_SHAPE]
    widest: dict[int, int] = {}
    for _, n in shapes:
        widest[T.hidden_bucket(n)] = max(widest.get(T.hidden_bucket(n), 0), n)
    labels = sorted({bucket_label(m) for m, _ in shapes}, key=lambda s: s.startswith("<="))
    out = []
    for dtype in dtypes:
        for op in ops:
            for pass_ in passes:
                for label in labels:
                    for bucket in sorted(widest):
                        ms = sorted({m for m, n in shapes if T.hidden_bucket(n) == bucket and bucket_label(m) == label})
                        if ms:
                            out.append({"op": op, "pass": pass_, "dtype": dtype, "hidden": bucket, "rows": label,
                                        "row_counts": ms, "n": widest[bucket]})
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
            # Depth 1 too: triton < 3.9 drops the rows' L2 evict_first hint from pipelined copies
            # (static_check.CP_ASYNC_HINTS_SINCE), and only a timing says whether the hint or the
            # prefetch is worth more there.
            for s in sorted({1, base.num_stages - 1, base.num_stages + 1}):
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


def static_problems(key: tuple, tile: dict, target=None) -> list[str]:
    """The static check's verdict on one candidate, compiled for `target` (static_check.Target: the
    timing GPU's; default an H100): the distinct problems over its variants and launches. A check
    that fails (the compiler or ptxas refusing the tile) rejects the candidate, never the run."""
    from normswap.kernels import _common as C
    from normswap.kernels.static_check import check_tile
    from normswap.kernels.timing import first_line

    try:
        with tempfile.TemporaryDirectory() as tmp:
            # Planned on meta tensors, whose launch-table key is PLAN_ARCH whatever the target.
            rows = check_tile((C.PLAN_ARCH, *key[1:]), tile, Path(tmp), target=target)
    except Exception as e:  # noqa: BLE001 - one candidate failing to compile must not end the run
        return [f"static check failed: {first_line(e)}"]
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
             deadline: float = math.inf, log: Callable[[str], None] = print) -> tuple[dict | None, list[dict]]:
    """Tune one key. `static_check(tiles) -> [problems per tile]`, `measure(tile, m) -> us`,
    `outputs(tile) -> tensors`, `agree(outs, ref_outs) -> None or why not`: injected, so that the
    selection is testable without a GPU. Returns (the winner's launch-table fields: tile, us,
    static, runner_up; or None) and one trial record per candidate for the report."""
    from normswap.kernels.timing import first_line

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
            t["why"] = f"error: {first_line(e)}"
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
# The GPU side: inputs, outputs, timing. (device "cpu": through the interpreter, which never reads
# a table: the CPU tests' plumbing check only.)


def _triton_ops():
    """The Triton functional ops with the backend signature (what backends.get_backend("triton")
    returns; imported directly: backends.py sits above the kernels)."""
    from normswap.kernels import layer_norm as ln
    from normswap.kernels import rms_norm as rms

    return types.SimpleNamespace(rms_norm=rms.rms_norm, layer_norm=ln.layer_norm)


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


def gpu_outputs(key: tuple, tile: dict, m: int, n: int | None = None, device: str = "cuda") -> list:
    """y (and dx, dweight, dbias for the backward) of the key's plain variant, m rows of n (default:
    the key's hidden bucket) elements, with `tile` forced."""
    import torch

    from normswap.kernels import _common as C

    arch, op, pass_, dtype, hidden, _ = key
    be = _triton_ops()
    x, w, b, dy = make_inputs(op, pass_, dtype, m, n or hidden, device=device)
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


def gpu_measure(key: tuple, tile: dict, m: int, l2: int, n: int | None = None, device: str = "cuda") -> float:
    """µs of one case of m rows of n elements (default: the key's hidden bucket), as the kernel
    benchmark times it (timing.make_case and time_us: CUDA graphs, rotating inputs)."""
    import torch

    from normswap.dtypes import DTYPES
    from normswap.kernels import _common as C
    from normswap.kernels.timing import fits, make_case, time_us

    arch, op, pass_, dtype, hidden, _ = key
    n = n or hidden
    bench_pass = "fwd" if pass_ == "fwd" else "fwd+bwd"
    if not fits(m, n, DTYPES[dtype], bench_pass, False, device):
        raise MemoryError(f"{m} x {n} does not fit in device memory")
    with T.forced(key, tile, C.ROW_BUCKETS):
        fn, _, sets = make_case(op, bench_pass, _triton_ops(), m, n, DTYPES[dtype], device, "gemma", False, l2)
        try:
            return time_us(fn, device, "graph", 1) / sets
        finally:
            fn = None  # noqa: F841 - release the case's tensors
            if device == "cuda":
                torch.cuda.empty_cache()


def parallel_static(key: tuple, pool, target=None):
    def check(tiles):
        return list(pool.map(static_problems, [key] * len(tiles), tiles, [target] * len(tiles)))
    return check


# ----------------------------------------------------------------------------------------------
# Output


def report(path: Path, meta: dict, done: list[dict]) -> None:
    """Markdown: per key the static choice and the winner with their times, the runner-up, and
    every candidate that was rejected and why."""
    lines = [f"# Launch-table tuning: {meta['device']}", "",
             f"{meta['date']}, commit {meta['commit']}, {meta['arch']}, torch {meta['torch']}, triton {meta['triton']}. "
             "Times: the kernel benchmark's cases (CUDA-graph replays, rotating inputs), µs per call; `bwd` keys "
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
    write_text_atomic(path, "\n".join(lines) + "\n")


def tune_keys(keys, doc, meta, out: Path, report_path: Path, *, retune, deadline, fits, static_check, measure,
              outputs, agree, same_device_only: bool = True, log: Callable[[str], None] | None = None) -> list[dict]:
    """Tune `keys` (grid_keys) in order into `doc` for meta["arch"], rewriting the table `out`
    and the report after every key (the report also when no key is attempted). The GPU work comes in as factories (see tune_key):
    static_check(key), measure(key, n), outputs(key, n, rows), agree(dtype); fits(k, m) says
    whether m rows of the key fit in memory. A key the table already has is skipped unless
    `retune`; with `same_device_only` (a user table) only where its entry was measured on
    meta["device"] with this process's kernels, and entries are kept per device (another GPU of the
    same architecture sharing the table measures and keeps its own beside them). Returns what the
    report shows, one record per key attempted."""
    from normswap.kernels import _common as C

    log = log or (lambda s: None)
    arch = meta["arch"]
    have = _have(doc, meta, same_device_only)
    done: list[dict] = []
    for i, k in enumerate(keys, 1):
        kt = T.entry_key(k)
        if kt in have and not retune:
            continue
        if deadline - time.monotonic() < MIN_KEY_S:
            log(f"stopping: {max(deadline - time.monotonic(), 0):.0f} s left; keys from {i} of {len(keys)} not tuned")
            break
        key = (arch, *kt)
        n = k.get("n", k["hidden"])
        rows = [m for m in k["row_counts"] if fits(k, m)]
        log(f"[{i}/{len(keys)}] {' '.join(map(str, kt))}" + (f" (timed at {n})" if n != k["hidden"] else "")
            + f" (rows {rows or 'none fit in memory'})")
        if not rows:
            continue
        tiles = candidates(k["pass"], k["dtype"], k["hidden"], rows[0])
        entry, trials = tune_key(key, rows, tiles, static_check(key), measure(key, n),
                                 outputs(key, n, agree_rows(rows)), agree(k["dtype"]), deadline, log)
        done.append({"key": key, "entry": entry, "trials": trials})
        if entry is not None:
            measured = {f: meta[f] for f in ("device", "date", "torch", "triton", "commit", "kernel_build")
                        if f in meta}
            measured.update(us=entry["us"], static=entry["static"], runner_up=entry["runner_up"])
            if n != k["hidden"]:
                measured["hidden_timed"] = n  # the user's own width: the entry serves its whole bucket
            # Merged into the file as it is now (read again under its lock), not written from this
            # run's copy: another tuner writing the same table meanwhile keeps its entries.
            try:
                doc = T.update(out, arch, [dict(zip(T.KEY_FIELDS, kt, strict=True), tile=entry["tile"],
                                                measured=measured)], C.ROW_BUCKETS, base=doc,
                               per_device=same_device_only)
            except ValueError as e:
                raise NormswapError(f"{e}; the key just tuned is not written") from None
        report(report_path, meta, done)
    if not done:  # nothing attempted (all tuned already, or no time): the report says so too
        report(report_path, meta, done)
    return done


def _have(doc, meta, same_device_only: bool) -> set:
    """Keys (op, pass, dtype, hidden, rows) the table has for meta's architecture; with
    `same_device_only` (a user table) only those measured on meta's device with this process's
    kernels (an entry of other kernels is stale: launches ignore it, so it is measured again)."""
    return {T.entry_key(e) for e in doc["archs"].get(meta["arch"], {}).get("entries", [])
            if not same_device_only or (e["measured"]["device"] == meta["device"]
                                        and e["measured"].get("kernel_build") == meta.get("kernel_build"))}


# ----------------------------------------------------------------------------------------------
# The entry point


def _split(value, what: str, allowed=None, cast=str) -> list:
    """A comma list (or a sequence) checked against `allowed`; BadInputError naming the bad item."""
    if not isinstance(value, str) and not isinstance(value, Iterable):
        raise TypeError(f"{what}: expected a comma list or a list, got {value!r}")
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
    if not items:
        raise BadInputError(f"{what}: empty list")
    out = []
    for v in items:
        try:
            v = cast(v)
        except (TypeError, ValueError):
            raise BadInputError(f"{what}: {v!r} is not a whole number") from None
        if allowed is not None and v not in allowed:
            raise BadInputError(f"{what}: unknown {v!r}; choose from {', '.join(allowed)}")
        out.append(v)
    return list(dict.fromkeys(out))


def _environment_problem() -> str | None:
    """Why this process cannot tune (None when it can): a CUDA device to time on, compiled (not
    interpreted) kernels, and the ptxas / nvdisasm the static check runs."""
    import torch

    if not torch.cuda.is_available():
        return "tuning needs a CUDA device (it times kernel launches on it); nothing written"
    from normswap.kernels import _common as C
    from normswap.kernels.rms_norm import _rms_fwd_kernel
    from normswap.kernels.static_check import tools_missing

    if C.interpreting(_rms_fwd_kernel):
        return "TRITON_INTERPRET is set: the interpreter times nothing; unset it; nothing written"
    why = tools_missing()
    return f"the static check cannot run: {why}; nothing written" if why else None


def _this_device() -> dict:
    """Name, architecture and L2 size of the current CUDA device, the static check's target for it
    (its capability and limits), and the versions an entry records."""
    import torch
    import triton

    from normswap.kernels import _common as C
    from normswap.kernels.static_check import device_target
    from normswap.kernels.timing import l2_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    uuid = getattr(torch.cuda.get_device_properties(device.index), "uuid", None)
    return {"device": C.device_name(device), "arch": C.device_arch(device), "l2": l2_bytes("cuda"),
            "target": device_target(device.index), "uuid": f"{uuid}" if uuid else f"{C.device_name(device)} {device.index}",
            "torch": torch.__version__, "triton": triton.__version__}


def timing_lock_path(here: dict) -> Path:
    """The lock one tuner holds on a GPU while it times (in the temporary folder: per machine)."""
    ident = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(here.get("uuid") or here["device"]))
    return Path(tempfile.gettempdir()) / f"normswap-tune-{ident}.lock"


@contextlib.contextmanager
def _timing_lock(here: dict):
    """One tuner per GPU at a time: a second one would time its candidates against the first's
    kernels (both would pick tiles from contended times). Refused at once, nothing written."""
    from normswap.fileio import LockHeld, path_lock

    with contextlib.ExitStack() as held:
        try:
            held.enter_context(path_lock(timing_lock_path(here), wait=False))
        except LockHeld:
            raise NormswapError(f"another normswap tune is timing on this GPU ({here['device']}); run one at a time "
                                "(their timings would include each other's kernels); nothing written") from None
        yield


def _static_worker_env(fp_fusion: str | None) -> None:
    """A static-check worker compiles as the tuning process's own launches do: triton's FP-fusion
    default, which triton warns about once per process where TRITON_DEFAULT_FP_FUSION is unset, is
    set to the value the tuning process runs with (so each worker neither warns nor differs)."""
    if fp_fusion is not None:
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", fp_fusion)


def _fp_fusion_default() -> str | None:
    """TRITON_DEFAULT_FP_FUSION as this process's compiles take it where the variable is unset
    (None where it is set: workers inherit it; or where this triton has no such knob)."""
    if "TRITON_DEFAULT_FP_FUSION" in os.environ:
        return None
    try:
        from triton import knobs
    except ImportError:  # an older triton: no knob, no warning
        return None
    default = getattr(getattr(knobs, "language", None), "default_fp_fusion", None)
    return None if default is None else ("1" if default else "0")


@contextlib.contextmanager
def _gpu_work(l2: int, target=None):
    """The factories tune_keys takes, timing on the current CUDA device; the static check, for
    `target` (static_check.Target: the device's; default an H100), runs in worker processes
    (spawned: never fork a process that holds CUDA; and its compiles intercept launches
    process-wide), set up to compile as this process does (_static_worker_env)."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(STATIC_WORKERS, os.cpu_count() or 1), mp_context=ctx,
                                                initializer=_static_worker_env,
                                                initargs=(_fp_fusion_default(),)) as pool:
        yield _factories(l2, lambda key: parallel_static(key, pool, target))


def _factories(l2: int, static_check, device: str = "cuda") -> dict:
    """tune_keys' GPU work (see tune_key) on `device`, around a given static check: memory fits,
    timing (the kernel benchmark's case and timer, rotating past `l2` bytes), outputs under a
    forced tile, agreement. device "cpu": the same wiring through the interpreter (the CPU test)."""
    from normswap.dtypes import DTYPES
    from normswap.kernels.timing import fits

    def fits_key(k, m):
        return fits(m, k.get("n", k["hidden"]), DTYPES[k["dtype"]], "fwd" if k["pass"] == "fwd" else "fwd+bwd",
                    False, device)

    return {"fits": fits_key, "static_check": static_check,
            "measure": lambda key, n: lambda tile, m: gpu_measure(key, tile, m, l2, n, device=device),
            "outputs": lambda key, n, m: lambda tile: gpu_outputs(key, tile, m, n, device=device), "agree": gpu_agree}


def tune_launches(*, ops=T.OPS, passes=T.PASSES, dtypes=DEFAULT_DTYPES, hidden=None,
                  budget: float = DEFAULT_BUDGET_S, out: str | Path | None = None, retune: bool = False,
                  report_path: str | Path | None = None, base: str | Path | None = None, commit: str | None = None,
                  same_device_only: bool = True, log: Callable[[str], None] | None = None,
                  option_names: Mapping[str, str] | None = None) -> dict:
    """Tune launch tiles on the current CUDA device into the launch table `out` (default: the user
    table, launch_table.user_path()), which then serves every launch on this device. ops, passes,
    dtypes: lists or comma strings; hidden: only these hidden sizes (any widths: each tunes its
    power-of-two bucket, timed at that width), default the benchmark grid; budget: seconds (no key
    starts with less than MIN_KEY_S left; a run stopped early keeps every key it finished, and
    the next run goes on from there); retune: measure keys the table already has again;
    base: the table to start from when `out` does not exist yet (default: an empty one); commit:
    the provenance an entry records (default: the git commit, else the normswap version);
    log(line): progress, one line per key and candidate; option_names: what bad-input messages
    call ops, passes, dtypes, hidden and budget (the CLI's {"hidden": "--hidden", ...}).

    Returns {"out", "report", "device", "arch", "keys", "already" (in the table: not measured again),
    "tuned": [per key its tile, the static tile and both times], "not_tuned": [per key why],
    "not_attempted" (budget spent, or no row count fits in memory)}. Raises BadInputError for bad arguments or an invalid existing table,
    NormswapError where it cannot time (no CUDA device, the Triton interpreter, no ptxas)."""
    from normswap._version import __version__, git_commit
    from normswap.kernels import _common as C

    t0 = time.monotonic()
    name = option_labels(("ops", "passes", "dtypes", "hidden", "budget"), option_names)
    ops = _split(ops, name["ops"], T.OPS)
    passes = _split(passes, name["passes"], T.PASSES)
    dtypes = _split(dtypes, name["dtypes"], T.DTYPES)
    if hidden is not None:
        hidden = _split(hidden, name["hidden"], cast=int)
        bad = [n for n in hidden if not 1 <= n <= MAX_HIDDEN]
        if bad:
            raise BadInputError(f"{name['hidden']}: {bad[0]} is outside 1..{MAX_HIDDEN}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise BadInputError(f"{name['budget']} must be a positive number of seconds, got {budget!r}")
    if out is None:
        out = T.user_path()
        if out is None:
            raise BadInputError(f"{T.USER_ENV}=off: no user launch table to write; give an output path")
    out = target_path(out, "file")  # Path("") is "." and has no suffix to swap for the report's
    report_path = Path(report_path) if report_path else out.with_suffix(".md")
    if report_path.resolve() == out:
        # --out table.md: the report, rewritten after every key, replaced the table the key had just
        # been merged into, and the next key found "not a valid launch table" (the first key lost)
        raise BadInputError(f"the launch table {out} and its report would be one file; name the table "
                            f"{out.with_suffix('.json').name}, or give the report a path of its own")
    for path, what in ((out, "launch table"), (report_path, "report")):
        why = unwritable(path)
        if why:  # found now, not after the first key's minutes of timing
            raise BadInputError(f"cannot write the {what} {path}: {why}; nothing written")
    start = out if out.exists() else (Path(base) if base else None)
    try:
        doc = T.read(start) if start else dict(T.empty(C.ROW_BUCKETS), about=T.ABOUT_USER)
        bad = T.problems(doc, C.ROW_BUCKETS, per_device=same_device_only)
    except (OSError, ValueError) as e:
        bad = [str(e)]
    if bad:
        raise BadInputError(f"{start} is not a valid launch table ({bad[0]}); move it away or write elsewhere")
    why = _environment_problem()
    if why:
        raise NormswapError(why)
    here = _this_device()
    meta = {**{k: here[k] for k in ("device", "arch", "torch", "triton")},
            "date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}",
            "commit": commit or git_commit() or f"normswap {__version__}", "kernel_build": T.kernel_build()}
    keys = grid_keys(ops, passes, dtypes, hidden)
    log = log or (lambda s: None)
    t = here["target"]
    log(f"{meta['device']} ({meta['arch']}): {len(keys)} keys; tuning into {out}; static check compiled for "
        f"{t.ptxas_arch}, {t.sms} SMs ({t.regs} registers, {t.threads} threads, {t.smem // 1024} KiB shared memory, "
        f"{t.blocks} programs at most each)")
    with _timing_lock(here), _gpu_work(here["l2"], t) as work:
        done = tune_keys(keys, doc, meta, out, report_path, retune=retune, deadline=t0 + budget,
                         same_device_only=same_device_only, log=log, **work)
    T.reload()  # launches in this process from now on read what was written
    return _summary(keys, done, meta, out, report_path, set() if retune else _have(doc, meta, same_device_only))


def _summary(keys, done, meta, out: Path, report_path: Path, had: set) -> dict:
    attempted = {d["key"][1:] for d in done}
    tuned = [{**dict(zip(T.KEY_FIELDS, d["key"][1:], strict=True)), "tile": d["entry"]["tile"],
              "static_tile": d["entry"]["static"]["tile"], "us": d["entry"]["us"],
              "static_us": d["entry"]["static"]["us"]} for d in done if d["entry"] is not None]
    not_tuned = [{**dict(zip(T.KEY_FIELDS, d["key"][1:], strict=True)),
                  "why": next((t["why"] for t in d["trials"] if t["why"]), "no candidate")}
                 for d in done if d["entry"] is None]
    kts = [T.entry_key(k) for k in keys]
    return {"out": str(out), "report": str(report_path), "device": meta["device"], "arch": meta["arch"],
            "keys": len(keys), "already": sum(kt in had for kt in kts), "tuned": tuned, "not_tuned": not_tuned,
            # the budget ran out before them, or none of their row counts fits in memory: a later run goes on
            "not_attempted": sum(kt not in had and kt not in attempted for kt in kts)}


def launch_table_status() -> dict:
    """Which launch tables are in effect in this process and what they answer on the current CUDA
    device (none without one): launch_table.status for it, plus the user table's default path."""
    import torch

    from normswap.kernels import _common as C

    arch = name = None
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        arch, name = C.device_arch(device), C.device_name(device)
    return T.status(C.ROW_BUCKETS, arch, name)
