"""Pure-torch references: the exact arithmetic of each norm family, in the input's dtypes.

These are the contract every backend must meet. Called with float64 tensors they are also the
high-precision ground truth that tests and per-module verification compare against.
Never imports transformers.

Dtype contract (what every backend returns when out_dtype is None; `x` means the *input* x, even
when a residual is added):
- no weight:            x.dtype
- casting "llama":      promote(weight.dtype, x.dtype)       (HF: weight * normed.to(input_dtype))
- casting "gemma"/"none": x.dtype                            (product in fp32, one final cast)
- casting "t5":         weight.dtype if half, else promote(weight.dtype, fp32)
- layer_norm:           x.dtype
An offset never changes the output dtype: `offset + weight` is formed in fp32 (adding 1 to a bf16
weight in bf16 would round 1 + 0.0039 to 1.0), and the product is cast to the dtype above.

Fused residual: h = x + residual is summed in fp32 and *stored* in residual.dtype (fp32 with
residual_in_fp32). The norm reads h exactly as stored — the value the next layer sees — while the
casting mode and output dtype still follow x.dtype, so residual_in_fp32 only widens the stream.
"""

from __future__ import annotations

import torch

from normswap.specs import CASTINGS

HALF = (torch.float16, torch.bfloat16)


def _acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp32, or float64 when any of `dtypes` is (the references double as float64 ground truth)."""
    acc = torch.float32
    for dtype in dtypes:
        acc = torch.promote_types(acc, dtype)
    return acc


def _add_residual(x, residual, residual_in_fp32):
    """h = x + residual, summed in fp32 (or the wider input dtype) and stored in the residual's dtype
    (fp32 when residual_in_fp32)."""
    acc = _acc_dtype(x.dtype, residual.dtype)
    h = x.to(acc) + residual.to(acc)
    store = torch.float32 if residual_in_fp32 else residual.dtype
    if store == torch.float32 and acc == torch.float64:
        store = torch.float64
    return h.to(store)


def split_residual(x, residual, residual_in_fp32):
    """(z, h): z is what the norm reads -- h = x + residual as stored, or x itself without a
    residual -- and h is None without one."""
    if residual is None:
        return x, None
    h = _add_residual(x, residual, residual_in_fp32)
    return h, h


def norm_result(y, h, out_dtype=None):
    """What every backend returns: y (cast to out_dtype when given), paired with h when there was
    a residual."""
    if out_dtype is not None:
        y = y.to(out_dtype)
    return y if h is None else (y, h)


def rms_out_dtype(x_dtype: torch.dtype, weight_dtype: torch.dtype | None, casting: str) -> torch.dtype:
    """The dtype rms_norm returns when out_dtype is None (see the module docstring)."""
    if weight_dtype is None or casting in ("gemma", "none"):
        return x_dtype
    if casting == "llama":
        return torch.promote_types(weight_dtype, x_dtype)
    if casting == "t5":
        return weight_dtype if weight_dtype in HALF else torch.promote_types(weight_dtype, torch.float32)
    raise ValueError(f"unknown casting mode {casting!r}")


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
    if casting not in CASTINGS:
        raise ValueError(f"unknown casting mode {casting!r}")
    in_dtype = x.dtype
    z, h = split_residual(x, residual, residual_in_fp32)
    acc = _acc_dtype(z.dtype, in_dtype)
    zf = z.to(acc)
    normed = zf * torch.rsqrt(zf.pow(2).mean(-1, keepdim=True) + eps)
    natural = rms_out_dtype(in_dtype, None if weight is None else weight.dtype, casting)
    if weight is None:
        y = normed.to(in_dtype)
    elif casting == "llama":
        # HF Llama: weight * normed.to(input_dtype) -- the normalized value is rounded first.
        w = weight if offset == 0 else weight.to(acc) + offset
        y = (w * normed.to(in_dtype)).to(natural)
    elif casting == "t5":
        # HF T5: the normalized value is cast to the weight's dtype only for half-precision weights.
        if weight.dtype in HALF:
            normed = normed.to(weight.dtype)
        w = weight if offset == 0 else weight.to(acc) + offset
        y = (w * normed).to(natural)
    else:  # "gemma" (HF Gemma: fp32 product with 1 + weight) and "none" (same arithmetic, any offset)
        y = (normed * (offset + weight.to(acc))).to(in_dtype)
    return norm_result(y, h, out_dtype)


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
    in_dtype = x.dtype
    z, h = split_residual(x, residual, residual_in_fp32)
    acc = _acc_dtype(z.dtype, in_dtype)
    zf = z.to(acc)
    mean = zf.mean(-1, keepdim=True)
    var = (zf - mean).pow(2).mean(-1, keepdim=True)
    y = (zf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * (offset + weight.to(acc))
    if bias is not None:
        y = y + bias.to(acc)
    return norm_result(y, h, out_dtype or in_dtype)
