"""The static check of a kernel launch, without a GPU: what `normswap tune` holds every candidate
tile to, and what benchmarks/kernel_static.py reports for the whole benchmark grid.

A launch is found by running the library's own launchers on `meta` tensors with kernel launches
intercepted (so what is compiled is what the launch table and heuristics chose, never a copy of
them), compiled for a target GPU exactly as the JIT would (same constexprs, warps and options, the
launcher's argument types and 16-byte alignment specialisations), and read back:
- registers, spill bytes, stack and shared memory from ptxas (`-v`; the ptxas triton's JIT runs for the
  target: triton_bin),
- programs per SM, from registers, warps and shared memory against the target's per-SM limits,
- every global memory instruction in the PTX, with its width and the Triton source line it comes
  from (the .loc triton writes before each instruction): loads/stores of row elements (x,
  residual, y, h, dy, dx, weight, bias) are told from those of per-row statistics and fp32 scratch
  (rstd, mean, partial sums, arrival counters) by the names on that source line. Read from the
  PTX, not the SASS: ptxas keeps a global access's width, but the line table it writes for
  scheduled code is approximate (a 4-byte rstd copy was once attributed to the row-load helper
  when only the line numbers of another file had changed). Inside an inline-asm block (triton
  writes every global access as one) only the block's first .loc counts: newer LLVMs (triton
  3.9's) write one .loc per asm line, counting up from the op's line, so a v4 load's 4-line block
  would otherwise point 4 lines past its tl.load. Spills (local memory) are read from the SASS.
`problems` is the rule: no spills, 16-byte row accesses wherever the hidden size is a multiple of
16, split rows launched cooperatively with a bounded GPU-scope wait.

Beyond the grid's cases, `variant_cases` enumerates every way a caller reaches the kernels (from
the library's own tables: casting families, run dtypes, parameter layouts, the launchers' row
layouts; a `Variant` per case, which `plan` takes) and `sweep` compiles each distinct kernel
variant once (registers, spills, or the compiler's error): what a GPU session checks before it
spends device time (benchmarks/kernel_static.py --variants). `representatives` picks one case per
variant class for CI.

The target (`Target`) is a compute capability with its SM count and per-SM limits: an H100 (sm_90)
by default, the analysis benchmarks/kernel_static.py reports; the CUDA device at hand
(`device_target`) when `normswap tune` checks the candidates it is about to time there, so that an
A100's (sm_80) or a 4090's (sm_89) registers, spills and co-residency are what is judged.

It compiles for real, so it needs a process without TRITON_INTERPRET. Nothing here imports triton
or the kernels at module level: benchmarks/kernel_static.py imports this module before it turns
the interpreter off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import subprocess
import tempfile
from pathlib import Path

# The row count a launch is planned for where only a bucket is given (any count of a bucket plans
# the same launch).
ROWS = 32768
# The variants a launch-table entry is checked in (--table, and the tuner's candidates): the one
# the tuner times and the same with the fused residual (more registers). One entry serves
# every variant of its op and pass.
TABLE_VARIANTS = {"rms_norm": (("rms_norm", True, False, False), ("rms_norm", True, False, True)),
                  "layer_norm": (("layer_norm", True, True, False), ("layer_norm", True, True, True))}
# Source-line names of per-row statistics and scratch buffers: their accesses are exempt from the
# 16-byte rule (one fp32 per row, or a program's partial-sum row).
SCRATCH_NAMES = ("RSTD", "MEAN", "STAT", "PART", "DWP", "DBP", "SYNC", "COUNT")


@dataclasses.dataclass(frozen=True)
class Target:
    """What a static check compiles for and plans with: a compute capability (90 for sm_90) and
    the device's SM count and per-SM limits (registers, threads, shared memory, resident blocks:
    _common's occupancy rule). The blocks limit follows from the capability where not given."""

    capability: int
    sms: int
    regs: int
    threads: int
    smem: int
    blocks: int | None = None

    def __post_init__(self):
        if self.blocks is None:
            from normswap.kernels import _common as C

            object.__setattr__(self, "blocks", C.max_blocks_per_sm(self.capability))

    @property
    def arch(self) -> str:
        return f"sm_{self.capability}"

    @property
    def ptxas_arch(self) -> str:
        """The --gpu-name triton's JIT gives ptxas (sm_90a from Hopper on: the arch-specific set)."""
        return f"sm_{self.capability}" + ("a" if self.capability >= 90 else "")

    @property
    def limits(self) -> dict:
        return {"sms": self.sms, "regs": self.regs, "threads": self.threads, "smem": self.smem, "blocks": self.blocks}


def h100() -> Target:
    """The default target: sm_90 with an H100 SXM's limits (_common.H100_LIMITS)."""
    from normswap.kernels import _common as C

    return Target(90, **C.H100_LIMITS)


def device_target(index: int) -> Target:
    """The CUDA device `index` as a target: its compute capability, SM count and per-SM limits
    (what the launchers size persistent and split-row grids with on it)."""
    import torch

    from normswap.kernels import _common as C

    major, minor = torch.cuda.get_device_capability(index)
    return Target(10 * major + minor, **C._cuda_props(index))


