"""LayerNorm: Triton kernels -> launchers -> torch.library ops (fake impl + autograd) -> functional.

    y = cast((h - mean) * rstd * (offset + w) + b),  rstd = 1 / sqrt(var(h) + eps),  h = x [+ residual]

Statistics and the affine run in fp32 with one final cast (reference.layer_norm_ref is the
contract). Rows that fit one tile use an exact two-pass variance in registers; longer rows merge
per-block (mean, M2) pairs with Chan's formula, so one read gives stable statistics even when the
mean is large next to the spread (sum/sum-of-squares would cancel catastrophically there).
dW and dB are reduced like RMSNorm's: per-program fp32 partial rows, then an fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normswap.kernels import _common as C
from normswap.kernels._common import load_norm_input, round_to, store_input_grads

# ----------------------------------------------------------------------------------------------
# Triton kernels (int64 row offsets; M never specialised).


@triton.jit
def _ln_apply(z, mean, rstd, W, B, cols, col_ok, offset, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
              OUT_CODE: tl.constexpr):
    y = (z - mean[:, None]) * rstd[:, None]
    if HAS_W:
        y = y * (tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return round_to(y, OUT_CODE)


@triton.jit(do_not_specialize=["M", "eps", "offset"])
def _ln_fwd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,
    M, N, stride_x, stride_r, stride_y, stride_h,
    eps, offset,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr,
    H_CODE: tl.constexpr, OUT_CODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_N)
    if SINGLE:
        col_ok = cols < N
        mask = row_ok[:, None] & col_ok[None, :]
        z = load_norm_input(X, R, H, rows, cols, mask, stride_x, stride_r, stride_h, HAS_R, True, H_CODE)
        mean = tl.sum(z, axis=1) / N
        d = tl.where(mask, z - mean[:, None], 0.0)
        rstd = tl.math.rsqrt(tl.sum(d * d, axis=1) / N + eps)
        tl.store(MEAN + rows, mean, mask=row_ok)
        tl.store(RSTD + rows, rstd, mask=row_ok)
        y = _ln_apply(z, mean, rstd, W, B, cols, col_ok, offset, HAS_W, HAS_B, OUT_CODE)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
    else:
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        count = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            col_ok = c < N
            mask = row_ok[:, None] & col_ok[None, :]
            z = load_norm_input(X, R, H, rows, c, mask, stride_x, stride_r, stride_h, HAS_R, True, H_CODE)
            nb = tl.sum(col_ok.to(tl.float32), axis=0)
            bmean = tl.sum(z, axis=1) / nb
            bd = tl.where(mask, z - bmean[:, None], 0.0)
            bm2 = tl.sum(bd * bd, axis=1)
            # Chan et al.: merge (count, mean, m2) with the block's (nb, bmean, bm2).
            total = count + nb
            delta = bmean - mean
            mean = mean + delta * (nb / total)
            m2 = m2 + bm2 + delta * delta * (count * nb / total)
            count = total
        rstd = tl.math.rsqrt(m2 / N + eps)
        tl.store(MEAN + rows, mean, mask=row_ok)
        tl.store(RSTD + rows, rstd, mask=row_ok)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            col_ok = c < N
            mask = row_ok[:, None] & col_ok[None, :]
            z = load_norm_input(X, R, H, rows, c, mask, stride_x, stride_r, stride_h, HAS_R, False, H_CODE)
            y = _ln_apply(z, mean, rstd, W, B, c, col_ok, offset, HAS_W, HAS_B, OUT_CODE)
            tl.store(Y + rows[:, None] * stride_y + c[None, :], y, mask=mask)


@triton.jit
def _ln_bwd_tile(DY, Z, W, rows, c, mask, col_ok, mean, rstd, stride_dy, stride_z, offset, HAS_W: tl.constexpr):
    """(xhat, wdy, dy) for one tile; padded columns give zeros everywhere."""
    z = tl.load(Z + rows[:, None] * stride_z + c[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + c[None, :], mask=mask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (z - mean[:, None]) * rstd[:, None], 0.0)
    wdy = dy
    if HAS_W:
        wdy = dy * (tl.load(W + c, mask=col_ok, other=0.0).to(tl.float32) + offset)[None, :]
    return xhat, wdy, dy


@triton.jit(do_not_specialize=["M", "offset"])
def _ln_bwd_kernel(
    DY, DH, Z, W, MEAN, RSTD, DX, DR, DWP, DBP,
    M, N, stride_dy, stride_dh, stride_z, stride_dx, stride_dr,
    offset,
    HAS_W: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, HAS_DH: tl.constexpr,
    HAS_DR: tl.constexpr, DX_CODE: tl.constexpr, DR_CODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
):
    # Persistent programs; program `pid` owns row `pid` of the fp32 partial buffers DWP / DBP.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    row_blocks = tl.cdiv(M, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dwp_row = DWP + pid.to(tl.int64) * N
    dbp_row = DBP + pid.to(tl.int64) * N
    if SINGLE:
        col_ok = cols < N
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for rb in range(pid, row_blocks, nprog):
            rows = rb * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
            row_ok = rows < M
            mask = row_ok[:, None] & col_ok[None, :]
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            xhat, wdy, dy = _ln_bwd_tile(DY, Z, W, rows, cols, mask, col_ok, mean, rstd, stride_dy, stride_z,
                                         offset, HAS_W)
            c1 = tl.sum(xhat * wdy, axis=1) / N
            c2 = tl.sum(wdy, axis=1) / N
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            store_input_grads(DH, DX, DR, rows, cols, mask, dx, stride_dh, stride_dx, stride_dr,
                              HAS_DH, HAS_DR, DX_CODE, DR_CODE)
            if HAS_DW:
                dw_acc += tl.sum(dy * xhat, axis=0)
            if HAS_DB:
                db_acc += tl.sum(dy, axis=0)
        if HAS_DW:
            tl.store(dwp_row + cols, dw_acc, mask=col_ok)
        if HAS_DB:
            tl.store(dbp_row + cols, db_acc, mask=col_ok)
    else:
        for rb in range(pid, row_blocks, nprog):
            rows = rb * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
            row_ok = rows < M
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                col_ok = c < N
                mask = row_ok[:, None] & col_ok[None, :]
                xhat, wdy, dy = _ln_bwd_tile(DY, Z, W, rows, c, mask, col_ok, mean, rstd, stride_dy, stride_z,
                                             offset, HAS_W)
                acc1 += xhat * wdy
                acc2 += wdy
            c1 = tl.sum(acc1, axis=1) / N
            c2 = tl.sum(acc2, axis=1) / N
            for start in range(0, N, BLOCK_N):
                c = start + cols
                col_ok = c < N
                mask = row_ok[:, None] & col_ok[None, :]
                xhat, wdy, dy = _ln_bwd_tile(DY, Z, W, rows, c, mask, col_ok, mean, rstd, stride_dy, stride_z,
                                             offset, HAS_W)
                dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
                store_input_grads(DH, DX, DR, rows, c, mask, dx, stride_dh, stride_dx, stride_dr,
                                  HAS_DH, HAS_DR, DX_CODE, DR_CODE)
                if HAS_DW or HAS_DB:
                    # The partial rows were last written in the previous row block, possibly by
                    # other threads of this program: make those stores visible before reading.
                    tl.debug_barrier()
                if HAS_DW:
                    part = tl.load(dwp_row + c, mask=col_ok, other=0.0)
                    tl.store(dwp_row + c, part + tl.sum(dy * xhat, axis=0), mask=col_ok)
                if HAS_DB:
                    part = tl.load(dbp_row + c, mask=col_ok, other=0.0)
                    tl.store(dbp_row + c, part + tl.sum(dy, axis=0), mask=col_ok)


# ----------------------------------------------------------------------------------------------
# Launchers.


def _ln_forward(x, weight, bias, residual, eps, offset, out_dtype, residual_in_fp32):
    return C.launch_forward(
        _ln_fwd_kernel, x, residual, [weight, bias], 2, out_dtype or x.dtype, residual_in_fp32, eps, offset,
        HAS_W=weight is not None, HAS_B=bias is not None,
    )


def _ln_backward(dy, dh, z, weight, bias, mean, rstd, offset, x_dtype, residual_dtype, need_dw=True):
    """`bias` only tells whether (and in which dtype) dbias is wanted: pass None to skip it."""
    need_dw = need_dw and weight is not None
    return C.launch_backward(
        _ln_bwd_kernel, dy, dh, z, weight, [mean, rstd], offset, x_dtype, residual_dtype,
        [weight if need_dw else None, bias], HAS_DW=need_dw, HAS_DB=bias is not None,
    )


# ----------------------------------------------------------------------------------------------
# torch.library ops.


@torch.library.custom_op("normswap::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None,
    eps: float, offset: float, out_dtype: torch.dtype | None, residual_in_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, h, mean, rstd); h is an empty tensor when there is no residual."""
    with C.device_guard(x):
        return _ln_forward(x, weight, bias, residual, eps, offset, out_dtype, residual_in_fp32)


