"""fileio.unwritable: the one check, before long work, that a destination can be written (what
`normswap tune` asks of its table and report, `normswap bench` of its results file, `normswap
patch` of its output directory)."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

import pytest

from normswap.errors import NormswapError
from normswap.fileio import LockHeld, LocksUnsupported, path_lock, unwritable, write_text_atomic
from tests.lock_checks import held_by_a_thread, wait_until_someone_waits_on


def test_what_stands_at_the_path_and_the_folder_it_goes_in(tmp_path):
    (tmp_path / "a-file").write_text("x")
    assert unwritable(tmp_path / "new.json") is None
    assert unwritable(tmp_path / "missing" / "deeper" / "new.json") is None  # made on the write
    assert unwritable(tmp_path / "missing", folder=True) is None
    assert unwritable(tmp_path, folder=True) is None  # a directory replaced whole, beside itself
    assert unwritable(tmp_path) == "it is a folder"
    assert unwritable(tmp_path / "a-file" / "t.json") == f"{tmp_path / 'a-file'} is not a folder"
    assert unwritable(tmp_path / "a-file" / "sub", folder=True) == f"{tmp_path / 'a-file'} is not a folder"
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]  # the probe leaves nothing behind


def test_a_folder_the_filesystem_refuses_is_found_even_for_root(tmp_path):
    """/proc takes no new entry although its permission bits let root write: the probe, not the
    bits, decides. And a read-only mount, as the filesystem reports it."""
    assert unwritable(Path("/proc/normswap-t.json")).startswith("/proc is not writable (")
    assert unwritable(Path("/proc/normswap-out"), folder=True).startswith("/proc is not writable (")

    def erofs(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "mkdtemp", erofs)
        assert unwritable(tmp_path / "t.json") == f"{tmp_path} is not writable (Read-only file system)"


@pytest.mark.parametrize("seed", range(3))
def test_a_write_to_a_link_goes_through_it_to_the_file(tmp_path, seed):
    """Every file normswap writes whole (a bench result, a launch table, tune's report, an
    experiment's reports and records) is renamed into place, which replaced a link at the path with
    a regular file: the link gone, the file it led to unchanged. A write goes through the link (a
    chain of them, relative or absolute) to the file it leads to, as cp or a shell's > does and as
    an --out folder given as a link is: the link stays, the file is replaced atomically in its own
    folder, keeping its mode, and no temporary file is left in either folder; unwritable judges
    that file, and probes its folder. A link to nothing, to a folder, to a pipe, or to a file in a
    folder this user may not write is refused, by unwritable before the work and by the write
    itself, each left as it was."""
    import random
    import stat

    from normswap.errors import BadInputError
    from normswap.fileio import replaced_atomically

    rng = random.Random(seed)
    text = "".join(rng.choice("abc\u00e9\n{}") for _ in range(rng.randint(0, 2000)))
    data = rng.randbytes(rng.randint(0, 2000))
    results, links = tmp_path / "results", tmp_path / "links"
    results.mkdir()
    links.mkdir()
    target = results / "2026-11-24.json"
    target.write_text("earlier")
    mode = rng.choice([0o600, 0o640, 0o664])
    target.chmod(mode)
    hops = rng.randint(1, 3)
    chain = [links / f"hop{i}" for i in range(hops)]
    chain[-1].symlink_to(os.path.relpath(target, links) if rng.random() < 0.5 else target)
    for near, far in zip(chain, chain[1:], strict=False):
        near.symlink_to(far.name)
    link = chain[0]
    assert unwritable(link) is None
    assert write_text_atomic(link, text) == link
    assert link.is_symlink() and all(p.is_symlink() for p in chain) and target.read_text() == text
    assert stat.S_IMODE(target.stat().st_mode) == mode
    with replaced_atomically(link, "wb") as f:
        f.write(data)
    assert link.is_symlink() and target.read_bytes() == data
    assert sorted(p.name for p in links.iterdir()) == sorted(p.name for p in chain)
    assert [p.name for p in results.iterdir()] == [target.name]
    # what cannot be written through
    dangling = links / "dangling"
    dangling.symlink_to(tmp_path / "nowhere" / "x.json")
    fifo = results / "pipe"
    os.mkfifo(fifo)
    (links / "to-pipe").symlink_to(fifo)
    (links / "to-folder").symlink_to(results)
    for name, why in (("dangling", f"{dangling} is a link to nothing"), ("to-folder", "it is a folder"),
                      ("to-pipe", "it is not a regular file (a pipe, socket or device); refusing to replace it")):
        assert unwritable(links / name) == why
        with pytest.raises(BadInputError) as refused:
            write_text_atomic(links / name, text)
        assert str(refused.value) == f"cannot write to {links / name}: {why}"
        assert (links / name).is_symlink()
    # a folder itself, as through a link: the rename's own refusal named the temporary file
    with pytest.raises(BadInputError) as refused:
        write_text_atomic(results, text)
    assert str(refused.value) == f"cannot write to {results}: it is a folder"
    assert not (tmp_path / "nowhere").exists() and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in results.iterdir()) == sorted([target.name, "pipe"])


def test_a_link_is_written_through_only_where_its_file_can_be_replaced():
    """The write replaces the file the link leads to, in that file's folder: a link in a folder
    this user may write, to a file (writable by all) in one this user may not, passed unwritable's
    probe of the link's folder and was then written over the link. The probe goes to the file's
    folder. Made in the system's temporary folder: pytest's tmp_path is 0700, which nobody cannot
    pass."""
    import shutil

    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o711)
        links, results = base / "links", base / "results"
        links.mkdir(mode=0o777)
        links.chmod(0o777)
        results.mkdir()
        (results / "r.json").write_text("{}")
        (results / "r.json").chmod(0o666)
        results.chmod(0o555)
        (links / "latest.json").symlink_to(results / "r.json")
        assert _as_a_user_the_bits_bind(lambda: unwritable(links / "latest.json")) == (
            f"{results} is not writable (Permission denied)")
        assert _as_a_user_the_bits_bind(lambda: unwritable(links / "new.json")) is None  # its own folder: fine
    finally:
        (base / "results").chmod(0o755)
        shutil.rmtree(base)


def test_a_link_into_a_folder_this_user_may_not_enter_is_a_reason_not_an_error():
    """A link (bench --out latest.json) to a file in another user's 0700 folder: unwritable, whose
    answer is a reason, raised PermissionError (the link's exists() asked through it), and so did
    the write. Both say the folder that cannot be entered, as for a path that goes through it
    itself; the link is left as it was."""
    import shutil

    from normswap.errors import BadInputError

    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o711)
        links, locked = base / "links", base / "locked"
        links.mkdir()
        links.chmod(0o777)
        locked.mkdir()
        (locked / "r.json").write_text("{}")
        (locked / "r.json").chmod(0o666)
        locked.chmod(0o700)
        link = links / "latest.json"
        link.symlink_to(locked / "r.json")
        why = f"{locked} cannot be entered (Permission denied)"
        assert _as_a_user_the_bits_bind(lambda: unwritable(link)) == why

        def write():
            try:
                write_text_atomic(link, "[]")
            except BadInputError as e:
                return str(e)

        assert _as_a_user_the_bits_bind(write) == f"cannot write to {link}: {why}"
        assert link.is_symlink() and (locked / "r.json").read_text() == "{}"
        assert sorted(p.name for p in links.iterdir()) == ["latest.json"]
    finally:
        (base / "locked").chmod(0o755)
        shutil.rmtree(base)


def test_a_link_to_nothing_on_the_way_is_not_a_folder_to_write_in(tmp_path):
    """exists() calls a dangling link absent, but its name is taken: the folders below it cannot be
    made, so the write would fail after the work (write_text_atomic's mkdir finds the name taken)."""
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    for path in (tmp_path / "link" / "t.json", tmp_path / "link" / "deeper" / "t.json"):
        assert unwritable(path) == f"{tmp_path / 'link'} is a link to nothing"
        with pytest.raises(NotADirectoryError, match="is a link to nothing"):
            write_text_atomic(path, "{}")
    assert unwritable(tmp_path / "link" / "sub", folder=True) == f"{tmp_path / 'link'} is a link to nothing"
    (tmp_path / "nowhere").mkdir()  # the link leads somewhere now: written through it
    assert unwritable(tmp_path / "link" / "deeper" / "t.json") is None
    assert write_text_atomic(tmp_path / "link" / "deeper" / "t.json", "{}").read_text() == "{}"


def test_an_output_path_through_a_link_to_nothing_is_refused(tmp_path):
    """target_path resolved a link to nothing to where it points, so the output went there. Refused,
    naming the link, whether it is the name itself, on the way, or a loop; a link to a folder that is
    there still leads where it points."""
    from normswap.errors import BadInputError
    from normswap.fileio import link_to_nothing, target_path

    (tmp_path / "dangling").symlink_to(tmp_path / "elsewhere" / "x")
    (tmp_path / "loop").symlink_to("loop")
    for given, link in (("dangling", "dangling"), ("dangling/sub", "dangling"), ("loop", "loop"),
                        ("loop/../out", "loop")):
        assert link_to_nothing(tmp_path / given) == tmp_path / link
        with pytest.raises(BadInputError, match="a link to nothing"):
            target_path(tmp_path / given)
        assert unwritable(tmp_path / given) == f"{tmp_path / link} is a link to nothing"
    assert not (tmp_path / "elsewhere").exists()
    (tmp_path / "real").mkdir()
    (tmp_path / "to-real").symlink_to(tmp_path / "real")
    assert link_to_nothing(tmp_path / "to-real" / "out") is None
    assert target_path(tmp_path / "to-real" / "out") == tmp_path / "real" / "out"


def test_a_full_disk_names_the_file_that_could_not_be_written(tmp_path, monkeypatch):
    """A write that fails on a full disk names no file: bench's results file on a full disk ended its
    run with 'normswap: error: No space left on device', after every measurement. The earlier file
    stays, and no temporary file is left."""
    target = tmp_path / "results.json"
    target.write_text("earlier")

    class FullDisk:
        def __init__(self, fd, *args, **kwargs):
            os.close(fd)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", FullDisk)
    with pytest.raises(OSError) as e:
        write_text_atomic(target, "new")
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(target))
    assert target.read_text() == "earlier" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_pipe_or_socket_is_never_replaced_by_a_file(tmp_path):
    """write_text_atomic renames a new file over the name: over a named pipe or a device node (as
    root, /dev/null) that replaced the thing itself. unwritable says so before the work, and the
    write refuses too, whatever its caller asked first."""
    import socket
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        for path in (fifo, sock_path):
            assert unwritable(path) == "it is not a regular file (a pipe, socket or device); refusing to replace it"
            with pytest.raises(NormswapError, match="not a regular file"):
                write_text_atomic(path, "{}")
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe", "sock"]  # no temporary file left beside them


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write a read-only file")
def test_a_read_only_file_is_not_replaced(tmp_path):
    ro = tmp_path / "t.json"
    ro.write_text("{}")
    ro.chmod(0o444)
    assert unwritable(ro) == "it is not writable"


def _as_a_user_the_bits_bind(fn):
    """fn()'s result, computed by a user whom permission bits bind: this process where it is not
    root; as root (the suite runs as root in CI, and root enters any folder), a forked child that
    has given root up for nobody (uid/gid 65534), its answer (or the exception it raised, as text)
    sent back through a pipe. Only os-level work happens in the child."""
    if os.geteuid() != 0:
        return fn()
    import pickle

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                answer = ("ok", fn())
            except BaseException as e:  # noqa: BLE001  (said back to the parent, which fails the test)
                answer = ("raised", repr(e))
            os.write(w, pickle.dumps(answer))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    assert kind == "ok", f"unwritable raised {value}"
    return value


def _read_only_model(folder: Path, text: str) -> None:
    """A model folder its owner made read-only (chmod -R a-w): a subfolder, files, no folder writable."""
    (folder / ".git" / "objects").mkdir(parents=True)
    (folder / "config.json").write_text(text)
    (folder / ".git" / "objects" / "ab").write_text("a blob")
    for d in (folder / ".git" / "objects", folder / ".git", folder):
        d.chmod(0o555)


def test_a_read_only_old_tree_is_removed_after_the_swap():
    """`normswap patch M --in-place` (or --force onto an earlier output) on a folder its owner had
    made read-only (chmod -R a-w): the swap succeeded (it needs only the parent's write bit), exit
    0, but the old tree, model-sized, stayed beside it as .M.normswap-PID-* for good: its entries
    could not be unlinked from folders that may not be written, and rmtree(ignore_errors=True)
    said nothing. remove_tree gives the owner's folders back their write bit first. As nobody
    where root ignores permission bits."""
    import shutil
    import warnings

    from normswap.checkpoint import publish_dir
    from normswap.fileio import remove_tree

    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o777)

        def work():
            _read_only_model(base / "alone", "{}")
            gone = remove_tree(base / "alone")
            _read_only_model(base / "m", '{"old": 1}')
            new = base / ".m.normswap-1-abc"
            new.mkdir()
            (new / "config.json").write_text('{"new": 1}')
            (new / ".git").mkdir()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                publish_dir(new, base / "m", replace=True, in_place=True)
            return (gone, sorted(os.listdir(base)), (base / "m" / "config.json").read_text(),
                    [str(w.message) for w in caught])

        gone, listing, config, warned = _as_a_user_the_bits_bind(work)
        assert gone is None and listing == ["m"] and config == '{"new": 1}' and warned == []
    finally:
        shutil.rmtree(base)


def test_remove_tree_of_a_link_changes_nothing_it_leads_to(tmp_path):
    """remove_tree(LINK) walked the folders the link leads to, after rmtree refused the link, and
    gave them their owner's write bit: a user's read-only model (sub/ 0555) came back 0755. A
    link is refused as rmtree refuses it, and nothing it leads to changes."""
    import stat

    from normswap.fileio import remove_tree

    (tmp_path / "model" / "sub").mkdir(parents=True)
    (tmp_path / "model" / "sub" / "w.bin").write_bytes(b"w")
    (tmp_path / "link").symlink_to(tmp_path / "model")
    for d in (tmp_path / "model" / "sub", tmp_path / "model"):
        d.chmod(0o555)
    try:
        assert isinstance(remove_tree(tmp_path / "link"), OSError)
        assert [oct(stat.S_IMODE(d.stat().st_mode)) for d in (tmp_path / "model", tmp_path / "model" / "sub")] \
            == ["0o555", "0o555"] and (tmp_path / "model" / "sub" / "w.bin").read_bytes() == b"w"
    finally:
        for d in (tmp_path / "model", tmp_path / "model" / "sub"):
            d.chmod(0o755)


def test_an_old_tree_that_cannot_be_removed_is_said(tmp_path, monkeypatch):
    """Where the old tree cannot go even so (another user's folder inside it), a warning names
    where it is: a model-sized hidden folder is never left without a word."""
    from normswap import checkpoint

    monkeypatch.setattr(checkpoint, "remove_tree", lambda p: PermissionError(errno.EACCES, "Permission denied", str(p)))
    (tmp_path / "m").mkdir()
    new = tmp_path / ".m.normswap-1-abc"
    new.mkdir()
    with pytest.warns(UserWarning) as caught:
        checkpoint.publish_dir(new, tmp_path / "m", replace=True, in_place=True)
    [said] = [str(w.message) for w in caught]
    assert said == (f"{tmp_path / 'm'} was replaced, but its old tree could not be removed: {new}: Permission "
                    f"denied; remove {new} yourself")


def test_a_folder_on_the_way_that_cannot_be_entered_is_a_reason_not_an_exception():
    """--out or a results file below a folder this user may not enter (another user's 0700 home):
    unwritable() raised PermissionError from its first look at the path (is_dir), so the
    one-line check before the long work was an OSError instead, naming no folder. It returns the
    reason, naming the folder that cannot be entered. Made in the system's temporary folder, not
    tmp_path: pytest makes that 0700, so as nobody the way would end above the folder under test."""
    import shutil

    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o711)  # nobody may pass through it, not list it
        locked = base / "locked"
        (locked / "sub").mkdir(parents=True)
        locked.chmod(0o000)
        said = f"{locked} cannot be entered (Permission denied)"
        answers = _as_a_user_the_bits_bind(lambda: [
            unwritable(locked / "sub" / "results.json"), unwritable(locked / "sub" / "out", folder=True),
            unwritable(locked / "results.json"), unwritable(locked / "new" / "deeper" / "out", folder=True),
            unwritable(base / "results.json")])
        assert answers[:4] == [said] * 4
        assert answers[4] is not None and answers[4].startswith(f"{base} is not writable")  # passes, may not write
    finally:
        locked.chmod(0o700)
        shutil.rmtree(base)


