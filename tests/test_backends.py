"""Backend registry: what is available and why not, clear errors, and every available backend
against the float64 reference (forward and backward) in every casting mode it claims."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from benchmark_scripts import load_script

from normswap.backends import CASTING_SUPPORT, LAYER_NORM_SUPPORT, available_backends, get_backend
from normswap.errors import NormswapError
from normswap.kernels.reference import layer_norm_ref, rms_norm_ref
from tests.kernel_checks import TOL, assert_close, grads, leaf, leaf64, rand_weight

NAMES = ("triton", "torch", "compile", "liger", "quack", "reference")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_registry_lists_every_backend_with_a_reason():
    avail = available_backends()
    assert tuple(avail) == NAMES
    assert avail["reference"] is None and avail["torch"] is None
    for name, why in avail.items():
        assert why is None or (isinstance(why, str) and why.strip()), name
    for name in ("liger", "quack"):
        try:
            __import__({"liger": "liger_kernel", "quack": "quack"}[name])
        except ImportError:
            assert "does not import" in avail[name]
    assert set(CASTING_SUPPORT) == set(LAYER_NORM_SUPPORT) == set(NAMES)


def test_unknown_and_unavailable_backends_are_errors():
    with pytest.raises(NormswapError, match="unknown backend 'fast'; known: triton, torch"):
        get_backend("fast")
    for wrong in (["torch"], {"torch": 1}, None):  # a list was a TypeError, "unhashable type: 'list'"
        with pytest.raises(NormswapError, match=rf"^unknown backend {re.escape(repr(wrong))}; known: triton, torch"):
            get_backend(wrong)
    missing = [n for n, why in available_backends().items() if why is not None]
    if not missing:
        pytest.skip("every backend is available here")
    with pytest.raises(NormswapError) as err:
        get_backend(missing[0])
    msg = str(err.value)
    assert f"backend {missing[0]!r} is not available here" in msg
    ok = [n for n, why in available_backends().items() if why is None]
    assert msg.endswith("available: " + ", ".join(ok))
    assert "\n" not in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine triton runs without the interpreter")
def test_triton_reason_without_interpreter():
    """triton imported before TRITON_INTERPRET=1 (or without it) cannot run on CPU: say exactly that."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import triton\n"
        "from normswap.backends import available_backends, get_backend\n"
        "print(available_backends()['triton'])\n"
        "try:\n    get_backend('triton')\nexcept Exception as e:\n    print(type(e).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    reason, kind = out.stdout.strip().splitlines()
    assert reason.startswith("no CUDA device, and TRITON_INTERPRET=1 was not set before triton was imported")
    assert kind == "NormswapError"


def test_an_interpreter_that_cannot_run_the_kernels_is_one_reason_not_a_traceback_per_launch(monkeypatch):
    """Triton <= 3.6's interpreter with numpy >= 2.4 fails on the persistent kernels' loop bounds
    (int() of a 1-element array). The triton backend then says so, once, as its reason."""
    from normswap.kernels import _common
    from normswap.kernels.rms_norm import _rms_fwd_kernel

    if not _common.interpreting(_rms_fwd_kernel):
        pytest.skip("the probe runs only where the kernels are interpreted")
    assert _common.triton_unavailable_reason(_rms_fwd_kernel) is None  # this interpreter runs them

    class Broken:
        def __getitem__(self, grid):
            def launch(*args):
                raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
            return launch

    monkeypatch.setattr(_common, "_strided_loop_probe", Broken())
    _common._interpreter_problem.cache_clear()
    try:
        why = _common.triton_unavailable_reason(_rms_fwd_kernel)
        assert why is not None and "cannot run normswap's kernels" in why and "triton >= 3.7" in why
        assert available_backends()["triton"] == why
        with pytest.raises(NormswapError, match="backend 'triton' is not available here") as err:
            get_backend("triton")
        assert "\n" not in str(err.value)
    finally:
        _common._interpreter_problem.cache_clear()


