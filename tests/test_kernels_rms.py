"""Triton RMSNorm through the CPU interpreter: forward and backward against float64 references,
every casting mode and offset, with/without weight and fused residual, poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from normswap.errors import NormswapError
from normswap.kernels import _common
from normswap.kernels.reference import rms_norm_ref
from normswap.kernels.rms_norm import _norm_code, _rms_fwd_kernel, rms_norm
from tests.kernel_checks import DEV, TOL, assert_close, grads, leaf, leaf64, needs_triton, rand_weight

pytestmark = needs_triton(_rms_fwd_kernel)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MODES = ("llama", "gemma", "t5", "none")
SMALL = ((1, 1), (3, 17), (5, 123))


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every buffer the ops allocate starts as NaN: an element a kernel never writes shows up."""
    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)


def check_rms(shape, dtype, casting="llama", offset=0.0, with_weight=True, residual=None,
              residual_in_fp32=False, out_dtype=None, eps=1e-6, weight_dtype=None, seed=0, x=None):
    """Run forward + backward of the triton op and of the float64 reference; compare both."""
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    if x is None:
        x = (torch.randn(*shape, generator=gen) * 2 + 0.5).to(dtype)
    w = rand_weight(n, weight_dtype or dtype, offset, gen) if with_weight else None
    r = None if residual is None else torch.randn(*shape, generator=gen).to(residual)
    x, w, r = (None if t is None else t.to(DEV) for t in (x, w, r))
    kw = dict(offset=offset, casting=casting, out_dtype=out_dtype, residual_in_fp32=residual_in_fp32)

    xs, ws, rs = leaf(x), leaf(w), leaf(r)
    out = rms_norm(xs, ws, eps, residual=rs, **kw)
    outs = out if r is not None else (out,)
    # Same-dtype reference: the casting contract (output dtypes, stored h) must match exactly.
    same = rms_norm_ref(x, w, eps, residual=r, **kw)
    same = same if r is not None else (same,)
    for o, s in zip(outs, same, strict=True):
        assert o.dtype == s.dtype and o.shape == s.shape

    x64, w64, r64 = leaf64(x), leaf64(w), leaf64(r)
    ref = rms_norm_ref(x64, w64, eps, residual=r64, offset=offset, casting=casting)
    refs = ref if r is not None else (ref,)
    fwd_tol, bwd_tol = TOL[dtype]
    fwd_tol = max(fwd_tol, TOL[outs[0].dtype][0])  # llama/t5 may return the weight's dtype
    assert_close(outs[0], refs[0], fwd_tol, "y")
    if r is not None:
        h_tol = 0 if (residual_in_fp32 or r.dtype == torch.float32) and dtype == torch.float32 else TOL[r.dtype][0]
        assert_close(outs[1], refs[1], max(h_tol, 2e-7), "h")

    upstream = [torch.randn(o.shape, generator=gen).to(o.dtype).to(DEV) for o in outs]
    kept = [u.clone() for u in upstream]
    got = grads(outs, upstream, (xs, ws, rs))
    want = grads(refs, upstream, (x64, w64, r64))
    for u, k in zip(upstream, kept, strict=True):
        assert torch.equal(u, k), "backward wrote into an upstream gradient it does not own"
    for name, g, e, t in zip(("dx", "dw", "dr"), got, want, (x, w, r), strict=True):
        if t is None:
            assert g is None
            continue
        assert g.dtype == t.dtype, f"{name} dtype {g.dtype} != {t.dtype}"
        assert_close(g, e, max(bwd_tol, TOL[t.dtype][1]), name)


@pytest.mark.parametrize("offset", (0.0, 1.0))
@pytest.mark.parametrize("casting", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SMALL)
def test_grid(shape, dtype, casting, offset):
    check_rms(shape, dtype, casting, offset)
    check_rms(shape, dtype, casting, offset, residual=dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SMALL)
def test_without_weight(shape, dtype):
    check_rms(shape, dtype, with_weight=False)
    check_rms(shape, dtype, with_weight=False, residual=dtype, seed=1)


@pytest.mark.parametrize("casting", MODES)
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16)])
def test_mixed_weight_dtype(x_dtype, w_dtype, casting):
    """Weight and input dtypes differ: llama and t5 round to different dtypes and return different
    dtypes (promote(w, x) vs the half weight's dtype)."""
    check_rms((5, 123), x_dtype, casting, weight_dtype=w_dtype)


