"""Writing a file so that no reader, and no other writer, ever sees it half-written: the one
atomic write every results file, report, manifest and launch table goes through (a link at the
path written through, to the file it leads to), the umask that
files made through temporary names are given back, the one check, made before any long work,
that a destination can be written at all, the refusal of an empty output path, and the missing
folders of an output path made for a run and removed again when it fails (made_folders), the
removal of a tree that is normswap's to remove, read-only folders in it included (remove_tree),
the one lock file that serialises two writers of one path (path_lock), and the renames that
replace nothing or swap two folders in one step (rename_noreplace, exchange_dirs: checkpoint's
publish, the built-in model's cache entry)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import glob
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from normswap.errors import BadInputError, NormswapError, one_line, option_labels

RENAME_NOREPLACE = 1  # linux/fs.h
RENAME_EXCHANGE = 2
RENAME_SWAP = 2  # macOS sys/stdio.h
RENAME_EXCL = 4


def _rename_with_flags(a: Path, b: Path, linux_flag: int, macos_flag: int) -> bool:
    """rename(a, b) with renameat2/renamex_np flags. False when the OS or filesystem offers no such
    call; an OSError (FileExistsError for a target that must not be replaced) when it failed."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fa, fb = os.fsencode(str(a)), os.fsencode(str(b))
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        AT_FDCWD = -100
        rc = libc.renameat2(AT_FDCWD, fa, AT_FDCWD, fb, linux_flag)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rc = libc.renamex_np(fa, fb, macos_flag)
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # old kernel or a filesystem without it
        return False
    raise OSError(err, os.strerror(err), str(b))


def exchange_dirs(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries. False when the OS offers no way to do it."""
    return _rename_with_flags(a, b, RENAME_EXCHANGE, RENAME_SWAP)


def rename_noreplace(src: Path, dst: Path) -> None:
    """Move `src` to `dst` only if nothing is at `dst`; FileExistsError otherwise. Where the OS has
    no such call, plain rename(2) stands in: for directories it fails on a non-empty target, so the
    most it can replace is an empty directory (never another run's result or a user's files)."""
    try:
        if _rename_with_flags(src, dst, RENAME_NOREPLACE, RENAME_EXCL):
            return
        os.rename(src, dst)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
            raise FileExistsError(e.errno, "already exists", str(dst)) from None
        raise


# What a hidden sibling's name keeps of the name it is made for: a name may take 255 bytes, and the
# staging folder, the lock file and the temporary file beside it add their own tags to it.
_SIBLING_NAME_BYTES = 100


def sibling_name(name: str) -> str:
    """`name` as the hidden entries beside it (`.NAME.normswap.lock`, `.NAME.normswap-PID-...`, a
    temporary file) spell it: as it is, or a long one shortened and told apart by a hash of it (a
    legal 240-byte --out was refused as "not writable (File name too long)"). Deterministic: the
    next run on the same name finds the same lock and a killed run's staging folder."""
    # Counted as the bytes the file system stores: os.fsencode, since a name that is not UTF-8
    # (b"out-\xff") reaches Python with surrogates, which a plain str.encode() refuses.
    if len(os.fsencode(name)) <= _SIBLING_NAME_BYTES:
        return name
    import hashlib

    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:12]
    short = name
    while len(os.fsencode(short)) > _SIBLING_NAME_BYTES - 13:
        short = short[:-1]
    return f"{short}~{digest}"


def umask() -> int:
    """The process umask (only readable by setting it: set and restored at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically (replaced_atomically: through a temporary file of its
    own, renamed into place; through a link, over the file it leads to). Returns `path`."""
    with replaced_atomically(path) as f:
        f.write(text)
    return Path(path)


