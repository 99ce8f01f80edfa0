"""Static quality of the norm kernels on Hopper, without a GPU.

    python benchmarks/kernel_static.py                       # the benchmark grid, table on stdout
    python benchmarks/kernel_static.py --subset ci           # the few variants the CPU test compiles
    python benchmarks/kernel_static.py --hidden 4096 --dtypes bf16 --json
    python benchmarks/kernel_static.py --table               # every sm_90 entry of the launch table
    python benchmarks/kernel_static.py --table --subset ci   # what CI compiles of it

For every kernel launch the library's launch table and heuristics pick on the benchmark grid (hidden
1,024 ... 262,144; bf16 / fp32; with and without weight, bias, residual; forward and backward),
this compiles the kernel for sm_90 exactly as the launcher would (same constexprs, warps and
options, the launcher's argument types and 16-byte alignment specialisations), then reads:
- registers, spill bytes, stack and shared memory from ptxas (`-v`; the ptxas triton ships),
- programs per SM, from registers, warps and shared memory against an H100's limits,
- every global memory instruction in the SASS (`nvdisasm -g`), with its width and the Triton
  source line it comes from: loads/stores of row elements (x, residual, y, h, dy, dx, weight,
  bias) are told from those of per-row statistics and fp32 scratch (rstd, mean, partial sums,
  arrival counters) by the names on that source line.

How the launches are found: the library's own launchers run on `meta` tensors (no data, no
device) with kernel launches intercepted, so what is compiled is what the heuristics chose, never
a copy of them. SM count for the plan: an H100 SXM's 132.

It must run without TRITON_INTERPRET (the interpreter compiles nothing); it sets that itself when
run as a script. Exit status 1 when a variant spills registers or moves row elements in accesses
narrower than 16 bytes at a hidden size that is a multiple of 16 (the CPU test's rule), 2 on bad
arguments or when ptxas is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
ROWS = 32768
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
H100_SMS = 132
# The variants a launch-table entry is checked in (--table, and the tuner's candidates): the one
# benchmarks/tune.py times and the same with the fused residual (more registers). One entry serves
# every variant of its op and pass.
TABLE_VARIANTS = {"rms_norm": (("rms_norm", True, False, False), ("rms_norm", True, False, True)),
                  "layer_norm": (("layer_norm", True, True, False), ("layer_norm", True, True, True))}
# Source-line names of per-row statistics and scratch buffers: their accesses are exempt from the
# 16-byte rule (one fp32 per row, or a program's partial-sum row).
SCRATCH_NAMES = ("RSTD", "MEAN", "STAT", "PART", "DWP", "DBP", "SYNC", "COUNT")
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def triton_bin(tool: str) -> Path:
    import triton

    base = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    # ptxas-blackwell is the newer ptxas; triton uses it for sm_90 and later.
    if tool == "ptxas" and (base / "ptxas-blackwell").exists():
        return base / "ptxas-blackwell"
    return base / tool


def tools_missing() -> str | None:
    for tool in ("ptxas", "nvdisasm"):
        if not triton_bin(tool).exists():
            return f"{triton_bin(tool)} not found (this triton ships no {tool})"
    return None


# ----------------------------------------------------------------------------------------------
# Finding the launches: run the library's launchers on meta tensors with launches recorded.


@dataclasses.dataclass
class Launch:
    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict


_RESIDENT: dict = {}


@contextlib.contextmanager
def recorded_launches(sms: int):
    """Launches are recorded instead of run; the device the launchers size persistent grids for is
    an H100 (its SM count, and programs per SM from the compiled kernel's registers and shared
    memory, computed by the library's own rule)."""
    from triton.runtime.jit import KernelInterface

    from normswap.kernels import _common as C

    seen: list[Launch] = []
    old_getitem = KernelInterface.__getitem__
    old_sms = C.sm_count
    old_resident = getattr(C, "resident_programs", None)

    def getitem(self, grid):
        def launch(*args, **kwargs):
            seen.append(Launch(self, tuple(grid) if not callable(grid) else grid, args, kwargs))
        return launch

    def resident(kernel, args, kwargs, device):
        launch = Launch(kernel, (1,), tuple(args), dict(kwargs))
        key = _variant_key(launch)
        if key not in _RESIDENT:
            k = compile_launch(launch)
            with tempfile.TemporaryDirectory() as tmp:
                rep = ptxas_report(k.asm["ptx"], Path(tmp))
            smem = max(rep["smem"], int(getattr(k.metadata, "shared", 0) or 0))
            _RESIDENT[key] = sms * programs_per_sm(rep["regs"], kwargs.get("num_warps", 4), smem)
        return _RESIDENT[key]

    KernelInterface.__getitem__ = getitem
    C.sm_count = lambda device: sms if device.type in ("meta", "cuda") else old_sms(device)
    if old_resident is not None:
        C.resident_programs = resident
    try:
        yield seen
    finally:
        KernelInterface.__getitem__ = old_getitem
        C.sm_count = old_sms
        if old_resident is not None:
            C.resident_programs = old_resident


def _variant_key(launch: Launch):
    return (launch.kernel.__name__, tuple(sorted((k, str(v)) for k, v in launch.kwargs.items())),
            tuple(_arg_type(a) for a in launch.args))


def plan(op: str, pass_: str, dtype: str, m: int, n: int, weight: bool, bias: bool, residual: bool,
         sms: int = H100_SMS) -> list[Launch]:
    """The kernel launches the library makes for one case (forward, or the backward alone)."""
    import torch

    from normswap.kernels import layer_norm as L
    from normswap.kernels import rms_norm as R

    dt = getattr(torch, DTYPE_NAMES[dtype])
    meta = dict(device="meta", dtype=dt)
    x = torch.empty(m, n, **meta)
    w = torch.empty(n, **meta) if weight else None
    b = torch.empty(n, **meta) if bias else None
    r = torch.empty(m, n, **meta) if residual else None
    stat = dict(device="meta", dtype=torch.float32)
    with recorded_launches(sms) as seen:
        if op == "rms_norm" and pass_ == "fwd":
            R._rms_forward(x, w, r, 1e-6, 0.0, "llama", None, False)
        elif op == "rms_norm":
            R._rms_backward(x, x if residual else None, x, w, torch.empty(m, **stat), 0.0, "llama", dt,
                            dt if residual else None)
        elif pass_ == "fwd":
            L._ln_forward(x, w, b, r, 1e-5, 0.0, None, False)
        else:
            L._ln_backward(x, x if residual else None, x, w, b, torch.empty(m, **stat), torch.empty(m, **stat),
                           0.0, dt, dt if residual else None)
    return seen


# ----------------------------------------------------------------------------------------------
# Compiling one launch as the JIT would, and reading the result.

OPTION_KEYS = ("num_warps", "num_stages", "num_ctas", "launch_cooperative_grid", "maxnreg")


def _arg_type(v) -> tuple[str, bool]:
    """(triton signature type, divisible by 16) of one runtime argument, as the JIT specialises it."""
    import torch

    if isinstance(v, torch.Tensor):
        name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}[v.dtype]
        return "*" + name, True  # torch allocations are 256-byte aligned
    if isinstance(v, bool):
        return "i1", False
    if isinstance(v, int):
        return ("i32" if -(2**31) <= v < 2**31 else "i64"), v % 16 == 0
    if isinstance(v, float):
        return "fp32", False
    raise TypeError(f"unexpected kernel argument {type(v).__name__}")


