"""Kill `normswap patch --in-place` at every step (and at random instants): the original path must
always hold a checkpoint that stock transformers loads, with the original's logits."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny

from normswap.manifest import MANIFEST_NAME
from normswap.verify import model_output

ROOT = Path(__file__).resolve().parents[1]
BATCH = {"input_ids": torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0))}


def _env(kill_at: str | None = None, signal_name: str = "KILL") -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    env.pop("NORMSWAP_TEST_KILL_AT", None)
    if kill_at:
        env["NORMSWAP_TEST_KILL_AT"] = kill_at
        env["NORMSWAP_TEST_KILL_SIGNAL"] = signal_name
    return env


def _cmd(d: Path) -> list[str]:
    return [sys.executable, "-m", "normswap", "patch", str(d), "--impl", "reference", "--in-place"]


def _logits(d: Path) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    return model_output(LlamaForCausalLM.from_pretrained(d).eval(), BATCH)[1]


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    save_tiny("llama", d)
    return d, _logits(d), sorted(p.name for p in d.iterdir())


def _assert_loadable_and_unchanged_output(d: Path, want: torch.Tensor) -> None:
    assert torch.equal(_logits(d), want)
    assert not any(p.name.startswith(".") for p in d.iterdir())


def _kill_at_stage(model_dir, stage, published, rerun=False):
    d, want, names = model_dir
    p = subprocess.run(_cmd(d), env=_env(stage), capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
    _assert_loadable_and_unchanged_output(d, want)
    if published:
        assert (d / MANIFEST_NAME).is_file()
    else:
        assert sorted(p.name for p in d.iterdir()) == names  # untouched
    if not rerun:
        return
    # a later run is not blocked by what the killed one left beside the target
    p = subprocess.run(_cmd(d), env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (d / MANIFEST_NAME).is_file()
    _assert_loadable_and_unchanged_output(d, want)
    assert [q.name for q in d.parent.iterdir()] == [d.name]  # the killed run's staging is gone


@pytest.mark.parametrize("stage,published,rerun", [("after-weights", False, False),
                                                   ("before-exchange", False, True),
                                                   ("after-exchange", True, False)])
def test_kill_at_stage(model_dir, stage, published, rerun):
    _kill_at_stage(model_dir, stage, published, rerun)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["after-manifest", "after-check", "before-publish"])
def test_kill_at_more_stages(model_dir, stage):
    _kill_at_stage(model_dir, stage, False)


@pytest.mark.slow
def test_kill_at_random_instants(model_dir):
    d, want, _ = model_dir
    rng = random.Random(1234)
    t0 = time.monotonic()
    full = subprocess.run(_cmd(d), env=_env(), capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr[-2000:]
    duration = time.monotonic() - t0
    _assert_loadable_and_unchanged_output(d, want)
    for _ in range(4):
        proc = subprocess.Popen(_cmd(d), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # the interesting part (writing, reloading, publishing) is the second half of a run
        time.sleep(rng.uniform(0.4, 1.1) * duration)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        _assert_loadable_and_unchanged_output(d, want)
    full = subprocess.run(_cmd(d), env=_env(), capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr[-2000:]
    assert [q.name for q in d.parent.iterdir()] == [d.name]


@pytest.mark.parametrize("stage", ["after-weights", "before-exchange"])
def test_sigterm_cleans_up_like_ctrl_c(model_dir, stage):
    """SIGTERM is what `timeout`, `kill`, a batch scheduler's cancel and `docker stop` send. It
    used to end the process on the spot, leaving the model-sized staging directory and the lock
    file beside the target; now it is an interrupt: both removed, the target untouched, one line,
    exit 143 (128 + SIGTERM)."""
    d, want, names = model_dir
    p = subprocess.run(_cmd(d), env=_env(stage, "TERM"), capture_output=True, text=True, timeout=300)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, p.stderr[-2000:])
    assert p.stderr.splitlines()[-1] == "normswap: terminated", p.stderr[-2000:]
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert sorted(q.name for q in d.iterdir()) == names
    _assert_loadable_and_unchanged_output(d, want)
    assert [q.name for q in d.parent.iterdir()] == [d.name]  # no staging directory, no lock file
