"""Plumbing shared by the Triton norm ops: dtype codes and exact rounding, launch heuristics,
output allocation, and the answer to "do Triton kernels run here?".

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

