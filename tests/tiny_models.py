"""Tiny random models (hidden <= 64, 2 layers) for every architecture the tests cover.

Norm weights and all biases are randomised: all-ones gains and zero biases hide bugs (a fold that
forgets γ, a swap that drops a bias, a Gemma offset applied twice all pass on them).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=48, max_position_embeddings=64)


def _llama_like(**extra):
    return dict(COMMON, num_key_value_heads=2, **extra)


# model_type -> (config class name, model class name, config kwargs)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _llama_like(rms_norm_eps=1e-5)),
    "mistral": ("MistralConfig", "MistralForCausalLM", _llama_like(rms_norm_eps=1e-6)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _llama_like(rms_norm_eps=1e-6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _llama_like(rms_norm_eps=1e-6, head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _llama_like(rms_norm_eps=1e-5, pad_token_id=0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", _llama_like(rms_norm_eps=1e-6, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", _llama_like(rms_norm_eps=1e-6, head_dim=8)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    _llama_like(rms_norm_eps=1e-6, head_dim=8, sliding_window=16)),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                layer_norm_epsilon=1e-6, decoder_start_token_id=0)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, layer_norm_epsilon=1e-5)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 ffn_dim=48, max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(COMMON, layer_norm_eps=1e-5)),
    "bloom": ("BloomConfig", "BloomForCausalLM",
              dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, layer_norm_epsilon=1e-5)),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    new_decoder_architecture=False, parallel_attn=True, bias=True, alibi=False)),
    "falcon_new": ("FalconConfig", "FalconForCausalLM",
                   dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_kv_heads=2, new_decoder_architecture=True, num_ln_in_parallel_attn=2,
                        bias=True, alibi=False)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(COMMON, layer_norm_eps=1e-5, partial_rotary_factor=0.5)),
    "bert": ("BertConfig", "BertModel",
             dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=48, max_position_embeddings=64, layer_norm_eps=1e-12)),
}


# Special tokens inside the tiny vocabulary (the configs' defaults point past it).
for _cfg in ARCHS.values():
    _cfg[2].update(bos_token_id=2, eos_token_id=2, pad_token_id=1)


def tiny_config(arch: str, **overrides):
    """arch's tiny config; overrides: fields set on top (phi's qk_layernorm=True)."""
    import transformers

    cfg_name, _, kwargs = ARCHS[arch]
    return getattr(transformers, cfg_name)(**kwargs | overrides)


def randomize_norms_and_biases(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every norm weight a spread around its init and every bias a random value: every
    parameter whose name ends in "bias" (GPT-NeoX-Japanese's dense_bias, a bias vector added into
    the stream as is, is zeros at init and would hide a conversion that forgets to center it)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            is_norm = "norm" in type(mod).__name__.lower()
            for name, p in mod.named_parameters(recurse=False):
                noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
                if is_norm:
                    p.add_((0.3 * noise).to(p.dtype))
                elif name.endswith("bias"):
                    p.copy_((0.1 * noise).to(p.dtype))
    return model


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    import transformers

    _, model_name, _ = ARCHS[arch]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(tiny_config(arch, **overrides))
    randomize_norms_and_biases(model, seed)
    return model.to(dtype).eval()


def tiny_tokenizer():
    """A byte-level word-piece-free tokenizer over a VOCAB-sized alphabet (printable ASCII)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + VOCAB - 3)]
    vocab = {"<unk>": 0, "<pad>": 1, "<s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>")


def save_tiny(arch: str, directory: str | Path, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """Write a tiny model with its tokenizer as a normal checkpoint directory; return the model.
    overrides: config fields (tiny_config's)."""
    model = tiny_model(arch, dtype, seed, **overrides)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return model


def arch_files() -> list[str]:
    """The model types normswap/archs/ holds a data file for."""
    return sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "normswap" / "archs").glob("*.toml"))
