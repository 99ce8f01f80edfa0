"""Discovery (normswap.discover: one traced forward on the meta device) against the architecture
files: on every tiny model a file describes, the plan discovered from the forward alone is the
file's plan, norm by norm and job by job. The files are overrides, not requirements."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import transformers

from normswap.discover import REFUSALS, discover
from normswap.plan import plan_conversion
from tests.tiny_models import ARCHS, arch_files

# Every file's tiny models: the default layout of each, and the layouts its config chooses.
FILE_MODELS = [
    ("gpt2", {}), ("opt", {}), ("gpt_neox", {}), ("phi", {}), ("falcon", {}), ("falcon_new", {}), ("bloom", {}),
    ("falcon", dict(parallel_attn=False)),
    ("falcon_new", dict(num_ln_in_parallel_attn=1)),
    ("falcon", dict(bias=False)),
    ("gpt_neox", dict(use_parallel_residual=False)),
    ("gpt_neox", dict(attention_bias=False)),
    ("phi", dict(qk_layernorm=True)),
    ("bert", {}),
    ("opt", dict(do_layer_norm_before=False)),
    ("opt", dict(_remove_final_layer_norm=True)),
    ("bloom", dict(apply_residual_connection_post_layernorm=True)),
]

DECISION_FIELDS = ("path", "readers", "rms", "zero_mean_input", "folded_gain", "folded_bias", "kept_gain",
                   "kept_gain_why", "kept_bias", "kept_bias_why", "baked", "bake_scale", "eps")


def meta_model(arch: str, **overrides):
    cfg_name, model_name, kwargs = ARCHS[arch]
    config = getattr(transformers, cfg_name)(**dict(kwargs, **overrides))
    with torch.device("meta"):
        return getattr(transformers, model_name)(config)


def comparable(plan) -> dict:
    return {
        # readers in any order (module order is the class's attribute order, not the data's)
        "norms": [{k: sorted(getattr(d, k)) if k == "readers" else getattr(d, k) for k in DECISION_FIELDS}
                  for d in plan.norms],
        "jobs": sorted((asdict(j) for j in plan.jobs), key=lambda j: (j["kind"], j["module"], j["outputs"])),
        "embeddings": sorted(plan.embeddings),
        "writers": sorted(plan.writers),
        "untie": plan.untie,
        "aliases": plan.aliases,
        "keep_gain": plan.keep_gain,
    }


def test_every_file_has_tiny_models():
    covered = {getattr(transformers, ARCHS[a][0])().model_type for a, _ in FILE_MODELS}
    assert covered >= set(arch_files())


@pytest.mark.parametrize("arch,overrides", FILE_MODELS, ids=[f"{a}-{'-'.join(o) or 'default'}" for a, o in FILE_MODELS])
def test_discovered_plan_equals_the_file(arch, overrides):
    model = meta_model(arch, **overrides)
    from_file = plan_conversion(model, model.config, arch_data=True)
    discovered = plan_conversion(model, model.config, arch_data=False)
    assert from_file.arch_file is not None and discovered.arch_file is None
    assert comparable(discovered) == comparable(from_file)
    for a, b in zip(from_file.norms, discovered.norms, strict=True):
        assert (a.category is None) == (b.category is None)
        if a.category not in (None, "arch-data"):  # the file's category is what discovery finds
            assert b.category == a.category, (a.path, a.why_not, b.why_not)
    for d in discovered.refused:
        assert d.category in REFUSALS and d.why_not


def test_discovery_names_terms_readers_and_earlier_streams():
    d = discover(meta_model("gpt2"))
    ln2 = d.norms["transformer.h.1.ln_2"]
    assert {(t.kind, t.ref) for t in ln2.terms} == {
        ("embedding", "transformer.wte"), ("embedding", "transformer.wpe"),
        ("writer", "transformer.h.0.attn.c_proj"), ("writer", "transformer.h.0.mlp.c_proj"),
        ("writer", "transformer.h.1.attn.c_proj")}
    assert ln2.earlier == ["transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.1.ln_1"]
    assert ln2.readers == [("transformer.h.1.mlp.c_fc", "conv1d")]
    assert d.untie == ("lm_head", "transformer.wte")


def test_a_real_model_is_discovered_as_its_meta_twin():
    """A parameter added into the stream through a view (GPT-NeoX-Japanese's dense_bias, expanded)
    after an init wrote it in place: on a real model its version is not 0, and a view keyed with
    the version read inside the dispatch mode would not match its users, so the in-memory convert
    refused norms that the checkpoint convert (meta) converts, and never centered the bias."""
    from tests.sweep_models import build
    from tests.tiny_models import randomize_norms_and_biases

    args = ("gpt_neox_japanese", "GPTNeoXJapaneseForCausalLM")
    real = randomize_norms_and_biases(build(*args, device="cpu", dtype=torch.float64), 0)
    bias = "gpt_neox_japanese.layers.1.attention.dense_bias"
    assert real.get_parameter(bias)._version > 0 and real.get_parameter(bias).abs().max() > 0
    meta, got = discover(build(*args)), discover(real)
    assert {p: f.category for p, f in got.norms.items()} == {p: f.category for p, f in meta.norms.items()}
    assert got.params == meta.params == [bias]
    assert all(f.category is None for f in got.norms.values())