def test_an_output_below_a_folder_that_cannot_be_entered_is_refused_in_unwritables_words():
    """patch/convert --out /x/locked/sub/o said "/x/locked/sub: Permission denied" (target_path's
    look for a link raised PermissionError), bench --out below the same folder "cannot write to
    ...: /x/locked cannot be entered (Permission denied)". One line now, the same for every command
    with an output (fileio.cannot_write with unwritable's reason), exit 2."""
    import shutil

    from click.testing import CliRunner
    from tiny_models import save_tiny

    from normswap.cli import cli

    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o711)
        save_tiny("gpt2", base / "m")  # a LayerNorm model: convert has work to do
        for p in [base / "m", *(base / "m").iterdir()]:
            p.chmod(0o755 if p.is_dir() else 0o644)  # the model is readable by all: only the output is refused
        locked = base / "locked"
        (locked / "sub").mkdir(parents=True)
        locked.chmod(0o000)
        said = f"{locked} cannot be entered (Permission denied)"

        def runs():
            out = []
            for args in (["patch", base / "m", "--impl", "torch", "--out", locked / "sub" / "o"],
                         ["convert", base / "m", "--to", "rms", "--out", locked / "sub" / "o"],
                         ["patch", base / "m", "--impl", "torch", "--out", locked / "new" / "deeper" / "o"],
                         ["bench", base / "m", "--impls", "torch", "--modes", "prefill", "--seq", "8", "--batch", "1",
                          "--out", locked / "sub" / "o.json"]):
                r = CliRunner().invoke(cli, [str(a) for a in args])
                out.append((r.exit_code, r.stderr))
            return out

        # imported as root: as nobody the child cannot read a Python installed under /root
        import importlib.readers  # noqa: F401  (convert reads its architecture data through it)

        answers = _as_a_user_the_bits_bind(runs)
        want = [f"cannot write to {locked / 'sub' / 'o'}: {said}", f"cannot write to {locked / 'sub' / 'o'}: {said}",
                f"cannot write to {locked / 'new' / 'deeper' / 'o'}: {said}",
                f"cannot write to {locked / 'sub' / 'o.json'}: {said}"]
        assert answers == [(2, f"normswap: error: {line}\n") for line in want]
    finally:
        locked.chmod(0o700)
        shutil.rmtree(base)