def test_the_interpreter_probe_runs_on_the_cpu_whatever_the_default_device():
    """The probe's answer holds for the process: asked first under a meta default device (a model
    built without weights), it must still run, not call a working interpreter broken."""
    from normswap.kernels import _common
    from normswap.kernels.rms_norm import _rms_fwd_kernel

    if not _common.interpreting(_rms_fwd_kernel):
        pytest.skip("the probe runs only where the kernels are interpreted")
    _common._interpreter_problem.cache_clear()
    try:
        with torch.device("meta"):
            assert _common.triton_unavailable_reason(_rms_fwd_kernel) is None
        assert available_backends()["triton"] is None
    finally:
        _common._interpreter_problem.cache_clear()


def test_kernels_and_backends_never_import_transformers():
    # Liger and quack are blocked: what they import is theirs (Liger imports peft, which imports
    # transformers), and the test must not depend on whether they are installed.
    code = (
        "import sys\n"
        "sys.modules['liger_kernel'] = sys.modules['quack'] = None\n"
        "import normswap.backends as b, normswap.kernels.rms_norm, normswap.kernels.layer_norm\n"
        "import normswap.kernels.native, normswap.kernels.adapters\n"
        "b.available_backends()\n"
        "print('transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_triton_backend_is_the_kernels():
    if available_backends()["triton"] is not None:
        pytest.skip(available_backends()["triton"])
    from normswap.kernels.layer_norm import layer_norm
    from normswap.kernels.rms_norm import rms_norm

    b = get_backend("triton")
    assert b.rms_norm is rms_norm and b.layer_norm is layer_norm


def run_rms_case(be, dtype, casting, offset, with_weight, residual, w_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, 96, generator=gen) * 2 + 0.3).to(dtype).to(DEV)
    w = rand_weight(96, w_dtype or dtype, offset, gen).to(DEV) if with_weight else None
    r = torch.randn(5, 96, generator=gen).to(dtype).to(DEV) if residual else None
    xs, ws, rs = leaf(x), leaf(w), leaf(r)
    out = be.rms_norm(xs, ws, 1e-6, offset, casting, residual=rs)
    outs = out if residual else (out,)
    same = rms_norm_ref(x, w, 1e-6, offset, casting, residual=r)
    same = same if residual else (same,)
    assert [o.dtype for o in outs] == [s.dtype for s in same]
    # The casting contract: a half-precision result equals the same-dtype reference on nearly
    # every element (fp32 results differ in the last bits with summation order, so only tolerances).
    if outs[0].dtype != torch.float32:
        assert (outs[0] != same[0]).float().mean().item() <= 0.02
    x64, w64, r64 = leaf64(x), leaf64(w), leaf64(r)
    ref = rms_norm_ref(x64, w64, 1e-6, offset, casting, residual=r64)
    refs = ref if residual else (ref,)
    assert_close(outs[0], refs[0], max(TOL[dtype][0], TOL[outs[0].dtype][0]), "y")
    up = [torch.randn(o.shape, generator=gen).to(o.dtype).to(DEV) for o in outs]
    # Autograd-based backends run part of the chain in the narrowest dtype involved.
    bwd_tol = max(TOL[t.dtype][1] for t in (x, w, outs[0]) if t is not None)
    for g, e, t, name in zip(grads(outs, up, (xs, ws, rs)), grads(refs, up, (x64, w64, r64)), (x, w, r), "xwr", strict=True):
        if t is not None:
            assert_close(g, e, bwd_tol, f"d{name}")


def run_ln_case(be, dtype, offset, with_weight, with_bias, residual, w_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, 96, generator=gen) * 2 + 3.0).to(dtype).to(DEV)
    w = rand_weight(96, w_dtype or dtype, offset, gen).to(DEV) if with_weight else None
    b = torch.randn(96, generator=gen).to(w_dtype or dtype).to(DEV) if with_bias else None
    r = torch.randn(5, 96, generator=gen).to(dtype).to(DEV) if residual else None
    xs, ws, bs, rs = leaf(x), leaf(w), leaf(b), leaf(r)
    out = be.layer_norm(xs, ws, bs, 1e-5, offset, residual=rs)
    outs = out if residual else (out,)
    same = layer_norm_ref(x, w, b, 1e-5, offset, residual=r)
    same = same if residual else (same,)
    assert [o.dtype for o in outs] == [s.dtype for s in same]
    if outs[0].dtype != torch.float32:
        assert (outs[0] != same[0]).float().mean().item() <= 0.02
    a64 = [leaf64(t) for t in (x, w, b, r)]
    ref = layer_norm_ref(a64[0], a64[1], a64[2], 1e-5, offset, residual=a64[3])
    refs = ref if residual else (ref,)
    assert_close(outs[0], refs[0], TOL[dtype][0], "y")
    up = [torch.randn(o.shape, generator=gen).to(o.dtype).to(DEV) for o in outs]
    bwd_tol = max(TOL[t.dtype][1] for t in (x, w, b) if t is not None)
    for g, e, t, name in zip(grads(outs, up, (xs, ws, bs, rs)), grads(refs, up, a64), (x, w, b, r), "xwbr", strict=True):
        if t is not None:
            assert_close(g, e, bwd_tol, f"d{name}")