def compile_launch(launch: Launch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = launch.kernel
    names = fn.arg_names
    consts = {k: v for k, v in launch.kwargs.items() if k not in OPTION_KEYS}
    options = {k: v for k, v in launch.kwargs.items() if k in OPTION_KEYS}
    sig, attrs = {}, {}
    positional = iter(launch.args)
    for i, (name, param) in enumerate(zip(names, fn.params, strict=True)):
        if name in consts:
            sig[name] = "constexpr"
            continue
        v = next(positional)
        ty, div16 = _arg_type(v)
        sig[name] = ty
        if div16 and not param.do_not_specialize and not param.do_not_specialize_on_alignment:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)


_PTXAS_RE = {
    "regs": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_st": re.compile(r"(\d+) bytes spill stores"),
    "spill_ld": re.compile(r"(\d+) bytes spill loads"),
    "smem": re.compile(r"(\d+) bytes smem"),
}
# The opcode must end at a dot or a space: LDGDEPBAR (a cp.async fence) is no load.
_MEM_RE = re.compile(r"\b(LDGSTS|LDG|STG|LDL|STL|ATOMG|REDG|RED|ATOM)((?:\.[A-Z0-9_]+)*)(?=\s)")
_LINE_RE = re.compile(r'//## File "([^"]+)", line (\d+)')


