"""Vision and audio models: the inputs a trace and a probe batch feed them (normswap.inputs),
their readers in scan, convert --to rms verified on those inputs, and ppl/diff refusing them.

Before normswap.inputs, every trace fed token ids only: every norm of a ViT, CLIP, Whisper or
wav2vec2 model was "untraced" with readers "?", convert found nothing to convert, and patch's
whole-model check failed ("cannot build a probe batch: the model's config has no vocab_size").
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from normswap import inputs
from normswap.cli import cli
from normswap.discover import discover, trace
from normswap.verify import probe_batch
from tests.tiny_models import randomize_norms_and_biases

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def _vit(device="meta", **kw):
    from transformers import ViTConfig, ViTModel

    with torch.device(device):
        return ViTModel(ViTConfig(**{**SIZES, "image_size": 32, "patch_size": 8, **kw})).eval()


def _clip(device="meta"):
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(text_config=dict(**SIZES, vocab_size=99, max_position_embeddings=40),
                        vision_config=dict(**SIZES, image_size=32, patch_size=8), projection_dim=16)
    with torch.device(device):
        return CLIPModel(config).eval()


def _whisper(device="meta", cls="WhisperModel"):
    import transformers

    config = transformers.WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=20, max_target_positions=40,
        vocab_size=99, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device(device):
        return getattr(transformers, cls)(config).eval()


def _wav2vec2(device="meta"):
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(**SIZES, do_stable_layer_norm=True, conv_dim=(16, 16), conv_kernel=(10, 3),
                            conv_stride=(5, 2), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    with torch.device(device):
        return Wav2Vec2Model(config).eval()


def _shapes(batch: dict) -> dict:
    return {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}


def test_an_image_of_the_configs_size_and_channels():
    for kw, shape in (({}, (1, 3, 32, 32)), ({"image_size": [32, 48], "num_channels": 1}, (1, 1, 32, 48))):
        model = _vit(**kw)
        assert inputs.candidates(model) == [("pixel_values",)]
        tr = trace(model)
        assert tr.error is None and tr.fed == ("pixel_values",)
        assert _shapes(inputs.build(model, tr.fed)) == {"pixel_values": shape}


def test_a_spectrogram_of_exactly_the_frames_whisper_requires():
    """Whisper's encoder refuses any frame count but max_source_positions times its convolutions'
    strides (20 x 1 x 2 here); the decoder gets ids."""
    model = _whisper()
    tr = trace(model)
    assert tr.error is None and tr.fed == ("input_features",)
    shapes = _shapes(inputs.build(model, tr.fed))
    assert shapes["input_features"] == (1, 16, 40) and shapes["decoder_input_ids"] == (1, 4)


def test_a_waveform_of_exactly_the_samples_the_feature_convolutions_need():
    """seq_len (4) positions from the fewest samples: 2 x (4 - 1) + 3 = 9 for the second
    convolution, 5 x (9 - 1) + 10 = 50 for the first; the positional convolution (kernel 16,
    padding 8) keeps the length. The count used to add every kernel's overhang, that one's too, and
    multiply none by the strides before it (61 samples here)."""
    model = _wav2vec2()
    tr = trace(model)
    assert tr.error is None and tr.fed == ("input_values",)
    (n,) = _shapes(inputs.build(model, tr.fed))["input_values"][1:]
    assert n == 50
    real = _wav2vec2(device="cpu")
    with torch.no_grad():
        assert real(**inputs.build(real, tr.fed)).last_hidden_state.shape[1] == 4
        assert real(input_values=torch.ones((1, n - 1))).last_hidden_state.shape[1] == 3  # the fewest
    d = discover(model)
    assert all(f.category != "untraced" for f in d.norms.values()), {p: f.reason for p, f in d.norms.items()}


def _vivit(device="meta"):
    from transformers import VivitConfig, VivitModel

    config = VivitConfig(**SIZES, image_size=32, num_frames=4, tubelet_size=[2, 8, 8])
    with torch.device(device):
        return VivitModel(config).eval()


def _ast(device="meta"):
    from transformers import ASTConfig, ASTModel

    config = ASTConfig(**SIZES, patch_size=4, frequency_stride=4, time_stride=4, num_mel_bins=16, max_length=24)
    with torch.device(device):
        return ASTModel(config).eval()


def test_a_video_model_gets_a_clip_of_the_configs_frames():
    """VideoMAE, ViViT and TimeSformer read (batch, frames, channels, height, width): fed one
    image, their forward failed ("not enough values to unpack") and every norm was untraced."""
    model = _vivit()
    tr = trace(model)
    assert tr.error is None and tr.fed == ("pixel_values",)
    assert _shapes(inputs.build(model, tr.fed)) == {"pixel_values": (1, 4, 3, 32, 32)}
    assert all(f.category is None for f in discover(model).norms.values())


def test_a_spectrogram_in_input_values_where_no_convolution_reads_a_waveform():
    """AST's input_values is a spectrogram (batch, max_length frames, num_mel_bins), which its
    position table is built for: fed a waveform, its forward failed and every norm was untraced.
    A model with a feature encoder's 1-d convolutions still gets a waveform."""
    model = _ast()
    tr = trace(model)
    assert tr.error is None and tr.fed == ("input_values",)
    assert _shapes(inputs.build(model, tr.fed)) == {"input_values": (1, 24, 16)}
    assert not any(f.category == "untraced" for f in discover(model).norms.values())
    assert len(_shapes(inputs.build(_wav2vec2(), ("input_values",)))["input_values"]) == 2