FAST = [n for n in ("triton", "torch", "liger", "quack", "reference") if available_backends()[n] is None]


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_backend_rms_all_claimed_modes(name, dtype):
    be = get_backend(name)
    for casting, condition in CASTING_SUPPORT[name].items():
        for offset in (0.0, 1.0):
            try:
                run_rms_case(be, dtype, casting, offset, True, residual=offset == 1.0)
            except NormswapError as e:
                # adapters refuse some combinations, loudly, but only where the table names the
                # condition a mode needs: a mode it claims outright must run
                assert name in ("liger", "quack") and condition is not None, e
    try:
        run_rms_case(be, dtype, "llama", 0.0, False, residual=True)
    except NormswapError as e:  # Liger's RMSNorm has no weight-free form, and says so
        assert name == "liger", e
    # Weight in another dtype: llama returns promote(w, x); t5 rounds to the half weight.
    if name not in ("liger", "quack"):
        run_rms_case(be, dtype, "llama", 0.0, True, False, w_dtype=torch.float32)
        run_rms_case(be, dtype, "t5", 0.0, True, False, w_dtype=torch.float16)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_backend_layer_norm(name, dtype):
    be = get_backend(name)
    for offset, wb, residual in ((0.0, (True, True), False), (1.0, (True, True), True), (0.0, (False, True), True),
                                 (0.0, (False, False), False)):
        try:
            run_ln_case(be, dtype, offset, *wb, residual)
        except NormswapError as e:  # only a backend whose LAYER_NORM_SUPPORT names a condition refuses
            assert name in ("liger", "quack") and LAYER_NORM_SUPPORT[name] is not None, e
    if name not in ("liger", "quack"):
        run_ln_case(be, dtype, 0.0, True, True, False, w_dtype=torch.float32)


def test_compile_backend_allows_many_configurations():
    """Each dtype/casting/offset combination is its own graph: with fullgraph=True, dynamo's default
    limit of 8 graphs made the 9th combination in a process a hard error."""
    if available_backends()["compile"] is not None:
        pytest.skip(available_backends()["compile"])
    import torch._dynamo

    get_backend("compile")
    assert torch._dynamo.config.recompile_limit >= 64


