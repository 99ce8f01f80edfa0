"""`normswap demo`: scan, patch and diff of the embedded SmolLM2-135M, end to end."""

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from normswap.cli import cli


@pytest.mark.slow
def test_demo_scans_patches_and_diffs_the_default_model():
    """The demo as `make demo` runs it (512 tokens): it patches and verifies every norm, and prints
    the figures README.md's demo table quotes as measured on this project's CPU machine. A change
    that moves them (a kernel's rounding, the probes, the evaluation) fails here until the table is
    measured again, to the digits where every CPU computes them alike and to their order where the
    CPU's float32 rounding decides them (_matches_the_readme_table)."""
    result = CliRunner().invoke(cli, ["demo", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["scan"]["summary"]["by_class"] == {"LlamaRMSNorm": 61}
    patch = doc["patch"]
    assert patch["ok"] and patch["impl"] == "triton" and patch["counts"]["patched"] == 61
    assert all(m["check"]["passed"] for m in patch["modules"])
    ev = patch["eval"]
    assert ev["tokens"] == 511 and ev["top1_agreement"] > 0.99
    assert abs(ev["relative_delta"]) < 1e-4 and 0 <= ev["kl_mean"] < 1e-6
    assert 1.5 < ev["ppl_a"] < 100
    _matches_the_readme_table(patch)


def _matches_the_readme_table(patch: dict) -> None:
    """Each figure of README.md's demo table, rendered as the table writes it, is in its row.

    The figures the CPU's own arithmetic decides (the whole-model logits difference, Δppl, the KL
    and Δlogit of two float32 models that differ by rounding) are held to the order of magnitude the
    table quotes, not to its digits: the same run on an AVX2 CPU (ATEN_CPU_CAPABILITY=avx2
    MKL_ENABLE_INSTRUCTIONS=AVX2 on the AVX-512 machine that measured the table) gives logits
    4.77e-05, Δppl +1.9e-06, KL 9.4e-12 / 9.3e-11, Δlogit 7.8e-05, where the digits failed any
    machine but that one. The rest (counts, the float64 errors, the perplexities to 4 places) is
    the same there and is held to the digits."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = dict(re.findall(r"^\| ([^|]+?) \| (.+) \|$", readme.split("## Install", 1)[0], re.M))
    ev, mc = patch["eval"], patch["model_check"]
    worst = max(m["check"]["worst_margin_ulps"] for m in patch["modules"])
    ppl_row = "perplexity, the first 512 tokens of Genesis (KJV: 1:1–1:18), 511 scored"
    wanted = [  # (row, what it must say)
        ("modules patched and verified", f"{patch['counts']['patched']} / {len(patch['modules'])} pass"),
        ("largest error vs float64", f"original {patch['max_err_original']:.3g}, triton {patch['max_err_replacement']:.3g}"),
        ("largest error vs float64", f"worst module {worst:+.2f} ulp over the original"),
        ("whole-model logits", f"of {mc['max_abs_value']:.3g}"),
        (ppl_row, f"original {ev['ppl_a']:.4f}, patched {ev['ppl_b']:.4f}"),
    ]
    wrong = [f"{row}: measured {text!r}, README says {rows.get(row)!r}"
             for row, text in wanted if text not in rows.get(row, "")]
    number = r"([-+]?\d[\d.]*(?:e[-+]?\d+)?)"
    rounding = [  # (row, the quoted figure, measured, the factor it may be off either way; None: only above)
        ("whole-model logits", rf"max \\\|Δ\\\| {number}", mc["max_abs_diff"], 3),
        (ppl_row, rf"\(Δ {number},", ev["delta_ppl"], None),
        (ppl_row, rf", {number} %\)", 100 * ev["relative_delta"], None),
        ("KL(original ‖ patched)", rf"mean {number},", ev["kl_mean"], 3),
        ("KL(original ‖ patched)", rf"max {number} nats", ev["kl_max"], 3),
        ("KL(original ‖ patched)", rf"max \\\|Δlogit\\\| {number}", ev["max_abs_logit_diff"], 3),
    ]
    for row, pattern, measured, factor in rounding:
        m = re.search(pattern, rows.get(row, ""))
        if not m:
            wrong.append(f"{row}: no figure {pattern!r} in {rows.get(row)!r}")
            continue
        quoted = abs(float(m.group(1)))
        # A difference of two near-equal sums (Δppl) is noise in sign and size: only its order is a claim.
        low, high = (quoted / factor, quoted * factor) if factor else (0.0, quoted * 10)
        if not low <= abs(measured) <= high:
            wrong.append(f"{row}: measured {measured:.2g}, README says {m.group(1)}")
    assert wrong == [], "README.md's demo table is out of date (measure it again):\n" + "\n".join(wrong)


def test_demo_calls_the_library_and_names_each_step(monkeypatch):
    """The demo makes the library calls the commands make (stubbed here: the slow test runs them),
    shows each as the command a user would type, and --json holds both results."""
    from types import SimpleNamespace

    from normswap import api, scan

    calls = []
    monkeypatch.setattr(scan, "scan", lambda ref, **kw: calls.append(("scan", ref, kw)) or
                        {"model": ref, "unknown": []})
    monkeypatch.setattr(api, "patch_checkpoint", lambda ref, impl, **kw: calls.append(("patch", ref, dict(kw, impl=impl)))
                        or SimpleNamespace(to_dict=lambda: {"impl": impl}))
    result = CliRunner().invoke(cli, ["demo", "--impl", "torch", "--json"])
    assert result.exit_code == 0, result.stderr
    assert [c[:2] for c in calls] == [("scan", "smollm2-135m"), ("patch", "smollm2-135m")]
    evaluation = calls[1][2]["evaluation"]
    assert calls[1][2]["impl"] == "torch" and str(evaluation.data).endswith("genesis-kjv.txt")
    assert evaluation.max_tokens == 512 and evaluation.max_length == 256
    assert json.loads(result.stdout) == {"scan": {"model": "smollm2-135m", "unknown": []}, "patch": {"impl": "torch"}}
    assert "$ normswap scan smollm2-135m" in result.stderr
    assert "$ normswap patch smollm2-135m --impl torch --eval" in result.stderr


def test_demo_impl_is_a_registry_choice(monkeypatch):
    """--impl is checked against the backend registry before anything runs: a typo is one line and
    exit 2, not a scan of the default model followed by a failed patch."""
    from normswap import api, scan
    from normswap.backends import BACKENDS

    calls = []
    monkeypatch.setattr(scan, "scan", lambda ref, **kw: calls.append("scan"))
    monkeypatch.setattr(api, "patch_checkpoint", lambda *a, **kw: calls.append("patch"))
    result = CliRunner().invoke(cli, ["demo", "--impl", "nope"])
    assert result.exit_code == 2 and calls == []
    (line,) = result.stderr.strip().splitlines()
    assert "--impl" in line and "'nope'" in line
    help_text = CliRunner().invoke(cli, ["demo", "--help"]).stdout
    assert all(name in help_text for name in BACKENDS)


def test_the_library_checks_the_demo_max_tokens_before_anything_loads():
    """The demo's evaluation is the library's: a --max-tokens it cannot score is a BadInputError
    named as the caller says (the parameter by default), and the window follows from it."""
    from normswap import api
    from normswap.errors import BadInputError

    for bad in (1, 0, -5):
        with pytest.raises(BadInputError, match=rf"^--max-tokens {bad}: at least 2 tokens"):
            api.demo_evaluation(bad, option_names={"max_tokens": "--max-tokens"})
        with pytest.raises(BadInputError, match=rf"^max_tokens {bad}: "):
            api.demo_evaluation(bad)
    with pytest.raises(BadInputError, match="^max_tokens must be a whole number"):
        api.demo_evaluation("12")
    short, long = api.demo_evaluation(100), api.demo_evaluation(4096)
    assert (short.max_length, short.max_tokens) == (100, 100) and (long.max_length, long.max_tokens) == (256, 4096)
    assert short.data == api.DEMO_TEXT and api.DEMO_TEXT.is_file()


def test_the_demo_cli_leaves_the_max_tokens_check_to_the_library(monkeypatch):
    """The command renders what the library refuses (one line, exit 2) and runs nothing after it;
    it checks nothing itself (a refusal only the library knows still stops it)."""
    from normswap import api, scan
    from normswap.errors import BadInputError

    calls = []
    monkeypatch.setattr(scan, "scan", lambda *a, **kw: calls.append("scan"))
    monkeypatch.setattr(api, "patch_checkpoint", lambda *a, **kw: calls.append("patch"))
    result = CliRunner().invoke(cli, ["demo", "--max-tokens", "1"])
    assert result.exit_code == 2 and calls == []
    assert result.stderr.strip().splitlines() == ["normswap: error: --max-tokens 1: at least 2 tokens are needed "
                                                  "to score one"]

    def refuse(max_tokens, *, option_names=None):
        calls.append(("check", max_tokens, dict(option_names)))
        raise BadInputError(f"{option_names['max_tokens']} {max_tokens}: refused by the library")

    monkeypatch.setattr(api, "demo_evaluation", refuse)
    result = CliRunner().invoke(cli, ["demo", "--max-tokens", "300"])
    assert result.exit_code == 2 and calls == [("check", 300, {"max_tokens": "--max-tokens"})]
    assert result.stderr.strip() == "normswap: error: --max-tokens 300: refused by the library"
