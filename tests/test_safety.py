"""Issue 9: never lose a user's data, never accept a broken model, say exactly what is wrong.

Each test names the case it covers; each fails without its fix."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_models import save_tiny, tiny_model

from normswap import checkpoint, fileio
from normswap.cli import cli
from normswap.errors import NormswapError
from normswap.swap import patch
from normswap.verify import ProbeConfig

ROOT = Path(__file__).resolve().parents[1]
SMALL = ProbeConfig(elements=4096)


pytestmark = pytest.mark.usefixtures("small_probes")  # conftest's


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("safety") / "llama"
    save_tiny("llama", d)
    return d


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    d = tmp_path_factory.mktemp("safety") / "gpt2"
    save_tiny("gpt2", d)
    return d


def run(*args):
    return CliRunner().invoke(cli, [*map(str, args)])


def assert_one_line_error(result, pattern):
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("normswap:")]
    assert len(lines) == 1 and pattern in lines[0], (lines, result.stderr[-2000:])
    assert "Traceback" not in result.stderr


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---- case 1: an empty --out, and what --force may replace -------------------------------------


@pytest.mark.parametrize("out", ["", "   "])
@pytest.mark.parametrize("cmd", ["patch", "convert"])
def test_case1_empty_out_is_bad_input_and_the_cwd_survives(src, gpt2, tmp_path, monkeypatch, out, cmd):
    work = tmp_path / "thesis"
    work.mkdir()
    (work / "chapter1.tex").write_text("years of work")
    monkeypatch.chdir(work)
    before = _tree(work)
    model, extra = (src, ["--impl", "torch"]) if cmd == "patch" else (gpt2, ["--to", "rms"])
    for force in ([], ["--force"]):
        r = run(cmd, model, *extra, "--out", out, *force)
        assert_one_line_error(r, "the output directory is empty")
        assert "--force" not in r.stderr  # never point the user at the flag that would destroy it
    assert _tree(work) == before


def test_case1_force_refuses_what_is_not_a_checkpoint(src, tmp_path, monkeypatch):
    """--force replaces only an empty dir, a checkpoint or a normswap output; never the current
    directory (or one holding it), a home directory, a root, or an arbitrary directory."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    (notes / "config.json").write_text('{"editor": "vim"}')  # a project's config, not a model's
    r = run("patch", src, "--impl", "torch", "--out", notes)
    assert_one_line_error(r, "not a model checkpoint")
    assert "pass --force" not in r.stderr
    assert_one_line_error(run("patch", src, "--impl", "torch", "--out", notes, "--force"), "not a model checkpoint")
    assert (notes / "todo.txt").read_text() == "mine"

    # the current directory, even when it is a checkpoint, and a directory holding it
    ckpt = tmp_path / "other-ckpt"
    save_tiny("gpt2", ckpt)
    (ckpt / "sub").mkdir()
    monkeypatch.chdir(ckpt)
    assert_one_line_error(run("patch", src, "--impl", "torch", "--out", ".", "--force"), "current directory")
    monkeypatch.chdir(ckpt / "sub")
    assert_one_line_error(run("patch", src, "--impl", "torch", "--out", "..", "--force"),
                          "holds the current directory")
    monkeypatch.chdir(tmp_path)
    # a home directory (whatever it holds) and a filesystem root
    home = tmp_path / "home"
    save_tiny("gpt2", home)
    monkeypatch.setenv("HOME", str(home))
    assert_one_line_error(run("patch", src, "--impl", "torch", "--out", home, "--force"), "home directory")
    with pytest.raises(NormswapError, match="filesystem root"):
        checkpoint.check_replaceable(Path("/"))
    # the library enforces the same rule, whatever the CLI checked
    model = tiny_model("llama")
    with pytest.raises(NormswapError, match="not a model checkpoint"):
        checkpoint.save_patched(model, patch(model, "torch", probe=SMALL), notes, replace=True)
    assert (notes / "todo.txt").read_text() == "mine"
    # what --force is for still works: an earlier output, and an empty directory (sub/, made for the
    # current-directory checks, is the user's folder: --force refuses a tree that holds it, below)
    (ckpt / "sub").rmdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (ckpt, empty):
        r = run("patch", src, "--impl", "torch", "--out", target, "--force", "--json")
        assert r.exit_code == 0, r.stderr
        assert (target / "normswap.json").is_file()


