"""Per-module verification: passes a faithful replacement, and catches each way one can be wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from normswap.backends import Backend
from normswap.errors import using_option_names
from normswap.kernels.reference import layer_norm_ref, rms_norm_ref
from normswap.modules import RmsForm, build_replacement
from normswap.specs import NormSpec
from normswap.verify import ProbeConfig, compare_outputs, eps_scale, probe_scales, ulp, verify_module

LLAMA = NormSpec("rms", 1e-5, "variance_epsilon", casting="llama", shape=(32,))
GEMMA = NormSpec("rms", 1e-6, "eps", offset=1.0, casting="gemma", shape=(32,))
T5 = NormSpec("rms", 1e-6, "variance_epsilon", casting="t5", shape=(32,))
LN = NormSpec("layer", 1e-5, "eps", has_bias=True, shape=(32,))
CFG = ProbeConfig()


def _rand(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_((0.0 if n == "bias" else 0.7) + 0.3 * torch.randn(p.shape, generator=g))
    return m.eval()


def _module(spec, dtype):
    m = {"llama": lambda: LlamaRMSNorm(32, spec.eps), "gemma": lambda: GemmaRMSNorm(32, spec.eps),
         "t5": lambda: T5LayerNorm(32, spec.eps)}.get(spec.casting, lambda: nn.LayerNorm(32, spec.eps))()
    return _rand(m).to(dtype)


def _backend(rms=rms_norm_ref, layer=layer_norm_ref):
    return Backend("fake", rms, layer)


def test_ulp_definition():
    assert ulp(1.0, torch.float32) == 2.0**-23
    assert ulp(1.9, torch.float32) == 2.0**-23
    assert ulp(2.0, torch.bfloat16) == 2.0**-6
    assert ulp(0.3, torch.float16) == 2.0**-2 * 2.0**-10
    assert ulp(0.0, torch.float32) > 0  # the smallest normal's spacing, never 0


@pytest.mark.parametrize("spec", [LLAMA, GEMMA, T5, LN], ids=lambda s: s.casting + s.kind)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_faithful_replacement_passes(spec, dtype):
    m = _module(spec, dtype)
    c = verify_module("n", m, build_replacement(m, spec, "reference"), spec, dtype, CFG)
    assert c.passed, c.failures
    assert c.eps == spec.eps and c.dtype == str(dtype).removeprefix("torch.")
    assert 0 < c.max_err_original and c.max_err_replacement <= c.max_err_original + ulp(8.0, dtype)


@pytest.mark.parametrize("spec", [LLAMA, GEMMA, T5], ids=lambda s: s.casting)
def test_a_float64_rms_norm_that_computes_in_float32_is_said_so(spec):
    """Transformers' RMS norms cast a float64 input to float32: a float64 checkpoint of Llama,
    Gemma, T5, Qwen ... failed every patch with "the spec does not describe this module", as if
    normswap had misread the norm. A LayerNorm computes float64 in float64 and still passes."""
    m = _module(spec, torch.float64)
    c = verify_module("n", m, build_replacement(m, spec, "reference"), spec, torch.float64, CFG)
    assert not c.passed
    assert any(f.startswith("float64: on torch.float64 input the original computes in float32") and
               f.endswith("run the model in fp32 (model.float())") for f in c.failures), c.failures
    # under an entry point that has a dtype option, its way: patch_checkpoint's, the command line's
    for names, way in (({"dtype": "dtype"}, " (dtype='fp32')"), ({"dtype": "--dtype"}, " (--dtype fp32)"),
                       ({"impls": "--impls"}, "")):  # bench's command line has no option for it to name
        with using_option_names(names):
            failures = verify_module("n", m, build_replacement(m, spec, "reference"), spec, torch.float64, CFG).failures
        assert any(f.endswith(f"run the model in fp32{way}") for f in failures), failures
    assert not any(f.startswith("reference:") for f in c.failures)
    m = _module(LN, torch.float64)
    assert verify_module("n", m, build_replacement(m, LN, "reference"), LN, torch.float64, CFG).passed
    # a wrong spec in float64 is still a wrong spec: the original is far from its reference in float32 ulps too
    m = _module(GEMMA, torch.float64)
    wrong = dataclasses.replace(GEMMA, offset=0.0)
    failures = verify_module("n", m, build_replacement(m, wrong, "reference"), wrong, torch.float64, CFG).failures
    assert any(f.startswith("reference:") for f in failures) and not any(f.startswith("float64:") for f in failures)


def test_wrong_offset_fails():
    m = _module(GEMMA, torch.bfloat16)
    wrong = dataclasses.replace(GEMMA, offset=0.0)  # forgets Gemma's (1 + w)
    c = verify_module("n", m, build_replacement(m, wrong, "reference"), wrong, torch.bfloat16, CFG,
                      registry_spec=GEMMA)
    assert not c.passed
    assert any("family differs" in f for f in c.failures)
    # the float64 reference is built from the (wrong) spec: the original is far from it
    assert any(f.startswith("reference:") for f in c.failures)
    # and without the registry's word, the reference check alone still catches it
    c = verify_module("n", m, build_replacement(m, wrong, "reference"), wrong, torch.bfloat16, CFG)
    assert not c.passed and all(f.startswith("reference:") for f in c.failures)


def test_wrong_casting_is_caught_by_output_dtype():
    # Llama promotes to the weight's dtype (fp32 weight, bf16 input -> fp32); "none" casts back.
    m = _module(LLAMA, torch.float32)
    wrong = dataclasses.replace(LLAMA, casting="none")
    c = verify_module("n", m, build_replacement(m, wrong, "reference"), wrong, torch.float32, CFG)
    assert not c.passed
    assert any("casting: output dtype" in f for f in c.failures)


def test_two_ulp_error_fails_and_half_ulp_passes():
    # The max rule's threshold, on a sparse set of elements (every 64th off by k ulp at the max):
    # an offset on *every* element would be a systematic bias, which the mean rule catches.
    def noisy(k):
        def rms(x, w, eps, offset=0.0, casting="llama", **kw):
            y = rms_norm_ref(x, w, eps, offset, casting, **kw)
            m = y.detach().double().abs().max().item()
            bump = torch.zeros(y.numel(), dtype=torch.float64)
            bump[::64] = k * ulp(m, y.dtype)
            return (y.double() + bump.reshape(y.shape)).to(y.dtype)
        return rms

    m = _module(LLAMA, torch.float32)
    bad = build_replacement(m, LLAMA, "fake", backend=_backend(rms=noisy(3.0)))
    c = verify_module("n", m, bad, LLAMA, torch.float32, CFG)
    assert not c.passed and any("numeric" in f for f in c.failures), c.failures
    assert c.worst_margin_ulps > 1
    ok = build_replacement(m, LLAMA, "fake", backend=_backend(rms=noisy(0.25)))
    c = verify_module("n", m, ok, LLAMA, torch.float32, CFG)
    assert c.passed, c.failures


def test_eps_must_be_exact_and_zero_stays_zero():
    m = _rand(LlamaRMSNorm(32, 0.0))
    spec0 = dataclasses.replace(LLAMA, eps=0.0)
    rep = build_replacement(m, spec0, "reference")
    c = verify_module("n", m, rep, spec0, torch.float32, CFG)
    assert c.passed and c.eps == 0.0
    rep.variance_epsilon = 1e-6  # a default slipped in
    c = verify_module("n", m, rep, spec0, torch.float32, CFG)
    assert not c.passed and any("eps differs" in f for f in c.failures)


def _eps_times(factor):
    def rms(x, w, eps, offset=0.0, casting="llama", **kw):
        return rms_norm_ref(x, w, eps * factor, offset, casting, **kw)

    def layer(x, w, b, eps, offset=0.0, **kw):
        return layer_norm_ref(x, w, b, eps * factor, offset, **kw)

    return _backend(rms=rms, layer=layer)


@pytest.mark.parametrize("spec", [LLAMA, GEMMA, T5, LN], ids=lambda s: s.casting + s.kind)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_that_misuses_eps_fails(spec, dtype):
    # The module's eps attribute is right; the kernel uses twice that. At the fixed probe scales eps
    # is negligible (half a bf16 ulp at 1e-2), so only rows with mean square ~ eps can see it.
    m = _module(spec, dtype)
    c = verify_module("n", m, build_replacement(m, spec, "fake", backend=_eps_times(2.0)), spec, dtype, CFG)
    assert not c.passed and any(f.startswith("numeric") for f in c.failures), c.failures


def test_eps_scale_probe():
    assert eps_scale(0.0, torch.bfloat16) is None  # eps = 0: no such scale
    assert eps_scale(1e-6, torch.bfloat16) == pytest.approx(1e-3)
    assert eps_scale(1e-12, torch.float16) is None  # would be subnormal in fp16
    assert probe_scales(CFG, 1e-6, torch.float32) == (*CFG.scales, pytest.approx(1e-3))
    assert probe_scales(CFG, 1e-4, torch.float32) == CFG.scales  # 1e-2 already probes there


def _gemma_cast_like_llama(x, w, eps, offset=0.0, casting="gemma", **kw):
    """Gemma's formula with Llama's extra rounding: the normalised value is cast to x's dtype
    before the (1 + w) product. At most one ulp worse anywhere; worse on many elements."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * (offset + w.float())).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_with_an_extra_rounding_fails(dtype):
    m = _module(GEMMA, dtype)
    rep = build_replacement(m, GEMMA, "fake", backend=_backend(rms=_gemma_cast_like_llama))
    c = verify_module("n", m, rep, GEMMA, dtype, CFG)
    assert not c.passed and any("mean error" in f for f in c.failures), c.failures
    assert c.mean_err_ratio > 1.25


