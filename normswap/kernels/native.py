"""The `torch` backend: PyTorch's native F.rms_norm / F.layer_norm, composed so that every casting
mode keeps the reference's numerics (normswap/kernels/reference.py).

What the native ops compute: F.rms_norm(x, (N,), w, eps) = (x.float() * rstd * w).to(x.dtype) and
F.layer_norm computes statistics and the affine in fp32 with one final cast. So:

- rms, no weight, any mode ....... native:   F.rms_norm(h, None) (then a cast to x.dtype if h is wider)
- rms llama (any offset) ......... native + one multiply: the native no-weight result *is* Llama's
                                   rounded normalized value; the weight multiplies it in torch
- rms t5, half weight = x.dtype .. native + one multiply (same reason); other t5 cases compose on fp32
- rms gemma/none, offset 0, weight dtype = x.dtype .... native with the weight
- rms gemma/none otherwise ....... composition: F.rms_norm on an fp32 upcast with the fp32 weight
                                   (offset + w formed in fp32), then one cast -- extra traffic, exact
- layer_norm, offset 0, weight/bias dtype = x.dtype ... native
- layer_norm otherwise ........... composition: F.layer_norm on fp32 upcasts, one cast
- per-head (heads, N) parameters . the native op without parameters, the affine in fp32, one cast
- fused residual ................. not fused: h = x + residual in torch (summed in fp32, stored in
                                   the stream dtype), then the norm of h
None of these silently changes the arithmetic; they only cost more memory traffic where unfused.
"""

from __future__ import annotations

import torch.nn.functional as F

from normswap.kernels.reference import HALF, norm_result, rms_out_dtype, split_residual
from normswap.specs import CASTINGS


def rms_norm(x, weight, eps, offset=0.0, casting="llama", residual=None, out_dtype=None, residual_in_fp32=False):
    if casting not in CASTINGS:
        raise ValueError(f"unknown casting mode {casting!r}")
    in_dtype = x.dtype
    z, h = split_residual(x, residual, residual_in_fp32)
    n = (z.shape[-1],)
    eps = float(eps)
    natural = rms_out_dtype(in_dtype, None if weight is None else weight.dtype, casting)
    if weight is None:
        y = F.rms_norm(z, n, None, eps).to(in_dtype)
    elif casting == "llama" or (casting == "t5" and weight.dtype in HALF and weight.dtype == in_dtype):
        normed = F.rms_norm(z, n, None, eps).to(in_dtype)
        w = weight if offset == 0 else weight.float() + offset
        y = (w * normed).to(natural)
    elif casting == "t5":
        normed = F.rms_norm(z.float(), n, None, eps)
        if weight.dtype in HALF:
            normed = normed.to(weight.dtype)
        w = weight if offset == 0 else weight.float() + offset
        y = (w * normed).to(natural)
    elif weight.dim() > 1:
        # Per-head (heads, N) weight: the native op takes an (N,) weight only; same fp32 product.
        y = (F.rms_norm(z.float(), n, None, eps) * (weight.float() + offset)).to(in_dtype)
    elif offset == 0 and weight.dtype == z.dtype:
        y = F.rms_norm(z, n, weight, eps).to(in_dtype)
    else:
        y = F.rms_norm(z.float(), n, weight.float() + offset, eps).to(in_dtype)
    return norm_result(y, h, out_dtype)


def layer_norm(x, weight, bias, eps, offset=0.0, residual=None, out_dtype=None, residual_in_fp32=False):
    in_dtype = x.dtype
    z, h = split_residual(x, residual, residual_in_fp32)
    n = (z.shape[-1],)
    eps = float(eps)
    native = offset == 0 and all(t is None or t.dtype == z.dtype for t in (weight, bias))
    if any(t is not None and t.dim() > 1 for t in (weight, bias)):
        # Per-head (heads, N) parameters: normalise natively, the affine in fp32, one cast.
        y = F.layer_norm(z.float(), n, None, None, eps)
        if weight is not None:
            y = y * (weight.float() + offset)
        if bias is not None:
            y = y + bias.float()
    elif native:
        y = F.layer_norm(z, n, weight, bias, eps)
    else:
        w = None if weight is None else weight.float() + offset
        b = None if bias is None else bias.float()
        y = F.layer_norm(z.float(), n, w, b, eps)
    return norm_result(y, h, out_dtype or in_dtype)
