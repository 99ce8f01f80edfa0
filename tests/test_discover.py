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


class _Chunked(torch.nn.Module):
    """A pre-LN toy: an embedding is the stream, one LayerNorm reads it, and its output is cut by
    position (torch.chunk, as ProphetNet cuts its stream) into two pieces read by two Linears.
    dim=-1 cuts across the hidden dimension instead; stray=True also reads a piece of the stream
    itself, with no norm in front."""

    def __init__(self, dim: int = 1, stray: bool = False, hidden: int = 8):
        super().__init__()
        self.dim, self.stray = dim, stray
        self.emb = torch.nn.Embedding(16, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        width = hidden if dim != -1 else hidden // 2
        self.a, self.b = torch.nn.Linear(width, 5), torch.nn.Linear(width, 5)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        first, second = self.norm(x).chunk(2, dim=self.dim)
        out = torch.cat([self.a(first), self.b(second)], dim=self.dim)
        if self.stray:
            return out, x.chunk(2, dim=1)[1].sum(-1)
        return out


def _toy_plan(model):
    from types import SimpleNamespace

    return plan_conversion(model, SimpleNamespace(model_type="normswap-toy"), arch_data=False)


def test_a_norm_output_cut_by_position_folds_into_every_piece_exactly():
    """Pieces of a norm's output cut across positions are rows of it: the Linears reading them are
    its readers, so γ and β fold into both (the walk stopped at the split before, refusing the norm
    as a nonlinear reader) and the converted model computes what it did, its norm's input zero-mean."""
    from normswap.convert import apply_plan
    from tests.tiny_models import randomize_norms_and_biases

    torch.manual_seed(0)
    model = randomize_norms_and_biases(_Chunked().double(), 0).eval()
    (d,) = _toy_plan(model).norms
    assert (d.rms, d.category, d.readers) == (True, None, ["a", "b"]), (d.category, d.why_not)
    ids = torch.randint(0, 16, (3, 6))
    before = model(ids)
    seen = {}
    model.norm.register_forward_pre_hook(lambda _m, args: seen.update(x=args[0]))
    apply_plan(model, _toy_plan(model))
    after = model(ids)
    assert torch.allclose(after, before, rtol=0, atol=1e-12), (after - before).abs().max()
    assert seen["x"].mean(-1).abs().max() < 1e-12 * seen["x"].abs().max()
    x = seen["x"]  # and the norm now is an RMSNorm of that input: γ and β live in the readers
    assert torch.allclose(model.norm(x), x / (x.pow(2).mean(-1, keepdim=True) + model.norm.eps).sqrt(),
                          rtol=0, atol=1e-12)


def test_a_cut_across_the_hidden_dimension_or_a_stray_piece_still_refuses():
    """A piece of the hidden dimension is not rows (γ/β cannot fold into half a reader's inputs),
    and a piece of the stream read without a norm is still a stray reader of that stream."""
    (d,) = _toy_plan(_Chunked(dim=-1)).norms
    assert d.category == "nonlinear-reader" and "split" in d.why_not, (d.category, d.why_not)
    (d,) = _toy_plan(_Chunked(stray=True)).norms
    assert d.category == "stray-reader" and "sum" in d.why_not, (d.category, d.why_not)


def test_module_order_is_walked_once_per_analysis():
    """readers_of runs once per norm (scan's norm_readers) and discover sorts by module order in
    several places: each used to rebuild the path -> index mapping by walking every module, which
    is quadratic on a deep model. The walk is made once, however many norms are asked about."""
    from normswap.discover import _Analysis, layer_norm_paths, trace

    class Walks(dict):
        walks = 0

        def __iter__(self):
            Walks.walks += 1
            return super().__iter__()

    model = meta_model("gpt2", n_layer=4)
    tr = trace(model)
    analysis = _Analysis(model, Walks(model.named_modules()), tr)
    after_init = Walks.walks
    norms = layer_norm_paths(model)
    assert len(norms) == 9
    readers = {p: analysis.readers_of(p) for p in norms}
    assert readers["transformer.ln_f"] == ["lm_head"]
    analysis.run()
    assert after_init == 1 and Walks.walks == after_init
