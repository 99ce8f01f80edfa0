"""The conversion sweep: every causal-LM and sequence-to-sequence LM class of the installed
transformers that holds LayerNorm-like modules is built tiny and either converts exactly, with no
architecture file (float64 logits within 1e-12 of the original, the stock from_pretrained reload
equal, every converted norm's input zero-mean), or is listed in SWEEP with the categories of its
refusals (normswap.discover.REFUSALS). A transformers release that adds an unclassified LayerNorm
architecture, or changes how one converts, fails here until SWEEP is updated.

Discovery runs on the meta device; real float64 models are built only for the exactness check.
README.md's architecture list is rendered from SWEEP (`python -m tests.test_convert_sweep`) and
checked against it below.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from normswap import inputs as model_inputs
from normswap.convert import convert_model
from normswap.discover import REFUSALS, discover, layer_norm_paths, tensors_in, trace
from tests.sweep_models import VOCAB, build, modality_entries, sweep_entries
from tests.tiny_models import randomize_norms_and_biases

CONVERTS = "converts"
NOT_BUILT = "not-built"  # the tiny config cannot be built (a validator, a missing sub-config)

# label -> outcome: "converts" (every LayerNorm), or the refusal categories of its refused norms,
# with "converts" among them when the others convert (normswap convert --partial). Swept on the
# transformers the table names (the README's list is rendered from it): another release adds or
# drops architectures, and the test then says which (SWEEP_BEFORE holds the earlier releases the
# suite still runs on).
SWEEP_TRANSFORMERS = "5.24.0"
SWEEP: dict[str, tuple[str, ...]] = {
    'audioflamingo3': ('untraced',),
    'axk2': ('untraced',),
    'bamba': ('not-built',),
    'bart': ('post-ln', 'untraced'),
    'bart:seq2seq': ('post-ln',),
    'bert': ('not-stream', 'post-ln'),
    'bert-generation': ('post-ln',),
    'big_bird': ('not-stream', 'post-ln'),
    'bigbird_pegasus': ('converts', 'untraced'),
    'bigbird_pegasus:seq2seq': ('shared-weights',),
    'biogpt': ('converts',),
    'blenderbot': ('converts', 'untraced'),
    'blenderbot-small': ('post-ln', 'untraced'),
    'blenderbot-small:seq2seq': ('post-ln',),
    'blenderbot:seq2seq': ('shared-weights',),
    'bloom': ('converts',),
    'camembert': ('not-stream', 'post-ln'),
    'codegen': ('converts',),
    'cohere': ('norm-form',),
    'cohere2': ('norm-form',),
    'cohere2_moe': ('untraced',),
    'cohere_compass_text': ('not-built',),
    'ctrl': ('not-stream', 'uncenterable-term'),
    'data2vec-text': ('not-stream', 'post-ln'),
    'dbrx': ('not-built',),
    'deepseek_v32': ('untraced',),
    'dots1': ('not-built',),
    'dots3_note': ('not-built',),
    'dots3_note_text': ('not-built',),
    'electra': ('converts', 'not-stream', 'post-ln'),
    'emu3': ('not-built',),
    'encoder-decoder': ('not-stream', 'post-ln'),
    'ernie': ('not-stream', 'post-ln'),
    'falcon': ('converts',),
    'fsmt': ('post-ln',),
    # Its forward also takes image_patches, which no config gives the shape of: what the image adds
    # into the text stream is unseen, so the text norms are refused (untraced) rather than converted.
    'fuyu': ('not-stream', 'untraced'),
    'gemma3': ('untraced',),
    'gemma3n': ('not-built',),
    'gemma3n_text': ('not-built',),
    'gemma4_assistant': ('not-built',),
    'git': ('nonlinear-reader', 'post-ln'),
    'glm_moe_dsa': ('untraced',),
    'glmasr': ('untraced',),
    'got_ocr2': ('nonlinear-reader', 'norm-form', 'stray-reader'),
    'gpt-sw3': ('converts',),
    'gpt2': ('converts',),
    'gpt_bigcode': ('converts',),
    'gpt_neo': ('converts',),
    'gpt_neox': ('converts',),
    'gpt_neox_japanese': ('converts',),
    'gptj': ('converts',),
    'granite_speech': ('untraced',),
    'granite_speech_plus': ('untraced',),
    'granitemoehybrid': ('not-built',),
    'hy_v4': ('untraced',),
    'jais2': ('converts',),
    'led': ('untraced',),
    'lfm2_moe': ('not-built',),
    'llama4': ('not-built',),
    'm2m_100': ('uncenterable-term',),
    'mamba2': ('not-built',),
    'marian': ('post-ln', 'untraced'),
    'marian:seq2seq': ('post-ln',),
    'mbart': ('post-ln', 'untraced'),
    'mbart:seq2seq': ('post-ln',),
    'megatron-bert': ('converts', 'not-stream'),
    'modernbert-decoder': ('not-stream', 'post-ln', 'stray-reader'),
    'moss_transcribe_diarize': ('untraced',),
    'moss_transcribe_diarize:seq2seq': ('untraced',),
    'mpt': ('converts',),
    'musicflamingo': ('untraced',),
    'musicgen': ('not-built',),
    'musicgen_melody': ('not-built',),
    'mvp': ('post-ln', 'untraced'),
    'mvp:seq2seq': ('post-ln',),
    'nemo_speechlm': ('untraced',),
    'nemotron': ('norm-form',),
    'nllb-moe': ('uncenterable-term',),
    'olmo': ('converts',),
    # Every LayerNorm is in the audio tower, which a text-only forward (input_ids) never runs; the
    # Llama text model holds RMSNorms only. Its get_audio_features does not run on the meta device:
    # TOWERS holds it (and the other towers) to the reason.
    'omniasr': ('untraced',),
    'openai-gpt': ('post-ln',),
    'opt': ('converts',),
    'pegasus': ('converts', 'untraced'),
    'pegasus:seq2seq': ('shared-weights',),
    'pegasus_x': ('nonlinear-reader', 'not-stream', 'shared-weights', 'uncenterable-term'),
    'persimmon': ('converts', 'not-stream'),
    'phi': ('converts',),
    'phi4_multimodal': ('untraced',),
    'phimoe': ('untraced',),
    'plbart': ('post-ln', 'untraced'),
    'plbart:seq2seq': ('post-ln',),
    'prophetnet': ('post-ln', 'untraced'),
    'prophetnet:seq2seq': ('post-ln',),
    'qwen2_audio': ('not-stream', 'uncenterable-term'),
    'qwen3_5': ('not-built',),
    'qwen3_5_moe': ('not-built',),
    'qwen3_asr': ('untraced',),
    'qwen4_exp': ('not-built',),
    'reformer': ('not-built',),
    'rembert': ('converts', 'not-stream', 'post-ln'),
    'roberta': ('not-stream', 'post-ln'),
    'roberta-prelayernorm': ('not-stream', 'post-ln'),
    'roc_bert': ('not-stream', 'post-ln'),
    'roformer': ('not-stream', 'post-ln'),
    'rwkv': ('post-ln', 'uncenterable-term'),
    'seamless_m4t': ('uncenterable-term',),
    'seamless_m4t_v2': ('uncenterable-term',),
    'stablelm': ('converts',),
    'starcoder2': ('converts',),
    't5gemma2': ('untraced',),
    'trocr': ('post-ln', 'untraced'),
    'voxtral': ('nonlinear-reader', 'uncenterable-term'),
    'whisper': ('converts', 'untraced'),
    'xglm': ('uncenterable-term',),
    'xlm': ('post-ln',),
    'xlm-roberta': ('not-stream', 'post-ln'),
    'xlm-roberta-xl': ('converts', 'not-stream'),
    'xlnet': ('untraced',),
    'xlstm': ('norm-form',),
    'xmod': ('untraced',),
    'zamba': ('not-built',),
    'zamba2': ('not-built',),
    'zaya': ('not-built',),
}


# The vision and audio models (modality_entries: every base model class whose forward mainly reads
# an image, a spectrogram or a waveform) with LayerNorms, as SWEEP: traced on the inputs their
# forward and config give (normswap.inputs), converted exactly where the graph allows.
SWEEP_MODALITIES: dict[str, tuple[str, ...]] = {
    'audio-spectrogram-transformer': ('converts',),
    'audioflamingo3_encoder': ('not-stream', 'uncenterable-term'),
    'beit': ('not-stream', 'stray-reader', 'uncenterable-term'),
    'blip-2': ('untraced',),
    'canary': ('untraced',),
    'chinese_clip_vision_model': ('post-ln',),
    'clip_vision_model': ('post-ln',),
    'cohere_asr': ('untraced',),
    'conditional_detr': ('not-built',),
    'convnext': ('untraced',),
    'convnextv2': ('untraced',),
    'cosmos3_edge_vision': ('untraced',),
    'cvt': ('not-built',),
    'd_fine': ('nonlinear-reader', 'not-stream', 'post-ln'),
    'dab-detr': ('not-built',),
    'data2vec-audio': ('nonlinear-reader', 'not-stream', 'post-ln'),
    'data2vec-vision': ('stray-reader', 'uncenterable-term'),
    'deformable_detr': ('not-built',),
    'deimv2': ('untraced',),
    'deit': ('converts',),
    'depth_pro': ('untraced',),
    'detr': ('not-built',),
    'dinat': ('not-built',),
    'dinov2': ('converts', 'uncenterable-term'),
    'dinov2_with_registers': ('converts', 'uncenterable-term'),
    'dinov3_convnext': ('norm-form', 'not-stream'),
    'dinov3_vit': ('converts', 'uncenterable-term'),
    'donut-swin': ('not-built',),
    'dpt': ('uncenterable-term',),
    'edgetam': ('not-built',),
    'edgetam_video': ('untraced',),
    'edgetam_vision_model': ('not-built',),
    'efficientloftr': ('not-built',),
    'focalnet': ('nonlinear-reader', 'post-ln'),
    'fun_asr_nano_encoder': ('untraced',),
    'gemma3n_vision': ('not-built',),
    'gemma4_audio': ('untraced',),
    'glm_image_vision': ('untraced',),
    'glmasr_encoder': ('not-stream', 'uncenterable-term'),
    'glpn': ('not-built',),
    'granite_speech5_ctc': ('not-built',),
    'granite_speech5_encoder': ('not-built',),
    'grounding-dino': ('untraced',),
    'hiera': ('not-built',),
    'hubert': ('not-stream', 'post-ln'),
    'hunyuan_vl_vision': ('untraced',),
    'hy_v4_vl_vision': ('untraced',),
    'ijepa': ('converts',),
    'inkling2_vision': ('untraced',),
    'instructblip': ('untraced',),
    'instructblipvideo': ('untraced',),
    'internvl_vision': ('stray-reader', 'uncenterable-term'),
    'kosmos-2': ('untraced',),
    'lasr_ctc': ('untraced',),
    'lasr_encoder': ('untraced',),
    'levit': ('not-built',),
    'lightglue': ('untraced',),
    'lw_detr': ('untraced',),
    'mask2former': ('untraced',),
    'maskformer': ('converts', 'nonlinear-reader', 'not-stream', 'post-ln', 'stray-reader'),
    'maskformer-swin': ('not-built',),
    'mgp-str': ('converts', 'nonlinear-reader', 'not-stream'),
    'mimi': ('not-built',),
    'mimi_encoder': ('untraced',),
    'minicpm_ocr_vision': ('untraced',),
    'minicpmv4_7_vision': ('untraced',),
    'mlcd': ('post-ln',),
    'mlcd_vision_model': ('post-ln',),
    'mm-grounding-dino': ('untraced',),
    'mobilevit': ('nonlinear-reader', 'not-stream', 'uncenterable-term'),
    'moonshine': ('converts', 'not-stream', 'uncenterable-term'),
    'moonshine_streaming': ('not-built',),
    'moss_transcribe_diarize_audio': ('uncenterable-term',),
    'muse_glimmer_vision': ('untraced',),
    'muse_spark_audio': ('not-built',),
    'muse_spark_vision': ('untraced',),
    'nemotron3_5_asr': ('untraced',),
    'nemotron3_5_transcribe_asr_audio': ('untraced',),
    'nemotron3_5_transcribe_audio': ('untraced',),
    'nemotron3_diarization': ('untraced',),
    'nemotron3_diarization_audio': ('untraced',),
    'nemotron_asr_streaming': ('untraced',),
    'nemotron_asr_streaming_encoder': ('untraced',),
    'neucodec': ('untraced',),
    'omdet-turbo': ('not-built',),
    'omniasr_audio': ('untraced',),
    'omniasr_ctc': ('untraced',),
    'parakeet_ctc': ('untraced',),
    'parakeet_encoder': ('untraced',),
    'parakeet_rnnt': ('untraced',),
    'parakeet_tdt': ('untraced',),
    'pe_audio_video_encoder': ('not-built',),
    'pixio': ('converts', 'nonlinear-reader'),
    'pocket_tts_audio_tokenizer': ('not-built',),
    'pocket_tts_audio_tokenizer_encoder': ('untraced',),
    'pp_doclayout_v3': ('untraced',),
    'pp_doclayout_v4': ('untraced',),
    'pp_ocrv6_medium_det': ('not-built',),
    'pvt': ('not-built',),
    'pvt_v2': ('not-built',),
    'qianfan_ocr_vision': ('stray-reader', 'uncenterable-term'),
    'qwen2_audio_encoder': ('not-stream', 'uncenterable-term'),
    'qwen3_asr_encoder': ('untraced',),
    'radio': ('uncenterable-term',),
    'rf_detr': ('untraced',),
    'rt_detr': ('untraced',),
    'rt_detr_v2': ('untraced',),
    'sam': ('untraced',),
    'sam2': ('untraced',),
    'sam2_hiera_det_model': ('untraced',),
    'sam2_video': ('untraced',),
    'sam2_vision_model': ('untraced',),
    'sam3': ('untraced',),
    'sam3_lite_text': ('untraced',),
    'sam3_lite_text_text_model': ('not-stream',),
    'sam3_tracker': ('untraced',),
    'sam3_tracker_video': ('untraced',),
    'sam3_video': ('untraced',),
    'sam3_vision_model': ('nonlinear-reader', 'post-ln'),
    'sam3_vit_model': ('nonlinear-reader', 'post-ln'),
    'sam_hq': ('untraced',),
    'sam_hq_vision_model': ('nonlinear-reader', 'norm-form', 'stray-reader'),
    'sam_vision_model': ('nonlinear-reader', 'norm-form', 'stray-reader'),
    'segformer': ('not-built',),
    'seggpt': ('untraced',),
    'sew': ('not-stream', 'post-ln'),
    'sew-d': ('untraced',),
    'siglip2_vision_model': ('untraced',),
    'siglip_vision_model': ('converts', 'nonlinear-reader', 'not-stream'),
    'speech_to_text': ('uncenterable-term',),
    'speecht5': ('untraced',),
    'swin': ('not-built',),
    'swin2sr': ('not-built',),
    'swinv2': ('not-built',),
    'table-transformer': ('not-built',),
    'timesformer': ('stray-reader', 'uncenterable-term'),
    'timm_backbone': ('not-built',),
    'timm_wrapper': ('not-built',),
    'tipsv2_vision_model': ('converts', 'uncenterable-term'),
    'unispeech': ('not-stream', 'post-ln'),
    'unispeech-sat': ('not-stream', 'post-ln'),
    'video_llama_3_vision': ('untraced',),
    'videomae': ('uncenterable-term',),
    'vit': ('converts',),
    'vit_mae': ('uncenterable-term',),
    'vit_msn': ('converts',),
    'vitdet': ('not-stream', 'uncenterable-term'),
    'vivit': ('converts',),
    'voxtral_encoder': ('uncenterable-term',),
    'wav2vec2': ('not-stream', 'post-ln'),
    'wav2vec2-bert': ('converts', 'nonlinear-reader', 'not-stream', 'post-ln'),
    'wav2vec2-conformer': ('converts', 'nonlinear-reader', 'not-stream', 'post-ln'),
    'wavlm': ('not-stream', 'post-ln'),
    'wavtokenizer': ('not-built',),
    'wavtokenizer_encoder': ('not-built',),
    'whisper': ('converts', 'uncenterable-term'),
    'xcodec': ('untraced',),
    'xcodec2': ('untraced',),
    'yolos': ('uncenterable-term',),
}


# The table on earlier releases, as what differs there from the release after: release -> label ->
# outcome before that release (None: no LM class with LayerNorms there). The suite runs on these
# too (pyproject's range); older ones fail the table by what they lack, and the message says so.
SWEEP_BEFORE: dict[str, dict[str, tuple[str, ...] | None]] = {
    "5.24": {
        "omniasr": None,  # added in 5.24
        # 5.23's tiny config cannot be built; 5.24's builds, and it holds no LayerNorm
        "gemma4_unified_assistant": (NOT_BUILT,),
    },
}


# SWEEP_BEFORE's for SWEEP_MODALITIES.
SWEEP_MODALITIES_BEFORE: dict[str, dict[str, tuple[str, ...] | None]] = {
    "5.24": dict.fromkeys(("hy_v4_vl_vision", "omniasr_audio", "omniasr_ctc", "wavtokenizer", "wavtokenizer_encoder")),
}


def sweep_for(version: str, sweep: dict | None = None, earlier: dict | None = None) -> dict[str, tuple[str, ...]]:
    """`sweep` (SWEEP) as it reads on transformers `version`: each later release's differences in
    `earlier` (SWEEP_BEFORE) undone."""
    from packaging.version import Version

    table = dict(SWEEP if sweep is None else sweep)
    earlier = SWEEP_BEFORE if earlier is None else earlier
    for release, before in sorted(earlier.items(), key=lambda kv: Version(kv[0]), reverse=True):
        if Version(version) < Version(release):
            for label, result in before.items():
                if result is None:
                    table.pop(label, None)
                else:
                    table[label] = result
    return table


# Norms that compute in float32 whatever the model's dtype: the converted model's float64 logits
# carry one float32 rounding of a (now centered) norm input, so they are held to float32's scale.
FLOAT32_NORMS = {"olmo": "OlmoLayerNorm runs F.layer_norm on a float32 copy of its input"}


def outcome(label: str, model_type: str, class_name: str):
    """(outcome tuple, discovery or None, meta model or None); the trace's inputs (Trace.fed) are
    the meta model's `traced_inputs`, for the exactness check."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build(model_type, class_name)
    except Exception:
        return (NOT_BUILT,), None, None
    if not layer_norm_paths(model):
        return None, None, model
    tr = trace(model)
    model.traced_inputs = tr.fed
    d = discover(model, tr=tr)
    cats = {f.category or CONVERTS for f in d.norms.values()}
    return tuple(sorted(cats, key=lambda c: (c != CONVERTS, c))), d, model