@pytest.mark.slow
def test_compile_backend():
    """torch.compile of the reference (inductor needs gcc on CPU and ~30 s per graph: one case each)."""
    if available_backends()["compile"] is not None:
        pytest.skip(available_backends()["compile"])
    be = get_backend("compile")
    assert get_backend("compile") is be  # one compiled wrapper per process: graphs are cached on it
    run_rms_case(be, torch.bfloat16, "llama", 0.0, True, residual=False)
    run_ln_case(be, torch.float32, 0.0, True, True, residual=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_benchmark_without_cuda_is_one_clear_line(capsys):
    assert load_script("kernels").main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["benchmarks/kernels.py: no CUDA device here; it measures GPU bandwidth "
                   "(use --dry-run for a CPU plumbing check)"]


def test_benchmark_takes_the_short_dtype_names_only(capsys, tmp_path):
    """Rows are keyed by the dtype name as given: an alias ('bfloat16') would not merge with the
    'bf16' rows of earlier runs, so it is refused like an unknown name, before anything runs."""
    for name in ("fp64", "bfloat16"):
        argv = ["--dry-run", "--dtypes", f"bf16,{name}", "--out", str(tmp_path / "k.json")]
        assert load_script("kernels").main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"benchmarks/kernels.py: unknown dtype '{name}'; choose from fp32, fp16, bf16"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content, says", [
    ("[" * 100_000 + "]" * 100_000, "malformed JSON: nested too deeply: more than 100 levels"),
    ('{"model_type": "llama", "hidden_size": 64}', "no list of result rows"),
])
def test_benchmark_refuses_an_out_it_did_not_write_before_measuring(capsys, tmp_path, content, says):
    """An existing --out is merged into: one nested past json's limit raised RecursionError after
    the first shape was measured (a traceback), and --out MODEL/config.json (a JSON object without
    rows) was replaced by the rows. Both are refused first, the file left as it was."""
    out = tmp_path / "k.json"
    out.write_text(content)
    argv = ["--dry-run", "--impls", "reference", "--rows", "4", "--hidden", "16", "--out", str(out)]
    assert load_script("kernels").main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("benchmarks/kernels.py:")]
    assert err == [f"benchmarks/kernels.py: {out} exists and is not a kernel benchmark result ({says}); write "
                   "elsewhere (--out)"]
    assert out.read_text() == content and sorted(p.name for p in tmp_path.iterdir()) == ["k.json"]