def _users_folder(ckpt: Path, name: str) -> None:
    """A folder of the user's own inside a checkpoint: a cloned hub repo's history, a trainer's
    checkpoint with its optimizer states."""
    if name == ".git":
        (ckpt / ".git" / "objects" / "ab").mkdir(parents=True)
        (ckpt / ".git" / "objects" / "ab" / "cdef").write_bytes(os.urandom(64))
        (ckpt / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    else:
        (ckpt / name).mkdir()
        (ckpt / name / "optimizer.pt").write_bytes(os.urandom(64))
        (ckpt / name / "config.json").write_text('{"model_type": "gpt2"}')


@pytest.mark.parametrize("name", [".git", "checkpoint-1"])
def test_case1_force_refuses_a_checkpoint_holding_a_folder_the_output_would_not(src, gpt2, tmp_path, name):
    """The old tree is removed whole after the swap: --force onto a checkpoint that holds a folder of
    the user's (.git, a trainer's checkpoint-1/) is refused before the load, naming the folder and
    the way out, and nothing changes; the library refuses it too, at the publish."""
    ckpt = tmp_path / "ckpt"
    save_tiny("gpt2", ckpt)
    _users_folder(ckpt, name)
    before = _tree(ckpt)
    for cmd, model, *opts in (("patch", src, "--impl", "torch"), ("convert", gpt2, "--to", "rms")):
        r = run(cmd, model, *opts, "--out", ckpt, "--force")
        assert_one_line_error(r, f"{ckpt} holds {name}/, which the new output would not hold")
        assert f"remove {ckpt / name} yourself" in r.stderr and r.stdout == ""
        assert _tree(ckpt) == before
    model = tiny_model("llama")
    with pytest.raises(NormswapError, match=f"holds {name}/"):
        checkpoint.save_patched(model, patch(model, "torch", probe=SMALL), ckpt, replace=True)
    assert _tree(ckpt) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_case1_force_still_replaces_an_earlier_output_holding_the_sources_folders(src, tmp_path):
    """A source's folders are carried (a sentence-transformers pipeline's 2_Dense/): an earlier
    output of it holds them, and --force replaces it again; so does --force onto a top-level
    file the new output does not hold (README.md, training_args.bin)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(src, model)
    (model / "2_Dense").mkdir()
    (model / "2_Dense" / "config.json").write_text('{"in_features": 4}')
    out = tmp_path / "out"
    assert run("patch", model, "--impl", "torch", "--out", out).exit_code == 0
    (out / "training_args.bin").write_bytes(b"old")
    (out / "2_Dense" / "stale.txt").write_text("written by the earlier run's source")
    r = run("patch", model, "--impl", "torch", "--out", out, "--force")
    assert r.exit_code == 0, r.stderr
    assert (out / "2_Dense" / "config.json").is_file() and not (out / "2_Dense" / "stale.txt").exists()
    assert not (out / "training_args.bin").exists() and (out / "normswap.json").is_file()


@pytest.mark.parametrize("command", ["patch", "convert"])
def test_case1_force_replaces_an_earlier_output_of_another_model_with_the_folders_it_carried(
        src, gpt2, tmp_path, command):
    """An earlier output of model A holds A's folders, copies normswap carried (custom code/, a
    pipeline's 2_Dense/); --force of model B, which has none, onto it was refused ('holds code/,
    which the new output would not hold'), though those folders are normswap's own writing and A
    still holds the originals. Each output's normswap.json names the folders it was written with
    (carried_folders), and --force may remove those; a folder the user put there since (runs/),
    a hidden one (.git, whatever the file says) and every folder of an output that names none (an
    older version's) are still refused. In place, the record of an earlier output is kept."""
    import shutil

    a = tmp_path / "a"
    shutil.copytree(src, a)
    (a / "code").mkdir()
    (a / "code" / "modeling_a.py").write_text("# model A's code")
    (a / "2_Dense").mkdir()
    (a / "2_Dense" / "config.json").write_text('{"in_features": 4}')
    out = tmp_path / "out"
    assert run("patch", a, "--impl", "torch", "--out", out).exit_code == 0
    assert list(json.loads((out / "normswap.json").read_text())["carried_folders"]) == ["2_Dense", "code"]
    assert run("patch", out, "--impl", "torch", "--in-place").exit_code == 0  # its folders are still its own
    assert list(json.loads((out / "normswap.json").read_text())["carried_folders"]) == ["2_Dense", "code"]
    b = ("patch", src, "--impl", "torch") if command == "patch" else ("convert", gpt2, "--to", "rms")
    manifest = json.loads((out / "normswap.json").read_text())
    for name in ("runs", ".git"):
        _users_folder(out, name)
        if name == ".git":
            # a hand-edited file does not make it ours
            manifest["carried_folders"][".git"] = [(out / ".git").stat().st_ino, (out / ".git").stat().st_ctime_ns]
            (out / "normswap.json").write_text(json.dumps(manifest))
        before = _tree(out)
        r = run(*b, "--out", out, "--force")
        assert_one_line_error(r, f"{out} holds {name}/, which the new output would not hold")
        assert _tree(out) == before
        shutil.rmtree(out / name)
    carried = manifest.pop("carried_folders")  # an output of a version that did not say
    (out / "normswap.json").write_text(json.dumps(manifest))
    assert_one_line_error(run(*b, "--out", out, "--force"), f"{out} holds 2_Dense/, which the new output would not")
    manifest["carried_folders"] = list(carried)  # names alone (this session's first form) do not say it is ours
    (out / "normswap.json").write_text(json.dumps(manifest))
    assert_one_line_error(run(*b, "--out", out, "--force"), f"{out} holds 2_Dense/, which the new output would not")
    manifest["carried_folders"] = carried
    (out / "normswap.json").write_text(json.dumps(manifest))
    r = run(*b, "--out", out, "--force")
    assert r.exit_code == 0, r.stderr
    assert not (out / "code").exists() and not (out / "2_Dense").exists()
    assert json.loads((out / "normswap.json").read_text())["carried_folders"] == {}
    assert (a / "code" / "modeling_a.py").is_file() and (a / "2_Dense" / "config.json").is_file()


def test_case1_force_refuses_a_carried_folder_the_user_replaced_with_their_own(src, gpt2, tmp_path):
    """carried_folders named the folders by name alone: the user who removed an output's carried
    code/ and put a code/ of their own there (same name) lost it whole to --force of another model,
    as did one whose hand-edited normswap.json named a folder of theirs. What the file records is
    each folder as written (inode and change time), so a folder made since is refused as the
    user's."""
    import shutil

    a = tmp_path / "a"
    shutil.copytree(src, a)
    (a / "code").mkdir()
    (a / "code" / "modeling_a.py").write_text("# model A's code")
    out = tmp_path / "out"
    assert run("patch", a, "--impl", "torch", "--out", out).exit_code == 0
    shutil.rmtree(out / "code")
    (out / "code").mkdir()
    (out / "code" / "mine.py").write_text("# the user's own, no other copy")
    before = _tree(out)
    for b in (("patch", src, "--impl", "torch"), ("convert", gpt2, "--to", "rms")):
        r = run(*b, "--out", out, "--force")
        assert_one_line_error(r, f"{out} holds code/, which the new output would not hold")
        assert _tree(out) == before
    _users_folder(out, "runs")  # named by hand in the file, in the form it is written in
    manifest = json.loads((out / "normswap.json").read_text())
    manifest["carried_folders"] = {"code": manifest["carried_folders"]["code"], "runs": manifest["carried_folders"]["code"]}
    (out / "normswap.json").write_text(json.dumps(manifest))
    shutil.rmtree(out / "code")
    before = _tree(out)
    assert_one_line_error(run("patch", src, "--impl", "torch", "--out", out, "--force"),
                          f"{out} holds runs/, which the new output would not hold")
    assert _tree(out) == before


def test_case1_force_onto_a_folder_whose_normswap_json_is_a_pipe_refuses_without_blocking(src, tmp_path):
    """check_replaceable read normswap.json for its carried_folders (0ffdf96) whatever it was: a
    pipe in its place (a checkpoint folder with config.json beside it) blocked --force forever on
    the read. Anything but a file records no folder, and the user's folder is refused."""
    import threading

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text((src / "config.json").read_text())
    os.mkfifo(out / "normswap.json")
    _users_folder(out, "runs")
    before = _tree(out)
    result = []
    worker = threading.Thread(target=lambda: result.append(run("patch", src, "--impl", "torch", "--out", out, "--force")))
    worker.start()
    worker.join(60)
    if worker.is_alive():  # unblock the read so that the suite goes on, then fail
        os.close(os.open(out / "normswap.json", os.O_WRONLY | os.O_NONBLOCK))
        worker.join()
        pytest.fail("--force blocked on the read of a pipe named normswap.json")
    assert_one_line_error(result[0], f"{out} holds runs/, which the new output would not hold")
    assert _tree(out) == before


def test_in_place_keeps_the_models_folders_intact(src, tmp_path):
    """--in-place keeps every folder of the model's own (.git, checkpoint-1/) byte for byte."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(src, d)
    for name in (".git", "checkpoint-1"):
        _users_folder(d, name)
    kept = {k: v for k, v in _tree(d).items() if k.startswith((".git", "checkpoint-1"))}
    assert len(kept) == 4
    r = run("patch", d, "--impl", "torch", "--in-place")
    assert r.exit_code == 0, r.stderr
    assert {k: v for k, v in _tree(d).items() if k.startswith((".git", "checkpoint-1"))} == kept
    assert (d / "normswap.json").is_file()


@contextlib.contextmanager
def _mount_point(path: Path):
    """`path` made a mount point of its own (a tmpfs), as a docker volume (-v /models/m:/model) is;
    skips where this process may not mount (not root, no CAP_SYS_ADMIN)."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("how", ["in-place", "force"])
def test_case1_a_mount_point_is_refused_before_the_load(src, tmp_path, how):
    """A directory that is a mount point cannot be swapped for another by a rename (EBUSY):
    --in-place on a mounted model folder, or --force onto a mounted earlier output, patched,
    verified and saved the whole model, then failed with 'Device or resource busy'. Refused before
    anything loads, naming the way out; what is there stays as it was."""
    import shutil

    with _mount_point(tmp_path / "mnt") as mnt:
        for f in src.iterdir():
            shutil.copy(f, mnt / f.name)
        before = _tree(mnt)
        args = [mnt, "--in-place"] if how == "in-place" else [src, "--out", mnt, "--force"]
        r = run("patch", *args, "--impl", "torch")
        assert_one_line_error(r, f"{mnt} is a mount point")
        assert ("--out DIR" if how == "in-place" else "write to a folder inside it") in r.stderr
        assert "load" not in r.stderr  # refused before the load
        assert _tree(mnt) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt"]  # no staging, no lock left


@pytest.mark.parametrize("how", ["in-place", "force", "bind"])
def test_case1_a_folder_holding_a_mount_point_is_refused_before_the_load(src, tmp_path, how):
    """A checkpoint folder with another filesystem mounted inside it (model/data on a share): the
    old tree's removal after the swap went down into the mount and deleted what was on that
    filesystem (--force: gone; --in-place: copied into the new tree first, the share emptied), and
    left the mount at a hidden staging name. Refused before anything loads; the mount's files stay."""
    import shutil

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in src.iterdir():
        shutil.copy(f, ckpt / f.name)
    if how == "bind":  # a bind mount of a folder of the same filesystem: os.path.ismount misses it
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "d.txt").write_text("the share's")
        (ckpt / "data").mkdir()
        if subprocess.run(["mount", "--bind", str(tmp_path / "elsewhere"), str(ckpt / "data")],
                          capture_output=True).returncode:
            pytest.skip("cannot bind-mount here")
        mounted = contextlib.nullcontext(ckpt / "data")
    else:
        mounted = _mount_point(ckpt / "data")
    try:
        with mounted as data:
            if how != "bind":
                (data / "d.txt").write_text("the share's")
            args = [ckpt, "--in-place"] if how == "in-place" else [src, "--out", ckpt, "--force"]
            r = run("patch", *args, "--impl", "torch")
            assert_one_line_error(r, f"{ckpt} holds a mount point ({data})")
            assert "load" not in r.stderr
            assert (data / "d.txt").read_text() == "the share's"
            assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt"] + (["elsewhere"] if how == "bind"
                                                                                     else []))
    finally:  # wherever a failing run left the mount (a hidden staging name), it goes
        for point in reversed(checkpoint.mount_points_within(tmp_path)):
            subprocess.run(["umount", "-l", str(point)], check=True)


@pytest.mark.parametrize("table", ["mountinfo", "none (not Linux)"])
def test_case1_mount_points_within_reads_escaped_names_and_walks_where_there_is_no_table(tmp_path, monkeypatch,
                                                                                          table):
    """The mount table escapes a space, a line break and a backslash in a mount point (as \\ooo): a
    mount at such a name inside the folder is found under its real name. Where there is no table
    (not Linux) the folder is walked: a mount at the folder itself is found too, as the table finds
    it (the walk listed only the ones below it), and the walk does not go into a mount it found."""
    odd = tmp_path / "ckpt" / "a b\nc\\123"
    odd.parent.mkdir()
    if table != "mountinfo":
        monkeypatch.setattr(checkpoint, "MOUNT_TABLE", tmp_path / "absent")
    with _mount_point(odd):
        with _mount_point(odd / "inner"):
            assert checkpoint.mount_points_within(odd.parent) == ([odd, odd / "inner"] if table == "mountinfo"
                                                                  else [odd])
            assert checkpoint.mount_points_within(odd)[0] == odd
            assert checkpoint.mount_points_within(tmp_path / "ckpt2") == []


