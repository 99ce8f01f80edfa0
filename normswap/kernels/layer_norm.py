"""LayerNorm: Triton kernels -> launchers -> torch.library ops (fake impl + autograd) -> functional.

    y = cast((h - mean) * rstd * (offset + w) + b),  rstd = 1 / sqrt(var(h) + eps),  h = x [+ residual]

Statistics and the affine run in fp32 with one final cast (reference.layer_norm_ref is the
contract). Rows that fit one tile use an exact two-pass variance in registers; wider rows are
split over several programs, each with its chunk's exact (mean, M2), merged over the chunks with
the parallel-variance formula -- one read, and stable even when the mean is large next to the
spread (sum/sum-of-squares would cancel catastrophically there). Per-head weight and bias
(heads, N) apply to x shaped (..., heads, N). dW and dB are reduced like RMSNorm's: per-program fp32
partial rows written once, then an fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normswap.kernels import _common as C
from normswap.kernels._common import (
    load_norm_input,
    load_param,
    load_rows,
    publish_and_gather,
    round_to,
    rounded_product,
    split_rows,
    store_input_grads,
)

# ----------------------------------------------------------------------------------------------
# Triton kernels (int64 row offsets; M never specialised).


@triton.jit
def _ln_params(W, B, rows, row_ok, c, col_ok, w_rows, N, offset, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
               PER_ROW_W: tl.constexpr):
    """(offset + w, b) in fp32, broadcastable to the tile (0.0 where absent)."""
    w = 0.0
    b = 0.0
    if HAS_W:
        w = load_param(W, rows, row_ok, c, col_ok, w_rows, N, PER_ROW_W) + offset
    if HAS_B:
        b = load_param(B, rows, row_ok, c, col_ok, w_rows, N, PER_ROW_W)
    return w, b


@triton.jit
def _ln_apply(z, mean, rstd, w, b, HAS_W: tl.constexpr, HAS_B: tl.constexpr, OUT_CODE: tl.constexpr):
    y = (z - mean[:, None]) * rstd[:, None]
    if HAS_W:
        y = y * w
    if HAS_B:
        y = y + b
    return round_to(y, OUT_CODE)


@triton.jit(do_not_specialize=["M", "eps", "offset"])
def _ln_fwd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD, PART, COUNT,
    M, N, w_rows, stride_x, stride_r, stride_y, stride_h,
    eps, offset,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr, PER_ROW_W: tl.constexpr,
    H_CODE: tl.constexpr, OUT_CODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
    PHASE: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_N)
    if CHUNKS == 1:
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        col_ok = cols < N
        mask = row_ok[:, None] & col_ok[None, :]
        # Parameters before the reduction, so that their latency hides under the row's.
        w, b = _ln_params(W, B, rows, row_ok, cols, col_ok, w_rows, N, offset, HAS_W, HAS_B, PER_ROW_W)
        z = load_norm_input(X, R, H, rows, cols, mask, stride_x, stride_r, stride_h, HAS_R, True, H_CODE)
        mean = tl.sum(z, axis=1) / N
        d = tl.where(mask, z - mean[:, None], 0.0)
        rstd = tl.math.rsqrt(tl.sum(d * d, axis=1) / N + eps)
        tl.store(MEAN + rows, mean, mask=row_ok)
        tl.store(RSTD + rows, rstd, mask=row_ok)
        y = _ln_apply(z, mean, rstd, w, b, HAS_W, HAS_B, OUT_CODE)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
    else:
        # Split rows: each chunk's exact (mean, M2) in registers, combined over the row's chunks
        # with the parallel-variance formula (stable when the mean is large next to the spread).
        chunk, group, groups = split_rows(M, CHUNKS)
        c = chunk * BLOCK_N + cols
        col_ok = c < N
        nb = tl.minimum(N - chunk * BLOCK_N, BLOCK_N).to(tl.float32)
        ks = tl.arange(0, CHUNKS_P2)
        counts = tl.minimum(tl.maximum(N - ks * BLOCK_N, 0), BLOCK_N).to(tl.float32)
        w = 0.0
        b = 0.0
        if not PER_ROW_W:
            w, b = _ln_params(W, B, tl.arange(0, 1), True, c, col_ok, w_rows, N, offset, HAS_W, HAS_B, False)
        for row in range(group, M, groups):
            rows = row + tl.arange(0, 1).to(tl.int64)
            row_ok = rows < M
            mask = row_ok[:, None] & col_ok[None, :]
            z = load_norm_input(X, R, H, rows, c, mask, stride_x, stride_r, stride_h, HAS_R, PHASE != 2, H_CODE)
            bmean = tl.sum(z) / nb
            bd = tl.where(mask, z - bmean, 0.0)
            qm, q2 = publish_and_gather(PART, COUNT, row, chunk, M, bmean, tl.sum(bd * bd), 2, CHUNKS, CHUNKS_P2,
                                        PHASE)
            if PHASE != 1:
                mean_s = tl.sum(counts * qm) / N
                dm = qm - mean_s
                mean = tl.zeros([1], dtype=tl.float32) + mean_s
                rstd = tl.zeros([1], dtype=tl.float32) + tl.math.rsqrt(tl.sum(q2 + counts * dm * dm) / N + eps)
                if chunk == 0:
                    tl.store(MEAN + rows, mean, mask=row_ok)
                    tl.store(RSTD + rows, rstd, mask=row_ok)
                if PER_ROW_W:
                    wr, br = _ln_params(W, B, rows, row_ok, c, col_ok, w_rows, N, offset, HAS_W, HAS_B, True)
                    y = _ln_apply(z, mean, rstd, wr, br, HAS_W, HAS_B, OUT_CODE)
                else:
                    y = _ln_apply(z, mean, rstd, w, b, HAS_W, HAS_B, OUT_CODE)
                tl.store(Y + rows[:, None] * stride_y + c[None, :], y, mask=mask)


@triton.jit
def _ln_bwd_tile(DY, Z, W, rows, row_ok, c, col_ok, mask, mean, rstd, w, w_rows, N, stride_dy, stride_z, offset,
                 HAS_W: tl.constexpr, PER_ROW_W: tl.constexpr):
    """(xhat, wdy, dy) for one tile; padded columns give zeros everywhere. `w` is the program's
    `offset + w` (per-row weights are loaded here instead). wdy is rounded once (rounded_product):
    dx subtracts its row mean from it, and where that mean is wdy itself (a 1-wide row, or every
    wdy of the row equal with an exact sum) the difference must be exactly 0, not a rounding error
    amplified by rstd (1/sqrt(eps) for a 1-wide row)."""
    z = load_rows(Z, rows, c, mask, stride_z)
    dy = load_rows(DY, rows, c, mask, stride_dy)
    xhat = tl.where(mask, (z - mean[:, None]) * rstd[:, None], 0.0)
    wdy = dy
    if HAS_W:
        if PER_ROW_W:
            wdy = rounded_product(dy, load_param(W, rows, row_ok, c, col_ok, w_rows, N, True) + offset)
        else:
            wdy = rounded_product(dy, w)
    return xhat, wdy, dy


@triton.jit(do_not_specialize=["M", "offset"])
def _ln_bwd_kernel(
    DY, DH, Z, W, MEAN, RSTD, DX, DR, DWP, DBP, PART, COUNT,
    M, N, w_rows, stride_dy, stride_dh, stride_z, stride_dx, stride_dr,
    offset,
    HAS_W: tl.constexpr, PER_ROW_W: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr,
    HAS_DH: tl.constexpr, HAS_DR: tl.constexpr, DX_CODE: tl.constexpr, DR_CODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
    PHASE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # Persistent: dW / dB summed in fp32 registers over the program's rows, written once as its own
    # row of DWP / DBP (its chunk's columns of one row when rows are split).
    cols = tl.arange(0, BLOCK_N)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
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
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            xhat, wdy, dy = _ln_bwd_tile(DY, Z, W, rows, row_ok, cols, col_ok, mask, mean, rstd, w, w_rows, N,
                                         stride_dy, stride_z, offset, HAS_W, PER_ROW_W)
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
            tl.store(DWP + pid * N + cols, dw_acc, mask=col_ok)
        if HAS_DB:
            tl.store(DBP + pid * N + cols, db_acc, mask=col_ok)
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
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            xhat, wdy, dy = _ln_bwd_tile(DY, Z, W, rows, row_ok, c, col_ok, mask, mean, rstd, w, w_rows, N,
                                         stride_dy, stride_z, offset, HAS_W, PER_ROW_W)
            q1, q2 = publish_and_gather(PART, COUNT, row, chunk, M, tl.sum(xhat * wdy), tl.sum(wdy), 2, CHUNKS,
                                        CHUNKS_P2, PHASE)
            if PHASE != 1:
                dx = (wdy - (xhat * (tl.sum(q1) / N) + tl.sum(q2) / N)) * rstd[:, None]
                store_input_grads(DH, DX, DR, rows, c, mask, dx, stride_dh, stride_dx, stride_dr,
                                  HAS_DH, HAS_DR, DX_CODE, DR_CODE)
                if HAS_DW:
                    dw_acc += tl.sum(dy * xhat, axis=0)
                if HAS_DB:
                    db_acc += tl.sum(dy, axis=0)
        if HAS_DW and PHASE != 1:
            tl.store(DWP + group * N + c, dw_acc, mask=col_ok)
        if HAS_DB and PHASE != 1:
            tl.store(DBP + group * N + c, db_acc, mask=col_ok)


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
    per_head = any(p is not None and p.dim() == 2 for p in (weight, bias))
    dx, dw, db, dr = C.launch_backward(
        _ln_bwd_kernel, dy, dh, z, weight, [mean, rstd], offset, x_dtype, residual_dtype,
        [None, None] if per_head else [weight if need_dw else None, bias],
        HAS_DW=need_dw and not per_head, HAS_DB=bias is not None and not per_head,
    )
    if per_head:
        # Per-head parameters: each head's dW / dB sums its own rows; torch sums them in fp32 here
        # (q/k norms are head_dim wide: a per-head partial buffer in the kernel is not worth it).
        heads = (weight if weight is not None else bias).shape
        dyf = dy.float().reshape(-1, *heads)
        if need_dw:
            xhat = (z.float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
            dw = (dyf * xhat.reshape(-1, *heads)).sum(0).to(weight.dtype)
        if bias is not None:
            db = dyf.sum(0).to(bias.dtype)
    return dx, dw, db, dr


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
    separate_dr = C.needs_separate_residual_grad(ctx.x_dtype, ctx.residual_dtype)
    dx, dw, db, dr = layer_norm_bwd(dy, dh, z, weight, bias if need_db else None, mean, rstd, ctx.offset,
                                    ctx.x_dtype, ctx.residual_dtype if separate_dr else None, need_dw)
    return (dx, dw if need_dw else None, db if need_db else None,
            C.residual_grad(dx, dr, ctx.residual_dtype, separate_dr), None, None, None, None)


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
    C.check_norm_inputs("layer_norm", x, residual, out_dtype, {"weight": weight, "bias": bias})
    y, h, _, _ = layer_norm_fwd(x, weight, bias, residual, float(eps), float(offset), out_dtype, bool(residual_in_fp32))
    return (y, h) if residual is not None else y