def inputs_for(model, names: tuple[str, ...] = ("input_ids",), seq: int = 8, seed: int = 1) -> dict:
    """Random inputs, batch 2: token ids (and decoder ids), or an image, spectrogram or waveform
    of the shape the config gives (normswap.inputs, the inputs the meta trace ran on: `names`)."""
    g = torch.Generator().manual_seed(seed)
    if names == ("input_ids",):
        ids = torch.randint(3, VOCAB, (2, seq), generator=g)
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
        if getattr(model.config, "is_encoder_decoder", False):
            out["decoder_input_ids"] = torch.randint(3, VOCAB, (2, seq), generator=g)
        return out
    return model_inputs.build(model, names, batch=2, seq_len=seq, generator=g)


def run_logits(model, inputs) -> torch.Tensor:
    """The logits, or (a model without: a vision or audio model) every float tensor it returns."""
    with torch.no_grad():
        out = model(**inputs)
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    return torch.cat([t.reshape(-1) for t in tensors_in(out) if t.is_floating_point()])


def check_exact(label: str, model_type: str, class_name: str, tmp_path, expected: set[str] | None = None,
                names: tuple[str, ...] = ("input_ids",)) -> str | None:
    """Convert a float64 tiny model in memory (--partial); None when exact, else what is wrong.
    `expected`: the norms the meta-device discovery converts; the real model must convert the same
    ones (else the exactness checked here is not that of the classified plan)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        size = sum(p.numel() for p in build(model_type, class_name).parameters())
        if size > 5_000_000:  # a config the sweep failed to shrink: say so rather than fill memory
            return f"the tiny model has {size} parameters"
        model = build(model_type, class_name, device="cpu", dtype=torch.float64)
    randomize_norms_and_biases(model, 0)
    inputs = inputs_for(model, names)
    ref = run_logits(model, inputs)
    original = copy.deepcopy(model)
    before = {name: (type(mod), {k: v.detach().clone() for k, v in mod.named_parameters()})
              for name, mod in model.named_modules()}
    manifest = convert_model(model, partial=True, check=False)
    converted = [n["path"] for n in manifest["norms"] if n["rms"]]
    for n in manifest["norms"]:  # --partial leaves a refused norm as it was: class, weight and bias
        if not n["rms"]:
            mod = model.get_submodule(n["path"])
            kind, params = before[n["path"]]
            now = dict(mod.named_parameters())
            if type(mod) is not kind or now.keys() != params.keys() or any(
                    not torch.equal(now[k], v) for k, v in params.items()):
                return f"the refused norm {n['path']} was changed"
    if expected is not None and set(converted) != expected:
        return (f"the real model converts other norms than the meta discovery: {sorted(set(converted) ^ expected)}")
    ratios: dict[str, float] = {}

    def hook(path):
        def pre(_m, args):
            x = args[0].double()
            r = (x.mean(-1).abs() / x.pow(2).mean(-1).sqrt().clamp_min(1e-30)).max()
            ratios[path] = max(ratios.get(path, 0.0), float(r))
        return pre

    handles = [model.get_submodule(p).register_forward_pre_hook(hook(p)) for p in converted]
    got = run_logits(model, inputs)
    for h in handles:
        h.remove()
    err = float((got - ref).abs().max() / ref.abs().max())
    tol = 1e-6 if label in FLOAT32_NORMS else 1e-12
    if err > tol:
        return f"logits differ by {err:.3g} of their scale"
    worst = max(ratios.items(), key=lambda kv: kv[1], default=(None, 0.0))
    if len(ratios) != len(converted) or worst[1] > 1e-9:
        return f"the input of {worst[0]} is not zero-mean (|mean|/rms {worst[1]:.3g})"
    model.save_pretrained(tmp_path)
    import transformers

    cls = getattr(transformers, class_name)
    again = run_logits(cls.from_pretrained(tmp_path, dtype=torch.float64).eval(), inputs)
    if torch.equal(again, got):
        return None
    # Some models compute a buffer again on load (DINOv3's RoPE periods in float32), so even the
    # original's reload differs in its last bits: then, and only then, the converted reload is held
    # to the original's reload at the conversion's tolerance.
    original.save_pretrained(tmp_path / "original")
    plain = run_logits(cls.from_pretrained(tmp_path / "original", dtype=torch.float64).eval(), inputs)
    if torch.equal(plain, ref) or float((again - plain).abs().max() / plain.abs().max()) > tol:
        return "the stock from_pretrained reload gives other logits"
    return None


@pytest.fixture(scope="module")
def sweep():
    """label -> (outcome, model type, class name) for every sweep entry with LayerNorms."""
    found = {}
    for label, model_type, class_name in sweep_entries():
        result, d, _ = outcome(label, model_type, class_name)
        if result is not None:
            converting = set() if d is None else {p for p, f in d.norms.items() if f.category is None}
            found[label] = (result, model_type, class_name, converting)
    return found


@pytest.fixture(scope="module")
def modality_sweep():
    """As `sweep`, over the vision and audio models (modality_entries), with the inputs traced."""
    found = {}
    for label, model_type, class_name in modality_entries():
        result, d, model = outcome(label, model_type, class_name)
        if result is not None:
            converting = set() if d is None else {p for p, f in d.norms.items() if f.category is None}
            found[label] = (result, model_type, class_name, converting, getattr(model, "traced_inputs", ()))
    return found


def test_every_layer_norm_architecture_is_classified(sweep):
    import transformers

    expected = sweep_for(transformers.__version__)
    got = {label: r for label, (r, *_) in sweep.items()}
    unknown = {k: v for k, v in got.items() if k not in expected}
    changed = {k: (expected[k], v) for k, v in got.items() if k in expected and expected[k] != v}
    gone = sorted(set(expected) - set(got))
    assert not unknown and not changed and not gone, (
        f"unclassified: {unknown}\nchanged (listed, found): {changed}\nno longer LayerNorm architectures: {gone}"
        f"\n(SWEEP is the table for transformers {SWEEP_TRANSFORMERS}, SWEEP_BEFORE undoes what "
        f"{', '.join(sorted(SWEEP_BEFORE))} changed; this is {transformers.__version__})")
    for table in (SWEEP, *SWEEP_BEFORE.values()):
        for result in table.values():
            assert result is None or set(result) <= {CONVERTS, NOT_BUILT, *REFUSALS}


def test_earlier_releases_differ_where_listed():
    """Each SWEEP_BEFORE entry undoes a real difference (else it is a stale line)."""
    for sweep, earlier in ((SWEEP, SWEEP_BEFORE), (SWEEP_MODALITIES, SWEEP_MODALITIES_BEFORE)):
        for release, before in earlier.items():
            later = sweep_for(release, sweep, earlier)
            for label, result in before.items():
                assert later.get(label) != result, (release, label)


# Architectures whose LayerNorms all sit in another modality's tower, which the sweep's text-only
# forward (input_ids) never runs. Each tower is traced through the model's own get_<x>_features
# method on that input alone (normswap.discover.trace: Trace.more), or, where the model has none,
# through the tower module's own forward, and decided there (None), or, where that does not run on
# the meta device, every tower norm is refused as untraced with the reason (held here by a piece of
# it): never a guess.
TOWERS: dict[str, tuple[str, str | None]] = {
    "audioflamingo3": ("model.audio_tower.", "get_audio_features(input_features) did not run"),  # torch.nonzero
    "glmasr": ("model.audio_tower.", "get_audio_features(input_features) did not run"),
    "musicflamingo": ("model.audio_tower.", "get_audio_features(input_features) did not run"),  # needs input_ids
    "omniasr": ("model.audio_tower.", "get_audio_features(input_values) did not run"),
    "qwen2_audio": ("model.audio_tower.", None),  # no get_<x>_features: the tower's own forward
    "qwen3_asr": ("model.audio_tower.", "get_audio_features(input_features) did not run"),
    "voxtral": ("model.audio_tower.", None),
    # the tiny config's mm_tokens_per_image does not fit its shrunk vision tower: an average pool of stride 0
    "gemma3": ("model.vision_tower.", "get_image_features(pixel_values) did not run"),
    "got_ocr2": ("model.vision_tower.", None),
}


def test_towers_are_traced_on_their_own_input_or_refused_with_the_reason(sweep):
    import transformers

    here = sweep_for(transformers.__version__)
    checked = []
    for label, (tower, why) in sorted(TOWERS.items()):
        if label not in here:  # not in this release (omniasr before 5.24)
            continue
        _, model_type, class_name, _ = sweep[label]
        _, d, model = outcome(label, model_type, class_name)
        assert d is not None and set(d.norms) == set(layer_norm_paths(model)), label
        for path, f in d.norms.items():
            assert path.startswith(tower), (label, path)
            if why is None:  # decided on the tower's own trace: a reason of its graph, never "untraced"
                assert f.category != "untraced", (label, path, f.reason)
            else:
                assert f.category == "untraced" and f.reason.startswith("it never ran in the traced forward; ") \
                    and why in f.reason, (label, path, f.reason)
        checked.append(label)
    assert len(checked) >= 8, checked


def test_every_vision_and_audio_layer_norm_model_is_classified(modality_sweep):
    """SWEEP_MODALITIES is what discovery finds for every vision and audio model class."""
    import transformers

    got = {label: r for label, (r, *_) in modality_sweep.items()}
    expected = sweep_for(transformers.__version__, SWEEP_MODALITIES, SWEEP_MODALITIES_BEFORE)
    unknown = {k: v for k, v in got.items() if k not in expected}
    changed = {k: (expected[k], v) for k, v in got.items() if k in expected and expected[k] != v}
    gone = sorted(set(expected) - set(got))
    assert not unknown and not changed and not gone, (
        f"unclassified: {unknown}\nchanged (listed, found): {changed}\nno longer LayerNorm models: {gone}"
        f"\n(SWEEP_MODALITIES is the table for transformers {SWEEP_TRANSFORMERS}, SWEEP_MODALITIES_BEFORE undoes "
        f"what {', '.join(sorted(SWEEP_MODALITIES_BEFORE))} changed; this is {transformers.__version__})")
    for table in (SWEEP_MODALITIES, *SWEEP_MODALITIES_BEFORE.values()):
        for result in table.values():
            assert result is None or set(result) <= {CONVERTS, NOT_BUILT, *REFUSALS}
    traced = [k for k, v in SWEEP_MODALITIES.items() if v != (NOT_BUILT,) and "untraced" not in v]
    assert len(traced) >= 50, traced  # the forward ran on the derived inputs: readers and a decision


def test_converted_vision_and_audio_models_are_exact(modality_sweep, tmp_path):
    """Every vision or audio model where something converts, fed random inputs of the traced
    shapes: float64 outputs within 1e-12, zero-mean norm inputs, stock reload equal. ViT, DeiT,
    SigLIP's vision tower and Whisper among them."""
    converting = {label for label, (r, *_) in modality_sweep.items() if CONVERTS in r}
    assert {"vit", "deit", "siglip_vision_model", "whisper", "dinov2"} <= converting, converting
    problems = {}
    for label, (result, model_type, class_name, expected, names) in modality_sweep.items():
        if CONVERTS in result:
            why = check_exact(label, model_type, class_name, tmp_path / label, expected, names)
            if why is not None:
                problems[label] = why
    assert not problems, problems