def test_a_destination_whose_folders_cannot_be_made_is_refused_in_unwritables_words():
    """Three places built "cannot write to PARENT: REASON" by hand as a NormswapError for a failed
    mkdir (staged_dir's folders and staging folder, experiment --out's folders), worded otherwise
    than the check patch and convert make first ("cannot write to OUT: FOLDER is not writable
    (Permission denied)", a BadInputError): experiment --out ro/new/run said "cannot write to
    ro/new: Permission denied", --out ro/run "cannot create the lock file ro/.run.normswap.lock:
    Permission denied", --out FILE/run "cannot write to FILE: FILE is not a folder", and a library
    caller of staged_dir a NormswapError. Each is the caller's place: fileio.cannot_write's line,
    with unwritable's reason, exit 2, nothing made. As nobody where root ignores permission bits."""
    import shutil

    from click.testing import CliRunner

    from normswap.checkpoint import staged_dir
    from normswap.cli import cli

    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o711)
        ro, file = base / "ro", base / "file"
        ro.mkdir(mode=0o755)  # root's: nobody may not write in it
        file.write_text("")
        (base / "t.txt").write_text("In the beginning\n")
        recipe = base / "r.toml"
        recipe.write_text('name = "t"\nimpl = "torch"\narms = ["original"]\n[model]\npath = "m"\n'
                          '[data]\neval = "t.txt"\ntrain = "t.txt"\n')
        for p in base.iterdir():
            p.chmod(0o755 if p.is_dir() else 0o644)

        def runs():
            out = []
            for where in (ro / "new" / "run", ro / "run", file / "run"):
                r = CliRunner().invoke(cli, ["experiment", str(recipe), "--out", str(where), "--no-progress"])
                out.append((r.exit_code, r.stderr))
            try:
                with staged_dir(ro / "new" / "o"):
                    pass
            except NormswapError as e:
                out.append((type(e).__name__, isinstance(e, ValueError), str(e)))
            return out

        # As root first, where the run goes on to the missing model (and removes the folders it made):
        # what the child imports is imported here (as nobody, a Python installed under /root is unreadable).
        warm = CliRunner().invoke(cli, ["experiment", str(recipe), "--out", str(base / "w" / "run"), "--no-progress"])
        assert warm.exit_code == 2 and "m: no such file or directory" in warm.stderr, warm.output
        answers = _as_a_user_the_bits_bind(runs)
        denied = f"{ro} is not writable (Permission denied)"
        assert answers == [(2, f"normswap: error: cannot write to {ro / 'new' / 'run'}: {denied}\n"),
                           (2, f"normswap: error: cannot write to {ro / 'run'}: {denied}\n"),
                           (2, f"normswap: error: cannot write to {file / 'run'}: {file} is not a folder\n"),
                           ("BadInputError", True, f"cannot write to {ro / 'new' / 'o'}: {denied}")]
        assert sorted(p.name for p in base.iterdir()) == ["file", "r.toml", "ro", "t.txt"] and not any(ro.iterdir())
    finally:
        shutil.rmtree(base)


