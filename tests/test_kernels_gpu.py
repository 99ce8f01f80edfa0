"""GPU-only checks (marker gpu; skipped without CUDA). `pytest -m gpu` runs the CPU grid of
test_kernels_rms.py / test_kernels_layer.py natively (test_grid_natively) plus what only a GPU can
show: large shapes, >2^31-element tensors, CUDA graph capture/replay of forward+backward, inductor
fullgraph compile, no recompilation per row count, determinism. The CPU test files themselves also
run natively on a GPU machine (plain `pytest`, no TRITON_INTERPRET)."""

from __future__ import annotations

import pytest
import torch

from normswap.backends import available_backends, get_backend
from normswap.kernels.layer_norm import _ln_bwd_kernel, _ln_fwd_kernel, layer_norm
from normswap.kernels.reference import layer_norm_ref, rms_norm_ref
from normswap.kernels.rms_norm import _rms_bwd_kernel, _rms_fwd_kernel, rms_norm
from tests.kernel_checks import TOL, assert_close, rand_weight
from tests.test_kernels_layer import check_ln
from tests.test_kernels_rms import MODES, SMALL, check_rms

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    from normswap.kernels import _common

    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_grid_natively(dtype):
    """The interpreter grid, compiled for the GPU: every shape, casting mode and offset, with and
    without weight, bias and fused residual, mixed weight dtypes, forward and backward."""
    for shape in (*SMALL, (64, 4096), (3, 70000)):
        for casting in MODES:
            for offset in (0.0, 1.0):
                check_rms(shape, dtype, casting, offset)
                check_rms(shape, dtype, casting, offset, residual=dtype, seed=1)
        check_rms(shape, dtype, with_weight=False, residual=dtype, seed=2)
        check_rms(shape, dtype, "t5", weight_dtype=torch.bfloat16, residual=torch.float32, residual_in_fp32=True)
        check_rms(shape, dtype, "llama", weight_dtype=torch.float32, out_dtype=torch.float32, seed=3)
        for offset in (0.0, 1.0):
            check_ln(shape, dtype, offset=offset)
            check_ln(shape, dtype, offset=offset, residual=dtype, seed=1)
        for with_weight, with_bias in ((False, False), (True, False), (False, True)):
            check_ln(shape, dtype, with_weight, with_bias, residual=dtype, seed=2)
        check_ln(shape, dtype, weight_dtype=torch.float32, residual=torch.float32, seed=3)


@pytest.mark.parametrize("shape", [(4096, 8192), (512, 4096), (33, 131072), (8, 262144), (4, 300000)])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_large_shapes(shape, dtype):
    check_rms(shape, dtype, "llama", residual=dtype)
    check_rms(shape, dtype, "gemma", 1.0)
    check_ln(shape, dtype, residual=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("n", (8192, 65536))  # one tile per row, and rows looped over column blocks
def test_past_two_to_the_31_elements(n):
    """Offsets beyond int32: the last rows of a >2^31-element bf16 tensor are normalised right, and
    their dx (and the fused residual's h and dr) are right too."""
    m = (1 << 31) // n + 64
    free, _ = torch.cuda.mem_get_info()
    if free < 8 * m * n * 2 + (2 << 30):
        pytest.skip("not enough GPU memory for >2^31-element tensors")
    bf16 = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=bf16, generator=gen)
    w = rand_weight(n, bf16, 0.0, torch.Generator().manual_seed(1)).cuda()
    tail = slice(m - 64, m)
    fwd_tol, bwd_tol = TOL[bf16]
    with torch.no_grad():
        y = rms_norm(x, w, 1e-6)
        assert_close(y[tail], rms_norm_ref(x[tail].double(), w.double(), 1e-6), fwd_tol, "rms tail rows")
        del y
        z = layer_norm(x, w, None, 1e-5)
        assert_close(z[tail], layer_norm_ref(x[tail].double(), w.double(), None, 1e-5), fwd_tol, "ln tail rows")
        del z
    # Backward with a fused residual: dy, y, h, dx, dr besides x and r (weight frozen: no dW sums).
    r = torch.randn(m, n, device="cuda", dtype=bf16, generator=gen)
    xs, rs = x.requires_grad_(), r.requires_grad_()
    y, h = rms_norm(xs, w, 1e-6, residual=rs)
    dy = torch.randn(m, n, device="cuda", dtype=bf16, generator=gen)
    dx, dr = torch.autograd.grad(y, (xs, rs), dy)
    del y
    x64 = x[tail].detach().double().requires_grad_()
    y64, h64 = rms_norm_ref(x64, w.double(), 1e-6, residual=r[tail].detach().double())
    (want,) = torch.autograd.grad(y64, (x64,), dy[tail].double())
    assert_close(h[tail], h64, fwd_tol, "h tail rows")
    assert_close(dx[tail], want, bwd_tol, "dx tail rows")
    assert_close(dr[tail], want, bwd_tol, "dr tail rows")


