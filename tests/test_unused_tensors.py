"""Stored tensors the model built has no place for (loading.unused_tensors): what cannot change the
computation is accepted and said once (bert-base's pooler and next-sentence head under
BertForMaskedLM, 2020-era GPT-2 checkpoints' attn.masked_bias); what would change it is refused (a
norm bias under an RMSNorm, a Linear bias the config turned off, a q_norm of another architecture,
layers past the config's count)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner
from tiny_models import randomize_norms_and_biases, save_tiny, tiny_config, tiny_tokenizer

from normswap import loading
from normswap.cli import cli
from normswap.errors import NormswapError
from normswap.verify import model_output

pytestmark = pytest.mark.usefixtures("small_probes")  # conftest's

BATCH = {"input_ids": torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0))}
BERT_HEADS = ["bert.pooler.dense.bias", "bert.pooler.dense.weight", "cls.seq_relationship.bias",
              "cls.seq_relationship.weight"]


def _saved(cls_name: str, arch: str, d, architectures: list[str], **overrides):
    """A tiny `arch` model built as transformers' `cls_name` (norms and biases randomised), saved in
    `d` with its tokenizer, config.json then naming `architectures`: weights saved from one class,
    a config naming another, as bert-base-uncased's are."""
    import transformers

    torch.manual_seed(0)
    model = randomize_norms_and_biases(getattr(transformers, cls_name)(tiny_config(arch, **overrides))).eval()
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = architectures
    (d / "config.json").write_text(json.dumps(cfg))
    return model


@pytest.fixture(scope="module")
def bert_base_layout(tmp_path_factory):
    """bert-base-uncased's layout: config.json says BertForMaskedLM, the weights are
    BertForPreTraining's (its pooler and next-sentence head too)."""
    d = tmp_path_factory.mktemp("unused") / "bert"
    _saved("BertForPreTraining", "bert", d, ["BertForMaskedLM"])
    return d


def _stock(cls_name: str, d):
    import transformers

    return getattr(transformers, cls_name).from_pretrained(d, output_loading_info=True)


