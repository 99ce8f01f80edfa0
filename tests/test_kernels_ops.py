"""The torch.library ops themselves: fake impls agree with the real outputs (shape, dtype, stride)
in every casting mode and dtype mix, torch.library.opcheck passes, dW keeps fp32 accumulation,
and the widest hidden size the issue names (262,144) runs through the kernels."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from normswap.kernels import _common
from normswap.kernels.layer_norm import layer_norm_bwd, layer_norm_fwd
from normswap.kernels.reference import rms_norm_ref
from normswap.kernels.rms_norm import _rms_fwd_kernel, rms_norm, rms_norm_bwd, rms_norm_fwd
from tests.kernel_checks import DEV, needs_triton, rand_weight
from tests.test_kernels_layer import check_ln
from tests.test_kernels_rms import check_rms

pytestmark = needs_triton(_rms_fwd_kernel)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)


def _rand(shape, dtype, gen, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=gen) * scale + shift).to(dtype).to(DEV)


def _meta(outs):
    return [(tuple(t.shape), t.dtype, t.stride()) for t in outs]


def _fake_agrees(op, *args):
    """The op's outputs and its fake impl's outputs: same shapes, dtypes and strides."""
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args)
    assert _meta(fake) == _meta(real), f"{op}: fake {_meta(fake)} != real {_meta(real)}"
    return real


@pytest.mark.parametrize("casting", ("llama", "gemma", "t5", "none"))
def test_rms_fake_impls_match_real_outputs(casting):
    gen = torch.Generator().manual_seed(0)
    for x_dtype, w_dtype in ((BF16, BF16), (BF16, FP32), (FP16, BF16), (FP32, FP16), (FP32, None)):
        for res_dtype, in_fp32, out_dtype in ((None, False, None), (FP32, False, None), (x_dtype, True, FP32)):
            x = _rand((2, 3, 17), x_dtype, gen)
            w = None if w_dtype is None else rand_weight(17, w_dtype, 1.0, gen).to(DEV)
            r = None if res_dtype is None else _rand((2, 3, 17), res_dtype, gen)
            y, h, rstd = _fake_agrees(rms_norm_fwd, x, w, r, 1e-6, 1.0, casting, out_dtype, in_fp32)
            z = x if r is None else h
            dy = _rand(y.shape, y.dtype, gen)
            dh = None if r is None else _rand(h.shape, h.dtype, gen)
            for need_dw in (True, False):
                dx, dw, dr = _fake_agrees(rms_norm_bwd, dy, dh, z, w, rstd, 1.0, casting, x_dtype,
                                          None if r is None else r.dtype, need_dw)
                assert dx.dtype == x_dtype and (dr.numel() == 0) == (r is None)
                assert dw.numel() == (17 if need_dw and w is not None else 0)


def test_layer_norm_fake_impls_match_real_outputs():
    gen = torch.Generator().manual_seed(1)
    for x_dtype, p_dtype in ((BF16, BF16), (BF16, FP32), (FP16, FP16), (FP32, None)):
        for res_dtype, in_fp32, out_dtype in ((None, False, None), (FP32, False, None), (x_dtype, True, FP32)):
            x = _rand((2, 3, 19), x_dtype, gen, shift=2.0)
            w = None if p_dtype is None else rand_weight(19, p_dtype, 0.0, gen).to(DEV)
            b = None if p_dtype is None else _rand((19,), p_dtype, gen)
            r = None if res_dtype is None else _rand((2, 3, 19), res_dtype, gen)
            y, h, mean, rstd = _fake_agrees(layer_norm_fwd, x, w, b, r, 1e-5, 0.0, out_dtype, in_fp32)
            z = x if r is None else h
            dy = _rand(y.shape, y.dtype, gen)
            dh = None if r is None else _rand(h.shape, h.dtype, gen)
            _fake_agrees(layer_norm_bwd, dy, dh, z, w, b, mean, rstd, 0.0, x_dtype, None if r is None else r.dtype,
                         w is not None)


def test_opcheck():
    """torch.library's own checks: schema, fake tensors, autograd registration, AOT dispatch."""
    gen = torch.Generator().manual_seed(2)
    x = _rand((3, 5, 17), BF16, gen).requires_grad_()
    w = rand_weight(17, FP32, 1.0, gen).to(DEV).requires_grad_()
    b = _rand((17,), FP32, gen).requires_grad_()
    r = _rand((3, 5, 17), BF16, gen).requires_grad_()
    torch.library.opcheck(rms_norm_fwd, (x, w, r, 1e-6, 1.0, "llama", None, True))
    torch.library.opcheck(layer_norm_fwd, (x, w, b, r, 1e-5, 1.0, None, False))
    y, h, rstd = rms_norm_fwd(x, w, r, 1e-6, 1.0, "llama", None, True)
    dy, dh = _rand(y.shape, y.dtype, gen), _rand(h.shape, h.dtype, gen)
    torch.library.opcheck(rms_norm_bwd, (dy, dh, h.detach(), w.detach(), rstd.detach(), 1.0, "llama", BF16, BF16, True))
    y, h, mean, rstd = layer_norm_fwd(x, w, b, r, 1e-5, 1.0, None, False)
    torch.library.opcheck(layer_norm_bwd, (_rand(y.shape, y.dtype, gen), _rand(h.shape, h.dtype, gen), h.detach(),
                                           w.detach(), b.detach(), mean.detach(), rstd.detach(), 1.0, BF16, BF16, True))