@contextlib.contextmanager
def replaced_atomically(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """A temporary file opened for the block (`mode`: "w" text, "wb" bytes) to write the new
    `path` into, closed and renamed into place when the block succeeds (removed when it fails):
    the one atomic write of every file normswap writes whole. Its own name: two writers of one
    path (two `normswap tune` on one user table, two benches into one results file) must never
    share a temporary name, or one renames the other's half-written file into place and then
    finds its own gone. The file keeps the mode of the one it replaces; a new one gets what a
    plain open would give it (0666 less the umask), not mkstemp's 0600. `path` a link to a file:
    the write goes through it (written_at)."""
    path = Path(path)
    # the last guards: a caller that asked unwritable first never gets here
    if _leads_nowhere(path):  # (one on the way: made_folders says it)
        raise cannot_write(path, f"{path} is a link to nothing")
    target = written_at(path)
    if why := _unreachable(target):  # a link into a folder this user may not enter: is_dir raised
        raise cannot_write(path, why)
    if target.is_dir():  # the rename's own refusal named the temporary file: "Is a directory: '.f.x.tmp' -> 'f'"
        raise cannot_write(path, "it is a folder")
    if why := _not_replaceable(target):
        raise cannot_write(path, why)
    with made_folders(target.parent):
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{sibling_name(target.name)}.", suffix=".tmp")
        try:
            with os.fdopen(fd, mode) as f:
                yield f
            os.chmod(tmp, stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o666 & ~umask())
            os.replace(tmp, target)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError) and e.filename is None and e.strerror:
                # a write or close (a full disk) names no file: the error said only "No space left on device"
                raise OSError(e.errno, e.strerror, str(path)) from None
            raise


def written_at(path: str | os.PathLike) -> Path:
    """The file a write to `path` replaces: `path`, or where `path` is a symbolic link (or a chain
    of them) the file it leads to. The rename into place replaces a name: `bench --out latest.json`,
    latest.json a link to an earlier result, left a regular file where the link was and the result
    it led to as it was. Written through instead, as cp, an editor or a shell's `>` write through a
    link, and as an --out folder given as a link is (target_path): the link stays, the file it leads
    to is replaced, atomically, in its own folder. What it leads to is then what is judged: a
    folder, a pipe or device (_not_replaceable), a file this user may not write. A link to nothing
    (link_to_nothing) names no file: refused by every writer, as target_path refuses it."""
    path = Path(path)
    return path.resolve() if path.is_symlink() else path


@contextlib.contextmanager
def made_folders(folder: str | os.PathLike) -> Iterator[None]:
    """Make `folder` and the missing folders above it (mkdir -p) for the block; when the block
    fails (an error, a refused verification, Ctrl-C, SIGTERM) remove again exactly the folders
    this call made, deepest first, each only while it is empty: a folder that existed before, or
    one another process made first or has put something into meanwhile, is left alone (and with
    it every folder above). A run whose `--out a/b/c/out` failed left a/, a/b/ and a/b/c/ behind."""
    p, missing = _nearest_present(Path(folder))
    if why := _not_a_folder(p):  # mkdir -p's own error, "File exists", read as if the run had tried to write into that file
        raise NotADirectoryError(errno.ENOTDIR, why, str(p))
    made = []
    try:
        for p in reversed(missing):
            try:
                p.mkdir()
            except FileExistsError:
                if not p.is_dir():
                    raise
                continue  # made by another process meanwhile: not this run's to remove
            made.append(p)
        yield
    except BaseException:
        for p in reversed(made):
            try:
                os.rmdir(p)  # only an empty folder: never what another process put there
            except OSError:
                break
        raise