def test_convert_a_video_model_exactly(tmp_path):
    """ViViT's stream is its tubelet convolution's channels, a class token and position
    embeddings: every LayerNorm converts, verified on a clip probe, and the stock reload gives the
    original's float64 outputs on other random clips."""
    path = _save(_vivit(device="cpu").double(), tmp_path / "vivit")
    out = tmp_path / "vivit-rms"
    result = CliRunner().invoke(cli, ["convert", path, "--to", "rms", "--out", str(out), "--dtype", "fp64", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verification"]["probe"] == [2, 4, 3, 32, 32] and doc["verification"]["passed"]
    assert all(n["rms"] for n in doc["norms"])
    from transformers import VivitModel

    clip = torch.randn((3, 4, 3, 32, 32), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        ref, got = (VivitModel.from_pretrained(p, dtype=torch.float64).eval()(pixel_values=clip)
                    for p in (path, str(out)))
    for name in ("last_hidden_state", "pooler_output"):
        assert float((got[name] - ref[name]).abs().max() / ref[name].abs().max()) < 1e-12, name


def test_a_model_that_pairs_text_and_images_gets_both():
    model = _clip()
    assert inputs.candidates(model) == [("input_ids", "pixel_values"), ("input_ids",)]
    tr = trace(model)
    assert tr.error is None and tr.fed == ("input_ids", "pixel_values") and tr.unfed == []
    from normswap.verify import ProbeConfig

    batch = probe_batch(_clip(device="cpu"), ProbeConfig(batch=2, seq_len=64))
    # the ids no longer than the text config's context (40), the image the vision config's size
    assert _shapes(batch) == {"input_ids": (2, 40), "pixel_values": (2, 3, 32, 32)}
    assert batch["input_ids"].min() >= inputs.LOW_ID and batch["input_ids"].max() < 99


def test_a_text_model_keeps_its_probe_batch():
    """Token ids exactly as before normswap.inputs (same generator, same draws)."""
    from normswap.verify import ProbeConfig
    from tests.tiny_models import tiny_model

    model = tiny_model("gpt2")
    batch = probe_batch(model, ProbeConfig(batch=2, seq_len=8))
    g = torch.Generator().manual_seed(ProbeConfig().seed + 1)
    assert list(batch) == ["input_ids"]
    assert torch.equal(batch["input_ids"], torch.randint(3, model.config.vocab_size, (2, 8), generator=g))


def test_an_audio_transformer_whose_pooler_averages_two_rows_converts_exactly(tmp_path):
    """AST's pooler is (y[:, 0] + y[:, 1]) / 2 of its final norm's output y: that add was taken for
    a residual add (post-ln, "its output is added into the residual stream") and the norm was
    refused, so ASTModel converted only with --partial. A sum of rows of the output that leaves
    the model keeps γ and β in the norm (its output is the original's exactly): every norm
    converts, and float64 outputs match on other random spectrograms. In ASTForAudioClassification
    the average feeds the classifier's LayerNorm, which γ and β cannot be folded through: refused
    as such (nonlinear-reader), not as a residual add."""
    d = discover(_ast())
    assert all(f.category is None for f in d.norms.values()), {p: f.reason for p, f in d.norms.items()}
    assert d.norms["layernorm"].readers == [("<output>", None)]
    path = _save(_ast(device="cpu").double(), tmp_path / "ast")
    out = tmp_path / "ast-rms"
    result = CliRunner().invoke(cli, ["convert", path, "--to", "rms", "--out", str(out), "--dtype", "fp64", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert all(n["rms"] for n in doc["norms"]) and doc["verification"]["compute_dtype"] == "float64"
    assert doc["verification"]["compared"] == "last_hidden_state, pooler_output" and doc["verification"]["passed"]
    from transformers import ASTConfig, ASTForAudioClassification, ASTModel

    spec = torch.randn((3, 24, 16), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        ref, got = (ASTModel.from_pretrained(p, dtype=torch.float64).eval()(input_values=spec) for p in (path, str(out)))
    for name in ("last_hidden_state", "pooler_output"):
        assert float((got[name] - ref[name]).abs().max() / ref[name].abs().max()) < 1e-12, name
    config = ASTConfig(**SIZES, patch_size=4, frequency_stride=4, time_stride=4, num_mel_bins=16, max_length=24)
    with torch.device("meta"):
        head = discover(ASTForAudioClassification(config).eval())
    final = head.norms["audio_spectrogram_transformer.layernorm"]
    assert final.category == "nonlinear-reader" and "classifier.layernorm reads a sum of rows" in final.reason


def test_scan_names_the_readers_convert_uses_for_a_sum_of_rows():
    """scan listed AST's final norm as read by "<output>, <model>" (the model's own code adds two rows
    of it into the pooler) while convert recorded "<output>" alone, though both are to be the same
    readers: scan now follows a sum of rows as convert does, so it says "<output>" for ASTModel and,
    for ASTForAudioClassification, names classifier.layernorm (which reads the average)."""
    from transformers import ASTConfig, ASTForAudioClassification

    from normswap.discover import norm_readers

    model = _ast()
    readers, note = norm_readers(model, ["layernorm"])
    assert note is None and readers["layernorm"] == ["<output>"] == [r for r, _ in discover(model).norms["layernorm"].readers]
    config = ASTConfig(**SIZES, patch_size=4, frequency_stride=4, time_stride=4, num_mel_bins=16, max_length=24)
    with torch.device("meta"):
        head = ASTForAudioClassification(config).eval()
    final = "audio_spectrogram_transformer.layernorm"
    assert norm_readers(head, [final])[0][final] == ["classifier.layernorm"]


def _musicgen(device="meta", cls="MusicgenForConditionalGeneration"):
    import transformers
    from transformers import EncodecConfig, MusicgenConfig, T5Config
    from transformers.models.musicgen.configuration_musicgen import MusicgenDecoderConfig

    text = T5Config(vocab_size=99, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16)
    audio = EncodecConfig(hidden_size=32, num_filters=4, codebook_size=64, codebook_dim=32, upsampling_ratios=[2, 2],
                          num_residual_layers=1, target_bandwidths=[1.5], sampling_rate=8000)
    decoder = MusicgenDecoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    ffn_dim=64, num_codebooks=2, max_position_embeddings=64, pad_token_id=64,
                                    bos_token_id=64)
    config = MusicgenConfig(text_encoder=text.to_dict(), audio_encoder=audio.to_dict(), decoder=decoder.to_dict())
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        return getattr(transformers, cls)(config.decoder if cls == "MusicgenForCausalLM" else config).eval()


def test_musicgen_gets_decoder_codes_of_its_own_vocabulary_one_row_per_codebook(tmp_path):
    """MusicGen's decoder reads audio codes, (batch x num_codebooks, length) of its own vocabulary
    (64 here; its text encoder's is 99): fed (batch, length) ids of the text vocabulary, its trace
    failed ("shape '[-1, 2, 4]' is invalid", every norm untraced) and `patch` ended in "internal
    error: IndexError: index out of range in self". The decoder ids now come from the decoder's
    config; the causal decoder alone gets its input_ids as codebook rows too."""
    model = _musicgen()
    tr = trace(model)
    assert tr.error is None, tr.error
    assert not any(f.category == "untraced" for p, f in discover(model, tr=tr).norms.items() if p.startswith("decoder."))
    batch = probe_batch(_musicgen(device="cpu"))
    assert _shapes(batch)["decoder_input_ids"] == (2 * 2, 4) and int(batch["decoder_input_ids"].max()) < 64
    assert _shapes(batch)["input_ids"] == (2, 8) and int(batch["input_ids"].max()) >= 64  # the text vocabulary
    assert trace(_musicgen(cls="MusicgenForCausalLM")).error is None
    assert _shapes(probe_batch(_musicgen(device="cpu", cls="MusicgenForCausalLM"))) == {"input_ids": (2 * 2, 8)}
    path = _save(_musicgen(device="cpu"), tmp_path / "musicgen")
    result = CliRunner().invoke(cli, ["patch", path, "--impl", "torch", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["model_check"]["kind"] == "logits" and doc["model_check"]["passed"]
    assert any(m["path"].startswith("decoder.") and m["status"] == "patched" for m in doc["modules"])


@pytest.mark.parametrize("model_type,class_name,codebooks", [("csm", "CsmForConditionalGeneration", 32),
                                                              ("moshi", "MoshiForCausalLM", 8)])
def test_a_config_with_codebooks_whose_ids_are_text_keeps_one_row_per_sequence(model_type, class_name, codebooks):
    """CSM and Moshi set num_codebooks too, but read (batch, length) text ids (their audio codes come
    another way): they got batch x num_codebooks rows (64 for CSM's 32 codebooks), a probe batch and
    a whole-model check that many times larger. Ids come as one row per codebook only where the
    model looks each row up in a table of its own (MusicGen's decoder)."""
    from tests.sweep_models import build

    model = build(model_type, class_name)
    assert inputs.setting(model.config, "num_codebooks") == codebooks
    assert _shapes(probe_batch(model))["input_ids"] == (2, 8)
    assert trace(model, towers=False).error is None


def test_a_multimodal_lm_whose_image_is_not_fed_converts_no_text_norm():
    """Fuyu's forward also takes image_patches (no config gives their shape): what they add into
    the text stream is unseen, so its text norms are refused, not converted on a text-only trace."""
    from tests.sweep_models import build

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("fuyu", "FuyuForCausalLM")
    d = discover(model)
    stream = [f for p, f in d.norms.items() if "layernorm" in p and "q_layernorm" not in p and "k_layernorm" not in p]
    assert stream and all(f.category == "untraced" and "image_patches" in f.reason for f in stream)
    assert d.tables == [] and d.writers == []


def _save(model, path):
    randomize_norms_and_biases(model, 0)
    model.save_pretrained(path)
    return str(path)


def test_scan_lists_a_vision_models_readers(tmp_path):
    path = _save(_vit(device="cpu"), tmp_path / "vit")
    result = CliRunner().invoke(cli, ["scan", path, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    rows = {r["path"]: r for r in doc["norms"]}
    assert doc["readers_note"] is None
    assert rows["layers.0.layernorm_before"]["readers"] == [
        "layers.0.attention.q_proj", "layers.0.attention.k_proj", "layers.0.attention.v_proj"]
    assert rows["layernorm"]["readers"] == ["<output>", "pooler.dense"]
    assert all(r["to_rms"]["converts"] for r in rows.values()), rows


def _vit_outputs(path, pixels):
    from transformers import ViTModel

    with torch.no_grad():
        out = ViTModel.from_pretrained(path, dtype=torch.float64).eval()(pixel_values=pixels)
    return torch.cat([out.last_hidden_state.reshape(-1), out.pooler_output.reshape(-1)])


def test_convert_a_vision_model_exactly(tmp_path):
    """ViT's stream is its patch convolution's channels, a class token and position embeddings:
    every LayerNorm converts, the stock reload gives the original's float64 outputs on random
    images, and the patched RMS path was verified on an image probe."""
    path = _save(_vit(device="cpu").double(), tmp_path / "vit")
    out = tmp_path / "vit-rms"
    result = CliRunner().invoke(cli, ["convert", path, "--to", "rms", "--out", str(out), "--dtype", "fp64", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verification"]["probe"] == [2, 3, 32, 32] and doc["verification"]["passed"]
    assert all(n["rms"] for n in doc["norms"])
    pixels = torch.randn((3, 3, 32, 32), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref, got = _vit_outputs(path, pixels), _vit_outputs(str(out), pixels)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-12


def test_convert_of_a_model_without_logits_names_and_compares_every_output(tmp_path):
    """A ViTModel has no logits: the verification compares its last_hidden_state and its
    pooler_output, and says so (the report's "compared"; the human line names them, where it used
    to say "max |Δlogit| ... of the logit scale" of a hidden state). A language model's line still
    speaks of logits."""
    path = _save(_vit(device="cpu"), tmp_path / "vit")
    result = CliRunner().invoke(cli, ["convert", path, "--to", "rms", "--out", str(tmp_path / "o"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verification"]["compared"] == "last_hidden_state, pooler_output"
    result = CliRunner().invoke(cli, ["convert", path, "--to", "rms", "--out", str(tmp_path / "o2")])
    assert result.exit_code == 0, result.output
    [line] = [ln for ln in result.stdout.splitlines() if ln.startswith("verified:")]
    assert line.startswith("verified: stock reload max |Δ| of the last_hidden_state, pooler_output = ") \
        and "of each one's own largest magnitude" in line and "logit" not in line, line
    assert "logit" not in result.stderr, result.stderr  # its progress line neither
    from tests.tiny_models import save_tiny

    save_tiny("gpt2", tmp_path / "gpt2")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "gpt2"), "--to", "rms", "--out", str(tmp_path / "g")])
    assert result.exit_code == 0, result.output
    [line] = [ln for ln in result.stdout.splitlines() if ln.startswith("verified:")]
    assert line.startswith("verified: stock reload max |Δlogit| = ") and "of the logit scale" in line, line


def test_convert_verification_of_a_model_without_logits_covers_its_pooler(tmp_path, monkeypatch):
    """The verification of a ViTModel compared its last_hidden_state alone: a converted checkpoint
    whose pooler computed something else passed. Now every output is compared: refused."""
    from safetensors.torch import load_file, save_file

    from normswap import convert_dir

    real = convert_dir.convert_directory

    def moves_the_pooler(source, out, *args, **kwargs):
        section = real(source, out, *args, **kwargs)
        tensors = load_file(out / "model.safetensors")
        tensors["pooler.dense.bias"] = tensors["pooler.dense.bias"] + 0.5
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return section

    monkeypatch.setattr(convert_dir, "convert_directory", moves_the_pooler)
    path = _save(_vit(device="cpu"), tmp_path / "vit")
    out = tmp_path / "vit-rms"
    result = CliRunner().invoke(cli, ["convert", path, "--to", "rms", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "the converted model's pooler_output differs by" in result.stderr, result.output
    assert not out.exists()


def _loud_vit(tmp_path):
    """A ViTModel whose final norm's weight is ~100: its last hidden state reaches hundreds, its
    pooler output (a tanh, its dense layer scaled down so that it does not saturate) stays below 1."""
    model = _vit(device="cpu")
    randomize_norms_and_biases(model, 0)
    with torch.no_grad():
        model.layernorm.weight.mul_(100)
        model.pooler.dense.weight.div_(100)
    model.save_pretrained(tmp_path / "vit")
    return str(tmp_path / "vit")


def test_convert_verification_judges_each_output_on_its_own_scale(tmp_path, monkeypatch):
    """A conversion whose pooler bias moved by 0.005 passed: the pooler's error (~0.005 of its
    own magnitude, 50x the fp32 tolerance) was measured against the last hidden state's scale
    (hundreds). Each output is now held to the tolerance of its own largest magnitude: refused,
    naming the pooler; the report gives each output's error."""
    from safetensors.torch import load_file, save_file

    from normswap import convert_dir

    real = convert_dir.convert_directory
    shift = {"by": 0.0}

    def moves_the_pooler(source, out, *args, **kwargs):
        section = real(source, out, *args, **kwargs)
        tensors = load_file(out / "model.safetensors")
        tensors["pooler.dense.bias"] = tensors["pooler.dense.bias"] + shift["by"]
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return section

    monkeypatch.setattr(convert_dir, "convert_directory", moves_the_pooler)
    path = _loud_vit(tmp_path)
    result = CliRunner().invoke(cli, ["convert", path, "--to", "rms", "--out", str(tmp_path / "ok"), "--json"])
    assert result.exit_code == 0, result.output
    v = json.loads(result.stdout)["verification"]
    assert set(v["outputs"]) == {"last_hidden_state", "pooler_output"}
    assert v["max_rel_logit_error"] == max(o["max_rel_error"] for o in v["outputs"].values()) <= v["tolerance"]
    shift["by"] = 0.005
    out = tmp_path / "vit-rms"
    result = CliRunner().invoke(cli, ["convert", path, "--to", "rms", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "the converted model's pooler_output differs by" in result.stderr, result.output
    assert "of its own largest magnitude" in result.stderr and not out.exists()


def test_patch_compares_every_output_of_a_model_without_logits(tmp_path):
    """patch compared a ViTModel's last_hidden_state alone, while convert compared its pooler
    output too: both now compare (and name) the same outputs, each on its own scale, through
    verify.named_outputs and verify.compare_outputs."""
    path = _loud_vit(tmp_path)
    result = CliRunner().invoke(cli, ["patch", path, "--impl", "torch", "--json"])
    assert result.exit_code == 0, result.output
    check = json.loads(result.stdout)["model_check"]
    assert check["kind"] == "last_hidden_state, pooler_output" and check["passed"]
    hidden, pooler = check["outputs"]["last_hidden_state"], check["outputs"]["pooler_output"]
    assert hidden["max_abs_value"] > 100 and pooler["max_abs_value"] < 1  # each its own scale
    result = CliRunner().invoke(cli, ["patch", path, "--impl", "torch"])
    assert result.exit_code == 0, result.output
    [line] = [ln for ln in result.stdout.splitlines() if ln.startswith("whole model:")]
    assert "max |Δlast_hidden_state|" in line and "max |Δpooler_output|" in line and line.endswith(": pass"), line


def test_convert_verification_feeds_the_image(tmp_path, monkeypatch):
    """A conversion that forgets to center the patch convolution is caught by the verification's
    zero-mean check on an image probe: exit 2, nothing written."""
    from normswap import fold

    real = fold.center_writer

    def forgets_convolutions(weight, bias, orientation):
        return (weight, bias) if weight.dim() == 4 else real(weight, bias, orientation)

    monkeypatch.setattr(fold, "center_writer", forgets_convolutions)
    path = _save(_vit(device="cpu"), tmp_path / "vit")
    out = tmp_path / "vit-rms"
    result = CliRunner().invoke(cli, ["convert", path, "--to", "rms", "--out", str(out)])
    assert result.exit_code == 2 and "not zero-mean" in result.output, result.output
    assert not out.exists()


def test_convert_a_text_and_image_model_verified_on_both(tmp_path):
    """CLIP: the text tower converts (its vision tower's pre-norm makes that stream a norm's output:
    refused), verified on ids and images, comparing every output (CLIP returns no logits)."""
    path = _save(_clip(device="cpu"), tmp_path / "clip")
    out = tmp_path / "clip-rms"
    result = CliRunner().invoke(cli, ["convert", path, "--to", "rms", "--partial", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    converted = {n["path"] for n in doc["norms"] if n["rms"]}
    assert converted and all(p.startswith("text_model.") for p in converted)
    assert doc["verification"]["passed"]


def test_convert_an_audio_model_verified_on_a_spectrogram(tmp_path):
    """Whisper: the decoder's norms convert (the encoder's stream starts with a GELU: refused);
    the verification feeds input_features and decoder ids (token ids alone do not run it)."""
    path = _save(_whisper(device="cpu", cls="WhisperForConditionalGeneration"), tmp_path / "whisper")
    out = tmp_path / "whisper-rms"
    result = CliRunner().invoke(cli, ["convert", path, "--to", "rms", "--partial", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verification"]["probe"] == [2, 16, 40] and doc["verification"]["passed"]
    assert any(n["rms"] for n in doc["norms"])


def test_patch_checks_a_vision_model_whole(tmp_path):
    path = _save(_vit(device="cpu"), tmp_path / "vit")
    result = CliRunner().invoke(cli, ["patch", path, "--impl", "torch", "--out", str(tmp_path / "p"), "--json"])
    assert result.exit_code == 0, result.output
    check = json.loads(result.stdout)["model_check"]
    assert check["kind"] == "last_hidden_state, pooler_output" and check["passed"]


@pytest.mark.parametrize("argv", [["ppl", "{m}", "--data", "{t}"], ["diff", "{m}", "{m}", "--data", "{t}"],
                                  ["patch", "{m}", "--impl", "torch", "--out", "{o}", "--eval", "{t}"]])
def test_scoring_a_model_without_a_text_head_is_one_line(tmp_path, argv):
    path = _save(_vit(device="cpu"), tmp_path / "vit")
    text = tmp_path / "t.txt"
    text.write_text("some words to score " * 20)
    args = [a.format(m=path, t=text, o=tmp_path / "out") for a in argv]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1] == ("normswap: error: ViTModel has no language-model head (no logits to score; it reads "
                         "pixel_values, not token ids); perplexity needs a causal language model"), result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_a_converted_norm_the_probe_never_runs_fails_the_zero_mean_check():
    """A converted norm that the probe batch never reaches (a tower that only its get_<x>_features
    method runs) was measured by nothing: the check used to pass it (no ratio, no failure)."""
    from normswap.convert import check_zero_mean, convert_model
    from normswap.errors import NormswapError

    model = _vit(device="cpu").double()
    randomize_norms_and_biases(model, 0)
    manifest = convert_model(model, check=False)
    batch = probe_batch(model)
    assert check_zero_mean(model, manifest, batch)["passed"]
    skipped = model.get_submodule("layers.1")
    skipped.forward = lambda hidden_states, *a, **kw: hidden_states  # the probe never reaches its norms
    result = check_zero_mean(model, manifest, batch, raise_on_failure=False)
    assert not result["passed"] and result["unmeasured"] == [
        "layers.1.layernorm_before", "layers.1.layernorm_after"], result
    with pytest.raises(NormswapError, match="never ran layers.1.layernorm_before"):
        check_zero_mean(model, manifest, batch)


def test_a_patch_convolution_read_elsewhere_too_is_not_centered():
    """A patch convolution whose output something else also reads (here the pooler, across its
    channels): centering it would change that reader, which the stream checks never follow. It
    used to count as a writer, and the conversion moved the pooler output by ~0.3."""
    import types

    model = _vit(device="cpu").double()
    pe, pooler = model.embeddings.patch_embeddings, model.pooler
    pooler_forward = type(pooler).forward

    def patches(self, pixel_values, interpolate_pos_encoding=False):
        x = self.projection(pixel_values)
        self.side = x.amax(dim=1)
        return x.flatten(2).transpose(1, 2)

    pe.forward = types.MethodType(patches, pe)
    pooler.forward = types.MethodType(lambda self, h: pooler_forward(self, h) + pe.side.flatten(1).sum(-1, keepdim=True),
                                      pooler)
    d = discover(model)
    assert d.writers == [] and all(f.category == "uncenterable-term" for f in d.norms.values()), d.norms


def test_a_tower_without_a_feature_method_is_traced_through_its_own_forward():
    """Qwen2-Audio's model has no get_audio_features: its audio tower's norms were untraced ("no
    get_<x>_features method runs that input's tower"). The tower module's own forward, the
    shallowest whose main input is input_features (not the inner Qwen2AudioModel, which is about
    its ids), is traced on that input alone and decides them."""
    from normswap.discover import layer_norm_paths, norm_readers
    from tests.sweep_models import build

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("qwen2_audio", "Qwen2AudioForConditionalGeneration")
    tr = trace(model)
    assert tr.fed == ("input_ids",) and tr.unfed == ["input_features"]
    assert [(t.via, t.fed, t.error) for t in tr.more] == [("model.audio_tower", ("input_features",), None)]
    readers, note = norm_readers(model, layer_norm_paths(model), tr)
    tower = "model.audio_tower."
    assert note is None and readers[tower + "layers.0.final_layer_norm"] == [tower + "layers.0.fc1"]
    d = discover(model, tr=tr)
    assert d.norms and all(f.category not in (None, "untraced") for f in d.norms.values()), d.norms


def test_a_tower_traced_through_its_forward_counts_every_hidden_state_as_read():
    """A tower traced through its own forward (no get_<x>_features) was traced for its last
    hidden state alone, while its parent may read any layer's (LLaVA's vision_feature_layer: here
    hidden_states[-2], projected into the text stream): every ViT norm was said to convert, whose
    conversion centers the stream that parent reads. Now the tower is asked for every hidden
    state: a stream that leaves it unnormed refuses them."""
    from torch import nn
    from transformers import ViTConfig, ViTModel

    class WithTower(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = ViTConfig(**SIZES, image_size=32, patch_size=8)
            self.vision_tower = ViTModel(self.config, add_pooling_layer=False)
            self.embed, self.proj = nn.Embedding(100, 32), nn.Linear(32, 32)

        def forward(self, input_ids, pixel_values=None):
            x = self.embed(input_ids)
            if pixel_values is not None:
                if input_ids.shape[1] < 1000:  # as a multimodal LM without its placeholder tokens
                    raise ValueError("image features and image tokens do not match")
                x = torch.cat([self.proj(self.vision_tower(pixel_values, output_hidden_states=True)
                                         .hidden_states[-2]), x], 1)
            return x

    with torch.device("meta"):
        model = WithTower().eval()
    tr = trace(model)
    assert tr.unfed == ["pixel_values"] and [(t.via, t.error) for t in tr.more] == [("vision_tower", None)]
    d = discover(model, tr=tr)
    assert len(d.norms) == 2 * SIZES["num_hidden_layers"] + 1
    assert all(f.category not in (None, "untraced") for f in d.norms.values()), d.norms


def test_a_towers_readers_come_from_its_own_trace():
    """Voxtral's forward runs its Llama text model on ids alone; its audio tower runs through
    get_audio_features(input_features), and its norms' readers are those seen there, the output of
    that method named as such (it goes on into the text model, which that trace did not follow).
    The probe batch's trace (towers=False) skips the tower."""
    from normswap.discover import layer_norm_paths, norm_readers
    from tests.sweep_models import build

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("voxtral", "VoxtralForConditionalGeneration")
    tr = trace(model)
    assert tr.fed == ("input_ids",) and tr.unfed == ["input_features"]
    assert [(t.via, t.fed, t.error) for t in tr.more] == [("get_audio_features", ("input_features",), None)]
    assert trace(model, towers=False).more == []
    readers, note = norm_readers(model, layer_norm_paths(model), tr)
    assert note is None
    tower = "model.audio_tower."
    assert readers[tower + "layers.0.self_attn_layer_norm"] == [
        tower + "layers.0.self_attn.k_proj", tower + "layers.0.self_attn.v_proj", tower + "layers.0.self_attn.q_proj"]
    # last_hidden_state leaves the method as is; get_audio_features' own reshape (no module's code) reads it
    assert readers[tower + "layer_norm"] == ["<output of get_audio_features>", ""]