def test_dweight_is_accumulated_in_fp32():
    """dW of a bf16 weight over 2,048 rows: a sum kept in fp32 and rounded once lands within one
    bf16 ulp of the float64 value on every column; summing in bf16 would drift far past that.
    Gemma casting: the forward multiplies the weight by the unrounded fp32 normalized value, so the
    float64 reference sees the same products."""
    gen = torch.Generator().manual_seed(3)
    m, n = 2048, 16
    x = _rand((m, n), BF16, gen).requires_grad_()
    w = rand_weight(n, BF16, 1.0, gen).to(DEV).requires_grad_()
    dy = _rand((m, n), BF16, gen)
    (dw,) = torch.autograd.grad(rms_norm(x, w, 1e-6, 1.0, "gemma"), (w,), dy)
    w64 = w.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(rms_norm_ref(x.detach().double(), w64, 1e-6, 1.0, "gemma"), (w64,), dy.double())
    ulp = 2.0 ** -7
    assert dw.dtype == BF16
    assert ((dw.double() - want).abs() <= ulp * want.abs()).all(), (dw.double() - want).abs().max()


@pytest.mark.slow
def test_widest_hidden_size_one_row():
    """Hidden 262,144 (the issue's upper bound): rows loop over 16 column blocks; fwd + bwd."""
    check_rms((1, 262144), BF16, "llama", residual=BF16)
    check_ln((1, 262144), BF16, residual=BF16, shift=3.0)


def _unspecialised(kernel) -> set[str]:
    """The arguments a @triton.jit kernel was told never to specialise on (interpreted or not)."""
    if _common.interpreting(kernel):
        return set(kernel.kwargs.get("do_not_specialize") or ())
    return {p.name for p in kernel.params if p.do_not_specialize}


def test_row_count_never_selects_a_new_gpu_kernel():
    """No recompilation per batch size, checked without a GPU: the kernels never specialise on M
    (Triton would otherwise compile anew for M == 1 or M % 16 == 0), and the GPU launch table picks
    one tile per coarse row-count bucket: a few variants per hidden size, never one per batch size.
    (tests/test_kernels_gpu.py counts the compiled variants on a real device.)"""
    from normswap.kernels.layer_norm import _ln_bwd_kernel, _ln_fwd_kernel
    from normswap.kernels.rms_norm import _rms_bwd_kernel

    for kernel in (_rms_fwd_kernel, _rms_bwd_kernel, _ln_fwd_kernel, _ln_bwd_kernel):
        assert "M" in _unspecialised(kernel), kernel
    gpu_kernel = object()  # anything but an interpreted kernel: the GPU launch table answers
    for n in (1, 17, 1024, 4096, 70000, 262144):
        for pass_ in ("fwd", "bwd"):
            tiles = {_common.launch_config(m, n, torch.bfloat16, pass_, gpu_kernel)
                     for m in (1, 3, 16, 1000, 2048, 2049, 4099, 32768, 1 << 20)}
            # At most one tile per coarse row bucket, never one per row count.
            assert len(tiles) <= len(_common.ROW_BUCKETS) + 1, (n, pass_, tiles)


