"""A model's context (the positions its token ids can take), read once (normswap.inputs.
context_length) for the probe batch, the perplexity window, bench's and experiment's checks.

The probe batch and the perplexity window used to read it apart: the window from the model's own
config under five names, the probe from the text config under two. A multimodal LM (Llava,
Gemma 3, Qwen2-VL: 168 config classes of transformers 5.24) then had no context for `ppl`
("cannot tell the model's context length from its config; pass --max-length") and none for
bench's check; VibeVoice-ASR's window was its audio frame count (450) instead of its text
context; MPT's max_seq_len (its ALiBi table) was read by neither, so a probe or a window longer
than it failed in the forward; MusicGen's probe raised transformers' "Multiple valid text
configs" ValueError.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from normswap import inputs
from normswap.evaluate import plan_window
from normswap.verify import ProbeConfig, probe_batch

SIZES = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


def _llava_config(context=48):
    from transformers import LlavaConfig

    return LlavaConfig(text_config=dict(model_type="llama", **SIZES, vocab_size=99, max_position_embeddings=context),
                       vision_config=dict(model_type="clip_vision_model", **SIZES, image_size=32, patch_size=8))


def _gpt2_config(context=40):
    from transformers import GPT2Config

    return GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=99, n_positions=context)


def _mpt_config(context=6):
    from transformers import MptConfig

    return MptConfig(d_model=32, n_heads=2, n_layers=1, vocab_size=99, max_seq_len=context)


class _Holder:  # what plan_window reads of a model: its config
    def __init__(self, config):
        self.config = config


@pytest.mark.parametrize("make, context", [(_llava_config, 48), (_gpt2_config, 40), (_mpt_config, 6)])
def test_the_probe_and_the_window_read_one_context(make, context):
    """The probe batch's length (asked for far more) and the perplexity window (not capped by a
    max_length) are the same number: the text model's positions."""
    import transformers

    config = make(context)
    cls = {"llava": transformers.LlavaForConditionalGeneration, "gpt2": transformers.GPT2LMHeadModel,
           "mpt": transformers.MptForCausalLM}[config.model_type]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(config)
    ids = probe_batch(model, ProbeConfig(seq_len=10_000))["input_ids"]
    assert ids.shape[1] == context
    assert plan_window([model], None, None) == (context, context // 2)
    assert inputs.context_length(config) == context


def test_a_multimodal_lms_window_is_its_text_models_context():
    """Before: the window read the model's own config only, which names no context ("cannot tell
    the model's context length from its config; pass --max-length"), and a max_length past the
    text model's positions was not capped."""
    model = _Holder(_llava_config(48))
    assert plan_window([model], None, None) == (48, 24)
    assert plan_window([model], 1000, None) == (48, 24)


def test_a_multimodal_models_own_setting_of_another_modality_does_not_cap_the_text():
    """VibeVoice-ASR's own max_position_embeddings counts audio frames (450 by default); its text
    model (Qwen2) has 32768 positions. MusicFlamingo's own is a float (its rope theta)."""
    from transformers import MusicFlamingoConfig, VibeVoiceAsrConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        asr, flamingo = VibeVoiceAsrConfig(), MusicFlamingoConfig()
    text = asr.text_config.max_position_embeddings
    assert asr.max_position_embeddings != text  # the case itself
    assert plan_window([_Holder(asr)], None, None) == (text, text // 2)  # was (450, 225)
    assert isinstance(flamingo.max_position_embeddings, float)
    text = flamingo.text_config.max_position_embeddings
    assert plan_window([_Holder(flamingo)], None, None) == (text, text // 2)  # was "cannot tell"


def test_an_mpt_probe_fits_its_alibi_table():
    """MPT's max_seq_len sizes its ALiBi table: a longer input fails in the forward (a size
    mismatch). Before, neither reading knew the name: the probe fed 8 tokens to a 6-position model."""
    from transformers import MptForCausalLM

    torch.manual_seed(0)
    model = MptForCausalLM(_mpt_config(6)).eval()
    batch = probe_batch(model)
    assert batch["input_ids"].shape == (2, 6)
    with torch.no_grad():
        assert model(**batch).logits.shape == (2, 6, 99)


def test_a_config_with_two_text_configs_is_read_by_its_encoders():
    """MusicGen has a text encoder and a decoder: transformers' get_text_config() refuses to
    choose (a ValueError, which was the probe's traceback). The token ids reach the encoder."""
    from transformers import MusicgenConfig

    config = MusicgenConfig()
    with pytest.raises(ValueError, match="Multiple valid text configs"):
        config.get_text_config()
    assert inputs.vocab_size(config) == config.text_encoder.vocab_size  # was the ValueError
    assert inputs.text_config(config) is config.text_encoder
    # T5's relative positions name no context; the decoder's table is the only one there is
    assert inputs.context_length(config) == config.decoder.max_position_embeddings


def test_every_config_class_has_a_context_reading():
    """Every config class of the installed transformers (its defaults): the reading returns a
    positive whole number or None, never raises (MusicGen's did)."""
    from transformers import CONFIG_MAPPING

    read = 0
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001  (a config whose defaults its own validator refuses)
            continue
        context, vocab = inputs.context_length(config), inputs.vocab_size(config)
        assert context is None or (type(context) is int and context > 0), model_type
        assert type(vocab) is int and vocab >= 0, model_type
        read += 1
    assert read > 500  # the sweep ran over the configs, not over an import that failed


def _bert_gpt2_config(encoder: int, decoder: int):
    from transformers import BertConfig, EncoderDecoderConfig

    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig(**SIZES, vocab_size=99, max_position_embeddings=encoder), _gpt2_config(decoder))
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    return config


@pytest.mark.parametrize("encoder, decoder", [(6, 40), (40, 6)])
def test_an_encoder_decoders_context_is_the_smaller_of_its_two_tables(encoder, decoder, tmp_path):
    """EncoderDecoderConfig (a BERT encoder, a GPT-2 decoder): the context was the decoder's alone
    (transformers' text config), so a 6-position encoder under a 40-position decoder was fed a
    probe of 8 ids and `normswap patch` stopped with an internal error ("The expanded size of the
    tensor (8) must match the existing size (6)"). The probe's ids reach the encoder and the
    decoder's are shorter: both fit in the smaller table, and the patch runs and verifies."""
    from click.testing import CliRunner
    from tiny_models import tiny_tokenizer
    from transformers import EncoderDecoderModel

    from normswap.cli import cli

    config = _bert_gpt2_config(encoder, decoder)
    assert inputs.context_length(config) == 6
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = EncoderDecoderModel(config).eval()
    batch = probe_batch(model)
    assert batch["input_ids"].shape == (2, 6) and batch["decoder_input_ids"].shape[1] <= 6
    with torch.no_grad():
        assert model(**batch).logits.shape[:2] == batch["decoder_input_ids"].shape
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    r = CliRunner().invoke(cli, ["patch", str(tmp_path / "model"), "--impl", "torch", "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.stderr


def test_a_vision_encoder_decoders_context_is_its_decoders():
    """A ViT encoder names no token context (its positions are patches, sized by the image): the
    text decoder's table is the only one, as before."""
    from transformers import VisionEncoderDecoderConfig, ViTConfig

    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        ViTConfig(**SIZES, image_size=32, patch_size=8), _gpt2_config(40))
    assert inputs.context_length(config) == 40
