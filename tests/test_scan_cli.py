"""`normswap scan` end to end through click: --json parsed and checked against the tiny models,
readers for the architectures the convert command folds into, bad inputs, --strict."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from click.testing import CliRunner
from tiny_models import ARCHS, save_tiny, tiny_config

from normswap.cli import cli

L = 2  # layers in every tiny model


def run(*args):
    result = CliRunner().invoke(cli, ["scan", *args])
    return result


def scan_json(path) -> dict:
    result = run(str(path), "--json")
    assert result.exit_code == 0, (result.output, result.stderr)
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny checkpoints written once per module: {arch: (directory, model)}."""
    cache = {}

    def get(arch):
        if arch not in cache:
            d = tmp_path_factory.mktemp(arch)
            cache[arch] = (d, save_tiny(arch, d))
        return cache[arch]

    return get


def _norm_counts_in(model) -> Counter:
    return Counter(type(m).__name__ for _, m in model.named_modules()
                   if isinstance(m, torch.nn.LayerNorm) or type(m).__name__.endswith(("RMSNorm", "LayerNorm")))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_scan_json_matches_the_checkpoint(saved, arch):
    directory, model = saved(arch)
    doc = scan_json(directory)
    assert Counter(n["class"] for n in doc["norms"]) == _norm_counts_in(model)
    assert doc["summary"]["norms"] == len(doc["norms"]) and doc["summary"]["unknown"] == 0
    assert sum(doc["summary"]["by_kind"].values()) == len(doc["norms"])
    cfg = tiny_config(arch)
    # OPT's config has no eps: its nn.LayerNorms keep torch's default.
    eps = next((getattr(cfg, a) for a in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon") if hasattr(cfg, a)),
               1e-5)
    assert {n["eps"] for n in doc["norms"]} == {eps}
    # Every row names a real module of that class, with the shape of its weight.
    modules = dict(model.named_modules())
    for n in doc["norms"]:
        m = modules[n["path"]]
        assert type(m).__name__ == n["class"]
        assert n["shape"] == list(m.weight.shape) and n["has_weight"] is True
        assert n["has_bias"] == (getattr(m, "bias", None) is not None)
        assert n["readers"], f"{arch}: {n['path']} has no reader"


def test_a_scan_row_holds_the_norm_spec_under_its_own_names(saved):
    """One name per concept: a row's spec fields are NormSpec's (has_weight, has_bias, as a patch
    manifest's "spec" holds them), so the row rebuilds the very spec the registry recognised."""
    from dataclasses import fields

    from normswap.registry import recognise
    from normswap.specs import NormSpec

    directory, model = saved("gpt2")
    names = {f.name for f in fields(NormSpec)}
    for n in scan_json(directory)["norms"]:
        assert set(n) == {"path", "class", *names, "readers", "recognised_by", "bit_exact", "to_rms"}
        spec = NormSpec.from_dict({k: n[k] for k in names})
        assert spec == recognise(model.get_submodule(n["path"])).spec


def test_scan_family_fields(saved):
    gemma = scan_json(saved("gemma3_text")[0])
    assert {(n["offset"], n["casting"]) for n in gemma["norms"]} == {(1.0, "gemma")}
    qk = [n for n in gemma["norms"] if n["path"].endswith(("q_norm", "k_norm"))]
    assert len(qk) == 2 * L and {tuple(n["shape"]) for n in qk} == {(8,)}
    qwen = scan_json(saved("qwen3")[0])
    assert len([n for n in qwen["norms"] if n["path"].endswith(("q_norm", "k_norm"))]) == 2 * L
    assert {n["casting"] for n in qwen["norms"]} == {"llama"}
    t5 = scan_json(saved("t5")[0])
    assert {(n["kind"], n["casting"], n["eps_attr"]) for n in t5["norms"]} == {("rms", "t5", "variance_epsilon")}
    gpt2 = scan_json(saved("gpt2")[0])
    assert {(n["kind"], n["casting"], n["offset"]) for n in gpt2["norms"]} == {("layer", "none", 0.0)}
    assert gpt2["summary"]["by_kind"] == {"layer": 2 * L + 1}
    # How each was recognised, and whether the reference reproduces it bit for bit.
    assert {(n["recognised_by"], n["bit_exact"]) for n in qwen["norms"]} == {("fingerprint:LlamaRMSNorm", True)}
    assert {(n["recognised_by"], n["bit_exact"]) for n in gpt2["norms"]} == {("torch-class", False)}


# What reads each norm, per architecture: layer 0's norms and the final one. For a LayerNorm that
# converts, these are the modules `normswap convert` folds gains and biases into
# (test_scan_readers_are_the_fold_readers).
EXPECTED_READERS = {
    "llama": {
        "model.layers.0.input_layernorm": ["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"],
        "model.layers.0.post_attention_layernorm": ["mlp.gate_proj", "mlp.up_proj"],
        "model.norm": ["lm_head"],
    },
    "phi3": {  # fused projections: one module reads the norm for q, k and v (and for gate and up)
        "model.layers.0.input_layernorm": ["self_attn.qkv_proj"],
        "model.layers.0.post_attention_layernorm": ["mlp.gate_up_proj"],
        "model.norm": ["lm_head"],
    },
    "qwen3": {  # q/k norms are read by their attention module's own code (the rotary embedding)
        "model.layers.0.self_attn.q_norm": [""],
        "model.layers.0.self_attn.k_norm": [""],
        "model.layers.0.input_layernorm": ["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"],
    },
    "t5": {  # the encoder's final norm feeds every decoder cross-attention's k and v, and leaves the
        # model as is (the output's encoder_last_hidden_state)
        "encoder.block.0.layer.0.layer_norm": ["SelfAttention.k", "SelfAttention.q", "SelfAttention.v"],
        "decoder.block.0.layer.2.layer_norm": ["DenseReluDense.wi"],
        "encoder.final_layer_norm": ["=<output>", *(f"=decoder.block.{i}.layer.1.EncDecAttention.{p}"
                                                    for i in range(L) for p in "kv")],
    },
    "bert": {  # post-LN: the norm's output is the stream the next block reads
        "encoder.layer.0.attention.output.LayerNorm": ["=encoder.layer.0.intermediate.dense",
                                                       "=encoder.layer.0.output"],
    },
    "gpt2": {
        "transformer.h.0.ln_1": ["attn.c_attn"],
        "transformer.h.0.ln_2": ["mlp.c_fc"],
        "transformer.ln_f": ["lm_head"],
    },
    "opt": {
        "model.decoder.layers.0.self_attn_layer_norm": ["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"],
        "model.decoder.layers.0.final_layer_norm": ["fc1"],
        "model.decoder.final_layer_norm": ["lm_head"],
    },
    "gpt_neox": {
        "gpt_neox.layers.0.input_layernorm": ["attention.query_key_value"],
        "gpt_neox.layers.0.post_attention_layernorm": ["mlp.dense_h_to_4h"],
        "gpt_neox.final_layer_norm": ["lm_head"],
    },
    "phi": {  # parallel block: one norm feeds attention and MLP
        "model.layers.0.input_layernorm": ["mlp.fc1", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"],
        "model.final_layernorm": ["lm_head"],
    },
    "falcon": {  # parallel attention, one norm
        "transformer.h.0.input_layernorm": ["mlp.dense_h_to_4h", "self_attention.query_key_value"],
        "transformer.ln_f": ["lm_head"],
    },
    "falcon_new": {
        "transformer.h.0.ln_attn": ["self_attention.query_key_value"],
        "transformer.h.0.ln_mlp": ["mlp.dense_h_to_4h"],
        "transformer.ln_f": ["lm_head"],
    },
    "bloom": {  # the embedding norm's output is the residual stream: the first block reads it too
        "transformer.word_embeddings_layernorm": ["h.0.input_layernorm", "h.0.self_attention"],
        "transformer.h.0.input_layernorm": ["self_attention.query_key_value"],
        "transformer.h.0.post_attention_layernorm": ["mlp.dense_h_to_4h"],
        "transformer.ln_f": ["lm_head"],
    },
}


def _absolute(norm_path: str, rel: str) -> str:
    """Readers are written relative to the norm's parent ("" is the parent itself); "=path" and
    lm_head are absolute."""
    parent = norm_path.rpartition(".")[0]
    if rel == "lm_head" or rel.startswith("="):
        return rel.removeprefix("=")
    return f"{parent}.{rel}" if rel else parent


@pytest.mark.parametrize("arch", sorted(EXPECTED_READERS))
def test_readers(saved, arch):
    doc = scan_json(saved(arch)[0])
    rows = {n["path"]: n["readers"] for n in doc["norms"]}
    assert doc["readers_note"] is None
    for norm, rel in EXPECTED_READERS[arch].items():  # listed in module order: compared as sets
        assert sorted(rows[norm]) == sorted(_absolute(norm, r) for r in rel), (norm, rows[norm])
        assert len(set(rows[norm])) == len(rows[norm])


LAYER_NORM_ARCHS = ("gpt2", "opt", "gpt_neox", "bloom", "falcon", "falcon_new", "phi")


@pytest.mark.parametrize("arch", LAYER_NORM_ARCHS)
def test_scan_readers_are_the_fold_readers(arch):
    """One concept, one trace: a LayerNorm that convert's discovery converts folds into exactly the
    readers the scan lists, in the same order (BLOOM's baked embedding norm excepted: it folds into
    its token table, "<residual stream>", while the scan lists the modules that read that stream)."""
    import transformers

    from normswap.discover import STREAM
    from normswap.plan import plan_conversion
    from normswap.scan import scan_model

    with torch.device("meta"):
        model = getattr(transformers, ARCHS[arch][1])(tiny_config(arch))
    plan = plan_conversion(model, model.config, arch_data=False)
    readers = {n["path"]: n["readers"] for n in scan_model(model, warn=False)["norms"]}
    converted = [d for d in plan.norms if d.rms and d.readers != [STREAM]]
    assert converted, arch
    for d in converted:
        assert d.readers == readers[d.path], (d.path, d.readers, readers[d.path])


def test_sandwich_post_norms_are_read_by_their_layer(saved):
    """Gemma 2/3 post-norms write into the residual stream: the layer's own add reads them."""
    doc = scan_json(saved("gemma3_text")[0])
    rows = {n["path"]: n["readers"] for n in doc["norms"]}
    assert rows["model.layers.0.post_attention_layernorm"] == ["model.layers.0"]
    assert rows["model.layers.1.post_feedforward_layernorm"] == ["model.layers.1"]


def test_human_table(saved):
    directory, _ = saved("llama")
    result = run(str(directory))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "model.layers.0.input_layernorm" in out and "LlamaRMSNorm" in out
    assert "self_attn.q_proj" in out
    assert f"{2 * L + 1} norms ({2 * L + 1} rms; {2 * L + 1} LlamaRMSNorm); 0 unknown" in out


def test_the_table_gives_eps_as_the_json_does(tmp_path):
    """The table said 1e-05 where the JSON (and patch's table) said 9.999999747378752e-06, the
    float32 1e-5 that SmolLM2's GGUF stores: one number, shown one way."""
    directory = tmp_path / "llama"
    save_tiny("llama", directory)
    config = json.loads((directory / "config.json").read_text())
    config["rms_norm_eps"] = float(torch.tensor(1e-5, dtype=torch.float32))
    (directory / "config.json").write_text(json.dumps(config))
    eps = {n["eps"] for n in json.loads(run(str(directory), "--json").stdout)["norms"]}
    assert eps == {9.999999747378752e-06}
    result = run(str(directory))
    assert result.exit_code == 0, result.output
    assert result.stdout.count(" 9.999999747378752e-06 ") == 2 * L + 1 and "1e-05" not in result.stdout


# ---- bad input: one line on stderr, exit 2, nothing on stdout


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def bad_inputs(tmp_path):
    return {
        "missing path": str(tmp_path / "nope"),
        "directory without config.json": str((tmp_path / "empty").mkdir() or tmp_path / "empty"),
        "a file that is not a model": str(_write(tmp_path / "notes.txt", "hello")),
        "unknown model_type": str(_write(tmp_path / "alien" / "config.json",
                                         json.dumps({"model_type": "no_such_arch_xyz"})).parent),
        "malformed config.json": str(_write(tmp_path / "broken" / "config.json", '{"model_type": "llama",').parent),
        "config.json that is not an object": str(_write(tmp_path / "list" / "config.json", "[1, 2]").parent),
        "hub id not cached": "normswap-test-nobody/no-such-model",
    }


@pytest.mark.parametrize("case", [
    "missing path", "directory without config.json", "a file that is not a model", "unknown model_type",
    "malformed config.json", "config.json that is not an object", "hub id not cached",
])
def test_bad_input_is_one_line_and_exit_2(bad_inputs, case, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for extra in ([], ["--json"]):
        result = run(bad_inputs[case], *extra)
        assert result.exit_code == 2, (case, result.output, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("normswap: error: "), (case, result.stderr)
        assert "Traceback" not in result.stderr and result.stdout == ""


# ---- unknown norm-like modules: a warning, or exit 2 under --strict

MAMBA2 = dict(model_type="mamba2", architectures=["Mamba2ForCausalLM"], vocab_size=96, hidden_size=32,
              num_hidden_layers=2, num_heads=4, head_dim=16, expand=2, n_groups=1, state_size=8)


@pytest.fixture
def mamba2_dir(tmp_path):
    _write(tmp_path / "mamba2" / "config.json", json.dumps(MAMBA2))
    return str(tmp_path / "mamba2")


def test_unknown_norm_warns_and_is_listed(mamba2_dir):
    result = run(mamba2_dir, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["summary"]["unknown"] == L
    assert {u["class"] for u in doc["unknown"]} == {"MambaRMSNormGated"}
    warnings = [ln for ln in result.stderr.splitlines() if ln.startswith("normswap: warning:")]
    assert len(warnings) == L
    assert "backbone.layers.0.mixer.norm (MambaRMSNormGated)" in warnings[0]


def test_strict_turns_unknown_norms_into_exit_2(mamba2_dir):
    result = run(mamba2_dir, "--strict")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "MambaRMSNormGated" in lines[0] and "backbone.layers.0.mixer.norm" in lines[0]


# ---- size: a 70B-class config scans from its config alone (timing is measured, not asserted)

LLAMA_70B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=8192, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                 rms_norm_eps=1e-5, max_position_embeddings=8192, torch_dtype="bfloat16")


def test_70b_config_scans_without_weights(tmp_path):
    _write(tmp_path / "llama70b" / "config.json", json.dumps(LLAMA_70B))
    doc = scan_json(tmp_path / "llama70b")
    assert doc["summary"]["by_class"] == {"LlamaRMSNorm": 2 * 80 + 1}
    assert {tuple(n["shape"]) for n in doc["norms"]} == {(8192,)}
    assert {n["dtype"] for n in doc["norms"]} == {"bfloat16"}
    assert doc["norms"][-1]["readers"] == ["lm_head"]


@pytest.mark.slow
def test_real_smollm2_scan():
    """The embedded default model (first use converts its GGUF once, ~20 s)."""
    result = CliRunner().invoke(cli, ["scan", "--json"])  # MODEL defaults to smollm2-135m
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["model"] == "smollm2-135m"
    assert doc["summary"]["by_class"] == {"LlamaRMSNorm": 61}
    assert doc["summary"]["by_kind"] == {"rms": 61} and doc["summary"]["by_casting"] == {"llama": 61}
    assert all(abs(n["eps"] - 1e-5) < 1e-9 for n in doc["norms"])
    assert doc["norms"][-1]["path"] == "model.norm" and doc["norms"][-1]["readers"] == ["lm_head"]


def test_all_archs_listed_here_exist():
    assert set(EXPECTED_READERS) <= set(ARCHS) and set(LAYER_NORM_ARCHS) <= set(ARCHS)


def test_example_script_runs(saved, monkeypatch, capsys):
    import runpy
    from pathlib import Path

    directory, _ = saved("gemma")
    script = Path(__file__).resolve().parent.parent / "examples" / "scan_model.py"
    monkeypatch.setattr("sys.argv", [str(script), str(directory)])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert f"{2 * L + 1} x rms norm, casting=gemma, offset=1, eps=1e-06" in out
    assert "final norm model.norm is read by lm_head" in out


def test_readers_unknown_when_the_forward_cannot_run():
    """A model whose forward does not take token ids: norms still listed, readers None with a note."""
    from normswap.scan import scan_model

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    doc = scan_model(model)
    assert [n["path"] for n in doc["norms"]] == ["1"]
    assert doc["norms"][0]["readers"] is None
    assert doc["readers_note"].startswith("readers unknown: the forward did not run on a dummy input")


def test_readers_unknown_for_a_norm_the_forward_never_runs():
    """A norm the dummy forward skips (a vision or audio tower fed no pixels or audio) has readers
    nobody saw: unknown ("?", null), with a note naming it, never "-" (read by nothing)."""
    from normswap.scan import scan_model

    class Towers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.text_norm, self.head = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)
            self.vision_norm, self.vision_proj = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)

        def forward(self, input_ids, pixel_values=None):
            x = self.head(self.text_norm(torch.ones(*input_ids.shape, 8)))
            return x if pixel_values is None else x + self.vision_proj(self.vision_norm(pixel_values))

    doc = scan_model(Towers())
    assert {n["path"]: n["readers"] for n in doc["norms"]} == {"text_norm": ["head"], "vision_norm": None}
    assert doc["readers_note"] == ("readers unknown for 1 norm that the traced forward on a dummy input did "
                                   "not run: vision_norm")


def test_readers_on_a_real_cpu_model():
    """Not only meta: on a model with weights the same trace runs for real (and leaves it in its mode)."""
    from tiny_models import tiny_model

    from normswap.discover import norm_readers

    model = tiny_model("gpt2").train()
    readers, note = norm_readers(model, ["transformer.h.0.ln_1", "transformer.ln_f"])
    assert note is None and model.training
    assert readers == {"transformer.h.0.ln_1": ["transformer.h.0.attn.c_attn"], "transformer.ln_f": ["lm_head"]}


def test_readers_follow_the_value_not_the_tensor():
    """A norm's output changed in place (a padding mask multiplied in, XLM's embedding norm) is no
    longer the norm's output: the modules reading the changed value are the mask's readers, not the
    norm's; ops that look only at its shape (new_zeros, GIT's zeros_like) read nothing."""
    from normswap.discover import norm_readers

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.q, self.side = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, input_ids):
            x = self.norm(torch.ones(*input_ids.shape, 8))
            pad = x.new_zeros(x.shape[:-1])  # shape only
            side = self.side(x)  # reads the norm's output
            x *= (input_ids > 0).unsqueeze(-1)  # the model's own code reads (and changes) it
            return self.q(x) + side + pad.unsqueeze(-1)

    readers, note = norm_readers(Masked(), ["norm"])
    assert note is None and readers == {"norm": ["", "side"]}


def test_readers_follow_pieces_cut_by_position():
    """ProphetNet's decoder layers chunk their input by position (main and predicted streams) and
    hand the pieces to relative_pos_embeddings: a reader of the norm before them, as the q/k/v
    projections are. A walk that stops at the split lists only the attention module that cut it."""
    from sweep_models import build

    from normswap.discover import norm_readers

    model = build("prophetnet", "ProphetNetForCausalLM")
    norm = "prophetnet.decoder.embeddings_layer_norm"
    readers, note = norm_readers(model, [norm])
    attn = "prophetnet.decoder.layers.0.self_attn"
    assert note is None and set(readers[norm]) >= {f"{attn}.{p}" for p in (
        "query_proj", "key_proj", "value_proj", "relative_pos_embeddings")}, readers[norm]


def test_readers_over_every_run_of_a_norm():
    """A norm module run twice (a shared layer, ALBERT's way) is read by the readers of both runs."""
    from normswap.discover import norm_readers

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.a, self.b = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, input_ids):
            x = torch.ones(*input_ids.shape, 8)
            return self.b(self.norm(self.a(self.norm(x))))

    readers, note = norm_readers(Twice(), ["norm"])
    assert note is None and readers == {"norm": ["a", "b"]}


