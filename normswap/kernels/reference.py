"""Pure-torch references: the exact arithmetic of each norm family, in the input's dtypes.

These are the contract every backend must meet. Called with float64 tensors they are also the
high-precision ground truth that tests and per-module verification compare against.
Never imports transformers.
"""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)


def _add_residual(x, residual, residual_in_fp32):
    """h = x + residual, summed in fp32 (or the wider input dtype) and stored in the residual's dtype
    (fp32 when residual_in_fp32)."""
    acc = torch.promote_types(torch.promote_types(x.dtype, residual.dtype), torch.float32)
    h = x.to(acc) + residual.to(acc)
    store = torch.float32 if residual_in_fp32 else residual.dtype
    if store == torch.float32 and acc == torch.float64:
        store = torch.float64
    return h.to(store)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float = 0.0,
    casting: str = "llama",
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    residual_in_fp32: bool = False,
):
    """RMSNorm over the last dimension. With `residual`, returns (norm(x + residual), x + residual)."""
    h = None
    if residual is not None:
        h = _add_residual(x, residual, residual_in_fp32)
        x = h.to(x.dtype) if not residual_in_fp32 else h
    in_dtype = x.dtype
    acc = torch.promote_types(in_dtype, torch.float32)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        y = normed.to(in_dtype)
    elif casting == "llama":
        w = weight if offset == 0 else weight.to(acc) + offset
        y = w * normed.to(in_dtype)
    elif casting == "gemma":
        y = (normed * (offset + weight.to(acc))).to(in_dtype)
    elif casting == "t5":
        w = weight if offset == 0 else weight.to(acc) + offset
        if weight.dtype in HALF:
            normed = normed.to(weight.dtype)
        y = w * normed
    elif casting == "none":
        y = (normed * (offset + weight.to(acc))).to(in_dtype)
    else:
        raise ValueError(f"unknown casting mode {casting!r}")
    if out_dtype is not None:
        y = y.to(out_dtype)
    return (y, h) if residual is not None else y


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    residual_in_fp32: bool = False,
):
    """LayerNorm over the last dimension, statistics and affine in fp32 (or fp64), one final cast."""
    h = None
    if residual is not None:
        h = _add_residual(x, residual, residual_in_fp32)
        x = h.to(x.dtype) if not residual_in_fp32 else h
    in_dtype = x.dtype
    acc = torch.promote_types(in_dtype, torch.float32)
    xf = x.to(acc)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * (offset + weight.to(acc))
    if bias is not None:
        y = y + bias.to(acc)
    y = y.to(out_dtype or in_dtype)
    return (y, h) if residual is not None else y