def triton_bin(tool: str, capability: int = 90) -> Path:
    import triton

    if tool == "ptxas":
        # The ptxas triton's own JIT runs for this capability (and the TRITON_PTXAS_PATH kind of
        # override it honours): triton 3.6 gives sm_90 its CUDA 12.8 ptxas and only sm_100 on the
        # newer ptxas-blackwell (12.9); 3.9 gives sm_90 on ptxas-blackwell (13.4). Registers and
        # spills are read from the ptxas that builds the kernel, whatever the triton.
        try:
            from triton.backends.nvidia.compiler import get_ptxas

            return Path(get_ptxas(capability).path)
        except (ImportError, AttributeError, TypeError):
            pass
    base = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    # A triton without get_ptxas: ptxas-blackwell, where there is one, from sm_90 on (3.9's rule).
    if tool == "ptxas" and capability >= 90 and (base / "ptxas-blackwell").exists():
        return base / "ptxas-blackwell"
    return base / tool


@functools.cache
def ptxas_release(capability: int = 90) -> str:
    """The CUDA release ("12.8") of the ptxas the check runs for a capability (triton_bin): what
    the JIT's PTX ISA version follows from, so the two agree when the check runs the JIT's ptxas."""
    out = subprocess.run([str(triton_bin("ptxas", capability)), "--version"], capture_output=True, text=True,
                         check=True).stdout
    return re.search(r"release (\d+\.\d+)", out).group(1)


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
def recorded_launches(target: Target, fit: int | None = None):
    """Launches are recorded instead of run; the device the launchers size persistent grids for is
    the target (its SM count, and programs per SM from the kernel compiled for it: registers and
    shared memory against its limits, by the library's own rule). `fit`: programs the target holds
    of every kernel, assumed instead of compiled (only the grids depend on it, never a variant)."""
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
        if fit is not None:
            return fit
        launch = Launch(kernel, (1,), tuple(args), dict(kwargs))
        key = _variant_key(launch, target)
        if key not in _RESIDENT:
            k = compile_launch(launch, target)
            with tempfile.TemporaryDirectory() as tmp:
                rep = ptxas_report(k.asm["ptx"], Path(tmp), target)
            smem = max(rep["smem"], int(getattr(k.metadata, "shared", 0) or 0))
            _RESIDENT[key] = target.sms * programs_per_sm(rep["regs"], kwargs.get("num_warps", 4), smem, target)
        return _RESIDENT[key]

    KernelInterface.__getitem__ = getitem
    C.sm_count = lambda device: target.sms if device.type in ("meta", "cuda") else old_sms(device)
    if old_resident is not None:
        C.resident_programs = resident
    try:
        yield seen
    finally:
        KernelInterface.__getitem__ = old_getitem
        C.sm_count = old_sms
        if old_resident is not None:
            C.resident_programs = old_resident


def _variant_key(launch: Launch, target: Target):
    return (target, launch.kernel.__name__, tuple(sorted((k, str(v)) for k, v in launch.kwargs.items())),
            tuple("1" if _is_one(a) else _arg_type(a) for a in launch.args))


def _is_one(v) -> bool:
    """An integer argument of 1, which the JIT compiles as the constant 1 (unless the parameter is
    do_not_specialize): w_rows of per-column parameters, every launch but per-head ones."""
    return isinstance(v, int) and not isinstance(v, bool) and v == 1


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a caller reaches the kernels beyond (op, pass, dtype, shape, weight, bias, residual): the
    casting family, the parameters' dtype and layout, the residual stream's dtype, the output dtype,
    and which gradients the backward is asked for. A case planned with one runs the library's own
    forward launcher, then for "bwd" its own autograd wiring (the op's setup_context and backward
    formula: what it saves, which dtype dy and dh arrive in, which grads it skips), so the backward
    launched is the one autograd would launch after that forward. Dtypes are RUN_DTYPES names; None
    means x's dtype (out_dtype None: the op's own choice)."""

    casting: str = "llama"
    # Gemma's 1 + w: a runtime fp32 argument (do_not_specialize, like eps), so no variant of its own.
    offset: float = 0.0
    param_dtype: str | None = None
    heads: int = 0  # > 0: per-head (heads, N) parameters (PER_ROW_W), x's rows cycling over heads
    residual_dtype: str | None = None
    residual_in_fp32: bool = False
    out_dtype: str | None = None
    grad_params: bool = True  # False: frozen weight and bias (no dW / dB partial sums)
    grad_h: bool = True  # False: h = x + residual is not used downstream (no dh reaches the backward)

    def label(self) -> str:
        parts = [self.casting]
        if self.param_dtype:
            parts.append(f"p={self.param_dtype}")
        if self.heads:
            parts.append(f"heads={self.heads}")
        if self.residual_dtype:
            parts.append(f"r={self.residual_dtype}")
        if self.residual_in_fp32:
            parts.append("h=fp32")
        if self.out_dtype:
            parts.append(f"out={self.out_dtype}")
        if not self.grad_params:
            parts.append("frozen")
        if not self.grad_h:
            parts.append("no-dh")
        return ",".join(parts)


class _Ctx:
    """Stands in for autograd's ctx when an op's setup_context and backward formula are run."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value):
        pass


