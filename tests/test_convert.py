"""Exact LayerNorm → RMSNorm on tiny random models of every supported architecture: logits match
the original in float64 and float32, as stock LayerNorms and as RMSNorms (the speedup path), the
output reloads in stock transformers, and unsupported models are refused with a reason per norm."""

import math
from contextlib import contextmanager

import pytest
import torch
import transformers

from normswap.convert import convert_model
from normswap.errors import NormswapError
from normswap.manifest import rms_forms
from normswap.modules import RmsForm
from normswap.plan import build_manifest, plan_conversion
from tests.tiny_models import ARCHS, VOCAB, randomize_norms_and_biases, tiny_model

ARCHS_CONVERTED = ["gpt2", "opt", "gpt_neox", "phi", "falcon", "falcon_new", "bloom"]


def probe(seed=1, batch=2, length=16):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def rel_err(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


@contextmanager
def running_as_rms(model, manifest, keep_gain_and_bias=False):
    """Inside the block the converted norms run as RMS norms (the reference backend, unverified:
    the caller compares logits); after it, as before. keep_gain_and_bias: apply each norm's γ and β
    whatever the manifest says was folded."""
    from normswap.swap import PatchConfig, patch, revert

    forms = rms_forms(manifest)
    if keep_gain_and_bias:
        forms = {p: RmsForm() for p in forms}
    patch(model, PatchConfig("reference", paths=tuple(forms), rms_forms=forms), verify=False)
    try:
        yield
    finally:
        revert(model)


def convert_and_measure(model):
    """Convert `model` in place. Returns (manifest, err, err_rms): the max-logit relative error
    against the unconverted model, with the norms run as LayerNorms and as RMSNorms."""
    ids = probe()
    ref = logits(model, ids)
    manifest = convert_model(model)
    err = rel_err(logits(model, ids), ref)
    with running_as_rms(model, manifest):
        err_rms = rel_err(logits(model, ids), ref)
    return manifest, err, err_rms


def custom_model(arch, dtype=torch.float64, **overrides):
    cfg_name, model_name, kwargs = ARCHS[arch]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**dict(kwargs, **overrides)))
    randomize_norms_and_biases(model, 0)
    return model.to(dtype).eval()


@pytest.mark.parametrize("arch", ARCHS_CONVERTED)
def test_float64_conversion_is_exact_as_layernorm_and_as_rmsnorm(arch):
    model = tiny_model(arch, dtype=torch.float64)
    manifest, err, err_rms = convert_and_measure(model)
    assert manifest["summary"]["refused"] == 0
    print(f"\n[max-logit-error] {arch} fp64 layernorm={err:.3e} rms={err_rms:.3e}")
    assert err <= 1e-10
    assert err_rms <= 1e-10
    # The conversion did something: folded norms now hold ones / zeros.
    for n in manifest["norms"]:
        mod = model.get_submodule(n["path"])
        if n["folded_gain"]:
            assert torch.equal(mod.weight, torch.ones_like(mod.weight))
        if n["folded_bias"]:
            assert torch.equal(mod.bias, torch.zeros_like(mod.bias))


@pytest.mark.parametrize("arch", ARCHS_CONVERTED)
def test_float32_conversion_is_within_rounding(arch):
    model = tiny_model(arch, dtype=torch.float32)
    _, err, err_rms = convert_and_measure(model)
    print(f"\n[max-logit-error] {arch} fp32 layernorm={err:.3e} rms={err_rms:.3e}")
    assert err <= 1e-5
    assert err_rms <= 1e-5


def test_rms_check_can_fail_on_an_unconverted_model():
    """Negative control: RMSNorm in place of LayerNorm is wrong unless the stream was centered
    (γ and β applied: only the mean differs)."""
    model = tiny_model("gpt2", dtype=torch.float64)
    ids = probe()
    ref = logits(model, ids)
    manifest = build_manifest(plan_conversion(model, model.config), model.config)
    with running_as_rms(model, manifest, keep_gain_and_bias=True):
        assert rel_err(logits(model, ids), ref) > 1e-3