# ---- case 3: racing runs, and the in-place lock ------------------------------------------------


def test_case3_publish_without_force_never_replaces_a_target_that_appeared(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(NormswapError, match="already exists"):
        with checkpoint.staged_dir(target) as tmp:
            (tmp / "f").write_text("mine")
            target.mkdir()  # another run published while this one worked
            (target / "f").write_text("theirs")
    assert (target / "f").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_case3_rename_noreplace_refuses_an_existing_directory(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (b / "f").write_text("B")
    with pytest.raises(FileExistsError):
        checkpoint.rename_noreplace(a, b)
    # the portable fallback (plain rename(2)) cannot replace a non-empty directory either
    monkeypatch.setattr(fileio, "_rename_with_flags", lambda *a: False)
    with pytest.raises(FileExistsError):
        checkpoint.rename_noreplace(a, b)
    assert (b / "f").read_text() == "B" and a.is_dir()


_HOLD = """
import sys
from normswap.checkpoint import target_lock
with target_lock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()
"""


def test_case3_second_in_place_run_is_refused_while_one_holds_the_lock(gpt2, tmp_path):
    d = tmp_path / "model"
    save_tiny("llama", d)
    before = _tree(d)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(d)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = run("patch", d, "--impl", "torch", "--in-place")
        assert_one_line_error(r, f"another normswap run (pid {holder.pid}) is writing")
        assert _tree(d) == before
        # --out to the same place is serialised the same way
        r = run("convert", gpt2, "--to", "rms", "--out", d, "--force")
        assert_one_line_error(r, "another normswap run")
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert _tree(d) == before
    r = run("patch", d, "--impl", "torch", "--in-place")  # released: the next run goes ahead
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_case3_second_patch_out_run_is_refused_before_the_load(src, tmp_path, force):
    """Two `patch --out X` at once: the second did its whole load, patch and verification (an hour
    on a large model) and was refused only at the save ('already exists'), or with --force replaced
    the first's result. It is refused at once, naming the first's pid, as --in-place and convert are."""
    target = tmp_path / "X"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(target)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = run("patch", src, "--impl", "torch", "--out", target, *force)
        assert_one_line_error(r, f"another normswap run (pid {holder.pid}) is writing")
        assert "load" not in r.stderr  # nothing was loaded
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    r = run("patch", src, "--impl", "torch", "--out", tmp_path / "a" / "b" / "X")  # parent folders to make: still fine
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["X"]


def test_case3_lock_is_reentrant_and_removed(tmp_path):
    t = tmp_path / "t"
    with checkpoint.target_lock(t):
        with checkpoint.target_lock(t):
            assert (tmp_path / ".t.normswap.lock").read_text() == str(os.getpid())
    assert not (tmp_path / ".t.normswap.lock").exists()


def test_case3_lock_is_reentrant_within_a_thread_only(tmp_path):
    """Two threads of one program writing one target (normswap.patch_checkpoint(out=X) from a
    pool): the second entered the first's lock as its own and wrote X alongside it. It is refused
    as another process is, and the first's lock stays whole."""
    import threading

    t = tmp_path / "t"
    got = []

    def second():
        try:
            with checkpoint.target_lock(t):
                got.append("entered")
        except NormswapError as e:
            got.append(str(e))

    with checkpoint.target_lock(t):
        other = threading.Thread(target=second)
        other.start()
        other.join(60)
        assert got == [f"another normswap run (pid {os.getpid()}) is writing {t}; try again when it has finished"]
        with checkpoint.target_lock(t):  # this thread's own: re-entrant
            assert (tmp_path / ".t.normswap.lock").read_text() == str(os.getpid())
    assert not (tmp_path / ".t.normswap.lock").exists()


def test_the_lock_never_follows_a_link_into_someone_elses_file(tmp_path):
    """The lock file is opened beside the target, often in a shared folder. A link planted at its
    name (or left there) was followed: the linked file was truncated and given the pid, then the
    link removed. The lock is opened without following links and a link there is refused."""
    precious = tmp_path / "important.txt"
    precious.write_text("precious data")
    (tmp_path / ".out.normswap.lock").symlink_to(precious)
    with pytest.raises(NormswapError, match="is a symbolic link; refusing to follow it"):
        with checkpoint.target_lock(tmp_path / "out"):
            pass
    assert precious.read_text() == "precious data"
    assert (tmp_path / ".out.normswap.lock").is_symlink()


@pytest.mark.parametrize("cmd", ["patch", "convert", "bench", "experiment"])
def test_an_out_that_is_a_link_to_nothing_is_refused_not_written_through(src, gpt2, tmp_path, cmd):
    """`ln -s /elsewhere/x out; normswap patch M --out out`: the output was written at the link's
    target (its missing folders made), reported as "saved to /elsewhere/x". Refused, one line; so is
    a path that goes through such a link."""
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "out").symlink_to(elsewhere / "x")
    args = {"patch": ["patch", src, "--impl", "torch"], "convert": ["convert", gpt2, "--to", "rms"],
            "bench": ["bench", src, "--impls", "torch", "--repeats", "1", "--warmup", "0"],
            "experiment": ["experiment", ROOT / "recipes" / "smoke-kjv-tiny.toml"]}[cmd]
    for out, said in ((tmp_path / "out", "is a link to nothing"), (tmp_path / "out" / "sub", "a link to nothing")):
        for force in ([], ["--force"]) if cmd in ("patch", "convert") else ([],):
            assert_one_line_error(run(*args, "--out", out, *force), said)
    assert not elsewhere.exists()
    assert (tmp_path / "out").is_symlink()


# ---- case 2 (and 7: a size mismatch names the tensor and both shapes) --------------------------


def _edited_copy(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_case2_config_that_disagrees_with_its_weights_is_bad_input(src, gpt2, tmp_path):
    fewer = _edited_copy(src, tmp_path / "fewer", num_hidden_layers=1)
    before = _tree(fewer)
    r = run("patch", fewer, "--impl", "torch", "--in-place")
    # refused before the load (test_loading holds that), naming config.json's field
    assert_one_line_error(r, "(num_hidden_layers is 1 there, but the weights hold 2 layers: 9 tensor(s) of "
                             "model.layers.1 the config has no place for)")
    assert _tree(fewer) == before  # the only copy keeps every layer
    # convert streamed the whole checkpoint into a converted copy before its verification refused it
    shallower = _edited_copy(gpt2, tmp_path / "shallower", n_layer=1)
    r = run("convert", shallower, "--to", "rms", "--out", tmp_path / "c1")
    assert_one_line_error(r, "(n_layer is 1 there, but the weights hold 2 layers: 11 tensor(s) of transformer.h.1 "
                             "the config has no place for)")
    assert "verify" not in r.stderr and not (tmp_path / "c1").exists()

    more = _edited_copy(src, tmp_path / "more", num_hidden_layers=3)
    r = run("patch", more, "--impl", "torch", "--out", tmp_path / "out")
    # refused before the model was allocated, naming config.json's field (test_loading holds that)
    assert_one_line_error(r, "(num_hidden_layers is 3 there, but the weights hold 2 layers: 9 tensor(s) of "
                             "model.layers.2 missing from the checkpoint)")
    assert not (tmp_path / "out").exists()
    # evaluation and the library loader follow the same rule
    (tmp_path / "t.txt").write_text("some text to score " * 20)
    assert_one_line_error(run("ppl", more, "--data", tmp_path / "t.txt", "--max-length", "16"),
                          "missing from the checkpoint")
    from normswap.loading import load_model, resolve

    with pytest.raises(NormswapError, match="missing from the checkpoint"):
        load_model(resolve(more))

    # convert said "the checkpoint has no tensor transformer.h.2.ln_2.weight", after planning the extra layer
    deeper = _edited_copy(gpt2, tmp_path / "deeper", n_layer=3)
    assert_one_line_error(run("convert", deeper, "--to", "rms", "--out", tmp_path / "c"),
                          "(n_layer is 3 there, but the weights hold 2 layers: 12 tensor(s) of transformer.h.2 "
                          "missing from the checkpoint)")
    assert not (tmp_path / "c").exists()

    wide = _edited_copy(src, tmp_path / "wide", intermediate_size=64)
    r = run("patch", wide, "--impl", "torch")
    assert_one_line_error(r, "model.layers.0.mlp.down_proj.weight (checkpoint [32, 48], config [32, 64])")
    assert "above report" not in r.stderr


def test_case2_tied_and_ignorable_keys_still_load(tmp_path):
    from normswap.loading import load_model, resolve

    save_tiny("gpt2", tmp_path / "g")  # lm_head tied to wte: not in the file, not "missing"
    from safetensors.torch import load_file, save_file

    f = tmp_path / "g" / "model.safetensors"
    tensors = load_file(f)
    tensors["transformer.h.0.attn.bias"] = torch.ones(1)  # what old GPT-2 files carry (ignorable)
    save_file(tensors, f, metadata={"format": "pt"})
    load_model(resolve(tmp_path / "g"))


# ---- case 9: Ctrl-C at any moment: one line, exit 130 ------------------------------------------

# The console script runs `from normswap.cli import main; main()`. These drivers deliver a real
# SIGINT at a chosen instant: while torch is being imported (start-up), and from an atexit
# handler (the interpreter's shutdown after a successful run).
_SIGINT_ON_TORCH_IMPORT = """
import os, signal, sys, importlib.abc
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
from normswap.cli import main
assert "torch" not in sys.modules  # the entry point itself is light: nothing heavy before main()
sys.argv = ["normswap", *sys.argv[1:]]
main()
"""

_SIGINT_AT_EXIT = """
import atexit, os, signal, sys
from normswap.cli import main
atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))
sys.argv = ["normswap", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("driver", [_SIGINT_ON_TORCH_IMPORT, _SIGINT_AT_EXIT], ids=["start-up", "after-success"])
def test_case9_ctrl_c_prints_one_line_and_exits_130(src, driver):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", driver, "scan", str(src), "--json", "--no-readers"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 130, (p.returncode, p.stderr[-3000:])
    assert p.stderr.strip() == "normswap: interrupted", p.stderr[-3000:]
    if driver is _SIGINT_AT_EXIT:
        assert json.loads(p.stdout)["model"] == str(src)  # the finished run's output is all there


# A signal at the first import of a module outside normswap, from the console script's own import
# of the entry point on: the driver imports no more than that script does (os, sys, both loaded at
# start-up; no signal.py), and sends the signal with os.kill.
_SIGNAL_AT_THE_FIRST_IMPORT = """
import os, sys
SIG = int(sys.argv[1])
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] != "normswap":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), SIG)
        return None