def _legacy_gpt2(d, pickled: bool | str, masked_bias: torch.Tensor | None = None, bare: bool = False):
    """A GPT-2 as a 2020-era transformers saved it: each attention's causal mask `attn.bias` and its
    fill value `attn.masked_bias` (a scalar, -1e4; or `masked_bias`) stored with the weights
    (pytorch_model.bin, its two shards with pickled="sharded", or safetensors). bare: saved as a
    GPT2Model (no `transformer.` prefix, no head), config.json still naming GPT2LMHeadModel."""
    model = save_tiny("gpt2", d)
    prefix = "" if bare else "transformer."
    tensors = {k: v.contiguous() for k, v in (model.transformer if bare else model).state_dict().items()}
    for i in range(2):
        tensors[f"{prefix}h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64, dtype=torch.uint8)).view(1, 1, 64, 64)
        tensors[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4) if masked_bias is None else masked_bias.clone()
    (d / "model.safetensors").unlink()
    if pickled == "sharded":
        names = sorted(tensors)
        shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
        for file, keys in shards.items():
            torch.save({k: tensors[k] for k in keys}, d / file)
        (d / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    elif pickled:
        torch.save(tensors, d / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        tensors.pop("lm_head.weight", None)  # tied: safetensors stores one of the two
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return model


def test_bert_base_layout_loads_as_stock_does_and_says_what_it_drops(bert_base_layout):
    """normswap refused it ('4 tensor(s) the config has no place for: bert.pooler.dense.bias, ...;
    is the config from another model size?'), where stock transformers loads it with a load report
    of the four as unexpected. Now the check before the load and the load's own (one rule) accept
    them as tensors of modules BertForMaskedLM does not build, name the class the weights are, and
    the model computes what stock transformers' does."""
    src = loading.resolve(bert_base_layout)
    unused = loading.check_stored_tensors(src, loading.load_config(src))
    assert unused is not None
    assert (list(unused.not_built), unused.saved_from, unused.buffers) == (BERT_HEADS, "BertForPreTraining", ())
    stock, info = _stock("BertForMaskedLM", bert_base_layout)
    assert info["unexpected_keys"] == set(BERT_HEADS)  # what transformers 5 reports
    assert loading.check_loading_info(stock, info, "x") == loading.UnusedTensors(
        "x", "BertForMaskedLM", tuple(BERT_HEADS), "BertForPreTraining")
    model = loading.load_model(src)
    assert model.normswap_unused_tensors == unused
    assert torch.equal(model_output(model, BATCH)[1], model_output(stock.eval(), BATCH)[1])
    assert "BertForMaskedLM does not build (bert.pooler.dense.bias" in unused.note()


def test_patch_of_the_bert_base_layout_runs_verifies_and_says_it_once(bert_base_layout, tmp_path):
    """`normswap patch` of it: exit 0, one note on stderr naming the tensors, the same record in
    --json; the output holds what BertForMaskedLM loads (the unused tensors are not written), and
    stock transformers loads it with nothing unexpected and the same logits as the source."""
    out = tmp_path / "patched"
    r = CliRunner().invoke(cli, ["patch", str(bert_base_layout), "--impl", "torch", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "4 stored tensor(s) of modules BertForMaskedLM does not build" in notes[0], notes
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["saved_to"] == str(out)
    [unused] = doc["unused_tensors"]
    assert unused["not_built"] == BERT_HEADS and unused["saved_from"] == "BertForPreTraining"
    assert unused["note"] in notes[0]
    reloaded, info = _stock("BertForMaskedLM", out)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    stock, _ = _stock("BertForMaskedLM", bert_base_layout)
    assert torch.equal(model_output(reloaded.eval(), BATCH)[1], model_output(stock.eval(), BATCH)[1])


def test_a_refused_conversion_of_the_bert_base_layout_is_one_error_line(bert_base_layout, tmp_path):
    """`normswap convert` of it is refused (BERT is post-LN): with --json, stderr said the note on
    the unused tensors ("... the load drops them") before the error, for a load that never ran;
    without, the note, the table, then "nothing written: X" and "normswap: error: X", the reason
    twice. Now the error line is the one line on stderr with --json (the report keeps the record),
    and without it the table ends in "nothing written", then the error, once."""
    out = tmp_path / "converted"
    r = CliRunner().invoke(cli, ["convert", str(bert_base_layout), "--to", "rms", "--out", str(out), "--json"])
    assert r.exit_code == 2 and not out.exists()
    assert r.stderr.startswith("normswap: error: nothing converts") and r.stderr.count("\n") == 1, r.stderr
    [unused] = json.loads(r.stdout)["unused_tensors"]
    assert unused["not_built"] == BERT_HEADS
    r = CliRunner().invoke(cli, ["convert", str(bert_base_layout), "--to", "rms", "--out", str(out)])
    assert r.exit_code == 2 and not out.exists() and r.stdout == ""
    lines = r.stderr.splitlines()
    assert not any(ln.startswith("note:") for ln in lines), lines
    assert lines[-2:] == ["nothing written", lines[-1]] and lines[-1].startswith("normswap: error: nothing converts")
    assert sum("nothing converts" in ln for ln in lines) == 1, lines


def test_patch_in_place_would_drop_a_head_and_is_refused(bert_base_layout, tmp_path):
    """--in-place rewrites the folder with what BertForMaskedLM loads: bert-base's pooler and
    next-sentence head would be gone from the user's only copy. Refused before the load, naming
    them and --out; nothing changes."""
    d = tmp_path / "bert"
    shutil.copytree(bert_base_layout, d)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir())
    r = CliRunner().invoke(cli, ["patch", str(d), "--impl", "torch", "--in-place"])
    assert r.exit_code == 2
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("normswap:")]
    # the folder apart from the class (it read 'modules BertForMaskedLM does not build from DIR'), and the
    # class that reads them named where it is known
    assert line == (f"normswap: error: --in-place would remove from {d} 4 stored tensor(s) of modules "
                    "BertForMaskedLM does not build (bert.pooler.dense.bias, bert.pooler.dense.weight, "
                    "cls.seq_relationship.bias and 1 more), which BertForPreTraining reads; write the patched model "
                    "with --out DIR instead")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir()) == before


def test_patch_in_place_of_sharded_pickled_weights_that_would_drop_a_head_is_refused(bert_base_layout, tmp_path):
    """The same layout as sharded pytorch_model-*.bin files with their index: the check before the
    load reads no names of such weights, so --in-place loaded, patched and rewrote the folder as
    one model.safetensors without the pooler and next-sentence head (only a note said they were
    dropped). Refused from what the load dropped, before anything is written; the folder as it was."""
    from safetensors.torch import load_file

    d = tmp_path / "bert"
    shutil.copytree(bert_base_layout, d)
    state = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(state)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: state[k] for k in part}, d / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir())
    r = CliRunner().invoke(cli, ["patch", str(d), "--impl", "torch", "--in-place"])
    assert r.exit_code == 2, r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("normswap:")]
    assert line.startswith(f"normswap: error: --in-place would remove from {d} 4 stored tensor(s) of modules "
                           "BertForMaskedLM does not build (bert.pooler.dense.bias, "), line
    assert sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir()) == before