def ptxas_report(ptx: str, workdir: Path) -> dict:
    src = workdir / "k.ptx"
    src.write_text(ptx)
    out = subprocess.run([str(triton_bin("ptxas")), "-lineinfo", "--regAllocOptLevel=2", "-v", "--gpu-name=sm_90a",
                          str(src), "-o", str(workdir / "k.o")], capture_output=True, text=True, check=True)
    rep = {}
    for key, rx in _PTXAS_RE.items():
        hit = rx.search(out.stderr)
        rep[key] = int(hit.group(1)) if hit else 0
    return rep


def _width_bits(suffixes: str) -> int:
    """Access width from a SASS memory op's suffixes (.128, .64, .U16, .U8 ...; none means 32)."""
    for s in suffixes.split("."):
        if s in ("128", "64", "32"):
            return int(s)
        if s in ("U16", "S16"):
            return 16
        if s in ("U8", "S8"):
            return 8
    return 32


def sass_memory_ops(cubin: bytes, workdir: Path) -> list[dict]:
    """Every global/local memory instruction: {op, bits, line text}."""
    path = workdir / "k.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([str(triton_bin("nvdisasm")), "-g", "-c", str(path)], capture_output=True, text=True,
                         check=True).stdout
    ops, where = [], None
    sources: dict[str, list[str]] = {}
    for line in out.splitlines():
        loc = _LINE_RE.search(line)
        if loc:
            where = (loc.group(1), int(loc.group(2)))
            continue
        hit = _MEM_RE.search(line)
        if not hit:
            continue
        text = ""
        if where is not None:
            if where[0] not in sources:
                try:
                    sources[where[0]] = Path(where[0]).read_text().splitlines()
                except OSError:
                    sources[where[0]] = []
            lines = sources[where[0]]
            text = lines[where[1] - 1].strip() if 0 < where[1] <= len(lines) else ""
        op = hit.group(1)
        ops.append({"op": op, "bits": _width_bits(hit.group(2)) if op != "LDGSTS" else _ldgsts_bits(hit.group(2)),
                    "source": text})
    return ops


def _ldgsts_bits(suffixes: str) -> int:
    return _width_bits(suffixes)


def is_scratch(source: str) -> bool:
    return any(name in source for name in SCRATCH_NAMES)


def programs_per_sm(regs: int, num_warps: int, smem: int) -> int:
    """Programs one H100 SM holds at once (the library's own occupancy rule)."""
    from normswap.kernels import _common as C

    return C.programs_per_sm(regs, num_warps, smem, C.H100_LIMITS)


def analyse(launch: Launch, workdir: Path) -> dict:
    k = compile_launch(launch)
    rep = ptxas_report(k.asm["ptx"], workdir)
    shared = max(rep["smem"], int(getattr(k.metadata, "shared", 0) or 0))
    mem = sass_memory_ops(k.asm["cubin"], workdir)
    row_ops = [o for o in mem if o["op"] in ("LDG", "STG", "LDGSTS") and not is_scratch(o["source"])]
    warps = launch.kwargs.get("num_warps", 4)
    consts = {k2: v for k2, v in launch.kwargs.items() if k2 in ("BLOCK_M", "BLOCK_N", "CHUNKS", "SINGLE")}
    grid = launch.grid if isinstance(launch.grid, tuple) else ()
    return {
        "kernel": launch.kernel.__name__,
        "grid": list(grid),
        "tile": consts,
        "num_warps": warps,
        "num_stages": launch.kwargs.get("num_stages"),
        "cooperative": bool(launch.kwargs.get("launch_cooperative_grid", False)),
        "regs": rep["regs"],
        "spill_bytes": rep["spill_st"] + rep["spill_ld"],
        "stack": rep["stack"],
        "smem": shared,
        "programs_per_sm": programs_per_sm(rep["regs"], warps, shared),
        "row_loads": _widths(row_ops, ("LDG",)),
        "row_stores": _widths(row_ops, ("STG",)),
        "cp_async": sum(1 for o in mem if o["op"] == "LDGSTS"),
        "cp_async_widths": _widths(row_ops, ("LDGSTS",)),
        "local": sum(1 for o in mem if o["op"] in ("LDL", "STL")),
        "narrow_row_ops": [f"{o['op']}.{o['bits']}: {o['source']}" for o in row_ops if o["bits"] < 128],
        "wait": split_row_wait(k.asm["ptx"]),
        "ptx": ptx_facts(k.asm["ptx"]),
    }


