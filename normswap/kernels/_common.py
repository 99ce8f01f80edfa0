"""Plumbing shared by the Triton norm ops: dtype codes and exact rounding, launch heuristics,
argument checks, the launchers and fake impls of both op pairs, and the answer to "do Triton
kernels run here?".

Why explicit rounding: every intermediate cast that a norm family performs (Llama rounds the
normalized value to the input dtype, T5 to a half weight's dtype, the residual sum to the stream's
dtype) is done in-kernel with round-to-nearest-even, then kept in fp32. The Triton CPU interpreter
*truncates* fp32 -> bf16, so bf16 is rounded with integer ops instead of a cast; the same code runs
natively on GPUs, so what the CPU tests check is what the GPU executes. Values reaching a store are
then already representable in the destination dtype and every store is exact.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from normswap.errors import NormswapError

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# dtype -> code understood by round_to(); 0 means "fp32: nothing to round".
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# Widest column block a program holds in registers; wider rows loop over column blocks. Module
# level so that tests can shrink it and exercise the looping path on small, fast shapes.
MAX_BLOCK_N = 16384
# Elements per program tile on the CPU interpreter: it pays per program and per op, not per
# element, so big multi-row tiles are what make interpreter tests fast.
INTERPRETER_TILE = 1 << 16

# Tests set this to True: every output buffer then starts as NaN (poisoned), so an element a
# kernel forgets to write cannot pass for a correct one.
POISON_OUTPUTS = False


@triton.jit
def round_to(x, CODE: tl.constexpr):
    """Round fp32 `x` to fp16 (CODE 1) or bf16 (CODE 2), round-to-nearest-even, returned as fp32.
    CODE 0 returns x unchanged."""
    if CODE == 1:
        return x.to(tl.float16).to(tl.float32)
    elif CODE == 2:
        bits = x.to(tl.uint32, bitcast=True)
        # Add half an ulp of bf16 (minus one when the kept lsb is 0: ties go to even), then drop
        # the low 16 bits. NaNs are passed through (their payload could otherwise round to inf).
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = (bits >> 16) << 16
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x


@triton.jit
def load_norm_input(X, R, H, rows, cols, mask, stride_x, stride_r, stride_h,
                     HAS_R: tl.constexpr, STORE_H: tl.constexpr, H_CODE: tl.constexpr):
    """The norm's input tile in fp32: x, or h = x + residual rounded to the stream's dtype (and
    written to H when STORE_H)."""
    z = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        z = round_to(z + r, H_CODE)
        if STORE_H:
            tl.store(H + rows[:, None] * stride_h + cols[None, :], z, mask=mask)
    return z


@triton.jit
def store_input_grads(DH, DX, DR, rows, c, mask, dx, stride_dh, stride_dx, stride_dr,
                      HAS_DH: tl.constexpr, HAS_DR: tl.constexpr, DX_CODE: tl.constexpr, DR_CODE: tl.constexpr):
    """Write the grad of the norm's input. Fused residual: h = x + residual, so the stream's own
    incoming grad dh joins the norm's, and x and residual receive the same values, each in its own
    freshly allocated buffer (never one shared tensor that a later in-place accumulate could hit)."""
    if HAS_DH:
        dx += tl.load(DH + rows[:, None] * stride_dh + c[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + rows[:, None] * stride_dx + c[None, :], round_to(dx, DX_CODE), mask=mask)
    if HAS_DR:
        tl.store(DR + rows[:, None] * stride_dr + c[None, :], round_to(dx, DR_CODE), mask=mask)


def interpreting(kernel) -> bool:
    """True when `kernel` (a @triton.jit function) was built for the CPU interpreter, which triton
    decides from TRITON_INTERPRET when the decorator runs."""
    return type(kernel).__name__ == "InterpretedFunction"


def triton_unavailable_reason(kernel) -> str | None:
    """None when Triton kernels run in this process, else the reason they do not."""
    if interpreting(kernel):
        return None
    if torch.cuda.is_available():
        return None
    return (
        "no CUDA device, and TRITON_INTERPRET=1 was not set before triton was imported "
        "(set it in the environment to run the kernels through the CPU interpreter)"
    )


def check_device(x: torch.Tensor, kernel) -> None:
    if interpreting(kernel):
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


def check_vector(t: torch.Tensor | None, n: int, what: str) -> None:
    if t is not None and (t.dim() != 1 or t.shape[0] != n):
        raise NormswapError(f"{what} must have shape ({n},), got {tuple(t.shape)}")


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
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 1


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def row_config(m: int, n: int, kernel, backward: bool = False) -> dict:
    """Block shape and warps for an (m, n) problem.

    BLOCK_N covers the whole row when it fits (one pass over HBM), else rows loop over column
    blocks. Several rows share a program when rows are short: on a GPU so that each program moves
    enough bytes to hide latency, on the interpreter because each program costs Python overhead.
    Cached: this runs on every call, and host time is what small shapes are made of.
    """
    return dict(_row_config(m, n, interpreting(kernel), backward, MAX_BLOCK_N, INTERPRETER_TILE))


@functools.lru_cache(maxsize=4096)
def _row_config(m: int, n: int, interp: bool, backward: bool, max_block_n: int, interp_tile: int) -> dict:
    max_n = max_block_n if not backward else max(max_block_n // 2, 16)
    block_n = min(triton.next_power_of_2(max(n, 1)), triton.next_power_of_2(max_n))
    if interp:
        tile = interp_tile
    else:
        # ~8K elements per program for short rows (bf16: 16 KiB in flight per program).
        tile = 8192 if not backward else 4096
    block_m = max(1, min(tile // block_n, 256))
    if interp:
        # The interpreter pays for masked-off rows too; on a GPU the tile never depends on the row
        # count, so no batch size ever compiles a new kernel variant.
        block_m = min(block_m, triton.next_power_of_2(max(m, 1)))
    elems = block_m * block_n
    num_warps = max(1, min(16, elems // 512))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "SINGLE": block_n >= n, "num_warps": num_warps}


def backward_programs(m: int, block_m: int, device: torch.device, kernel) -> int:
    """Persistent backward: a bounded number of programs loop over row blocks, so the fp32 partial
    dW buffer is (programs, N), not (rows, N)."""
    row_blocks = triton.cdiv(max(m, 1), block_m)
    if interpreting(kernel):
        return min(row_blocks, 2)
    # Two programs per SM keep the memory system busy while the partial buffer stays ~2*SMs*N*4 bytes.
    return min(row_blocks, 2 * sm_count(device))



# ----------------------------------------------------------------------------------------------
# Host-side plumbing shared by the RMSNorm and LayerNorm ops. Both kernel pairs take their
# arguments in one layout, which is what lets one launcher serve both:
#   forward:  X, R, *params, Y, H, *stats, M, N, stride_x, stride_r, stride_y, stride_h, eps, offset
#   backward: DY, DH, Z, W, *stats, DX, DR, *partials, M, N, stride_dy, stride_dh, stride_z,
#             stride_dx, stride_dr, offset
# Absent tensors are replaced by a harmless pointer of the right device (their HAS_* flag is off).

_PLURAL = {"weight": "weights", "bias": "biases"}


def check_norm_inputs(op: str, kernel, x: torch.Tensor, residual: torch.Tensor | None,
                      out_dtype: torch.dtype | None, params: dict[str, torch.Tensor | None]) -> None:
    """The functional API's argument checks, one clear NormswapError each. `params` maps the
    per-column vectors' names ("weight", "bias") to the tensors (or None)."""
    if x.dim() < 1 or x.shape[-1] < 1:
        raise NormswapError(f"{op} needs a non-empty last dimension, got shape {tuple(x.shape)}")
    check_device(x, kernel)
    check_dtype(x, "inputs")
    for what, t in params.items():
        check_dtype(t, _PLURAL[what])
    check_dtype(residual, "residuals")
    for what, t in params.items():
        check_vector(t, x.shape[-1], what)
    for what, t in (*params.items(), ("residual", residual)):
        if t is not None and t.device != x.device:
            raise NormswapError(f"{what} is on {t.device} but x is on {x.device}")
    if residual is not None and residual.shape != x.shape:
        raise NormswapError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise NormswapError(f"out_dtype must be fp32/fp16/bf16, got {out_dtype}")