def _bit_exact_case(dtype, casting, seed=3):
    """(x, [(offset, weight)]) of the same-dtype comparisons below."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 257, generator=gen).to(dtype).to(DEV)
    return x, [(offset, rand_weight(257, torch.bfloat16 if casting == "t5" else dtype, offset, gen).to(DEV))
               for offset in (0.0, 1.0)]


def _ulps(x, w, casting) -> int:
    """How many ulps apart the kernel and the same-dtype reference may be: one where the output is
    rounded once, two where the family rounds the normalized value before the weight (llama; t5
    with half weights: _norm_code), since one ulp there can become two in the output."""
    return 2 if _norm_code(casting, x.dtype, w.dtype) else 1


def _assert_nearly_same(y, same, ulps):
    """Equal on nearly every element, and never more than `ulps` apart. rstd is computed in fp32
    in another order (and on a GPU with approximate rsqrt and division), so a rare element sits on
    the other side of a rounding boundary."""
    assert (y != same).float().mean().item() <= 0.01
    ulp = torch.finfo(y.dtype).eps
    assert ((y.double() - same.double()).abs() <= ulps * ulp * same.double().abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("casting", MODES)
def test_bit_exact_against_same_dtype_reference(dtype, casting):
    """The rounding steps of each family are reproduced, not approximated: the kernel's output
    equals the same-dtype reference on nearly every element, while a wrong casting mode differs on
    ~25% of them."""
    x, cases = _bit_exact_case(dtype, casting)
    for offset, w in cases:
        _assert_nearly_same(rms_norm(x, w, 1e-6, offset, casting), rms_norm_ref(x, w, 1e-6, offset, casting),
                            _ulps(x, w, casting))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("casting", MODES)
def test_same_dtype_bound_holds_for_an_rstd_a_few_fp32_ulps_off(dtype, casting, monkeypatch):
    """The bounds above are what an rstd a few fp32 ulps off (another summation order, a GPU's
    approximate rsqrt and division) can move the output by: the reference itself, with its rsqrt
    nudged, stays within them. Rounded once, the output moves by one ulp at most; rounded twice, a
    one-ulp bound does not hold (llama fp16 on an H100: elements two ulps apart), nor here."""
    x, cases = _bit_exact_case(dtype, casting)
    rsqrt, ulp = torch.rsqrt, torch.finfo(dtype).eps
    beyond_one_ulp = 0
    for offset, w in cases:
        same = rms_norm_ref(x, w, 1e-6, offset, casting)
        for nudge in (-8, -4, -2, -1, 1, 2, 4, 8):  # fp32 ulps (2**-24 relative: the lower bound)
            with monkeypatch.context() as m:
                m.setattr(torch, "rsqrt", lambda t, k=nudge: rsqrt(t) * (1 + k * 2.0**-24))
                nudged = rms_norm_ref(x, w, 1e-6, offset, casting)
            _assert_nearly_same(nudged, same, _ulps(x, w, casting))
            beyond_one_ulp += int(((nudged.double() - same.double()).abs() > ulp * same.double().abs() + 1e-6).sum())
    if casting == "llama" and dtype == torch.float16:
        assert beyond_one_ulp > 0
    if _ulps(x, w, casting) == 1:
        assert beyond_one_ulp == 0


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_residual_variants(dtype):
    # fp32 stream kept for a low-precision model; a mixed-dtype residual; an fp32 output.
    check_rms((5, 123), dtype, "llama", residual=dtype, residual_in_fp32=True)
    check_rms((5, 123), dtype, "gemma", 1.0, residual=torch.float32, seed=2)
    check_rms((5, 123), dtype, "llama", out_dtype=torch.float32, residual=dtype, seed=3)


def test_looped_columns_on_small_rows(monkeypatch):
    """Rows wider than the widest tile loop over column blocks; shrink the tile to test it cheaply."""
    monkeypatch.setattr(_common, "MAX_BLOCK_N", 32)
    for dtype in DTYPES:
        for casting in ("llama", "gemma"):
            check_rms((5, 123), dtype, casting, 1.0 if casting == "gemma" else 0.0, residual=dtype)
        check_rms((3, 70), dtype, "t5", with_weight=False, residual=torch.float32, residual_in_fp32=True)


def test_medium_and_wide_shapes():
    check_rms((64, 4096), torch.bfloat16, "llama", residual=torch.bfloat16)
    check_rms((64, 4096), torch.float32, "gemma", 1.0)
    # 70,000 > the widest tile: the looped path at its real size.
    check_rms((3, 70000), torch.bfloat16, "gemma", 1.0, residual=torch.bfloat16)
    check_rms((2, 70000), torch.float32, "llama")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_eps_zero_is_honoured():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 33, generator=gen).to(DEV)
    w = rand_weight(33, torch.float32, 0.0, gen).to(DEV)
    y = rms_norm(x, w, 0.0)
    assert_close(y, rms_norm_ref(x.double(), w.double(), 0.0), 2e-6, "eps=0")
    # A zero row has no scale: eps=0 must give NaN/inf there, as the reference does, not a default eps.
    y0 = rms_norm(torch.zeros(1, 8, device=DEV), None, 0.0)
    assert not torch.isfinite(y0).any()
    # Large eps visibly changes the result, so eps really reaches the kernel.
    big = rms_norm(x, w, 10.0)
    assert_close(big, rms_norm_ref(x.double(), w.double(), 10.0), 2e-6, "eps=10")


def test_non_contiguous_and_3d_inputs():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6, 40, 2, generator=gen).to(DEV)
    x = base[..., 0]  # last-dim stride 2: must be copied, never read with the wrong stride
    check_rms(x.shape, torch.float32, "llama", x=x)
    sliced = torch.randn(7, 64, generator=gen).to(DEV)[::2, 5:45]  # row stride 128, unit column stride
    check_rms(sliced.shape, torch.float32, "gemma", 1.0, x=sliced)
    transposed = torch.randn(40, 6, generator=gen).to(DEV).T  # strides (1, 6)
    check_rms(transposed.shape, torch.bfloat16, "llama", x=transposed.to(torch.bfloat16), residual=torch.bfloat16)
    check_rms((2, 3, 50), torch.bfloat16, "llama", residual=torch.bfloat16)


def test_empty_batch():
    x = torch.randn(0, 16, device=DEV, requires_grad=True)
    w = torch.randn(16, device=DEV, requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_bad_inputs_are_clear_errors():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(NormswapError, match="casting"):
        rms_norm(x, None, 1e-6, casting="mistral")
    with pytest.raises(NormswapError, match="weight must have shape"):
        rms_norm(x, torch.ones(7, device=DEV), 1e-6)
    with pytest.raises(NormswapError, match="fp32/fp16/bf16"):
        rms_norm(x.double(), None, 1e-6)
    with pytest.raises(NormswapError, match="residual shape"):
        rms_norm(x, None, 1e-6, residual=torch.randn(2, 9, device=DEV))


def test_compile_fullgraph_no_graph_breaks():
    """fullgraph=True fails on any graph break. aot_eager traces the op through its fake impl and
    its registered autograd (forward + backward graphs) without needing a C++ toolchain; inductor
    compiles the same graph on GPU (tests/test_kernels_gpu.py). Dynamic shapes: one graph serves
    every row count."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def block(x, w, r):
        y, h = rms_norm(x * 2.0, w, 1e-6, 1.0, "gemma", residual=r)
        return (y.float() * h.float()).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=True)
    gen = torch.Generator().manual_seed(6)
    for rows in (3, 5, 9):
        x = torch.randn(rows, 48, generator=gen).to(DEV).requires_grad_()
        w = rand_weight(48, torch.float32, 1.0, gen).to(DEV).requires_grad_()
        r = torch.randn(rows, 48, generator=gen).to(DEV).requires_grad_()
        loss = compiled(x, w, r)
        gx, gw, gr = torch.autograd.grad(loss, (x, w, r))
        x64, w64, r64 = leaf64(x), leaf64(w), leaf64(r)
        y64, h64 = rms_norm_ref(x64 * 2.0, w64, 1e-6, 1.0, "gemma", residual=r64)
        loss64 = (y64 * h64).sum()
        ex, ew, er = torch.autograd.grad(loss64, (x64, w64, r64))
        assert abs(loss.item() - loss64.item()) <= 1e-4 * abs(loss64.item()) + 1e-4
        for g, e, name in ((gx, ex, "dx"), (gw, ew, "dw"), (gr, er, "dr")):
            assert_close(g, e, 2e-5, name)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1, f"expected one graph for all row counts, got {frames}"


def test_frozen_weight_skips_dw_and_keeps_dx():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6, 77, generator=gen).to(torch.bfloat16).to(DEV).requires_grad_()
    w = rand_weight(77, torch.bfloat16, 0.0, gen).to(DEV)  # no grad wanted
    dy = torch.randn(6, 77, generator=gen).to(torch.bfloat16).to(DEV)
    (dx,) = torch.autograd.grad(rms_norm(x, w, 1e-6), (x,), dy)
    x64 = leaf64(x)
    (want,) = torch.autograd.grad(rms_norm_ref(x64, w.double(), 1e-6), (x64,), dy.double())
    assert_close(dx, want, TOL[torch.bfloat16][1], "dx")
    assert w.grad is None
