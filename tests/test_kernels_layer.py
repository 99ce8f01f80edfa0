"""Triton LayerNorm through the CPU interpreter: forward and backward against float64 references,
with/without weight, bias, offset and fused residual, poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from normswap.errors import NormswapError
from normswap.kernels import _common
from normswap.kernels.layer_norm import _ln_fwd_kernel, layer_norm
from normswap.kernels.reference import layer_norm_ref
from tests.kernel_checks import DEV, TOL, assert_close, grads, leaf, leaf64, needs_triton, rand_weight

pytestmark = needs_triton(_ln_fwd_kernel)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SMALL = ((1, 1), (3, 17), (5, 123))


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)


def check_ln(shape, dtype, with_weight=True, with_bias=True, offset=0.0, residual=None,
             residual_in_fp32=False, out_dtype=None, eps=1e-5, weight_dtype=None, shift=0.5, seed=0, x=None):
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    if x is None:
        # `shift` moves the row means away from 0: the variance must not come from E[x^2] - E[x]^2.
        x = (torch.randn(*shape, generator=gen) * 2 + shift).to(dtype)
    wdt = weight_dtype or dtype
    w = rand_weight(n, wdt, offset, gen) if with_weight else None
    b = (0.5 * torch.randn(n, generator=gen)).to(wdt) if with_bias else None
    r = None if residual is None else torch.randn(*shape, generator=gen).to(residual)
    x, w, b, r = (None if t is None else t.to(DEV) for t in (x, w, b, r))
    kw = dict(offset=offset, out_dtype=out_dtype, residual_in_fp32=residual_in_fp32)

    xs, ws, bs, rs = leaf(x), leaf(w), leaf(b), leaf(r)
    out = layer_norm(xs, ws, bs, eps, residual=rs, **kw)
    outs = out if r is not None else (out,)
    same = layer_norm_ref(x, w, b, eps, residual=r, **kw)
    same = same if r is not None else (same,)
    for o, s in zip(outs, same, strict=True):
        assert o.dtype == s.dtype and o.shape == s.shape

    x64, w64, b64, r64 = leaf64(x), leaf64(w), leaf64(b), leaf64(r)
    ref = layer_norm_ref(x64, w64, b64, eps, offset=offset, residual=r64)
    refs = ref if r is not None else (ref,)
    fwd_tol = max(TOL[dtype][0], TOL[outs[0].dtype][0])
    assert_close(outs[0], refs[0], fwd_tol, "y")
    if r is not None:
        assert_close(outs[1], refs[1], max(TOL[outs[1].dtype][0], 2e-7), "h")

    upstream = [torch.randn(o.shape, generator=gen).to(o.dtype).to(DEV) for o in outs]
    kept = [u.clone() for u in upstream]
    got = grads(outs, upstream, (xs, ws, bs, rs))
    want = grads(refs, upstream, (x64, w64, b64, r64))
    for u, k in zip(upstream, kept, strict=True):
        assert torch.equal(u, k), "backward wrote into an upstream gradient it does not own"
    for name, g, e, t in zip(("dx", "dw", "db", "dr"), got, want, (x, w, b, r), strict=True):
        if t is None:
            assert g is None
            continue
        assert g.dtype == t.dtype, f"{name} dtype {g.dtype} != {t.dtype}"
        assert_close(g, e, max(TOL[dtype][1], TOL[t.dtype][1]), name)


@pytest.mark.parametrize("offset", (0.0, 1.0))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SMALL)
def test_grid(shape, dtype, offset):
    check_ln(shape, dtype, offset=offset)
    check_ln(shape, dtype, offset=offset, residual=dtype, seed=1)


@pytest.mark.parametrize("with_weight,with_bias", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_optional_affine(dtype, with_weight, with_bias):
    check_ln((5, 123), dtype, with_weight, with_bias)
    check_ln((3, 17), dtype, with_weight, with_bias, residual=dtype, seed=1)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_residual_variants_and_mixed_dtypes(dtype):
    check_ln((5, 123), dtype, residual=dtype, residual_in_fp32=True)
    check_ln((5, 123), dtype, residual=torch.float32, seed=2)
    check_ln((5, 123), dtype, out_dtype=torch.float32, seed=3)
    check_ln((5, 123), dtype, weight_dtype=torch.float32, seed=4)  # fp32 LayerNorm params on bf16 activations


def test_same_dtype_reference_nearly_bit_exact():
    """Statistics and affine in fp32 with one cast: equal to the same-dtype reference except for
    rare one-ulp moves from summation order."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float16, torch.bfloat16):
        x = (torch.randn(64, 257, generator=gen) + 1).to(dtype).to(DEV)
        w = rand_weight(257, dtype, 0.0, gen).to(DEV)
        b = torch.randn(257, generator=gen).to(dtype).to(DEV)
        y = layer_norm(x, w, b, 1e-5)
        same = layer_norm_ref(x, w, b, 1e-5)
        assert (y != same).float().mean().item() <= 0.01