def test_a_staging_folder_that_cannot_be_made_is_refused_in_unwritables_words(tmp_path, monkeypatch):
    """The mkdir of the staging folder failing (a read-only file system, as root meets it: root
    ignores permission bits) said "cannot write to PARENT: Read-only file system", a NormswapError;
    now cannot_write's line for the target with unwritable's reason (its probe meets the same
    file system), a BadInputError."""
    import errno

    from normswap.checkpoint import staged_dir
    from normswap.errors import BadInputError

    def erofs(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", erofs)
    with pytest.raises(BadInputError) as e, staged_dir(tmp_path / "o"):
        pass
    assert str(e.value) == f"cannot write to {tmp_path / 'o'}: {tmp_path} is not writable (Read-only file system)"
    assert list(tmp_path.iterdir()) == []


class _Failed(Exception):
    pass


def test_made_folders_removes_on_failure_exactly_the_empty_folders_it_made(tmp_path):
    """A failed run with --out a/b/c/out left a/, a/b/ and a/b/c/ behind. Only the folders the
    call made go, deepest first; one that existed stays, and so does one another process put
    something into meanwhile (with every folder above it)."""
    from normswap.fileio import made_folders

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "mine.txt").write_text("the user's")
    with pytest.raises(_Failed), made_folders(tmp_path / "a" / "b" / "c" / "out"):
        assert (tmp_path / "a" / "b" / "c" / "out").is_dir()
        raise _Failed
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["mine.txt"]
    with pytest.raises(_Failed), made_folders(tmp_path / "x" / "y" / "z"):
        (tmp_path / "x" / "y" / "theirs.txt").write_text("another process's")
        raise _Failed
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "a", "a/mine.txt", "x", "x/y", "x/y/theirs.txt"]
    with pytest.raises(KeyboardInterrupt), made_folders(tmp_path / "k" / "l"):  # Ctrl-C, SIGTERM (Terminated)
        raise KeyboardInterrupt
    assert not (tmp_path / "k").exists()
    with made_folders(tmp_path / "ok" / "deep"):  # success keeps them, empty or not
        pass
    assert (tmp_path / "ok" / "deep").is_dir()