@pytest.mark.parametrize("arch", ["llama", "gpt_neo"])
def test_a_scan_traces_the_forward_once(arch, monkeypatch):
    """Readers and conversion rows come from one traced forward: an RMSNorm model (whose conversion
    rows discovery decides, finding no LayerNorm) and a LayerNorm model no normswap/archs file
    describes (GPT-Neo: discovery plans it) each run their forward once per scan."""
    import transformers
    from sweep_models import build

    from normswap import discover
    from normswap.scan import scan_model

    if arch in ARCHS:
        with torch.device("meta"):
            model = getattr(transformers, ARCHS[arch][1])(tiny_config(arch))
    else:
        model = build(arch, "GPTNeoForCausalLM")
    runs = []
    model.register_forward_pre_hook(lambda *_: runs.append(1))
    monkeypatch.setattr(discover._Recorder, "__init__", lambda self, _init=discover._Recorder.__init__: (
        runs.append("trace"), _init(self))[1])
    doc = scan_model(model, warn=False)
    assert doc["readers_note"] is None and all(n["readers"] for n in doc["norms"])
    assert runs == ["trace", 1]
    if arch == "gpt_neo":  # the conversion rows were made (from the same trace)
        assert all(n["to_rms"] is not None for n in doc["norms"] if n["kind"] == "layer")