def test_looped_columns_on_small_rows(monkeypatch):
    """Chan-merged statistics over column blocks, tested cheaply by shrinking the widest tile."""
    monkeypatch.setattr(_common, "MAX_BLOCK_N", 32)
    for dtype in DTYPES:
        check_ln((5, 123), dtype, offset=1.0, residual=dtype)
        check_ln((3, 70), dtype, with_weight=False, residual=torch.float32, residual_in_fp32=True, shift=100.0)


@pytest.mark.parametrize("max_block_n", (16384, 64))
def test_large_mean_is_stable(monkeypatch, max_block_n):
    """Rows with mean 1000 and spread 2. fp32 arithmetic bounds the error near |mean|/std * 2^-24
    (3e-5); a sum/sum-of-squares variance would be off by ~(mean/std)^2 * 2^-24 (1.5e-2). Checked
    for the in-register two-pass and the looped Chan merge."""
    monkeypatch.setattr(_common, "MAX_BLOCK_N", max_block_n)
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(4, 300, generator=gen) * 2 + 1000.0).to(DEV)
    y = layer_norm(x, None, None, 1e-5)
    assert_close(y, layer_norm_ref(x.double(), None, None, 1e-5), 1e-4, "y")


def test_medium_and_wide_shapes():
    check_ln((64, 4096), torch.bfloat16, residual=torch.bfloat16)
    check_ln((3, 70000), torch.bfloat16, offset=1.0, residual=torch.bfloat16, shift=3.0)
    check_ln((2, 70000), torch.float32)


def test_eps_zero_and_large_eps():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 33, generator=gen).to(DEV)
    for eps in (0.0, 10.0):
        assert_close(layer_norm(x, None, None, eps), layer_norm_ref(x.double(), None, None, eps), 2e-6, f"eps={eps}")


def test_non_contiguous_and_3d_inputs():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 40, 2, generator=gen).to(DEV)[..., 1]
    check_ln(x.shape, torch.float32, x=x)
    sliced = torch.randn(7, 64, generator=gen).to(DEV)[1::2, 3:50]
    check_ln(sliced.shape, torch.float32, x=sliced)
    transposed = torch.randn(40, 6, generator=gen).to(DEV).T
    check_ln(transposed.shape, torch.float32, x=transposed, residual=torch.float32)
    check_ln((2, 3, 50), torch.float16, residual=torch.float16)


def test_bad_inputs_are_clear_errors():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(NormswapError, match="bias must have shape"):
        layer_norm(x, None, torch.ones(3, device=DEV), 1e-5)
    with pytest.raises(NormswapError, match="fp32/fp16/bf16"):
        layer_norm(x, torch.ones(8, device=DEV, dtype=torch.float64), None, 1e-5)


def test_compile_fullgraph_no_graph_breaks():
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def block(x, w, b, r):
        y, h = layer_norm(x + 1.0, w, b, 1e-5, residual=r)
        return (y * h).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=True)
    gen = torch.Generator().manual_seed(6)
    for rows in (2, 7):
        args = [torch.randn(rows, 40, generator=gen), rand_weight(40, torch.float32, 0.0, gen),
                torch.randn(40, generator=gen), torch.randn(rows, 40, generator=gen)]
        args = [a.to(DEV).requires_grad_() for a in args]
        got = torch.autograd.grad(compiled(*args), args)
        a64 = [leaf64(a) for a in args]
        y64, h64 = layer_norm_ref(a64[0] + 1.0, a64[1], a64[2], 1e-5, residual=a64[3])
        want = torch.autograd.grad((y64 * h64).sum(), a64)
        for g, e, name in zip(got, want, ("dx", "dw", "db", "dr"), strict=True):
            assert_close(g, e, 2e-5, name)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_frozen_affine_skips_their_grads():
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(6, 77, generator=gen) + 2).to(DEV).requires_grad_()
    w = rand_weight(77, torch.float32, 0.0, gen).to(DEV).requires_grad_()
    b = torch.randn(77, generator=gen).to(DEV)  # frozen bias
    dy = torch.randn(6, 77, generator=gen).to(DEV)
    dx, dw = torch.autograd.grad(layer_norm(x, w, b, 1e-5), (x, w), dy)
    x64, w64 = leaf64(x), leaf64(w)
    ex, ew = torch.autograd.grad(layer_norm_ref(x64, w64, b.double(), 1e-5), (x64, w64), dy.double())
    assert_close(dx, ex, 2e-5, "dx")
    assert_close(dw, ew, 2e-5, "dw")
