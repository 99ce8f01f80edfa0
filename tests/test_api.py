"""The checkpoint-level API (normswap.api): each call does what its command does, its result's
to_dict() is the command's --json document, progress arrives through the callback, and in half
precision the diff is judged against the dtype's own noise floor."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from tiny_models import save_tiny, tiny_model, tiny_tokenizer

import normswap
from normswap import api
from normswap.cli import cli
from normswap.evaluate import NOISE_KL_FACTOR, diff_models
from normswap.loading import load
from normswap.manifest import read_manifest
from normswap.modules import RmsForm
from normswap.swap import PatchConfig, patch

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form. " * 6


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    save_tiny("llama", root / "llama")
    save_tiny("gpt2", root / "gpt2")
    (root / "text.txt").write_text(TEXT)
    return root


pytestmark = pytest.mark.usefixtures("small_probes")  # conftest's


def cli_json(*args):
    result = CliRunner().invoke(cli, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def as_json(d: dict) -> dict:
    """What emit() writes: strict JSON (tuples as lists, paths as strings)."""
    return json.loads(json.dumps(d, default=str))


# -- PatchConfig -------------------------------------------------------------------------------


def test_patch_config_round_trips_and_is_hashable():
    config = PatchConfig("torch", paths=["b", "a"], rms_forms={"a": {"weight": False, "bias": True}}, strict=True)
    assert config.paths == ("a", "b") and config.forms == {"a": RmsForm(weight=False, bias=True)}
    assert PatchConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert hash(config) == hash(PatchConfig.from_dict(config.to_dict()))
    with pytest.raises(ValueError):
        PatchConfig("")


def test_patch_applies_a_config_and_reports_the_one_that_does_it_again():
    model = tiny_model("llama")
    wanted = ("model.layers.0.input_layernorm", "model.norm")
    report = patch(model, PatchConfig("torch", paths=wanted), verify=False)
    assert tuple(sorted(m.path for m in report.patched)) == wanted
    assert {m.status for m in report.modules if m.path not in wanted} == {"excluded"}
    assert report.config == PatchConfig("torch", paths=wanted)
    again = tiny_model("llama")
    assert patch(again, report.config, verify=False).config == report.config


# -- patch_checkpoint --------------------------------------------------------------------------


def test_patch_checkpoint_is_the_patch_command(root, tmp_path):
    calls = []
    result = normswap.patch_checkpoint(root / "llama", "torch", out=tmp_path / "lib",
                                       evaluation=api.EvalSettings(root / "text.txt", max_length=32),
                                       progress=lambda *a: calls.append(a))
    assert result.report.ok and result.saved_to == (tmp_path / "lib").resolve()
    stages = [c[0] for c in calls]
    assert stages[0] == "load" and ("patch", 5, 5) in calls and calls[-1] == ("save", 4, 4)
    assert stages.index("patch") < stages.index("diff") < stages.index("save")
    assert result.eval.result.noise_floor is None  # fp32: no half-precision noise to judge against
    doc = cli_json("patch", root / "llama", "--impl", "torch", "--out", tmp_path / "cli", "--eval", root / "text.txt",
                   "--eval-max-length", 32)
    mine = as_json(result.to_dict())
    assert mine.pop("saved_to").endswith("lib") and doc.pop("saved_to").endswith("cli")
    assert mine == doc
    # The manifest's patch section is the config, and normswap.load applies it again.
    section = read_manifest(tmp_path / "lib")["patch"]
    assert PatchConfig.from_dict(section) == result.report.config
    assert load(tmp_path / "lib").normswap_report.config == result.report.config


def test_a_failed_patch_carries_its_result(root, monkeypatch):
    from normswap.swap import VerificationError

    monkeypatch.setattr("normswap.verify.MEAN_RATIO", 0.0)  # nothing can pass
    with pytest.raises(VerificationError) as e:
        api.patch_checkpoint(root / "llama", "torch")
    assert e.value.result.model == str(root / "llama") and not e.value.result.to_dict()["ok"]


def test_every_report_names_its_device_as_loading_device_label_does(root, monkeypatch):
    """The device a report names (the CPU: parse_device's None) is decided in one place,
    loading.device_label: patch's (a failed one's too, and its --eval's), ppl's and diff's reports
    each wrote `device or "cpu"` themselves, so one could drift from the others. device_label is
    made to answer something no copy of the old default would, and every report must say it."""
    from normswap import loading
    from normswap.swap import VerificationError

    monkeypatch.setattr(loading, "device_label", lambda device: f"label of {device}")
    settings = api.EvalSettings(root / "text.txt", max_length=32, max_tokens=64)
    patched = api.patch_checkpoint(root / "llama", "torch", evaluation=settings)
    assert patched.device == patched.eval.device == "label of None"
    assert api.evaluate_checkpoint(root / "llama", settings).device == "label of None"
    assert api.diff_checkpoints(root / "llama", settings=settings, patched="torch").device == "label of None"
    monkeypatch.setattr("normswap.verify.MEAN_RATIO", 0.0)  # nothing can pass
    with pytest.raises(VerificationError) as e:
        api.patch_checkpoint(root / "llama", "torch")
    assert e.value.result.device == "label of None"


# -- convert_checkpoint ------------------------------------------------------------------------


def test_convert_checkpoint_is_the_convert_command(root, tmp_path):
    stages = []
    result = api.convert_checkpoint(root / "gpt2", tmp_path / "lib", progress=lambda s, d, t: stages.append(s))
    assert result.out == (tmp_path / "lib").resolve() and result.section["verification"]["passed"]
    assert {"convert", "verify"} <= set(stages)
    doc = cli_json("convert", root / "gpt2", "--to", "rms", "--out", tmp_path / "cli")
    mine = as_json(result.to_dict())
    # Where it was written is "saved_to", as in patch's and bench's reports ("out", its older name
    # here, is still written, the same path).
    assert result.saved_to == result.out
    assert mine.pop("saved_to") == mine.pop("out") == str(result.out) and doc.pop("saved_to") == doc.pop("out")
    assert doc == mine
    assert read_manifest(tmp_path / "lib")["convert"] == as_json(result.section)


def test_convert_checkpoint_reads_plans_and_writes_once(root, tmp_path, monkeypatch):
    """Each config is read once (the source's, then the output's for its check), the plan built
    once and the manifest written once: the convert command once did each two or three times."""
    import collections

    from normswap import convert, convert_dir, loading, manifest, plan

    calls = collections.Counter()

    def counted(name, *modules):
        """Count calls of `name` through every binding of it (modules that import it by name too)."""
        real = getattr(modules[0], name)

        def call(*args, **kwargs):
            calls[name, str(getattr(args[0], "path", args[0]))] += 1
            return real(*args, **kwargs)
        for module in modules:
            monkeypatch.setattr(module, name, call)

    counted("load_config", loading)
    counted("plan_conversion", plan, convert, convert_dir)
    counted("write_manifest", manifest, convert_dir)
    api.convert_checkpoint(root / "gpt2", tmp_path / "out")
    assert sorted(n for n, _ in calls.elements()) == ["load_config", "load_config", "plan_conversion", "write_manifest"]
    assert max(calls.values()) == 1, calls


def test_convert_checkpoint_refusal_carries_the_report(tmp_path):
    save_tiny("bert", tmp_path / "bert")
    with pytest.raises(api.ConversionRefused) as e:
        api.convert_checkpoint(tmp_path / "bert", tmp_path / "out")
    doc = e.value.result.to_dict()
    assert doc["saved_to"] is None and doc["error"] == str(e.value) and all(n["why_not"] for n in doc["norms"])
    assert doc["out"] is None  # the older name, still written
    assert not (tmp_path / "out").exists()


# -- evaluate_checkpoint / diff_checkpoints ------------------------------------------------------


def test_evaluate_and_diff_are_the_ppl_and_diff_commands(root):
    settings = api.EvalSettings(root / "text.txt", max_length=32)
    ppl = api.evaluate_checkpoint(root / "llama", settings)
    assert as_json(ppl.to_dict()) == cli_json("ppl", root / "llama", "--data", root / "text.txt", "--max-length", 32)
    diff = api.diff_checkpoints(root / "llama", settings=settings, patched="torch")
    assert as_json(diff.to_dict()) == cli_json("diff", root / "llama", "--patched", "torch", "--data",
                                               root / "text.txt", "--max-length", 32)
    assert diff.result.ppl_a == pytest.approx(ppl.result.ppl, rel=1e-12)


@pytest.mark.parametrize("window, says", [(dict(max_length=1), "max_length 1: a window needs at least 2 tokens"),
                                          (dict(stride=0), "stride 0: must be a positive number of tokens"),
                                          (dict(max_tokens=2.5), "max_tokens must be a whole number of tokens")])
def test_every_scoring_entry_point_checks_its_window_options_before_reading_anything(root, tmp_path, monkeypatch,
                                                                                      window, says):
    """The library's three scoring calls check EvalSettings first, as the commands check their
    options: patch_checkpoint reached its only check after reading the model's config and
    manifest, evaluate/diff checked twice."""
    from normswap import loading
    from normswap.errors import BadInputError

    def no_read(*a, **k):
        raise AssertionError("the model was read before the window options were checked")

    monkeypatch.setattr(loading, "resolve", no_read)
    settings = api.EvalSettings(root / "text.txt", **window)
    for call in (lambda: api.patch_checkpoint(root / "llama", "torch", out=tmp_path / "o", evaluation=settings),
                 lambda: api.evaluate_checkpoint(root / "llama", settings),
                 lambda: api.diff_checkpoints(root / "llama", settings=settings, patched="torch")):
        with pytest.raises(BadInputError, match=f"^{says}"):
            call()
    assert not (tmp_path / "o").exists()


# -- the noise floor ------------------------------------------------------------------------------


def test_half_precision_diff_is_judged_against_the_noise_floor(root):
    settings = api.EvalSettings(root / "text.txt", max_length=32)
    calls = []
    d = api.diff_checkpoints(root / "llama", settings=settings, patched="torch", dtype="bf16",
                             progress=lambda *a: calls.append(a))
    # The float32 reference is a second load of A, as long as the first: a stage of its own.
    assert [c for c in calls if c[0] == "reference"] == [("reference", 0, 1), ("reference", 1, 1)]
    noise = d.result.noise_floor
    assert noise is not None and noise.dtype == "bfloat16" and noise.limit == NOISE_KL_FACTOR
    # bf16 really is away from float32, and a faithful kernel is as far from it as the original
    assert noise.original.kl_mean > 0 and noise.patched.kl_mean > 0
    assert noise.within and noise.kl_ratio <= NOISE_KL_FACTOR and "within the bfloat16 noise" in noise.verdict
    assert noise.ppl_reference == pytest.approx(api.evaluate_checkpoint(root / "llama", settings).result.ppl)
    doc = d.to_dict()["noise_floor"]
    assert doc["within"] and set(doc["original"]) == {"delta_ppl", "relative_delta", "kl_mean", "kl_max",
                                                      "top1_agreement"}
    human = CliRunner().invoke(cli, ["diff", str(root / "llama"), "--patched", "torch", "--data",
                                     str(root / "text.txt"), "--max-length", "32", "--dtype", "bf16"])
    assert human.exit_code == 0 and noise.verdict in human.stdout
    assert "load float32 reference (noise floor) ...\n" in human.stderr


def test_patch_eval_in_half_precision_reports_the_noise_floor(root):
    result = api.patch_checkpoint(root / "llama", "torch", dtype="bf16",
                                  evaluation=api.EvalSettings(root / "text.txt", max_length=32))
    noise = result.to_dict()["eval"]["noise_floor"]
    assert noise["dtype"] == "bfloat16" and noise["within"] and noise["verdict"].startswith("bfloat16 noise floor")


def test_a_bug_is_outside_the_noise_floor():
    """A patched model that is wrong (here: one norm with another eps) is far outside the noise."""
    reference = tiny_model("llama", dtype=torch.float32)
    original = copy.deepcopy(reference).to(torch.bfloat16)
    broken = copy.deepcopy(original)
    broken.model.layers[0].input_layernorm.variance_epsilon = 0.5
    faithful = copy.deepcopy(original)
    patch(faithful, "torch", verify=False)
    kwargs = dict(max_length=32, progress=False, reference=reference)
    good = diff_models(original, faithful, tiny_tokenizer(), TEXT, **kwargs).noise_floor
    bad = diff_models(original, broken, tiny_tokenizer(), TEXT, **kwargs).noise_floor
    assert good.within and not bad.within
    assert bad.kl_ratio > 10 * NOISE_KL_FACTOR and "OUTSIDE the bfloat16 noise" in bad.verdict


# -- progress: one callback shape everywhere -----------------------------------------------------


def test_patch_save_and_load_call_progress_with_stage_done_total(tmp_path):
    """The model-level calls take the same progress(stage, done, total) as the checkpoint-level
    ones (normswap.progress.ProgressFn): no adapter between them."""
    from normswap.checkpoint import save_patched

    model = tiny_model("llama")
    calls = []
    report = normswap.patch(model, "torch", progress=lambda *a: calls.append(a))
    n = len(report.patched)
    assert n > 1 and calls == [("patch", i, n) for i in range(n + 1)]
    calls.clear()
    save_patched(model, report, tmp_path / "out", progress=lambda *a: calls.append(a))
    assert calls == [("save", i, 4) for i in range(5)]
    calls.clear()
    loaded = normswap.load(tmp_path / "out", progress=lambda *a: calls.append(a))
    assert len(loaded.normswap_report.patched) == n and calls == [("patch", i, n) for i in range(n + 1)]