@pytest.mark.parametrize("arch", ["gpt2", "opt", "bloom", "falcon", "gpt_neox"])
def test_stock_reload_gives_the_same_logits_and_stays_untied(arch, tmp_path):
    model = tiny_model(arch, dtype=torch.float32)
    ids = probe()
    ref = logits(model, ids)
    was_tied = model.config.tie_word_embeddings
    manifest = convert_model(model)
    converted = logits(model, ids)
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert torch.equal(logits(reloaded, ids), converted)
    assert rel_err(logits(reloaded, ids), ref) <= 1e-5
    head, table = reloaded.get_output_embeddings().weight, reloaded.get_input_embeddings().weight
    assert head is not table
    if was_tied:
        assert manifest["untied"] is not None
        assert reloaded.config.tie_word_embeddings is False
        assert not torch.equal(head, table)  # the table was centered, the head was not


def test_keep_gain_folds_only_beta():
    model = tiny_model("opt", dtype=torch.float64)
    gains = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    ids = probe()
    ref = logits(model, ids)
    manifest = convert_model(model, keep_gain=True)
    assert rel_err(logits(model, ids), ref) <= 1e-10
    for n in manifest["norms"]:
        assert not n["folded_gain"] and n["kept_gain"] and n["kept_gain_why"] == "keep_gain=True"
        assert torch.equal(model.get_submodule(n["path"]).weight, gains[n["path"]])
    assert all(f.weight for f in rms_forms(manifest).values())


def test_zero_gains_are_fine():
    model = tiny_model("gpt2", dtype=torch.float64)
    with torch.no_grad():
        model.transformer.h[0].ln_1.weight[[0, 5, 9]] = 0.0
        model.transformer.h[1].ln_2.weight[2] = 0.0
    ids = probe()
    ref = logits(model, ids)
    convert_model(model)
    assert rel_err(logits(model, ids), ref) <= 1e-10


def test_final_norm_before_bias_free_head_keeps_gain_and_beta():
    model = tiny_model("gpt2", dtype=torch.float64)
    gamma, beta = model.transformer.ln_f.weight.clone(), model.transformer.ln_f.bias.clone()
    manifest = convert_model(model)
    final = next(n for n in manifest["norms"] if n["path"] == "transformer.ln_f")
    assert final["rms"] and final["kept_bias"] and final["kept_gain"]
    assert "lm_head" in final["kept_bias_why"] and "no bias" in final["kept_bias_why"]
    assert "never divides by γ" in final["kept_gain_why"]
    assert torch.equal(model.transformer.ln_f.weight, gamma) and torch.equal(model.transformer.ln_f.bias, beta)
    # Phi's head has a bias: there the final β folds too.
    phi = convert_model(tiny_model("phi", dtype=torch.float64))
    final = next(n for n in phi["norms"] if n["path"] == "model.final_layernorm")
    assert final["folded_gain"] and final["folded_bias"] and not final["kept_bias"]
    assert rms_forms(phi)["model.final_layernorm"] == RmsForm(weight=False, bias=False)


def test_bias_free_readers_keep_beta_in_the_norm():
    """Falcon-7B style (bias=False): no reader can take Wβ, so every norm keeps γ and β."""
    model = custom_model("falcon", bias=False)
    ids = probe()
    ref = logits(model, ids)
    manifest = convert_model(model)
    assert rel_err(logits(model, ids), ref) <= 1e-10
    for n in manifest["norms"]:
        assert n["rms"] and n["kept_bias"] and not n["folded_bias"] and not n["folded_gain"]
    with running_as_rms(model, manifest):
        assert rel_err(logits(model, ids), ref) <= 1e-10


@pytest.mark.parametrize("arch,overrides", [
    ("falcon", dict(parallel_attn=False)),  # sequential: input_layernorm, post_attention_layernorm
    ("falcon_new", dict(num_ln_in_parallel_attn=1)),  # new decoder, one shared norm
    ("gpt_neox", dict(use_parallel_residual=False)),  # sequential NeoX
    ("gpt_neox", dict(attention_bias=False)),  # bias-free qkv: input norms keep β
])
def test_other_layouts(arch, overrides):
    model = custom_model(arch, **overrides)
    ids = probe()
    ref = logits(model, ids)
    manifest = convert_model(model)
    assert manifest["summary"]["refused"] == 0
    with running_as_rms(model, manifest):
        assert rel_err(logits(model, ids), ref) <= 1e-10


