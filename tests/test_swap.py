"""patch()/revert() on every tiny architecture, with each CPU-capable implementation."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import ARCHS, tiny_model
from torch import nn

from normswap import walk
from normswap.backends import Backend
from normswap.errors import NormswapError, UnknownNormError
from normswap.kernels.reference import layer_norm_ref, rms_norm_ref
from normswap.modules import NormswapNorm
from normswap.swap import VerificationError, patch, regex_filter, revert
from normswap.verify import LOGITS_RTOL, ProbeConfig, model_output, probe_batch

# The Triton interpreter pays per launch (~30 ms). fp32 needs the default ~65K-element probes (two
# equally good fp32 kernels differ by > 1 ulp in the max error of small samples); in bf16 the
# final rounding dominates both errors, so a small probe is as conclusive there and much cheaper.
SMALL = ProbeConfig(elements=4096)
CASES = [(a, "triton", torch.float32) for a in ARCHS]
CASES += [(a, "triton", torch.bfloat16) for a in ARCHS]
CASES += [(a, "torch", torch.float32) for a in ARCHS]


def _classes(model):
    return {p: type(m) for p, m in model.named_modules()}


@pytest.mark.parametrize("arch,impl,dtype", CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_patch_verify_revert(arch, impl, dtype):
    model = tiny_model(arch, dtype)
    classes = _classes(model)
    sd = {k: (v.dtype, v.shape, v.data_ptr()) for k, v in model.state_dict().items()}
    batch = probe_batch(model)
    kind, before = model_output(model, batch)

    report = patch(model, impl, probe=SMALL if dtype == torch.bfloat16 else None)

    norms = [f for f in walk.find_norms(model, warn=False)]
    assert report.ok and report.patched and not report.failed
    assert not report.by_status("unknown"), report.by_status("unknown")
    assert all(e.check is not None and e.check.passed for e in report.patched)
    assert len(report.patched) == len(norms)
    for e in report.patched:
        rep = walk.get_submodule(model, e.path)
        assert isinstance(rep, NormswapNorm) and rep.impl == impl and rep.original_class is classes[e.path]
    # state_dict: same keys, dtypes, shapes, and the very same storage (adopted parameters)
    assert {k: (v.dtype, v.shape, v.data_ptr()) for k, v in model.state_dict().items()} == sd
    # logits close to the original's (independently of the report's own check)
    _, after = model_output(model, batch)
    assert (after - before).abs().max() <= LOGITS_RTOL[dtype] * before.abs().max()
    assert report.model_check.passed and report.model_check.kind == kind

    reverted = revert(model)
    assert sorted(reverted) == sorted(e.path for e in report.patched)
    assert _classes(model) == classes
    _, again = model_output(model, batch)
    assert torch.equal(again, before)


def test_gradients_match_unpatched_model():
    """Training through the patch: every norm weight gets the gradient the original model gives."""
    ref = tiny_model("llama", torch.float32)
    model = copy.deepcopy(ref)
    patch(model, "triton")
    batch = probe_batch(ref)
    ids = batch["input_ids"]
    for m in (ref, model):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
    norm_params = [n for n, _ in ref.named_parameters() if "norm" in n]
    assert len(norm_params) == 5
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert got[name].grad is not None, name
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_filter_and_already_patched():
    model = tiny_model("qwen3")
    r = patch(model, "torch", filter_fn=regex_filter(exclude=r"q_norm|k_norm"))
    assert {e.path.rsplit(".", 1)[-1] for e in r.by_status("excluded")} == {"q_norm", "k_norm"}
    assert len(r.patched) == 5
    r2 = patch(model, "torch")  # the rest, without wrapping twice
    assert len(r2.patched) == 4 and len(r2.by_status("already-patched")) == 5
    assert not any(isinstance(m._normswap_original, NormswapNorm)
                   for _, m in model.named_modules() if isinstance(m, NormswapNorm))
    with pytest.raises(NormswapError, match=r"^only '\(': not a regular expression"):  # the parameter, not --only
        regex_filter(only="(")
    # a repeat count past re's limit raises OverflowError, not re.error: it was an internal error (exit 1)
    with pytest.raises(NormswapError, match=r"^exclude 'a\{99999999999\}': not a regular expression \(the repetition"):
        regex_filter(exclude="a{99999999999}")


class WeirdNorm(nn.Module):
    """Norm-like by name, but max-abs scaling: no family the registry knows."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        return x / x.abs().amax(-1, keepdim=True) * self.weight


