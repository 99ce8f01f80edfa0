"""RMSNorm: Triton kernels -> launchers -> torch.library ops (fake impl + autograd) -> functional.

    y = cast(round_norm(h * rstd) * (offset + w)),  rstd = 1 / sqrt(mean(h^2) + eps),  h = x [+ residual]

The casting mode decides the intermediate rounding (see normswap/kernels/reference.py, which is
the contract): llama rounds h * rstd to x.dtype before the weight, t5 rounds it to a half
weight's dtype, gemma/none keep fp32 until the single final cast. Shapes: x (..., N), weight (N,)
or (heads, N) for per-head weights (x then (..., heads, N)), residual like x; rows =
prod(x.shape[:-1]).

Compile- and graph-safety: eps and offset are plain float arguments of the op, handed to the
kernel as fp32 runtime scalars -- never folded into an fp64 constant, never replaced by a default
(eps = 0 stays 0). The row count is a runtime argument that Triton does not specialise on, and on
GPUs the tile depends on the row count only through a coarse bucket (_common.launch_config), so
new batch sizes reuse the compiled kernels. No host syncs, so CUDA graphs capture it.

Rows wider than one program holds are split over several programs and still read once
(_common.publish_and_gather: per-chunk partial sums combined in a fixed order).

Statistics, dx and dW accumulate in fp32. dW is reduced in two stages: each backward program sums
its rows in registers and writes its own fp32 row of a (programs, N) buffer once, then torch sums
that buffer in fp32, so no program ever writes another's memory and no atomics make results
run-to-run different.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normswap.errors import NormswapError
from normswap.kernels import _common as C
from normswap.kernels._common import (
    load_norm_input,
    load_param,
    load_rows,
    publish_and_gather,
    round_to,
    split_rows,
    store_input_grads,
)
from normswap.kernels.reference import HALF, rms_out_dtype
from normswap.specs import CASTINGS

# ----------------------------------------------------------------------------------------------
# Triton kernels. Row indices are int64 before they multiply a stride (tensors past 2^31
# elements). M (the row count) is never specialised, so a new batch size never compiles anew.


@triton.jit
def _rms_apply(z, rstd, w, HAS_W: tl.constexpr, NORM_CODE: tl.constexpr, NAT_CODE: tl.constexpr,
               OUT_CODE: tl.constexpr):
    """y from the input tile, its rows' rstd and the fp32 `offset + w` (broadcastable to the tile)."""
    n = z * rstd[:, None]
    if HAS_W:
        n = round_to(n, NORM_CODE) * w
    return round_to(round_to(n, NAT_CODE), OUT_CODE)