def _fwd_bwd(x, w, r, dy, dh):
    y, h = rms_norm(x, w, 1e-6, 1.0, "gemma", residual=r)
    return (y, h, *torch.autograd.grad((y, h), (x, w, r), (dy, dh)))


@pytest.mark.parametrize("n", (2048, 65536))  # whole rows, and rows split over cooperative programs
def test_cuda_graph_capture_and_replay_forward_backward(n):
    torch.manual_seed(0)
    m = 256
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (0.3 * torch.randn(n, device="cuda")).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernels outside the capture
        for _ in range(2):
            _fwd_bwd(x, w, r, dy, dh)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _fwd_bwd(x, w, r, dy, dh)
    for step in range(3):
        with torch.no_grad():
            for t in (x, r, dy, dh):
                t.copy_(torch.randn_like(t))
            w.copy_((0.3 * torch.randn(n, device="cuda")).to(torch.bfloat16) + step)
        graph.replay()
        eager = _fwd_bwd(x, w, r, dy, dh)
        for got, want, name in zip(static_out, eager, ("y", "h", "dx", "dw", "dr"), strict=True):
            assert torch.equal(got, want), f"replay {step}: {name} differs from eager"


def test_inductor_fullgraph_compile():
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def block(x, w, b, r):
        y, h = rms_norm(torch.nn.functional.gelu(x), w, 1e-6, residual=r)
        return layer_norm(y, w, b, 1e-5) * h

    compiled = torch.compile(block, fullgraph=True)
    for rows in (16, 48, 80):
        args = [torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16),
                (1 + 0.3 * torch.randn(1024, device="cuda")).to(torch.bfloat16),
                torch.randn(1024, device="cuda", dtype=torch.bfloat16),
                torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)]
        args = [a.requires_grad_() for a in args]
        out = compiled(*args)
        eager = block(*args)
        assert_close(out, eager.detach(), 2e-2, "compiled vs eager")
        got = torch.autograd.grad(out.float().sum(), args)
        want = torch.autograd.grad(eager.float().sum(), args)
        for g, e in zip(got, want, strict=True):
            assert_close(g, e, 5e-2, "compiled grads")


def _compiled_variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this triton exposes no per-device kernel cache to count")
    return sum(len(entry[0]) for entry in caches.values())


def test_no_recompilation_per_row_count():
    """Forward and backward: a new batch size reuses the compiled kernels (M is a runtime argument)."""
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kernels = (_rms_fwd_kernel, _rms_bwd_kernel, _ln_fwd_kernel, _ln_bwd_kernel)

    def fwd_bwd(rows):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for y in (rms_norm(x, w, 1e-6), layer_norm(x, w, None, 1e-5)):
            torch.autograd.grad(y, (x, w), torch.randn_like(y))

    fwd_bwd(1000)
    fwd_bwd(3001)  # the launch table has one tile per coarse row bucket (_common.ROW_BUCKETS)
    before = [_compiled_variants(k) for k in kernels]
    for rows in (1, 3, 7, 1001, 1017, 2048, 2049, 3001, 4099, 20000):
        fwd_bwd(rows)
    after = [_compiled_variants(k) for k in kernels]
    assert after == before, f"row counts triggered recompiles: {before} -> {after}"


@pytest.mark.parametrize("n", (4096, 65536, 262144))
def test_split_rows_are_deterministic(n):
    """Wide rows are split over programs that wait for each other: results must be bitwise the same
    run after run (fixed-order combination, no value atomics), for y, rstd-dependent dx, dW and dB."""
    torch.manual_seed(1)
    x = torch.randn(96, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.3 * torch.randn(n, device="cuda")).to(torch.bfloat16).requires_grad_()
    b = (0.3 * torch.randn(n, device="cuda")).to(torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)

    def run():
        y1 = rms_norm(x, w, 1e-6)
        y2 = layer_norm(x, w, b, 1e-5)
        return (y1, y2, *torch.autograd.grad((y1, y2), (x, w, b), (dy, dy)))

    first = run()
    for _ in range(3):
        for a, c in zip(first, run(), strict=True):
            assert torch.equal(a, c)


def test_backward_is_deterministic():
    torch.manual_seed(0)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.3 * torch.randn(4096, device="cuda")).to(torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    first = torch.autograd.grad(rms_norm(x, w, 1e-6), (x, w), dy)
    second = torch.autograd.grad(rms_norm(x, w, 1e-6), (x, w), dy)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert _compiled_variants(_rms_bwd_kernel) >= 1


@pytest.mark.parametrize("name", ["liger", "quack", "torch", "compile"])
@pytest.mark.parametrize("casting", MODES)
def test_other_backends_agree_with_triton(name, casting):
    if available_backends()[name] is not None:
        pytest.skip(available_backends()[name])
    from normswap.errors import NormswapError

    be = get_backend(name)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.3 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    try:
        other = be.rms_norm(x, w, 1e-6, 0.0, casting)
    except NormswapError:
        pytest.skip(f"{name} does not run casting {casting!r}")
    ours = rms_norm(x, w, 1e-6, 0.0, casting)
    assert (ours != other).float().mean().item() <= 0.01