def _plan_variant(op, pass_, x, weight, bias, residual, v: Variant, seen: list) -> None:
    """The launches of one case with a Variant: the forward launcher, then (pass "bwd", forward
    launches dropped) the op's autograd formula with its backward op run as the launcher."""
    import torch

    from normswap.dtypes import DTYPES
    from normswap.kernels import layer_norm as L
    from normswap.kernels import rms_norm as R

    m, n = x.shape
    pdt = DTYPES[v.param_dtype] if v.param_dtype else x.dtype
    shape = (v.heads, n) if v.heads else (n,)
    w = torch.empty(shape, device="meta", dtype=pdt) if weight else None
    b = torch.empty(shape, device="meta", dtype=pdt) if bias else None
    r = torch.empty(m, n, device="meta", dtype=DTYPES[v.residual_dtype] if v.residual_dtype else x.dtype) \
        if residual else None
    out = DTYPES[v.out_dtype] if v.out_dtype else None
    if op == "rms_norm":
        mod, bwd_op = R, "rms_norm_bwd"
        inputs = (x, w, r, 1e-6, v.offset, v.casting, out, v.residual_in_fp32)
        outputs = R._rms_forward(*inputs)
        grads = (True, v.grad_params, True, False, False, False, False, False)
    else:
        mod, bwd_op = L, "layer_norm_bwd"
        inputs = (x, w, b, r, 1e-5, v.offset, out, v.residual_in_fp32)
        outputs = L._ln_forward(*inputs)
        grads = (True, v.grad_params, v.grad_params, True, False, False, False, False)
    if pass_ == "fwd":
        return
    seen.clear()
    ctx = _Ctx(grads)
    mod._setup_context(ctx, inputs, outputs)
    dy = torch.empty_like(outputs[0])
    dh = torch.empty_like(outputs[1]) if residual and v.grad_h else None
    op_def = getattr(mod, bwd_op)
    setattr(mod, bwd_op, op_def._init_fn)  # the op's own implementation: the launcher, launches recorded
    try:
        mod._backward(ctx, dy, dh, *(None,) * (len(outputs) - 2))
    finally:
        setattr(mod, bwd_op, op_def)


def plan(op: str, pass_: str, dtype: str, m: int, n: int, weight: bool, bias: bool, residual: bool,
         target: Target | None = None, variant: Variant | None = None, fit: int | None = None) -> list[Launch]:
    """The kernel launches the library makes for one case (forward, or the backward alone) on the
    target (default: an H100). Without a `variant`: llama casting, parameters of x's dtype, and the
    backward launcher called with every grad (dh and a separate residual grad included); with one:
    see Variant. `fit`: as recorded_launches takes it."""
    import torch

    from normswap.dtypes import DTYPES
    from normswap.kernels import layer_norm as L
    from normswap.kernels import rms_norm as R

    dt = DTYPES[dtype]
    meta = dict(device="meta", dtype=dt)
    x = torch.empty(m, n, **meta)
    if variant is not None:
        with recorded_launches(target or h100(), fit) as seen:
            _plan_variant(op, pass_, x, weight, bias, residual, variant, seen)
        return seen
    w = torch.empty(n, **meta) if weight else None
    b = torch.empty(n, **meta) if bias else None
    r = torch.empty(m, n, **meta) if residual else None
    stat = dict(device="meta", dtype=torch.float32)
    with recorded_launches(target or h100(), fit) as seen:
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


def compile_launch(launch: Launch, target: Target | None = None):
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
        if _is_one(v) and not param.do_not_specialize:
            sig[name] = "constexpr"
            consts[name] = 1
            continue
        ty, div16 = _arg_type(v)
        sig[name] = ty
        if div16 and not param.do_not_specialize and not param.do_not_specialize_on_alignment:
            attrs[(i,)] = [["tt.divisibility", 16]]
    capability = (target or h100()).capability
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", capability, 32), options=options)


_PTXAS_RE = {
    "regs": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_st": re.compile(r"(\d+) bytes spill stores"),
    "spill_ld": re.compile(r"(\d+) bytes spill loads"),
    "smem": re.compile(r"(\d+) bytes smem"),
}
# The opcode must end at a dot or a space: LDGDEPBAR (a cp.async fence) is no load.
_MEM_RE = re.compile(r"\b(LDGSTS|LDG|STG|LDL|STL|ATOMG|REDG|RED|ATOM)((?:\.[A-Z0-9_]+)*)(?=\s)")


@functools.cache
def _jit_ptxas_flags() -> tuple[str, ...]:
    """The register-allocation flag triton's own JIT gives ptxas, where it gives one (3.9 adds
    --regAllocOptLevel=2 to work around a ptxas bug; 3.6 gives none): registers and spills are read
    as the JIT of the triton at hand gets them, not another version's."""
    import inspect

    from triton.backends.nvidia import compiler

    flag = "--regAllocOptLevel=2"
    return (flag,) if flag in inspect.getsource(compiler) else ()