def stream_dtype(residual: torch.Tensor | None, residual_in_fp32: bool) -> torch.dtype | None:
    """The dtype h = x + residual is stored in (None without a residual)."""
    if residual is None:
        return None
    return torch.float32 if residual_in_fp32 else residual.dtype


def _tile_args(cfg: dict) -> dict:
    return {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "SINGLE": cfg["SINGLE"], "num_warps": cfg["num_warps"]}


def launch_forward(kernel, x, residual, params, n_stats, y_dtype, residual_in_fp32, eps, offset, **consts):
    """Run a forward kernel over the rows of x: returns (y, h, *stats) shaped like x (stats like
    x.shape[:-1], fp32); h is an empty tensor without a residual. `params` are the per-column
    vectors (None where absent); `consts` the kernel's own constexprs (HAS_W, ...)."""
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
        cfg = row_config(m, n, kernel)
        kernel[(triton.cdiv(m, cfg["BLOCK_M"]),)](
            x2, x2 if r2 is None else r2, *(x2 if p is None else p for p in params),
            y, y if residual is None else h, *stats,
            m, n, x2.stride(0), 0 if r2 is None else r2.stride(0), y.stride(0),
            0 if residual is None else h.stride(0),
            float(eps), float(offset),
            HAS_R=residual is not None, H_CODE=0 if h_dtype is None else DTYPE_CODE[h_dtype],
            OUT_CODE=DTYPE_CODE[y_dtype], **consts, **_tile_args(cfg),
        )
    y = y.view(x.shape)
    if residual is not None:
        h = h.view(x.shape)
    return (y, h, *(s.view(x.shape[:-1]) for s in stats))