sys.meta_path.insert(0, Interrupt())
from normswap.cli import main
sys.argv = ["normswap", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize("sig, line, code", [(signal.SIGINT, "normswap: interrupted", 130),
                                             (signal.SIGTERM, "normswap: terminated", 143)], ids=["SIGINT", "SIGTERM"])
def test_case9_nothing_before_the_entry_point_answers_an_interrupt_imports_a_module(src, sig, line, code):
    """`from normswap.cli import main`, which the console script runs before main() can set its
    handlers, imported importlib.abc (tempfile, shutil, bz2, lzma), subprocess (threading, locale,
    selectors), re and signal.py: ~35 ms idle, up to 0.22 s on a loaded machine, where a Ctrl-C
    ended the run with a KeyboardInterrupt traceback and death by the signal (-2), a SIGTERM with
    no line (-15). It now imports only normswap's own modules: the first other import
    comes after main() answers signals."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _SIGNAL_AT_THE_FIRST_IMPORT, str(int(sig)), "scan", str(src), "--json"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    assert p.stderr.strip() == line and p.stdout == "", p.stderr[-3000:]


# A library that catches the KeyboardInterrupt on its way and raises another error in its place, as
# numpy's C initialisation does when Ctrl-C lands in it (an ImportError, or a module left half made
# that fails the next import): at start-up (numpy, under torch's import) and during the command
# (transformers' lazy import of the model class, which it reports as "Could not import module").
_SIGINT_TURNED_INTO_IMPORT_ERROR = """
import os, signal, sys, importlib.abc
TARGET = sys.argv[1]
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == TARGET:
            sys.meta_path.remove(self)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # the handler runs between bytecodes
                    pass
            except KeyboardInterrupt:
                raise ImportError("cannot load module more than once per process") from None
        return None
sys.meta_path.insert(0, Interrupt())
from normswap.cli import main
sys.argv = ["normswap", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize("module", ["numpy", "transformers.models.llama.modeling_llama"],
                         ids=["start-up", "during-the-command"])
def test_case9_ctrl_c_that_a_library_turns_into_another_error_is_still_an_interrupt(src, module):
    """Ctrl-C at start-up or in a lazy import came out as a traceback (ImportError, exit 1) or as
    'internal error: ModuleNotFoundError: Could not import module 'LlamaForCausalLM'' (exit 1)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _SIGINT_TURNED_INTO_IMPORT_ERROR, module, "scan", str(src), "--json"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 130, (p.returncode, p.stderr[-3000:])
    assert p.stderr.strip() == "normswap: interrupted" and p.stdout == "", p.stderr[-3000:]


@pytest.mark.parametrize("module", ["numpy", "transformers.models.llama.modeling_llama"],
                         ids=["start-up", "during-the-command"])
def test_case9_a_sigint_ignored_by_the_parent_stays_ignored(src, module):
    """A shell script's background job ('normswap ... &') starts with SIGINT ignored, so that a
    Ctrl-C meant for the script's foreground command leaves it running (Python keeps an inherited
    SIG_IGN). main() set its own handler regardless: the run ended 'normswap: interrupted', 130."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _SIGINT_TURNED_INTO_IMPORT_ERROR, module, "scan", str(src), "--json"],
                       env=env, capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert json.loads(p.stdout)["model"] == str(src)


# Ctrl-C that lands in a __del__ (regex's Group.__del__ runs many times under transformers'
# imports): the driver's finder makes and drops such an object when the module named first is
# imported, and the object interrupts the process from its __del__.
_SIGINT_IN_A_DEL = """
import os, signal, sys
TARGET = sys.argv[1]
class Dropped:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs between bytecodes: here, inside __del__
            pass
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == TARGET:
            sys.meta_path.remove(self)
            Dropped()
        return None
sys.meta_path.insert(0, Interrupt())
from normswap.cli import main
sys.argv = ["normswap", *sys.argv[2:]]
main()
"""


def test_case9_ctrl_c_in_a_del_during_the_first_imports_is_not_lost(src):
    """Raised there, Python ignored the KeyboardInterrupt ('Exception ignored in: <function
    Group.__del__ ...>' and its traceback) and the command ran on to exit 0: seen in 1 of 30
    SIGINTs at random instants to `normswap scan smollm2-135m` at load 7, once the imports of
    torch and transformers had moved from start-up into the command (so that --help needs
    neither). They run with the signals ending the process at once, as at start-up."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _SIGINT_IN_A_DEL, "transformers", "scan", str(src), "--json",
                        "--no-readers"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 130, (p.returncode, p.stderr[-3000:])
    assert p.stderr.strip() == "normswap: interrupted" and p.stdout == "", p.stderr[-3000:]


def test_case9_ctrl_c_in_a_del_during_the_command_is_not_lost(src):
    """During the command an interrupt is raised where the program is (so that its clean-ups run);
    raised in a __del__ (here while the model's class is first imported), Python printed
    'Exception ignored in: <function Dropped.__del__ ...>' and a traceback, and the scan ran on to
    exit 0. The signal is sent again once the __del__ is over (signals.resending_lost_interrupts)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _SIGINT_IN_A_DEL, "transformers.models.llama.modeling_llama", "scan",
                        str(src), "--json", "--no-readers"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 130, (p.returncode, p.stderr[-3000:])
    assert p.stderr.strip() == "normswap: interrupted" and p.stdout == "", p.stderr[-3000:]


# Which handler answers SIGINT while triton is first imported: written to stderr by a finder.
_HANDLER_AT_TRITON = """
import signal, sys
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "triton":
            sys.meta_path.remove(self)
            sys.stderr.write("handler: " + getattr(signal.getsignal(signal.SIGINT), "__name__", "?") + "\\n")
        return None
sys.meta_path.insert(0, Spy())
from normswap.cli import main
sys.argv = ["normswap", *sys.argv[1:]]
main()
"""


def test_triton_is_first_imported_where_an_interrupt_ends_the_run_at_once(src):
    """An interrupt raised while triton's native module starts (its enums made from C++ through
    nanobind) aborted the process: C++ terminate, SIGABRT and a traceback instead of one line and
    130 (seen 1 in 3 runs of the lost-interrupt test above, its resent signal landing in triton's
    import under torch._dynamo). triton is imported with torch, where signals end the run at once."""
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _HANDLER_AT_TRITON, "scan", str(src), "--json", "--no-readers"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "handler: end_at_once" in p.stderr.splitlines(), p.stderr[-3000:]


# Ctrl-C during the command's first imports that a package swallows on the way (as torch turns a
# failed NumPy initialisation into a warning and goes on): the driver's finder interrupts the
# process while torch is first imported, inside a handler that drops whatever is raised there.
_SIGINT_SWALLOWED = """
import os, signal, sys
class Swallow:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # the handler runs between bytecodes: here, inside the try
                    pass
            except BaseException:
                pass
        return None
sys.meta_path.insert(0, Swallow())
from normswap.cli import main
sys.argv = ["normswap", *sys.argv[1:]]
main()
"""


def test_case9_ctrl_c_swallowed_during_the_first_imports_is_not_lost(src):
    """The first imports run with the signals ending the process at once (signals.EndingAtOnce):
    raised there, an interrupt a package catches and drops was lost, and the scan ran on to exit 0
    (the resending unraisable hook sees only those lost in a __del__)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _SIGINT_SWALLOWED, "scan", str(src), "--json", "--no-readers"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 130, (p.returncode, p.stderr[-3000:])
    assert p.stderr.strip() == "normswap: interrupted" and p.stdout == "", p.stderr[-3000:]


# A signal later than every atexit handler: sent while the interpreter tears its modules down
# (a global of __main__ freed), after Python has switched its signal handling off. Only where
# main() is not the program (here: called from a function) does the interpreter tear down after
# it; as the program it ends the process first (cli._exit_without_teardown, tests/test_startup.py).
_SIGNAL_IN_TEARDOWN = """
import os, signal, sys
from normswap.cli import main
class Late:
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=int(sys.argv[1])):
        kill(pid, sig)
late = Late()
sys.argv = ["normswap", *sys.argv[2:]]
def run():
    main()
run()
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_case9_a_signal_in_the_last_moments_of_teardown_loses_nothing(src, sig):
    """No handler of ours can run then (cli.main says why that is acceptable): the signal's default
    action ends the process (the shell's 130 or 143), with no line, and the finished run's output
    is all there."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _SIGNAL_IN_TEARDOWN, str(int(sig)), "scan", str(src), "--json",
                        "--no-readers"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == -sig, (p.returncode, p.stderr[-3000:])
    assert json.loads(p.stdout)["model"] == str(src) and p.stderr == ""


# ---- cases 5, 7 (the whole reason) and 8: nonsense configs and unreadable files -----------------


@pytest.mark.parametrize("change, says", [
    (dict(num_hidden_layers=-1), "num_hidden_layers is -1; it must be at least 1"),
    (dict(hidden_size=0), "hidden_size is 0"),
    (dict(vocab_size=0), "vocab_size is 0"),
    (dict(num_key_value_heads=-2), "num_key_value_heads is -2; a size or count cannot be negative"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps is nan; an eps must be finite"),
    (dict(hidden_size="big"), "Validation error for field 'hidden_size': TypeError: Field 'hidden_size' "
                              "expected int, got str"),
    # a string was read letter by letter, found no class, and built the bare base model: scan showed the
    # wrong model, patch blamed 'lm_head.weight ... another model size?'
    (dict(architectures="LlamaForCausalLM"), "architectures is a str ('LlamaForCausalLM'); it must be a list"),
])
@pytest.mark.parametrize("cmd", ["scan", "patch"])
def test_case5_8_nonsense_config_is_bad_input(src, tmp_path, change, says, cmd):
    d = _edited_copy(src, tmp_path / "m", **change)
    r = run(cmd, d, *(["--impl", "torch"] if cmd == "patch" else []))
    assert_one_line_error(r, says)
    assert f"{d / 'config.json'}" in r.stderr
    assert "Warning" not in r.stderr and "warn" not in r.stderr.lower()


@contextlib.contextmanager
def _denied(path: Path):
    """Reading anything under `path` fails with EACCES, as for a user without permission (tests
    may run as root, which ignores permission bits, so the calls normswap makes are made to fail)."""
    import builtins
    import errno
    import pathlib
    from unittest import mock

    prefix = str(path)

    def guard(real):
        def wrapper(p, *a, **k):
            if str(os.fspath(p)).startswith(prefix):
                raise PermissionError(errno.EACCES, "Permission denied", str(p))
            return real(p, *a, **k)
        return wrapper

    with mock.patch.object(os, "listdir", guard(os.listdir)), \
            mock.patch.object(pathlib.Path, "read_text", guard(pathlib.Path.read_text)), \
            mock.patch.object(builtins, "open", guard(builtins.open)):
        yield


def test_case5_unreadable_model_directory_is_bad_input_naming_the_os_reason(src, tmp_path):
    import shutil

    d = tmp_path / "locked"
    shutil.copytree(src, d)
    for cmd in (["scan", d], ["patch", d, "--impl", "torch"]):
        with _denied(d):
            r = run(*cmd)
        assert_one_line_error(r, f"{d}: cannot read (Permission denied)")  # as for a file in it
        assert "no such" not in r.stderr.lower() and "malformed" not in r.stderr


def test_case5_unreadable_config_and_data_name_the_file(src, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(src, d)
    text = tmp_path / "t.txt"
    text.write_text("hello there " * 50)
    with _denied(d / "config.json"):
        r = run("scan", d)
    assert_one_line_error(r, f"{d / 'config.json'}: cannot read (Permission denied)")
    assert "malformed" not in r.stderr
    with _denied(text):
        r = run("ppl", src, "--data", text)
    assert_one_line_error(r, "Permission denied")
    assert str(text) in r.stderr


# ---- case 6: non-finite input is named, never blamed on the kernel or the conversion -----------


def _corrupt(src: Path, dst: Path, name: str, value: float) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    tensors[name][3] = value
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def _retyped(src: Path, dst: Path, name: str, dtype: torch.dtype) -> Path:
    """A copy of `src` whose tensor `name` is stored as `dtype` (its values times 3, cast)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    tensors[name] = (tensors[name] * 3).to(dtype)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_case6_non_finite_weight_is_named(src, gpt2, tmp_path, value):
    bad = _corrupt(src, tmp_path / "bad", "model.norm.weight", value)
    r = run("patch", bad, "--impl", "torch")
    assert_one_line_error(r, "is corrupt: model.norm.weight holds")
    assert "whole-model check" not in r.stderr and "kernel" not in r.stderr
    bad2 = _corrupt(gpt2, tmp_path / "bad2", "transformer.h.0.ln_1.weight", value)
    r = run("convert", bad2, "--to", "rms", "--out", tmp_path / "conv")
    assert_one_line_error(r, "transformer.h.0.ln_1.weight holds")
    assert "differ" not in r.stderr and not (tmp_path / "conv").exists()
    # the library says the same
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = value
    with pytest.raises(NormswapError, match=r"model.layers.1.mlp.up_proj.weight holds"):
        patch(model, "torch", probe=SMALL)


def test_case6_nan_eps_is_bad_input(tmp_path):
    model = tiny_model("llama")
    model.model.norm.variance_epsilon = float("nan")
    with pytest.raises(NormswapError, match=r"model.norm \(LlamaRMSNorm\): eps is nan"):
        patch(model, "torch", probe=SMALL)


# ---- case 7: every option named as typed, and checked before any load --------------------------


def test_case7_options_are_named_as_typed_and_checked_before_loading(src, tmp_path, monkeypatch):
    from normswap import loading

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(loading, "load_model", no_load)
    text = tmp_path / "t.txt"
    text.write_text("hello there " * 50)
    r = run("patch", src, "--impl", "torch", "--eval", text, "--eval-max-length", "0")
    assert_one_line_error(r, "--eval-max-length 0: a window needs at least 2 tokens")
    r = run("patch", src, "--impl", "torch", "--eval", text, "--eval-max-tokens", "1")
    assert_one_line_error(r, "--eval-max-tokens 1")
    r = run("demo", "--max-tokens", "-5")
    assert_one_line_error(r, "--max-tokens -5: at least 2 tokens")
    assert "--max-length" not in r.stderr and "--eval" not in r.stderr
    r = run("patch", src, "--impl", "torch", "--out", tmp_path / "o", "--max-shard-size", "banana")
    assert_one_line_error(r, "--max-shard-size 'banana'")
    assert not (tmp_path / "o").exists()


# ---- case 10: the Python API raises NormswapError subclasses for plausible values --------------


def test_case10_api_errors_are_normswap_errors(tmp_path):
    from tiny_models import tiny_tokenizer

    import normswap
    from normswap.errors import BadInputError

    model = tiny_model("llama")
    report = normswap.patch(model, "torch", dtype="fp32", probe=SMALL)  # what load accepts, patch accepts
    assert report.dtype == "float32"
    normswap.revert(model)
    with pytest.raises(BadInputError, match="unknown dtype 'fp8'"):
        normswap.patch(model, "torch", dtype="fp8")
    with torch.device("meta"):
        meta = type(model)(model.config)
    with pytest.raises(BadInputError, match="meta device"):
        normswap.patch(meta, "torch")
    normswap.patch(meta, "torch", verify=False)  # what the meta device is for: no numbers
    tok = tiny_tokenizer()
    with pytest.raises(BadInputError, match="token id -3 is negative"):
        normswap.perplexity(model, tok, torch.tensor([5, 6, -3, 7, 8]), max_length=4, progress=False)
    with pytest.raises(BadInputError, match="max_length must be a whole number of tokens, got 2.5"):
        normswap.perplexity(model, tok, "some text here", max_length=2.5, progress=False)
    assert issubclass(BadInputError, ValueError) and issubclass(BadInputError, normswap.NormswapError)



@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_a_dtype_that_is_not_a_float_is_bad_input_everywhere(src, dtype):
    """A torch.dtype is the right kind of argument; int32 is not a value a model runs in. patch()
    raised torch.finfo's TypeError from deep in the verification, patch_checkpoint/load handed it
    to from_pretrained."""
    import normswap
    from normswap.errors import BadInputError

    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(BadInputError, match=f"dtype {dtype}: normswap runs models in"):
        normswap.patch(model, "torch", dtype=dtype)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(type(m).__name__.startswith("Normswap") for m in model.modules())
    with pytest.raises(BadInputError, match=f"dtype {dtype}"):
        normswap.patch_checkpoint(src, "torch", dtype=dtype)
    with pytest.raises(BadInputError, match=f"dtype {dtype}"):
        normswap.load(src, dtype=dtype)


def test_float_token_ids_are_bad_input_not_truncated():
    """torch.tensor([1.5, 2.0, ...]) was scored as ids [1, 2, ...] (tolist + int): a wrong number
    with no complaint. Ids are integers; a float tensor says the caller passed something else
    (logits, embeddings, a normalised array)."""
    from tiny_models import tiny_tokenizer

    import normswap
    from normswap.errors import BadInputError

    model, tok = tiny_model("llama"), tiny_tokenizer()
    with pytest.raises(BadInputError, match="token ids must be integers, got a torch.float32 tensor"):
        normswap.perplexity(model, tok, torch.tensor([5.5, 6.0, 7.0, 8.0, 9.0]), max_length=4, progress=False)
    ok = normswap.perplexity(model, tok, torch.tensor([5, 6, 7, 8, 9]), max_length=4, progress=False)
    assert ok.tokens > 0

# ---- case 4: tokenisation streams, whatever the file's shape -----------------------------------


class _SpyTokenizer:
    """Wraps a tokenizer and records the length of every text it is asked to encode."""

    def __init__(self, tok):
        self.tok, self.seen = tok, []

    def __call__(self, text, **kw):
        self.seen.append(len(text))
        return self.tok(text, **kw)


def _one_line_file(path: Path, chars: int) -> str:
    import random

    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "anarchism", "originated"]
    out, n = [], 0
    while n < chars:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    text = " ".join(out)  # text8's shape: one line, no newline at all
    path.write_text(text)
    return text