@triton.jit(do_not_specialize=["M", "eps", "offset"])
def _rms_fwd_kernel(
    X, R, W, Y, H, RSTD, PART, COUNT,
    M, N, w_rows, stride_x, stride_r, stride_y, stride_h,
    eps, offset,
    HAS_W: tl.constexpr, HAS_R: tl.constexpr, PER_ROW_W: tl.constexpr,
    H_CODE: tl.constexpr, NORM_CODE: tl.constexpr, NAT_CODE: tl.constexpr, OUT_CODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
    PHASE: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_N)
    if CHUNKS == 1:
        # The whole row is one tile: one read of x (and residual), one write of y (and h).
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        col_ok = cols < N
        mask = row_ok[:, None] & col_ok[None, :]
        w = 0.0
        if HAS_W:
            # Loaded before the reduction, so that its latency hides under the row's.
            w = load_param(W, rows, row_ok, cols, col_ok, w_rows, N, PER_ROW_W) + offset
        z = load_norm_input(X, R, H, rows, cols, mask, stride_x, stride_r, stride_h, HAS_R, True, H_CODE)
        rstd = tl.math.rsqrt(tl.sum(z * z, axis=1) / N + eps)
        tl.store(RSTD + rows, rstd, mask=row_ok)
        y = _rms_apply(z, rstd, w, HAS_W, NORM_CODE, NAT_CODE, OUT_CODE)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
    else:
        # Split rows: this program owns one column chunk of every row of its group; the row is
        # read once, its sum of squares combined over the chunks (_common.publish_and_gather).
        chunk, group, groups = split_rows(M, CHUNKS)
        c = chunk * BLOCK_N + cols
        col_ok = c < N
        w = 0.0
        if HAS_W and not PER_ROW_W:
            w = load_param(W, tl.arange(0, 1), True, c, col_ok, w_rows, N, False) + offset
        for row in range(group, M, groups):
            rows = row + tl.arange(0, 1).to(tl.int64)
            row_ok = rows < M
            mask = row_ok[:, None] & col_ok[None, :]
            z = load_norm_input(X, R, H, rows, c, mask, stride_x, stride_r, stride_h, HAS_R, PHASE != 2, H_CODE)
            q, _ = publish_and_gather(PART, COUNT, row, chunk, M, tl.sum(z * z), 0.0, 1, CHUNKS, CHUNKS_P2, PHASE)
            if PHASE != 1:
                rstd = tl.zeros([1], dtype=tl.float32) + tl.math.rsqrt(tl.sum(q) / N + eps)
                if chunk == 0:
                    tl.store(RSTD + rows, rstd, mask=row_ok)
                if PER_ROW_W:
                    wr = load_param(W, rows, row_ok, c, col_ok, w_rows, N, True) + offset
                    y = _rms_apply(z, rstd, wr, HAS_W, NORM_CODE, NAT_CODE, OUT_CODE)
                else:
                    y = _rms_apply(z, rstd, w, HAS_W, NORM_CODE, NAT_CODE, OUT_CODE)
                tl.store(Y + rows[:, None] * stride_y + c[None, :], y, mask=mask)


@triton.jit
def _rms_bwd_tile(DY, Z, W, rows, row_ok, c, col_ok, mask, rstd, w, w_rows, N, stride_dy, stride_z, offset,
                  HAS_W: tl.constexpr, PER_ROW_W: tl.constexpr):
    """(nhat, dn, dy) for one tile: nhat = z * rstd, dn = dy * (offset + w), the grad w.r.t. nhat.
    `w` is the program's `offset + w` (per-row weights are loaded here instead)."""
    z = load_rows(Z, rows, c, mask, stride_z)
    dy = load_rows(DY, rows, c, mask, stride_dy)
    nhat = z * rstd[:, None]
    dn = dy
    if HAS_W:
        if PER_ROW_W:
            dn = dy * (load_param(W, rows, row_ok, c, col_ok, w_rows, N, True) + offset)
        else:
            dn = dy * w
    return nhat, dn, dy


