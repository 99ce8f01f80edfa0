"""`normswap demo`: scan, patch and diff of the embedded SmolLM2-135M, end to end."""

import json

import pytest
from click.testing import CliRunner

from normswap.cli import cli


@pytest.mark.slow
def test_demo_scans_patches_and_diffs_the_default_model():
    result = CliRunner().invoke(cli, ["demo", "--json", "--max-tokens", "128"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["scan"]["summary"]["by_class"] == {"LlamaRMSNorm": 61}
    patch = doc["patch"]
    assert patch["ok"] and patch["impl"] == "triton" and patch["counts"]["patched"] == 61
    assert all(m["check"]["passed"] for m in patch["modules"])
    ev = patch["eval"]
    assert ev["tokens"] == 127 and ev["top1_agreement"] > 0.99
    assert abs(ev["relative_delta"]) < 1e-4 and 0 <= ev["kl_mean"] < 1e-6
    assert 1.5 < ev["ppl_a"] < 100


def test_demo_human_output_names_each_step(monkeypatch):
    """The human form runs the real commands in order (stubbed here: the slow test runs them)."""
    calls = []
    for name in ("scan", "patch"):
        command = cli.get_command(None, name)
        monkeypatch.setattr(command, "callback", lambda name=name, **kw: calls.append((name, kw)))
    result = CliRunner().invoke(cli, ["demo", "--impl", "torch"])
    assert result.exit_code == 0, result.stderr
    assert [c[0] for c in calls] == ["scan", "patch"]
    assert calls[1][1]["impl"] == "torch" and calls[1][1]["eval_path"].endswith("genesis-kjv.txt")
    assert "$ normswap patch smollm2-135m --impl torch --eval" in result.stderr