@pytest.mark.parametrize("split", (False, True))
def test_per_head_weights(monkeypatch, split):
    """Cohere-style q/k norms: x (batch, seq, heads, head_dim), weight and bias (heads, head_dim),
    each head normalised over head_dim with its own parameter row. Forward, dx, dW and dB against
    the float64 reference (which broadcasts the (heads, N) parameters the same way); `split` runs
    the split-row path by shrinking the widest tile."""
    from normswap.kernels.layer_norm import layer_norm
    from normswap.kernels.reference import layer_norm_ref
    from tests.kernel_checks import TOL, assert_close, leaf64

    if split:
        monkeypatch.setattr(_common, "MAX_BLOCK_N", 32)  # 40 columns: 5 chunks of 8
    gen = torch.Generator().manual_seed(11)
    heads, d = 3, 40
    cases = ((BF16, "llama", 0.0), (FP32, "gemma", 1.0), (FP16, "t5", 0.0))
    for dtype, casting, offset in cases[:1] if split else cases:
        x = _rand((1, 4, heads, d), dtype, gen, 2.0, 0.5).requires_grad_()
        w = torch.stack([rand_weight(d, dtype, offset, gen) for _ in range(heads)]).to(DEV).requires_grad_()
        b = _rand((heads, d), dtype, gen, 0.3).requires_grad_()
        dy = _rand(x.shape, dtype, gen)
        fwd_tol, bwd_tol = TOL[dtype]
        for name, ours, ref, params in (
            ("rms", lambda x, w, b, o=offset, c=casting: rms_norm(x, w, 1e-6, o, c),
             lambda x, w, b, o=offset, c=casting: rms_norm_ref(x, w, 1e-6, o, c), (w,)),
            ("ln", lambda x, w, b, o=offset: layer_norm(x, w, b, 1e-5, o),
             lambda x, w, b, o=offset: layer_norm_ref(x, w, b, 1e-5, o), (w, b)),
        ):
            y = ours(x, w, b)
            x64, w64, b64 = leaf64(x), leaf64(w), leaf64(b)
            y64 = ref(x64, w64, b64)
            assert_close(y, y64, max(fwd_tol, TOL[y.dtype][0]), f"{name} y")
            # A flattened (heads * d,) weight would be a different norm: the rows really use their head.
            assert (y.float() - ours(x, w[:1].expand_as(w).contiguous(), b).float()).abs().max() > 0.05
            got = torch.autograd.grad(y, (x, *params), dy.to(y.dtype))
            want = torch.autograd.grad(y64, (x64, *(w64, b64)[:len(params)]), dy.double())
            for what, g, e in zip(("dx", "dw", "db"), got, want, strict=False):
                assert g.shape == e.shape
                assert_close(g, e, bwd_tol, f"{name} {what}")


def test_per_head_weight_shape_errors():
    from normswap.errors import NormswapError

    x = torch.randn(2, 3, 8, device=DEV)
    with pytest.raises(NormswapError, match="heads"):
        rms_norm(x, torch.ones(4, 8, device=DEV), 1e-6)  # 4 rows for 3 heads
    from normswap.kernels.layer_norm import layer_norm

    with pytest.raises(NormswapError, match="shapes differ"):
        layer_norm(x, torch.ones(3, 8, device=DEV), torch.zeros(8, device=DEV), 1e-5)


def _fused_grads(op, x, r, residual_in_fp32):
    """Gradients of the fused add + norm with respect to x and the residual, through both outputs."""
    gen = torch.Generator().manual_seed(7)
    w = rand_weight(x.shape[-1], FP32, 0.0, gen).to(DEV).requires_grad_()
    if op == "rms":
        y, h = rms_norm(x, w, 1e-5, residual=r, residual_in_fp32=residual_in_fp32)
    else:
        b = (0.3 * torch.randn(x.shape[-1], generator=gen)).to(DEV).requires_grad_()
        y, h = _ln(x, w, b, 1e-5, residual=r, residual_in_fp32=residual_in_fp32)
    dy, dh = _rand(y.shape, y.dtype, gen), _rand(h.shape, h.dtype, gen)
    return y, h, torch.autograd.grad((y, h), (x, r), (dy, dh)), (dy, dh), w


def _ln(*args, **kwargs):
    from normswap.kernels.layer_norm import layer_norm

    return layer_norm(*args, **kwargs)


@pytest.mark.parametrize("op", ["rms", "ln"])
def test_residual_gradient_is_written_once(op):
    """h = x + r hands its gradient unchanged to x and r: with one dtype the backward writes it once
    and returns that tensor for both (issue 13: a second copy was a full extra write); a residual
    of another dtype gets its own rounding. Values are checked against float64 autograd."""
    gen = torch.Generator().manual_seed(3)
    for dtype, r_dtype, in_fp32 in ((BF16, BF16, False), (FP32, FP32, False), (BF16, BF16, True),
                                    (BF16, FP32, True)):
        x = _rand((6, 48), dtype, gen).requires_grad_()
        r = _rand((6, 48), r_dtype, gen, shift=0.5).requires_grad_()
        y, h, (gx, gr), (dy, dh), w = _fused_grads(op, x, r, in_fp32)
        shared = gx.data_ptr() == gr.data_ptr()
        assert shared == (r_dtype == dtype), (dtype, r_dtype, in_fp32)
        assert gr.dtype == r.dtype and gx.dtype == x.dtype
        # float64 reference of the same graph (h as the kernel stores it)
        x64, r64 = x.detach().double().requires_grad_(), r.detach().double().requires_grad_()
        h64 = x64 + r64
        if op == "rms":
            y64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.detach().double()
        else:
            y64 = torch.nn.functional.layer_norm(h64, (48,), eps=1e-5) * w.detach().double()
        g64 = torch.autograd.grad((y64, h64), (x64, r64), (dy.double(), dh.double()))
        tol = 5e-2 if dtype == BF16 else 1e-4
        for g, ref in zip((gx, gr), g64, strict=True):
            err = (g.double() - ref).abs().max() / ref.abs().max()
            assert err < tol, (op, dtype, r_dtype, in_fp32, float(err))