def test_made_folders_leaves_a_folder_another_process_made_first(tmp_path, monkeypatch):
    """Between finding b/ missing and making it, another process made it: b/ is theirs, c/ ours."""
    from normswap.fileio import made_folders

    real = Path.mkdir

    def racing(self, *a, **k):
        if self.name == "b":
            real(self)  # the other process, first
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", racing)
    with pytest.raises(_Failed), made_folders(tmp_path / "a" / "b" / "c"):
        raise _Failed
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["a", "a/b"]


def test_a_failed_atomic_write_leaves_no_folder_it_made(tmp_path, monkeypatch):
    """bench and tune write their files through write_text_atomic: a write that fails (a full disk,
    SIGTERM) removes the folders it made for the file."""
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space"):
        write_text_atomic(tmp_path / "a" / "b" / "r.json", "{}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["n" * 250, "é" * 120 + ".json",  # 250 and 245 bytes: legal names
                                  os.fsdecode(b"out-\xff"), os.fsdecode(b"n" * 200 + b"\xff" * 40)])  # not UTF-8
def test_a_long_legal_name_can_be_written(tmp_path, name):
    """The hidden entries beside a target add their tags to its name (`.NAME.normswap-PID-...`,
    `.NAME.normswap.lock`, `.NAME.XXXX.tmp`): for a name near the 255-byte limit they could not be
    made, and a legal --out was refused as "<folder> is not writable (File name too long)". A name
    that is not UTF-8 is a legal one too (sibling_name's str.encode() refused it: a traceback). The
    shortened name is the same in another process: the next run must find this one's lock."""
    import subprocess
    import sys

    from normswap.checkpoint import remove_stale_staging, staged_dir, target_lock

    target = tmp_path / name
    assert unwritable(target) is None and unwritable(target, folder=True) is None
    assert write_text_atomic(target, "x").read_text() == "x"
    target.unlink()
    from normswap.fileio import sibling_name
    stale = tmp_path / f".{sibling_name(name)}.normswap-999999999-abc"  # a killed run's (no such pid)
    stale.mkdir()
    with target_lock(target), staged_dir(target) as tmp:
        (tmp / "config.json").write_text("{}")
        assert len(os.fsencode(sibling_name(name))) <= 100 and sibling_name(name) != sibling_name(name + "x")
    other = subprocess.run([sys.executable, "-c", "import os, sys; from normswap.fileio import sibling_name; "
                            "sys.stdout.write(os.fsencode(sibling_name(os.fsdecode(bytes.fromhex(sys.argv[1])))).hex())",
                            os.fsencode(name).hex()], capture_output=True, text=True, check=True).stdout
    assert bytes.fromhex(other) == os.fsencode(sibling_name(name))
    assert (target / "config.json").read_text() == "{}"
    assert not stale.exists() and remove_stale_staging(target) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no lock file or staging left


