"""Replacement modules adopt the original's tensors and compute the original family's arithmetic."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from normswap.modules import (
    NormswapLayerNorm,
    NormswapRMSNorm,
    RmsForm,
    build_replacement,
    restore_original,
)
from normswap.specs import NormSpec


def _randomise(m: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_((0.0 if name == "bias" else 0.8) + 0.3 * torch.randn(p.shape, generator=g))
    return m


def cases():
    """(module factory, spec) pairs covering every family the modules must reproduce."""
    return {
        "llama": (lambda: LlamaRMSNorm(32, 1e-5),
                  NormSpec("rms", 1e-5, "variance_epsilon", casting="llama", shape=(32,))),
        "gemma": (lambda: GemmaRMSNorm(32, 1e-6),
                  NormSpec("rms", 1e-6, "eps", offset=1.0, casting="gemma", shape=(32,))),
        "t5": (lambda: T5LayerNorm(32, 1e-6),
               NormSpec("rms", 1e-6, "variance_epsilon", casting="t5", shape=(32,))),
        "layernorm": (lambda: nn.LayerNorm(32, 1e-5),
                      NormSpec("layer", 1e-5, "eps", has_bias=True, shape=(32,))),
        "layernorm_nobias": (lambda: nn.LayerNorm(32, 1e-5, bias=False),
                             NormSpec("layer", 1e-5, "eps", shape=(32,))),
        "layernorm_noaffine_eps0": (lambda: nn.LayerNorm(32, 0.0, elementwise_affine=False),
                                    NormSpec("layer", 0.0, "eps", has_weight=False, shape=(32,))),
        "layernorm_2d": (lambda: nn.LayerNorm((4, 8), 1e-5),
                         NormSpec("layer", 1e-5, "eps", has_bias=True, shape=(4, 8))),
    }


CASES = cases()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adopts_parameters_and_matches_original(name, dtype):
    factory, spec = CASES[name]
    orig = _randomise(factory()).to(dtype).eval()
    keys = {k: (v.dtype, v.shape) for k, v in orig.state_dict().items()}
    rep = build_replacement(orig, spec, "reference")
    assert isinstance(rep, NormswapLayerNorm if spec.kind == "layer" else NormswapRMSNorm)
    # same keys, same objects (adopted, not copied), same dtypes
    assert {k: (v.dtype, v.shape) for k, v in rep.state_dict().items()} == keys
    for pname, p in orig.named_parameters():
        assert rep._parameters[pname] is p
    # the eps attribute the model's code reads keeps its name and exact value
    assert getattr(rep, spec.eps_attr) == getattr(orig, spec.eps_attr) == spec.eps
    assert rep.original_class is type(orig)
    shape = (3, 5, *spec.shape)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2 + 0.3).to(dtype)
    with torch.no_grad():
        y0, y1 = orig(x), rep(x)
    assert y1.dtype == y0.dtype and y1.shape == y0.shape
    # the reference backend reproduces each family's roundings: equal up to fp32 reduction order
    tol = 4 * torch.finfo(y0.dtype).eps * y0.abs().max().item()
    assert (y1.double() - y0.double()).abs().max().item() <= tol


def test_requires_grad_and_device_kept():
    orig = _randomise(nn.LayerNorm(16))
    orig.bias.requires_grad_(False)
    rep = build_replacement(orig, NormSpec("layer", 1e-5, "eps", has_bias=True, shape=(16,)), "reference")
    assert rep.weight.requires_grad and not rep.bias.requires_grad
    assert rep.weight.device == orig.weight.device
    assert rep.normalized_shape == (16,) and rep.elementwise_affine  # attributes HF code may read


def test_gradients_reach_adopted_weights():
    torch.manual_seed(0)
    for name in ("llama", "gemma", "layernorm"):
        factory, spec = CASES[name]
        ref = _randomise(factory())
        orig = copy.deepcopy(ref)
        rep = build_replacement(orig, spec, "reference")
        x = torch.randn(4, 32, dtype=torch.float32)
        g = torch.randn(4, 32)
        (ref(x) * g).sum().backward()
        (rep(x) * g).sum().backward()
        for pname, p in ref.named_parameters():
            q = getattr(orig, pname)  # the original's own Parameter received the gradient
            assert q.grad is not None, (name, pname)
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)


def test_restore_original_gets_current_tensors():
    orig = _randomise(LlamaRMSNorm(8, 1e-6))
    rep = build_replacement(orig, NormSpec("rms", 1e-6, "variance_epsilon", casting="llama", shape=(8,)),
                            "reference")
    rep.weight = nn.Parameter(torch.full((8,), 0.5))  # e.g. accelerate swapped the Parameter object
    rep.eval()
    back = restore_original(rep)
    assert back is orig and back.weight is rep.weight and not back.training


def test_eps_is_read_from_the_adopted_attribute():
    orig = _randomise(LlamaRMSNorm(8, 0.0))
    rep = build_replacement(orig, NormSpec("rms", 0.0, "variance_epsilon", casting="llama", shape=(8,)),
                            "reference")
    assert rep.norm_eps == 0.0  # eps = 0 stays 0
    rep.variance_epsilon = 1e-2  # code that edits eps later is honoured, like the original would
    assert rep.norm_eps == 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_rmsnorm_with_eps_none(dtype):
    # nn.RMSNorm(eps=None) picks its eps per call from the input's dtype; the replacement must too
    # (it crashed with float(None), and a fixed eps would be off by 2**16 in bf16).
    from normswap import patch
    from normswap.verify import ProbeConfig

    net = nn.Sequential(_randomise(nn.RMSNorm(32, eps=None))).to(dtype)
    orig = net[0]
    x = 1e-3 * torch.randn(4, 32)  # small enough for eps to matter
    report = patch(net, "reference", probe=ProbeConfig(elements=2048))
    assert isinstance(net[0], NormswapRMSNorm) and net[0].norm_eps is None and report.patched[0].check.eps is None
    for xd in (x.to(dtype), x.to(torch.bfloat16), x):
        torch.testing.assert_close(net[0](xd), orig(xd), rtol=0, atol=0)


def test_layernorm_as_rms_equals_layernorm_on_zero_mean_input():
    orig = _randomise(nn.LayerNorm(32, 1e-5))
    spec = NormSpec("layer", 1e-5, "eps", has_bias=True, shape=(32,))
    rep = build_replacement(orig, spec, "reference", rms_form=RmsForm())
    x = torch.randn(6, 32, dtype=torch.float64)
    x = (x - x.mean(-1, keepdim=True)).float()
    with torch.no_grad():
        torch.testing.assert_close(rep(x), orig(x), rtol=2e-6, atol=2e-6)
    # and it really skips the centring: on shifted input it differs (so the flag is honoured)
    with torch.no_grad():
        assert (rep(x + 3.0) - orig(x + 3.0)).abs().max() > 0.1
    with pytest.raises(ValueError):
        build_replacement(LlamaRMSNorm(4), NormSpec("rms", 1e-6, "variance_epsilon", shape=(4,)),
                          "reference", rms_form=RmsForm())


def _zero_mean(rows: int, width: int, dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    return (x - x.mean(-1, keepdim=True)).to(dtype)


def _layer_norm64(x, weight, bias, eps):
    x = x.double()
    y = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    return y * weight.double() + (bias.double() if bias is not None else 0)


@pytest.mark.parametrize("form", [RmsForm(), RmsForm(weight=True, bias=False), RmsForm(weight=False, bias=True)])
def test_layernorm_as_rms_keeps_float64_exact(form):
    """float64 stays float64 on the RMS path (the bias branch used to drop to fp32): equal to the
    LayerNorm's float64 value on zero-mean input to ~1e-12."""
    orig = _randomise(nn.LayerNorm(32, 1e-5)).double()
    with torch.no_grad():  # what convert leaves where it folded: ones / zeros
        if not form.weight:
            orig.weight.fill_(1.0)
        if not form.bias:
            orig.bias.zero_()
    rep = build_replacement(orig, NormSpec("layer", 1e-5, "eps", has_bias=True, shape=(32,)), "reference",
                            rms_form=form)
    x = _zero_mean(16, 32, torch.float64)
    with torch.no_grad():
        y = rep(x)
    assert y.dtype == torch.float64
    assert (y - _layer_norm64(x, orig.weight, orig.bias, 1e-5)).abs().max().item() <= 1e-12


