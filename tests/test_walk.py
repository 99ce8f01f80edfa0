"""find_norms against what each tiny model really contains; get/set_submodule; unknown norms."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from tiny_models import ARCHS, tiny_config, tiny_model
from torch import nn

from normswap.errors import NormswapError, UnknownNormError
from normswap.walk import FoundNorm, UnknownNormWarning, find_norms, get_submodule, set_submodule

L = ARCHS["llama"][2]["num_hidden_layers"]


def _expected_norms(model: nn.Module) -> Counter:
    """Ground truth independent of the registry: modules whose class is a torch LayerNorm or
    whose class name ends in RMSNorm / LayerNorm."""
    return Counter(
        type(m).__name__ for _, m in model.named_modules()
        if isinstance(m, nn.LayerNorm) or type(m).__name__.endswith(("RMSNorm", "LayerNorm"))
    )


# Counts per architecture, worked out from the modeling code: per layer, plus final/embedding norms.
EXPECTED_COUNTS = {
    "llama": 2 * L + 1, "mistral": 2 * L + 1, "qwen2": 2 * L + 1, "phi3": 2 * L + 1,
    "qwen3": 4 * L + 1,  # + q_norm, k_norm per layer
    "gemma": 2 * L + 1,
    "gemma2": 4 * L + 1,  # sandwich: pre/post attention and pre/post feed-forward
    "gemma3_text": 6 * L + 1,  # sandwich + q_norm, k_norm
    "t5": 2 * L + 3 * L + 2,  # encoder 2/layer, decoder 3/layer, two final norms
    "gpt2": 2 * L + 1, "opt": 2 * L + 1, "gpt_neox": 2 * L + 1,
    "bloom": 2 * L + 2,  # + the embedding LayerNorm
    "falcon": L + 1,  # parallel attention, one norm per layer
    "falcon_new": 2 * L + 1,  # new architecture: ln_attn and ln_mlp
    "phi": L + 1,
    "bert": 2 * L + 1,  # post-LN: attention output and layer output, plus embeddings
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_find_norms_matches_the_model(arch):
    model = tiny_model(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownNormWarning)
        found = find_norms(model)
    assert Counter(f.module_class for f in found) == _expected_norms(model)
    assert len(found) == EXPECTED_COUNTS[arch]
    assert all(f.spec is not None and f.unknown_reason is None for f in found)
    for f in found:
        m = get_submodule(model, f.path)
        assert type(m).__name__ == f.module_class
        w = getattr(m, f.spec.weight_attr, None)
        assert f.spec.shape == tuple(w.shape if isinstance(w, torch.Tensor) else f.spec.shape)


def _config_eps(arch: str) -> float:
    cfg = tiny_config(arch)
    for name in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        if hasattr(cfg, name):
            return getattr(cfg, name)
    raise AssertionError(f"{arch}: no eps in config")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma2", "t5", "gpt2", "bert", "falcon"])
def test_eps_comes_from_the_config(arch):
    found = find_norms(tiny_model(arch))
    assert {f.spec.eps for f in found} == {_config_eps(arch)}


@pytest.mark.parametrize("arch, head_dim", [("qwen3", 16), ("gemma3_text", 8)])
def test_qk_norms_are_found_with_head_shape(arch, head_dim):
    found = find_norms(tiny_model(arch))
    qk = [f for f in found if f.path.endswith((".q_norm", ".k_norm"))]
    assert len(qk) == 2 * L
    assert all(f.spec.shape == (head_dim,) for f in qk)
    assert {f.path for f in qk} >= {"model.layers.0.self_attn.q_norm", "model.layers.1.self_attn.k_norm"}


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_offsets(arch):
    assert {(f.spec.offset, f.spec.casting) for f in find_norms(tiny_model(arch))} == {(1.0, "gemma")}


def test_t5_casting_and_dtype():
    found = find_norms(tiny_model("t5", dtype=torch.bfloat16))
    assert {(f.spec.casting, f.spec.dtype) for f in found} == {("t5", "bfloat16")}


def test_meta_model_gives_the_same_specs():
    import transformers

    real = find_norms(tiny_model("qwen3"))
    with torch.device("meta"):
        meta_model = transformers.Qwen3ForCausalLM(tiny_config("qwen3"))
    assert find_norms(meta_model) == real


class OddNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x, cond):
        return x * cond


def _with_odd_norm():
    return nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.LayerNorm(8), OddNorm()]))


def test_unknown_norm_warns_with_path_and_class():
    with pytest.warns(UnknownNormWarning, match=r"1\.1 \(OddNorm\)"):
        found = find_norms(_with_odd_norm())
    assert [f.path for f in found] == ["1.0", "1.1"]
    assert found[1].spec is None and found[1].unknown_reason


def test_unknown_norm_is_an_error_when_strict():
    with pytest.raises(UnknownNormError, match=r"1\.1 \(OddNorm\)"):
        find_norms(_with_odd_norm(), strict=True)
    assert issubclass(UnknownNormError, NormswapError)


def test_set_submodule_replaces_in_parent_including_module_list():
    model = tiny_model("llama")
    new = nn.RMSNorm(32)
    old = set_submodule(model, "model.layers.1.input_layernorm", new)
    assert type(old).__name__ == "LlamaRMSNorm"
    assert model.model.layers[1].input_layernorm is new
    seq = _with_odd_norm()
    ln = nn.LayerNorm(8)
    set_submodule(seq, "1.0", ln)
    assert seq[1][0] is ln and get_submodule(seq, "1.0") is ln
    assert isinstance(get_submodule(seq, ""), nn.Sequential)
    with pytest.raises(NormswapError):
        get_submodule(seq, "1.7")
    with pytest.raises(NormswapError):
        set_submodule(seq, "2.0", ln)
    with pytest.raises(NormswapError):
        set_submodule(seq, "", ln)


def test_found_norm_is_frozen():
    f = FoundNorm("a", "LayerNorm", None, "why")
    with pytest.raises(AttributeError):
        f.path = "b"
