"""Shared helper for the registry tests: does a spec reproduce its module's arithmetic?"""

from __future__ import annotations

import copy

import torch

from normswap.kernels.reference import layer_norm_ref, rms_norm_ref
from normswap.specs import NormSpec


def reference_output(x: torch.Tensor, module: torch.nn.Module, spec: NormSpec) -> torch.Tensor:
    w = getattr(module, spec.weight_attr) if spec.has_weight else None
    b = getattr(module, spec.bias_attr) if spec.has_bias else None
    if spec.kind == "rms":
        return rms_norm_ref(x, w, spec.eps, spec.offset, spec.casting)
    return layer_norm_ref(x, w, b, spec.eps, spec.offset)


def randomised_copy(module: torch.nn.Module, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A CPU copy in `dtype` with gains spread around 0.7 and random biases (never all-ones)."""
    m = copy.deepcopy(module)
    if any(p.is_meta for p in m.parameters()):
        m = m.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters(recurse=False):
            base = 0.0 if "bias" in name or "beta" in name else 0.7
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
    return m.to(dtype).eval()


def random_input(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((2, 7) + tuple(shape), generator=g) * 1.5 + 0.4
    return x.to(dtype)


def max_ulps(y: torch.Tensor, r: torch.Tensor) -> float:
    assert y.dtype == r.dtype and y.shape == r.shape, (y.dtype, r.dtype, y.shape, r.shape)
    if torch.equal(y, r):
        return 0.0
    diff = (y.double() - r.double()).abs().max().item()
    return diff / (r.double().abs().max().item() * torch.finfo(r.dtype).eps)


def assert_spec_reproduces(module: torch.nn.Module, spec: NormSpec, dtype: torch.dtype,
                           x_dtype: torch.dtype | None = None, seed: int = 0) -> None:
    """module(x) == reference(x, module's params, spec): bit for bit, except fp32 LayerNorm, whose
    statistics torch accumulates in another order than the reference (a couple of ulps)."""
    m = randomised_copy(module, dtype, seed)
    x = random_input(spec.shape or (16,), x_dtype or dtype, seed + 1)
    with torch.no_grad():
        y = m(x)
        r = reference_output(x, m, spec)
    ulps = max_ulps(y, r)
    if spec.kind == "layer" and y.dtype == torch.float32:
        assert ulps <= 4, f"{type(module).__name__} {dtype}: {ulps} ulps from the reference"
    else:
        assert ulps == 0, f"{type(module).__name__} {dtype}/{x_dtype}: not bit-exact ({ulps} ulps)"
