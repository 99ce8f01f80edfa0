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


# `normswap patch --in-place` where the OS offers no atomic exchange (publish_dir's fallback: the
# target renamed aside, the new tree renamed in), as on a filesystem without renameat2's exchange.
_NO_EXCHANGE = ("import runpy, sys\nfrom normswap import checkpoint\ncheckpoint.exchange_dirs = lambda a, b: False\n"
                "sys.argv = ['normswap', *sys.argv[1:]]\nrunpy.run_module('normswap', run_name='__main__')")


def _fallback_cmd(d: Path) -> list[str]:
    return [sys.executable, "-c", _NO_EXCHANGE, *_cmd(d)[3:]]


@pytest.mark.parametrize("stage, published", [("fallback-aside", False), ("fallback-published", True)])
def test_a_kill_in_the_fallback_publish_is_recovered_by_the_next_run(model_dir, stage, published):
    """Killed between the fallback's two renames, the run left the target missing and the whole old
    checkpoint at a hidden `.NAME.old-XXXXXXXX`, which nothing ever removed or put back (a
    model-sized copy, and the model gone from its own path); killed after them, the old tree stayed
    there for good. The aside is named as normswap's own now: the next run puts a missing target
    back (said in a warning) or removes the replaced tree, and finishes with only the target left."""
    d, want, names = model_dir
    p = subprocess.run(_fallback_cmd(d), env=_env(stage), capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
    left = sorted(q.name for q in d.parent.iterdir() if q.name != d.name)
    assert any(".normswap-old-" in n for n in left), left
    assert d.exists() == published
    p = subprocess.run(_fallback_cmd(d), env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert ("it is back in place" in p.stderr) == (not published), p.stderr[-2000:]
    assert (d / MANIFEST_NAME).is_file()
    _assert_loadable_and_unchanged_output(d, want)
    assert [q.name for q in d.parent.iterdir()] == [d.name]


def test_only_normswaps_own_asides_are_recovered(tmp_path):
    """What the recovery touches is named as publish_dir's fallback names it, beside that target:
    a user's backup named like an older normswap's aside (".model.old-20240101"), another target's
    folder, a link, are left alone; a target whose name is a glob pattern ("m[1]") finds its own."""
    from normswap import checkpoint

    target = tmp_path / "m[1]"
    target.mkdir()
    (target / "config.json").write_text("{}")
    mine = tmp_path / ".m[1].normswap-old-77-abcd_123"
    mine.mkdir()
    (mine / "f").write_text("old")
    kept = [tmp_path / ".m[1].old-20240101", tmp_path / ".m1.normswap-old-77-abcd_123",
            tmp_path / ".m[1].normswap-old-77-abcd_123.x", tmp_path / ".m[1].normswap-old-x-1"]
    for k in kept:
        k.mkdir()
    (tmp_path / ".m[1].normswap-old-78-link").symlink_to(mine)
    with checkpoint.target_lock(target):
        assert checkpoint.recover_interrupted_publish(target) == [mine]
    assert not mine.exists() and all(k.is_dir() for k in kept)
    assert (tmp_path / ".m[1].normswap-old-78-link").is_symlink() and target.is_dir()
    # the target missing: the aside is put back, with a warning
    target.rename(mine)
    with pytest.warns(UserWarning, match="it is back in place"), checkpoint.target_lock(target):
        checkpoint.recover_interrupted_publish(target)
    assert (target / "config.json").is_file() and not mine.exists()


def test_an_aside_is_left_alone_while_another_run_holds_the_lock(tmp_path):
    """recover_beside takes the target's lock: while another run holds it (it may be between the
    fallback's two renames itself) nothing is touched and nothing is raised (the run's own lock,
    later, says that another run is writing); once it is free, the target is put back."""
    import threading

    from normswap import checkpoint

    target = tmp_path / "out"
    aside = tmp_path / ".out.normswap-old-5-abcd1234"
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    held, release = threading.Event(), threading.Event()

    def other_run():
        with checkpoint.target_lock(target):
            held.set()
            release.wait(30)

    t = threading.Thread(target=other_run)
    t.start()
    try:
        assert held.wait(30)
        checkpoint.recover_beside(target)
        assert aside.is_dir() and not target.exists()
    finally:
        release.set()
        t.join(30)
    with pytest.warns(UserWarning, match="it is back in place"):
        checkpoint.recover_beside(target)
    assert (target / "config.json").is_file() and not aside.exists()


def test_a_kill_in_the_fallback_publish_through_an_out_link_is_recovered(tmp_path):
    """--out a link to the folder: killed between the fallback's two renames, the folder is aside and
    the link leads nowhere. The next run refused the link as one to nothing, before any recovery,
    and the old checkpoint stayed at its hidden name without a word. It is put back through the
    link now, and --force replaces it as asked; the link stays a link."""
    src, real, link = tmp_path / "src", tmp_path / "real", tmp_path / "lnk"
    save_tiny("llama", src)
    save_tiny("llama", real)
    link.symlink_to(real)
    cmd = [sys.executable, "-c", _NO_EXCHANGE, "patch", str(src), "--impl", "reference", "--out", str(link), "--force"]
    p = subprocess.run(cmd, env=_env("fallback-aside"), capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
    assert not real.exists() and any(".real.normswap-old-" in q.name for q in tmp_path.iterdir())
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "it is back in place" in p.stderr, p.stderr[-2000:]
    assert link.is_symlink() and (real / MANIFEST_NAME).is_file()
    assert sorted(q.name for q in tmp_path.iterdir()) == ["lnk", "real", "src"]


def test_a_read_of_a_model_left_aside_says_where_it_is(tmp_path, monkeypatch):
    """After a kill between the fallback's renames the model is missing from its path until a run
    that writes it puts it back. A command that only reads it (scan, ppl, patch without --out) said
    "no such file or directory, and not a hub id", not where the model was; it names the aside now.
    A user's backup named like an older normswap's aside is no such thing."""
    from normswap.errors import NormswapError
    from normswap.loading import resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / ".model.old-20240101").mkdir()
    with pytest.raises(NormswapError, match=r"no such file or directory, and not a hub id"):
        resolve(str(tmp_path / "runs" / "model"))
    aside = tmp_path / "runs" / ".model.normswap-old-5-abcd1234"
    aside.mkdir()
    for ref in (str(tmp_path / "runs" / "model"), "runs/model"):  # the second would be read as a hub id
        with pytest.raises(NormswapError, match=f"left it at {aside}; the next patch or convert that writes"):
            resolve(ref)


def test_an_aside_whose_run_never_published_is_kept_when_the_target_was_made_anew(tmp_path):
    """Killed between the fallback's renames, the run left the model aside and its new tree in its
    staging folder. Where the target has been made anew since (the user, finding the model gone,
    fetched one again), the next run took the aside for a replaced tree and removed it: the only
    copy of what stood there, without a word. It is moved in sight now, with a warning, and kept
    from then on; the killed run's staging folder is swept as before."""
    from normswap import checkpoint

    target = tmp_path / "model"
    aside = tmp_path / ".model.normswap-old-4242-abcd1234"
    staging = tmp_path / ".model.normswap-4242-efgh5678"  # that run's new tree, never published
    for d, what in ((aside, "the user's model"), (staging, "the patched copy"), (target, "fetched again")):
        d.mkdir()
        (d / "weights").write_text(what)
    with pytest.warns(UserWarning, match="so it is kept: remove it, or put it back yourself"), \
            checkpoint.target_lock(target):
        assert checkpoint.recover_interrupted_publish(target) == []
        checkpoint.remove_stale_staging(target)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("model.normswap-kept-")]
    assert len(kept) == 1 and (kept[0] / "weights").read_text() == "the user's model"
    assert (target / "weights").read_text() == "fetched again"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model", kept[0].name])
    with checkpoint.target_lock(target):  # the next run: nothing more to do, the kept copy stays
        assert checkpoint.recover_interrupted_publish(target) == []
    assert (kept[0] / "weights").is_file()
