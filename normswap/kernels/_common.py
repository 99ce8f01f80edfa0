"""Plumbing shared by the Triton norm ops: dtype codes and exact rounding, the launch table,
the split-row synchronisation, argument checks, the launchers and fake impls of both op pairs, and
the answer to "do Triton kernels run here?".

Why explicit rounding: every intermediate cast that a norm family performs (Llama rounds the
normalized value to the input dtype, T5 to a half weight's dtype, the residual sum to the stream's
dtype) is done in-kernel with round-to-nearest-even, then kept in fp32. On GPUs that is the
hardware conversion (cvt.rn); the Triton CPU interpreter *truncates* fp32 -> bf16, so there bf16
is rounded with integer ops instead, which give the same bits. Values reaching a store are then
already representable in the destination dtype and every store is exact.

How rows are laid out over programs (see launch_config):
- a row that fits one program's registers (forward <= 16,384 elements, backward <= 8,192) is one
  tile; short rows share a program (BLOCK_M rows);
- a wider row is split into CHUNKS column chunks, one per program, and read once: each program
  publishes its chunk's partial statistics, waits until every chunk of the row has, then combines
  all of them in a fixed order (so every program of the row computes bit-identical statistics, run
  after run: no atomics touch the values). The wait needs all programs of a row resident at once,
  so these launches are persistent and cooperative (the driver refuses a grid that cannot be
  co-resident, instead of hanging). The CPU interpreter runs programs one after another, so there
  the same kernel runs twice: PHASE 1 publishes the partials, PHASE 2 combines them.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from normswap.dtypes import DTYPES, RUN_DTYPES
from normswap.errors import NormswapError
from normswap.kernels import launch_table

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# dtype -> code understood by round_to(); 0 means "fp32: nothing to round".
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CODE_DTYPE = {code: dtype for dtype, code in DTYPE_CODE.items()}

# Widest row one program holds in registers, forward (the backward holds dy and the input: half).
# Wider rows are split into chunks of half that width over several programs. Module level so that
# tests can shrink it and exercise the split-row path on small, fast shapes.
MAX_BLOCK_N = 16384
# Elements per program tile on the CPU interpreter: it pays per program and per op, not per
# element, so big multi-row tiles are what make interpreter tests fast.
INTERPRETER_TILE = 1 << 16
# Row groups of a split-row launch on the interpreter: two, so the persistent loop is exercised.
INTERPRETER_ROW_GROUPS = 2

# Polls of a row's arrival counter before a split-row program gives up and traps (~1 us each: tens
# of seconds, against microseconds for a real wait). Cooperative launches make the wait finite;
# this bound is the safety net if that guarantee is ever lost (a launcher that drops the flag).
SPIN_LIMIT = tl.constexpr(1 << 24)

# Tests set this to True: every output buffer then starts as NaN (poisoned), so an element a
# kernel forgets to write cannot pass for a correct one.
POISON_OUTPUTS = False


def interpreting(kernel) -> bool:
    """True when `kernel` (a @triton.jit function) was built for the CPU interpreter, which triton
    decides from TRITON_INTERPRET when the decorator runs. Asked by launch planning, of the kernel
    at hand (tests plan GPU launches in an interpreter process with stand-ins for compiled kernels)."""
    return type(kernel).__name__ == "InterpretedFunction"


@triton.jit
def _probe():
    pass


# Whether this process's kernels run on the interpreter (triton decides once, at import): what the
# functional API's checks ask. Never asked of a kernel there: torch.compile traces those checks,
# and its tracer models a GPU kernel as an object with no Python type (type() of one breaks a
# fullgraph=True trace; found natively on an H100).
INTERPRETED = interpreting(_probe)

# Hardware fp32 -> bf16 conversion (round-to-nearest-even) on GPUs; integer rounding on the
# interpreter, whose cast truncates. Decided once per process, like TRITON_INTERPRET itself.
HW_ROUND = tl.constexpr(not INTERPRETED)


@triton.jit
def round_to(x, CODE: tl.constexpr):
    """Round fp32 `x` to fp16 (CODE 1) or bf16 (CODE 2), round-to-nearest-even, returned as fp32.
    CODE 0 returns x unchanged."""
    if CODE == 1:
        return x.to(tl.float16).to(tl.float32)
    elif CODE == 2:
        if HW_ROUND:
            return x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
        else:
            bits = x.to(tl.uint32, bitcast=True)
            # Add half an ulp of bf16 (minus one when the kept lsb is 0: ties go to even), then drop
            # the low 16 bits. NaNs are passed through (their payload could otherwise round to inf).
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            bits = (bits >> 16) << 16
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x


@triton.jit
def rounded_product(a, b):
    """a * b in fp32, rounded before any use. The GPU compiler otherwise fuses a product into the
    add or subtract that consumes it (an FMA, which never rounds the product) while the same product
    feeds a sum elsewhere rounded: two values that should be equal then differ by a rounding error.
    An explicitly rounded PTX multiply is one it may not fuse. The interpreter never fuses."""
    if HW_ROUND:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def load_param(P, rows, row_ok, cols, col_ok, w_rows, N, PER_ROW: tl.constexpr):
    """A per-column parameter in fp32, as a (len(rows), len(cols)) tile: P[cols] on every row, or
    with PER_ROW the row of a (w_rows, N) matrix each normalised row uses (row % w_rows: per-head
    parameters). Loaded in the data tile's own layout: each thread reads the columns it holds, in
    16-byte vectors (a 1-D load would be spread over all threads, a few bytes each, and then moved
    through shared memory). Kept in L2 (evict_last): every program reads it."""
    if PER_ROW:
        return tl.load(P + (rows % w_rows)[:, None] * N + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                       other=0.0, eviction_policy="evict_last").to(tl.float32)
    else:
        return tl.load(P + (rows * 0)[:, None] + cols[None, :], mask=(rows >= 0)[:, None] & col_ok[None, :],
                       other=0.0, eviction_policy="evict_last").to(tl.float32)


@triton.jit
def load_norm_input(X, R, H, rows, cols, mask, stride_x, stride_r, stride_h,
                    HAS_R: tl.constexpr, STORE_H: tl.constexpr, H_CODE: tl.constexpr):
    """The norm's input tile in fp32: x, or h = x + residual rounded to the stream's dtype (and
    written to H when STORE_H). Streamed: read once, so evicted first."""
    z = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    if HAS_R:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        z = round_to(z + r, H_CODE)
        if STORE_H:
            tl.store(H + rows[:, None] * stride_h + cols[None, :], z, mask=mask)
    return z


@triton.jit
def load_rows(P, rows, cols, mask, stride):
    """A streamed tile (dy, the saved input) in fp32."""
    return tl.load(P + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0,
                   eviction_policy="evict_first").to(tl.float32)


@triton.jit
def store_input_grads(DH, DX, DR, rows, c, mask, dx, stride_dh, stride_dx, stride_dr,
                      HAS_DH: tl.constexpr, HAS_DR: tl.constexpr, DX_CODE: tl.constexpr, DR_CODE: tl.constexpr):
    """Write the grad of the norm's input. Fused residual: h = x + residual, so the stream's own
    incoming grad dh joins the norm's, and x and residual receive the same values, each in its own
    freshly allocated buffer (never one shared tensor that a later in-place accumulate could hit)."""
    if HAS_DH:
        dx += load_rows(DH, rows, c, mask, stride_dh)
    tl.store(DX + rows[:, None] * stride_dx + c[None, :], round_to(dx, DX_CODE), mask=mask)
    if HAS_DR:
        tl.store(DR + rows[:, None] * stride_dr + c[None, :], round_to(dx, DR_CODE), mask=mask)


@triton.jit
def split_rows(M, CHUNKS: tl.constexpr):
    """A split-row program's place: (its column chunk, first row, row step). Programs pid and
    pid + CHUNKS * k share a chunk, so each program's column chunk (and its weight slice, and its
    dW columns) stays the same for all its rows."""
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // CHUNKS
    return pid % CHUNKS, pid // CHUNKS, groups


@triton.jit
def publish_and_gather(PART, COUNT, row, chunk, M, p0, p1, NSTAT: tl.constexpr, CHUNKS: tl.constexpr,
                       CHUNKS_P2: tl.constexpr, PHASE: tl.constexpr):
    """Split rows: store this chunk's partial statistics (p0, and p1 when NSTAT == 2) for `row`,
    wait for the row's other chunks (PHASE 0, one launch on a GPU), and return every chunk's
    partials as (CHUNKS_P2,) vectors, padded with zeros. PART holds NSTAT planes of (M, CHUNKS)
    fp32; COUNT one zeroed int32 arrival counter per row."""
    ks = tl.arange(0, CHUNKS_P2)
    plane = M * CHUNKS  # the second statistic's plane
    if PHASE != 2:
        tl.store(PART + row * CHUNKS + chunk, p0)
        if NSTAT == 2:
            tl.store(PART + plane + row * CHUNKS + chunk, p1)
    if PHASE == 0:
        # Every thread's partial store is issued before the one release that announces it; the
        # acquire loop then orders the reads below after every chunk's announcement.
        tl.debug_barrier()
        tl.atomic_add(COUNT + row, 1, sem="release", scope="gpu")
        # The loop carries only the poll count (no more registers than an unbounded wait).
        spins = 0
        while tl.atomic_add(COUNT + row, 0, sem="acquire", scope="gpu") < CHUNKS:
            spins += 1
            if spins > SPIN_LIMIT:
                # A row's chunks that never all arrive (programs not co-resident after all) must
                # end the kernel with an error, never hang the process (or a GPU session) forever.
                spins = tl.inline_asm_elementwise("trap;", "=r,r", [spins], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
    q0 = tl.zeros([CHUNKS_P2], dtype=tl.float32)
    q1 = tl.zeros([CHUNKS_P2], dtype=tl.float32)
    if PHASE != 1:
        # .cg: read from L2, never from this SM's L1 (it may hold the line from before the writes).
        q0 = tl.load(PART + row * CHUNKS + ks, mask=ks < CHUNKS, other=0.0, cache_modifier=".cg")
        if NSTAT == 2:
            q1 = tl.load(PART + plane + row * CHUNKS + ks, mask=ks < CHUNKS, other=0.0, cache_modifier=".cg")
    return q0, q1


@triton.jit
def _strided_loop_probe(OUT, N):
    # The persistent kernels' loop: bounds that are program ids, not constants.
    for i in tl.range(tl.program_id(0), N, tl.num_programs(0)):
        tl.store(OUT + i, i)


@functools.cache
def _interpreter_problem() -> str | None:
    """Why this triton's CPU interpreter cannot run the kernels, or None. Triton <= 3.6's
    interpreter turns a loop bound into an int with int(1-element array), which numpy >= 2.4
    refuses: every persistent kernel would fail at its first launch, with a traceback deep in
    triton, instead of the backend saying once that it cannot run here."""
    # On the CPU whatever default device the caller set: under torch.device("meta") the probe would
    # fail, and the backend would be called broken for the rest of the process (the answer is cached).
    out = torch.full((4,), -1, dtype=torch.int32, device="cpu")
    try:
        _strided_loop_probe[(2,)](out, 4)
    except Exception as e:  # noqa: BLE001 - whatever it is, it is the reason
        import numpy

        return (f"the CPU interpreter of triton {triton.__version__} cannot run normswap's kernels with "
                f"numpy {numpy.__version__} ({type(e).__name__}: {e}); triton >= 3.7, or numpy < 2.4, runs them")
    if out.tolist() != [0, 1, 2, 3]:
        return f"the CPU interpreter of triton {triton.__version__} ran a strided loop wrongly: {out.tolist()}"
    return None


def triton_unavailable_reason(kernel) -> str | None:
    """None when Triton kernels run in this process, else the reason they do not."""
    if interpreting(kernel):
        return _interpreter_problem()
    if torch.cuda.is_available():
        return None
    return (
        "no CUDA device, and TRITON_INTERPRET=1 was not set before triton was imported "
        "(set it in the environment to run the kernels through the CPU interpreter)"
    )


def check_device(x: torch.Tensor) -> None:
    if INTERPRETED:
        if x.device.type != "cpu":
            raise NormswapError(f"the Triton interpreter runs on CPU tensors, got a tensor on {x.device}")
    elif x.device.type != "cuda":
        raise NormswapError(
            f"Triton kernels need CUDA tensors, got a tensor on {x.device} "
            "(on a CPU machine set TRITON_INTERPRET=1 before importing triton)"
        )


def check_dtype(t: torch.Tensor | None, what: str) -> None:
    if t is not None and t.dtype not in SUPPORTED_DTYPES:
        raise NormswapError(f"triton norm kernels take fp32/fp16/bf16 {what}, got {t.dtype}")


def check_param(t: torch.Tensor | None, x: torch.Tensor, what: str) -> None:
    """A per-column parameter is (N,), or (heads, N) for per-head parameters: x's rows are then
    (..., heads, N) and each head has its own row (Cohere's q/k LayerNorm)."""
    if t is None:
        return
    n = x.shape[-1]
    if t.dim() == 1 and t.shape[0] == n:
        return
    if t.dim() == 2 and t.shape[1] == n and x.dim() >= 2 and x.shape[-2] == t.shape[0]:
        return
    raise NormswapError(f"{what} must have shape ({n},), or (heads, {n}) for inputs shaped (..., heads, {n}); "
                        f"got {tuple(t.shape)} for inputs {tuple(x.shape)}")


def as_rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """View `t` as a (rows, n) matrix with unit column stride. Row-strided views pass as they are
    (kernels take a row stride); anything else is copied, never read with the wrong strides."""
    if t is None:
        return None
    t2 = t.reshape(-1, n) if t.dim() != 2 else t
    if t2.stride(-1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < n):
        t2 = t2.contiguous()
    return t2


def device_guard(t: torch.Tensor):
    """Triton launches on the *current* CUDA device: make it the tensor's (x on cuda:1 while
    cuda:0 is current would otherwise read the wrong memory)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def new_empty(shape, dtype, device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())["sms"]
    return 1


# Resident blocks (programs) one SM holds at most, by compute capability (10 * major + minor), as
# NVIDIA's own occupancy calculator gives them (cudaOccMaxBlocksPerMultiprocessor in
# cuda_occupancy.h, CUDA 12.8 to 13.1, which triton's NVIDIA backend ships: tests/test_occupancy.py
# checks this table against it); torch does not report it. An overestimate is the harmful error: a
# split-row launch asks for as many co-resident programs as the rule allows, and the driver refuses
# a cooperative grid that does not fit (an RTX 4090, sm_89, holds 24, not an H100's 32). So a
# capability the table does not know gets its smallest cap: an underestimate only makes a
# persistent grid smaller than it could be. sm_101 is Jetson Thor as CUDA 12.8 and 12.9 name it
# (CUDA 13 renamed it sm_110): 24 under either name, where the unknown-capability fallback would
# have given it 16. NVIDIA's Blackwell tuning guide says 32 for 12.0; the calculator says 24 for
# every 12.x, and the smaller is the safe one.
MAX_BLOCKS_PER_SM = {70: 32, 72: 32, 75: 16, 80: 32, 86: 16, 87: 16, 88: 16, 89: 24, 90: 32, 100: 32, 101: 24,
                     103: 32, 110: 24, 120: 24, 121: 24}


def max_blocks_per_sm(capability: int) -> int:
    """Resident blocks per SM of compute capability `capability` (89 for sm_89)."""
    return MAX_BLOCKS_PER_SM.get(capability, min(MAX_BLOCKS_PER_SM.values()))


@functools.cache
def _cuda_props(index: int) -> dict:
    p = torch.cuda.get_device_properties(index)
    return {"sms": p.multi_processor_count,
            "regs": getattr(p, "regs_per_multiprocessor", 65536),
            "threads": getattr(p, "max_threads_per_multi_processor", 2048),
            "smem": getattr(p, "shared_memory_per_multiprocessor", 228 * 1024),
            "blocks": max_blocks_per_sm(10 * p.major + p.minor)}


# Hopper's per-SM limits: the planning target where no device answers (meta tensors, the static
# analysis in benchmarks/kernel_static.py).
H100_LIMITS = {"sms": 132, "regs": 65536, "threads": 2048, "smem": 228 * 1024, "blocks": max_blocks_per_sm(90)}


def programs_per_sm(regs: int, num_warps: int, smem: int, limits: dict) -> int:
    """How many programs of a kernel one SM holds at once (CUDA's occupancy rules: registers are
    allocated per warp in units of 256, each program also reserves 1 KiB of shared memory, and an
    SM holds at most limits["blocks"] of them, whatever their size)."""
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = (limits["regs"] // per_warp) // num_warps
    by_threads = limits["threads"] // (32 * num_warps)
    by_smem = limits["smem"] // (smem + 1024)
    return max(0, min(by_regs, by_threads, by_smem, limits["blocks"]))


_RESIDENT: dict = {}


def resident_programs(kernel, args, kwargs, device: torch.device) -> int:
    """Programs of this kernel variant the whole device holds at once: SMs x programs per SM, from
    the compiled kernel's registers and shared memory (compiled here, ahead of the launch that
    would compile it anyway). Persistent launches size their grid with it, so that every program
    is resident in one wave, and split-row launches need it (their programs wait for each other)."""
    if device.type != "cuda":
        return sm_count(device)
    key = (kernel, device.index, tuple(sorted(kwargs.items())),
           tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else type(a) for a in args))
    if key not in _RESIDENT:
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
        compiled._init_handles()
        limits = _cuda_props(device.index if device.index is not None else torch.cuda.current_device())
        per_sm = programs_per_sm(compiled.n_regs, kwargs["num_warps"], compiled.metadata.shared, limits)
        _RESIDENT[key] = max(per_sm, 0) * limits["sms"]
    return _RESIDENT[key]


@dataclasses.dataclass(frozen=True)
class Tile:
    """How a pass lays rows over programs. chunks > 1: each row is split into `chunks` column
    chunks of block_n elements (block_m is then 1)."""

    block_m: int
    block_n: int
    chunks: int
    num_warps: int
    num_stages: int

    def constexprs(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "CHUNKS": self.chunks,
                "CHUNKS_P2": triton.next_power_of_2(self.chunks), "num_warps": self.num_warps}


# The static launch heuristics, per pass: elements per program tile for rows held whole (by
# row-count bucket: few rows get smaller tiles, so that they still spread over the SMs), the warps
# of a split-row program, and the software-pipelining depth of the backward's loop over rows.
# Chosen from the sm_90 static analysis (benchmarks/kernel_static.py: no spills, 16-byte accesses,
# >= 2 programs per SM where rows are split, so one program's wait overlaps another's loads). They
# answer wherever the measured launch tables (the committed launch_table.json per architecture, and
# the user table `normswap tune` writes per machine) have no entry. Measured tables, not
# triton.autotune: a tile fixes the reduction order, so a winner picked by run-time timing would let
# noise change the output's last bit from one run to the next (launch_table.py says more).
ROW_BUCKETS = (2048,)  # row counts <= 2048 are "few"
TILE_ELEMS = {"fwd": (4096, 8192), "bwd": (4096, 4096)}
SPLIT_WARPS = {"fwd": 8, "bwd": 8}
STAGES = {"fwd": 1, "bwd": 3}
# The architecture a launch is planned for where no CUDA device answers (meta tensors: the static
# analysis of benchmarks/kernel_static.py, whose limits are an H100's).
PLAN_ARCH = "sm_90"
DTYPE_NAME = {DTYPES[name]: name for name in RUN_DTYPES}  # torch dtype -> the table's dtype name


def row_bucket(m: int) -> int:
    """The coarse row-count bucket of m rows (an index into launch_table.bucket_labels(ROW_BUCKETS))."""
    return bisect.bisect_left(ROW_BUCKETS, m)  # how many bounds m exceeds


def device_arch(device: torch.device | None) -> str:
    """'sm_<major><minor>' of a CUDA device; PLAN_ARCH for anything else (meta tensors)."""
    if device is not None and device.type == "cuda":
        return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
    return PLAN_ARCH


@functools.cache
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def device_name(device: torch.device | None) -> str | None:
    """torch.cuda.get_device_name of a CUDA device (the key of user-table entries); None for
    anything else. Asked once per device index per process."""
    if device is not None and device.type == "cuda":
        return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())
    return None


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def kernel_op(kernel) -> str:
    """The op a kernel belongs to, from its module (normswap.kernels.rms_norm -> rms_norm)."""
    return str(getattr(kernel, "__module__", "")).rpartition(".")[2]


def launch_config(m: int, n: int, dtype: torch.dtype, pass_: str, kernel, device=None) -> Tile:
    """The tile for an (m, n) problem of `dtype` elements, pass "fwd" or "bwd", on `device`. On GPUs
    the measured launch tables (launch_table.py: the committed one for the device's architecture,
    the user's for the device itself) answer where they have an entry, the static heuristics
    elsewhere; all see the row count only through a coarse bucket, so batch sizes never compile
    anew. On the interpreter, tiles shrink to the row count (it pays for masked-off rows) and no
    table is read. Cached: this runs on every call, and host
    time is what small shapes are made of."""
    elem_bytes = dtype.itemsize
    if interpreting(kernel):
        return _launch_config(triton.next_power_of_2(max(m, 1)), n, elem_bytes, pass_, True, MAX_BLOCK_N,
                              INTERPRETER_TILE)
    return _gpu_launch_config(row_bucket(m), n, dtype, pass_, kernel, device, launch_table.generation(ROW_BUCKETS),
                              MAX_BLOCK_N)


@functools.lru_cache(maxsize=4096)
def _gpu_launch_config(bucket: int, n: int, dtype: torch.dtype, pass_: str, kernel, device, generation: int,
                       max_block_n: int) -> Tile:
    """The table's tile where it has one (generation: which table, so that a new one is never
    answered from the cache), else the heuristics'. Keyed by the kernel and the device themselves
    (the launchers pass a tensor's device, which names its index), so that a call costs one lookup."""
    op, arch = kernel_op(kernel), device_arch(device)
    table, _ = launch_table.active(ROW_BUCKETS, device_name(device))
    hidden = launch_table.hidden_bucket(n)
    label = launch_table.bucket_labels(ROW_BUCKETS)[bucket]
    t = table.get((arch, op, pass_, DTYPE_NAME.get(dtype), hidden, label))
    if t is None:
        return _launch_config(bucket, n, dtype.itemsize, pass_, False, max_block_n, INTERPRETER_TILE)
    if t["block_n"] < n:  # split rows
        return Tile(1, t["block_n"], triton.cdiv(n, t["block_n"]), t["num_warps"], t["num_stages"])
    return Tile(t["block_m"], t["block_n"], 1, t["num_warps"], t["num_stages"])


def heuristic_config(m: int, n: int, dtype: torch.dtype, pass_: str) -> Tile:
    """The static heuristics' GPU tile for (m, n): what launches where the table has no entry (and
    the baseline every tuned candidate is measured against)."""
    return _launch_config(row_bucket(m), n, dtype.itemsize, pass_, False, MAX_BLOCK_N, INTERPRETER_TILE)


def tile_fields(tile: Tile) -> dict:
    """A Tile as a launch-table entry's tile (chunks follow from block_n and the hidden size)."""
    return {"block_m": tile.block_m, "block_n": tile.block_n, "num_warps": tile.num_warps,
            "num_stages": tile.num_stages}


@functools.lru_cache(maxsize=4096)
def _launch_config(rows: int, n: int, elem_bytes: int, pass_: str, interp: bool, max_block_n: int,
                   interp_tile: int) -> Tile:
    whole = max_block_n if pass_ == "fwd" else max(max_block_n // 2, 2)
    stages = 1 if interp else STAGES[pass_]
    if n > whole:
        # Split rows: narrower chunks than a whole-row tile (forward a quarter, backward half), so
        # that several programs fit per SM and one's wait for its row overlaps another's loads.
        chunk = max(whole // 4 if pass_ == "fwd" else whole // 2, 1)
        return Tile(1, chunk, triton.cdiv(n, chunk), 4 if interp else SPLIT_WARPS[pass_], stages)
    block_n = triton.next_power_of_2(max(n, 1))
    tile = interp_tile if interp else TILE_ELEMS[pass_][rows]
    block_m = max(1, min(tile // block_n, 256))
    if interp:
        block_m = min(block_m, rows)
    # ~32 bytes of each streamed tensor per thread (two 16-byte vectors): fp32 tiles get twice
    # the warps of bf16 ones, so registers per thread (and spills) do not grow with the dtype.
    num_warps = max(1, min(16, block_m * block_n * (elem_bytes if not interp else 2) // 1024))
    return Tile(block_m, block_n, 1, num_warps, stages)


# ----------------------------------------------------------------------------------------------
# Host-side plumbing shared by the RMSNorm and LayerNorm ops. Both kernel pairs take their
# arguments in one layout, which is what lets one launcher serve both:
#   forward:  X, R, *params, Y, H, *stats, PART, COUNT, M, N, w_rows, stride_x, stride_r, stride_y,
#             stride_h, eps, offset
#   backward: DY, DH, Z, W, *stats, DX, DR, *partials, PART, COUNT, M, N, w_rows, stride_dy, stride_dh,
#             stride_z, stride_dx, stride_dr, offset
# Absent tensors are replaced by a harmless pointer of the right device (their HAS_* flag is off).
# PART / COUNT are the split-row scratch (partial statistics, arrival counters).

_PLURAL = {"weight": "weights", "bias": "biases"}


def check_norm_inputs(op: str, x: torch.Tensor, residual: torch.Tensor | None,
                      out_dtype: torch.dtype | None, params: dict[str, torch.Tensor | None]) -> None:
    """The functional API's argument checks, one clear NormswapError each. `params` maps the
    per-column parameters' names ("weight", "bias") to the tensors (or None)."""
    if x.dim() < 1 or x.shape[-1] < 1:
        raise NormswapError(f"{op} needs a non-empty last dimension, got shape {tuple(x.shape)}")
    check_device(x)
    check_dtype(x, "inputs")
    for what, t in params.items():
        check_dtype(t, _PLURAL[what])
    check_dtype(residual, "residuals")
    for what, t in params.items():
        check_param(t, x, what)
    for what, t in (*params.items(), ("residual", residual)):
        if t is not None and t.device != x.device:
            raise NormswapError(f"{what} is on {t.device} but x is on {x.device}")
    shaped = [t for t in params.values() if t is not None]
    if len({tuple(t.shape) for t in shaped}) > 1:
        raise NormswapError(f"{op}: weight and bias shapes differ ({', '.join(str(tuple(t.shape)) for t in shaped)})")
    if residual is not None and residual.shape != x.shape:
        raise NormswapError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise NormswapError(f"out_dtype must be fp32/fp16/bf16, got {out_dtype}")


def stream_dtype(residual: torch.Tensor | None, residual_in_fp32: bool) -> torch.dtype | None:
    """The dtype h = x + residual is stored in (None without a residual)."""
    if residual is None:
        return None
    return torch.float32 if residual_in_fp32 else residual.dtype


def param_rows(params) -> int:
    """Rows of the parameter matrix: 1 for per-column vectors, `heads` for (heads, N) per-head
    parameters (normalised row r uses parameter row r % heads)."""
    return next((p.shape[0] for p in params if p is not None and p.dim() == 2), 1)


def scratch_placeholders(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins of the right dtypes (fp32 partials, int32 counters) for scratch a launch does not
    use, or does not have yet: the kernel variant compiled for them is the one that runs."""
    return torch.empty((1,), dtype=torch.float32, device=device), torch.empty((1,), dtype=torch.int32, device=device)


def _grid(kernel, m: int, tile: Tile, args, kwargs: dict, device, persistent: bool) -> tuple[int, dict]:
    """(programs, the launch's keyword arguments) for m rows. Persistent launches never exceed what
    the device holds at once; split-row launches must fit at once (their programs wait for each
    other), so they are cooperative launches, which the driver refuses rather than hang."""
    interp = interpreting(kernel)
    if tile.chunks == 1:
        kw = dict(kwargs, PHASE=0)
        programs = triton.cdiv(m, tile.block_m)
        if persistent:
            programs = min(programs, 2 if interp else resident_programs(kernel, args, kw, device))
        return programs, kw
    if interp:  # PHASE is set per launch (1, then 2)
        return max(1, min(m, INTERPRETER_ROW_GROUPS)) * tile.chunks, dict(kwargs)
    kw = dict(kwargs, PHASE=0, launch_cooperative_grid=True)
    fit = resident_programs(kernel, args, kw, device)
    if fit < tile.chunks:
        raise NormswapError(f"rows of {tile.chunks} chunks need {tile.chunks} programs running at once, but this "
                            f"device holds only {fit} of them")
    return max(1, min(m, fit // tile.chunks)) * tile.chunks, kw


def _run(kernel, m: int, tile: Tile, programs: int, args, kw: dict, device, n_planes: int, scratch_at: int) -> None:
    """Launch over m rows. scratch_at: where PART and COUNT sit in args (split rows only)."""
    args = list(args)
    if tile.chunks > 1:
        args[scratch_at] = new_empty((n_planes, m, tile.chunks), torch.float32, device)
        if interpreting(kernel):
            for phase in (1, 2):
                kernel[(programs,)](*args, PHASE=phase, **kw)
            return
        args[scratch_at + 1] = torch.zeros((m,), dtype=torch.int32, device=device)
    kernel[(programs,)](*args, **kw)


def launch_forward(kernel, x, residual, params, n_stats, y_dtype, residual_in_fp32, eps, offset, **consts):
    """Run a forward kernel over the rows of x: returns (y, h, *stats) shaped like x (stats like
    x.shape[:-1], fp32); h is an empty tensor without a residual. `params` are the per-column
    parameters (None where absent; (heads, N) for per-head ones); `consts` the kernel's own
    constexprs (HAS_W, ...)."""
    n = x.shape[-1]
    x2 = as_rows(x, n)
    r2 = as_rows(residual, n)
    params = [None if p is None else p.contiguous() for p in params]
    m = x2.shape[0]
    dev = x.device
    y = new_empty((m, n), y_dtype, dev)
    h_dtype = stream_dtype(residual, residual_in_fp32)
    h = new_empty((m, n), h_dtype, dev) if residual is not None else x.new_empty((0,))
    stats = [new_empty((m,), torch.float32, dev) for _ in range(n_stats)]
    if m > 0:
        tile = launch_config(m, n, x.dtype, "fwd", kernel, dev)
        args = (x2, x2 if r2 is None else r2, *(x2 if p is None else p for p in params),
                y, y if residual is None else h, *stats, *scratch_placeholders(dev),
                m, n, param_rows(params), x2.stride(0), 0 if r2 is None else r2.stride(0), y.stride(0),
                0 if residual is None else h.stride(0), float(eps), float(offset))
        kwargs = dict(HAS_R=residual is not None, H_CODE=0 if h_dtype is None else DTYPE_CODE[h_dtype],
                      OUT_CODE=DTYPE_CODE[y_dtype], PER_ROW_W=param_rows(params) > 1, **consts, **tile.constexprs())
        programs, kw = _grid(kernel, m, tile, args, kwargs, dev, persistent=False)
        _run(kernel, m, tile, programs, args, kw, dev, n_stats, 2 + len(params) + 2 + n_stats)
    y = y.view(x.shape)
    if residual is not None:
        h = h.view(x.shape)
    return (y, h, *(s.view(x.shape[:-1]) for s in stats))


def launch_backward(kernel, dy, dh, z, weight, stats, offset, x_dtype, residual_dtype, param_grads, **consts):
    """Run a backward kernel: returns (dx, *dparams, dresidual). `param_grads` holds, per
    parameter, the tensor whose grad is wanted (for its dtype and shape) or None to skip it (an
    empty tensor then stands in its place); `consts` are the kernel's own constexprs.

    dW/dB: each program sums its rows' products in fp32 registers and writes them once, as one row
    of a (programs, N) buffer (split rows: its chunk's columns of one row per row group), which
    torch then sums in fp32: no read-modify-write per row, no atomics."""
    n = z.shape[-1]
    z2 = as_rows(z, n)
    dy2 = as_rows(dy, n)
    dh2 = as_rows(dh, n)
    m = z2.shape[0]
    dev = z.device
    dx = new_empty((m, n), x_dtype, dev)
    dr = new_empty((m, n), residual_dtype, dev) if residual_dtype is not None else z.new_empty((0,))
    w = weight.contiguous() if weight is not None else None
    tile = launch_config(m, n, z.dtype, "bwd", kernel, dev)
    w_rows = param_rows([w])
    args = [dy2, dy2 if dh2 is None else dh2, z2, z2 if w is None else w, *(s.reshape(-1) for s in stats),
            dx, dx if residual_dtype is None else dr, *(scratch_placeholders(dev)[0] for _ in param_grads),
            *scratch_placeholders(dev),
            m, n, w_rows, dy2.stride(0), 0 if dh2 is None else dh2.stride(0), z2.stride(0), dx.stride(0),
            0 if residual_dtype is None else dr.stride(0), float(offset)]
    kwargs = dict(HAS_W=w is not None, PER_ROW_W=w_rows > 1, HAS_DH=dh2 is not None,
                  HAS_DR=residual_dtype is not None, DX_CODE=DTYPE_CODE[x_dtype],
                  DR_CODE=DTYPE_CODE[residual_dtype or x_dtype], NUM_STAGES=tile.num_stages,
                  **consts, **tile.constexprs())
    at = 4 + len(stats) + 2  # first partial-sum buffer in args
    scratch_at = at + len(param_grads)
    partials = [None] * len(param_grads)
    if m > 0:
        # Every program writes its whole partial row (its chunk's columns when rows are split), so
        # the buffers need no zeroing (poisoned in tests like every output).
        programs, kw = _grid(kernel, m, tile, args, kwargs, dev, persistent=True)
        rows = programs // tile.chunks
        partials = [None if like is None else new_empty((rows, n), torch.float32, dev) for like in param_grads]
        for i, p in enumerate(partials):
            if p is not None:
                args[at + i] = p
        _run(kernel, m, tile, programs, args, kw, dev, len(stats), scratch_at)

    def reduce(part, like):
        if like is None:
            return z.new_empty((0,))
        if m == 0:
            return torch.zeros_like(like)
        return part.sum(0).to(like.dtype)

    dparams = [reduce(part, like) for part, like in zip(partials, param_grads, strict=True)]
    dx = dx.view(z.shape)
    if residual_dtype is not None:
        dr = dr.view(z.shape)
    return (dx, *dparams, dr)


def needs_separate_residual_grad(x_dtype, residual_dtype) -> bool:
    """h = x + residual passes its gradient unchanged to both terms, so where they share a dtype
    the backward writes it once (dx) and hands the same tensor back as the residual's gradient:
    a second copy would cost a full extra write of the rows. Only a residual kept in another dtype
    (residual_in_fp32) needs its own rounding of it."""
    return residual_dtype is not None and residual_dtype != x_dtype


def residual_grad(dx, dr, residual_dtype, separate):
    """The residual's gradient for the autograd formula (see needs_separate_residual_grad). The
    op's own outputs never alias (custom ops forbid it); autograd accepts one tensor as the
    gradient of two inputs and never accumulates into a buffer that is shared."""
    if residual_dtype is None:
        return None
    return dr if separate else dx


def fake_forward(x, residual, residual_in_fp32, n_stats, y_dtype):
    """What launch_forward returns, as empty tensors (the ops' fake impls for torch.compile)."""
    h_dtype = stream_dtype(residual, residual_in_fp32)
    h = x.new_empty((0,)) if h_dtype is None else x.new_empty(x.shape, dtype=h_dtype)
    stats = (x.new_empty(x.shape[:-1], dtype=torch.float32) for _ in range(n_stats))
    return (x.new_empty(x.shape, dtype=y_dtype), h, *stats)


def fake_backward(z, x_dtype, residual_dtype, param_grads):
    """What launch_backward returns, as empty tensors (each its own: custom ops' outputs must not
    alias one another)."""
    dparams = (z.new_empty((0,)) if like is None else torch.empty_like(like) for like in param_grads)
    dr = z.new_empty((0,)) if residual_dtype is None else z.new_empty(z.shape, dtype=residual_dtype)
    return (z.new_empty(z.shape, dtype=x_dtype), *dparams, dr)
