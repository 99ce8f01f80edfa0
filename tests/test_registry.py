"""The registry: every norm class of the tiny models gets a spec that reproduces it bit for bit;
odd variants (no bias, no weights, 1 + weight, hard-coded eps) are recognised by probe; what is
not a norm, or not one normswap can express, gets None and a reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from norm_checks import assert_spec_reproduces
from tiny_models import ARCHS, tiny_model
from torch import nn

from normswap import registry
from normswap.specs import NormSpec

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _norm_classes_of(arch: str) -> dict[str, nn.Module]:
    model = tiny_model(arch)
    out = {}
    for _, m in model.named_modules():
        if registry.is_norm_like(m):
            out.setdefault(type(m).__name__, m)
    return out


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_tiny_model_norm_class_reproduces_bit_for_bit(arch):
    classes = _norm_classes_of(arch)
    assert classes, f"{arch}: no norm found"
    for name, module in classes.items():
        spec = registry.recognise(module).spec
        assert spec is not None, f"{arch}: {name} not recognised: {registry.recognise(module).reason}"
        for dtype in DTYPES:
            assert_spec_reproduces(module, spec, dtype)
        if spec.has_weight and spec.kind == "rms":  # mixed precision: where llama, t5 and gemma castings part ways
            assert_spec_reproduces(module, spec, torch.float32, x_dtype=torch.bfloat16)
            assert_spec_reproduces(module, spec, torch.bfloat16, x_dtype=torch.float32)


@pytest.mark.parametrize("arch, cls_name, kind, casting, offset, eps_attr", [
    ("llama", "LlamaRMSNorm", "rms", "llama", 0.0, "variance_epsilon"),
    ("qwen3", "Qwen3RMSNorm", "rms", "llama", 0.0, "variance_epsilon"),
    ("gemma", "GemmaRMSNorm", "rms", "gemma", 1.0, "eps"),
    ("gemma3_text", "Gemma3RMSNorm", "rms", "gemma", 1.0, "eps"),
    ("t5", "T5LayerNorm", "rms", "t5", 0.0, "variance_epsilon"),
    ("gpt2", "LayerNorm", "layer", "none", 0.0, "eps"),
])
def test_family_fields(arch, cls_name, kind, casting, offset, eps_attr):
    spec = registry.recognise(_norm_classes_of(arch)[cls_name]).spec
    assert (spec.kind, spec.casting, spec.offset, spec.eps_attr) == (kind, casting, offset, eps_attr)
    assert spec.has_weight and spec.has_bias == (kind == "layer") and spec.dtype == "float32"


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "t5", "qwen3"])
def test_probe_agrees_with_the_fingerprint(arch):
    """The numeric fallback alone reaches the same family as the code fingerprint."""
    for module in _norm_classes_of(arch).values():
        parts = registry._find_parts(module)
        family, _, method, exact = registry._probe(module, parts)
        spec = registry.recognise(module).spec
        assert method == "probe" and exact
        assert (family.kind, family.casting, family.offset) == (spec.kind, spec.casting, spec.offset)


def test_fingerprint_ignores_names_but_not_arithmetic():
    class RenamedRMS(nn.Module):  # LlamaRMSNorm's code, other names throughout
        def __init__(self, n, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.epsilon = eps

        def forward(self, h):
            """A docstring the fingerprint ignores."""
            dt = h.dtype
            h = h.to(torch.float32)
            var = h.pow(2).mean(-1, keepdim=True)
            h = h * torch.rsqrt(var + self.epsilon)
            return self.weight * h.to(dt)

    class CastLateRMS(RenamedRMS):  # one cast moved: a different family
        def forward(self, h):
            dt = h.dtype
            h = h.to(torch.float32)
            var = h.pow(2).mean(-1, keepdim=True)
            h = h * torch.rsqrt(var + self.epsilon)
            return (self.weight * h).to(dt)

    rec = registry.recognise(RenamedRMS(24, eps=3e-6))
    assert rec.method == "fingerprint:LlamaRMSNorm"
    assert rec.spec.eps == 3e-6 and rec.spec.eps_attr == "epsilon"
    late = registry.recognise(CastLateRMS(24))
    assert late.method == "probe" and late.spec.casting == "none" and late.spec.offset == 0.0
    for dtype in DTYPES:
        assert_spec_reproduces(CastLateRMS(24), late.spec, dtype)


class OffsetLayerNorm(nn.LayerNorm):
    """A LayerNorm with a (1 + weight) gain and a bias, computed in fp32."""

    def forward(self, x):
        return F.layer_norm(x.float(), self.normalized_shape, 1.0 + self.weight.float(),
                            self.bias.float(), self.eps).to(x.dtype)


class NonParametricLayerNorm(nn.Module):
    """OLMo-style: no parameters, eps written into the forward."""

    def __init__(self, hidden_size):
        super().__init__()
        self.normalized_shape = (hidden_size,)

    def forward(self, x):
        return F.layer_norm(x.float(), self.normalized_shape, None, None, eps=1e-6).to(x.dtype)


class GainOnlyRMSNorm(nn.Module):
    """(1 + g) RMS gain, Gemma arithmetic, with unusual attribute names."""

    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(n))
        self.norm_eps = 1e-5

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return (y * (1.0 + self.scale.float())).type_as(x)


@pytest.mark.parametrize("make, expect", [
    (lambda: nn.LayerNorm(40, bias=False), dict(kind="layer", has_weight=True, has_bias=False)),
    (lambda: nn.LayerNorm(40, elementwise_affine=False), dict(kind="layer", has_weight=False)),
    (lambda: nn.RMSNorm(40, eps=1e-6), dict(kind="rms", casting="none", eps=1e-6)),
    (lambda: OffsetLayerNorm(40, eps=1e-5), dict(kind="layer", offset=1.0, has_bias=True)),
    (lambda: NonParametricLayerNorm(40), dict(kind="layer", has_weight=False, eps=1e-6, eps_attr=None)),
    (lambda: GainOnlyRMSNorm(40), dict(kind="rms", offset=1.0, casting="gemma", eps_attr="norm_eps",
                                       weight_attr="scale")),
])
def test_variants(make, expect):
    module = make()
    spec = registry.recognise(module).spec
    assert spec is not None, registry.recognise(module).reason
    for k, v in expect.items():
        assert getattr(spec, k) == v, (k, getattr(spec, k), v)
    assert spec.shape == (40,)
    for dtype in DTYPES:
        assert_spec_reproduces(module, spec, dtype)


def test_meta_module_is_recognised_like_a_real_one():
    with torch.device("meta"):
        module = GainOnlyRMSNorm(40)
    spec = registry.recognise(module).spec
    assert spec is not None and spec.offset == 1.0 and spec.dtype == "float32"


class GatedRMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = 1e-6

    def forward(self, x, gate):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * gate


class CenteredNoScaleNorm(nn.Module):  # subtracts the mean, never divides: not a norm family
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = 1e-6

    def forward(self, x):
        return self.weight * (x - x.mean(-1, keepdim=True))


def test_unrecognised_modules_get_a_reason():
    for module in (GatedRMSNorm(16), CenteredNoScaleNorm(16)):
        rec = registry.recognise(module)
        assert rec.spec is None and rec.reason, type(module).__name__
    assert "takes gate besides the input" in registry.recognise(GatedRMSNorm(16)).reason
    assert "matches no known" in registry.recognise(CenteredNoScaleNorm(16)).reason


class OptionallyGatedRMSNorm(nn.Module):
    """transformers' Mamba-2 pattern under a name no list holds: without the gate it is exactly a
    Llama RMSNorm, so the numeric probe alone accepts it."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        if gate is not None:
            hidden_states = hidden_states * F.silu(gate.to(torch.float32))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Ungated(OptionallyGatedRMSNorm):
    def forward(self, hidden_states):
        return super().forward(hidden_states)


