"""`normswap patch --eval PATH`: the perplexity diff of the patched model against the original."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import save_tiny

from normswap.cli import cli

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form. " * 6


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory):
    root = tmp_path_factory.mktemp("patch-eval")
    save_tiny("gpt2", root / "gpt2")
    (root / "text.txt").write_text(TEXT)
    return root / "gpt2", root / "text.txt"


def run(*args):
    return CliRunner().invoke(cli, ["patch", *map(str, args)])


def test_eval_reports_a_near_zero_diff(model_and_text):
    model, text = model_and_text
    result = run(model, "--impl", "torch", "--eval", text, "--eval-max-length", 32, "--json")
    assert result.exit_code == 0, result.stderr
    ev = json.loads(result.stdout)["eval"]
    assert ev["model_b"].endswith("--impl torch") and ev["tokens"] == len(TEXT) - 1
    assert ev["top1_agreement"] == 1.0 and abs(ev["relative_delta"]) < 1e-6 and ev["kl_mean"] < 1e-9
    human = run(model, "--impl", "torch", "--eval", text, "--eval-max-length", 32)
    assert human.exit_code == 0 and "KL(A||B)" in human.stdout and "top-1 agree" in human.stdout


def test_without_eval_there_is_no_diff(model_and_text):
    model, _ = model_and_text
    result = run(model, "--impl", "torch", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["eval"] is None


@pytest.mark.parametrize("args, says", [
    (["--eval", "/no/such/file.txt"], "no/such/file.txt"),
    (["--eval", "TEXT", "--eval-max-length", 0], "max-length"),
    (["--eval", "TEXT", "--eval-max-length", 32, "--eval-max-tokens", 10], "shorter than one window"),
])
def test_bad_eval_input_fails_before_loading(model_and_text, args, says):
    model, text = model_and_text
    args = [text if a == "TEXT" else a for a in args]
    result = run(model, "--impl", "torch", *args)
    assert result.exit_code == 2 and says in result.stderr and "Traceback" not in result.stderr
    assert "patch+verify" not in result.stderr  # refused before the model was loaded and patched


def _impls(model) -> set:
    """The implementations the model's norms run with (None: a norm of its own class)."""
    return {getattr(m, "impl", None) for m in model.modules() if "norm" in type(m).__name__.lower()}


def test_eval_on_a_folder_patch_wrote_compares_with_the_folder_as_it_loads(model_and_text, tmp_path, monkeypatch):
    """`patch --out fast`, then `patch fast --impl IMPL --eval`: A is fast as ppl, diff and
    normswap.load run it (its recorded patch), not its stock modules, which credited the new patch
    with whatever the recorded one already did. The new patch still replaces the recorded one, from
    the stock weights, and is what --out saves."""
    import normswap
    from normswap import evaluate

    model, text = model_and_text
    fast = tmp_path / "fast"
    normswap.patch_checkpoint(model, "torch", out=fast)
    scored = []
    real = evaluate.diff_models
    monkeypatch.setattr(evaluate, "diff_models", lambda *a, **k: scored.append(a[:2]) or real(*a, **k))
    result = run(fast, "--impl", "reference", "--eval", text, "--eval-max-length", 32, "--out", tmp_path / "again",
                 "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    ev = doc["eval"]
    assert (ev["model_a"], ev["impl_a"], ev["impl_b"]) == (str(fast), "torch", "reference")
    model_a, model_b = scored.pop()
    assert _impls(model_a) == {"torch"} and _impls(model_b) == {"reference"}
    assert all(m["status"] == "patched" for m in doc["modules"])  # patched afresh, each module verified
    saved = json.loads((tmp_path / "again" / "normswap.json").read_text())["patch"]
    assert saved["impl"] == "reference" and saved["source"] == str(fast)
    human = run(fast, "--impl", "reference", "--eval", text, "--eval-max-length", 32)
    assert human.exit_code == 0, human.stderr
    assert "perplexity diff, as it loads (A) vs patched (B):" in human.stdout
    assert f"A: {fast} (its normswap.json's patch, run with torch)\nB: {fast} --impl reference\n" in human.stdout
    # an unpatched model is still compared with its own modules
    assert run(model, "--impl", "torch", "--eval", text, "--eval-max-length", 32, "--json").exit_code == 0
    assert _impls(scored.pop()[0]) == {None}


def test_eval_on_a_folder_whose_recorded_patch_cannot_run_here_is_refused(model_and_text, tmp_path, monkeypatch):
    """With no way to run the recorded patch (liger, on a CPU-only machine) there is no honest
    baseline: --eval is refused before anything loads, saying why; patching without --eval still
    works (the new patch replaces the recorded one, from the stock weights)."""
    import sys

    import normswap

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not importable, on a GPU machine with it too

    model, text = model_and_text
    fast = tmp_path / "fast"
    normswap.patch_checkpoint(model, "torch", out=fast)
    manifest = json.loads((fast / "normswap.json").read_text())
    manifest["patch"]["impl"] = "liger"
    (fast / "normswap.json").write_text(json.dumps(manifest))
    result = run(fast, "--impl", "torch", "--eval", text, "--eval-max-length", 32, "--json")
    assert result.exit_code == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert "records a liger patch, which cannot run here" in result.stderr and "drop --eval" in result.stderr
    assert "patch+verify" not in result.stderr and "--impl torch" not in result.stderr  # refused before the load
    result = run(fast, "--impl", "torch", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"], result.stderr


@pytest.mark.parametrize("where", ["out", "in-place"])
def test_the_source_manifest_is_read_once(model_and_text, tmp_path, monkeypatch, where):
    """`patch --eval` on a folder an earlier `patch --out` wrote read its normswap.json three times:
    for its convert section, for the recorded patch A runs, and again for the save to keep the
    convert section. One reading serves all three (test_patch_cli and test_convert_patch check
    that a converted source's convert section is still saved)."""
    import normswap
    from normswap import manifest as manifest_module

    model, text = model_and_text
    fast = tmp_path / "fast"
    normswap.patch_checkpoint(model, "torch", out=fast)
    doc = json.loads((fast / "normswap.json").read_text())
    assert "convert" not in doc
    reads = []
    real = manifest_module.read_manifest
    monkeypatch.setattr(manifest_module, "read_manifest", lambda where: reads.append(Path(where)) or real(where))
    target = fast if where == "in-place" else tmp_path / "again"
    args = ["--in-place"] if where == "in-place" else ["--out", target]
    result = run(fast, "--impl", "reference", "--eval", text, "--eval-max-length", 32, *args, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["eval"]["impl_a"] == "torch"  # A ran the recorded patch
    assert json.loads((target / "normswap.json").read_text())["patch"]["impl"] == "reference"
    assert [p for p in reads if p.resolve() == fast.resolve()] == [fast], reads


def test_the_eval_reports_the_device_the_patch_ran_on(model_and_text, monkeypatch):
    """patch --eval's diff runs on the patched model's device and says so (eval.device), as ppl and
    diff do: it would otherwise read "cpu" whatever --device gave. No CUDA here, so parse_device
    is made to answer cuda:0 and the load is done on the CPU."""
    from normswap import loading

    model, text = model_and_text
    load = loading.load_model
    monkeypatch.setattr(loading, "parse_device", lambda name: "cuda:0")
    monkeypatch.setattr(loading, "load_model", lambda source, *a, device=None, **k: load(source, *a, **k))
    result = run(model, "--impl", "torch", "--eval", text, "--eval-max-length", 32, "--device", "cuda:0", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["device"] == doc["eval"]["device"] == "cuda:0"
