"""benchmarks/report.py on CPU, from tests/data/kernels-report-fixture.json: hand-written round
numbers (labelled a fixture in the file and in every heading), never a measurement. The report reads
benchmarks/results/ by default, so the fixture can never turn up there as a result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from benchmark_scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "kernels-report-fixture.json"


@pytest.fixture(scope="module")
def report():
    return load_script("report")


def test_fixture_report_and_plot(report, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(FIXTURE, results)
    shutil.copy(ROOT / "benchmarks" / "results" / "convert-vm-2026-11-21.json", results)  # another benchmark
    dry = json.loads(FIXTURE.read_text())
    dry.pop("fixture")
    dry["device"] = "cpu-dry-run"
    (results / "cpu-dry-run-2000-01-01.json").write_text(json.dumps(dry))
    (results / "patch.json").write_text("{broken")
    (results / "deep-patch.json").write_text("[" * 100_000 + "]" * 100_000)  # json: RecursionError, no ValueError
    patch = {"command": "normswap patch smollm2-135m --impl triton", "exit": 0, "versions": {"device": "FIXTURE-GPU"},
             "report": {"ok": True, "device": "cuda", "counts": {"patched": 61},
                        "eval": {"ppl_a": 3.5, "ppl_b": 3.5, "top1_agreement": 1.0}}}
    (results / "x-patch-smollm2-bf16.json").write_text(json.dumps(patch))
    (results / "y-patch-smollm2-bf16.json").write_text(json.dumps(dict(patch, versions={"device": "cpu-dry-run"})))

    assert report.main(["--results", str(results)]) == 0
    text = (results / "REPORT.md").read_text()
    assert text.count("FIXTURE, not a measurement: FIXTURE-GPU") == 2  # headline and its run section
    assert "NOT a measurement of any device" in text
    # Headline: triton's worst shape (600 of 1000 GB/s at 32768×8192), its worst speedup over torch
    # (10 µs / 20 µs at 4096×2048) and the geometric mean over the three shapes, (0.5·2·1.25)^(1/3).
    fwd = next(ln for ln in text.splitlines() if ln.startswith("| rms_norm | fwd | bf16 |"))
    assert "| 60% (32768×8192) | 80% | 0.50× (4096×2048) / 1.08× | 1.25× (32768×2048) / 1.25× |" in fwd
    assert "| layer_norm (fused residual) | fwd | bf16 | 85% (32768×2048)" in text
    # Per shape: every backend against every other of the same run, and skipped rows with their reason.
    assert "| 32768×2048 | liger | events | 125.0 | 720 | 72% | 0.80× | 1.60× | — |" in text
    assert "| 32768×8192 | liger | — | skipped: error: hidden size refused |" in text
    assert "Commit `0000000`" in text and "liger-kernel 0.0-fixture" in text
    assert "`cpu-dry-run-2000-01-01.json`: a `--dry-run` on CPU, not a measurement" in text
    assert "`patch.json`: not readable JSON (Expecting property name" in text
    assert "`deep-patch.json`: not readable JSON (nested too deeply: more than 100 levels)" in text
    assert ("`x-patch-smollm2-bf16.json`: `normswap patch smollm2-135m --impl triton`, exit 0, device cuda, ok True, "
            "patched 61, ppl_a 3.5, ppl_b 3.5, top1_agreement 1") in text
    assert "`y-patch-smollm2-bf16.json`: a `gpu.py --dry-run` on CPU, not a GPU result" in text
    assert "convert-vm" not in text.split("## Runs")[1].split("## Files left out")[0]
    png = results / "rms_norm_bf16.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_model_level_bench_table(report, tmp_path):
    """A `normswap bench` file (hand-written fixture rows, not a measurement); CPU ones are left out."""
    rows = [{"variant": "eager", "impl": None, "fused": False, "mode": "train", "median_ms": 100.0,
             "tokens_per_s": 20480.0, "peak_memory_bytes": 2 * 2**30, "speedup": None, "method": "events", "error": None},
            {"variant": "triton+fused", "impl": "triton", "fused": True, "mode": "train", "median_ms": 80.0,
             "tokens_per_s": 25600.0, "peak_memory_bytes": 2**31, "speedup": 1.25, "method": "events", "error": None},
            {"variant": "liger", "impl": "liger", "fused": False, "mode": "decode", "median_ms": None,
             "tokens_per_s": None, "peak_memory_bytes": None, "speedup": None, "method": None, "error": "no CUDA"}]
    doc = {"format": "normswap-bench/1", "device": {"type": "cuda", "name": "FIXTURE-GPU"},
           "config": {"model": "benchmarks/configs/llama-1b", "batch": 1, "seq": 2048, "dtype": "bf16"},
           "notes": ["FIXTURE, not a measurement"], "rows": rows}
    (tmp_path / "fixture-bench-llama-1b.json").write_text(json.dumps(doc))
    (tmp_path / "cpu-bench-tiny.json").write_text(json.dumps(dict(doc, device={"type": "cpu", "cpu_numbers": True})))
    text = report.build(tmp_path, tmp_path)[0].read_text()
    assert "### FIXTURE-GPU: `benchmarks/configs/llama-1b` (`fixture-bench-llama-1b.json`)" in text
    assert "batch 1, seq 2048, dtype bf16; FIXTURE, not a measurement" in text
    assert "| train | triton+fused | 80.000 | 25600 | 2048 | 1.250× | events |" in text
    assert "| train | eager | 100.000 | 20480 | 2048 | — | events |" in text
    assert "| decode | liger | error: no CUDA |" in text
    assert "`cpu-bench-tiny.json`: `normswap bench` on a CPU, not a GPU result" in text


def test_schema_without_the_newer_fields(report, tmp_path):
    """kernels.py's first schema: no timing, commit, versions, date or skipped rows."""
    doc = json.loads(FIXTURE.read_text())
    for key in ("fixture", "commit", "versions", "date"):
        doc.pop(key)
    doc["rows"] = [{k: r[k] for k in ("op", "pass", "dtype", "M", "N", "impl", "us", "gbs")}
                   for r in doc["rows"] if "us" in r and not r.get("residual")]
    (tmp_path / "gpu-x-2001-02-03.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    md, png = report.build(tmp_path, out)
    text = md.read_text()
    assert "FIXTURE-GPU (not a measurement), 2001-02-03" in text and "| timing |" not in text
    assert "| 32768×2048 | liger | 125.0 | 720 | 72% | 0.80× | 1.60× | — |" in text
    assert png == out / "rms_norm_bf16.png" and png.is_file()


def test_no_measurements_and_bad_folder(report, tmp_path, capsys):
    md, png = report.build(tmp_path, tmp_path)
    assert png is None and "No kernel measurements yet" in md.read_text()
    assert report.main(["--results", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such folder" in err[0]


def test_default_results_hold_no_fixture(report):
    """The report's default input is benchmarks/results/, and nothing there is a fixture or a dry run."""
    assert report.RESULTS == ROOT / "benchmarks" / "results"
    runs, notes = report.load_runs(report.RESULTS)
    assert not [r for r in runs if r["doc"].get("fixture")] and not [n for n in notes if "dry-run" in n]