class KeywordsRMSNorm(Ungated):
    def forward(self, hidden_states, **kwargs):
        return super().forward(hidden_states)


def _without_wraps(forward):
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)
    return wrapper


class OpaqueRMSNorm(Ungated):
    forward = _without_wraps(Ungated.forward)


def test_a_norm_with_a_second_input_is_refused_by_its_signature_whatever_its_name():
    """Swapped for a one-input kernel, a gated norm would compute the wrong thing (or fail) where
    the model passes the gate; called without it, it computes a plain norm, which is all the probe
    sees. So any forward input besides the first refuses the class."""
    assert registry.recognise(Ungated(16)).spec is not None  # the same arithmetic, one input
    rec = registry.recognise(OptionallyGatedRMSNorm(16))
    assert rec.spec is None and "takes gate besides the input" in rec.reason
    rec = registry.recognise(KeywordsRMSNorm(16))
    assert rec.spec is None and "takes **kwargs besides the input" in rec.reason
    # A forward behind a decorator without functools.wraps shows only (*args, **kwargs): what it
    # takes cannot be read, and the reason names both (not the *args as if they were self).
    rec = registry.recognise(OpaqueRMSNorm(16))
    assert rec.spec is None and "takes *args, **kwargs besides the input" in rec.reason



def test_is_norm_like():
    assert registry.is_norm_like(nn.LayerNorm(8)) and registry.is_norm_like(GatedRMSNorm(8))
    assert not registry.is_norm_like(nn.BatchNorm1d(8))
    assert not registry.is_norm_like(nn.GroupNorm(2, 8))
    assert not registry.is_norm_like(nn.Linear(8, 8))

    class PreNorm(nn.Module):  # a block holding a norm: its norm is found on its own
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)

    assert not registry.is_norm_like(PreNorm())
    for name in ("LlamaRMSNorm", "T5LayerNorm", "EomtLayerNorm2d", "NemotronLayerNorm1P", "Llama4TextL2Norm",
                 "Qwen3NextRMSNormGated", "FooLayerNormalization"):
        assert registry.is_norm_like_name(name), name
    for name in ("DetrFrozenBatchNorm2d", "DFineConvNormLayer", "InklingNormedEmbedding",
                 "Sapiens2ForNormalEstimation", "PoolFormerGroupNorm"):
        assert not registry.is_norm_like_name(name), name


