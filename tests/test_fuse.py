"""Fused residual add + norm (normswap.fuse, patch(fuse_residual=True)): the fused model computes
what the unfused patched model computes, gradients included, with every add really fused."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from tiny_models import randomize_norms_and_biases, save_tiny, tiny_model

import normswap
from normswap import fuse
from normswap.errors import NormswapError
from normswap.modules import NormswapNorm

# arch -> fused adds per forward (2 layers): sequential blocks fuse two adds per layer, parallel
# blocks (attn + mlp + residual) one.
EXPECTED = {
    "llama": 4, "mistral": 4, "qwen2": 4, "qwen3": 4, "gemma": 4, "gemma2": 4, "gemma3_text": 4, "phi3": 4,
    "gpt2": 4, "opt": 4, "gpt_neox": 2, "phi": 2, "falcon": 2, "falcon_new": 2,
    "gptj": 2,  # no data: its writers come from normswap.discover
}
IDS = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))


class Counter:
    """Counts fused kernel calls and norms that returned the precomputed value."""

    def __init__(self, monkeypatch):
        self.fused = self.hits = 0
        fused_add, precomputed = NormswapNorm.fused_add, fuse.precomputed

        def counting_fused_add(norm, x, residual):
            self.fused += 1
            return fused_add(norm, x, residual)

        def counting_precomputed(x, norm):
            y = precomputed(x, norm)
            self.hits += y is not None
            return y

        monkeypatch.setattr(NormswapNorm, "fused_add", counting_fused_add)
        monkeypatch.setattr(fuse, "precomputed", counting_precomputed)


def _logits_and_grads(model):
    model.zero_grad(set_to_none=True)
    out = model(IDS, labels=IDS)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_fused_equals_unfused(arch, impl, dtype, monkeypatch, rtol, atol, model=None):
    model = model if model is not None else tiny_model(arch, dtype)  # eval: dropout off, runs comparable
    normswap.patch(model, impl, verify=False)
    logits, grads = _logits_and_grads(model)
    report = normswap.patch(model, impl, fuse_residual=True)
    assert report.fusion.ok and report.fusion.model_check is not None
    assert not report.fusion.unfused, report.fusion.unfused
    counter = Counter(monkeypatch)
    fused_logits, fused_grads = _logits_and_grads(model)
    assert counter.fused == counter.hits == EXPECTED[arch]
    torch.testing.assert_close(fused_logits, logits, rtol=rtol, atol=atol)
    params = dict(model.named_parameters())
    assert set(fused_grads) == set(params), f"no gradient: {sorted(set(params) - set(fused_grads))}"
    assert set(grads) == set(params)
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=rtol, atol=atol, msg=name)
    return model, report


def _gptj():
    """A LayerNorm architecture with neither residual_writers.toml nor normswap/archs data."""
    import transformers

    from normswap import fuse as fuse_mod

    assert fuse_mod.writer_patterns("gptj") == []
    torch.manual_seed(0)
    cfg = transformers.GPTJConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
                                  bos_token_id=2, eos_token_id=2)
    return randomize_norms_and_biases(transformers.GPTJForCausalLM(cfg)).eval()


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_fused_matches_unfused_torch_backend(arch, monkeypatch):
    model = _gptj() if arch == "gptj" else None
    model, report = _check_fused_equals_unfused(arch, "torch", torch.float32, monkeypatch, 1e-6, 1e-6, model)
    # Across layers: the last layer's sum feeds the final norm, every earlier one the next layer.
    targets = set(report.fusion.pairs.values())
    final = [p for p, m in model.named_modules() if isinstance(m, NormswapNorm) and ".0." not in p
             and ".1." not in p]
    assert final and set(final) <= targets


@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("gemma2", torch.bfloat16),
                                        ("gpt2", torch.float32), ("gpt_neox", torch.bfloat16)])
def test_fused_matches_unfused_triton(arch, dtype, monkeypatch):
    # bf16: gradients summed over different paths may differ by the dtype's rounding.
    tol = (1e-6, 1e-6) if dtype == torch.float32 else (1.6e-2, 1e-2)
    _check_fused_equals_unfused(arch, "triton", dtype, monkeypatch, *tol)


def test_pairs_within_and_across_layers():
    model = tiny_model("llama")
    report = normswap.patch(model, "torch", fuse_residual=True)
    assert report.fusion.pairs == {
        "model.layers.0.self_attn.o_proj": "model.layers.0.post_attention_layernorm",
        "model.layers.0.mlp.down_proj": "model.layers.1.input_layernorm",
        "model.layers.1.self_attn.o_proj": "model.layers.1.post_attention_layernorm",
        "model.layers.1.mlp.down_proj": "model.norm",
    }
    # Gemma 2: the post-norms write, the pre-norms read.
    report = normswap.patch(tiny_model("gemma2"), "torch", fuse_residual=True)
    assert report.fusion.pairs["model.layers.0.post_attention_layernorm"] == "model.layers.0.pre_feedforward_layernorm"
    assert report.fusion.pairs["model.layers.0.post_feedforward_layernorm"] == "model.layers.1.input_layernorm"


def test_unpatched_reader_is_left_unfused_with_reason():
    model = tiny_model("llama")
    report = normswap.patch(model, "torch", fuse_residual=True,
                            filter_fn=lambda _m, path: "post_attention_layernorm" not in path)
    assert "model.layers.0.self_attn.o_proj" in report.fusion.unfused
    assert "model.layers.0.mlp.down_proj" in report.fusion.pairs
    assert report.to_dict()["fuse_residual"]["unfused_count"] == 2


def test_unknown_architecture_is_a_clear_error():
    # BERT: no data, and discovery finds no pre-LN stream writers (post-LN).
    with pytest.raises(NormswapError, match="residual writers"):
        normswap.patch(tiny_model("bert"), "torch", fuse_residual=True)


def test_in_place_change_drops_the_precomputed_norm():
    model = tiny_model("llama")
    normswap.patch(model, "torch")
    norm = model.model.norm
    stream = torch.randn(2, 3, 32)
    write = fuse._tag(torch.randn(2, 3, 32), _ns_into=norm)
    h = stream + write
    assert type(h) is fuse.StreamTensor and fuse.precomputed(h, norm) is not None
    assert torch.equal(fuse.precomputed(h, norm), norm._norm(h.as_subclass(torch.Tensor)))
    assert fuse.precomputed(h, model.model.layers[0].input_layernorm) is None  # only its own norm
    h.mul_(2.0)
    assert fuse.precomputed(h, norm) is None
    torch.testing.assert_close(norm(h), norm._norm(h.as_subclass(torch.Tensor)))
    # Broadcasting or mixed dtypes: not the add the kernel computes, so a plain add.
    assert type(torch.randn(32) + write) is torch.Tensor
    assert type(stream.double() + write) is torch.Tensor


@pytest.mark.parametrize("arch,norms,fused", [("llama", 5, 4), ("gpt2", 5, 4), ("opt", 5, 4), ("falcon", 3, 2)])
def test_compile_fullgraph_has_fused_ops(arch, norms, fused):
    """torch.compile sees one graph, and in it every fused add is one normswap op with a residual
    (through GPT-2's dropout modules, OPT's reshapes and Falcon's in-place parallel sum)."""
    model = tiny_model(arch)
    normswap.patch(model, "triton", verify=False, fuse_residual=True)
    expected = model(IDS).logits
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        return aot_autograd(fw_compiler=lambda g, _i: make_boxed_func(g.forward))(gm, example_inputs)

    torch._dynamo.reset()
    got = torch.compile(model, backend=backend, fullgraph=True)(IDS).logits
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert len(graphs) == 1
    ops = [n for n in graphs[0].graph.nodes if n.op == "call_function"
           and str(n.target).startswith("normswap.") and "_fwd" in str(n.target)]
    residual = 2 if "rms_norm" in str(ops[0].target) else 3  # (x, weight, residual) / (x, weight, bias, residual)
    with_residual = [n for n in ops if n.args[residual] is not None]
    assert len(ops) == norms and len(with_residual) == fused


def test_cli_save_load_revert(tmp_path):
    from normswap.cli import cli

    save_tiny("qwen2", tmp_path / "src")
    out = tmp_path / "fused"
    res = CliRunner().invoke(cli, ["patch", str(tmp_path / "src"), "--impl", "torch", "--fuse-residual",
                                   "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["fuse_residual"]["fused"] == 4 and data["fuse_residual"]["model_check"]["passed"]
    manifest = json.loads((out / "normswap.json").read_text())
    pairs = manifest["patch"]["fuse_residual"]
    assert pairs["model.layers.1.mlp.down_proj"] == "model.norm"

    model = normswap.load(out)
    assert fuse._fused_pairs(model) == pairs
    fused = model(IDS).logits
    normswap.revert(model)
    assert fuse._fused_pairs(model) == {}
    assert not any(m._forward_hooks for m in model.modules())
    torch.testing.assert_close(model(IDS).logits, fused, rtol=1e-5, atol=1e-5)


def test_precomputed_norm_is_dropped_when_the_sum_or_the_weights_change():
    """A tagged sum outlives its forward (a returned hidden state): an in-place change through a
    view of it, or to the norm's weight (an optimizer step), makes the precomputed value stale."""
    model = tiny_model("llama")
    normswap.patch(model, "torch")
    norm = model.model.norm
    g = torch.Generator().manual_seed(3)
    stream, x = torch.randn(2, 3, 32, generator=g), torch.randn(2, 3, 32, generator=g)
    h = stream + fuse._tag(x, _ns_into=norm)
    h[0].zero_()  # a plain view of h: h itself sees no in-place op
    torch.testing.assert_close(norm(h), norm._norm(h.as_subclass(torch.Tensor)))
    h = stream + fuse._tag(x, _ns_into=norm)
    assert fuse.precomputed(h.view(-1, 32), norm) is not None  # a view keeps it while nothing changed
    with torch.no_grad():
        norm.weight.mul_(3.0)
    assert fuse.precomputed(h, norm) is None
    torch.testing.assert_close(norm(h), norm._norm(h.as_subclass(torch.Tensor)))


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_keeps_every_gradient(reentrant):
    """Reentrant checkpointing runs each block without grad and hands its output a new grad_fn:
    a norm taking the precomputed value there would cut every gradient upstream of it."""
    import copy

    model = tiny_model("llama")
    normswap.patch(model, "torch", verify=False)
    fused = copy.deepcopy(model)
    normswap.patch(fused, "torch", fuse_residual=True)
    results = []
    for m in (model, fused):
        m.train()  # (tiny models have no active dropout: runs stay comparable)
        kwargs = {"use_reentrant": reentrant}
        if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.2x's name (the old one warns)
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        results.append(_logits_and_grads(m))
    (logits, grads), (fused_logits, fused_grads) = results
    torch.testing.assert_close(fused_logits, logits, rtol=1e-6, atol=1e-6)
    assert set(fused_grads) == set(grads) == {n for n, _ in model.named_parameters()}
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-6, atol=1e-6, msg=name)


def test_generate_with_kv_cache_fused_gives_the_same_tokens(monkeypatch):
    """Decoding with a KV cache runs fused (every step's adds) and picks the unfused model's tokens."""
    import copy

    model = tiny_model("llama")
    normswap.patch(model, "torch", verify=False)
    fused = copy.deepcopy(model)
    normswap.patch(fused, "torch", fuse_residual=True)
    expected = model.generate(IDS, max_new_tokens=6, do_sample=False)
    counter = Counter(monkeypatch)
    got = fused.generate(IDS, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)
    assert counter.fused == counter.hits == 6 * EXPECTED["llama"]  # the prompt's forward + 5 cached steps


def test_inference_mode_runs_fused(monkeypatch):
    """Inference tensors keep no version counter: the fused model still runs (and fuses) under
    torch.inference_mode, as pipelines call it."""
    model = tiny_model("llama")
    normswap.patch(model, "torch", verify=False)
    with torch.no_grad():
        expected = model(IDS).logits
    normswap.patch(model, "torch", fuse_residual=True)
    counter = Counter(monkeypatch)
    with torch.inference_mode():
        got = model(IDS).logits
    assert counter.fused == counter.hits == EXPECTED["llama"]
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