class Wrapper(nn.Module):
    """A PEFT-like wrapper: the model lives under base_model.model, plus an extra norm."""

    def __init__(self, model):
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = model
        self.extra = WeirdNorm(32)

    @property
    def config(self):
        return self.base_model.model.config

    def forward(self, **kw):
        return self.base_model.model(**kw)


def test_wrapped_model_unknown_norms_and_strict():
    model = Wrapper(tiny_model("llama"))
    with pytest.raises(UnknownNormError, match="extra"):
        patch(model, "torch", strict=True)
    assert not any(isinstance(m, NormswapNorm) for m in model.modules())  # nothing changed
    r = patch(model, "torch")
    assert [e.path for e in r.by_status("unknown")] == ["extra"]
    assert all(e.path.startswith("base_model.model.") for e in r.patched) and len(r.patched) == 5
    assert revert(model) and not any(isinstance(m, NormswapNorm) for m in model.modules())


def test_failed_verification_undoes_everything(monkeypatch):
    def off_by_a_lot(x, w, eps, offset=0.0, casting="llama", **kw):
        return rms_norm_ref(x, w, eps, offset, casting, **kw) * 1.01

    from normswap import backends

    model = tiny_model("llama")
    classes = _classes(model)
    monkeypatch.setitem(backends._LOADERS, "reference",
                        lambda: Backend("reference", off_by_a_lot, layer_norm_ref))
    # patch's own caller leaves a norm out with filter_fn (patch_checkpoint's with exclude=REGEX)
    with pytest.raises(VerificationError, match=r"\(exclude it with filter_fn\)$") as info:
        patch(model, "reference")
    assert len(info.value.report.failed) == 5
    assert _classes(model) == classes


def test_failed_whole_model_check_undoes_everything(monkeypatch):
    # Right on the probe rows, wrong on the model's own (batch=2, seq=8) activations: every module
    # check passes; only the logits can catch it.
    def wrong_when_batched(x, w, eps, offset=0.0, casting="llama", **kw):
        y = rms_norm_ref(x, w, eps, offset, casting, **kw)
        return y * 1.05 if tuple(x.shape[:-1]) == (2, 8) else y

    from normswap import backends

    model = tiny_model("llama")
    classes = _classes(model)
    monkeypatch.setitem(backends._LOADERS, "reference",
                        lambda: Backend("reference", wrong_when_batched, layer_norm_ref))
    with pytest.raises(VerificationError, match="whole-model check failed") as info:
        patch(model, "reference", probe=SMALL)
    assert not info.value.report.failed and not info.value.report.model_check.passed
    assert _classes(model) == classes


def test_unavailable_impl_fails_before_any_change(monkeypatch):
    from normswap import backends

    def cannot_load():
        raise ImportError("quack needs an H100")

    monkeypatch.setitem(backends._LOADERS, "quack", cannot_load)
    model = tiny_model("llama")
    with pytest.raises(NormswapError, match=r"quack needs an H100.*available: .*reference"):
        patch(model, "quack")
    with pytest.raises(NormswapError, match="unknown backend"):
        patch(model, "no-such-impl")
    assert not any(isinstance(m, NormswapNorm) for m in model.modules())


def test_rms_for_must_name_layernorms():
    model = tiny_model("gpt2")
    with pytest.raises(NormswapError, match="not LayerNorms"):
        patch(model, "torch", rms_forms={"transformer.h.0.attn"})


def test_meta_model_without_verification():
    from tiny_models import tiny_config
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_config("llama"))
    r = patch(model, "torch", verify=False)
    assert len(r.patched) == 5 and r.model_check is None and not r.verified


def test_accelerate_offload_hooks_move_to_the_replacement():
    from accelerate import cpu_offload

    model = tiny_model("llama")
    batch = probe_batch(model)
    _, before = model_output(model, batch)
    cpu_offload(model, execution_device="cpu")
    assert model.model.norm.weight.device.type == "meta"  # really offloaded
    r = patch(model, "torch")
    assert r.ok and len(r.patched) == 5
    rep = model.model.norm
    assert isinstance(rep, NormswapNorm) and hasattr(rep, "_hf_hook")
    _, after = model_output(model, batch)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    revert(model)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm" and hasattr(model.model.norm, "_hf_hook")
    _, again = model_output(model, batch)
    torch.testing.assert_close(again, before, rtol=0, atol=1e-5)


