"""The names README.md promises at the top level of the package."""

from pathlib import Path

import normswap


def test_every_public_name_resolves():
    for name in normswap.__all__:
        assert getattr(normswap, name) is not None, name
    assert callable(normswap.perplexity) and callable(normswap.convert_model)


def test_unknown_names_still_raise_attribute_error():
    import pytest

    with pytest.raises(AttributeError):
        normswap.no_such_thing  # noqa: B018


def test_the_errors_the_api_raises_are_public():
    """patch/patch_checkpoint raise VerificationError and convert_checkpoint ConversionRefused,
    each carrying its report: a caller catches them without reaching into a submodule."""
    from normswap.api import ConversionRefused
    from normswap.swap import VerificationError

    assert normswap.VerificationError is VerificationError and normswap.ConversionRefused is ConversionRefused
    assert issubclass(VerificationError, normswap.NormswapError) and issubclass(ConversionRefused, normswap.NormswapError)


# --------------------------------------------------------------------------- hostile arguments

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from tiny_models import save_tiny

    d = tmp_path_factory.mktemp("api") / "gpt2"
    save_tiny("gpt2", d)
    return d


def _meta_gpt2():
    import transformers
    from tiny_models import tiny_config

    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(tiny_config("gpt2"))


def _hostile_calls(d, out):
    """(what is called, the exception, what its message must say): each public name with an argument
    of the wrong kind, which used to end in an AttributeError deep inside, a message naming no
    argument, or (rms_forms="path") a str taken letter by letter."""
    from tiny_models import tiny_model, tiny_tokenizer

    from normswap import EvalSettings

    g, tok, text = tiny_model("gpt2"), tiny_tokenizer(), "In the beginning God created the heaven. " * 10
    settings = EvalSettings(d.parent / "t.txt", max_length=16, max_tokens=64)
    P = normswap
    return [
        (lambda: P.patch(str(d), "torch"), TypeError, "model: expected a torch.nn.Module, got str"),
        (lambda: P.patch(None, "torch"), TypeError, "model: expected a torch.nn.Module, got NoneType"),
        (lambda: P.revert(str(d)), TypeError, "model: expected a torch.nn.Module"),
        (lambda: P.convert_model(d), TypeError, "model: expected a torch.nn.Module, got PosixPath"),
        (lambda: P.convert_model(torch.nn.Linear(4, 4)), TypeError, r"model: expected a transformers model \(with a .config\)"),
        (lambda: P.patch(g, "torch", filter_fn="ln_1"), TypeError, "filter_fn: expected a function"),
        (lambda: P.patch(g, "torch", rms_forms="transformer.ln_f"), TypeError, "rms_forms: expected a collection"),
        (lambda: P.patch(g, "torch", rms_forms=[3]), TypeError, "rms_forms: module paths are strings, got 3"),
        (lambda: P.patch(g, "torch", fuse_residual="yes"), TypeError, "fuse_residual: expected a bool or a mapping"),
        (lambda: P.patch(g, "torch", progress=3), TypeError, "progress: expected a function"),
        (lambda: P.PatchConfig.from_dict([]), TypeError, "PatchConfig.from_dict: expected a mapping"),
        (lambda: P.perplexity(str(d), tok, text, progress=False), TypeError, "model: expected a torch.nn.Module"),
        (lambda: P.perplexity(_meta_gpt2(), tok, text, progress=False), P.NormswapError,
         "model: transformer.wte.weight is on the meta device"),
        (lambda: P.perplexity(g, str(d), text, progress=False), TypeError, "tokenizer: expected a tokenizer"),
        (lambda: P.perplexity(g, tok, None, progress=False), TypeError, "data: expected a text, .* got NoneType"),
        (lambda: P.diff_models(g, None, tok, text, progress=False), TypeError, "model_b: expected a torch.nn.Module"),
        (lambda: P.diff_models(g, g, tok, text, reference="x", progress=False), TypeError, "reference: expected"),
        (lambda: P.load(g), TypeError, "directory: expected a model directory, .* got GPT2LMHeadModel"),
        (lambda: P.patch_checkpoint(g, "torch", out=out), TypeError, "model: expected a model directory"),
        (lambda: P.patch_checkpoint(d, "torch", out=3), TypeError, "out: expected a folder path"),
        (lambda: P.patch_checkpoint(d, "torch", out=out, evaluation=str(d)), TypeError, "evaluation: expected normswap.EvalSettings"),
        (lambda: P.patch_checkpoint(d, "torch", out=out, only=3), TypeError, r"only: expected a regular expression \(str\)"),
        (lambda: P.convert_checkpoint(d, None), TypeError, "out: expected a folder path .*got NoneType"),
        (lambda: P.evaluate_checkpoint(d, str(d)), TypeError, "settings: expected normswap.EvalSettings"),
        (lambda: P.evaluate_checkpoint(d, EvalSettings(None)), TypeError, "EvalSettings.data: expected a data path"),
        (lambda: P.diff_checkpoints(d, g, settings=settings), TypeError, "b: expected a model directory"),
        (lambda: P.bench_checkpoint(g, "torch", out=out / "b.json"), TypeError, "model: expected a model directory"),
        (lambda: P.bench_checkpoint(d, 3, out=out / "b.json"), TypeError, "impls: expected names"),
        # a str read letter by letter, a flag given "no" (truthy: yes), a path that names no norm:
        # each a patch that silently did something else than asked
        (lambda: P.PatchConfig("torch", paths="transformer.ln_f"), TypeError, "paths: expected None or a list"),
        (lambda: P.PatchConfig("torch", rms_forms="x"), TypeError, "rms_forms: expected a mapping"),
        (lambda: P.PatchConfig("torch", fuse_residual="yes"), TypeError, "fuse_residual: expected a bool"),
        (lambda: P.PatchConfig("torch", strict="no"), TypeError, "strict: expected True or False, got 'no'"),
        (lambda: P.patch(g, P.PatchConfig("torch", paths=["nope.ln"])), P.NormswapError,
         "paths names modules that are not norms here: nope.ln"),
        (lambda: P.patch(g, "torch", strict="no"), TypeError, "strict: expected True or False"),
        (lambda: P.patch(g, "torch", verify="no"), TypeError, "verify: expected True or False"),
        (lambda: P.RmsForm(weight="x"), TypeError, "RmsForm.weight: expected True or False"),
        (lambda: P.perplexity(g, tok, text, progress="no"), TypeError, "progress: expected True, False or a function"),
        (lambda: P.convert_model(g, keep_gain="x"), TypeError, "keep_gain: expected True or False"),
        (lambda: P.patch_checkpoint(d, "torch", out=out, force="no"), TypeError, "force: expected True or False"),
        (lambda: P.convert_checkpoint(d, out, partial="no"), TypeError, "partial: expected True or False"),
        (lambda: P.diff_checkpoints(d, patched="torch", settings=settings, noise_floor="no"), TypeError,
         "noise_floor: expected True or False"),
        # a dtype the weights cannot take (the original LayerNorm raised a RuntimeError from the probe)
        (lambda: P.patch(g, "torch", dtype="fp64"), P.VerificationError,
         r"the original itself raised on torch.float64 input \(RuntimeError: .*\); verify in the dtype the model"),
        (lambda: P.tune_launches(ops=3), TypeError, "ops: expected a comma list or a list, got 3"),
        # a float reached transformers' parser of "5GB" strings (AttributeError: no .upper), and
        # True was taken as 1 byte: a shard per tensor
        (lambda: P.patch_checkpoint(d, "torch", out=out, max_shard_size=1.5), TypeError,
         r"max_shard_size: expected a size such as '5GB' or a number of bytes \(int\), got float"),
        (lambda: P.patch_checkpoint(d, "torch", out=out, max_shard_size=True), TypeError, "max_shard_size: .*got bool"),
        # None compared with 1: a TypeError naming no argument
        (lambda: P.evaluate_checkpoint(d, EvalSettings(d.parent / "t.txt", batch_size=None)), P.NormswapError,
         "batch_size must be a whole number of windows, got None"),
        # impls=[] timed the unpatched model alone, and repeats=1.5 reached range() after the
        # model was built: a TypeError naming no argument
        (lambda: P.bench_checkpoint(d, [], modes="prefill", seq=4, out=out / "b.json"), ValueError,
         "impls names no implementation; expected one or more of "),
        (lambda: P.bench_checkpoint(d, "torch", modes="prefill", seq=4, repeats=1.5, out=out / "b.json"), TypeError,
         r"repeats: expected a whole number \(int\), got 1.5"),
        (lambda: P.bench_checkpoint(d, "torch", modes="prefill", seq=4, warmup=True, out=out / "b.json"), TypeError,
         "warmup: expected a whole number .*got True"),
        # torch.device(None): torch's TypeError, naming no argument
        (lambda: P.patch_checkpoint(d, "torch", out=out, device=None), TypeError,
         r"device: expected 'auto', 'cpu', 'cuda' or 'cuda:N' \(str\), got NoneType"),
        # load checked its dtype first and passed device and progress on: a device transformers
        # cannot place weights on said so after the manifest was read; a progress that is no function
        # failed after every weight had loaded
        (lambda: P.load(d, device="tpu"), P.NormswapError, "unknown device 'tpu'; choose auto, cpu, cuda or cuda:N"),
        (lambda: P.load(d, device=5), TypeError, r"device: expected 'auto', 'cpu', 'cuda' or 'cuda:N' \(str\), got int"),
        (lambda: P.load(d, progress="yes"), TypeError, "progress: expected a function .stage, done, total. or None, got str"),
        # the checkpoint calls called it at their first stage: "'int' object is not callable"
        (lambda: P.patch_checkpoint(d, "torch", out=out, progress=5), TypeError, "progress: expected a function"),
        (lambda: P.convert_checkpoint(d, out, progress=5), TypeError, "progress: expected a function"),
        (lambda: P.evaluate_checkpoint(d, settings, progress=True), TypeError,
         r"progress: expected a function .stage, done, total. or None, got bool \(normswap.progress.ProgressBars"),
        (lambda: P.diff_checkpoints(d, patched="torch", settings=settings, progress=5), TypeError,
         "progress: expected a function"),
        (lambda: P.bench_checkpoint(d, "torch", modes="prefill", seq=4, out=out / "b.json", progress=5), TypeError,
         "progress: expected a function"),
    ]


