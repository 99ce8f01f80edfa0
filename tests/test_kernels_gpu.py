"""GPU-only checks (marker gpu; skipped without CUDA). The CPU grids in test_kernels_rms.py /
test_kernels_layer.py / test_backends.py run natively on a GPU machine as well; this file adds
what only a GPU can show: large shapes, >2^31-element tensors, CUDA graph capture/replay of
forward+backward, inductor fullgraph compile, no recompilation per row count, determinism."""

from __future__ import annotations

import pytest
import torch

from normswap.backends import available_backends, get_backend
from normswap.kernels.layer_norm import _ln_fwd_kernel, layer_norm
from normswap.kernels.reference import layer_norm_ref, rms_norm_ref
from normswap.kernels.rms_norm import _rms_bwd_kernel, _rms_fwd_kernel, rms_norm
from tests.kernel_checks import TOL, assert_close, rand_weight
from tests.test_kernels_layer import check_ln
from tests.test_kernels_rms import MODES, check_rms

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    from normswap.kernels import _common

    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)


@pytest.mark.parametrize("shape", [(4096, 8192), (512, 4096), (33, 131072), (8, 262144), (4, 300000)])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_large_shapes(shape, dtype):
    check_rms(shape, dtype, "llama", residual=dtype)
    check_rms(shape, dtype, "gemma", 1.0)
    check_ln(shape, dtype, residual=dtype)


@pytest.mark.slow
def test_past_two_to_the_31_elements():
    """Row offsets beyond int32: the last rows of a >2^31-element bf16 tensor are normalised right."""
    n = 8192
    m = (1 << 31) // n + 64
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * m * n * 2 + (1 << 30):
        pytest.skip("not enough GPU memory for a >2^31-element tensor")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = rand_weight(n, torch.bfloat16, 0.0, torch.Generator().manual_seed(1)).cuda()
    y = rms_norm(x, w, 1e-6)
    tail = slice(m - 64, m)
    assert_close(y[tail], rms_norm_ref(x[tail].double(), w.double(), 1e-6), TOL[torch.bfloat16][0], "tail rows")
    z = layer_norm(x, w, None, 1e-5)
    assert_close(z[tail], layer_norm_ref(x[tail].double(), w.double(), None, 1e-5), TOL[torch.bfloat16][0], "tail")


def _fwd_bwd(x, w, r, dy, dh):
    y, h = rms_norm(x, w, 1e-6, 1.0, "gemma", residual=r)
    return (y, h, *torch.autograd.grad((y, h), (x, w, r), (dy, dh)))


def test_cuda_graph_capture_and_replay_forward_backward():
    torch.manual_seed(0)
    m, n = 256, 2048
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
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    for kernel_fn in (lambda x: rms_norm(x, w, 1e-6), lambda x: layer_norm(x, w, None, 1e-5)):
        kernel_fn(torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16))
        before = (_compiled_variants(_rms_fwd_kernel), _compiled_variants(_ln_fwd_kernel))
        for rows in (1, 3, 7, 1001, 1017, 2048, 3001, 4099):
            kernel_fn(torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16))
        after = (_compiled_variants(_rms_fwd_kernel), _compiled_variants(_ln_fwd_kernel))
        assert after == before, f"row counts triggered recompiles: {before} -> {after}"


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