@pytest.mark.parametrize("blocker", ["file", "dangling link"])
def test_made_folders_under_a_file_names_what_is_in_the_way(tmp_path, blocker):
    """mkdir -p's own error was 'File exists', which convert (and experiment) reported as 'cannot
    write to notes.txt: File exists', as if the run had tried to write into the user's file."""
    from click.testing import CliRunner

    from normswap.cli import cli
    from normswap.fileio import made_folders

    notes = tmp_path / "notes.txt"
    if blocker == "file":
        notes.write_text("mine")
    else:
        notes.symlink_to(tmp_path / "nowhere")
    why = "is not a folder" if blocker == "file" else "is a link to nothing"
    with pytest.raises(NotADirectoryError, match=f"{notes} {why}"):
        with made_folders(notes / "a" / "b"):
            pass
    if blocker != "file":  # --out resolves through the link: written where it leads, as any --out link is
        return
    from tiny_models import save_tiny

    save_tiny("gpt2", tmp_path / "gpt2")
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "gpt2"), "--to", "rms", "--out", str(notes / "run")])
    assert r.exit_code == 2 and r.stderr.strip() == f"normswap: error: cannot write to {notes / 'run'}: {notes} {why}", r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "notes.txt"]
    assert notes.read_text() == "mine"


def test_a_waiter_locks_the_file_at_the_path_not_the_one_its_holder_removed(tmp_path):
    """path_lock removes its file on release, so a waiter blocked on it is granted a lock on a file
    no longer at the path: it must lock the file there instead, or a third run locks a new file at
    the path and two runs write at once (the launch table's filelock lock had that race)."""
    lock = tmp_path / "t.lock"
    with contextlib.ExitStack() as waiter:
        with path_lock(lock, wait=False):
            assert lock.read_text() == str(os.getpid())
            inside = waiter.enter_context(held_by_a_thread(lock, wait=True))
            wait_until_someone_waits_on(lock)  # in its flock on this file, not yet at the open
        assert inside.wait(60)
        with pytest.raises(LockHeld) as held:
            with path_lock(lock, wait=False):
                pass
        assert held.value.holder == str(os.getpid())
    assert not lock.exists()  # no lock file outlives its holder


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_lock_file_of_another_user_is_locked_read_only(tmp_path, monkeypatch):
    """A lock file another user made (/tmp is shared: tune's per-GPU lock) cannot be opened for
    writing, and in a sticky folder not opened with O_CREAT either: it was 'cannot create the lock
    file ...: Permission denied' both while that user's run held it (instead of 'held') and after a
    kill left it there (no run of ours could ever lock again). flock needs no write access."""
    from normswap import fileio

    lock = tmp_path / "t.lock"
    real = os.open

    def as_another_user(p, flags, *a):
        if Path(p) == lock and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return real(p, flags, *a)

    with path_lock(lock, wait=False):  # the other user's run
        with monkeypatch.context() as m:
            m.setattr(fileio.os, "open", as_another_user)
            with pytest.raises(LockHeld) as held:
                with path_lock(lock, wait=False):
                    pass
        assert held.value.holder == str(os.getpid())
    lock.write_text("4242")  # left by a killed run of theirs
    with monkeypatch.context() as m:
        m.setattr(fileio.os, "open", as_another_user)
        with path_lock(lock, wait=False):
            with pytest.raises(LockHeld) as held:  # held now, by us: a run of theirs is refused
                with path_lock(lock, wait=False):
                    pass
    assert held.value.holder == "4242"  # their file: our pid could not be written into it


def test_a_file_system_without_flock_is_one_line_naming_the_lock(tmp_path, monkeypatch):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    before = _fds()
    with pytest.raises(LocksUnsupported, match=r"^cannot lock .*t\.lock: No locks available$"):
        with path_lock(tmp_path / "t.lock", wait=True):
            pass
    assert _fds() == before
    assert list(tmp_path.iterdir()) == []  # the lock file it made, which no run could ever hold, is gone


def test_a_refused_flock_never_removes_a_lock_file_another_run_holds(tmp_path, monkeypatch):
    """flock's ENOLCK is not only 'this mount has no locks': it is what one NFS client without its
    lock daemon gets while another client, whose locks work, holds the lock (and what a kernel out
    of lock records gives). The refused run removed the lock file whatever it held, so a third run
    made a new one and locked it while the holder still wrote: two writers of one target. Only an
    empty file (made by this run, or by one that has not locked it yet, which then locks again the
    file at the path) is removed; a holder's has its pid."""
    import fcntl

    lock = tmp_path / "t.lock"
    real_flock = fcntl.flock
    with held_by_a_thread(lock, wait=False) as inside:
        assert inside.wait(60)
        monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "No locks available")))
        with pytest.raises(LocksUnsupported):
            with path_lock(lock, wait=True):
                pass
        monkeypatch.setattr(fcntl, "flock", real_flock)
        assert lock.read_text() == str(os.getpid())  # the holder's file is still there
        with pytest.raises(LockHeld):  # and still keeps a third run out
            with path_lock(lock, wait=False):
                pass
    assert not lock.exists()  # removed by its holder on release


def test_a_lock_that_keeps_writers_apart_is_not_skipped_on_a_file_system_without_flock(tmp_path, monkeypatch):
    """Where the lock keeps two writers apart (an --out folder, the user launch table) a file system
    without locks stays one line and exit 2, with nothing written and nothing left: only the built-in
    model's conversion, whose lock just saves duplicated work, goes on without it (test_loading).
    The lock file it made was left beside the target and kept the --out folders made for the run."""
    import fcntl

    from click.testing import CliRunner
    from tiny_models import save_tiny

    from normswap.cli import cli
    from normswap.kernels import launch_table
    from normswap.kernels._common import ROW_BUCKETS

    save_tiny("gpt2", tmp_path / "gpt2")
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.EOPNOTSUPP, "Operation not supported")))
    out = tmp_path / "made" / "out"
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "gpt2"), "--to", "rms", "--out", str(out)])
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.strip().splitlines()[-1] == (f"normswap: error: cannot lock {tmp_path}/made/.out.normswap.lock: "
                                                 "Operation not supported"), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]
    table = tmp_path / "tables" / "launch.json"
    with pytest.raises(LocksUnsupported, match=r"^cannot lock .*launch\.json\.lock: Operation not supported$"):
        launch_table.update(table, "sm_90", [], ROW_BUCKETS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]