N_HOSTILE = 58


def test_every_hostile_case_is_listed():
    assert len(_hostile_calls(Path("/nonexistent/gpt2"), Path("/nonexistent/out"))) == N_HOSTILE


@pytest.mark.parametrize("i", range(N_HOSTILE))
def test_a_wrong_kind_of_argument_is_a_clear_error_naming_it(gpt2_dir, tmp_path, i):
    (gpt2_dir.parent / "t.txt").write_text("In the beginning God created the heaven and the earth. " * 20)
    call, error, message = _hostile_calls(gpt2_dir, tmp_path / "out")[i]
    with pytest.raises(error, match=message) as e:
        call()
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_patching_again_with_another_impl_is_refused_not_ignored():
    """The second patch used to keep the first impl and report the second: a silently wrong patch.
    The same impl again stays idempotent (nothing wrapped twice)."""
    from tiny_models import tiny_model

    from normswap.swap import patched_modules

    model = tiny_model("gpt2")
    first = normswap.patch(model, "torch")
    again = normswap.patch(model, "torch")
    assert len(again.by_status("already-patched")) == len(first.patched) == 5 and not again.patched
    with pytest.raises(normswap.NormswapError, match="is already patched with torch; normswap.revert"):
        normswap.patch(model, "reference")
    with pytest.raises(normswap.NormswapError, match="transformer.ln_f is already patched with torch"):
        normswap.patch(model, "torch", rms_forms=["transformer.ln_f"])
    assert {m.impl for _, m in patched_modules(model)} == {"torch"}
    assert len(normswap.revert(model)) == 5
    assert len(normswap.patch(model, "reference").patched) == 5