def test_no_readers_and_its_old_name(saved):
    """--no-readers skips the traced forward; --no-consumers, scan's name for it before readers
    became the one name, still works and is hidden from --help."""
    directory, _ = saved("gpt2")
    docs = []
    for flag in ("--no-readers", "--no-consumers"):
        doc = json.loads(run(str(directory), "--json", flag).stdout)
        assert doc["readers_note"] == "readers not computed"
        assert {n["readers"] for n in doc["norms"]} == {None} and {n["to_rms"] for n in doc["norms"]} == {None}
        docs.append(doc)
    assert docs[0] == docs[1]
    help_text = run("--help").stdout
    assert "--no-readers" in help_text and "--no-consumers" not in help_text


def test_scan_warns_about_nothing_on_a_clean_model(saved, capfd):
    """The dummy forward passes an explicit attention mask: the ids it uses (1) are the pad id of
    many configs, and transformers would otherwise print a padding warning into the scan's stderr."""
    import logging

    directory, _ = saved("gpt2")
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process
    capfd.readouterr()  # what writing the checkpoint printed
    result = run(str(directory), "--json")
    assert result.exit_code == 0 and result.stderr == ""
    json.loads(result.stdout)
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("args, says", [
    (["scan", "--strid"], "No such option '--strid'. Did you mean '--strict'?"),
    (["ppl", "some-model"], "Missing option '--data'."),
    (["ppl", "m", "--data", "x", "--stride", "abc"], "'abc' is not a valid integer"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
])
def test_usage_errors_are_one_line_and_exit_2(args, says):
    """Mistyped options and commands are bad input too: one line (not click's usage block)."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("normswap: error: ") and says in lines[0], result.stderr


def test_a_mistyped_option_is_suggested_only_the_spellings_help_shows():
    """An old spelling (bench's --impl and --mode, scan's --no-consumers) is still accepted but hidden
    from --help; click's "Did you mean" offered it beside the current one (`bench --imp`: '--impl',
    '--impls'). Every command's hidden spellings, and the group's, mistyped: none is suggested, the
    current one still is."""
    import click

    from normswap.cli.main import OldSpellings

    hidden = []
    for path, command in [([], cli)] + [([name], c) for name, c in cli.commands.items()]:
        for p in command.params:
            if isinstance(p, click.Option):
                old = p.opts + p.secondary_opts if p.hidden else p.opts[1:] if isinstance(p, OldSpellings) else []
                hidden += [(path, spelling) for spelling in old]
    assert {(tuple(path), s) for path, s in hidden} >= {(("bench",), "--impl"), (("bench",), "--mode"),
                                                           (("scan",), "--no-consumers")}
    for path, spelling in hidden:
        for typo in (spelling[:-1], spelling + "x"):
            result = CliRunner().invoke(cli, [*path, typo])
            lines = result.stderr.strip().splitlines()
            assert result.exit_code == 2 and len(lines) == 1, result.stderr
            assert f"No such option '{typo}'" in lines[0] and f"'{spelling}'" not in lines[0], lines[0]
    says = CliRunner().invoke(cli, ["bench", "--imp", "x"]).stderr
    assert "Did you mean one of: '--impls', '--warmup'?" in says, says
    says = CliRunner().invoke(cli, ["bench", "--mod", "x"]).stderr
    assert "Did you mean one of: '--modes', '--out'?" in says, says
    says = CliRunner().invoke(cli, ["scan", "--no-reader"]).stderr
    assert "Did you mean '--no-readers'?" in says, says


def test_a_mistyped_option_is_suggested_close_spellings_on_click_8_3(monkeypatch):
    """pyproject allows click 8.1 on; up to 8.3 NoSuchOption keeps the possibilities it is given
    (the parser passes the close matches; the installed 8.5 picks them in NoSuchOption): handed
    every spelling --help shows, `bench --imp` listed all of bench's options. Under that
    constructor, the suggestions are still the close ones."""
    import click

    def init_8_3(self, option_name, message=None, possibilities=None, ctx=None):
        click.UsageError.__init__(self, message or f"No such option: {option_name}", ctx)
        self.option_name, self.possibilities = option_name, possibilities

    monkeypatch.setattr(click.exceptions.NoSuchOption, "__init__", init_8_3)
    says = CliRunner().invoke(cli, ["bench", "--imp", "x"]).stderr
    assert "'--impls'" in says and "'--warmup'" in says and "--dtype" not in says, says
    says = CliRunner().invoke(cli, ["scan", "--no-consumer"]).stderr
    assert "--json" not in says and "--no-consumers" not in says, says


@pytest.mark.parametrize("arch,converts,refused", [
    ("gpt2", 2 * L + 1, {}),
    ("bert", 0, {"post-ln": 2 * L + 1}),  # every norm's output is the stream; plus BertModel has no head norm
    ("llama", 0, {}),  # RMS norms only: nothing to convert, no to_rms entries
])
def test_scan_says_per_layer_norm_whether_it_converts(saved, arch, converts, refused):
    """The same answer `normswap convert` would give, before converting: per LayerNorm a verdict,
    a category and a reason; RMS norms get none."""
    directory, _ = saved(arch)
    doc = scan_json(directory)
    assert doc["summary"]["to_rms"] == {"converts": converts, "refused": refused}
    for n in doc["norms"]:
        t = n["to_rms"]
        if n["kind"] == "rms":
            assert t is None
        else:
            assert t["converts"] == (t["category"] is None) == (t["why_not"] is None)
    text = run(str(directory)).stdout
    if converts:
        assert f"normswap convert --to rms: {converts} LayerNorms convert, 0 refused" in text
    if refused:
        assert "post-ln: embeddings.LayerNorm" in text and "no (post-ln)" in text


def test_scan_shows_discovered_refusals_with_reasons(tmp_path):
    """A model with no architecture file: q/k LayerNorms of Persimmon refused as not-stream, the
    residual-stream norms convert (what `normswap convert --partial` does)."""
    import transformers

    cfg = transformers.PersimmonConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=48, max_position_embeddings=64, qk_layernorm=True)
    transformers.PersimmonForCausalLM(cfg).save_pretrained(tmp_path / "p")
    doc = scan_json(tmp_path / "p")
    assert doc["summary"]["to_rms"] == {"converts": 2 * L + 1, "refused": {"not-stream": 2 * L}}
    qk = [n for n in doc["norms"] if "_layernorm" in n["path"] and "self_attn" in n["path"]]
    assert len(qk) == 2 * L and all("not a sum of residual-stream writers" in n["to_rms"]["why_not"] for n in qk)


def test_a_gguf_scans_path_is_the_file(tmp_path):
    """`normswap scan DIR/model.gguf --json` said "path": "DIR", the folder, as for a model
    directory: a script reading the document could not tell which of the folder's files it was."""
    from test_loading import write_tiny_llama_gguf

    gguf = write_tiny_llama_gguf(tmp_path / "tiny ü.gguf")
    write_tiny_llama_gguf(tmp_path / "other.gguf")
    result = run(str(gguf), "--json", "--no-readers")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["path"] == str(gguf)
    save_tiny("llama", tmp_path / "llama")
    assert scan_json(tmp_path / "llama")["path"] == str(tmp_path / "llama")