def test_an_interrupt_after_the_flock_does_not_keep_the_lock(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) between the flock and the block, while it checks that it locked the file
    at the path: the descriptor leaked and kept the lock, so every later lock of that path in this
    process (a notebook, a library caller) was refused as held, by itself."""
    lock = tmp_path / "t.lock"
    real = os.fstat
    calls = []

    def interrupted(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(fd)

    before = _fds()
    with monkeypatch.context() as m:
        m.setattr(os, "fstat", interrupted)
        with pytest.raises(KeyboardInterrupt):
            with path_lock(lock, wait=False):
                pass
    assert calls and _fds() == before
    with path_lock(lock, wait=False):
        pass


def test_a_holder_removes_only_its_own_lock_file(tmp_path):
    """Someone removes a held lock file by hand and a second run locks a new one at the path: the
    first holder, on release, removed that second run's file, and a third run then locked a third
    file while the second still wrote (two writers)."""
    lock = tmp_path / "t.lock"
    with contextlib.ExitStack() as second:
        with path_lock(lock, wait=False):
            lock.unlink()
            second.enter_context(path_lock(lock, wait=False))
        assert lock.read_text() == str(os.getpid())
        with pytest.raises(LockHeld):
            with path_lock(lock, wait=False):
                pass
    assert not lock.exists()


# A second process taking path_lock(wait=False) on sys.argv[1] where Python has no fcntl.
_LOCK_WITHOUT_FCNTL = """
import sys
import filelock  # the platform's lock is taken before fcntl goes: on Windows it never needs fcntl
sys.modules["fcntl"] = None
from normswap.fileio import LockHeld, path_lock
try:
    with path_lock(sys.argv[1], wait=False):
        print("locked")
except LockHeld as e:
    print("held", repr(e.holder))