def test_case4_one_line_file_with_max_tokens_tokenises_a_bounded_prefix(tmp_path):
    from tiny_models import tiny_tokenizer

    import normswap
    from normswap import data as nsdata
    from normswap.data import open_corpus

    p = tmp_path / "text8.txt"
    _one_line_file(p, 4_000_000)
    spy = _SpyTokenizer(tiny_tokenizer())
    model = tiny_model("llama")
    r = normswap.perplexity(model, spy, open_corpus(p), max_length=32, max_tokens=256, progress=False)
    assert r.tokens == 255
    assert max(spy.seen) <= nsdata.FIRST_PIECE_CHARS  # never the 4 MB line
    assert sum(spy.seen) <= 2 * nsdata.FIRST_PIECE_CHARS  # it stopped once 256 tokens were there


def test_case4_long_lines_and_strings_are_cut_into_bounded_exact_pieces(tmp_path, monkeypatch):
    import tracemalloc

    from tiny_models import tiny_tokenizer

    from normswap import data as nsdata
    from normswap.data import open_corpus
    from normswap.evaluate import document_tokens

    p = tmp_path / "line.txt"
    text = _one_line_file(p, 3_000_000)
    # reading a 3 MB one-line file piece by piece holds a bounded amount of it
    tracemalloc.start()
    try:
        (doc,) = list(open_corpus(p).documents())
        sizes = [len(piece) for piece in doc]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert max(sizes) <= nsdata.MAX_PIECE_CHARS and sum(sizes) == len(text)
    assert peak < 8 * nsdata.MAX_PIECE_CHARS < len(text) * 4  # not the whole line (str of 3M chars)
    # a str, a jsonl row or a dataset row arrives whole: the tokenizer still sees bounded pieces,
    # and the cuts (before a space) give exactly the tokens of the whole text
    monkeypatch.setattr(nsdata, "FIRST_PIECE_CHARS", 1000)
    monkeypatch.setattr(nsdata, "MAX_PIECE_CHARS", 4000)
    sample = text[:200_000]
    spy = _SpyTokenizer(tiny_tokenizer())
    streamed = [t for chunk in document_tokens(spy, [iter([sample])]) for t in chunk]
    assert max(spy.seen) <= 4000
    assert streamed == tiny_tokenizer()(sample, add_special_tokens=False)["input_ids"]


