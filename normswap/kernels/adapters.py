"""Adapters for third-party kernels (Liger-Kernel, quack) behind the shared functional signature.

They run only what the library computes with the reference's numerics; any other combination is a
NormswapError naming what is unsupported -- never a silent change of arithmetic. Residual adds are
done in torch before calling them (their fused-add variants round h differently or not at all).
Neither package is installed on the development machine: these adapters are exercised on GPUs only.
"""

from __future__ import annotations

import torch

from normswap.errors import NormswapError
from normswap.kernels.reference import HALF, norm_result, rms_out_dtype, split_residual


def _per_column_only(name: str, *params) -> None:
    if any(p is not None and p.dim() > 1 for p in params):
        raise NormswapError(f"the {name} backend takes (N,) parameters only, not per-head (heads, N) ones")

# Liger-Kernel ---------------------------------------------------------------------------------
# Supported: llama with offset 0 (its llama mode adds the offset in the weight's dtype), gemma with
# any offset (fp32 weight + offset). Its "none" mode computes in the input dtype, unlike ours.


def liger_rms_norm(x, weight, eps, offset=0.0, casting="llama", residual=None, out_dtype=None,
                   residual_in_fp32=False):
    _per_column_only("liger", weight)
    if weight is None:
        raise NormswapError("the liger backend needs a weight (Liger's RMSNorm has no weight-free form)")
    if casting == "llama" and offset != 0:
        raise NormswapError("the liger backend cannot run casting 'llama' with an offset (it adds it in low precision)")
    if casting == "llama" and weight.dtype != x.dtype:
        # Liger writes y in x's dtype; Llama's weight * normed returns promote(weight, x) (fp32 for an
        # fp32 weight on bf16 activations).
        raise NormswapError(f"the liger backend cannot run casting 'llama' with a {weight.dtype} weight on "
                            f"{x.dtype} inputs (it returns {x.dtype}, Llama returns the promoted dtype)")
    if casting not in ("llama", "gemma"):
        raise NormswapError(f"the liger backend has no casting mode {casting!r} with normswap's numerics; use llama or gemma")
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    z, h = split_residual(x, residual, residual_in_fp32)
    z = z.to(x.dtype).contiguous()
    # in_place=False: Liger's in-place backward writes dX into dY, a buffer it does not own.
    y = LigerRMSNormFunction.apply(z, weight, float(eps), float(offset), casting, False)
    return norm_result(y, h, out_dtype)


def liger_layer_norm(x, weight, bias, eps, offset=0.0, residual=None, out_dtype=None, residual_in_fp32=False):
    _per_column_only("liger", weight, bias)
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    if weight is None or bias is None or offset != 0:
        raise NormswapError("the liger backend's LayerNorm needs both weight and bias, and no offset")
    z, h = split_residual(x, residual, residual_in_fp32)
    y = LigerLayerNormFunction.apply(z.to(x.dtype).contiguous(), weight, bias, float(eps))
    return norm_result(y, h, out_dtype)


# quack ----------------------------------------------------------------------------------------
# quack's RMSNorm computes (x * rstd * w) in fp32 with one cast: casting gemma/none directly, with
# the fp32 weight `offset + w` when there is an offset. Llama (and T5 with a weight of x's dtype)
# is quack without a weight -- the rounded normalized value -- times the weight in torch.


def quack_rms_norm(x, weight, eps, offset=0.0, casting="llama", residual=None, out_dtype=None,
                   residual_in_fp32=False):
    _per_column_only("quack", weight)
    from quack.rmsnorm import rmsnorm

    z, h = split_residual(x, residual, residual_in_fp32)
    z = z.to(x.dtype)
    eps = float(eps)
    if weight is None:
        y = rmsnorm(z, None, eps=eps)
    elif casting in ("gemma", "none"):
        y = rmsnorm(z, weight if offset == 0 else weight.float() + offset, eps=eps)
    elif casting == "llama" or (casting == "t5" and weight.dtype in HALF and weight.dtype == x.dtype):
        w = weight if offset == 0 else weight.float() + offset
        y = (w * rmsnorm(z, None, eps=eps)).to(rms_out_dtype(x.dtype, weight.dtype, casting))
    else:
        raise NormswapError(f"the quack backend cannot run casting {casting!r} with a {weight.dtype} weight on {x.dtype}")
    return norm_result(y, h, out_dtype)


def quack_layer_norm(x, weight, bias, eps, offset=0.0, residual=None, out_dtype=None, residual_in_fp32=False):
    _per_column_only("quack", weight, bias)
    from quack.rmsnorm import layernorm_fwd

    if any(t is not None and t.requires_grad for t in (x, weight, bias, residual)):
        raise NormswapError("the quack backend has LayerNorm forward only (no backward); use it without grads")
    if weight is None:
        raise NormswapError("the quack backend's LayerNorm needs a weight")
    z, h = split_residual(x, residual, residual_in_fp32)
    n = z.shape[-1]
    w = weight.float() + offset
    b = None if bias is None else bias.float()
    y = layernorm_fwd(z.to(x.dtype).reshape(-1, n).contiguous(), w, b, eps=float(eps)).view(z.shape)
    return norm_result(y, h, out_dtype)


def require_cuda(name: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{name} kernels need a CUDA device (none found)")