def ptx_facts(ptx: str) -> dict:
    """What the PTX says about rounding and caching: `int_round` counts the 0x7FFF (32767) that
    round_to's integer bf16 rounding adds (the interpreter's path: on a GPU the conversion must be
    the hardware's cvt.rn, so 0 there); evict_first / evict_last count the L2 eviction policies
    created for the streamed rows and the parameters."""
    return {
        "int_round": len(re.findall(r"\b32767\b", ptx)),
        "evict_first": len(re.findall(r"createpolicy\.\S*L2::evict_first", ptx)),
        "evict_last": len(re.findall(r"createpolicy\.\S*L2::evict_last", ptx)),
    }


def split_row_wait(ptx: str) -> dict:
    """How a split-row kernel's programs wait for each other, read from the PTX: the arrival is a
    release and the poll an acquire, both at GPU scope (the chunks of a row run on different SMs;
    CTA scope would order nothing between them), and the poll loop is bounded (a trap ends it)."""
    return {
        "release_gpu": len(re.findall(r"\b(?:red|atom)\.global\.gpu\.release\b", ptx)),
        "acquire_gpu": len(re.findall(r"\b(?:ld|atom)\.global\.gpu\.acquire\b", ptx)),
        "trap": len(re.findall(r"^\s*trap;", ptx, re.M)),
    }


def _widths(ops, kinds) -> dict[int, int]:
    out: dict[int, int] = {}
    for o in ops:
        if o["op"] in kinds:
            out[o["bits"]] = out.get(o["bits"], 0) + 1
    return dict(sorted(out.items(), reverse=True))


def problems(case: dict, res: dict) -> list[str]:
    """The CPU test's rules: no spills, and 16-byte row accesses wherever the hidden size allows."""
    out = []
    if res["spill_bytes"] or res["local"]:
        out.append(f"spills {res['spill_bytes']} bytes ({res['local']} local-memory instructions)")
    if case["N"] % 16 == 0 and res["narrow_row_ops"]:
        out.append("row accesses narrower than 16 bytes: " + "; ".join(sorted(set(res["narrow_row_ops"]))))
    if res["tile"].get("CHUNKS", 1) > 1:
        # Split rows wait for each other: co-resident only under a cooperative launch, their
        # partials published and read with GPU-scope release/acquire, the wait bounded, and no
        # cp.async prefetch (it could read a row's partials ahead of that row's wait).
        w = res["wait"]
        if not res["cooperative"]:
            out.append("split rows launched without launch_cooperative_grid")
        if not (w["release_gpu"] and w["acquire_gpu"] and w["trap"]):
            out.append(f"split-row wait is not a bounded GPU-scope release/acquire: {w}")
        if res["cp_async"]:
            out.append(f"split-row loop is software-pipelined ({res['cp_async']} cp.async)")
    return out


# ----------------------------------------------------------------------------------------------


def cases(hidden, dtypes, variants, passes, rows):
    for n in hidden:
        for dtype in dtypes:
            for op, w, b, r in variants:
                for p in passes:
                    yield {"op": op, "pass": p, "dtype": dtype, "M": rows, "N": n, "weight": w, "bias": b,
                           "residual": r}


