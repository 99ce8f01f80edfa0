"""The speedup path end to end: `normswap convert --to rms` then `normswap patch --impl triton`
(interpreter on CPU). The result is a stock checkpoint with the original logits, one normswap.json
recording both steps, and normswap.load runs the converted LayerNorms as RMS norms (weightless
where γ was folded) with the original logits."""

import copy
import json
import shutil

import pytest
import torch
import transformers
from click.testing import CliRunner

import normswap
from normswap.cli import cli
from normswap.manifest import read_manifest
from normswap.modules import NormswapLayerNorm, RmsForm
from tests.tiny_models import VOCAB, save_tiny

IDS = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))


def run(*args):
    return CliRunner().invoke(cli, [*map(str, args)], catch_exceptions=False)


def logits(model):
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def stock_logits(directory):
    return logits(transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32))


def rel_err(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


def expected_forms(convert_section):
    """The RMS form each converted norm must run with, from what convert says it folded."""
    return {n["path"]: RmsForm(weight=not n["folded_gain"] and n["kept_gain"] or n["baked"],
                               bias=n["kept_bias"])
            for n in convert_section["norms"] if n["rms"]}


# gpt2: Conv1D, tied head, final β kept; opt: learned positions with an offset; gpt_neox: a
# parallel block (attention and MLP read two norms of the same stream).
@pytest.mark.parametrize("arch", ["gpt2", "opt", "gpt_neox"])
def test_convert_then_patch_triton(arch, tmp_path):
    src, conv, out = tmp_path / "src", tmp_path / "conv", tmp_path / "patched"
    save_tiny(arch, src)
    ref = stock_logits(src)

    r = run("convert", src, "--to", "rms", "--out", conv, "--json")
    assert r.exit_code == 0, r.output
    convert_section = read_manifest(conv)["convert"]
    forms = expected_forms(convert_section)
    assert forms and len(forms) == len(convert_section["norms"])  # every norm of these archs converts
    assert any(not f.weight and not f.bias for f in forms.values())  # some run with nothing to apply

    r = run("patch", conv, "--impl", "triton", "--out", out)
    assert r.exit_code == 0, r.output
    # the human report names each converted norm and says it runs as an RMS norm
    for path in forms:
        line = next(ln for ln in r.stdout.splitlines() if path + " " in ln)
        assert "as RMS" in line and "pass" in line, line

    # one manifest, both steps
    manifest = read_manifest(out)
    assert manifest["format"] == "normswap/2"
    assert manifest["convert"] == convert_section
    p = manifest["patch"]
    assert p["impl"] == "triton" and p["verified"] and p["model_check"]["passed"]
    recorded = {path: RmsForm.coerce(f) for path, f in p["rms_forms"].items()}
    assert recorded == forms

    # stock transformers: the original model's logits
    assert rel_err(stock_logits(out), ref) <= 1e-5

    # normswap.load: the converted norms run as RMS norms, in the recorded form, same logits
    model = normswap.load(out)
    kinds = {path: (type(mod), mod.impl, mod.rms_form) for path, mod in model.named_modules()
             if isinstance(mod, NormswapLayerNorm)}
    assert kinds == {path: (NormswapLayerNorm, "triton", form) for path, form in forms.items()}
    err = rel_err(logits(model), ref)
    print(f"\n[convert->patch] {arch} triton-interpreter max rel logit error {err:.3e}")
    assert err <= 1e-5


def test_patch_json_reports_rms_forms_and_load_of_a_converted_only_checkpoint(tmp_path):
    """`patch --json` says, per module, whether and how it runs as RMS; normswap.load of a
    directory that was only converted runs its zero-mean LayerNorms as RMS norms."""
    src, conv = tmp_path / "src", tmp_path / "conv"
    save_tiny("gpt2", src)
    ref = stock_logits(src)
    assert run("convert", src, "--to", "rms", "--out", conv).exit_code == 0
    r = run("patch", conv, "--impl", "torch", "--json")
    assert r.exit_code == 0, r.output
    mods = {m["path"]: m for m in json.loads(r.stdout)["modules"]}
    assert mods["transformer.ln_f"]["runs_as"] == "RMS·γ+β"  # β kept: lm_head has no bias
    assert mods["transformer.h.0.ln_1"]["runs_as"] == "RMS"  # γ and β folded into c_attn
    assert mods["transformer.h.0.ln_1"]["rms_form"] == {"weight": False, "bias": False}

    model = normswap.load(conv)
    forms = {p: m.rms_form for p, m in model.named_modules() if isinstance(m, NormswapLayerNorm)}
    assert forms == expected_forms(read_manifest(conv)["convert"]) and len(forms) == 5
    assert rel_err(logits(model), ref) <= 1e-5


def test_converting_a_patched_checkpoint_drops_the_patch_section(tmp_path):
    """convert reads stock weights; a patch recorded in its input was verified against other
    weights, so the output carries only the new convert section (and says so on stderr)."""
    src, patched, conv = tmp_path / "src", tmp_path / "patched", tmp_path / "conv"
    save_tiny("gpt2", src)
    assert run("patch", src, "--impl", "torch", "--out", patched).exit_code == 0
    r = run("convert", patched, "--to", "rms", "--out", conv)
    assert r.exit_code == 0, r.output
    assert "not carried" in r.stderr
    manifest = read_manifest(conv)
    assert "patch" not in manifest and manifest["convert"]["summary"]["converted"] == 5


def _old_format(manifest: dict, oldest: bool = False) -> dict:
    """`manifest` as the writers before "runs as RMS is held once" wrote it: the convert section
    also spelled each form as rms_weight ('weight'/'none') and rms_bias, and each patched module
    carried its rms_form. The oldest (before PatchConfig) also had as_rms per module, and no
    paths, rms_forms or strict: the per-module forms were the only record of the patch's."""
    old = copy.deepcopy(manifest)
    old["format"] = "normswap/1"
    for n in old["convert"]["norms"]:
        n["rms_weight"] = ("weight" if n["kept_gain"] or n["baked"] else "none") if n["rms"] else None
        n["rms_bias"] = n["kept_bias"] if n["rms"] else None
    p = old.get("patch")
    if p is not None:
        for m in p["modules"]:
            m["rms_form"] = p["rms_forms"].get(m["path"])
            if oldest:
                m["as_rms"] = m["rms_form"] is not None
        if oldest:
            for key in ("paths", "rms_forms", "strict"):
                del p[key]
    return old


def _raw(directory) -> dict:
    return json.loads((directory / "normswap.json").read_text())


def _with_manifest(directory, into, manifest: dict):
    shutil.copytree(directory, into)
    (into / "normswap.json").write_text(json.dumps(manifest, indent=2))
    return into


def _same_model(a, b) -> None:
    def norms(model):
        return {p: (type(m), m.impl, m.rms_form) for p, m in model.named_modules() if isinstance(m, NormswapLayerNorm)}

    assert norms(a) == norms(b) and len(norms(a)) == 5
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(logits(a), logits(b))


def test_runs_as_rms_is_held_once_and_old_manifests_load_the_same(tmp_path):
    """A convert -> patch manifest holds each RMS form once, in the patch section's rms_forms (the
    convert section keeps the facts it follows from: zero-mean input, γ/β kept or baked). Manifests
    in the older shapes, the form also in the convert section and per module, or only per module,
    load as the same model; patching an old converted directory writes the new shape."""
    src, conv, new = tmp_path / "src", tmp_path / "conv", tmp_path / "new"
    save_tiny("gpt2", src)
    ref = stock_logits(src)
    assert run("convert", src, "--to", "rms", "--out", conv).exit_code == 0
    r = run("patch", conv, "--impl", "torch", "--out", new)
    assert r.exit_code == 0, r.output

    written = _raw(new)
    forms = expected_forms(written["convert"])
    assert written["patch"]["rms_forms"] == {p: f.to_dict() for p, f in forms.items()} and len(forms) == 5
    assert not any(k in n for n in written["convert"]["norms"] for k in ("rms_weight", "rms_bias"))
    assert not any(k in m for m in written["patch"]["modules"] for k in ("rms_form", "as_rms"))
    assert _raw(conv)["convert"] == written["convert"]  # carried verbatim

    loaded = normswap.load(new)
    assert rel_err(logits(loaded), ref) <= 1e-5
    config = normswap.PatchConfig.from_dict(read_manifest(new)["patch"])
    for oldest in (False, True):
        old = _with_manifest(new, tmp_path / f"old-{oldest}", _old_format(written, oldest))
        assert ("rms_forms" in _raw(old)["patch"]) is not oldest
        _same_model(normswap.load(old), loaded)
        upgraded = read_manifest(old)
        assert upgraded["convert"] == read_manifest(new)["convert"]
        assert normswap.PatchConfig.from_dict(upgraded["patch"]) == config

    # a converted-only directory in the old shape: the same RMS norms, and a patch of it writes the new shape
    old_conv = _with_manifest(conv, tmp_path / "old-conv", _old_format(_raw(conv)))
    assert "rms_weight" in _raw(old_conv)["convert"]["norms"][0]
    _same_model(normswap.load(old_conv), normswap.load(conv))
    r = run("patch", old_conv, "--impl", "torch", "--out", tmp_path / "from-old")
    assert r.exit_code == 0, r.output
    again = _raw(tmp_path / "from-old")
    assert again["convert"] == written["convert"] and again["patch"]["rms_forms"] == written["patch"]["rms_forms"]
    _same_model(normswap.load(tmp_path / "from-old"), loaded)


def test_a_newer_normswaps_manifest_is_refused_in_one_line_before_any_load(tmp_path, monkeypatch):
    """A manifest of a format newer than this version's (a later normswap's layout) is refused with
    one line naming that, by read_manifest, normswap.load and the commands that read a source's
    manifest (exit 2, nothing written), before any weight is loaded; a format that is no
    normswap's at all is named as such."""
    from normswap import loading
    from normswap.errors import NormswapError

    src = tmp_path / "src"
    save_tiny("gpt2", src)
    (src / "normswap.json").write_text(json.dumps({"format": "normswap/3", "convert": {"norms": [], "layout": 3}}))

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the manifest was refused")
    monkeypatch.setattr(loading, "load_model", no_load)
    newer = (r"normswap\.json: written by a newer normswap \(manifest format 'normswap/3'; normswap \S+ reads up to "
             r"normswap/2\): upgrade normswap to load it$")
    with pytest.raises(NormswapError, match=newer):
        read_manifest(src)
    with pytest.raises(NormswapError, match=newer):
        normswap.load(src)
    for args in (("patch", src, "--impl", "torch", "--out", tmp_path / "out"),
                 ("patch", src, "--impl", "torch", "--no-rms", "--out", tmp_path / "out", "--json"),
                 ("convert", src, "--to", "rms", "--out", tmp_path / "out")):
        r = run(*args)
        assert r.exit_code == 2 and r.stdout == "", (args, r.output)
        assert len(r.stderr.strip().splitlines()) == 1 and "written by a newer normswap" in r.stderr, (args, r.stderr)
        assert not (tmp_path / "out").exists()
    (src / "normswap.json").write_text(json.dumps({"format": "normswap-bench/1", "convert": {"norms": []}}))
    with pytest.raises(NormswapError, match=r"not a normswap manifest \(format 'normswap-bench/1'; normswap \S+ "
                                            r"reads normswap/1 and normswap/2\)$"):
        read_manifest(src)