def ptxas_report(ptx: str, workdir: Path, target: Target | None = None) -> dict:
    target = target or h100()
    src = workdir / "k.ptx"
    src.write_text(ptx)
    out = subprocess.run([str(triton_bin("ptxas", target.capability)), "-lineinfo", *_jit_ptxas_flags(), "-v",
                          f"--gpu-name={target.ptxas_arch}", str(src), "-o", str(workdir / "k.o")],
                         capture_output=True, text=True, check=True)
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


_PTX_FILE_RE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', re.M)
_PTX_LOC_RE = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\b")
# A global access as the SASS names it: ld / st / cp.async (global to shared) / atom / red.
_PTX_MEM_RE = re.compile(r"\b(ld\.global|st\.global|cp\.async\.c[ag]\.shared\.global|atom\.global|red\.global)(\S*)")
_PTX_OP = {"ld.global": "LDG", "st.global": "STG", "atom.global": "ATOMG", "red.global": "REDG"}
_CP_SIZE_RE = re.compile(r",\s*(0x[0-9a-fA-F]+|\d+)\s*[,;]")
_PTX_ASM_RE = re.compile(r"^\s*// (begin|end) inline asm\s*$")


def _ptx_width_bits(suffixes: str) -> int:
    """Access width from a PTX global op's suffixes (.v4.b32: 128; .b16: 16)."""
    vec = re.search(r"\.v(\d)\b", suffixes)
    elem = re.findall(r"\.[bfsu](8|16|32|64)\b", suffixes)
    return (int(vec.group(1)) if vec else 1) * (int(elem[-1]) if elem else 32)


def _source_file(path: str) -> Path:
    """The file a PTX `.file` names, as this process has it where it is one of normswap's kernel
    modules. Triton's compile cache is shared by every checkout on a machine and keyed by the
    kernels' source text and line numbers, not their path: a launch first compiled in another
    checkout (since changed or removed) names that checkout's files, whose lines are this one's."""
    named = Path(path)
    here = Path(__file__).with_name(named.name)
    return here if named.parent.parts[-2:] == ("normswap", "kernels") and here.exists() else named


def ptx_memory_ops(ptx: str) -> list[dict]:
    """Every global memory instruction of the PTX: {op (its SASS name), bits, line text}."""
    files = {int(n): path for n, path in _PTX_FILE_RE.findall(ptx)}
    sources: dict[str, list[str]] = {}
    ops, where = [], None
    in_asm = asm_started = False  # inside an inline-asm block; past its first instruction or .loc
    for line in ptx.splitlines():
        asm = _PTX_ASM_RE.match(line)
        if asm:
            in_asm, asm_started = asm.group(1) == "begin", False
            continue
        loc = _PTX_LOC_RE.match(line)
        if loc:
            # A block's own op is where its first line says; the .loc lines after it count up from
            # there one per asm line (LLVM's numbering of the asm text, no source line).
            if not (in_asm and asm_started):
                where = (files.get(int(loc.group(1))), int(loc.group(2)))
            asm_started = in_asm
            continue
        asm_started = in_asm and (asm_started or bool(line.strip()))
        hit = _PTX_MEM_RE.search(line.split("//")[0])
        if not hit:
            continue
        if hit.group(1).startswith("cp.async"):
            op, size = "LDGSTS", _CP_SIZE_RE.search(line)
            bits = int(size.group(1), 0) * 8 if size else 32
        else:
            op, bits = _PTX_OP[hit.group(1)], _ptx_width_bits(hit.group(2))
        text = ""
        if where is not None and where[0]:
            if where[0] not in sources:
                try:
                    sources[where[0]] = _source_file(where[0]).read_text().splitlines()
                except OSError:
                    sources[where[0]] = []
            lines = sources[where[0]]
            text = lines[where[1] - 1].strip() if 0 < where[1] <= len(lines) else ""
        ops.append({"op": op, "bits": bits, "source": text})
    return ops


def sass_memory_ops(cubin: bytes, workdir: Path) -> list[dict]:
    """Every global/local memory instruction of the machine code: {op, bits} (what it is and how
    wide; which source line, ptx_memory_ops says exactly)."""
    path = workdir / "k.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([str(triton_bin("nvdisasm")), "-c", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return [{"op": hit.group(1), "bits": _width_bits(hit.group(2))}
            for hit in map(_MEM_RE.search, out.splitlines()) if hit]


def is_scratch(source: str) -> bool:
    return any(name in source for name in SCRATCH_NAMES)


def programs_per_sm(regs: int, num_warps: int, smem: int, target: Target | None = None) -> int:
    """Programs one SM of the target (default: an H100) holds at once (the library's own
    occupancy rule)."""
    from normswap.kernels import _common as C

    return C.programs_per_sm(regs, num_warps, smem, (target or h100()).limits)


_PTX_TARGET_RE = re.compile(r"^\s*\.target\s+(sm_\w+)", re.M)