def test_weightless_rms_form_skips_the_folded_gain_and_bias():
    """RmsForm(weight=False, bias=False) must not read the weight/bias at all: with a weight
    that is not ones it gives the bare RMS-normalised value (so the flag is really honoured)."""
    orig = _randomise(nn.LayerNorm(32, 1e-5)).double()
    spec = NormSpec("layer", 1e-5, "eps", has_bias=True, shape=(32,))
    bare = build_replacement(orig, spec, "reference", rms_form=RmsForm(weight=False, bias=False))
    full = build_replacement(orig, spec, "reference", rms_form=RmsForm())
    x = _zero_mean(8, 32, torch.float64)
    with torch.no_grad():
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        assert (bare(x) - expected).abs().max().item() <= 1e-12
        assert (full(x) - bare(x)).abs().max().item() > 0.1
    assert "rms_form=RMS" in repr(bare) and "rms_form=RMS·γ+β" in repr(full)


def test_patch_refuses_a_weightless_form_when_the_weight_is_not_ones():
    """The manifest says γ was folded (weight ones); a checkpoint fine-tuned afterwards is not
    silently run without its gains, also with verify=False (normswap.load's default)."""
    from normswap.errors import NormswapError
    from normswap.swap import patch

    model = nn.Sequential(_randomise(nn.LayerNorm(32, 1e-5)))
    with pytest.raises(NormswapError, match="should be all 1"):
        patch(model, "reference", rms_forms={"0": RmsForm(weight=False, bias=True)}, verify=False)
    assert type(model[0]) is nn.LayerNorm
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    patch(model, "reference", rms_forms={"0": {"weight": False, "bias": True}}, verify=False)
    assert model[0].rms_form == RmsForm(weight=False, bias=True)