def run(case_list, workdir: Path, progress=None, cache: dict | None = None) -> list[dict]:
    results = []
    cache = {} if cache is None else cache
    for i, case in enumerate(case_list, 1):
        launches = plan(case["op"], case["pass"], case["dtype"], case["M"], case["N"], case["weight"],
                        case["bias"], case["residual"])
        for j, launch in enumerate(launches):
            key = _variant_key(launch)
            if key not in cache:
                cache[key] = analyse(launch, workdir)
            res = dict(cache[key], grid=list(launch.grid) if isinstance(launch.grid, tuple) else [])
            row = dict(case, launch=j, **res)
            row["problems"] = problems(case, res)
            results.append(row)
        if progress:
            progress(i, len(case_list), case)
    return results


def bucket_rows(label: str) -> int:
    """A row count inside a launch-table row bucket ("<=2048" -> 2048, ">2048" -> 32768): any count
    in the bucket plans the same launch."""
    bound = int(label.lstrip("<=>"))
    return bound if label.startswith("<=") else max(ROWS, bound + 1)


def check_tile(key: tuple, tile: dict, workdir: Path, cache: dict | None = None, variants=None) -> list[dict]:
    """The static check of one launch-table tile: `key` = (arch, op, pass, dtype, hidden, rows label)
    is planned with `tile` forced for it (launch_table.forced), in each of TABLE_VARIANTS[op], and
    analysed like the grid. Each result row's problems also name a launch that did not use the
    tile (the table was not what the launcher read) or a split row too wide to be co-resident."""
    from normswap.errors import NormswapError
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T

    arch, op, pass_, dtype, hidden, label = key
    out = []
    with T.forced(key, tile, C.ROW_BUCKETS):
        for variant in variants or TABLE_VARIANTS[op]:
            case = next(cases((hidden,), (dtype,), (variant,), (pass_,), bucket_rows(label)))
            try:
                rows = run([case], workdir, cache=cache)
            except NormswapError as e:
                out.append(dict(case, launch=0, tile={}, problems=[f"cannot launch: {e}"]))
                continue
            for r in rows:
                used = (r["tile"].get("BLOCK_N"), r["num_warps"]) == (tile["block_n"], tile["num_warps"]) and (
                    r["tile"].get("CHUNKS", 1) > 1 or r["tile"].get("BLOCK_M") == tile["block_m"])
                if r["launch"] == 0 and not used:
                    r["problems"].append(f"the launch used {r['tile']} with {r['num_warps']} warps, not the table's "
                                         f"{tile}")
                out.append(r)
    return out


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
        key = (arch, *(e[f] for f in T.KEY_FIELDS))
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
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--ops", default="rms_norm,layer_norm")
    p.add_argument("--passes", default="fwd,bwd")
    p.add_argument("--rows", type=int, default=ROWS, help="row count the launch plan is made for (default 32768)")
    p.add_argument("--subset", choices=("ci",), default=None, help="the CPU test's representative subset")
    p.add_argument("--json", action="store_true", help="JSON on stdout instead of the table")
    p.add_argument("--summary", action="store_true", help="one line per (op, pass, dtype, hidden)")
    p.add_argument("--render", metavar="JSON", default=None, help="print the tables of a saved --json run")
    p.add_argument("--table", nargs="?", const="", default=None, metavar="PATH",
                   help="check every sm_90 entry of a launch table (default: the package's) instead of the grid")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        try:
            results = json.loads(Path(args.render).read_text())["results"]
        except (OSError, ValueError, KeyError) as e:
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
            if any(d not in DTYPE_NAMES for d in dtypes):
                raise ValueError(f"dtypes must be among {', '.join(DTYPE_NAMES)}")
            ops = set(args.ops.split(","))
            variants = [v for v in VARIANTS if v[0] in ops]
    except ValueError as e:
        print(f"kernel_static.py: {e}", file=sys.stderr)
        return 2
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
        print(json.dumps({"target": "sm_90 (H100 limits)", "rows": args.rows, "results": results,
                          "not_checked": others}, indent=1))
    else:
        shown = [r for r in results if "regs" in r]  # not the launches that could not be planned
        print(summary(shown) if args.summary else table(shown))
        for r in bad:
            print(f"FAIL {r['op']} {r['pass']} {r['dtype']} N={r['N']} {variant_name(r)} launch {r['launch']}: "
                  + " | ".join(r["problems"]))
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # compile for real; normswap would turn the interpreter on
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
