"""Kernel quality on Hopper, checked without a GPU (benchmarks/kernel_static.py): every kernel the
launch table picks compiles for sm_90 with no register spills, moves row elements (x, residual, y,
h, dy, dx, weight, bias) only in 16-byte accesses when the hidden size is a multiple of 16, and the
design's promises show in the machine code (split rows for wide rows, pipelined backward loads).

CI compiles the representative subset (`--subset ci`: hidden 4,096 and 65,536, bf16 and fp32,
rms with weight + residual and layer_norm with weight + bias, forward and backward); the whole grid
is `python benchmarks/kernel_static.py`. Beyond that subset, one representative of each kernel
variant class (`--variants ci`: constexpr values, argument types and dtype pairs, in each row
layout) must compile (its spills are listed, not failed: the grid's tiles are held to none);
every variant is `--variants api`. Skipped only where the
ptxas / nvdisasm that triton ships are missing. Runs in a subprocess: the interpreter decision is per process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "kernel_static.py"


def _tools_missing() -> str | None:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        return f"this triton has no offline compile API ({e})"
    base = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for tool in ("ptxas", "nvdisasm"):
        if not (base / tool).exists():
            return f"triton ships no {tool} here"
    return None


pytestmark = pytest.mark.skipif(_tools_missing() is not None, reason=str(_tools_missing()))


def _run(tmp_path, *args) -> tuple[int, dict, str]:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"),
               TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", *args], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    doc = json.loads(out.stdout) if out.stdout.strip().startswith("{") else {}
    return out.returncode, doc, out.stderr


def test_representative_kernels_are_spill_free_and_16_byte_wide(tmp_path):
    from normswap.kernels.static_check import cp_async_hints

    rc, doc, err = _run(tmp_path, "--subset", "ci")
    assert doc, err[-3000:]
    results = doc["results"]
    bad = [f"{r['op']} {r['pass']} {r['dtype']} {r['N']}: {r['problems']}" for r in results if r["problems"]]
    assert rc == 0 and not bad, "\n".join(bad) or err[-3000:]
    # Registers and spills are read with the ptxas the JIT builds the kernel with: the PTX ISA
    # version triton wrote is the one it derives from that ptxas' CUDA release (triton 3.6 builds
    # sm_90 with its CUDA 12.8 ptxas, PTX 8.7, not with the 12.9 ptxas-blackwell beside it).
    from triton.backends.nvidia.compiler import ptx_get_version

    assert {r["ptx"]["version"] for r in results} == {"{}.{}".format(*divmod(ptx_get_version(doc["ptxas"]), 10))}, \
        doc["ptxas"]
    # The subset really covers what it claims: both ops, both passes, both dtypes, both row layouts.
    assert {(r["op"], r["pass"], r["dtype"]) for r in results} == {
        (op, p, dt) for op in ("rms_norm", "layer_norm") for p in ("fwd", "bwd") for dt in ("bf16", "fp32")}
    for r in results:
        assert r["spill_bytes"] == 0 and r["local"] == 0
        assert r["row_loads"] and set(r["row_loads"]) | set(r["cp_async_widths"]) <= {"128"}, r
        assert set(r["row_stores"]) == {"128"}, r
        assert 1 <= r["programs_per_sm"], r
        # bf16 is rounded by the hardware conversion (cvt.rn), never by the interpreter's integer
        # code; the parameters (plain loads before any loop) are marked evict_last.
        assert r["ptx"]["int_round"] == 0, r
        assert r["ptx"]["evict_last"] >= 1, r
        ptx = r["ptx"]
        if not r["cp_async"]:
            assert ptx["evict_first"] >= 1, r  # streamed rows: plain loads, marked evict_first
        else:
            # The pipelined backward's streamed rows are cp.async copies. The kernels ask for
            # evict_first on every one (the TTGIR's async copies carry it, whatever the triton);
            # triton writes it into the PTX (createpolicy + cp.async...L2::cache_hint) only from 3.9
            # with PTX ISA 9.4, and 3.6-3.8 drop it when they lower the copy:
            # static_check.CP_ASYNC_HINTS_SINCE (triton-lang/triton#11660, #11848), and
            # benchmarks/README.md, Pre-flight.
            assert r["ttgir"]["async_copies_evict_first"] >= 1, r
            assert ptx["cp_async_rows"] >= 1, r
            if cp_async_hints(doc["triton"], ptx["version"]):
                assert ptx["cp_async_rows_hinted"] == ptx["cp_async_rows"] and ptx["evict_first"] >= 1, r
            else:  # a triton that keeps them before CP_ASYNC_HINTS_SINCE fails here: move it
                assert ptx["cp_async_rows_hinted"] == 0, r
        chunks = r["tile"]["CHUNKS"]
        if r["N"] == 65536:
            # Wider than one program's registers: the row is split over co-resident programs (read
            # once), launched cooperatively, the grid a whole number of row groups that all fit.
            assert chunks > 1 and r["cooperative"], r
            # The programs of a row wait for each other: GPU-scope release/acquire, a bounded poll
            # (a trap, never a hang), and no cp.async prefetch that could run ahead of the wait.
            w = r["wait"]
            assert w["release_gpu"] >= 1 and w["acquire_gpu"] >= 1 and w["trap"] >= 1, r
            assert r["cp_async"] == 0, r
            assert r["grid"][0] % chunks == 0
            assert r["grid"][0] <= 132 * r["programs_per_sm"]
        else:
            assert chunks == 1 and not r["cooperative"], r
        if r["pass"] == "bwd" and chunks == 1:
            # The persistent backward's loads are software-pipelined (cp.async), and its grid is
            # what fits per SM, one wave.
            assert r["cp_async"] > 0, r
            assert r["grid"][0] == 132 * r["programs_per_sm"], r


def test_narrow_accesses_are_seen_and_exempt_only_off_multiples_of_16(tmp_path):
    """The width check is real: a hidden size of 1,000 (not a multiple of 16) forces narrower row
    accesses, which the analysis reports but does not fail; per-row statistics never count."""
    rc, doc, err = _run(tmp_path, "--hidden", "1000", "--dtypes", "bf16", "--ops", "rms_norm", "--passes", "fwd")
    assert rc == 0, err[-3000:]
    narrow = [op for r in doc["results"] for op in r["narrow_row_ops"]]
    assert narrow, "a 1,000-wide bf16 row cannot be read in 16-byte vectors; the analysis saw none"
    assert not any("RSTD" in op for op in narrow)
    assert all(not r["problems"] for r in doc["results"])


def test_every_committed_launch_table_entry_passes_the_static_check(tmp_path):
    """The measured table (normswap/kernels/launch_table.json) is held to the heuristics' rule: each
    sm_90 entry whose tile is not the heuristics' own (those are checked with the grid), planned as
    the launcher plans it, compiles spill-free with 16-byte row accesses in the fused-residual
    variant (the most live values), and is what the launcher really used. (CI's share; `--table`
    alone also compiles the variant without the residual, as the tuner does for each candidate.)"""
    from normswap.dtypes import DTYPES
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T
    from normswap.kernels.static_check import bucket_rows

    rc, doc, err = _run(tmp_path, "--table", "--subset", "ci")
    assert rc == 0 and "results" in doc, err[-3000:]
    tuned = {("sm_90", *T.entry_key(e)) for e in T.read(T.PATH)["archs"].get("sm_90", {}).get("entries", [])
             if e["tile"] != C.tile_fields(C.heuristic_config(bucket_rows(e["rows"]), e["hidden"], DTYPES[e["dtype"]],
                                                               e["pass"]))}
    assert {tuple(r["entry"]) for r in doc["results"]} == tuned
    assert all(r["residual"] for r in doc["results"])
    assert not [r for r in doc["results"] if r["problems"]]


def test_table_check_fails_a_spilling_entry_and_passes_a_sound_one(tmp_path):
    """The table check is real: a fabricated entry with one warp for an 8,192-wide row (256 fp32
    values per thread) spills and fails the run; a sound 2 x 4,096 tile passes, and both were the
    tiles the launcher used. CI's share (--subset ci) leaves out the entry that is the heuristics'
    own tile and compiles the others with the fused residual only."""
    measured = {"device": "test fixture, not a measurement", "date": "2000-01-01", "torch": "-", "triton": "-",
                "commit": "-", "us": {"32768": 1.0}, "static": None, "runner_up": None}

    def entry(hidden, **tile):
        return {"op": "rms_norm", "pass": "fwd", "dtype": "bf16", "hidden": hidden, "rows": ">2048",
                "tile": dict(tile, num_stages=1), "measured": measured}

    path = tmp_path / "table.json"
    path.write_text(json.dumps({"schema": 1, "about": "fixture", "row_buckets": [2048], "archs": {"sm_90": {
        "entries": [entry(4096, block_m=2, block_n=4096, num_warps=8),
                    entry(8192, block_m=1, block_n=8192, num_warps=1),
                    entry(1024, block_m=8, block_n=1024, num_warps=16)]}}}))  # the heuristics' tile
    rc, doc, err = _run(tmp_path, "--table", str(path))
    assert rc == 1 and doc, err[-3000:]
    by_n = {}
    for r in doc["results"]:
        by_n.setdefault(r["N"], []).append(r)
    assert {n: len(rs) for n, rs in by_n.items()} == {4096: 2, 8192: 2, 1024: 2}  # with and without the residual
    for r in by_n[4096]:
        assert not r["problems"] and r["tile"]["BLOCK_M"] == 2 and r["num_warps"] == 8, r
    for r in by_n[8192]:
        assert r["num_warps"] == 1 and r["spill_bytes"] > 0 and any("spills" in p for p in r["problems"]), r
    rc, doc, err = _run(tmp_path, "--table", str(path), "--subset", "ci")
    assert rc == 1 and doc, err[-3000:]
    assert sorted((r["N"], r["residual"]) for r in doc["results"]) == [(4096, True), (8192, True)]
    assert doc["not_checked"] == ["sm_90 rms_norm fwd bf16 1024 >2048 (the heuristics' tile)"]


def test_the_committed_table_holds_only_architectures_the_static_check_plans():
    """kernel_static.py --table (and the test above) compiles only entries of the architecture it
    plans with (sm_90, an H100's limits); entries of another architecture would reach every launch
    on such GPUs unchecked. So committing, say, an A100's tuned entries must come with a target for
    sm_80 in that check (SM count and per-SM limits, static_check.Target) and this test widened."""
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T

    unchecked = sorted(set(T.read(T.PATH)["archs"]) - {C.PLAN_ARCH})
    assert not unchecked, f"launch_table.json has entries for {unchecked}, which the static check does not compile"


def test_one_of_each_kernel_variant_class_compiles_for_sm_90(tmp_path):
    """Beyond the ci subset's few cases: one representative of each variant class of every launch
    the library can make (static_check.variant_cases, scope "api"; a class is a constexpr value or an
    argument type, alone and in each row layout) that the ci subset does not compile already,
    compiled for sm_90 without an error (spills are the grid's rule, for the tiles it holds: a few
    variants at a hidden size that is no multiple of 16 spill some bytes with triton 3.6). The whole
    enumeration is `--variants library` / `api`, the pre-flight of a GPU session
    (benchmarks/README.md)."""
    rc, doc, err = _run(tmp_path, "--variants", "ci")
    assert doc, err[-3000:]
    bad = [f"{r['kernel']} {r['case']}: {r['error']}" for r in doc["results"] if r["error"]]
    assert rc == 0 and not bad and doc["failed"] == 0, "\n".join(bad) or err[-3000:]
    assert all(r["regs"] for r in doc["results"])  # ptxas was read for every variant
    rows = doc["results"]
    assert doc["variants"] == len(rows) >= 8 and doc["classes"] > len(rows)

    def some(kernel, **want):
        return any(r["kernel"] == kernel and all(r["constexprs"].get(k, r["args"].get(k)) == v for k, v in want.items())
                   for r in rows)

    for k in ("_rms_fwd_kernel", "_rms_bwd_kernel", "_ln_fwd_kernel", "_ln_bwd_kernel"):
        # per-head parameters in the split-row loop (their own code path there), no 16-divisible
        # hidden size, and no weight at all
        assert some(k, PER_ROW_W=True, CHUNKS=next(r["constexprs"]["CHUNKS"] for r in rows
                                                   if r["kernel"] == k and r["constexprs"]["CHUNKS"] > 1)), k
        assert some(k, N="i32") and some(k, HAS_W=False), k
    for code in (0, 1, 2):  # every rounding the RMS families apply before the weight (none, fp16, bf16)
        assert some("_rms_fwd_kernel", NORM_CODE=code) and some("_rms_bwd_kernel", NORM_CODE=code)
    # what the functional API adds: h kept in fp32 on a half stream, an output dtype other than x's,
    # and the backward's separate residual grad with dy in another dtype than the saved input
    assert some("_rms_fwd_kernel", X="*bf16", H="*fp32") or some("_rms_fwd_kernel", X="*fp16", H="*fp32")
    assert any(r["kernel"] == "_ln_fwd_kernel" and r["args"]["Y"] != r["args"]["X"] for r in rows)
    assert some("_rms_bwd_kernel", HAS_DR=True) and some("_ln_bwd_kernel", HAS_DR=True)
    assert any(r["kernel"].endswith("bwd_kernel") and r["args"]["DY"] != r["args"]["Z"] for r in rows)
    assert some("_ln_bwd_kernel", HAS_DB=True, HAS_DW=False) and some("_rms_bwd_kernel", HAS_DW=False, HAS_W=True)


_WDY_SCRIPT = """
import json, sys
from normswap.kernels import static_check as S
out = []
for n, heads in ((1, 0), (4096, 0), (4096, 2), (65536, 0)):
    for launch in S.plan("layer_norm", "bwd", "fp32", 64, n, True, True, False, variant=S.Variant(heads=heads)):
        if launch.kernel.fn.__name__ == "_ln_bwd_kernel":
            ptx = S.compile_launch(launch).asm["ptx"]
            out.append(dict(n=n, heads=heads, chunks=launch.kwargs["CHUNKS"], rounded=ptx.count("mul.rn.f32")))
print(json.dumps(out))
"""


def test_layer_norm_backward_rounds_the_weighted_gradient_before_centering_it(tmp_path):
    """dx = rstd * (wdy - mean(wdy) - xhat * mean(xhat * wdy)). Where the mean is wdy itself (a 1-wide
    row) the first difference must be exactly 0; the GPU compiler fused wdy = dy * w
    into that subtract (an FMA: the product unrounded there, rounded in the mean), so on an H100 a
    1-wide row's dx came out ~1e-5 instead of 0 (rstd = 1/sqrt(eps) amplifies the rounding error).
    The kernel now computes wdy with an explicitly rounded multiply, which the compiler may not
    fuse: it must be in the machine code of every layout (one tile, per-head weights, split rows)."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _WDY_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert {r["chunks"] > 1 for r in rows} == {False, True} and any(r["heads"] for r in rows)
    assert all(r["rounded"] > 0 for r in rows), rows


def test_ptx_accesses_are_attributed_to_their_op_line_inside_inline_asm(tmp_path):
    """Triton writes every global access as an inline-asm block (movs for the masked-off value,
    then the load). triton 3.6's LLVM puts the op's .loc before the block; 3.9's writes one .loc
    per asm line, counting up from the op's line, so the load itself sat under a line 4 further
    down (a blank line, an `if`, or another op's line: a scratch access could pass for a row one,
    or a row access for scratch). Both forms must name the tl.load's own line."""
    from normswap.kernels.static_check import ptx_memory_ops

    src = tmp_path / "k.py"
    src.write_text("z = tl.load(X + offs, mask=mask, other=0.0,\n    eviction_policy='evict_first')\n\n"
                   "if HAS_R:\n    rstd = tl.load(RSTD + rows)\n")
    load = "\t@%p1 ld.global.L1::evict_first.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n"
    movs = [f"\tmov.u32 %r{i}, %r9;\n" for i in range(1, 5)]
    llvm_3_9 = "".join(f"\t.loc\t1 {1 + i} 9, function_name $L__info_string0, inlined_at 2 7 3\n{m}"
                       for i, m in enumerate(movs))
    ptx = (f'\t.file\t1 "{src}"\n\t.loc\t1 1 9\n\t// begin inline asm\n{"".join(movs)}{load}\t// end inline asm\n'
           f"\t// begin inline asm\n{llvm_3_9}{load}\t// end inline asm\n"
           "\t.loc\t1 5 12\n\t// begin inline asm\n\t@%p2 cp.async.ca.shared.global [ %r5 + 0 ], [ %rd2 + 0 ], 0x4, %r6;\n"
           "\t// end inline asm\n")
    ops = ptx_memory_ops(ptx)
    assert [(o["op"], o["bits"]) for o in ops] == [("LDG", 128), ("LDG", 128), ("LDGSTS", 32)]
    assert [o["source"] for o in ops] == ["z = tl.load(X + offs, mask=mask, other=0.0,"] * 2 + \
        ["rstd = tl.load(RSTD + rows)"]


_SOURCES_SCRIPT = """
import json
import re
from normswap.kernels import static_check as S
out = []
for op, pass_, dtype, n in (("rms_norm", "fwd", "fp32", 4096), ("rms_norm", "bwd", "bf16", 65536)):
    for launch in S.plan(op, pass_, dtype, 64, n, True, False, True):
        out += [o["source"] for o in S.ptx_memory_ops(S.compile_launch(launch).asm["ptx"])]
print(json.dumps(out))
"""


def test_every_global_access_of_a_compiled_kernel_names_a_load_or_store_line(tmp_path):
    """What tells row accesses from scratch is the source line each global access names: compiled
    with the triton at hand (vector loads with a masked-off value, stores, cp.async copies, split
    rows' scratch), every one must name a tl.load / tl.store / atomic line."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _SOURCES_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    sources = json.loads(out.stdout)
    assert len(sources) > 20 and any("RSTD" in s for s in sources)
    bad = sorted({s for s in sources if not re.search(r"\btl\.(load|store|atomic_\w+)\(", s)})
    assert not bad, bad


def test_ptx_source_lines_come_from_this_checkout_when_the_compile_was_cached_by_another():
    """Triton's compile cache is shared by every checkout on a machine and keyed by the kernels'
    source and line numbers, not their path: a launch compiled first in another checkout (since
    removed) names that checkout's files. Their lines are this checkout's, read from here (before:
    no line at all, so a 4-byte access of scratch counted as a narrow row access)."""
    from normswap.kernels import _common
    from normswap.kernels.static_check import ptx_memory_ops

    lines = Path(_common.__file__).read_text().splitlines()
    at = next(i for i, line in enumerate(lines, 1) if "tl.load(PART" in line)
    ld = "\t@%p1 ld.global.b32 { %r1 }, [ %rd1 + 0 ];\n"
    ptx = (f'\t.file\t1 "/gone/checkout/normswap/kernels/_common.py"\n\t.file\t2 "/gone/checkout/other.py"\n'
           f"\t.loc\t1 {at} 9\n{ld}\t.loc\t2 {at} 9\n{ld}")
    assert [o["source"] for o in ptx_memory_ops(ptx)] == [lines[at - 1].strip(), ""]
