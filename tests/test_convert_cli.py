"""`normswap convert`: end to end through the command line, refusals, and the write safety."""

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

from normswap.cli import cli
from tests.tiny_models import VOCAB, randomize_norms_and_biases, save_tiny


def run(*args):
    return CliRunner().invoke(cli, ["convert", *map(str, args)], catch_exceptions=False)


def logits(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits, model


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    save_tiny("gpt2", d)
    return d


def test_convert_gpt2_json(gpt2_dir, tmp_path):
    out = tmp_path / "conv"
    r = run(gpt2_dir, "--to", "rms", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["verification"]["passed"] and data["verification"]["max_rel_logit_error"] <= 1e-5
    assert data["summary"] == {"norms": 5, "converted": 5, "refused": 0, "folded_gain": 4, "folded_bias": 4,
                               "kept_bias": 1}
    written = json.loads((out / "normswap.json").read_text())
    assert written["format"] == "normswap/2" and "patch" not in written
    assert written["convert"]["norms"] == data["norms"]
    ref, _ = logits(gpt2_dir)
    got, model = logits(out)
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_human_table(gpt2_dir, tmp_path):
    r = run(gpt2_dir, "--to", "rms", "--out", tmp_path / "c")
    assert r.exit_code == 0
    for text in ("folded γ", "kept β (why)", "transformer.ln_f", "lm_head has no bias", "verified"):
        assert text in r.stdout


def test_existing_out_needs_force(gpt2_dir, tmp_path):
    out = tmp_path / "conv"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    (out / "model.safetensors").write_bytes(b"an earlier checkpoint")  # --force replaces only those
    r = run(gpt2_dir, "--to", "rms", "--out", out)
    assert r.exit_code == 2 and "--force" in r.stderr
    assert (out / "keep.txt").read_text() == "user data"
    r = run(gpt2_dir, "--to", "rms", "--out", out, "--force", "--json")
    assert r.exit_code == 0
    assert not (out / "keep.txt").exists() and (out / "normswap.json").is_file()


def test_bert_refused_with_reasons_and_nothing_written(tmp_path):
    save_tiny("bert", tmp_path / "bert")
    r = run(tmp_path / "bert", "--to", "rms", "--out", tmp_path / "out", "--json")
    assert r.exit_code == 2
    assert not (tmp_path / "out").exists()
    data = json.loads(r.stdout)
    assert len(data["norms"]) == 5 and all(not n["rms"] for n in data["norms"])
    assert all("post-LN" in n["why_not"] or "embedding LayerNorm" in n["why_not"] for n in data["norms"])
    assert r.stderr.startswith("normswap: error: nothing converts") and r.stderr.count("\n") == 1
    # --partial cannot help a model where nothing converts.
    r = run(tmp_path / "bert", "--to", "rms", "--out", tmp_path / "out", "--partial")
    assert r.exit_code == 2 and not (tmp_path / "out").exists()


def test_llama_and_made_up_architectures(tmp_path):
    save_tiny("llama", tmp_path / "llama")
    r = run(tmp_path / "llama", "--to", "rms", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "nothing to convert" in r.stderr and "RMS norms already" in r.stderr
    save_tiny("gpt2", tmp_path / "odd")
    cfg = json.loads((tmp_path / "odd" / "config.json").read_text())
    cfg["model_type"] = "made_up_lm"
    (tmp_path / "odd" / "config.json").write_text(json.dumps(cfg))
    r = run(tmp_path / "odd", "--to", "rms", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "made_up_lm" in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


def test_partial_phi_with_qk_norms(tmp_path):
    save_tiny("phi", tmp_path / "phi", qk_layernorm=True)
    r = run(tmp_path / "phi", "--to", "rms", "--out", tmp_path / "o", "--json")
    assert r.exit_code == 2 and "--partial" in r.stderr and not (tmp_path / "o").exists()
    r = run(tmp_path / "phi", "--to", "rms", "--out", tmp_path / "o", "--json", "--partial")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["summary"]["converted"] == 3 and data["summary"]["refused"] == 4
    assert data["verification"]["max_rel_logit_error_rms"] <= 1e-5


def test_failed_verification_writes_nothing(gpt2_dir, tmp_path, monkeypatch):
    """If the writers were not centered, the stock reload would still match (LayerNorm ignores
    the mean) but the RMS path would not: verification must catch it and leave no output."""
    from normswap import fold

    monkeypatch.setattr(fold, "center_embedding", lambda t: t.clone())
    r = run(gpt2_dir, "--to", "rms", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "verification failed" in r.stderr
    assert not (tmp_path / "o").exists()
    assert not list(tmp_path.iterdir())


def test_bad_model_reference(tmp_path):
    r = run(tmp_path / "missing", "--to", "rms", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "no such file" in r.stderr


def test_a_missing_choice_option_lists_its_values_in_plain_words(gpt2_dir, tmp_path):
    """click lays the choices out on lines of their own; the one error line shows them as words,
    not as an escaped "\\n\\t" (which is how a line break in a user's own path is shown)."""
    r = run(gpt2_dir, "--out", tmp_path / "o")
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1  # (the prog name after "see" is CliRunner's)
    assert r.stderr.startswith("normswap: error: Missing option '--to'. Choose from: rms (see ")


def test_force_replaces_through_the_atomic_exchange(gpt2_dir, tmp_path, monkeypatch):
    """convert publishes like patch (checkpoint.staged_dir): an existing --out is swapped with the
    verified result in one renameat2(RENAME_EXCHANGE), never removed first."""
    from normswap import checkpoint

    out = tmp_path / "conv"
    out.mkdir()
    (out / "old.txt").write_text("old")
    (out / "normswap.json").write_text("{}")  # an earlier output: --force may replace it
    calls = []
    real = checkpoint.exchange_dirs

    def spy(a, b):
        assert (b / "old.txt").is_file()  # the old tree is still in place at the instant of the swap
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(checkpoint, "exchange_dirs", spy)
    r = run(gpt2_dir, "--to", "rms", "--out", out, "--force")
    assert r.exit_code == 0, r.output
    assert len(calls) == 1 and calls[0][1] == out.resolve()
    assert not (out / "old.txt").exists() and (out / "normswap.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv"]  # no staging or aside dirs left


def test_real_architecture_without_data_converts_by_discovery(tmp_path):
    """A transformers model with LayerNorms that normswap/archs/ has no file for (GPT-BigCode):
    the layout is discovered from its forward, every norm converts, and the stock reload verifies."""
    cfg = transformers.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    randomize_norms_and_biases(transformers.GPTBigCodeForCausalLM(cfg)).save_pretrained(tmp_path / "bigcode")
    r = run(tmp_path / "bigcode", "--to", "rms", "--out", tmp_path / "o", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["arch_file"] is None and data["summary"]["converted"] == 5 and data["summary"]["refused"] == 0
    assert [n["path"] for n in data["norms"]] == [
        "transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.1.ln_1", "transformer.h.1.ln_2",
        "transformer.ln_f"]
    assert data["verification"]["passed"] and data["verification"]["max_rel_logit_error"] <= 1e-4


def test_discovered_refusals_and_partial(tmp_path):
    """No architecture file (Persimmon, q/k LayerNorms): refused whole without --partial (exit 2,
    the category and reason on stderr, nothing written); with it the stream norms convert and the
    stock reload verifies, the q/k norms stay LayerNorms."""
    cfg = transformers.PersimmonConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=48, max_position_embeddings=64, qk_layernorm=True)
    torch.manual_seed(0)
    randomize_norms_and_biases(transformers.PersimmonForCausalLM(cfg)).save_pretrained(tmp_path / "p")
    r = run(tmp_path / "p", "--to", "rms", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "--partial" in r.stderr and not (tmp_path / "o").exists()
    # the refusal's table explains the error: on stderr with it, stdout empty (the error contract)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("normswap:")]
    assert len(errors) == 1 and "not a sum of residual-stream writers" in errors[0] and r.stdout == ""
    assert "no (not-stream)" in r.stderr and "discovered from the model's forward" in r.stderr
    r = run(tmp_path / "p", "--to", "rms", "--out", tmp_path / "o", "--json", "--partial")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["summary"]["converted"] == 5 and data["summary"]["refused"] == 4
    assert {n["category"] for n in data["norms"] if not n["rms"]} == {"not-stream"}
    assert data["verification"]["passed"]


def test_truncated_shard_is_bad_input(gpt2_dir, tmp_path):
    """A corrupt checkpoint is the user's input, not an internal error: one line, exit 2."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(gpt2_dir, src)
    with open(src / "model.safetensors", "r+b") as f:
        f.truncate(5000)
    r = run(src, "--to", "rms", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "unreadable safetensors file" in r.stderr, r.output
    assert "internal error" not in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("tensor", ["transformer.h.0.ln_1.weight", "transformer.h.0.mlp.c_fc.bias"])
def test_a_tensor_stored_in_another_shape_than_the_config_gives_is_bad_input(gpt2_dir, tmp_path, tensor):
    """A LayerNorm gain stored with 64 values where the config says 32 stopped the fold with an internal
    error (the sizes of tensor a and b must match); any other tensor of another shape was written and
    found only by the verification. Refused from the headers, as every other command's load refuses it."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(gpt2_dir, src)
    weights = load_file(src / "model.safetensors")
    weights[tensor] = torch.cat([weights[tensor], weights[tensor]])
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    r = CliRunner().invoke(cli, ["convert", str(src), "--to", "rms", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    assert f"of another shape than the config gives: {tensor} (checkpoint [" in r.stderr, r.stderr
    assert "internal error" not in r.stderr and not (tmp_path / "o").exists()


def test_out_containing_the_source_is_refused(tmp_path):
    """--out PARENT --force would replace the directory that holds the model being converted."""
    save_tiny("gpt2", tmp_path / "models" / "gpt2")
    (tmp_path / "models" / "notes.txt").write_text("user data")
    r = run(tmp_path / "models" / "gpt2", "--to", "rms", "--out", tmp_path / "models", "--force")
    assert r.exit_code == 2 and "contains the model being converted" in r.stderr
    assert (tmp_path / "models" / "gpt2" / "model.safetensors").is_file()
    assert (tmp_path / "models" / "notes.txt").read_text() == "user data"
