"""Tiny models of any transformers model type, from its config class's defaults shrunk to a few
thousand parameters: for sweeps over every architecture the installed transformers has."""

from __future__ import annotations

import inspect

import torch

VOCAB = 96
HIDDEN = 32

# Size knobs, under every name the configs of transformers use for them.
_SIZES = {
    HIDDEN: ("hidden_size", "n_embd", "d_model", "embed_dim", "n_embed", "model_dim", "word_embed_proj_dim"),
    2: ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
        "num_decoder_layers", "num_encoder_layers", "num_key_value_heads", "num_kv_heads",
        "num_experts_per_tok", "moe_topk", "top_k"),
    4: ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
        "n_heads", "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
        "num_frames"),  # a video model's clip: 16 or 32 frames of 196 patches are thousands of positions
    8: ("head_dim", "d_kv", "kv_channels", "attention_head_size", "qk_rope_head_dim", "v_head_dim",
        "qk_nope_head_dim"),
    48: ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim",
         "ffn_hidden_size", "decoder_intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"),
    64: ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length"),
    VOCAB: ("vocab_size",),
}
# Config values a few types need on top of the sizes (their validators tie them to the layer count).
_EXTRA = {"gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
          # its Swin backbone_config is built from a dict the size knobs do not reach (87M parameters)
          "maskformer": dict(backbone_config=dict(model_type="swin", embed_dim=16, depths=[1, 1, 1, 1],
                                                  num_heads=[1, 1, 1, 1],
                                                  out_features=["stage1", "stage2", "stage3", "stage4"]),
                             fpn_feature_size=32),
          # its spectrograms' frames (the position table is built for exactly that many): 1024 by default
          "audio-spectrogram-transformer": dict(max_length=64)}
_TOKENS = dict(pad_token_id=1, bos_token_id=2, eos_token_id=2, decoder_start_token_id=0)


def tiny_config(model_type: str, sub_configs: bool = True):
    """The config class's defaults with every size knob it has set small (and, with sub_configs,
    so for its sub-configs: a multimodal model's text and vision configs)."""
    from transformers import CONFIG_MAPPING

    return _tiny(CONFIG_MAPPING[model_type], model_type, 0 if sub_configs else 1)


def _tiny(cls, model_type: str, depth: int = 0):
    from transformers import PretrainedConfig

    default = cls()
    params = set(inspect.signature(cls.__init__).parameters)

    def knob(name: str) -> bool:  # a constructor argument or a plain attribute (not a property)
        return name in params or (hasattr(default, name) and not isinstance(getattr(cls, name, None), property))

    kwargs = {}
    for value, names in _SIZES.items():
        for name in names:
            if knob(name):
                kwargs[name] = value
    for name, value in _TOKENS.items():
        if knob(name):
            kwargs[name] = value
    kwargs.update(_EXTRA.get(model_type, {}))
    if knob("rotary_dim"):
        kwargs["rotary_dim"] = 4  # within the tiny head size
    if knob("q_lora_rank"):
        kwargs.update(q_lora_rank=16, kv_lora_rank=16)
    if depth == 0:
        for name in params:
            sub = getattr(default, name, None)
            if isinstance(sub, PretrainedConfig):
                try:
                    kwargs[name] = _tiny(type(sub), sub.model_type, depth + 1).to_dict()
                except Exception:  # a sub-config that will not shrink keeps its defaults
                    pass
    return cls(**kwargs)


def sweep_entries() -> list[tuple[str, str, str]]:
    """(label, model type, class name) for every causal-LM class and every sequence-to-sequence LM
    class of the installed transformers; a type with both gets both ("bart", "bart:seq2seq")."""
    from transformers.models.auto import modeling_auto as auto

    causal, seq2seq = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    out = [(t, t, causal[t]) for t in causal]
    out += [(f"{t}:seq2seq" if t in causal else t, t, seq2seq[t]) for t in seq2seq]
    return sorted(out)


def build(model_type: str, class_name: str, device: str = "meta", dtype: torch.dtype = torch.float32,
          seed: int = 0):
    """The tiny model; where shrinking the sub-configs breaks a validator, with their defaults."""
    import transformers

    cls = getattr(transformers, class_name)
    try:
        config = tiny_config(model_type)
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(config)
    except Exception:
        config = tiny_config(model_type, sub_configs=False)
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(config)
    return model.to(dtype).eval()


def modality_entries() -> list[tuple[str, str, str]]:
    """(label, model type, class name) for every base model class of the installed transformers
    whose forward mainly reads another modality than token ids (normswap.inputs.MODALITY_INPUTS:
    an image, a spectrogram, a waveform): the vision and audio models, and the towers of the
    multimodal LMs that transformers also lists as models of their own."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    from normswap.inputs import MODALITY_INPUTS

    out = []
    for model_type, class_name in sorted(auto.MODEL_MAPPING_NAMES.items()):
        if not isinstance(class_name, str):
            continue
        try:
            cls = getattr(transformers, class_name)
            main = cls.main_input_name
        except Exception:  # noqa: BLE001  (a class whose extra library is not installed: torchaudio)
            continue
        if main in MODALITY_INPUTS:
            out.append((model_type, model_type, class_name))
    return out