def test_kernel_that_ignores_strides_fails():
    # Reads the input's storage as if it were a contiguous (rows, hidden) matrix: right on tidy
    # 2-D probes, silently wrong on a transposed view of the activations.
    def rms(x, w, eps, offset=0.0, casting="llama", **kw):
        rows = torch.as_strided(x, (x.numel() // x.shape[-1], x.shape[-1]), (x.shape[-1], 1))
        return rms_norm_ref(rows, w, eps, offset, casting, **kw).reshape(x.shape)

    m = _module(LLAMA, torch.bfloat16)
    c = verify_module("n", m, build_replacement(m, LLAMA, "fake", backend=_backend(rms=rms)), LLAMA,
                      torch.bfloat16, CFG)
    assert not c.passed and any(f.startswith("numeric") for f in c.failures), c.failures


class ViewingRMSNorm(LlamaRMSNorm):
    """Its forward .view()s the input: it cannot take a strided view, and its model never gives it one."""

    def forward(self, x):
        return super().forward(x.view(-1, x.shape[-1])).view(x.shape)


def test_original_that_needs_contiguous_input_is_probed_contiguous():
    m = _rand(ViewingRMSNorm(32, LLAMA.eps))
    c = verify_module("n", m, build_replacement(m, LLAMA, "reference"), LLAMA, torch.float32, CFG)
    assert c.passed, c.failures


def test_copied_parameters_fail_adoption():
    m = _module(LN, torch.float32)
    rep = build_replacement(m, LN, "reference")
    rep.weight = nn.Parameter(m.weight.detach().clone())
    c = verify_module("n", m, rep, LN, torch.float32, CFG)
    assert not c.passed and any("copy" in f for f in c.failures)


def test_replacement_that_raises_is_a_failure_not_a_crash():
    def boom(*a, **k):
        raise RuntimeError("kernel launch failed")

    m = _module(LLAMA, torch.float32)
    c = verify_module("n", m, build_replacement(m, LLAMA, "fake", backend=_backend(rms=boom)), LLAMA,
                      torch.float32, CFG)
    assert not c.passed and "kernel launch failed" in c.failures[0]


def test_zero_mean_probes_for_as_rms():
    m = _module(LN, torch.float32)
    c = verify_module("n", m, build_replacement(m, LN, "reference", rms_form=RmsForm()), LN, torch.float32, CFG)
    assert c.passed, c.failures


@pytest.mark.parametrize("width", [2, 3])
def test_narrow_layer_norm_is_probed_on_rows_with_spread(width):
    # A row of two or three Gaussian samples is often nearly flat; removing its offset in fp32 then
    # cancels, the original lands thousands of ulps from float64 (4,572 at width 2 before the probe
    # spread each row), and the check blamed the spec. Every probe row now has spread at its scale.
    spec = dataclasses.replace(LN, shape=(width,))
    m = _rand(nn.LayerNorm(width, spec.eps))
    c = verify_module("n", m, build_replacement(m, spec, "reference"), spec, torch.float32, CFG)
    assert c.passed, c.failures
    assert c.original_ulps <= 4  # measured 2.0 (width 2) and 3.4 (width 3)


def test_compare_outputs():
    a = torch.randn(2, 3, 10)
    ok = compare_outputs(torch.float32, {"logits": a}, {"logits": a + 1e-7})
    assert ok.passed and ok.argmax_agreement == 1.0 and ok.kind == "logits"
    bad = compare_outputs(torch.float32, {"logits": a}, {"logits": a + 0.1})
    assert not bad.passed


def test_compare_outputs_judges_each_output_on_its_own_scale():
    """A ViTModel's outputs: a last hidden state of magnitude ~100 (a large final-norm weight) and a
    pooler output of at most 1 (a tanh). One scale for both (the largest) let the pooler be off by
    50x its own tolerance; each output is now held to rtol of its own largest magnitude, and the
    report names each one's numbers."""
    g = torch.Generator().manual_seed(0)
    hidden = 100 * torch.randn(2, 5, 8, generator=g)
    pooler = torch.tanh(torch.randn(2, 8, generator=g))
    before = {"last_hidden_state": hidden, "pooler_output": pooler}
    off = 50 * 1e-4 * pooler.abs().max()  # 50x the pooler's fp32 limit, 1/2 of the hidden state's
    check = compare_outputs(torch.float32, before, {"last_hidden_state": hidden, "pooler_output": pooler + off})
    assert check.kind == "last_hidden_state, pooler_output"
    assert not check.passed and not check.outputs["pooler_output"]["passed"]
    assert check.outputs["last_hidden_state"]["passed"] and check.outputs["last_hidden_state"]["max_abs_diff"] == 0
    assert check.max_abs_value == pytest.approx(float(pooler.abs().max()))  # the worst output's scale
    assert check.rel_diff("pooler_output") == pytest.approx(50 * 1e-4, rel=1e-3)
    # within every output's own limit: passes
    near = {"last_hidden_state": hidden * (1 + 1e-5), "pooler_output": pooler * (1 + 1e-5)}
    assert compare_outputs(torch.float32, before, near).passed


def test_named_outputs_keeps_every_output_when_two_names_meet():
    """Nested outputs are named "outer.inner": a field named "a.b" beside a nested "a" holding "b"
    made the same name, and one replaced the other, so a changed output went uncompared and the
    check passed. Both are kept (the second as "a.b'") and compared."""
    from normswap.verify import named_outputs

    class Dotted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return {"a.b": y, "a": {"b": 2 * x}}

    model, x = Dotted(), {"x": torch.randn(2, 4)}
    before = named_outputs(model, x)
    assert list(before) == ["a.b", "a.b'"]
    with torch.no_grad():
        model.lin.bias.add_(1)  # changes the first output, which the second replaced
    check = compare_outputs(torch.float32, before, named_outputs(model, x))
    assert not check.outputs["a.b"]["passed"] and check.outputs["a.b'"]["passed"] and not check.passed


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_norm_is_recognised_run_and_verified(impl, dtype):
    """Cohere's q/k LayerNorm: weight (heads, head_dim), each head normalised over head_dim with its
    own row. It is recognised with its (heads, head_dim) parameter shape, replaced without
    flattening (which would be a different norm), and passes verification like any norm; a
    replacement that flattens it fails."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    from normswap import registry
    from normswap.backends import available_backends

    if available_backends()[impl] is not None:
        pytest.skip(available_backends()[impl])
    m = _rand(CohereLayerNorm((4, 8), eps=1e-5)).to(dtype)
    rec = registry.recognise(m)
    assert rec.spec is not None, rec.reason
    spec = rec.spec
    assert spec.kind == "layer" and spec.shape == (4, 8) and spec.has_weight and spec.per_head
    rep = build_replacement(m, spec, impl)
    c = verify_module("q_norm", m, rep, spec, dtype, CFG)
    assert c.passed, c.failures
    x = torch.randn(3, 5, 4, 8).to(dtype)
    with torch.no_grad():
        assert (rep(x).double() - m(x).double()).abs().max().item() <= 2 * ulp(4.0, dtype)

    def flattened(x, weight, bias, eps, offset=0.0, residual=None, out_dtype=None, residual_in_fp32=False):
        y = layer_norm_ref(x.reshape(*x.shape[:-2], -1), weight.reshape(-1), bias, eps, offset)
        return y.reshape(x.shape)

    wrong = verify_module("q_norm", m, build_replacement(m, spec, "fake", backend=_backend(layer=flattened)), spec,
                          dtype, CFG)
    assert not wrong.passed


def test_overflow_probe_notes_nan_differences_both_ways():
    """Issue 9 case 11: at |x| ~ 1e30 torch's CPU nn.LayerNorm gives NaN rows (its sum of squares
    overflows float32) where normswap's LayerNorm returns the bias. The swap keeps the finite
    output, and the check says so in a note; a replacement that turns a finite output of the
    original into NaN is noted the other way round (neither fails: both are overflow garbage)."""
    m = _module(LN, torch.float32)
    x = 1e30 * torch.randn(4, 32)
    assert bool(torch.isnan(m(x)).all()), "premise: the original overflows to NaN here"
    c = verify_module("n", m, build_replacement(m, LN, "reference"), LN, torch.float32, CFG)
    assert c.passed, c.failures
    assert any("overflow" in n and "NaN" in n for n in c.notes), c.notes

    def nan_on_overflow(x, w, eps, offset=0.0, casting="llama", **kw):
        y = rms_norm_ref(x, w, eps, offset, casting, **kw)
        big = x.detach().float().abs().amax(-1, keepdim=True) > 1e20
        return torch.where(big, torch.full_like(y, float("nan")), y)

    r = _module(LLAMA, torch.float32)
    assert bool(torch.isfinite(r(x)).all()), "premise: Llama's RMSNorm stays finite (0) there"
    bad = build_replacement(r, LLAMA, "fake", backend=_backend(rms=nan_on_overflow))
    c = verify_module("n", r, bad, LLAMA, torch.float32, CFG)
    assert c.passed and any("replacement gives NaN" in n for n in c.notes), (c.failures, c.notes)
    ok = verify_module("n", r, build_replacement(r, LLAMA, "reference"), LLAMA, torch.float32, CFG)
    assert ok.passed and not ok.notes, (ok.failures, ok.notes)