def remove_tree(path: str | os.PathLike) -> OSError | None:
    """Remove `path`, a tree that is normswap's to remove (a staging folder, or the old tree an
    --in-place or --force publish swapped out), whatever its folders' modes; None once it is gone,
    else the error that kept it. A folder's entries cannot be removed while it may not be written
    (chmod -R a-w on a model: its copy in a staging folder, or the old tree after the swap, keeps
    the modes), so where the plain removal fails, the tree's folders are given their owner's
    read, write and search bits (this process owns them, or nothing changes) and it is removed
    again. shutil.rmtree(ignore_errors=True) left such a tree, model-sized, and said nothing.
    Links are never followed."""
    try:
        shutil.rmtree(path)
        return None
    except FileNotFoundError:
        return None
    except OSError:
        pass
    folders = [os.fspath(path)]
    while folders:
        folder = folders.pop()
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode):
                continue  # `path` a link: scandir and chmod would act on the folders it leads to
            mode = stat.S_IMODE(st.st_mode)
            if mode & stat.S_IRWXU != stat.S_IRWXU:
                os.chmod(folder, mode | stat.S_IRWXU)
            with os.scandir(folder) as entries:
                folders.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
        except OSError:
            continue  # not ours, or gone: the removal below says what is left
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return e
    return None


def _nearest_present(folder: Path) -> tuple[Path, list[Path]]:
    """The nearest of `folder` and the folders above it that is there, and the missing ones below it,
    deepest first. A link to nothing stops the walk: the missing folders cannot be made through it
    (mkdir finds the link's name taken), though exists() calls it absent."""
    missing = []
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return folder, missing


def _not_a_folder(p: Path) -> str | None:
    """Why the missing folders cannot be made under `p` (a file or a link to nothing holds its name)."""
    if p.is_dir():
        return None
    return f"{p} is a link to nothing" if p.is_symlink() else f"{p} is not a folder"


def unwritable(path: str | os.PathLike, *, folder: bool = False) -> str | None:
    """Why `path` (a file, or with folder=True a directory) cannot be written, None when it can;
    asked before minutes of work whose result would otherwise be lost. A file must not have a
    folder in its place, nor be one this user may not write (a read-only file is one not to
    replace). Where it goes (its folder, or the nearest one that exists: missing ones are made on
    the write) must be a folder that takes a new entry, which is probed by making and removing a
    directory there: permission bits would pass root on a mount that refuses every write (/proc, a
    read-only filesystem). Writes go through a temporary entry beside the path, renamed into place
    (write_text_atomic, checkpoint.staged_dir), so that folder is what they need."""
    path = Path(path)
    if why := _unreachable(path):
        return why
    if (link := link_to_nothing(path)) is not None:
        return f"{link} is a link to nothing"
    if not folder:
        path = written_at(path)  # what a write replaces, in its own folder
        if why := _unreachable(path):  # a link into a folder this user may not enter (_unreachable asked the link's way)
            return why
        if path.is_dir():
            return "it is a folder"
        if why := _not_replaceable(path):
            return why
        if path.exists() and not os.access(path, os.W_OK):
            return "it is not writable"
    parent, _missing = _nearest_present(path.parent)
    if why := _not_a_folder(parent):
        return why
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{sibling_name(path.name)}.normswap-probe-", dir=parent))
    except OSError as e:
        return f"{parent} is not writable ({e.strerror or e})"
    return None


def _not_replaceable(path: Path) -> str | None:
    """Why a file written to `path` must not be renamed over what stands there: something that is not
    a regular file. The rename replaces the name, not the thing: as root, `bench --out /dev/null`
    left a regular file of numbers where the null device was (every later `> /dev/null` on the
    machine filled it), and a named pipe a user's reader was attached to went the same way."""
    if path.exists() and not path.is_file() and not path.is_dir():
        return "it is not a regular file (a pipe, socket or device); refusing to replace it"
    return None


def cannot_write(path: str | os.PathLike, why: str) -> BadInputError:
    """The one line for a destination that cannot be written, `why` as unwritable says it
    ("cannot write to /x/locked/sub/out: /x/locked cannot be entered (Permission denied)")."""
    return BadInputError(f"cannot write to {path}: {why}")