@pytest.mark.parametrize("op", ["rms", "ln"])
def test_residual_that_is_x_itself_gets_both_gradients(op):
    """The shared gradient tensor must not be accumulated into in place: norm(x, residual=x) needs
    the sum of both paths (2x the single gradient), not a doubled-then-redoubled buffer."""
    gen = torch.Generator().manual_seed(5)
    x = _rand((4, 32), FP32, gen)
    x2 = x.clone().requires_grad_()
    gen = torch.Generator().manual_seed(7)
    w = rand_weight(32, FP32, 0.0, gen).to(DEV)
    if op == "rms":
        y, h = rms_norm(x2, w, 1e-5, residual=x2)
        ref = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w  # noqa: E731
    else:
        b = (0.3 * torch.randn(32, generator=gen)).to(DEV)
        y, h = _ln(x2, w, b, 1e-5, residual=x2)
        ref = lambda t: torch.nn.functional.layer_norm(t, (32,), w, b, 1e-5)  # noqa: E731
    (g,) = torch.autograd.grad(y.sum() + h.sum(), x2)
    x3 = x.detach().clone().requires_grad_()
    h3 = x3 + x3
    (g_ref,) = torch.autograd.grad(ref(h3).sum() + h3.sum(), x3)
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


def test_fullgraph_compile_traces_with_gpu_kernels(monkeypatch):
    """torch.compile(fullgraph=True) traces the functional API's Python up to the ops. On a GPU its
    tracer models each @triton.jit kernel the code touches as a Triton kernel variable, which has
    no Python type: a check that asked type() of one broke the trace there and nowhere on the
    interpreter (found natively on an H100). Here every kernel is swapped for a real JITFunction,
    as the tracer sees kernels on a GPU, whose launches still run through the interpreter."""
    import torch._dynamo
    from triton.runtime.jit import JITFunction

    from normswap.kernels import layer_norm as L
    from normswap.kernels import rms_norm as R
    from normswap.kernels.layer_norm import layer_norm

    if not _common.INTERPRETED:
        pytest.skip("on a GPU the kernels are JITFunctions already (tests/test_kernels_gpu.py)")

    class InterpretedFunction(JITFunction):
        """A JITFunction to the tracer; to launch planning, which runs eagerly inside the ops and
        asks a kernel's type name, the interpreted kernel it wraps and launches."""

        def __init__(self, interpreted):
            super().__init__(interpreted.fn)
            self.interpreted = interpreted

        def __getitem__(self, grid):
            return self.interpreted[grid]

    # The launched kernels only: the interpreter calls the @triton.jit helpers they use by name.
    for mod, names in ((R, ("_rms_fwd_kernel", "_rms_bwd_kernel")), (L, ("_ln_fwd_kernel", "_ln_bwd_kernel"))):
        for name in names:
            monkeypatch.setattr(mod, name, InterpretedFunction(getattr(mod, name)))
    torch._dynamo.reset()

    def block(x, w, b, r):
        y, h = rms_norm(x * 2.0, w, 1e-6, residual=r)
        return (layer_norm(y, w, b, 1e-5).float() * h.float()).sum()

    gen = torch.Generator().manual_seed(11)
    args = [_rand((6, 40), FP32, gen), _rand(40, FP32, gen, 0.3, 1.0), _rand(40, FP32, gen), _rand((6, 40), FP32, gen)]
    args = [a.requires_grad_() for a in args]
    loss = torch.compile(block, fullgraph=True, backend="aot_eager")(*args)
    got = torch.autograd.grad(loss, args)
    torch._dynamo.reset()
    want_loss = block(*args)
    want = torch.autograd.grad(want_loss, args)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_tensors_on_a_device_the_kernels_cannot_use_are_one_clear_error():
    from normswap.errors import NormswapError
    from normswap.kernels.layer_norm import layer_norm

    x = torch.ones(2, 8, device="meta") if _common.INTERPRETED else torch.ones(2, 8)
    want = "interpreter runs on CPU tensors, got a tensor on meta" if _common.INTERPRETED else "need CUDA tensors"
    for call in (lambda: rms_norm(x, None, 1e-6), lambda: layer_norm(x, None, None, 1e-5)):
        with pytest.raises(NormswapError, match=want):
            call()