@pytest.mark.parametrize("pickled", [True, False], ids=["pickled", "safetensors"])
def test_a_gpt2_with_the_buffers_older_transformers_saved_loads(tmp_path, pickled):
    """2020-era GPT-2 fine-tunes hold each attention's attn.bias (the causal mask: GPT-2's class
    declares it ignorable) and attn.masked_bias (the masked scores' fill value, -1e4, which no module
    of transformers 5 has, and which stock transformers reports as unexpected): the second was
    refused. Accepted as a buffer no module reads, said as such; logits equal stock's; --in-place
    may drop it (a constant: nothing is lost), and its output reloads with nothing unexpected."""
    d = tmp_path / "gpt2"
    _legacy_gpt2(d, pickled)
    src = loading.resolve(d)
    masked = ("transformer.h.0.attn.masked_bias", "transformer.h.1.attn.masked_bias")
    unused = loading.check_stored_tensors(src, loading.load_config(src))
    assert unused == loading.UnusedTensors(str(d), "GPT2LMHeadModel", (), None, masked)
    stock, info = _stock("GPT2LMHeadModel", d)
    assert info["unexpected_keys"] == set(masked)
    model = loading.load_model(src)
    assert model.normswap_unused_tensors == unused
    assert torch.equal(model_output(model, BATCH)[1], model_output(stock.eval(), BATCH)[1])
    r = CliRunner().invoke(cli, ["patch", str(d), "--impl", "torch", "--in-place"])
    assert r.exit_code == 0, r.stderr
    assert sum(ln.startswith("note:") for ln in r.stderr.splitlines()) == 1
    reloaded, info = _stock("GPT2LMHeadModel", d)
    assert not info["unexpected_keys"]
    assert torch.equal(model_output(reloaded.eval(), BATCH)[1], model_output(stock.eval(), BATCH)[1])


@pytest.mark.parametrize("pickled", [True, "sharded", False], ids=["pickled", "sharded", "safetensors"])
def test_a_masked_bias_that_is_not_the_old_scalar_buffer_is_refused(tmp_path, pickled):
    """masked_bias was accepted by its name alone, whatever it held: a tensor of 32 values under it
    is no fill constant but a weight of the model the checkpoint was saved from, which GPT-2 would
    run without. Only what 2020-era transformers stored (a scalar: torch.tensor(-1e4)) is the old
    buffer; anything else is refused as any tensor without a place is, before the load (its shape
    read from the files: safetensors headers, a pickled file on the meta device; sharded pickled
    weights are checked for missing tensors only there) and by the load's own check (shards
    read on the meta device)."""
    d = tmp_path / "gpt2"
    _legacy_gpt2(d, pickled, masked_bias=torch.full((32,), -1e4))
    src = loading.resolve(d)
    says = ("2 tensor(s) the config has no place for: transformer.h.0.attn.masked_bias, "
            "transformer.h.1.attn.masked_bias")
    if pickled != "sharded":
        with pytest.raises(NormswapError, match=re.escape(says)):
            loading.check_stored_tensors(src, loading.load_config(src))
    r = CliRunner().invoke(cli, ["patch", str(d), "--impl", "torch"])
    [error] = [ln for ln in r.stderr.splitlines() if ln.startswith("normswap: error:")]
    assert r.exit_code == 2 and says in error and "Traceback" not in r.stderr, r.stderr
    stock, info = _stock("GPT2LMHeadModel", d)
    with pytest.raises(NormswapError, match=re.escape(says)):
        loading.check_loading_info(stock, info, str(d), stored=d)