def check_writable(target: Path, *, folder: bool) -> None:
    """Refuse, in cannot_write's line, a destination that cannot be written: before the long load
    or measurement (api's patch and bench, checkpoint.check_out_target for every --out)."""
    if why := unwritable(target, folder=folder):
        raise cannot_write(target, why)


def cannot_make(target: str | os.PathLike, error: OSError) -> BadInputError:
    """cannot_write for a destination folder `target` whose making failed (the folders above it,
    made_folders; its staging folder beside it), in the words of the check before the work
    (unwritable: a folder that cannot be entered, one not writable, a file in the way), or the
    error's own where unwritable finds nothing wrong (the place changed since it looked). Every
    such failure is the place the caller chose, not the run's fault: bad input, as unwritable's are."""
    return cannot_write(target, unwritable(target, folder=True) or one_line(error))


def _unreachable(path: Path) -> str | None:
    """Why the way to `path` cannot be taken: a folder on it that this user may not enter (a
    private home, a 0700 folder of another user's). Each entry on the way is asked of the file
    system as written (lstat), as link_to_nothing does; the questions unwritable asks next
    (is_dir, exists) raised PermissionError instead of saying so."""
    path = path.absolute()
    for p in (*reversed(path.parents), path):
        try:
            os.lstat(p)
        except PermissionError as e:
            return f"{p.parent} cannot be entered ({e.strerror or e})"
        except OSError:
            return None  # missing (made on the write), a file or a loop in the way: said by what follows
    return None


def target_path(out: str | os.PathLike, what: str = "directory") -> Path:
    """The absolute path of an output target (`what`: directory or file, for the message), refusing
    an empty or blank one: Path("") is the current directory, and an unset shell variable passed
    as --out "$OUT" would write (or with --force, replace) whatever directory the user happens to
    be in."""
    if not isinstance(out, str | os.PathLike):  # Path(5): pathlib's "expected str, bytes or os.PathLike object"
        label = option_labels(("out",))["out"]
        raise TypeError(f"{label}: expected the output {what}'s path (str or path), got {type(out).__name__}")
    if not str(out).strip():
        raise BadInputError(f"the output {what} is empty; pass a {what} name")
    path = Path(out).expanduser()
    # the questions below (is it a link?) raised PermissionError below another user's 0700 folder:
    # "/x/locked/sub: Permission denied", worded otherwise than unwritable's reason
    if why := _unreachable(path):
        raise cannot_write(path.absolute(), why)
    # resolve() follows a link to nothing to where it points: --out LINK wrote the output at the
    # link's target (made its missing folders, /nonexistent/x included), not at the name given.
    if (link := link_to_nothing(path)) is not None:
        where = "is" if link == path.absolute() else f"leads through {link},"
        raise BadInputError(f"the output {what} {out} {where} a link to nothing (-> {os.readlink(link)}); "
                            "refusing to write where it points: remove the link, or name the place itself")
    return path.resolve()


def link_to_nothing(path: str | os.PathLike) -> Path | None:
    """The first entry on the way to `path`, `path` itself included, that is a symbolic link leading
    nowhere (to a missing path, or round in a loop), None when there is none. Each step is asked of
    the file system as written, so a `..` after a link goes where the kernel takes it."""
    path = Path(path).absolute()
    for p in (*reversed(path.parents), path):
        if _leads_nowhere(p):
            return p
    return None


def _leads_nowhere(p: Path) -> bool:
    """`p` is a symbolic link to a missing path or round in a loop. One into a folder this user may
    not enter leads somewhere (_unreachable says where the way stops): exists() raised
    PermissionError for it, where unwritable is to give its reason."""
    if not p.is_symlink():
        return False
    try:
        os.stat(p)
    except PermissionError:
        return False
    except OSError:
        return True
    return False


# What flock gives where the file system has no locks at all (not a held lock): an NFS mount whose
# lock daemon is missing (ENOLCK), some SMB/CIFS and FUSE mounts (EOPNOTSUPP, ENOSYS).
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


