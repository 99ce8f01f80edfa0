"""The kernel benchmark's case and timer, shared by benchmarks/kernels.py and the launch tuner
(normswap/kernels/tune.py), so that a tuned tile is timed exactly as the benchmark times it: the
benchmark grid's shapes, a case that rotates over input sets of >= ROTATE_L2 x the L2 size inside
the timed region (shapes that fit in L2 are not measured L2-warm), CUDA-graph replays or CUDA
events (never silently one for the other), and the bytes each pass moves as separate kernels must
move them (benchmarks/kernels.py's docstring says how they are counted)."""

from __future__ import annotations

import math
import time

import torch

# The benchmark grid: rows x hidden sizes, plus one small shape (few rows).
ROWS = (4096, 32768)
HIDDEN = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
SMALL_SHAPE = (512, 4096)
# Input sets a case rotates over: enough to total ROTATE_L2 x the L2 size, at most MAX_SETS.
ROTATE_L2 = 4
MAX_SETS = 64


def time_us(fn, device: str, timing: str, reps: int) -> float:
    """Median time of one fn() call in microseconds, by the requested method only (a failure to
    time that way propagates: the caller records it, never falls back to another method)."""
    if device != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    import triton.testing

    fn()  # compile / autotune outside the measurement
    torch.cuda.synchronize()
    if timing == "events":
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    # The capture allocates from a private pool: blocks cached by the warm-up calls would otherwise
    # stay reserved beside it and turn the largest shapes that fit into spurious OOMs.
    torch.cuda.empty_cache()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def l2_bytes(device: str) -> int:
    if device == "cuda":
        return int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 50 << 20))
    return 1 << 20


def pass_bytes(op: str, pass_: str, m: int, n: int, e: int, residual: bool) -> int:
    """Bytes the pass moves as separate forward and backward kernels (see the module docstring)."""
    params = 2 if op == "layer_norm" else 1
    rows = m * n * e
    fwd = (4 if residual else 2) * rows + params * n * e             # x (+r) read, y (+h) written
    if pass_ == "fwd":
        return fwd
    # saved input + dy (+ dh) and the weight read (never the bias: its grad needs none of it),
    # dx and every parameter's grad written. With a residual, x and residual get the same gradient
    # (h = x + residual): one tensor, written once; a second copy is traffic no kernel must move.
    bwd = (4 if residual else 3) * rows + (1 + params) * n * e
    return fwd + bwd


def make_case(op, pass_, be, m, n, dtype, device, casting, residual, l2):
    """(callable over every input set, bytes per set, number of sets); allocates the tensors.

    The callable runs the case once per input set, so that consecutive runs never find their
    inputs in L2: the time of one case is the callable's time over the number of sets."""
    grad = pass_ == "fwd+bwd"
    e = torch.finfo(dtype).bits // 8
    nbytes = pass_bytes(op, pass_, m, n, e, residual)
    sets = max(1, min(MAX_SETS, math.ceil(ROTATE_L2 * l2 / nbytes)))
    if device != "cuda":
        sets = 2
    w = (1 + 0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_(grad)
    b = (0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_(grad) if op == "layer_norm" else None

    def forward(x, r):
        if op == "rms_norm":
            return be.rms_norm(x, w, 1e-6, 0.0, casting, residual=r)
        return be.layer_norm(x, w, b, 1e-5, residual=r)

    inputs = []
    for _ in range(sets):
        x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=grad)
        r = torch.randn(m, n, device=device, dtype=dtype, requires_grad=grad) if residual else None
        dy = torch.randn(m, n, device=device, dtype=dtype) if grad else None
        dh = torch.randn(m, n, device=device, dtype=dtype) if grad and residual else None
        inputs.append((x, r, dy, dh))

    if not grad:
        def run_all():
            with torch.no_grad():
                for x, r, _, _ in inputs:
                    forward(x, r)
        return run_all, nbytes, sets

    params = [t for t in (w, b) if t is not None]

    def run_all():
        for x, r, dy, dh in inputs:
            out = forward(x, r)
            if r is None:
                torch.autograd.grad(out, (x, *params), dy)
            else:
                torch.autograd.grad(out, (x, r, *params), (dy, dh))
    return run_all, nbytes, sets


def fits(m, n, dtype, pass_, residual, device) -> bool:
    """Cheap pre-check: one input set's own tensors (x, y, +dy, dx; with a residual also r, h, dh,
    dr) must fit."""
    if device != "cuda":
        return True
    tensors = (2 if pass_ == "fwd" else 4) * (2 if residual else 1)
    free, _ = torch.cuda.mem_get_info()
    return tensors * m * n * (torch.finfo(dtype).bits // 8) < 0.9 * free


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