def test_bloom_embedding_norm_is_baked_stock_loadably(tmp_path):
    model = tiny_model("bloom", dtype=torch.float64)
    manifest = convert_model(model)
    emb = next(n for n in manifest["norms"] if n["path"] == "transformer.word_embeddings_layernorm")
    assert emb["baked"] and emb["rms"] and emb["zero_mean_input"] and emb["bake_scale"] >= 1.0
    ln = model.transformer.word_embeddings_layernorm
    assert torch.equal(ln.weight, torch.full_like(ln.weight, emb["bake_scale"]))
    assert torch.equal(ln.bias, torch.zeros_like(ln.bias))
    rows = model.transformer.word_embeddings.weight
    assert rows.mean(-1).abs().max() < 1e-12  # the embedding norm's input is zero-mean too


def test_partial_conversion_of_phi_with_qk_norms():
    model = custom_model("phi", qk_layernorm=True)
    with pytest.raises(NormswapError, match="pass partial=True to convert the other"):  # its parameter
        convert_model(model)
    ids = probe()
    ref = logits(model, ids)
    manifest = convert_model(model, partial=True)
    refused = {n["path"]: n["why_not"] for n in manifest["norms"] if not n["rms"]}
    assert set(refused) == {f"model.layers.{i}.self_attn.{q}_layernorm" for i in (0, 1) for q in "qk"}
    assert all("q/k norm" in why for why in refused.values())
    assert rel_err(logits(model, ids), ref) <= 1e-10
    with running_as_rms(model, manifest):
        assert rel_err(logits(model, ids), ref) <= 1e-10


def test_bert_is_refused_norm_by_norm():
    model = tiny_model("bert")
    plan = plan_conversion(model, model.config)
    assert not plan.converted and len(plan.refused) == 5
    assert all("post-LN" in n.why_not or "embedding LayerNorm" in n.why_not for n in plan.refused)
    with pytest.raises(NormswapError, match="nothing converts"):
        convert_model(model, partial=True)


def test_post_ln_opt_is_refused():
    model = custom_model("opt", dtype=torch.float32, do_layer_norm_before=False)
    plan = plan_conversion(model, model.config)
    assert not plan.converted
    assert all("do_layer_norm_before" in n.why_not for n in plan.refused)


@pytest.mark.parametrize("arch,overrides,reason", [
    # the norm's output is the residual stream: without this refusal the conversion changes the
    # logits by ~70% of their scale and the zero-mean check does not notice
    ("bloom", dict(apply_residual_connection_post_layernorm=True), "apply_residual_connection_post_layernorm"),
    ("opt", dict(word_embed_proj_dim=16), "project_in/project_out"),  # opt-350m's projections
])
def test_layouts_the_data_refuses_whole(arch, overrides, reason):
    model = custom_model(arch, dtype=torch.float32, **overrides)
    plan = plan_conversion(model, model.config)
    assert not plan.converted and not plan.jobs
    assert all(reason in n.why_not for n in plan.refused)