def test_converted_architectures_are_exact(sweep, tmp_path):
    """Every architecture where something converts: float64 logits within 1e-12, zero-mean norm
    inputs, stock reload equal. At least 15 convert whole, with no architecture file."""
    from tests.tiny_models import arch_files

    whole = [label for label, (r, *_) in sweep.items() if r == (CONVERTS,)]
    assert len(whole) >= 15, whole
    assert {"gpt2", "opt", "gpt_neox", "phi", "falcon", "bloom"} <= set(whole) | set(arch_files())
    problems = {}
    for label, (result, model_type, class_name, converting) in sweep.items():
        if CONVERTS in result:
            why = check_exact(label, model_type, class_name, tmp_path / label, converting)
            if why is not None:
                problems[label] = why
    assert not problems, problems


def render_readme(table: dict[str, tuple[str, ...]] | None = None, earlier: dict | None = None) -> str:
    """The README's architecture list, from SWEEP (and SWEEP_BEFORE), or from another sweep's
    table and its earlier releases' differences (SWEEP_MODALITIES and SWEEP_MODALITIES_BEFORE:
    the vision and audio models)."""
    from packaging.version import Version

    sweep_table = SWEEP if table is None else table
    earlier = SWEEP_BEFORE if earlier is None else earlier
    whole = sorted(k for k, v in sweep_table.items() if v == (CONVERTS,))
    partial = sorted(k for k, v in sweep_table.items() if CONVERTS in v and v != (CONVERTS,))
    refused: dict[str, list[str]] = {}
    for k, v in sweep_table.items():
        if CONVERTS not in v and v != (NOT_BUILT,):
            refused.setdefault(", ".join(v), []).append(k)
    not_built = sorted(k for k, v in sweep_table.items() if v == (NOT_BUILT,))
    lines = [f"Converts exactly, every LayerNorm ({len(whole)}): " + ", ".join(f"`{k}`" for k in whole) + ".",
             "",
             f"Converts with `--partial` ({len(partial)}; the rest refused): "
             + "; ".join(f"`{k}` ({', '.join(c for c in sweep_table[k] if c != CONVERTS)})" for k in partial) + ".",
             "",
             f"Refused ({sum(len(v) for v in refused.values())}), by category:"]
    for cats, labels in sorted(refused.items()):
        lines.append(f"- {cats}: " + ", ".join(f"`{k}`" for k in sorted(labels)))
    lines += ["", f"Not built tiny by the sweep ({len(not_built)}; their configs need more than the size knobs, so "
              "whether they hold LayerNorms is not known): " + ", ".join(f"`{k}`" for k in not_built) + "."]
    for release, before in sorted(earlier.items(), key=lambda kv: Version(kv[0]), reverse=True):
        lines += ["", f"Before transformers {release}: " + "; ".join(
            f"`{k}` " + ("absent" if v is None else f"{', '.join(v)}") for k, v in sorted(before.items())) + "."]
    return "\n".join(lines) + "\n"


def test_readme_lists_the_sweep():
    from pathlib import Path

    text = (Path(__file__).parent.parent / "README.md").read_text()
    begin, end = "<!-- sweep:begin -->\n", "<!-- sweep:end -->"
    assert begin in text and end in text
    assert text.split(begin, 1)[1].split(end, 1)[0] == render_readme()
    assert f"class of transformers {SWEEP_TRANSFORMERS.rsplit('.', 1)[0]} with LayerNorms" in text
    begin, end = "<!-- sweep-modalities:begin -->\n", "<!-- sweep-modalities:end -->"
    assert begin in text and end in text
    assert text.split(begin, 1)[1].split(end, 1)[0] == render_readme(SWEEP_MODALITIES, SWEEP_MODALITIES_BEFORE)


if __name__ == "__main__":  # print the observed SWEEP and SWEEP_MODALITIES tables
    for entries in (sweep_entries, modality_entries):
        rows = {}
        for label, model_type, class_name in entries():
            result, _, _ = outcome(label, model_type, class_name)
            if result is not None:
                rows[label] = result
        for k, v in sorted(rows.items()):
            print(f"    {k!r}: {v!r},")
        print()