class LocksUnsupported(NormswapError):
    """path_lock found no locks on the lock file's file system. Its one line, `cannot lock PATH:
    REASON`, is the error where the lock keeps two writers of one file or folder apart; a caller
    whose lock only saves duplicated work (the built-in model's first-use conversion, which
    publishes atomically anyway) may go on without it."""


class LockHeld(Exception):
    """path_lock(wait=False) found the lock held; `holder` is the pid its holder wrote ("" unknown)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


@contextlib.contextmanager
def path_lock(path: str | os.PathLike, *, wait: bool) -> Iterator[None]:
    """Hold an exclusive flock on the file `path` for the block (made if missing; the holder's pid
    written into it), waiting for another holder (`wait`) or raising LockHeld at once. The file is
    removed on release, while still locked, so no lock file outlives its run (a stray one would
    keep made_folders from removing the folder it made). Because a holder removes it, a process
    that opened the file just before may end up locking an unlinked file: after the flock it checks
    that the file at `path` is the one it locked, else it locks again the file now there. Opened
    without following links: a link planted at the name (often a shared folder or /tmp) would have
    the pid written over the file it points at. Another user's lock file (one we may not write, or,
    in a sticky folder such as /tmp, not open to create) is locked read-only: flock needs no write
    access, and that user's run and ours still exclude each other. No flock (Windows): the
    platform's lock through the filelock package (_lock_without_flock).
    A file system without locks is LocksUnsupported (a NormswapError), any other failure of the
    flock a NormswapError: `cannot lock PATH: REASON`."""
    path = Path(path)
    try:
        import fcntl
    except ImportError:
        with _lock_without_flock(path, wait=wait):
            yield
        return
    while True:
        fd = _open_lock_file(path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                raise LockHeld(holder if holder.isdigit() else "") from None
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    raise NormswapError(f"cannot lock {path}: {e.strerror or e}") from None
                # Left, a lock file would keep made_folders from removing its folder; but ENOLCK is
                # also what one NFS client without its lock daemon gets while another, whose locks
                # work, holds the lock: a holder's file (its pid written) stays, or a third run would
                # make a new one and lock it beside the holder. An empty one is this run's, or one
                # whose taker locks again the file at the path after its flock (the loop below).
                if os.fstat(fd).st_size == 0 and _same_file(path, fd):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                raise LocksUnsupported(f"cannot lock {path}: {e.strerror or e}") from None
            if _same_file(path, fd):
                break
        except BaseException:  # held, refused, or interrupted (Ctrl-C, SIGTERM) while waiting
            os.close(fd)
            raise
        os.close(fd)  # released and removed by its holder meanwhile: lock the file now there
    try:
        with contextlib.suppress(OSError):  # opened read-only: another user's file keeps its pid
            pid = str(os.getpid()).encode()
            os.pwrite(fd, pid, 0)  # before the truncation: a held file is never empty (see above)
            os.ftruncate(fd, len(pid))
        yield
    finally:
        try:
            if _same_file(path, fd):  # never a file someone else put at the path after removing ours
                with contextlib.suppress(OSError):
                    os.unlink(path)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _lock_without_flock(path: Path, *, wait: bool) -> Iterator[None]:
    """path_lock where Python has no fcntl (Windows): filelock's lock for the platform (LockFileEx on
    Windows), a package torch already requires. Without it path_lock held nothing there, and its
    callers rely on the exclusion, not only on saving work: a second run on one --out removed the
    first's staging folder as a killed run's while the first wrote it, two tunes on one table
    dropped each other's entries, two experiments trained into one pretraining folder. filelock's
    Windows lock removes its file on release (where no other process has it open; that one holds
    the lock next and removes it). Windows locks a held file's bytes against reading, so a refused
    run cannot read the holder's pid there: LockHeld("") (unknown)."""
    import filelock

    if not path.parent.is_dir():  # filelock would make the folders (made_folders' job, with their removal)
        raise NormswapError(f"cannot create the lock file {path}: its folder {path.parent} does not exist")
    lock = filelock.FileLock(str(path))
    try:
        lock.acquire(timeout=-1 if wait else 0)  # 0: one try; -1: until it is free (Ctrl-C still ends the wait)
    except filelock.Timeout:
        raise LockHeld("") from None
    except OSError as e:
        raise NormswapError(f"cannot lock {path}: {e.strerror or e}") from None
    try:
        yield
    finally:
        lock.release()