def analyse(launch: Launch, workdir: Path, target: Target | None = None) -> dict:
    target = target or h100()
    k = compile_launch(launch, target)
    rep = ptxas_report(k.asm["ptx"], workdir, target)
    shared = max(rep["smem"], int(getattr(k.metadata, "shared", 0) or 0))
    mem = sass_memory_ops(k.asm["cubin"], workdir)
    row_ops = [o for o in ptx_memory_ops(k.asm["ptx"])
               if o["op"] in ("LDG", "STG", "LDGSTS") and not is_scratch(o["source"])]
    warps = launch.kwargs.get("num_warps", 4)
    consts = {k2: v for k2, v in launch.kwargs.items() if k2 in ("BLOCK_M", "BLOCK_N", "CHUNKS", "SINGLE")}
    grid = launch.grid if isinstance(launch.grid, tuple) else ()
    ptx_target = _PTX_TARGET_RE.search(k.asm["ptx"])
    return {
        "kernel": launch.kernel.__name__,
        "target": ptx_target.group(1) if ptx_target else None,  # what the PTX was generated for
        "grid": list(grid),
        "tile": consts,
        "num_warps": warps,
        "num_stages": launch.kwargs.get("num_stages"),
        "cooperative": bool(launch.kwargs.get("launch_cooperative_grid", False)),
        "regs": rep["regs"],
        "spill_bytes": rep["spill_st"] + rep["spill_ld"],
        "stack": rep["stack"],
        "smem": shared,
        "programs_per_sm": programs_per_sm(rep["regs"], warps, shared, target),
        "row_loads": _widths(row_ops, ("LDG",)),
        "row_stores": _widths(row_ops, ("STG",)),
        "cp_async": sum(1 for o in mem if o["op"] == "LDGSTS"),
        "cp_async_widths": _widths(row_ops, ("LDGSTS",)),
        "local": sum(1 for o in mem if o["op"] in ("LDL", "STL")),
        "narrow_row_ops": [f"{o['op']}.{o['bits']}: {o['source']}" for o in row_ops if o["bits"] < 128],
        "wait": split_row_wait(k.asm["ptx"]),
        "ptx": ptx_facts(k.asm["ptx"]),
        "ttgir": ttgir_facts(k.asm["ttgir"]),
    }


# A load the software pipeliner turns into an asynchronous copy (the persistent backward's row
# loads, num_stages > 1) keeps its eviction policy in the TTGIR (ttg.async_copy_global_to_local);
# whether that policy reaches the machine code is the NVIDIA lowering's choice. triton 3.6.0, 3.7.1
# and 3.8.0 lower the copy to a plain cp.async.cg, dropping it (compiled for sm_90 here); 3.9.0
# emits createpolicy + cp.async...L2::cache_hint, and only for PTX ISA 9.4 on: upstream turned
# policies on cp.async off around a ptxas miscompile (triton-lang/triton#11660) and back on for
# PTX 9.4, ptxas 13.4 (#11848). Without the hint the streamed rows pass through L2 at the normal
# priority (benchmarks/README.md, Pre-flight).
CP_ASYNC_HINTS_SINCE = {"triton": (3, 9), "ptx": (9, 4)}


def _major_minor(version: str) -> tuple[int, int]:
    hit = re.match(r"(\d+)\.(\d+)", version)
    return (int(hit.group(1)), int(hit.group(2))) if hit else (0, 0)


def cp_async_hints(triton_version: str, ptx_version: str) -> bool:
    """Whether this triton, writing this PTX ISA version, carries a load's L2 eviction policy onto
    the cp.async copies the software pipeliner makes of it (CP_ASYNC_HINTS_SINCE)."""
    return (_major_minor(triton_version) >= CP_ASYNC_HINTS_SINCE["triton"]
            and _major_minor(ptx_version) >= CP_ASYNC_HINTS_SINCE["ptx"])


_PTX_VERSION_RE = re.compile(r"^\s*\.version\s+(\d+\.\d+)", re.M)
# One cp.async copy (not its commit/wait): 16-byte ones are row elements (cp.async.cg moves only
# 16), the 4-byte ones a row's statistic.
_CP_ASYNC_RE = re.compile(r"\bcp\.async\.c[ag]\.shared\S*\s[^;]*;")


def ptx_facts(ptx: str) -> dict:
    """What the PTX says about rounding and caching: `int_round` counts the 0x7FFF (32767) that
    round_to's integer bf16 rounding adds (the interpreter's path: on a GPU the conversion must be
    the hardware's cvt.rn, so 0 there); evict_first / evict_last count the L2 eviction policies
    created for the streamed rows and the parameters; cp_async_rows counts the 16-byte cp.async
    copies (pipelined row loads) and cp_async_rows_hinted those that carry an L2 cache policy
    (.L2::cache_hint: see CP_ASYNC_HINTS_SINCE); version is the PTX ISA version."""
    version = _PTX_VERSION_RE.search(ptx)
    rows = [c for c in _CP_ASYNC_RE.findall(ptx) if re.search(r",\s*(?:0x10|16)\s*[,;]", c)]
    return {
        "version": version.group(1) if version else None,
        "int_round": len(re.findall(r"\b32767\b", ptx)),
        "evict_first": len(re.findall(r"createpolicy\.\S*L2::evict_first", ptx)),
        "evict_last": len(re.findall(r"createpolicy\.\S*L2::evict_last", ptx)),
        "cp_async_rows": len(rows),
        "cp_async_rows_hinted": sum(1 for c in rows if "L2::cache_hint" in c),
    }