@pytest.mark.parametrize("content, says", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply: more than 100 levels"),
    ("[1, 2]", "list indices must be integers"),
])
def test_kernel_static_render_of_a_file_it_did_not_write_is_one_line(capsys, tmp_path, content, says):
    """kernel_static.py --render FILE: a file nested past json's limit (RecursionError) or a list in
    place of the results document (TypeError) was a traceback."""
    bad = tmp_path / "static.json"
    bad.write_text(content)
    assert load_script("kernel_static").main(["--render", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kernel_static.py: cannot read {bad}: {says}"), err


def _separate_kernel_bytes(r) -> int:
    """Bytes as separate kernels move them, for a dry-run row of 4 rows x 16: fwd+bwd reads x twice;
    with a residual, x and residual share one gradient (h = x + residual), written once."""
    e = 4 if r["dtype"] == "fp32" else 2
    params = 1 if r["op"] == "rms_norm" else 2
    fwd = (4 if r["residual"] else 2) * 4 * 16 * e + params * 16 * e  # x (+ r), w (+ b) read; y (+ h) written
    bwd = (4 if r["residual"] else 3) * 4 * 16 * e + (1 + params) * 16 * e  # x or h, dy (+ dh), w read; dx, dw (+ db)
    return fwd if r["pass"] == "fwd" else fwd + bwd


def test_benchmark_dry_run_writes_the_schema(tmp_path, capsys):
    """Plumbing only (tiny CPU shapes, reference and torch backends): table and JSON schema."""
    import json

    out = tmp_path / "bench.json"
    bench = load_script("kernels")
    assert bench.main(["--dry-run", "--impls", "reference,torch", "--rows", "4", "--hidden", "16",
                       "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {"device", "torch", "triton", "commit", "versions", "copy_gbs", "l2_bytes", "launch_table",
                        "user_launch_table", "rows"}
    assert doc["launch_table"]["arch"] == "interpreter" and doc["launch_table"]["entries"] == 0
    assert doc["user_launch_table"] is None  # the test suite runs with NORMSWAP_LAUNCH_TABLE=off
    assert doc["copy_gbs"] > 0
    assert set(doc["versions"]) == {"reference", "torch"} and doc["versions"]["torch"]
    assert len(doc["rows"]) == 2 * 2 * 2 * 2  # ops x passes x dtypes x impls, one shape
    for r in doc["rows"]:
        assert set(r) == {"op", "pass", "dtype", "M", "N", "residual", "impl", "casting", "timing", "us", "gbs",
                          "bytes", "sets"}
        assert r["op"] in ("rms_norm", "layer_norm") and r["pass"] in ("fwd", "fwd+bwd")
        assert r["us"] > 0 and r["gbs"] > 0 and r["sets"] >= 2
        assert r["casting"] == ("gemma" if r["op"] == "rms_norm" else None)
        assert r["bytes"] == _separate_kernel_bytes(r)
    table = capsys.readouterr().out
    assert "copy bandwidth" in table and "reference" in table and "torch" in table
    # A second run of a part merges into the same file instead of dropping the rest.
    assert bench.main(["--dry-run", "--impls", "reference", "--ops", "rms_norm", "--passes", "fwd",
                       "--dtypes", "fp32", "--rows", "4", "--hidden", "16", "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["rows"]) == 16
    # The fused residual path is timed apart and kept apart (its own rows, residual true).
    assert bench.main(["--dry-run", "--impls", "reference", "--ops", "rms_norm", "--passes", "fwd,fwd+bwd",
                       "--dtypes", "fp32", "--rows", "4", "--hidden", "16", "--residual", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 18 and sum(r["residual"] for r in rows) == 2
    assert all(r["bytes"] == _separate_kernel_bytes(r) for r in rows if r["residual"])
    # CUDA-only backends are refused in a dry run whether or not they import (they would crash on CPU tensors).
    for name in ("liger", "quack"):
        assert bench.main(["--dry-run", "--impls", name]) == 2


def test_benchmark_survives_a_backend_failing_one_shape(tmp_path, capsys, monkeypatch):
    """Liger raises a RuntimeError for rows wider than 65,536: such a cell is marked `error`, the
    message goes to stderr, the other cells are measured, and the JSON holds what was measured."""
    import json

    import normswap.backends as backends
    from normswap.kernels.reference import layer_norm_ref, rms_norm_ref

    def picky_rms_norm(x, *args, **kwargs):
        if x.shape[-1] > 16:
            raise RuntimeError("Cannot launch Triton kernel since n = 48 exceeds the recommended blocksize")
        return rms_norm_ref(x, *args, **kwargs)

    monkeypatch.setattr(backends, "available_backends", lambda: {"reference": None})
    monkeypatch.setattr(backends, "get_backend", lambda name: backends.Backend(name, picky_rms_norm, layer_norm_ref))
    out = tmp_path / "bench.json"
    assert load_script("kernels").main(["--dry-run", "--impls", "reference", "--dtypes", "fp32", "--rows", "4",
                                   "--hidden", "16,48", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "reference failed on rms_norm fwd fp32 4x48: RuntimeError: Cannot launch" in cap.err
    assert "error" in cap.out
    rows = json.loads(out.read_text())["rows"]
    measured = {(r["op"], r["pass"], r["N"]) for r in rows if "skip" not in r}
    assert measured == {(op, p, n) for op in ("rms_norm", "layer_norm") for p in ("fwd", "fwd+bwd") for n in (16, 48)
                        if not (op == "rms_norm" and n == 48)}
    # The failures stay in the JSON, with their reason.
    failed = [r for r in rows if "skip" in r]
    assert len(failed) == 2 and all(r["op"] == "rms_norm" and r["N"] == 48 for r in failed)
    assert all(r["skip"].startswith("error: RuntimeError: Cannot launch") for r in failed)


def test_gradient_reaching_the_empty_h_placeholder_is_ignored():
    """Without a residual the ops return an empty h; a gradient flowing into it (e.g. summing every
    output) must not be handed to the kernel, which would read past its end."""
    from normswap.kernels.layer_norm import layer_norm_fwd
    from normswap.kernels.reference import layer_norm_ref, rms_norm_ref
    from normswap.kernels.rms_norm import rms_norm_fwd

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 37, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (1 + 0.3 * torch.randn(37, generator=g)).requires_grad_()
    b = (0.3 * torch.randn(37, generator=g)).requires_grad_()
    dy = torch.randn(4, 37, generator=g)
    for op, ref, params in [
        (lambda: rms_norm_fwd(x, w, None, 1e-6, 0.0, "llama", None, False),
         lambda x, w: rms_norm_ref(x, w, 1e-6, casting="llama"), (w,)),
        (lambda: layer_norm_fwd(x, w, b, None, 1e-5, 0.0, None, False),
         lambda x, w: layer_norm_ref(x, w, b.double(), 1e-5), (w, b)),
    ]:
        outs = op()
        assert outs[1].numel() == 0
        grads = torch.autograd.grad((outs[0] * dy).sum() + outs[1].sum(), [x, *params])
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        ref_dx, ref_dw = torch.autograd.grad((ref(x64, w64) * dy.double()).sum(), [x64, w64])
        torch.testing.assert_close(grads[0].double(), ref_dx, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grads[1].double(), ref_dw, rtol=1e-4, atol=1e-5)


def _hf_norms(n: int):
    """(family, HF module factory, casting, offset) for each RMSNorm family the casting modes name."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return (("llama", lambda: LlamaRMSNorm(n, eps=1e-6), "llama", 0.0),
            ("gemma", lambda: GemmaRMSNorm(n, eps=1e-6), "gemma", 1.0),
            ("gemma3", lambda: Gemma3RMSNorm(n, eps=1e-6), "gemma", 1.0),
            ("t5", lambda: T5LayerNorm(n, eps=1e-6), "t5", 0.0))


@pytest.mark.parametrize("name", [n for n in ("reference", "torch", "triton") if available_backends()[n] is None])
def test_half_precision_outputs_equal_the_hf_modules(name):
    """Each casting mode is the HF family's own arithmetic: for every x/weight dtype mix whose result
    is half precision, the backend's RMSNorm output equals the HF module's bit for bit (the reference
    runs HF's very ops; on a GPU, native and Triton reductions may move a rare element by one ulp).
    fp32 results are left to the tolerance tests (reduction order sets their last bits)."""
    be = get_backend(name)
    limit = 0.0 if name == "reference" or DEV == "cpu" else 0.01
    gen = torch.Generator().manual_seed(11)
    n, half, checked = 257, (torch.float16, torch.bfloat16), 0
    for x_dtype in half:
        for w_dtype in (torch.float16, torch.bfloat16, torch.float32):
            x = (torch.randn(16, n, generator=gen) * 2 + 0.3).to(x_dtype).to(DEV)
            w = 1 + 0.3 * torch.randn(n, generator=gen)
            for family, factory, casting, offset in _hf_norms(n):
                hf = factory()
                with torch.no_grad():
                    hf.weight.copy_(w - offset)
                hf = hf.to(device=DEV, dtype=w_dtype)
                with torch.no_grad():
                    want = hf(x)
                    got = be.rms_norm(x, hf.weight, 1e-6, offset, casting)
                what = f"{family} x={x_dtype} w={w_dtype}"
                assert got.dtype == want.dtype, what
                if want.dtype in half:
                    assert (got != want).float().mean().item() <= limit, what
                    checked += 1
            if w_dtype == x_dtype:
                ln = torch.nn.LayerNorm(n, eps=1e-5)
                with torch.no_grad():
                    ln.weight.copy_(w)
                    ln.bias.copy_(torch.randn(n, generator=gen))
                ln = ln.to(device=DEV, dtype=w_dtype)
                with torch.no_grad():
                    want, got = ln(x), be.layer_norm(x, ln.weight, ln.bias, 1e-5)
                assert got.dtype == want.dtype
                # nn.LayerNorm is one native op: only the torch backend runs that very op; the others
                # compute mean and variance themselves (summation order moves a rare ulp).
                ln_limit = 0.0 if name == "torch" else 0.01
                assert (got != want).float().mean().item() <= ln_limit, f"LayerNorm {x_dtype}"
                checked += 1
    # 24 RMS cases less llama/t5 with an fp32 weight and llama with the other half dtype (fp32 results),
    # plus two LayerNorms
    assert checked == 24 - 4 - 2 + 2


def test_liger_adapter_refuses_what_it_would_compute_differently():
    """Checked before Liger is imported, so this runs without it: Liger writes y in x's dtype, so
    Llama casting with a weight of another dtype (HF returns the promoted dtype) is refused."""
    from normswap.kernels.adapters import liger_rms_norm

    x = torch.randn(2, 8, dtype=torch.bfloat16)
    for w, kw, why in ((torch.ones(8), {}, "float32 weight on torch.bfloat16"),
                       (None, {}, "needs a weight"),
                       (torch.ones(8, dtype=torch.bfloat16), {"offset": 1.0}, "with an offset"),
                       (torch.ones(8, dtype=torch.bfloat16), {"casting": "t5"}, "no casting mode 't5'")):
        with pytest.raises(NormswapError, match=why):
            liger_rms_norm(x, w, 1e-6, **kw)