def _same_file(path: Path, fd: int) -> bool:
    try:
        at = os.lstat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (at.st_dev, at.st_ino) == (held.st_dev, held.st_ino)


def _open_lock_file(path: Path) -> int:
    """The lock file at `path` opened for writing (made if missing, readable by all whatever the
    umask: another user's run must be able to open it to be refused, or to wait), or read-only
    where it is another user's; never through a link. One line where it can be neither."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | nofollow, 0o644)
    except OSError as e:
        refused = e
    else:
        with contextlib.suppress(OSError):  # not ours to change where another user made it
            os.fchmod(fd, 0o644)
        return fd
    if isinstance(refused, PermissionError):
        with contextlib.suppress(OSError):
            return os.open(path, os.O_RDONLY | nofollow)
    if path.is_symlink():
        raise NormswapError(f"the lock file {path} is a symbolic link; refusing to follow it "
                            "(remove it if no normswap run is using it)")
    if not path.parent.is_dir():
        raise NormswapError(f"cannot create the lock file {path}: its folder {path.parent} does not exist")
    try:
        owner = os.lstat(path).st_uid
    except OSError:
        raise NormswapError(f"cannot create the lock file {path}: {refused.strerror or refused}") from None
    theirs = f" (another user's, uid {owner})" if owner != getattr(os, "getuid", lambda: owner)() else ""
    raise NormswapError(f"cannot open the lock file {path}{theirs}: {refused.strerror or refused}")


def staging_prefix(target: Path) -> str:
    return f".{sibling_name(target.name)}.normswap-"


def aside_prefix(target: Path) -> str:
    """The name publish_dir's fallback moves the old tree to, PID-XXXXXXXX after it (never a staging
    folder's name: those are PID-XXXXXXXX right after staging_prefix)."""
    return f"{staging_prefix(target)}old-"


def ours_beside(target: Path, prefix: str) -> list[Path]:
    """The folders beside `target` named `prefix` + PID-XXXXXXXX, as mkdtemp names this module's:
    not another target's whose name starts alike (target "m.normswap-1-x" stages in
    ".m.normswap-1-x.normswap-PID-...", under its own lock), nor a link. The prefix is matched as
    text (a target named "m[1]" was a glob pattern matching "m1" instead: its staging folders were
    never found)."""
    found = []
    for p in target.parent.glob(glob.escape(prefix) + "*"):
        if re.fullmatch(r"\d+-[a-z0-9_]+", p.name[len(prefix):]) and p.is_dir() and not p.is_symlink():
            found.append(p)
    return sorted(found)


def last_moved(asides: list[Path]) -> Path:
    return max(asides, key=lambda p: (p.stat().st_ctime_ns, p.name))


def left_aside(target: str | os.PathLike) -> Path | None:
    """Where a run killed between publish_dir's fallback renames left the missing `target` (what
    recover_interrupted_publish would put back), or None: for the line of a command that only
    reads it (scan, ppl, patch without --out), which said "no such file or directory" and not
    where the model is; the recovery itself is a writing run's, under the target's lock."""
    target = Path(target).expanduser().absolute()
    if os.path.lexists(target):
        return None
    try:
        asides = ours_beside(target, aside_prefix(target))
        return last_moved(asides) if asides else None
    except OSError:  # an unreadable folder, or one moved meanwhile: the plain line stands
        return None