"""


def test_without_fcntl_path_lock_still_keeps_threads_and_processes_apart(tmp_path, monkeypatch):
    """Where Python has no fcntl (Windows) path_lock held no lock at all, so its callers ran
    together: a second run on one --out removed the first's staging folder as a killed run's while
    the first wrote into it, two tunes on one launch table dropped each other's entries. There it
    takes the platform's lock (filelock's); fcntl is made absent here, so the lock under filelock is
    its Unix one, and what is shown is path_lock's contract: a second taker, thread or process, is
    refused at once (LockHeld, holder unknown: Windows keeps a held file's bytes from being read) or
    waits, and enters once the first lets go."""
    import subprocess
    import sys
    import threading

    import filelock  # noqa: F401  (imported while fcntl is there, as it is on Windows without it)

    from normswap.checkpoint import target_lock

    monkeypatch.setitem(sys.modules, "fcntl", None)
    with pytest.raises(ImportError):
        import fcntl  # noqa: F401
    lock = tmp_path / "t.lock"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    with contextlib.ExitStack() as waiter:
        with held_by_a_thread(lock, wait=False) as inside:
            assert inside.wait(60)
            with pytest.raises(LockHeld) as held:
                with path_lock(lock, wait=False):
                    pass
            assert held.value.holder == ""
            p = subprocess.run([sys.executable, "-c", _LOCK_WITHOUT_FCNTL, str(lock)], env=env,
                               capture_output=True, text=True, timeout=120)
            assert p.stdout == "held ''\n", p.stderr[-2000:]
            target = tmp_path / "out"
            with held_by_a_thread(lock.parent / ".out.normswap.lock", wait=False) as other_run:
                assert other_run.wait(60)
                with pytest.raises(NormswapError, match=f"^another normswap run is writing {target}; try again"):
                    with target_lock(target):
                        pass
            entered = threading.Event()

            def wait_for_it():
                with path_lock(lock, wait=True):
                    entered.set()

            t = threading.Thread(target=wait_for_it)
            t.start()
            waiter.callback(t.join, 60)
            assert not entered.wait(1.0)  # it waits while the first holds the lock
        assert entered.wait(60)  # and enters once it is let go
    p = subprocess.run([sys.executable, "-c", _LOCK_WITHOUT_FCNTL, str(lock)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.stdout == "locked\n", p.stderr[-2000:]
    with pytest.raises(NormswapError, match=r"^cannot create the lock file .*t\.lock: its folder .*gone does not exist$"):
        with path_lock(tmp_path / "gone" / "t.lock", wait=True):
            pass
    assert not (tmp_path / "gone").exists()


def test_a_lock_whose_folder_is_gone_says_so(tmp_path):
    with pytest.raises(NormswapError, match=r"^cannot create the lock file .*t\.lock: its folder .*gone does not exist$"):
        with path_lock(tmp_path / "gone" / "t.lock", wait=True):
            pass


def test_a_waiter_interrupted_in_its_flock_leaves_the_holders_file(tmp_path):
    """Ctrl-C (SIGTERM is raised the same way) while waiting for the lock: the waiter closes its
    descriptor and goes, and the holder's file stays at the path, still held (a waiter that removed
    it on the way out would let a third run lock a new file beside the holder)."""
    import signal
    import threading

    lock = tmp_path / "t.lock"
    main = threading.get_ident()

    def interrupt_the_waiter():
        wait_until_someone_waits_on(lock)
        signal.pthread_kill(main, signal.SIGINT)

    before = _fds()
    with held_by_a_thread(lock, wait=False) as inside:
        assert inside.wait(60)
        t = threading.Thread(target=interrupt_the_waiter)
        t.start()
        with pytest.raises(KeyboardInterrupt):
            with path_lock(lock, wait=True):
                pass
        t.join(60)
        with pytest.raises(LockHeld):
            with path_lock(lock, wait=False):
                pass
        assert lock.exists()
    assert _fds() == before and not lock.exists()


def test_the_lock_file_is_readable_by_other_users_whatever_the_umask(tmp_path):
    """Under umask 077 the lock file was 0600: another user's run (tune's per-GPU lock in /tmp) could
    not open it even read-only, so it failed with 'Permission denied' instead of being refused
    as held, or waiting."""
    lock = tmp_path / "t.lock"
    old = os.umask(0o077)
    try:
        with path_lock(lock, wait=False):
            assert lock.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


@pytest.mark.parametrize("script, argv, stem", [("discover", [], "discover"),
                                                ("convert", ["--errors"], "convert-errors")])
def test_a_benchmark_script_that_cannot_finish_its_results_file_leaves_the_earlier_one(tmp_path, monkeypatch,
                                                                                         script, argv, stem):
    """benchmarks/discover.py and convert.py wrote their JSON with a plain write_text, which empties
    the file first: a disk that filled mid-write left the earlier run's results file of that day
    half-written. Every results file goes through write_text_atomic. The disk here fills after a
    few characters, whichever way a file under tmp_path is opened for writing; the measurements
    are stand-ins (the scripts' own take minutes)."""
    import datetime as dt
    import io
    import socket
    import sys

    from tests.benchmark_scripts import load_script

    mod = load_script(script)
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    if script == "discover":
        monkeypatch.setattr(mod, "CONFIGS", {"tiny": None})
        monkeypatch.setattr(mod, "measure", lambda name, repeat: {
            "config": name, "params_billion": 0.0, "norms": 1, "converted": 1, "build_s": 0.0, "discover_s": 0.0,
            "discover_cpu_s": 0.0})
    else:
        cols = [f"{p}_{k}" for p in ("fp64", "fp32") for k in ("layernorm", "rms_reference", "rms_patch")]
        monkeypatch.setattr(mod, "logit_errors", lambda: [{"arch": "gpt2", **dict.fromkeys(cols, 0.0)}])
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    earlier = results / f"{stem}-{socket.gethostname()}-{dt.date.today().isoformat()}.json"
    earlier.write_text('{"rows": ["an earlier run"]}\n')

    class FillsUp:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
            return False

        def write(self, text):
            self.f.write(text[:8])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    real_open, real_fdopen = io.open, os.fdopen

    def opening(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return FillsUp(f) if "w" in mode and str(file).startswith(str(tmp_path)) else f

    monkeypatch.setattr(io, "open", opening)
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: FillsUp(real_fdopen(fd, *a, **k)))
    with pytest.raises(OSError, match="No space left"):
        mod.main()
    assert earlier.read_text() == '{"rows": ["an earlier run"]}\n'
    assert [p.name for p in results.iterdir()] == [earlier.name]  # no temporary file left either


def test_patch_and_convert_refuse_a_read_only_out_in_one_wording(monkeypatch):
    """patch made the writability check of --out before its load ("cannot write to OUT: FOLDER is
    not writable (...)"); convert made none, and its refusal came from the lock file when the staged
    write began ("cannot create the lock file /proc/.o.normswap.lock: No such file or directory";
    in a read-only folder "... Permission denied"). Both now go through checkpoint.check_out_target,
    the one check of an --out: the same line, exit 2, before any weight is read. /proc takes no new
    entry even from root; the read-only folder is refused as nobody (root's bits bind no one)."""
    import shutil

    from click.testing import CliRunner
    from tiny_models import save_tiny

    from normswap import loading
    from normswap.cli import cli

    def no_load(*a, **k):
        raise AssertionError("the weights were loaded")

    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o711)
        save_tiny("gpt2", base / "m")  # a LayerNorm model: convert has work to do
        for p in [base / "m", *(base / "m").iterdir()]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        ro = base / "ro"
        ro.mkdir(mode=0o755)  # root's: nobody may not write in it
        monkeypatch.setattr(loading, "from_pretrained_checked", no_load)

        def runs(where):
            def run():
                out = []
                for args in (["patch", base / "m", "--impl", "torch", "--out", where],
                             ["convert", base / "m", "--to", "rms", "--out", where]):
                    r = CliRunner().invoke(cli, [str(a) for a in args])
                    out.append((r.exit_code, r.stderr))
                return out
            return run

        import importlib.readers  # noqa: F401  (imported as root: convert reads its architecture data through it)

        proc = Path("/proc/normswap-o")
        [(patch_rc, patch_says), (convert_rc, convert_says)] = runs(proc)()
        assert (patch_rc, convert_rc) == (2, 2) and patch_says == convert_says, (patch_says, convert_says)
        assert patch_says.startswith(f"normswap: error: cannot write to {proc}: /proc is not writable (")
        answers = _as_a_user_the_bits_bind(runs(ro / "o"))
        want = f"normswap: error: cannot write to {ro / 'o'}: {ro} is not writable (Permission denied)\n"
        assert answers == [(2, want), (2, want)]
        assert not any(ro.iterdir())
    finally:
        shutil.rmtree(base)