@triton.jit(do_not_specialize=["M", "offset"])
def _rms_bwd_kernel(
    DY, DH, Z, W, RSTD, DX, DR, DWP, PART, COUNT,
    M, N, w_rows, stride_dy, stride_dh, stride_z, stride_dx, stride_dr,
    offset,
    HAS_W: tl.constexpr, PER_ROW_W: tl.constexpr, HAS_DW: tl.constexpr, HAS_DH: tl.constexpr,
    HAS_DR: tl.constexpr, NORM_CODE: tl.constexpr, DX_CODE: tl.constexpr, DR_CODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
    PHASE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # Persistent: each program loops over rows, keeps its dW sums in fp32 registers and writes
    # them once, as its own row of DWP (its chunk's columns of one row when rows are split).
    cols = tl.arange(0, BLOCK_N)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    w = 0.0
    if CHUNKS == 1:
        pid = tl.program_id(0)
        col_ok = cols < N
        if HAS_W and not PER_ROW_W:
            w = load_param(W, tl.arange(0, BLOCK_M), True, cols, col_ok, w_rows, N, False) + offset  # once per program
        for rb in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=NUM_STAGES):
            rows = rb * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
            row_ok = rows < M
            mask = row_ok[:, None] & col_ok[None, :]
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            nhat, dn, dy = _rms_bwd_tile(DY, Z, W, rows, row_ok, cols, col_ok, mask, rstd, w, w_rows, N,
                                         stride_dy, stride_z, offset, HAS_W, PER_ROW_W)
            mean_dn_nhat = tl.sum(dn * nhat, axis=1) / N
            dx = (dn - nhat * mean_dn_nhat[:, None]) * rstd[:, None]
            store_input_grads(DH, DX, DR, rows, cols, mask, dx, stride_dh, stride_dx, stride_dr,
                              HAS_DH, HAS_DR, DX_CODE, DR_CODE)
            if HAS_DW:
                # dW sees the value the forward multiplied by the weight (rounded for llama/t5).
                dw_acc += tl.sum(dy * round_to(nhat, NORM_CODE), axis=0)
        if HAS_DW:
            tl.store(DWP + pid * N + cols, dw_acc, mask=col_ok)
    else:
        chunk, group, groups = split_rows(M, CHUNKS)
        c = chunk * BLOCK_N + cols
        col_ok = c < N
        if HAS_W and not PER_ROW_W:
            w = load_param(W, tl.arange(0, 1), True, c, col_ok, w_rows, N, False) + offset  # once per program
        # Not software-pipelined (no num_stages): a prefetch of the next row's partials would be
        # issued before that row's wait, and read chunks that have not arrived yet.
        for row in range(group, M, groups):
            rows = row + tl.arange(0, 1).to(tl.int64)
            row_ok = rows < M
            mask = row_ok[:, None] & col_ok[None, :]
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            nhat, dn, dy = _rms_bwd_tile(DY, Z, W, rows, row_ok, c, col_ok, mask, rstd, w, w_rows, N,
                                         stride_dy, stride_z, offset, HAS_W, PER_ROW_W)
            q, _ = publish_and_gather(PART, COUNT, row, chunk, M, tl.sum(dn * nhat), 0.0, 1, CHUNKS, CHUNKS_P2,
                                      PHASE)
            if PHASE != 1:
                dx = (dn - nhat * (tl.sum(q) / N)) * rstd[:, None]
                store_input_grads(DH, DX, DR, rows, c, mask, dx, stride_dh, stride_dx, stride_dr,
                                  HAS_DH, HAS_DR, DX_CODE, DR_CODE)
                if HAS_DW:
                    dw_acc += tl.sum(dy * round_to(nhat, NORM_CODE), axis=0)
        if HAS_DW and PHASE != 1:
            tl.store(DWP + group * N + c, dw_acc, mask=col_ok)


# ----------------------------------------------------------------------------------------------
# Launchers (plain tensors in, plain tensors out; no autograd).


def _norm_code(casting: str, x_dtype: torch.dtype, w_dtype: torch.dtype | None) -> int:
    """Rounding applied to h * rstd before the weight multiplies it."""
    if w_dtype is None:
        return 0
    if casting == "llama":
        return C.DTYPE_CODE[x_dtype]
    if casting == "t5" and w_dtype in HALF:
        return C.DTYPE_CODE[w_dtype]
    return 0


def _rms_forward(x, weight, residual, eps, offset, casting, out_dtype, residual_in_fp32):
    w_dtype = None if weight is None else weight.dtype
    natural = rms_out_dtype(x.dtype, w_dtype, casting)
    return C.launch_forward(
        _rms_fwd_kernel, x, residual, [weight], 1, out_dtype or natural, residual_in_fp32, eps, offset,
        HAS_W=weight is not None, NORM_CODE=_norm_code(casting, x.dtype, w_dtype), NAT_CODE=C.DTYPE_CODE[natural],
    )


def _rms_backward(dy, dh, z, weight, rstd, offset, casting, x_dtype, residual_dtype, need_dw=True):
    need_dw = need_dw and weight is not None
    code = _norm_code(casting, x_dtype, None if weight is None else weight.dtype)
    per_head = weight is not None and weight.dim() == 2
    dx, dw, dr = C.launch_backward(
        _rms_bwd_kernel, dy, dh, z, weight, [rstd], offset, x_dtype, residual_dtype,
        [weight if need_dw and not per_head else None], HAS_DW=need_dw and not per_head, NORM_CODE=code,
    )
    if need_dw and per_head:
        # Per-head weights: each head's dW sums its own rows; a (programs, heads, N) partial buffer
        # in the kernel is not worth it for q/k norms (N = head_dim), so torch sums in fp32 here.
        nhat = z.float() * rstd.unsqueeze(-1)
        if code:
            nhat = nhat.to(C.CODE_DTYPE[code]).float()
        dw = (dy.float() * nhat).reshape(-1, *weight.shape).sum(0).to(weight.dtype)
    return dx, dw, dr


