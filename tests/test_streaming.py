"""Shard-by-shard conversion: byte-identical to the in-memory path, reloadable, bounded reads."""

import filecmp
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from normswap import streaming as st
from normswap.convert import convert_model
from normswap.convert_dir import convert_directory, verify_conversion
from normswap.loading import resolve
from tests.tiny_models import save_tiny, tiny_model, tiny_tokenizer


def read_dir(d):
    """name -> tensor for every tensor of a checkpoint directory."""
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("arch", ["gpt2", "bloom", "opt", "falcon_new"])
def test_streaming_is_byte_identical_to_in_memory(arch, tmp_path):
    model = save_tiny(arch, tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = [f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]
    assert len(shards) > 3  # really sharded
    outs = {}
    for mode in (True, False):
        out = tmp_path / f"out-{mode}"
        out.mkdir()
        convert_directory(resolve(tmp_path / "sharded"), out, streaming=mode)
        outs[mode] = out
    files = sorted(os.listdir(outs[True]))
    assert files == sorted(os.listdir(outs[False]))
    assert st.INDEX_NAME in files
    for f in files:
        if f != "normswap.json":
            assert filecmp.cmp(outs[True] / f, outs[False] / f, shallow=False), f
    # ... and identical, tensor by tensor, to converting the model object in memory.
    convert_model(model)
    streamed = read_dir(outs[True])
    state = model.state_dict()
    assert set(streamed) == set(state)
    for name, t in streamed.items():
        assert same_bytes(t, state[name]), name
    # The index maps every tensor to a file that holds it.
    index = json.loads((outs[True] / st.INDEX_NAME).read_text())
    for name, f in index["weight_map"].items():
        with safe_open(outs[True] / f, framework="pt") as h:
            assert name in h.keys()


def test_single_file_and_sharded_give_the_same_tensors(tmp_path):
    model = save_tiny("gpt2", tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    for src in ("single", "sharded"):
        (tmp_path / f"o-{src}").mkdir()
        convert_directory(resolve(tmp_path / src), tmp_path / f"o-{src}")
    a, b = read_dir(tmp_path / "o-single"), read_dir(tmp_path / "o-sharded")
    assert set(a) == set(b) and all(same_bytes(a[k], b[k]) for k in a)


def test_streamed_checkpoint_reloads_and_verifies(tmp_path):
    save_tiny("gpt2", tmp_path / "src").save_pretrained(tmp_path / "src", max_shard_size="30KB")
    (tmp_path / "src" / st.SINGLE_NAME).unlink()  # save_pretrained leaves it: transformers would load it, not the shards
    (tmp_path / "out").mkdir()
    manifest = convert_directory(resolve(tmp_path / "src"), tmp_path / "out")
    v = verify_conversion(resolve(tmp_path / "src"), tmp_path / "out", manifest)
    assert v["passed"] and v["max_rel_logit_error"] <= 1e-5 and v["max_rel_logit_error_rms"] <= 1e-5
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_float64_checkpoint_verifies_at_1e_10(tmp_path):
    save_tiny("opt", tmp_path / "src", dtype=torch.float64)
    (tmp_path / "out").mkdir()
    manifest = convert_directory(resolve(tmp_path / "src"), tmp_path / "out")
    v = verify_conversion(resolve(tmp_path / "src"), tmp_path / "out", manifest)
    assert v["compute_dtype"] == "float64" and v["max_rel_logit_error"] <= 1e-10
    assert v["max_rel_logit_error_rms"] <= 1e-10  # the RMS path keeps float64 in float64


def test_dtype_cast_happens_once_from_float64(tmp_path):
    save_tiny("gpt2", tmp_path / "src")
    (tmp_path / "out").mkdir()
    convert_directory(resolve(tmp_path / "src"), tmp_path / "out", dtype=torch.bfloat16)
    tensors = read_dir(tmp_path / "out")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    # A folded tensor equals the float64 result rounded once (not via an fp32 intermediate).
    model = tiny_model("gpt2", dtype=torch.float64)
    convert_model(model)
    want = model.state_dict()["transformer.h.0.attn.c_attn.weight"].to(torch.bfloat16)
    assert torch.equal(tensors["transformer.h.0.attn.c_attn.weight"], want)


def test_dtype_cast_happens_once_for_pickled_weights(tmp_path):
    """A checkpoint that is not safetensors (pytorch_model.bin; GGUF takes the same path) is
    converted in memory: with --dtype it too is rounded once, from the float64 result."""
    model = save_tiny("gpt2", tmp_path / "src")
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "src" / "pytorch_model.bin")
    (tmp_path / "src" / "model.safetensors").unlink()
    (tmp_path / "out").mkdir()
    convert_directory(resolve(tmp_path / "src"), tmp_path / "out", dtype=torch.bfloat16)
    tensors = read_dir(tmp_path / "out")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    reference = tiny_model("gpt2", dtype=torch.float64)
    convert_model(reference)
    want = reference.state_dict()
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.bias", "transformer.wte.weight"):
        assert torch.equal(tensors[name], want[name].to(torch.bfloat16)), name


def test_pickled_weights_are_planned_once(tmp_path, monkeypatch):
    """The in-memory path (pickled weights, GGUF) applies the plan convert_checkpoint built from
    the meta model; it planned a second time on the loaded model before."""
    import normswap
    from normswap import convert, convert_dir, plan

    model = save_tiny("gpt2", tmp_path / "src")
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "src" / "pytorch_model.bin")
    (tmp_path / "src" / "model.safetensors").unlink()
    plans = []
    real = plan.plan_conversion
    for module in (plan, convert, convert_dir):  # every binding of the name
        monkeypatch.setattr(module, "plan_conversion", lambda *a, **k: plans.append(a[0]) or real(*a, **k))
    result = normswap.convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert len(plans) == 1 and result.section["verification"]["passed"]
    reference = tiny_model("gpt2", dtype=torch.float32)
    convert_model(reference)
    got = read_dir(tmp_path / "out")
    for name, want in reference.state_dict().items():
        assert torch.equal(got[name], want), name


