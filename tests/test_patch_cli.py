"""`normswap patch`: report, save, in-place, and one-line errors (exit 2) on every kind of bad input."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from click.testing import CliRunner
from tiny_models import save_tiny

from normswap.cli import cli
from normswap.manifest import MANIFEST_NAME, read_manifest
from normswap.verify import model_output


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "llama"
    save_tiny("llama", d)
    return d


pytestmark = pytest.mark.usefixtures("small_probes")  # conftest's


BATCH = {"input_ids": torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0))}


def run(*args):
    return CliRunner().invoke(cli, ["patch", *map(str, args)])


def error_lines(result):
    return [ln for ln in result.stderr.splitlines() if ln.startswith("normswap:")]


def assert_one_line_error(result, pattern):
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = error_lines(result)
    assert len(lines) == 1 and pattern in lines[0], lines
    assert "Traceback" not in result.stderr


def _stock(directory, batch):
    from transformers import LlamaForCausalLM

    return model_output(LlamaForCausalLM.from_pretrained(directory).eval(), batch)[1]


def _listing(d):
    return sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir())


def test_report_only_writes_nothing(src):
    before = _listing(src)
    r = run(src, "--impl", "torch", "--json")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["ok"] and data["saved_to"] is None and data["counts"]["patched"] == 5
    m = data["modules"][0]
    assert {"path", "class", "check"} <= set(m) and m["check"]["passed"]
    assert {"max_err_original", "max_err_replacement", "eps", "dtype", "impl"} <= set(m["check"])
    assert data["model_check"]["passed"]
    assert data["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # --device auto
    assert _listing(src) == before


def test_human_report_and_progress(src):
    r = run(src, "--impl", "reference")
    assert r.exit_code == 0, r.stderr
    for text in ("model.layers.0.input_layernorm", "LlamaRMSNorm", "err orig", "pass", "whole model",
                 "nothing saved"):
        assert text in r.stdout
    assert "patch+verify" in r.stderr  # the progress bar lives on stderr


def test_out_force_and_stock_reload(src, tmp_path):
    out = tmp_path / "out"
    r = run(src, "--impl", "torch", "--out", out, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["saved_to"] == str(out.resolve())
    batch = BATCH
    assert torch.equal(_stock(out, batch), _stock(src, batch))
    assert read_manifest(out)["patch"]["impl"] == "torch"
    assert_one_line_error(run(src, "--impl", "torch", "--out", out), "already exists; pass --force")
    r = run(src, "--impl", "reference", "--out", out, "--force")
    assert r.exit_code == 0, r.stderr
    assert read_manifest(out)["patch"]["impl"] == "reference"


def test_in_place(tmp_path):
    d = tmp_path / "m"
    save_tiny("llama", d)
    batch = BATCH
    want = _stock(d, batch)
    d.chmod(0o750)
    r = run(d, "--impl", "torch", "--in-place")
    assert r.exit_code == 0, r.stderr
    assert (d.stat().st_mode & 0o777) == 0o750  # the replaced directory keeps its mode
    assert (d / MANIFEST_NAME).is_file() and (d / "tokenizer.json").is_file()
    assert torch.equal(_stock(d, batch), want)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging or old trees left behind


def test_in_place_reads_the_folder_under_its_lock(tmp_path, monkeypatch):
    """--in-place loads and saves what the folder holds once its lock is taken: a run that held the
    lock (here `convert --out M --force`) may have published a new folder just before. The
    normswap.json read before the lock kept the convert section of the folder as it was, so the
    save dropped the section of the converted weights it had loaded (and with it the RMS forms
    that patch --rms and normswap.load read from it)."""
    import contextlib
    import shutil

    import normswap
    from normswap import checkpoint

    d, converted = tmp_path / "m", tmp_path / "converted"
    save_tiny("gpt2", d)
    normswap.convert_checkpoint(d, converted)
    real_lock, published = checkpoint.target_lock, []

    @contextlib.contextmanager
    def after_another_run(target):
        if not published:  # the other run publishes its folder and lets go as this one takes the lock
            shutil.rmtree(d)
            shutil.copytree(converted, d)
            published.append(target)
        with real_lock(target):
            yield

    monkeypatch.setattr(checkpoint, "target_lock", after_another_run)
    r = run(d, "--impl", "torch", "--in-place", "--json")
    assert r.exit_code == 0 and published, r.stderr
    saved = read_manifest(d)
    assert saved["convert"] == read_manifest(converted)["convert"] and saved["patch"]["impl"] == "torch"


def test_in_place_keeps_every_file_of_the_user(tmp_path):
    # --in-place publishes a new tree and deletes the old one: whatever is not carried over is gone
    d = tmp_path / "m"
    save_tiny("llama", d)
    (d / ".git").mkdir()
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (d / "training_args.bin").write_bytes(b"trainer state")
    (d / "secret.txt").write_text("mine")
    (d / "secret.txt").chmod(0o600)
    (d / "pytorch_model.bin").write_bytes(b"old weights")  # replaced by the new safetensors
    r = run(d, "--impl", "torch", "--in-place")
    assert r.exit_code == 0, r.stderr
    assert (d / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert (d / ".gitattributes").is_file() and (d / "training_args.bin").read_bytes() == b"trainer state"
    assert (d / "secret.txt").stat().st_mode & 0o777 == 0o600
    assert not (d / "pytorch_model.bin").exists()
    assert (d / MANIFEST_NAME).is_file() and (d / "model.safetensors").is_file()


def test_in_place_refuses_another_dtype(tmp_path):
    d = tmp_path / "m"
    save_tiny("llama", d)  # float32
    before = _listing(d)
    assert_one_line_error(run(d, "--impl", "torch", "--in-place", "--dtype", "bf16"), "--out DIR")
    assert _listing(d) == before
    r = run(d, "--impl", "torch", "--in-place", "--dtype", "fp32")  # its own dtype: fine
    assert r.exit_code == 0, r.stderr


def test_only_and_exclude(src):
    r = run(src, "--impl", "torch", "--only", r"layers\.1\.", "--exclude", "post_attention", "--json")
    data = json.loads(r.stdout)
    assert [m["path"] for m in data["modules"] if m["status"] == "patched"] == ["model.layers.1.input_layernorm"]
    assert data["counts"]["excluded"] == 4


def test_verification_failure_saves_nothing_unless_excluded(tmp_path, monkeypatch):
    from normswap import backends
    from normswap.kernels.reference import layer_norm_ref, rms_norm_ref

    def broken_on_heads(x, w, eps, offset=0.0, casting="llama", **kw):
        y = rms_norm_ref(x, w, eps, offset, casting, **kw)
        return y * 1.01 if x.shape[-1] == 16 else y  # wrong only for the q/k head norms

    monkeypatch.setitem(backends._LOADERS, "reference",
                        lambda: backends.Backend("reference", broken_on_heads, layer_norm_ref))
    d = tmp_path / "qwen3"
    save_tiny("qwen3", d)
    out = tmp_path / "out"
    r = run(d, "--impl", "reference", "--out", out)
    assert_one_line_error(r, "verification failed for model.layers.0.self_attn.q_norm")
    assert "--exclude" in error_lines(r)[0] and "FAIL" in r.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["qwen3"]
    r = run(d, "--impl", "reference", "--out", out, "--exclude", "q_norm|k_norm", "--json")
    assert r.exit_code == 0, r.stderr
    left = read_manifest(out)["patch"]["left_alone"]
    assert len(left) == 4 and {e["status"] for e in left} == {"excluded"}


def test_bad_inputs(src, tmp_path, monkeypatch):
    assert_one_line_error(run(tmp_path / "nope"), "no such file or directory")
    assert_one_line_error(run(src, "--out", tmp_path / "o", "--in-place"), "exclusive")

    bad = tmp_path / "corrupt"
    save_tiny("llama", bad)
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:200])
    out = tmp_path / "out"
    assert_one_line_error(run(bad, "--impl", "torch", "--out", out), "cannot load the weights")
    assert not out.exists()

    (bad / "config.json").write_text("{broken")
    assert_one_line_error(run(bad, "--impl", "torch"), "malformed config.json")

    (tmp_path / "empty").mkdir()
    assert_one_line_error(run(tmp_path / "empty"), "not a model directory")


def test_device_option(src):
    """--device: cpu runs (and is reported); a device this machine lacks or a non-device is one line."""
    r = run(src, "--impl", "torch", "--device", "cpu", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["device"] == "cpu"
    assert_one_line_error(run(src, "--device", "tpu"), "unknown device 'tpu'")
    assert_one_line_error(run(src, "--device", "cuda:x"), "unknown device 'cuda:x'")
    if not torch.cuda.is_available():
        assert_one_line_error(run(src, "--device", "cuda"), "no CUDA device here")
    else:
        n = torch.cuda.device_count()
        assert_one_line_error(run(src, "--device", f"cuda:{n}"), f"has {n} CUDA device(s)")


def test_unavailable_impl_lists_available(src, monkeypatch):
    from normswap import backends

    def cannot():
        raise ImportError("no quack on this machine")

    monkeypatch.setitem(backends._LOADERS, "quack", cannot)
    r = run(src, "--impl", "quack")
    assert_one_line_error(r, "no quack on this machine")
    assert "available: " in error_lines(r)[0] and "reference" in error_lines(r)[0]


def test_read_only_destination(src, tmp_path, monkeypatch):
    import tempfile

    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
    else:  # root ignores permission bits: make the filesystem say what a read-only mount says
        def erofs(*a, **k):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(tempfile, "mkdtemp", erofs)
    assert_one_line_error(run(src, "--impl", "torch", "--out", ro / "out"), "cannot write to")
    assert list(ro.iterdir()) == []


def test_out_that_contains_the_model_is_refused_even_with_force(tmp_path):
    model_dir = tmp_path / "models" / "llama"
    save_tiny("llama", model_dir)
    before = _listing(model_dir)
    r = run(model_dir, "--impl", "torch", "--out", tmp_path / "models", "--force")
    assert_one_line_error(r, "contains the model being patched")
    assert _listing(model_dir) == before


def test_filters_that_leave_nothing_to_patch_are_an_error(src, tmp_path, monkeypatch):
    from normswap import loading

    def no_load(*a, **k):  # the filter is checked on the meta model, before the weights (a GGUF's take seconds)
        raise AssertionError("weights loaded")

    monkeypatch.setattr(loading, "load_model", no_load)
    r = run(src, "--impl", "torch", "--only", "no_such_module", "--out", tmp_path / "out")
    assert_one_line_error(r, "--only/--exclude leave no recognised norm to patch")
    assert "load" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_strict_unknown_norm(src, monkeypatch):
    from normswap import registry

    monkeypatch.setitem(registry.UNSUPPORTED, "LlamaRMSNorm", "pretend unknown for the test")
    r = run(src, "--impl", "torch", "--strict")
    assert_one_line_error(r, "unknown norm class at model.layers.0.input_layernorm")
    r = run(src, "--impl", "torch", "--json")  # without --strict: left alone, reported
    assert r.exit_code == 0 and json.loads(r.stdout)["counts"]["unknown"] == 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="triton runs natively on a GPU")
def test_triton_without_gpu_or_interpreter(src):
    """A real process with TRITON_INTERPRET=0 and no GPU: one line naming what does run here."""
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run([sys.executable, "-m", "normswap", "patch", str(src), "--impl", "triton"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "backend 'triton' is not available" in lines[0]
    assert "available: torch" in lines[0] and "Traceback" not in p.stderr


def test_converted_checkpoint_runs_layernorms_as_rms(tmp_path):
    """The hook for `normswap convert`: its zero-mean LayerNorms run as RMS norms (verified on
    zero-mean probes and by the whole-model check), and the choice survives save -> load."""
    from normswap.loading import load
    from normswap.modules import NormswapLayerNorm

    src, conv, out = tmp_path / "gpt2", tmp_path / "conv", tmp_path / "out"
    save_tiny("gpt2", src)
    r = CliRunner().invoke(cli, ["convert", str(src), "--to", "rms", "--out", str(conv)])
    assert r.exit_code == 0, r.stderr
    r = run(conv, "--impl", "torch", "--out", out, "--json")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert [m["rms_form"] is not None for m in data["modules"]] == [True] * 5 and data["model_check"]["passed"]
    assert read_manifest(out)["convert"] == read_manifest(conv)["convert"]
    again = load(out)
    assert [m.rms_form is not None for m in again.modules() if isinstance(m, NormswapLayerNorm)] == [True] * 5
    r = run(conv, "--impl", "torch", "--no-rms", "--json")
    assert [m["rms_form"] is not None for m in json.loads(r.stdout)["modules"]] == [False] * 5