def test_patching_again_with_the_same_rms_forms_stays_idempotent():
    """Only a different RMS form (or impl) is refused: the same call again, as normswap.load's
    config re-applied, changes nothing and says so."""
    import re

    from tiny_models import tiny_model

    model = tiny_model("gpt2")
    normswap.patch(model, "torch", rms_forms=["transformer.ln_f"], check_model=False)
    again = normswap.patch(model, "torch", rms_forms=["transformer.ln_f"], check_model=False)
    assert not again.patched and "transformer.ln_f" in {e.path for e in again.by_status("already-patched")}
    # a compiled pattern, which re.compile (and so --only's library form) always took
    assert normswap.swap.regex_filter(only=re.compile(r"ln_f$"))(None, "transformer.ln_f")


def test_an_original_that_raises_in_its_own_dtype_is_not_blamed_on_the_dtype(monkeypatch):
    """The dtype hint is for patch(dtype=...) the weights cannot take; an original that fails in the
    dtype it runs in is a failed check with its own reason only."""
    from tiny_models import tiny_model

    from normswap import verify

    def broken(original, x):
        raise ValueError("this norm wants another input shape")

    monkeypatch.setattr(verify, "_run_original", broken)
    with pytest.raises(normswap.VerificationError, match="another input shape") as e:
        normswap.patch(tiny_model("gpt2"), "torch")
    assert "verify in the dtype" not in str(e.value)


def test_each_public_name_is_listed_once():
    """0849d85 made BadInputError and NormswapError lazy (in _LAZY) but kept them in __all__ beside
    *_LAZY: each was listed twice (what `from normswap import *`, documentation tools and
    `help(normswap)` read)."""
    assert len(normswap.__all__) == len(set(normswap.__all__)), sorted(normswap.__all__)
    assert {"BadInputError", "NormswapError", "__version__"} <= set(normswap.__all__)