def test_unsupported_entries_have_reasons():
    for name, reason in registry.UNSUPPORTED.items():
        assert isinstance(reason, str) and len(reason) > 10, name


def test_spec_round_trips_json():
    spec = registry.recognise(_norm_classes_of("gemma")["GemmaRMSNorm"]).spec
    assert NormSpec.from_dict(spec.to_dict()) == spec


def test_a_layer_norm_run_as_rms_does_not_decide_for_its_class():
    """The per-class verdict cache once ignored NormswapLayerNorm.rms_form: after one converted
    model's zero-mean LayerNorms (which compute RMS norms) were looked at, every patched LayerNorm
    of the same shape in the process was taken for an RMS norm (convert_model then refused a
    plain patched GPT-2 with 'nothing to convert')."""
    import normswap
    from normswap.discover import is_layer_norm
    from normswap.manifest import rms_forms

    converted = tiny_model("gpt2")
    section = normswap.convert_model(converted)
    normswap.patch(converted, "torch", rms_forms=rms_forms(section), verify=False)
    assert not is_layer_norm(converted.transformer.h[0].ln_1)  # it computes an RMS norm now
    plain = tiny_model("gpt2")
    normswap.patch(plain, "torch", verify=False)
    assert is_layer_norm(plain.transformer.h[0].ln_1)
    assert normswap.convert_model(plain)["summary"]["converted"] > 0
