"""`normswap patch --eval PATH`: the perplexity diff of the patched model against the original."""

import json

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