def test_checkpoint_without_the_model_prefix(tmp_path):
    """Hub GPT-2 checkpoints name tensors 'h.0...' (base model); the converter maps them."""
    model = save_tiny("gpt2", tmp_path / "src")
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "out").mkdir()
    manifest = convert_directory(resolve(tmp_path / "src"), tmp_path / "out")
    out = read_dir(tmp_path / "out")
    assert "transformer.wte.weight" in out and "lm_head.weight" in out
    v = verify_conversion(resolve(tmp_path / "src"), tmp_path / "out", manifest)
    assert v["passed"]


def test_writer_round_trips_through_safetensors(tmp_path):
    tensors = {
        "a": torch.randn(3, 5, dtype=torch.float32),
        "b": torch.randn(7, dtype=torch.bfloat16),
        "c": torch.arange(4, dtype=torch.int64),
        "d": torch.randn(2, 2, dtype=torch.float16),
        "e": torch.randn(0, 3),
    }
    w = st.SafetensorsWriter(tmp_path / "x.safetensors", [(k, v.dtype, list(v.shape)) for k, v in tensors.items()],
                             {"format": "pt"})
    for k in ["d", "b", "e", "a", "c"]:  # any order
        w.write(k, tensors[k])
    w.close()
    back = load_file(tmp_path / "x.safetensors")
    assert set(back) == set(tensors) and all(same_bytes(back[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("streaming", [True, False])
def test_streaming_holds_one_group_at_a_time(tmp_path, monkeypatch, streaming):
    """Bytes of checkpoint tensors alive at once: the streaming path holds one job's tensors,
    the in-memory path (the control) holds the whole model."""
    import weakref

    model = save_tiny("gpt2", tmp_path / "src")
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    (tmp_path / "src" / st.SINGLE_NAME).unlink()
    alive: weakref.WeakSet = weakref.WeakSet()
    peak = [0]
    real_read = st.CheckpointReader.read

    def tracking_read(self, name):
        t = real_read(self, name)
        alive.add(t)
        peak[0] = max(peak[0], sum(x.numel() * x.element_size() for x in alive))
        return t

    monkeypatch.setattr(st.CheckpointReader, "read", tracking_read)
    (tmp_path / "out").mkdir()
    convert_directory(resolve(tmp_path / "src"), tmp_path / "out", streaming=streaming)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    total = sum(sizes)
    if streaming:
        # the largest job: a reader's weight and bias plus its norm's γ and β
        assert peak[0] <= max(sizes) + 4 * 4 * 1024
        assert peak[0] < total / 4
    else:
        assert peak[0] >= 0.9 * total


@pytest.mark.parametrize("arch", ["bloom", "phi", "gpt2"])
def test_sliced_float64_work_is_still_exact(arch, tmp_path, monkeypatch):
    """Big tensors are worked on a slice at a time; force many slices and check the result."""
    import normswap.jobs as jobs
    from tests.test_convert import logits, probe, rel_err

    monkeypatch.setattr(jobs, "CHUNK_ELEMENTS", 70)  # a couple of rows per slice
    model = tiny_model(arch, dtype=torch.float64)
    ids = probe()
    ref = logits(model, ids)
    manifest = convert_model(model)
    assert rel_err(logits(model, ids), ref) <= 1e-10
    assert manifest["zero_mean_check"]["passed"]
    # same slices on the checkpoint paths: streaming and in-memory still agree to the byte
    save_tiny(arch, tmp_path / "src").save_pretrained(tmp_path / "src", max_shard_size="20KB")
    (tmp_path / "src" / st.SINGLE_NAME).unlink()
    for mode in (True, False):
        (tmp_path / f"o{mode}").mkdir()
        convert_directory(resolve(tmp_path / "src"), tmp_path / f"o{mode}", streaming=mode)
    a, b = read_dir(tmp_path / "oTrue"), read_dir(tmp_path / "oFalse")
    assert set(a) == set(b) and all(same_bytes(a[k], b[k]) for k in a)


@pytest.mark.parametrize("arch,src_dtype,out_dtype", [("bloom", torch.bfloat16, None),
                                                      ("falcon_new", torch.float32, torch.float16)])
def test_half_precision_checkpoints_verify(arch, src_dtype, out_dtype, tmp_path):
    save_tiny(arch, tmp_path / "src", dtype=src_dtype)
    (tmp_path / "out").mkdir()
    manifest = convert_directory(resolve(tmp_path / "src"), tmp_path / "out", dtype=out_dtype)
    v = verify_conversion(resolve(tmp_path / "src"), tmp_path / "out", manifest)
    # one rounding of the folded weights to a 16-bit format: well under a percent of the logit scale
    assert v["passed"] and v["max_rel_logit_error"] < 1e-2 and v["max_rel_logit_error_rms"] < 1e-2
    want = out_dtype or src_dtype
    assert {t.dtype for t in read_dir(tmp_path / "out").values()} == {want}


def test_missing_shard_is_named(tmp_path):
    """A shard the index lists but the directory lacks is the input's fault, and said so (it
    used to surface as 'cannot write' the output)."""
    from normswap.errors import NormswapError

    save_tiny("gpt2", tmp_path / "src").save_pretrained(tmp_path / "src", max_shard_size="20KB")
    (tmp_path / "src" / "model.safetensors").unlink()
    shard = sorted((tmp_path / "src").glob("model-*.safetensors"))[1]
    shard.unlink()
    (tmp_path / "out").mkdir()
    with pytest.raises(NormswapError, match=f"shard.*not there.*{shard.name}"):
        convert_directory(resolve(tmp_path / "src"), tmp_path / "out")


@pytest.mark.parametrize("index", ['{"weight_map": 5}', '[1, 2]', '{"weight_map": {"a.weight": 3}}',
                                   '{"weight_map": {"a.weight": ["x"]}}'])
def test_an_index_of_the_wrong_shape_is_malformed_not_a_crash(tmp_path, index):
    """model.safetensors.index.json with a weight_map that is not a map of names to file names
    raised AttributeError/TypeError: `normswap convert` on it was an internal error (exit 1)."""
    from normswap.errors import NormswapError

    (tmp_path / st.INDEX_NAME).write_text(index)
    with pytest.raises(NormswapError, match="malformed index"):
        st.checkpoint_layout(tmp_path)


def _sharded(tmp_path, seed=0):
    d = tmp_path / "src"
    tiny_model("gpt2", seed=seed).save_pretrained(d, max_shard_size="20KB")
    return d


def test_an_index_that_names_the_wrong_shard_is_bad_input(tmp_path):
    """An index that sends a tensor to a shard that does not hold it (two shards' keys listed
    under one) was a KeyError: `normswap convert` on it an internal error, exit 1."""
    from normswap.errors import NormswapError

    d = _sharded(tmp_path)
    index = json.loads((d / st.INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    first, last = shards[0], shards[-1]
    index["weight_map"] = {k: first if v == last else v for k, v in index["weight_map"].items()}
    (d / st.INDEX_NAME).write_text(json.dumps(index))
    (tmp_path / "out").mkdir()
    with pytest.raises(NormswapError, match=f"index.json: names {first} for .*, which that file does not hold"):
        convert_directory(resolve(d), tmp_path / "out")


def test_a_header_that_is_not_an_object_is_not_a_safetensors_file(tmp_path):
    header = b"[1, 2]"
    (tmp_path / st.SINGLE_NAME).write_bytes(len(header).to_bytes(8, "little") + header)
    from normswap.errors import NormswapError

    with pytest.raises(NormswapError, match="not a safetensors file .its header is not a JSON object"):
        st.checkpoint_layout(tmp_path)


def test_a_model_safetensors_beside_an_index_is_what_is_converted(tmp_path):
    """transformers loads model.safetensors when it sits beside an index (a leftover of an earlier
    save: save_pretrained leaves it). The conversion read the shards instead, so its verification,
    which loads the single file, failed on a folder transformers loads without a word."""
    from normswap.api import convert_checkpoint

    d = _sharded(tmp_path)
    tiny_model("gpt2", seed=7).save_pretrained(tmp_path / "other")
    (tmp_path / "other" / st.SINGLE_NAME).rename(d / st.SINGLE_NAME)
    tiny_tokenizer().save_pretrained(d)
    assert st.checkpoint_layout(d)[0] == [st.SINGLE_NAME]
    r = convert_checkpoint(d, tmp_path / "out")
    assert r.section["verification"]["passed"]
    want = tiny_model("gpt2", seed=7)
    convert_model(want)
    got = read_dir(tmp_path / "out")
    assert all(same_bytes(got[k], t) for k, t in want.state_dict().items() if k in got)


@pytest.mark.parametrize("weights", ["safetensors", "pickled"])
@pytest.mark.parametrize("head", ["other", "same"])
def test_a_tied_config_with_a_head_stored_apart(tmp_path, head, weights):
    """config.json says tie_word_embeddings, the checkpoint stores lm_head.weight with values of its
    own: transformers loads them untied, the conversion folded the embedding into the head and its
    verification refused with only "logits differ". Now refused naming the key and the fix; a head
    stored with the embedding's own values (an older save of a tied model) still converts. Pickled
    weights (converted in memory) said "logits differ" after d7c8518 still."""
    import transformers

    from normswap.api import convert_checkpoint
    from normswap.errors import NormswapError
    from tests.tiny_models import randomize_norms_and_biases, tiny_config

    cfg = tiny_config("gpt2")
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = randomize_norms_and_biases(transformers.GPT2LMHeadModel(cfg))
    if head == "same":
        with torch.no_grad():
            model.lm_head.weight.copy_(model.transformer.wte.weight)
    d = tmp_path / "src"
    if weights == "safetensors":
        model.save_pretrained(d)
    else:
        model.config.save_pretrained(d)
        torch.save(model.state_dict(), d / "pytorch_model.bin")
    tiny_tokenizer().save_pretrained(d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    if head == "same":
        assert convert_checkpoint(d, tmp_path / "out").section["verification"]["passed"]
        return
    with pytest.raises(NormswapError, match=r"config.json: tie_word_embeddings is true, but the checkpoint stores "
                                            r"lm_head.weight apart from transformer.wte.weight, with other values"):
        convert_checkpoint(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (d / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))  # the way out it names
    assert convert_checkpoint(d, tmp_path / "out").section["verification"]["passed"]