def test_peft_wrapped_model():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    batch = probe_batch(model)
    _, before = model_output(model, batch)
    # the norms are also trained (modules_to_save matches every *norm): PEFT wraps each one,
    # holding the original and a trainable copy, and both are patched
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                      modules_to_save=["norm"]))
    r = patch(lora, "torch")
    assert r.ok and len(r.patched) == 10, [e.path for e in r.patched]
    assert sum(e.path.endswith("modules_to_save.default") for e in r.patched) == 5
    assert all(e.path.startswith("base_model.model.") for e in r.patched)
    _, after = model_output(lora, batch)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    # training the adapter still reaches the trainable norm copy through the replacement
    lora.train()
    lora(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad and "norm" in n]
    assert trainable and all(dict(lora.named_parameters())[n].grad is not None for n in trainable)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_triton_passes_verification(dtype):
    """The real SmolLM2-135M (61 RMSNorms, hidden 576): every module within one ulp of the
    original's error, logits within the dtype's tolerance. ~15 s per dtype in the interpreter."""
    from normswap.loading import DEFAULT_MODEL, load_model, resolve

    model = load_model(resolve(DEFAULT_MODEL), dtype=dtype)
    report = patch(model, "triton")
    assert report.ok and len(report.patched) == 61 and not report.by_status("unknown")
    assert all(e.check.passed and e.check.worst_margin_ulps <= 1 for e in report.patched)
    assert report.model_check.passed and report.model_check.argmax_agreement >= 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_smollm2_triton_on_cuda(dtype):
    """On a GPU the compiled kernels (not the interpreter) must pass the same per-module proof."""
    from normswap.loading import DEFAULT_MODEL, load_model, resolve

    model = load_model(resolve(DEFAULT_MODEL), dtype=dtype, device="cuda")
    report = patch(model, "triton")
    assert report.ok and len(report.patched) == 61
    assert all(e.check.passed for e in report.patched)
    assert report.model_check.passed


def test_plain_module_without_config():
    """Any nn.Module with norms can be patched; without a vocabulary there is no whole-model probe."""
    net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.LayerNorm(32, bias=False))
    x = torch.randn(4, 8)
    with torch.no_grad():
        want = net(x)
    r = patch(net, "torch", probe=ProbeConfig(elements=4096))
    assert len(r.patched) == 2 and r.model_check is None and r.ok
    with torch.no_grad():
        torch.testing.assert_close(net(x), want)


def test_training_model_keeps_train_mode_and_checks_without_dropout():
    model = tiny_model("gpt2").train()  # GPT-2 has dropout: a train-mode probe would never match
    r = patch(model, "torch", probe=ProbeConfig(elements=4096))
    assert r.ok and r.model_check.max_abs_diff < 1e-4
    assert all(m.training for m in model.modules())


def test_a_message_names_the_way_out_its_caller_has():
    """patch(model, ...)'s own caller reads its own arguments (rms_forms, filter_fn,
    fuse_residual); under an entry point with options of its own (patch_checkpoint, the command
    line: errors.using_option_names) the same message names those (rms=False, --no-rms)."""
    from normswap.errors import using_option_names

    def folded_but_changed():
        net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32))
        with torch.no_grad():
            net[1].weight.fill_(2.0)  # γ no longer the ones normswap convert left
        return net

    for names, says in (({}, "; patch with rms_forms leaving it out"), ({"rms": "rms"}, "; patch with rms=False"),
                        ({"rms": "--rms"}, "; patch with --no-rms"),
                        ({"impl": "--impl"}, "")):  # `normswap ppl` has no --rms: no way out to name
        with using_option_names(names), pytest.raises(NormswapError, match=f"conversion\\?\\){says}$"):
            patch(folded_but_changed(), "torch", rms_forms={"1": {"weight": False}}, probe=SMALL)
    net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32))  # no config.vocab_size: no token model
    for names, says in (({}, "fuse_residual"), ({"fuse_residual": "--fuse-residual"}, "--fuse-residual")):
        with using_option_names(names), pytest.raises(NormswapError, match=f"^{says} needs a token model"):
            patch(net, "torch", fuse_residual=True, probe=SMALL)
        assert not any(isinstance(m, NormswapNorm) for m in net.modules())
        with using_option_names(names), pytest.raises(NormswapError, match=f"^{says}: no residual writers"):
            patch(tiny_model("bert"), "torch", fuse_residual=True, probe=SMALL)
