"""Helpers shared by the kernel tests: random inputs, float64 references, per-dtype tolerances.

Tolerances are relative to the largest reference magnitude (norm outputs are O(1) and grads are
compared as a whole): they cover the roundings each dtype forces (Llama's normalized value rounded
to x.dtype, then the product rounded again) and nothing more.
"""

from __future__ import annotations

import pytest
import torch

from normswap.kernels import _common
from normswap.kernels.rms_norm import _rms_fwd_kernel

# Where the kernel tests put their tensors: the CPU under the interpreter, else the GPU. Triton
# decides interpretation once per process (TRITON_INTERPRET when the decorators run), so one
# kernel answers for all of them.
DEV = "cpu" if _common.interpreting(_rms_fwd_kernel) else "cuda"

# (forward, backward) tolerance on max|got - ref| / max|ref|, per dtype.
TOL = {
    torch.float32: (2e-6, 2e-5),
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (1.6e-2, 6e-2),
}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    # The floor keeps mathematically-zero results (dx of a 1-wide row) from dividing by ~0.
    scale = ref.abs().max().clamp_min(1e-2)
    return ((got - ref).abs().max() / scale).item()


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values (unwritten or poisoned output?)"
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def rand_weight(n: int, dtype: torch.dtype, offset: float, gen: torch.Generator) -> torch.Tensor:
    """Around 1 - offset, so that offset + weight is O(1) but never all-ones (nor all-zeros)."""
    w = (1.0 - offset) + 0.3 * torch.randn(n, generator=gen)
    return w.to(dtype)


def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    """A grad-requiring copy with t's exact strides (clone() would make a strided view contiguous,
    and the op would never see the layout the test means to give it)."""
    if t is None:
        return None
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    out.copy_(t.detach())
    return out.requires_grad_(True)


def leaf64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().double().requires_grad_(True)


def grads(outputs, upstream, inputs):
    """Grads of sum(out * g) w.r.t. the non-None inputs (None kept in place)."""
    live = [t for t in inputs if t is not None]
    loss = sum((o.double() * g.double()).sum() for o, g in zip(outputs, upstream, strict=True))
    got = iter(torch.autograd.grad(loss, live))
    return [None if t is None else next(got) for t in inputs]


def needs_triton(kernel):
    """The skip mark of a kernel test file, saying why Triton kernels cannot run here (no CUDA and
    no TRITON_INTERPRET, or an interpreter that cannot run them), never skipping where they can."""
    why = _common.triton_unavailable_reason(kernel)
    return pytest.mark.skipif(why is not None, reason=f"triton kernels cannot run here: {why}")