def test_a_gguf_scan_says_on_stderr_what_it_reads(tmp_path, capfd):
    """transformers reads a .gguf's config from the file's whole metadata, tokenizer included:
    seconds (SmolLM2-135M's Q4_1: about 5) in which scan showed nothing. That read is a stage of
    the caller's progress: the command draws it on stderr (whole lines off a terminal) and --json's
    stdout stays the one document; patch draws it before its load; a library scan without
    progress, and any config.json, print nothing."""
    from test_loading import write_tiny_llama_gguf

    from normswap.scan import scan

    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    what = "tiny.gguf: reading its config (GGUF metadata)"
    result = run(str(gguf), "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["summary"]["norms"] == 2 * L + 1  # stdout is the document, whole
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0] == f"{what} ..." and lines[1].startswith(f"{what}: 1/1 step, "), lines
    human = run(str(gguf))
    assert human.exit_code == 0 and what not in human.stdout and human.stderr.startswith(f"{what} ...\n")
    calls = []
    scan(str(gguf), warn=False, progress=lambda *a: calls.append(a))
    assert calls == [(what, 0, 1), (what, 1, 1)]
    capfd.readouterr()
    scan(str(gguf), warn=False)
    save_tiny("llama", tmp_path / "llama")
    assert run(str(tmp_path / "llama"), "--json").stderr == ""
    assert capfd.readouterr().err == ""
    patched = CliRunner().invoke(cli, ["patch", str(gguf), "--impl", "torch", "--json"])
    assert patched.exit_code == 0 and json.loads(patched.stdout)["ok"], patched.stderr
    starts = [line for line in patched.stderr.splitlines() if line.endswith(" ...")]
    assert starts[:2] == [f"{what} ...", "load ..."], patched.stderr