@layer_norm_fwd.register_fake
def _(x, weight, bias, residual, eps, offset, out_dtype, residual_in_fp32):
    return C.fake_forward(x, residual, residual_in_fp32, 2, out_dtype or x.dtype)


@torch.library.custom_op("normswap::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: torch.Tensor, dh: torch.Tensor | None, z: torch.Tensor, weight: torch.Tensor | None,
    bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, offset: float,
    x_dtype: torch.dtype, residual_dtype: torch.dtype | None, need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight, dbias, dresidual); absent or unwanted ones are empty tensors. `bias`
    is only read for its dtype and shape (dbias does not depend on its value); None skips dbias."""
    with C.device_guard(z):
        return _ln_backward(dy, dh, z, weight, bias, mean, rstd, offset, x_dtype, residual_dtype, need_dw)


@layer_norm_bwd.register_fake
def _(dy, dh, z, weight, bias, mean, rstd, offset, x_dtype, residual_dtype, need_dw):
    return C.fake_backward(z, x_dtype, residual_dtype, [weight if need_dw else None, bias])


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps, offset, out_dtype, residual_in_fp32 = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(x if residual is None else h, weight, bias, mean, rstd)
    ctx.offset, ctx.x_dtype = offset, x.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dh, _dmean, _drstd):
    z, weight, bias, mean, rstd = ctx.saved_tensors
    if ctx.residual_dtype is None:  # h is an empty placeholder: a gradient reaching it carries nothing
        dh = None
    if dy is None:
        dy = torch.zeros(z.shape, dtype=z.dtype, device=z.device)
    # Frozen parameters (no grad wanted) skip their partial sums entirely.
    need_dw = weight is not None and ctx.needs_input_grad[1]
    need_db = bias is not None and ctx.needs_input_grad[2]
    dx, dw, db, dr = layer_norm_bwd(dy, dh, z, weight, bias if need_db else None, mean, rstd, ctx.offset,
                                    ctx.x_dtype, ctx.residual_dtype, need_dw)
    return (dx, dw if need_dw else None, db if need_db else None,
            dr if ctx.residual_dtype is not None else None, None, None, None, None)


layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Functional API.


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    residual_in_fp32: bool = False,
):
    """Triton LayerNorm over the last dim. With `residual`: returns (norm(x + residual), x + residual)."""
    C.check_norm_inputs("layer_norm", _ln_fwd_kernel, x, residual, out_dtype, {"weight": weight, "bias": bias})
    y, h, _, _ = layer_norm_fwd(x, weight, bias, residual, float(eps), float(offset), out_dtype, bool(residual_in_fp32))
    return (y, h) if residual is not None else y