def test_opt_without_final_norm_is_refused():
    """_remove_final_layer_norm: lm_head reads the stream itself, so centering it would change the
    logits (by 18% of their scale on this model): refused whole, nothing is changed."""
    model = custom_model("opt", dtype=torch.float64, _remove_final_layer_norm=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_conversion(model, model.config)
    assert not plan.converted and not plan.jobs
    assert all("lm_head reads the residual stream without" in n.why_not for n in plan.refused)
    with pytest.raises(NormswapError, match="nothing converts"):
        convert_model(model, partial=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_llama_has_nothing_to_convert():
    model = tiny_model("llama")
    with pytest.raises(NormswapError, match="nothing to convert: this llama model has no LayerNorm"):
        plan_conversion(model, model.config)


def test_a_model_type_without_a_file_is_discovered():
    """No normswap/archs file for the model_type: the layout comes from the model's forward."""
    model = tiny_model("gpt2", dtype=torch.float64)
    model.config.model_type = "made_up_lm"
    plan = plan_conversion(model, model.config)
    assert plan.arch_file is None and len(plan.converted) == 5 and plan.jobs
    ids = probe()
    ref = logits(model, ids)
    convert_model(model)
    assert rel_err(logits(model, ids), ref) <= 1e-12


def test_rms_forms_reads_the_manifest_file(tmp_path):
    import json

    model = tiny_model("gpt2")
    manifest = convert_model(model)
    from normswap.manifest import new_manifest, write_manifest

    write_manifest(tmp_path, new_manifest(convert=json.loads(json.dumps(manifest))))
    assert set(rms_forms(tmp_path)) == {n["path"] for n in manifest["norms"]} == set(rms_forms(manifest))
    assert rms_forms(tmp_path)["transformer.ln_f"] == RmsForm(weight=True, bias=True)
    assert rms_forms(tmp_path)["transformer.h.0.ln_1"] == RmsForm(weight=False, bias=False)


# ---------------------------------------------------------------------------------------------
# A trained model: perplexity unchanged to 4 significant digits
# ---------------------------------------------------------------------------------------------

TRAIN_TEXT = (
    "The river ran quiet under the old stone bridge, and the miller counted his sacks by lamplight. "
    "Every morning the baker walked to the mill, bought two sacks of flour, and carried them home. "
    "In spring the water rose, the wheel turned faster, and the village ate bread that was still warm. "
    "In winter the river froze, the wheel stood still, and the miller mended nets beside the fire. "
    "Children ran across the bridge to school, and the teacher rang a bell at eight each morning. "
) * 3
HELD_OUT_TEXT = (
    "In autumn the baker walked to the bridge, and the miller rang the bell beside the quiet river. "
    "The children counted the sacks by the fire, and the water ran under the old wheel."
)


def encode(text):
    return torch.tensor([[3 + (ord(c) - 32) for c in text if 32 <= ord(c) < 32 + VOCAB - 3]])


def perplexity(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids).logits[:, :-1].double()
    nll = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))
    return math.exp(float(nll))