def ttgir_facts(ttgir: str) -> dict:
    """The pipeliner's asynchronous copies in the TTGIR, and how many of them keep the evict_first
    policy the kernel's tl.load asked for (what the lowering then keeps or drops: ptx_facts)."""
    copies = re.findall(r"ttg\.async_copy_global_to_local\b[^\n]*", ttgir)
    return {"async_copies": len(copies), "async_copies_evict_first": sum(1 for c in copies if "evict_first" in c)}


def unhinted_copies(rows) -> list[dict]:
    """The analysed launches (analyse) or swept variants (sweep) whose pipelined row loads are
    cp.async copies without an L2 cache policy (CP_ASYNC_HINTS_SINCE)."""
    return [r for r in rows if r.get("ptx") and r["ptx"]["cp_async_rows"] > r["ptx"]["cp_async_rows_hinted"]]


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


def row_layout(block_m: int, chunks: int) -> str:
    """The row layout of a tile: "split" (a row over several programs), "rows" (several rows per
    program) or "row" (one whole row). Of a planned tile (regimes) and of a launch's constexprs
    (variant_classes) alike."""
    return "split" if chunks > 1 else "rows" if block_m > 1 else "row"


def regimes(op: str, pass_: str, dtype: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(row layout, row bucket) -> (rows, hidden) that the launcher lays out that way on the plan's
    target: "rows" (several rows per program), "row" (one whole row), "split" (a row over several
    programs), for every row bucket (few/many rows: other tiles), each at the first hidden size of
    the benchmark grid that gives it, and "ragged" (the first, one column short: a hidden size that
    is no multiple of 16, so no 16-byte divisibility on N and the strides). Read from the launch
    table and heuristics the launcher itself reads (_common.launch_config), never a copy."""
    import torch

    from normswap.dtypes import DTYPES
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T
    from normswap.kernels import layer_norm as L
    from normswap.kernels import rms_norm as R
    from normswap.kernels.timing import HIDDEN

    kernel = {("rms_norm", "fwd"): R._rms_fwd_kernel, ("rms_norm", "bwd"): R._rms_bwd_kernel,
              ("layer_norm", "fwd"): L._ln_fwd_kernel, ("layer_norm", "bwd"): L._ln_bwd_kernel}[(op, pass_)]
    out = {}
    for label in T.bucket_labels(C.ROW_BUCKETS):
        m = bucket_rows(label)
        for n in HIDDEN:
            tile = C.launch_config(m, n, DTYPES[dtype], pass_, kernel, torch.device("meta"))
            out.setdefault((row_layout(tile.block_m, tile.chunks), label), (m, n))
        first = min(n for (_, lab), (_, n) in out.items() if lab == label)
        out[("ragged", label)] = (m, first - 1)
    return out


# What the enumeration covers ("library": every launch a patched model makes; "api": also what only
# the functional API reaches): see variant_cases.
SCOPES = ("library", "api")
# Per-head parameters: heads of a (heads, N) weight (Cohere's q/k LayerNorm); one count that is a
# multiple of 16 and one that is not (the JIT specialises integer arguments on 16-divisibility).
HEADS = (8, 16)
# The row layouts the functional API's own options are crossed with: one per code path of the
# kernels (CHUNKS == 1, CHUNKS > 1); the tile shapes themselves are the library scope's.
API_LAYOUTS = ("rows", "split")


def variant_cases(scope: str = "library", ops=None, passes=None, dtypes=None, layouts=None) -> list[dict]:
    """Every case (a dict of `cases`, with its Variant under "variant" and its row layout under
    "layout") whose launches make up the kernel variants a GPU run can compile, from the library's
    own tables: the ops and passes of the launch table, the run dtypes, the casting families
    (specs.CASTINGS), parameters absent / per-column / per-head in every run dtype, residual absent
    or present, frozen or trained parameters, dh present or absent, over every row layout
    (`regimes`). scope "library": the residual in x's dtype, no out_dtype, h in the stream's dtype
    (what normswap.fuse and the patched modules call); "api": also every residual dtype,
    residual_in_fp32 and out_dtype the functional API accepts (in API_LAYOUTS). Distinct cases may share launches:
    `sweep` compiles each kernel variant once (_variant_key)."""
    import itertools

    from normswap.dtypes import RUN_DTYPES
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T
    from normswap.specs import CASTINGS

    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}")
    out = []
    for op in ops or T.OPS:
        forms = ((False, False), (True, False)) if op == "rms_norm" else tuple(itertools.product((False, True),
                                                                                                  repeat=2))
        for pass_ in passes or T.PASSES:
            for dtype in dtypes or RUN_DTYPES:
                for (layout, label), (m, n) in regimes(op, pass_, dtype).items():
                    if layouts and layout not in layouts:
                        continue
                    case = {"op": op, "pass": pass_, "dtype": dtype, "M": m, "N": n, "layout": layout,
                            "rows_bucket": label}
                    for (weight, bias), residual in itertools.product(forms, (False, True)):
                        params = weight or bias
                        castings = CASTINGS if op == "rms_norm" and weight else ("none",)
                        grads = list(itertools.product((True, False) if pass_ == "bwd" and params else (True,),
                                                       (True, False) if pass_ == "bwd" and residual else (True,)))
                        form = dict(case, weight=weight, bias=bias, residual=residual)
                        for casting, pdt, heads, (gp, gh) in itertools.product(
                                castings, RUN_DTYPES if params else (None,), (0, *HEADS) if params else (0,), grads):
                            out.append(dict(form, variant=Variant(casting=casting, param_dtype=pdt, heads=heads,
                                                                  grad_params=gp, grad_h=gh)))
                        if scope != "api" or label != T.bucket_labels(C.ROW_BUCKETS)[-1] or layout not in API_LAYOUTS:
                            continue
                        # What only the functional API reaches, in the many-rows layouts: every
                        # residual dtype, h kept in fp32, every out_dtype, with parameters of x's
                        # dtype per column (their own dimensions are the library's, above). With
                        # those parameters the families differ only in whether h * rstd is rounded
                        # to x's dtype before the weight (llama) or not (none).
                        for casting, rdt, rif, odt, (gp, gh) in itertools.product(
                                [c for c in castings if c in ("llama", "none")], RUN_DTYPES if residual else (None,), (False, True) if residual else (False,),
                                (None, *RUN_DTYPES), grads):
                            if (rdt in (None, dtype)) and not rif and odt is None:
                                continue  # the library's own case
                            out.append(dict(form, variant=Variant(casting=casting, residual_dtype=rdt,
                                                                  residual_in_fp32=rif, out_dtype=odt,
                                                                  grad_params=gp, grad_h=gh)))
    return out


def signature(launch: Launch) -> dict:
    """A launch's kernel variant in words: its constexprs and launch options, and the type (with
    ":16" where it is 16-divisible) of each runtime argument, by parameter name."""
    consts = dict(launch.kwargs)
    params = [p for p in launch.kernel.params if p.name not in consts]
    types = {}
    for param, v in zip(params, launch.args, strict=True):
        if _is_one(v) and not param.do_not_specialize:
            types[param.name] = "=1"
            continue
        ty, div16 = _arg_type(v)
        special = div16 and ty[0] != "*" and not (param.do_not_specialize or param.do_not_specialize_on_alignment)
        types[param.name] = ty + (":16" if special else "")
    return {"kernel": launch.kernel.__name__, "constexprs": consts, "args": types}


def sweep(case_list, workdir: Path, target: Target | None = None, on_case=None) -> list[dict]:
    """Compile every distinct kernel variant (_variant_key) the cases launch, once, for the target
    (default: an H100) and read ptxas' registers and spills: one row per variant, with the first case
    that launched it and how many cases did, and its error where planning or compiling failed (a
    case whose planning failed is a row of its own: the split-row launchers compile while they plan).
    on_case(i, total, case, rows so far) after each case."""
    import time

    target = target or h100()
    rows: dict = {}
    out: list[dict] = []

    def where(case):
        return {k: (v.label() if isinstance(v, Variant) else v) for k, v in case.items()}

    for i, case in enumerate(case_list, 1):
        try:
            launches = plan(case["op"], case["pass"], case["dtype"], case["M"], case["N"], case["weight"],
                            case["bias"], case["residual"], target, case.get("variant"))
        except Exception as e:  # noqa: BLE001 - a failure to plan is a finding, reported with its case
            out.append({"case": where(case), "kernel": None, "error": f"planning failed: {type(e).__name__}: {e}"})
            launches = []
        for launch in launches:
            key = _variant_key(launch, target)
            if key in rows:
                rows[key]["cases"] += 1
                continue
            row = {"case": where(case), **signature(launch), "cases": 1, "error": None}
            t0 = time.perf_counter()
            try:
                k = compile_launch(launch, target)
                rep = ptxas_report(k.asm["ptx"], workdir, target)
                row.update(regs=rep["regs"], spill_bytes=rep["spill_st"] + rep["spill_ld"], stack=rep["stack"],
                           ptx=ptx_facts(k.asm["ptx"]))
            except Exception as e:  # noqa: BLE001 - any compiler error is the finding
                row["error"] = f"{type(e).__name__}: {str(e).strip()[-2000:]}"
            row["seconds"] = round(time.perf_counter() - t0, 3)
            rows[key] = row
            out.append(row)
        if on_case:
            on_case(i, len(case_list), case, out)
    return out


# Constexprs that only size the tile: a variant class is its code path (the other constexprs, the
# argument types, the row layout), whatever tile the layout gets.
TILE_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "CHUNKS", "CHUNKS_P2", "num_warps", "num_stages", "NUM_STAGES")


def variant_classes(launch: Launch) -> set:
    """The variant classes one launch belongs to: each of its kernel's constexpr values (tile sizes
    aside) and argument types (with their 16-divisibility), each alone and in its row layout (a
    code path can compile in one layout and not in another: the split-row loop is its own), and
    each tensor's dtype with the rows' dtype."""
    sig = signature(launch)
    k = sig["kernel"]
    where = row_layout(launch.kwargs.get("BLOCK_M", 1), launch.kwargs.get("CHUNKS", 1))
    singles = {(k, name, str(v)) for name, v in sig["constexprs"].items() if name not in TILE_CONSTEXPRS}
    singles |= {(k, name, ty) for name, ty in sig["args"].items()}
    # Each tensor's dtype against the rows' own (x forward, the saved input backward): the
    # conversions between them are code of their own (h kept in fp32 on a bf16 stream, dy in fp32
    # for bf16 rows, an fp32 weight on fp16 rows).
    rows = sig["args"]["X" if "X" in sig["args"] else "Z"]
    pairs = {(k, "rows " + rows, name, ty) for name, ty in sig["args"].items() if ty.startswith("*")}
    return {(k, "layout", where)} | singles | {(where, *f) for f in singles} | pairs


def representatives(case_list, covered=(), target: Target | None = None) -> tuple[list[dict], set]:
    """A few cases of case_list whose launches together belong to every variant class
    (variant_classes) that the launches of case_list do, less those the `covered` cases' launches
    already compile: picked greedily (most new classes first, ties to the earlier case), planned
    without compiling (`fit`). Returns (the cases, every class of case_list)."""
    target = target or h100()

    def classes(case):
        launches = plan(case["op"], case["pass"], case["dtype"], case["M"], case["N"], case["weight"], case["bias"],
                        case["residual"], target, case.get("variant"), fit=target.sms)
        return set().union(*(variant_classes(launch) for launch in launches))

    firsts: dict = {}  # class set -> the first case with it
    for case in case_list:
        firsts.setdefault(frozenset(classes(case)), case)
    every = set().union(*firsts)
    have = set().union(*(classes(c) for c in covered)) if covered else set()
    todo = list(firsts.items())
    picked = []
    while True:
        todo = [(cl - have, case) for cl, case in todo if cl - have]
        if not todo:
            return picked, every
        best = max(todo, key=lambda t: len(t[0]))  # the first of the largest
        picked.append(best[1])
        have |= best[0]


def cases(hidden, dtypes, variants, passes, rows):
    for n in hidden:
        for dtype in dtypes:
            for op, w, b, r in variants:
                for p in passes:
                    yield {"op": op, "pass": p, "dtype": dtype, "M": rows, "N": n, "weight": w, "bias": b,
                           "residual": r}


def run(case_list, workdir: Path, on_case=None, cache: dict | None = None,
        target: Target | None = None) -> list[dict]:
    """Analyse every launch of each case (a dict of `cases`) for the target (default: an H100);
    on_case(i, total, case) after each."""
    results = []
    cache = {} if cache is None else cache
    target = target or h100()
    for i, case in enumerate(case_list, 1):
        launches = plan(case["op"], case["pass"], case["dtype"], case["M"], case["N"], case["weight"],
                        case["bias"], case["residual"], target)
        for j, launch in enumerate(launches):
            key = _variant_key(launch, target)
            if key not in cache:
                cache[key] = analyse(launch, workdir, target)
            res = dict(cache[key], grid=list(launch.grid) if isinstance(launch.grid, tuple) else [])
            row = dict(case, launch=j, **res)
            row["problems"] = problems(case, res)
            results.append(row)
        if on_case:
            on_case(i, len(case_list), case)
    return results


def bucket_rows(label: str) -> int:
    """A row count inside a launch-table row bucket ("<=2048" -> 2048, ">2048" -> 32768): any count
    in the bucket plans the same launch."""
    bound = int(label.lstrip("<=>"))
    return bound if label.startswith("<=") else max(ROWS, bound + 1)


def check_tile(key: tuple, tile: dict, workdir: Path, cache: dict | None = None, variants=None,
               target: Target | None = None) -> list[dict]:
    """The static check of one launch-table tile: `key` = (arch, op, pass, dtype, hidden, rows label)
    is planned with `tile` forced for it (launch_table.forced), in each of TABLE_VARIANTS[op], and
    analysed like the grid, for the target (default: an H100; the key's arch is the plan's lookup
    key, _common.PLAN_ARCH for meta tensors). Each result row's problems also name a launch that
    did not use the tile (the table was not what the launcher read) or a split row too wide to be
    co-resident on the target."""
    from normswap.errors import NormswapError
    from normswap.kernels import _common as C
    from normswap.kernels import launch_table as T

    arch, op, pass_, dtype, hidden, label = key
    out = []
    with T.forced(key, tile, C.ROW_BUCKETS):
        for variant in variants or TABLE_VARIANTS[op]:
            case = next(cases((hidden,), (dtype,), (variant,), (pass_,), bucket_rows(label)))
            try:
                rows = run([case], workdir, cache=cache, target=target)
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