def launch_backward(kernel, dy, dh, z, weight, stats, offset, x_dtype, residual_dtype, param_grads, **consts):
    """Run a persistent backward kernel: returns (dx, *dparams, dresidual). `param_grads` holds, per
    parameter, the tensor whose grad is wanted (for its dtype and shape) or None to skip it (an
    empty tensor then stands in its place); `consts` are the kernel's own constexprs."""
    n = z.shape[-1]
    z2 = as_rows(z, n)
    dy2 = as_rows(dy, n)
    dh2 = as_rows(dh, n)
    m = z2.shape[0]
    dev = z.device
    dx = new_empty((m, n), x_dtype, dev)
    dr = new_empty((m, n), residual_dtype, dev) if residual_dtype is not None else z.new_empty((0,))
    w = weight.contiguous() if weight is not None else None
    cfg = row_config(m, n, kernel, backward=True)
    progs = backward_programs(m, cfg["BLOCK_M"], dev, kernel)
    # Single-tile programs store their whole partial row once (poisoned in tests like every output,
    # so a row no program writes shows up); looping ones accumulate into a zeroed row.
    shape = (max(progs, 1), n)
    partials = [None if like is None else
                new_empty(shape, torch.float32, dev) if cfg["SINGLE"] else torch.zeros(shape, dtype=torch.float32, device=dev)
                for like in param_grads]
    if m > 0:
        kernel[(progs,)](
            dy2, dy2 if dh2 is None else dh2, z2, z2 if w is None else w, *(s.reshape(-1) for s in stats),
            dx, dx if residual_dtype is None else dr, *(dx if p is None else p for p in partials),
            m, n, dy2.stride(0), 0 if dh2 is None else dh2.stride(0), z2.stride(0), dx.stride(0),
            0 if residual_dtype is None else dr.stride(0),
            float(offset),
            HAS_W=w is not None, HAS_DH=dh2 is not None, HAS_DR=residual_dtype is not None,
            DX_CODE=DTYPE_CODE[x_dtype], DR_CODE=DTYPE_CODE[residual_dtype or x_dtype],
            **consts, **_tile_args(cfg),
        )

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
