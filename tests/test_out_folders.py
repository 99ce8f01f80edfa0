"""A new --out path deep in folders that do not exist yet (`--out a/b/c/out`): when the command
fails (a refused verification, bad input found late, SIGTERM), the folders this run made are
removed again; never one that existed before (fileio.made_folders). They stayed behind."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import save_tiny

from normswap.cli import cli
from normswap.cli.signals import Terminated
from normswap.errors import NormswapError


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / "gpt2"
    save_tiny("gpt2", d)
    return d


pytestmark = pytest.mark.usefixtures("small_probes")


def _raise(error):
    def fail(*a, **k):
        raise error
    return fail


def _run(tmp_path, *args):
    """Run in tmp_path with a user folder `a/` already there (holding a file): a/ must stay, and
    everything the run made under it must go."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("the user's")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        r = CliRunner().invoke(cli, [str(a) for a in args])
    finally:
        os.chdir(cwd)
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "a").rglob("*")) == ["a/notes.txt"], r.output
    assert [p.name for p in tmp_path.iterdir()] == ["a"]
    return r


@pytest.mark.parametrize("command", ["patch", "convert"])
def test_a_refused_verification_removes_the_folders_made_for_out(tmp_path, gpt2, monkeypatch, command):
    from normswap import checkpoint, convert_dir

    if command == "patch":
        monkeypatch.setattr(checkpoint, "check_saved", _raise(NormswapError("the saved checkpoint reloads with "
                                                                            "different logits; nothing was published")))
        args = ["patch", gpt2, "--impl", "torch"]
    else:
        monkeypatch.setattr(convert_dir, "verify_conversion", _raise(NormswapError("verification failed")))
        args = ["convert", gpt2, "--to", "rms"]
    r = _run(tmp_path, *args, "--out", "a/b/c/out")
    assert r.exit_code == 2 and "normswap: error:" in r.stderr


@pytest.mark.parametrize("command", ["patch", "convert"])
def test_sigterm_while_saving_removes_the_folders_made_for_out(tmp_path, gpt2, monkeypatch, command):
    from normswap import checkpoint

    monkeypatch.setattr(checkpoint, "publish_dir", _raise(Terminated()))
    args = ["patch", gpt2, "--impl", "torch"] if command == "patch" else ["convert", gpt2, "--to", "rms"]
    r = _run(tmp_path, *args, "--out", "a/b/c/out")
    assert r.exit_code == 143 and "normswap: terminated" in r.stderr


def test_bad_input_found_while_converting_removes_the_folders_made_for_out(tmp_path, gpt2):
    """A truncated weights file is found only when convert reads it, inside the staging directory."""
    src = tmp_path.parent / f"{tmp_path.name}-trunc"
    src.mkdir()
    for f in gpt2.iterdir():
        data = f.read_bytes()
        (src / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    r = _run(tmp_path, "convert", src, "--to", "rms", "--out", "a/b/c/out")
    assert r.exit_code == 2 and "unreadable safetensors" in r.stderr


def test_a_failed_bench_write_removes_the_folders_made_for_its_file(tmp_path, gpt2, monkeypatch):
    monkeypatch.setattr(os, "replace", _raise(OSError(errno.ENOSPC, "No space left on device")))
    r = _run(tmp_path, "bench", gpt2, "--impls", "torch", "--modes", "prefill", "--seq", "4", "--repeats", "1",
             "--warmup", "0", "--out", "a/b/c/bench.json")
    assert r.exit_code == 2 and "No space left on device" in r.stderr


def test_experiment_that_does_not_fit_the_model_leaves_no_folder(tmp_path, gpt2):
    """finetune.seq_len past the model's context is found once the model is loaded: now before OUT
    is made (it left OUT/recipe.json and OUT/logs/, and the folders above, behind)."""
    recipe = tmp_path.parent / f"{tmp_path.name}-recipe.toml"
    text = Path(__file__).resolve().parent / "data" / "lighthouse.txt"
    recipe.write_text(f'name = "t"\narms = ["original"]\n[model]\npath = "{gpt2}"\n'
                      f'[data]\ntrain = "{text}"\neval = "{text}"\n[finetune]\nsteps = 1\nseq_len = 500\n')
    r = _run(tmp_path, "experiment", recipe, "--out", "a/b/c/run")
    assert r.exit_code == 2 and "exceeds the model's context" in r.stderr