# ----------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile (traced through the fake impls, no graph breaks)
# and safe under CUDA graphs (no host syncs, no allocations that depend on values).


@torch.library.custom_op("normswap::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float,
    offset: float, casting: str, out_dtype: torch.dtype | None, residual_in_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, h, rstd); h is an empty tensor when there is no residual."""
    with C.device_guard(x):
        return _rms_forward(x, weight, residual, eps, offset, casting, out_dtype, residual_in_fp32)


@rms_norm_fwd.register_fake
def _(x, weight, residual, eps, offset, casting, out_dtype, residual_in_fp32):
    y_dtype = out_dtype or rms_out_dtype(x.dtype, None if weight is None else weight.dtype, casting)
    return C.fake_forward(x, residual, residual_in_fp32, 1, y_dtype)


@torch.library.custom_op("normswap::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor, dh: torch.Tensor | None, z: torch.Tensor, weight: torch.Tensor | None,
    rstd: torch.Tensor, offset: float, casting: str, x_dtype: torch.dtype, residual_dtype: torch.dtype | None,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight, dresidual); absent ones (or dweight when not needed) are empty tensors."""
    with C.device_guard(z):
        return _rms_backward(dy, dh, z, weight, rstd, offset, casting, x_dtype, residual_dtype, need_dw)


@rms_norm_bwd.register_fake
def _(dy, dh, z, weight, rstd, offset, casting, x_dtype, residual_dtype, need_dw):
    return C.fake_backward(z, x_dtype, residual_dtype, [weight if need_dw else None])


def _setup_context(ctx, inputs, output):
    x, weight, residual, eps, offset, casting, out_dtype, residual_in_fp32 = inputs
    _, h, rstd = output
    # The norm's input is h (as stored) with a residual, else x itself.
    ctx.save_for_backward(x if residual is None else h, weight, rstd)
    ctx.offset, ctx.casting, ctx.x_dtype = offset, casting, x.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dh, _drstd):
    z, weight, rstd = ctx.saved_tensors
    if ctx.residual_dtype is None:  # h is an empty placeholder: a gradient reaching it carries nothing
        dh = None
    if dy is None:
        dy = torch.zeros(z.shape, dtype=z.dtype, device=z.device)
    # A frozen weight (no grad wanted) skips the dW partial sums entirely.
    need_dw = weight is not None and ctx.needs_input_grad[1]
    separate_dr = C.needs_separate_residual_grad(ctx.x_dtype, ctx.residual_dtype)
    dx, dw, dr = rms_norm_bwd(dy, dh, z, weight, rstd, ctx.offset, ctx.casting, ctx.x_dtype,
                              ctx.residual_dtype if separate_dr else None, need_dw)
    return (dx, dw if need_dw else None, C.residual_grad(dx, dr, ctx.residual_dtype, separate_dr),
            None, None, None, None, None)


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Functional API (the signature every backend shares).


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float = 0.0,
    casting: str = "llama",
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    residual_in_fp32: bool = False,
):
    """Triton RMSNorm over the last dim. With `residual`: returns (norm(x + residual), x + residual)."""
    if casting not in CASTINGS:
        raise NormswapError(f"unknown casting mode {casting!r}; expected one of {', '.join(CASTINGS)}")
    C.check_norm_inputs("rms_norm", x, residual, out_dtype, {"weight": weight})
    y, h, _ = rms_norm_fwd(x, weight, residual, float(eps), float(offset), casting, out_dtype, bool(residual_in_fp32))
    return (y, h) if residual is not None else y