# ---- the error contract: without --json a refusal's report goes to stderr, stdout stays empty --


def test_contract_refusal_report_goes_to_stderr_without_json(tmp_path):
    save_tiny("bert", tmp_path / "bert")
    r = run("convert", tmp_path / "bert", "--to", "rms", "--out", tmp_path / "o")
    assert_one_line_error(r, "nothing converts")
    assert r.stdout == "" and "embeddings.LayerNorm" in r.stderr
    r = run("convert", tmp_path / "bert", "--to", "rms", "--out", tmp_path / "o", "--json")
    assert_one_line_error(r, "nothing converts")
    assert json.loads(r.stdout)["out"] is None


def test_case8_scan_of_a_nonsense_config_prints_only_our_line(src, tmp_path):
    """A fresh process (transformers warns once per process, so in-process runs cannot see it):
    vocab_size 0 made transformers log three config warnings before normswap's error line."""
    import shutil

    bad = tmp_path / "zero_vocab"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] = 0
    (bad / "config.json").write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "normswap", "scan", str(bad), "--json"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout)
    assert len(lines) == 1 and lines[0].startswith("normswap: error:") and "vocab_size" in lines[0], lines


# ---- a hostile user's second pass: inputs the first sweep did not try --------------------------


@pytest.mark.parametrize("content, says", [
    (b'{"model_type": "llama", "name": "caf\xe9"}', "not UTF-8"),  # a Latin-1 editor's save
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # json's recursion limit
])
@pytest.mark.parametrize("cmd", ["scan", "patch"])
def test_config_json_that_is_not_text_or_too_deep_is_bad_input(src, tmp_path, content, says, cmd):
    """Both were internal errors (exit 1): read_text raised UnicodeDecodeError and json.loads
    RecursionError, neither an OSError nor the ValueError load_config caught."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(src, d)
    (d / "config.json").write_bytes(content)
    r = run(cmd, d, *(["--impl", "torch"] if cmd == "patch" else []))
    assert_one_line_error(r, f"{d / 'config.json'}: malformed config.json")
    assert says in r.stderr


@pytest.mark.parametrize("change", [dict(num_hidden_layers=10**12), dict(num_hidden_layers=50_000)])
def test_a_layer_count_no_model_has_is_refused_before_building(src, tmp_path, change):
    """A typo such as 320000 for 32 made scan build the module tree on the meta device for ever
    (10**12 layers: 23 GB of memory after ten minutes, still going). Refused from the config."""
    d = _edited_copy(src, tmp_path / "m", **change)
    r = run("scan", d, "--no-readers")
    assert_one_line_error(r, f"num_hidden_layers is {change['num_hidden_layers']}; normswap takes at most")


def test_a_nested_layer_count_is_refused_too(src, tmp_path):
    """Encoder-decoder configs count layers under other names (num_decoder_layers, decoder_layers,
    a text_config's num_hidden_layers): the limit reads every field named like a layer count."""
    d = _edited_copy(src, tmp_path / "m", text_config={"num_layers": 2 * 10**9})
    assert_one_line_error(run("scan", d), "text_config.num_layers is 2000000000")


def test_a_newline_in_a_path_stays_on_the_one_error_line(tmp_path):
    """Messages name the user's paths as given; a name holding a newline split the error into two
    lines (a script reading the last line of stderr got half of it). The CLI shows it escaped."""
    bad = tmp_path / "two\nlines"
    r = run("scan", bad)
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("normswap: error: "), r.stderr
    assert "two\\nlines: no such file" in r.stderr


@pytest.mark.parametrize("model", ["", "  "])
def test_an_empty_model_argument_is_bad_input_not_the_current_directory(src, tmp_path, monkeypatch, model):
    """The --out rule (case 1) for MODEL: `normswap patch "$MODEL" --in-place` with MODEL unset,
    run inside a checkpoint, rewrote the current directory and exited 0 (Path("") is "."). An
    empty or blank model reference is bad input, for every command and the library."""
    import shutil

    import normswap

    here = tmp_path / "cwd"
    shutil.copytree(src, here)
    before = _tree(here)
    monkeypatch.chdir(here)
    assert_one_line_error(run("patch", model, "--impl", "torch", "--in-place"), "the model is empty")
    assert_one_line_error(run("scan", model), "the model is empty")
    assert _tree(here) == before
    with pytest.raises(normswap.BadInputError, match="the model is empty"):
        normswap.patch_checkpoint(model, "torch", in_place=True)


def test_a_broken_gguf_is_named_not_a_config_json_that_does_not_exist(tmp_path):
    """A .gguf that is not one (a text file renamed, an empty or truncated download) was reported as
    '<folder>/config.json: cannot read the model config: ...', a file that is not there."""
    bad = tmp_path / "model.gguf"
    bad.write_text("not a gguf file at all " * 10)
    r = run("scan", bad)
    assert_one_line_error(r, f"{bad}: a truncated or malformed GGUF file; cannot read it (the reader says: ")
    assert "config.json" not in r.stderr


@pytest.mark.parametrize("names", ["X" * 100_000, {"a": list(range(50_000))}])
def test_architectures_of_the_wrong_type_are_shown_shortened(src, tmp_path, names):
    """The refusal quotes the value it refuses; a config file's value can be any size (a 100 KB
    string, a large object), so the quote is shortened and the error stays one short line."""
    d = _edited_copy(src, tmp_path / "m", architectures=names)
    r = run("scan", d)
    assert_one_line_error(r, f"architectures is a {type(names).__name__} (")
    assert len(r.stderr) < 400 + len(str(d)), len(r.stderr)


def test_normswap_alone_prints_its_help_readably():
    """`normswap` with no command shows the help (click's NoArgsIsHelp), line by line: escaping
    line breaks, right for an error naming a path, must not turn it into one '\\n'-studded line."""
    r = run()
    assert r.exit_code == 2
    assert "Commands:" in r.stderr.splitlines() and "\\n" not in r.stderr


# ---- a reader that closes stdout early (`normswap scan M | head -1`) ------------------------------


@pytest.mark.parametrize("args", [["scan", "{m}"], ["scan", "{m}", "--json"], ["--help"]],
                         ids=["table", "json", "help"])
def test_a_closed_stdout_ends_quietly_with_141(src, args):
    """Like a Unix tool that SIGPIPE ended: exit 128 + 13, nothing on stderr (not rich's silent
    exit 1, which reads as an internal error, nor a 'Broken pipe' error line or the interpreter's
    'Exception ignored' at its final flush). The pipe's reader is closed before the process
    starts, so the first write fails whatever the output's size."""
    read, write = os.pipe()
    os.close(read)
    try:
        p = subprocess.run([sys.executable, "-m", "normswap", *(a.format(m=src) for a in args)], stdout=write,
                           stderr=subprocess.PIPE, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    assert (p.returncode, p.stderr) == (141, "")


@pytest.mark.parametrize("args, code, stderr", [(["scan", "{m}", "--json"], 0, ""),
                                                (["scan", "{m}-missing"], 2, "normswap: error: ")],
                         ids=["done", "bad-input"])
def test_a_stdout_closed_before_the_start_is_dev_null(src, args, code, stderr):
    """`normswap ... >&-` (a daemon's closed stdout): Python leaves sys.stdout None, and the report's
    write, even a bad-input line's final flush, was an internal error with a traceback, exit 1.
    Now it is /dev/null from the start, as `>/dev/null` is (and no file opened later can take
    descriptor 1)."""
    p = subprocess.run(["/bin/sh", "-c", 'exec "$0" -m normswap "$@" >&-', sys.executable,
                        *(a.format(m=src) for a in args)], stderr=subprocess.PIPE, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == code and "Traceback" not in p.stderr and p.stderr.startswith(stderr), p.stderr[-2000:]
    assert len(p.stderr.splitlines()) == (code != 0)


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error(src, monkeypatch):
    """Only a closed stdout is the reader's choice: a BrokenPipeError from any other pipe (here the
    library's) stays a one-line error, not a silent 141."""
    from normswap import scan

    def broken(*a, **k):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(scan, "scan", broken)
    assert_one_line_error(run("scan", src), "Broken pipe")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full (every write: ENOSPC)")
@pytest.mark.parametrize("args", [["scan", "{m}"], ["scan", "{m}", "--json"]], ids=["table", "json"])
def test_a_full_stdout_is_named_as_stdout(src, args):
    """`normswap scan M > /dev/full` said only 'No space left on device', as if the command's own
    output had failed: the line says the report could not be written to stdout."""
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "normswap", *(a.format(m=src) for a in args)], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.splitlines() == ["normswap: error: could not write the report to stdout: No space left on device"]


# ---- a generation_config.json transformers cannot use: refused, never replaced by a default ------


@pytest.mark.parametrize("content, says", [
    (b'{"max_length": 50,', "malformed generation_config.json (Expecting property name enclosed in double quotes: line 1"),
    (b"", "malformed generation_config.json (Expecting value: line 1 column 1"),
    (b"[" * 100_000 + b"]" * 100_000, "malformed generation_config.json (nested too deeply: more than 100 levels)"),
    (b'"greedy"', "malformed generation_config.json (a string, not an object of generation settings)"),
    (b'{"max_length": 50, "note": "caf\xe9"}', "malformed generation_config.json (not UTF-8: invalid byte at"),
    (b'{"cache_implementation": 5}', "malformed generation_config.json (Invalid `cache_implementation` (5)"),
])
def test_a_malformed_generation_config_is_refused_before_anything_is_written(src, gpt2, tmp_path, content, says):
    """transformers reads a generation_config.json that is not JSON as no file and builds a default;
    save_pretrained wrote that default in its place, so --in-place lost the user's file and --out
    published the model without it. Now every command refuses it, naming the file, and --in-place
    leaves the directory byte for byte as it was."""
    import shutil

    out = tmp_path / "out"
    for model, runs in ((src, [["patch", "--impl", "torch", "--in-place"], ["patch", "--impl", "torch", "--out", out]]),
                        (gpt2, [["convert", "--to", "rms", "--out", out], ["scan"]])):
        d = tmp_path / model.name
        shutil.copytree(model, d)
        (d / "generation_config.json").write_bytes(content)
        before = _tree(d)
        for cmd, *opts in runs:
            assert_one_line_error(run(cmd, d, *opts), f"{d / 'generation_config.json'}: {says}")
            assert _tree(d) == before and not out.exists()


def test_a_generation_config_folder_survives_in_place(src, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(src, d)
    (d / "generation_config.json").unlink()
    (d / "generation_config.json").mkdir()
    (d / "generation_config.json" / "notes.txt").write_text("mine")
    before = _tree(d)
    assert_one_line_error(run("patch", d, "--impl", "torch", "--in-place"), "generation_config.json: cannot read "
                                                                              "(Is a directory)")
    assert _tree(d) == before


def test_a_model_that_does_not_generate_keeps_its_generation_config_as_it_is(tmp_path):
    """BertModel neither reads nor writes generation_config.json (transformers loads the folder
    whatever the file holds): it is not refused, and patch --out and --in-place carry it byte for
    byte, a malformed one included."""
    d = tmp_path / "bert"
    save_tiny("bert", d)
    mine = b'{"max_length": 50,'
    (d / "generation_config.json").write_bytes(mine)
    for where in (["--out", tmp_path / "out"], ["--in-place"]):
        r = run("patch", d, "--impl", "torch", *where)
        assert r.exit_code == 0, r.output
        assert (Path(where[-1]) if len(where) == 2 else d).joinpath("generation_config.json").read_bytes() == mine


def test_a_valid_generation_config_is_saved_with_its_settings(src, tmp_path):
    """The refusal stops at what transformers cannot use: values it accepts, even odd ones, and keys
    it does not know are carried into the saved model as they were."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(src, d)
    mine = {"max_length": 50, "temperature": 0.7, "do_sample": True, "top_k": 7, "my_own_key": "kept"}
    (d / "generation_config.json").write_text(json.dumps(mine))
    r = run("patch", d, "--impl", "torch", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert {k: saved.get(k) for k in mine} == mine


# ---- a floating-point tensor stored as integers: refused, never cast silently --------------------


@pytest.mark.parametrize("name, dtype, stored", [
    ("model.norm.weight", torch.int64, "I64"),
    ("model.layers.0.mlp.up_proj.weight", torch.int32, "I32"),
    ("model.layers.1.input_layernorm.weight", torch.bool, "BOOL"),
    ("model.layers.0.self_attn.q_proj.weight", torch.uint8, "U8"),
])
def test_a_float_tensor_stored_as_integers_is_refused_before_anything_is_written(src, tmp_path, name, dtype, stored):
    """transformers casts an integer-stored weight to float without a word: patch verified, saved and
    re-saved (--in-place: over the user's file) a model that is not the one in the file, and ppl
    scored it."""
    d = _retyped(src, tmp_path / "m", name, dtype)
    before = _tree(d)
    says = f"{d / 'model.safetensors'}: {name} is stored as {stored} where LlamaForCausalLM has a floating-point"
    for args in (["patch", d, "--impl", "torch", "--in-place"], ["patch", d, "--impl", "torch", "--out", tmp_path / "o"],
                 ["bench", d, "--load-weights", "--impls", "torch", "--modes", "prefill", "--seq", "4",
                  "--out", tmp_path / "o" / "b.json"]):
        assert_one_line_error(run(*args), says)
        assert _tree(d) == before and not (tmp_path / "o").exists()


def test_convert_refuses_an_integer_stored_layernorm_weight_of_a_base_model_checkpoint(gpt2, tmp_path):
    """convert folds the tensors as stored (shard by shard): an I64 gain was folded and written.
    GPT-2 as on the hub names its tensors without the `transformer.` prefix of the model's."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(gpt2, d)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(d / "model.safetensors").items()}
    tensors["h.0.ln_1.weight"] = (tensors["h.0.ln_1.weight"] * 3).to(torch.int64)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    r = run("convert", d, "--to", "rms", "--out", tmp_path / "o")
    assert_one_line_error(r, "model.safetensors: h.0.ln_1.weight is stored as I64 where GPT2LMHeadModel has a "
                             "floating-point tensor")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("mode", [0o640, 0o600, 0o444], ids=oct)
def test_in_place_rewritten_files_keep_the_mode_of_the_files_they_replace(src, tmp_path, mode):
    """A private model's weights stay private after --in-place (they came out 0644 whatever they
    had been); a file the folder did not hold (normswap.json) follows the umask."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(src, d)
    for name in ("model.safetensors", "config.json"):
        os.chmod(d / name, mode)
    old_umask = os.umask(0o002)
    try:
        r = run("patch", d, "--impl", "torch", "--in-place")
    finally:
        os.umask(old_umask)
    assert r.exit_code == 0, r.stderr
    for name in ("model.safetensors", "config.json"):
        assert (d / name).stat().st_mode & 0o7777 == mode, name
    # a file the folder did not hold: the umask's 0664, but nothing for a class config.json does
    # not let read (the group's write bit stays where the group may read config.json)
    assert (d / "normswap.json").stat().st_mode & 0o7777 == {0o640: 0o660, 0o600: 0o600, 0o444: 0o664}[mode]


def _modes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o7777 for p in [d, *d.iterdir()]}


def _private_copy(model: Path, d: Path) -> None:
    """`model` as a private model: its weights readable by the group only, its other files the
    owner's, its folder shut to others, save a README the owner has made public."""
    import shutil

    from normswap.carry import STOCK_WEIGHTS

    shutil.copytree(model, d)
    (d / "README.md").write_text("public card\n")
    for p in d.iterdir():
        os.chmod(p, 0o640 if STOCK_WEIGHTS.fullmatch(p.name) else 0o644 if p.name == "README.md" else 0o600)
    d.chmod(0o750)


@pytest.mark.parametrize("how", ["patch-out", "patch-out-resharded", "patch-in-place-resharded",
                                 "patch-force-over-a-public-output", "convert-out"])
def test_a_private_models_output_is_no_more_readable_than_the_model(src, gpt2, tmp_path, how):
    """Modes were matched by file name: a file the target did not hold got 0666 less the umask, and
    a copied 0600 one was opened up to it too. So --out of a private model (0640 weights, 0600
    config and tokenizer, a 0750 folder) came out 0664 in a 0775 folder, --max-shard-size's new
    shards (in place too) 0664 beside the 0640 model.safetensors they replaced, and --force over an
    earlier public output kept that output's 0644. Now every file keeps no group/other permission
    its kind lacks in the model (weights: the weights'; a file with a namesake: that file's;
    normswap.json: config.json's), nor the folder the model folder's."""
    from normswap.carry import STOCK_WEIGHTS

    d, out = tmp_path / "m", tmp_path / "out"
    _private_copy(gpt2 if how.startswith("convert") else src, d)
    args = {"patch-out": ["--out", out], "patch-out-resharded": ["--out", out, "--max-shard-size", "50KB"],
            "patch-in-place-resharded": ["--in-place", "--max-shard-size", "50KB"],
            "patch-force-over-a-public-output": ["--out", out, "--force"],
            "convert-out": ["--out", out]}[how]
    if how == "patch-force-over-a-public-output":
        assert run("patch", src, "--impl", "torch", "--out", out).exit_code == 0
        for p in [out, *out.iterdir()]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    old_umask = os.umask(0o002)
    try:
        r = run(*(["convert", d, "--to", "rms"] if how.startswith("convert") else ["patch", d, "--impl", "torch"]),
                *args)
    finally:
        os.umask(old_umask)
    assert r.exit_code == 0, r.stderr
    written = d if how == "patch-in-place-resharded" else out
    modes = _modes(written)
    weights = sorted(n for n in modes if STOCK_WEIGHTS.fullmatch(n))
    assert weights == (["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                        "model.safetensors.index.json"] if "resharded" in how else ["model.safetensors"])
    # the group may read the weights and the folder, so the umask's group write stays on what is
    # new (the replaced public output's 0644 and 0755 have none)
    replaced = how in ("patch-in-place-resharded", "patch-force-over-a-public-output")
    want = {written.name: 0o750 if replaced else 0o770, "README.md": 0o644,
            **{n: 0o640 if how == "patch-force-over-a-public-output" else 0o660 for n in weights},
            **{n: 0o600 for n in ("config.json", "generation_config.json", "normswap.json", "tokenizer.json",
                                  "tokenizer_config.json")}}
    assert {n: oct(m) for n, m in modes.items()} == {n: oct(m) for n, m in want.items()}


def test_a_private_gguf_makes_a_private_output(tmp_path):
    """A .gguf's output (weights, config.json, normswap.json) written 0664 from a 0600 file: the
    GGUF file is the model, weights and config at once, and its read bits bound the folder's."""
    from test_loading import write_tiny_llama_gguf

    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    gguf.chmod(0o600)
    old_umask = os.umask(0o002)
    try:
        r = run("patch", gguf, "--impl", "torch", "--out", tmp_path / "out")
    finally:
        os.umask(old_umask)
    assert r.exit_code == 0, r.stderr
    modes = _modes(tmp_path / "out")
    assert {n: oct(m) for n, m in modes.items()} == {n: oct(0o700 if n == "out" else 0o600) for n in modes}
    assert "model.safetensors" in modes and "normswap.json" in modes


def test_the_staging_folder_is_shut_while_the_run_writes(src, tmp_path):
    """The staging folder was given the output's mode before anything was written, so while a run
    worked, and in what a kill -9 left of it, the new files lay in a 0755 folder, a private model's
    config and carried tokenizer at 0644. It stays mkdtemp's 0700 until the modes are settled."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(src, d)
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT),
               NORMSWAP_TEST_KILL_AT="after-manifest", NORMSWAP_TEST_KILL_SIGNAL="KILL")
    p = subprocess.run([sys.executable, "-m", "normswap", "patch", str(d), "--impl", "torch", "--out",
                        str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    (left,) = [q for q in tmp_path.iterdir() if q.name.startswith(".out.normswap-")]
    assert left.stat().st_mode & 0o777 == 0o700
    assert (left / "normswap.json").is_file()


@pytest.mark.parametrize("command", ["patch", "convert"])
def test_a_readable_models_output_keeps_the_group_bits_the_umask_gives(src, gpt2, tmp_path, command):
    """The bound on an output's modes is on who may read the model, not on its write bits: a model
    of another user's (0644 files in a 0755 folder), written by a group with umask 002, came out
    0644 files in a 0755 folder (037d066 dropped every group bit the model lacked), so the group
    that shares the output could no longer rewrite it (patch --in-place, --force). The umask's 0664
    and 0775 stay, as before 037d066."""
    import shutil

    d, out = tmp_path / "m", tmp_path / "out"
    shutil.copytree(gpt2 if command == "convert" else src, d)
    for p in d.iterdir():
        p.chmod(0o644)
    d.chmod(0o755)
    old_umask = os.umask(0o002)
    try:
        r = run(*(["convert", d, "--to", "rms"] if command == "convert" else ["patch", d, "--impl", "torch"]),
                "--out", out)
    finally:
        os.umask(old_umask)
    assert r.exit_code == 0, r.stderr
    modes = _modes(out)
    # what is written anew (a carried tokenizer keeps its source's 0644, as before 037d066)
    written = ["out", "model.safetensors", "config.json", "normswap.json"]
    assert {n: oct(modes[n]) for n in written} == {n: oct(0o775 if n == "out" else 0o664) for n in written}