@pytest.mark.slow
def test_trained_gpt2_perplexity_unchanged():
    torch.manual_seed(0)
    model = tiny_model("gpt2", dtype=torch.float32).train()
    data = encode(TRAIN_TEXT)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        starts = torch.randint(0, len(data) - 33, (4,), generator=g)
        batch = torch.stack([data[s:s + 33] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    held = encode(HELD_OUT_TEXT)[:, :64]
    before = perplexity(model, held)
    assert before < 20  # it learned something (uniform over the vocabulary would be ~96)
    manifest = convert_model(model)
    after = perplexity(model, held)
    with running_as_rms(model, manifest):
        after_rms = perplexity(model, held)
    print(f"\n[trained-gpt2] ppl before={before:.6f} after={after:.6f} as-rms={after_rms:.6f}")
    assert f"{before:.4g}" == f"{after:.4g}" == f"{after_rms:.4g}"
    assert abs(after - before) / before < 1e-5


# ---------------------------------------------------------------------------------------------
# The speedup path through `normswap patch`: RMS kernels on the converted model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS_CONVERTED)
def test_patched_converted_model_matches_the_original(arch):
    from normswap.swap import patch

    model = tiny_model(arch, dtype=torch.float32)
    ids = probe()
    ref = logits(model, ids)
    manifest = convert_model(model)
    forms = rms_forms(manifest)  # weightless where γ was folded, β only where kept
    report = patch(model, "torch", rms_forms=forms)  # each module proved vs the LayerNorm's float64 value
    assert {e.path: e.rms_form for e in report.modules if e.rms_form and e.status == "patched"} == forms
    assert set(forms) == {n["path"] for n in manifest["norms"] if n["rms"]}
    err = rel_err(logits(model, ids), ref)
    print(f"\n[max-logit-error] {arch} fp32 patched-rms(torch)={err:.3e}")
    assert err <= 1e-5


@pytest.mark.parametrize("arch", ["gpt2", "phi", "bloom"])
def test_patched_converted_float64_is_exact(arch):
    """float64 through the RMS path stays float64 (reference impl): as exact as the conversion."""
    from normswap.swap import patch

    model = tiny_model(arch, dtype=torch.float64)
    ids = probe()
    ref = logits(model, ids)
    patch(model, "reference", rms_forms=rms_forms(convert_model(model)))
    assert rel_err(logits(model, ids), ref) <= 1e-12


@pytest.mark.slow
def test_patched_converted_with_triton_kernels():
    from normswap.swap import patch

    model = tiny_model("gpt2", dtype=torch.float32)
    ids = probe()
    ref = logits(model, ids)
    patch(model, "triton", rms_forms=rms_forms(convert_model(model)))
    assert rel_err(logits(model, ids), ref) <= 1e-5


def test_patch_refuses_rms_on_an_unconverted_model():
    """Negative control: without the conversion, running the LayerNorms as RMS norms is wrong,
    and patch's own verification says so."""
    from normswap.swap import patch

    model = tiny_model("gpt2", dtype=torch.float32)
    manifest = build_manifest(plan_conversion(model, model.config), model.config)
    # Forms that apply both γ and β: only the proof (here the whole-model check: the per-module
    # probes are zero-mean by design) can tell the stream is not centered.
    from normswap.swap import VerificationError

    with pytest.raises(VerificationError):
        patch(model, "torch", rms_forms={p: RmsForm() for p in rms_forms(manifest)})


def test_gpt2_with_cross_attention_is_refused_whole():
    """An undescribed writer would leave the stream uncentered: the whole layout is refused."""
    model = custom_model("gpt2", dtype=torch.float32, add_cross_attention=True)
    plan = plan_conversion(model, model.config)
    assert not plan.converted and not plan.jobs
    assert all("add_cross_attention" in n.why_not for n in plan.refused)


def test_zero_mean_check_is_recorded_and_catches_a_missed_writer(monkeypatch):
    from normswap import fold

    manifest = convert_model(tiny_model("opt", dtype=torch.float64))
    zm = manifest["zero_mean_check"]
    assert zm["passed"] and zm["max_mean_over_rms"] <= 1e-9
    # A writer left uncentered (as if the data forgot it): the check must say so.
    real = fold.center_writer
    monkeypatch.setattr(fold, "center_writer", lambda w, b, o: (w.clone(), None if b is None else b.clone()))
    with pytest.raises(NormswapError, match="not zero-mean"):
        convert_model(tiny_model("opt", dtype=torch.float64))
    monkeypatch.setattr(fold, "center_writer", real)


def test_rms_forms_of_a_directory(tmp_path):
    """What `normswap patch` / `normswap.load` read: the convert section's norms and RMS forms;
    nothing for a directory without a manifest or with a patch section only."""
    import json

    from normswap.manifest import new_manifest, write_manifest

    assert rms_forms(tmp_path) == {}
    write_manifest(tmp_path, new_manifest(patch={"impl": "torch", "modules": []}))
    assert rms_forms(tmp_path) == {}
    manifest = convert_model(tiny_model("phi"))
    write_manifest(tmp_path, new_manifest(convert=json.loads(json.dumps(manifest))))
    forms = rms_forms(tmp_path)
    assert set(forms) == set(rms_forms(manifest)) and len(forms) == 3
    # phi: the final norm's β folds into lm_head's bias, γ too: nothing left to multiply or add
    assert forms["model.final_layernorm"] == RmsForm(weight=False, bias=False)
    (tmp_path / "normswap.json").write_text(json.dumps(manifest))  # a bare section is not a manifest
    with pytest.raises(NormswapError, match="not a normswap manifest"):
        rms_forms(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt2", "bloom", "phi"])
def test_patched_converted_on_cuda_with_triton(arch):
    """The speedup path on a GPU: converted model, RMS-eligible norms as Triton RMSNorm kernels."""
    from normswap.swap import patch

    model = tiny_model(arch, dtype=torch.float32).cuda()
    ids = probe().cuda()
    ref = logits(model, ids)
    manifest = convert_model(model)
    patch(model, "triton", rms_forms=rms_forms(manifest))
    assert rel_err(logits(model, ids), ref) <= 1e-5