@pytest.mark.parametrize("pickled", [True, "sharded", False], ids=["pickled", "sharded", "safetensors"])
def test_the_old_scalar_masked_bias_is_accepted_in_every_layout(tmp_path, pickled):
    """The shape check reads each layout: the scalar is found as such in one pickled file, in
    shards, and in safetensors, before the load and after it."""
    d = tmp_path / "gpt2"
    _legacy_gpt2(d, pickled)
    src = loading.resolve(d)
    masked = ("transformer.h.0.attn.masked_bias", "transformer.h.1.attn.masked_bias")
    before = loading.check_stored_tensors(src, loading.load_config(src))
    assert before is None if pickled == "sharded" else before.buffers == masked  # see the test above
    stock, info = _stock("GPT2LMHeadModel", d)
    assert loading.check_loading_info(stock, info, str(d), stored=d).buffers == masked
    assert loading.load_model(src).normswap_unused_tensors.buffers == masked


@pytest.mark.parametrize("pickled", [True, "sharded", False], ids=["pickled", "sharded", "safetensors"])
def test_a_bare_gpt2_checkpoint_with_the_old_buffer_loads_as_the_prefixed_one_does(tmp_path, pickled):
    """The same checkpoint saved as a GPT2Model (h.0.attn.masked_bias, no `transformer.` prefix),
    config naming GPT2LMHeadModel: transformers loads it under the prefix and reports the buffer
    by its stored name, which unused_tensors looked up as a module of the head model, found none
    and refused ("2 tensor(s) the config has no place for: h.0.attn.masked_bias, ..."), where the
    prefixed copy loaded. Now both load alike: the scalar is accepted (before the load, after it,
    and by `normswap patch`), a 32-value tensor under the name refused."""
    masked = ("h.0.attn.masked_bias", "h.1.attn.masked_bias")  # as transformers reports them
    d = tmp_path / "gpt2"
    _legacy_gpt2(d, pickled, bare=True)
    src = loading.resolve(d)
    before = loading.check_stored_tensors(src, loading.load_config(src))
    assert before is None if pickled == "sharded" else before.buffers == masked  # shards: names only there
    stock, info = _stock("GPT2LMHeadModel", d)
    assert info["unexpected_keys"] == set(masked)
    assert loading.check_loading_info(stock, info, str(d), stored=d).buffers == masked
    model = loading.load_model(src)
    assert model.normswap_unused_tensors.buffers == masked
    assert torch.equal(model_output(model, BATCH)[1], model_output(stock.eval(), BATCH)[1])
    r = CliRunner().invoke(cli, ["patch", str(d), "--impl", "torch", "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.stderr
    assert sum(ln.startswith("note:") for ln in r.stderr.splitlines()) == 1

    d = tmp_path / "gpt2-32"
    _legacy_gpt2(d, pickled, masked_bias=torch.full((32,), -1e4), bare=True)
    src = loading.resolve(d)
    says = "2 tensor(s) the config has no place for: h.0.attn.masked_bias, h.1.attn.masked_bias"
    with pytest.raises(NormswapError, match=re.escape(says)):
        loading.load_model(src)


def test_convert_of_a_model_saved_with_another_head_runs_verifies_and_leaves_the_head_out(tmp_path):
    """A GPT-2 saved from GPT2DoubleHeadsModel (its multiple-choice head) with the legacy
    masked_bias, config naming GPT2LMHeadModel: convert was refused for 'no place for'. It converts
    and verifies now; the multiple-choice head reads the final norm's output, which the conversion
    changes (its γ folds into lm_head), so it is not written (carried, a GPT2DoubleHeadsModel load
    of the output would compute another multiple-choice score, unverified); the masked_bias
    buffers, which nothing reads, are carried as stored. The output loads in stock transformers
    with nothing unexpected but them, and its logits are the source's."""
    d = tmp_path / "doubleheads"
    _saved("GPT2DoubleHeadsModel", "gpt2", d, ["GPT2LMHeadModel"])
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    tensors.update({f"transformer.h.{i}.attn.masked_bias": torch.tensor(-1e4) for i in range(2)})
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "converted"
    r = CliRunner().invoke(cli, ["convert", str(d), "--to", "rms", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.stderr
    [unused] = json.loads(r.stdout)["unused_tensors"]
    assert unused["not_built"] == ["multiple_choice_head.summary.bias", "multiple_choice_head.summary.weight"]
    assert unused["saved_from"] == "GPT2DoubleHeadsModel"
    assert unused["buffers"] == ["transformer.h.0.attn.masked_bias", "transformer.h.1.attn.masked_bias"]
    assert sum(ln.startswith("note:") for ln in r.stderr.splitlines()) == 1
    stored = set(load_file(out / "model.safetensors"))
    assert not any(k.startswith("multiple_choice_head.") for k in stored)
    # the folder says it (the report was not kept): the manifest names what it does not hold
    assert json.loads((out / "normswap.json").read_text())["convert"]["dropped"] == unused["not_built"]
    assert {"transformer.h.0.attn.masked_bias", "transformer.h.1.attn.masked_bias"} <= stored
    converted, info = _stock("GPT2LMHeadModel", out)
    assert info["unexpected_keys"] == {"transformer.h.0.attn.masked_bias", "transformer.h.1.attn.masked_bias"}
    source, _ = _stock("GPT2LMHeadModel", d)
    torch.testing.assert_close(model_output(converted.eval(), BATCH)[1], model_output(source.eval(), BATCH)[1],
                               rtol=1e-4, atol=1e-4)


def test_a_non_persistent_buffer_older_transformers_saved_is_accepted(tmp_path):
    """GPT-Neo builds its causal mask attn.attention.bias as a non-persistent buffer (computed from
    the config); older checkpoints stored it, with masked_bias beside it. Both are buffers no
    stored value of which the model reads: found from the module (its non-persistent buffers),
    not from a list."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    d = tmp_path / "neo"
    config = GPTNeoConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
                          attention_types=[[["global", "local"], 1]], window_size=16, intermediate_size=48)
    model = randomize_norms_and_biases(GPTNeoForCausalLM(config)).eval()
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    for i in range(2):
        tensors[f"transformer.h.{i}.attn.attention.bias"] = torch.tril(torch.ones(1, 1, 64, 64, dtype=torch.bool))
        tensors[f"transformer.h.{i}.attn.attention.masked_bias"] = torch.tensor(-1e9)
    model.save_pretrained(d)
    torch.save(tensors, d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    src = loading.resolve(d)
    unused = loading.check_stored_tensors(src, loading.load_config(src))
    assert unused is not None and not unused.not_built
    assert set(unused.buffers) == {f"transformer.h.{i}.attn.attention.{b}" for i in range(2)
                                   for b in ("bias", "masked_bias")}
    assert loading.load_model(src).normswap_unused_tensors == unused


def _llama_with(d, extra: dict, **config_changes):
    from safetensors.torch import load_file, save_file

    save_tiny("llama", d)
    tensors = load_file(d / "model.safetensors")
    save_file({**tensors, **extra}, d / "model.safetensors", metadata={"format": "pt"})
    if config_changes:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(config_changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return loading.resolve(d)


@pytest.mark.parametrize("extra, says", [
    # a LayerNorm's bias under an RMSNorm-configured model: the norm computed with it
    ({"model.norm.bias": torch.randn(32), "model.layers.0.input_layernorm.bias": torch.randn(32)},
     "2 tensor(s) the config has no place for: model.layers.0.input_layernorm.bias, model.norm.bias"),
    # a Linear bias the config turned off (attention_bias false)
    ({"model.layers.1.self_attn.q_proj.bias": torch.randn(32)},
     "1 tensor(s) the config has no place for: model.layers.1.self_attn.q_proj.bias"),
    # a Qwen3-style q_norm under a Llama config: a module no Llama class builds, inside the layer
    ({"model.layers.0.self_attn.q_norm.weight": torch.randn(8)},
     "1 tensor(s) the config has no place for: model.layers.0.self_attn.q_norm.weight"),
    # a head no class of the config builds (LlamaForSequenceClassification's score would be accepted)
    ({"classifier.weight": torch.randn(2, 32)}, "1 tensor(s) the config has no place for: classifier.weight"),
])
def test_tensors_that_would_change_the_computation_are_still_refused(tmp_path, extra, says):
    """Refused, with a hint that fits: none of these is a size (the line ended 'is the config from
    another model size?', sending the user to look for a size that is the same)."""
    src = _llama_with(tmp_path / "llama", extra)
    for check in (lambda: loading.check_stored_tensors(src, loading.load_config(src)), lambda: loading.load_model(src)):
        with pytest.raises(NormswapError) as e:
            check()
        assert str(e.value) == (f"{src.path}: the weights do not match config.json ({says}); is the config from "
                                "another model?")
    r = CliRunner().invoke(cli, ["patch", str(src.path), "--impl", "torch"])
    assert r.exit_code == 2 and says in r.stderr and "note:" not in r.stderr


def test_a_layer_past_the_config_is_refused_beside_a_head_that_is_accepted(tmp_path):
    """BertForPreTraining's weights of 3 layers under a 2-layer BertForMaskedLM config: the pooler and
    next-sentence head are no fault, the third layer is, said with the layer count as before."""
    d = tmp_path / "bert"
    _saved("BertForPreTraining", "bert", d, ["BertForMaskedLM"], num_hidden_layers=3)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    src = loading.resolve(d)
    with pytest.raises(NormswapError) as e:
        loading.check_stored_tensors(src, loading.load_config(src))
    assert str(e.value) == (f"{d}: the weights do not match config.json (num_hidden_layers is 2 there, but the weights "
                            "hold 3 layers: 16 tensor(s) of bert.encoder.layer.2 the config has no place for); is the "
                            "config from another model size?")


def test_convert_leaves_out_a_dropped_head_stored_under_a_legacy_name(tmp_path):
    """transformers renames every checkpoint's legacy LayerNorm.gamma / .beta to .weight / .bias
    on load (its "legacy" conversion mapping), a head's too. A Megatron-BERT (its own norms are
    named `ln`, so the checkpoint streams) saved from MegatronBertForPreTraining with the MLM
    head's LayerNorm under the old names, config naming MegatronBertForNextSentencePrediction:
    convert dropped the head by the loaded names and wrote cls.predictions.transform.LayerNorm
    .gamma and .beta into the output anyway, while its normswap.json said they were dropped."""
    import transformers
    from safetensors.torch import load_file, save_file

    d = tmp_path / "megatron"
    config = transformers.MegatronBertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=64, vocab_size=96, max_position_embeddings=64,
                                             architectures=["MegatronBertForNextSentencePrediction"])
    torch.manual_seed(0)
    model = randomize_norms_and_biases(transformers.MegatronBertForPreTraining(config))
    tensors = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"):
               v.contiguous().clone() for k, v in model.state_dict().items()}
    assert {"cls.predictions.transform.LayerNorm.gamma", "cls.predictions.transform.LayerNorm.beta"} <= set(tensors)
    d.mkdir()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(d)
    out = tmp_path / "converted"
    r = CliRunner().invoke(cli, ["convert", str(d), "--to", "rms", "--partial", "--out", str(out)])
    assert r.exit_code == 0, r.stderr
    dropped = json.loads((out / "normswap.json").read_text())["convert"]["dropped"]
    assert "cls.predictions.transform.LayerNorm.weight" in dropped
    stored = set(load_file(out / "model.safetensors"))
    assert not any(k.startswith("cls.predictions.") for k in stored), sorted(stored)
    assert {"cls.seq_relationship.weight", "bert.pooler.dense.weight"} <= stored  # what the class builds
    converted, info = transformers.MegatronBertForNextSentencePrediction.from_pretrained(
        out, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]


def test_convert_of_pickled_weights_names_what_the_output_does_not_hold(tmp_path):
    """Pickled weights are loaded whole and saved with transformers, which keeps neither the
    legacy masked_bias buffers nor a head the class does not build: the manifest's "dropped" names
    them (it said nothing: the folder gave no sign that it holds less than its source)."""
    d = tmp_path / "gpt2"
    _legacy_gpt2(d, pickled=True)
    state = torch.load(d / "pytorch_model.bin", weights_only=True)
    state["multiple_choice_head.summary.weight"] = torch.randn(1, 32)
    state["multiple_choice_head.summary.bias"] = torch.randn(1)
    torch.save(state, d / "pytorch_model.bin")
    out = tmp_path / "converted"
    r = CliRunner().invoke(cli, ["convert", str(d), "--to", "rms", "--out", str(out)])
    assert r.exit_code == 0, r.stderr
    dropped = json.loads((out / "normswap.json").read_text())["convert"]["dropped"]
    assert dropped == ["multiple_choice_head.summary.bias", "multiple_choice_head.summary.weight",
                       "transformer.h.0.attn.masked_bias", "transformer.h.1.attn.masked_bias"]
    from safetensors.torch import load_file

    assert not set(dropped) & set(load_file(out / "model.safetensors"))
