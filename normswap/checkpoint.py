"""Saving a patched model as a stock checkpoint, without ever losing the user's data.

The layout written is exactly what transformers' own `save_pretrained` writes for the ORIGINAL
architecture (sharded safetensors, shared/tied tensors handled, config and generation config),
plus the files carried over from the source (carry.py: tokenizer, chat template, README, custom code) and
`normswap.json` (see manifest.py). Stock transformers loads it; `normswap.load` re-applies the patch.

Safety protocol (every step can be killed and the target still holds a loadable checkpoint):
  1. write everything into a fresh hidden directory beside the target (same filesystem);
  2. reload it there with stock transformers and check its outputs against the expected ones;
  3. publish: without permission to replace, a rename that cannot replace anything (Linux
     renameat2(RENAME_NOREPLACE), macOS renamex_np(RENAME_EXCL); elsewhere rename(2), which fails
     on a non-empty directory), so of two runs racing for one --out the second fails with
     "already exists" instead of silently replacing the first's result. With permission (--force,
     --in-place) an existing target is swapped in one atomic exchange (Linux
     renameat2(RENAME_EXCHANGE), macOS renamex_np(RENAME_SWAP)), after which the old tree, now at
     the hidden name, is removed. Elsewhere the fallback is two renames (target aside, new into
     place): a kill between them leaves the complete old checkpoint at the hidden
     `.NAME.normswap-old-PID-*` name, never a partial one, and the next run on that target puts it
     back (recover_interrupted_publish).
A kill leaves at worst a stale hidden directory beside the target (the next run on that target
removes it: every run makes its own under the target's lock, so the holder knows any other is a dead run's), never a broken target.

What may be replaced at all (check_replaceable): only an empty directory, a model checkpoint or an
earlier normswap output; never an arbitrary directory, the current directory (or one holding it),
a home directory or a filesystem root, whatever --force says, nor one holding a folder the new
tree would not hold (the old tree is removed whole after the swap: a .git, a trainer's
checkpoint-500/ would go with it). Runs that write one target are
serialised by an flock(2) on a lock file beside it (target_lock): not inside it, because the
directory itself is exchanged and a lock inside would move with the old tree.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import stat
import tempfile
import threading
import warnings
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from normswap.carry import STOCK_WEIGHTS, carried_folders, carry_over, real_folders
from normswap.errors import (
    BadInputError,
    Metavar,
    NormswapError,
    one_line,
    option_labels,
    option_setting,
    way_out,
)
from normswap.fileio import (
    LockHeld,
    aside_prefix,
    cannot_make,
    check_writable,
    exchange_dirs,
    last_moved,
    link_to_nothing,
    made_folders,
    ours_beside,
    path_lock,
    remove_tree,
    rename_noreplace,
    sibling_name,
    staging_prefix,
    target_path,
    umask,
)
from normswap.manifest import carried_record, recorded_carried_folders
from normswap.progress import ProgressFn, step


def _kill_point(stage: str) -> None:
    """Test hook: NORMSWAP_TEST_KILL_AT=<stage> makes the process SIGKILL itself right here (or send
    itself NORMSWAP_TEST_KILL_SIGNAL, e.g. TERM), so the kill-during-save test can hit every step
    of the protocol, not only random instants."""
    if os.environ.get("NORMSWAP_TEST_KILL_AT") == stage:
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("NORMSWAP_TEST_KILL_SIGNAL", "KILL")))


def publish_dir(tmp: Path, target: Path, replace: bool = False, in_place: bool = False) -> None:
    """Move the finished `tmp` to `target`. An existing target is replaced (atomically) only with
    `replace`, and only if check_replaceable allows it at this very moment; without it, a target
    that appeared while this run worked (another run published first) is an error, never lost."""
    try:
        rename_noreplace(tmp, target)
        return
    except FileExistsError:
        if not replace:
            raise NormswapError(f"{target} already exists (another run wrote it while this one worked?); "
                                "nothing was published") from None
    # it may have changed since the run started; the old tree's folders must all be in the new one
    check_replaceable(target, in_place=in_place, keeps=real_folders(tmp))
    _kill_point("before-exchange")
    if exchange_dirs(tmp, target):
        _kill_point("after-exchange")
        _remove_old_tree(tmp, target)  # tmp now holds the old tree
        return
    # Fallback (no atomic exchange on this OS/filesystem): a window between two renames in which
    # `target` is missing, but the complete old tree is at `aside` the whole time. The aside's name
    # is normswap's own (aside_prefix), so that the next run on this target recognises it
    # (recover_interrupted_publish: put back where the target is missing, else removed); once the
    # new tree is in place the old one moves to the staging folder's free name, where the exchange
    # leaves it, so that a kill during its removal leaves a staging folder (remove_stale_staging's),
    # never a part of a tree under the aside's name, which the next run could put back.
    aside = Path(tempfile.mkdtemp(prefix=f"{aside_prefix(target)}{os.getpid()}-", dir=target.parent))
    os.rmdir(aside)
    os.replace(target, aside)
    _kill_point("fallback-aside")
    os.replace(tmp, target)
    _kill_point("fallback-published")
    os.replace(aside, tmp)
    _remove_old_tree(tmp, target)


def _remove_old_tree(old: Path, target: Path) -> None:
    """The replaced tree goes; where it cannot (another user's folder in it), a warning names where
    it is and why it stayed: a hidden model-sized copy is never left without a word."""
    if error := remove_tree(old):
        warnings.warn(f"{target} was replaced, but its old tree could not be removed: {one_line(error)}; "
                      f"remove {old} yourself", stacklevel=2)


def is_checkpoint_dir(directory: Path) -> bool:
    """A model checkpoint or a normswap output: a normswap.json, stock weight files, or a
    config.json that names a model type (not any project's config.json)."""
    try:
        names = {p.name for p in directory.iterdir()}
    except OSError:
        return False
    if "normswap.json" in names or any(STOCK_WEIGHTS.fullmatch(n) for n in names):
        return True
    if "config.json" in names:
        from normswap import jsonsafe

        try:
            cfg = jsonsafe.read(directory / "config.json")
        except (OSError, ValueError):
            return False
        return isinstance(cfg, dict) and bool(cfg.get("model_type") or cfg.get("architectures"))
    return False


def check_replaceable(target: Path, in_place: bool = False, *, keeps: Collection[str] | None = None) -> None:
    """Refuse (one line, with the reason) to replace a directory that is not ours to replace.

    --force replaces only an empty directory, a model checkpoint or an earlier normswap output;
    never a filesystem root, a home directory, or the current directory or one that holds it (the
    user's shell would be left in a deleted directory, and the files there with it), whatever
    their contents, nor a mount point (a docker volume: a rename cannot move it). in_place: the
    model's own directory, whose other files are all carried over; only the root, home and mount
    point rules apply.

    keeps: the folders the new tree holds (carry.carried_folders before the write, the staging
    folder's at the publish). The old tree is removed whole after the swap, so --force refuses one
    that holds a folder the new tree does not: a cloned hub repository's .git, a trainer's
    checkpoint-500/ (optimizer states), runs/ (logs) are the user's, not an earlier output's. An
    earlier normswap output of the same source holds only folders the new one holds too. None: not
    known yet (the publish checks it)."""
    if not target.exists():
        return
    if not target.is_dir() or target.is_symlink():
        raise NormswapError(f"{target} exists and is not a directory; refusing to replace it")
    if target.parent == target:
        raise NormswapError(f"{target} is a filesystem root; refusing to replace it")
    if target == Path.home().resolve():
        raise NormswapError(f"{target} is the home directory; refusing to replace it")
    mounts = mount_points_within(target)
    if target in mounts or os.path.ismount(target):
        # a rename cannot move a mount point (EBUSY): found only after the whole model was saved
        raise NormswapError(f"{target} is a mount point, which no directory can be swapped for; "
                            + (_save_elsewhere() if in_place else "write to a folder inside it, or elsewhere"))
    if mounts:
        # the old tree's removal after the swap would go down into it and delete that filesystem's files
        raise NormswapError(f"{target} holds a mount point ({mounts[0]}): replacing the folder would delete what is "
                            "on that other filesystem; " + (_save_elsewhere() if in_place else "write elsewhere"))
    if in_place:
        return
    cwd = Path.cwd().resolve()
    if cwd.is_relative_to(target):
        what = "the current directory" if cwd == target else f"a directory that holds the current directory {cwd}"
        raise NormswapError(f"{target} is {what}; refusing to replace it (write to a new directory)")
    if any(target.iterdir()) and not is_checkpoint_dir(target):
        raise NormswapError(f"{target} is not a model checkpoint or a normswap output (no config.json, "
                            f"weights or normswap.json); refusing to replace it{_even_with_force()}")
    if keeps is not None:
        # the folders an earlier output was written with are normswap's copies (of another model's,
        # when that output was of another model): its normswap.json names them
        lost = sorted(real_folders(target) - set(keeps) - recorded_carried_folders(target))
        if lost:
            raise NormswapError(f"{target} holds {lost[0]}/, which the new output would not hold (the old folder "
                                f"is removed whole); refusing to replace it{_even_with_force()}: write elsewhere, "
                                f"or remove {target / lost[0]} yourself")


# Messages here name the caller's options as its entry point was told to (errors.option_labels):
# `--force` on the command line, `force=True` for patch_checkpoint's library caller.
def _force() -> str:
    return option_setting(option_labels(("force",))["force"], True)


def _even_with_force() -> str:
    """What force would not override either, said only to a caller that has force: an
    experiment's pretraining cache (staged_dir(replace=True)) has none to name."""
    way = way_out("force", True, "force=True")
    return f", even with {way}" if way else ""


def _save_elsewhere() -> str:
    return f"save with {option_setting(option_labels(('out',))['out'], Metavar('DIR'))} instead"


# This process's mount table (Linux): every mount point, as the kernel resolved it.
MOUNT_TABLE = Path("/proc/self/mountinfo")


def mount_points_within(folder: Path) -> list[Path]:
    """The mount points at `folder` or below it, bind mounts included (os.path.ismount misses a bind
    mount of a folder of the same filesystem): from /proc/self/mountinfo where there is one, else
    (not Linux) by walking the tree with os.path.ismount, which does not go into a mount it found.
    `folder` is a resolved path: the table's are."""
    folder = Path(folder)
    try:
        table = MOUNT_TABLE.read_bytes()
    except OSError:
        table = None
    if table is not None:
        found = []
        for line in table.splitlines():
            fields = line.split()
            if len(fields) > 4:  # the mount point, with space, tab, line break and backslash as \ooo
                point = Path(os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])))
                if point.is_relative_to(folder):
                    found.append(point)
        return sorted(found)
    found = [folder] if os.path.ismount(folder) else []
    for root, dirs, _files in os.walk(folder):  # links are not followed
        mounted = [d for d in dirs if os.path.ismount(Path(root) / d)]
        found += [Path(root) / d for d in mounted]
        # not into a found mount: one is enough to refuse, and a share's whole tree can take hours to walk
        dirs[:] = [d for d in dirs if d not in mounted]
    return sorted(found)


# The targets each thread holds, and how many times over: re-entrant within a thread only. Keyed by
# target alone, a second thread's normswap.patch(out=X) (a library caller's pool) entered the first's
# lock as its own, wrote X alongside it, and its release (a KeyError after the first's) left X unlocked.
_HELD_LOCKS: dict[tuple[int, Path], int] = {}


@contextmanager
def target_lock(target: str | os.PathLike) -> Iterator[None]:
    """Hold the write lock of `target` (flock on `.NAME.normswap.lock` beside it) for the block, or
    fail at once with one line naming the run that holds it. Re-entrant within a process. The lock
    file is removed on release (fileio.path_lock); a kill releases the lock with the process."""
    target = Path(target)
    key = (threading.get_ident(), target)
    if key in _HELD_LOCKS:
        _HELD_LOCKS[key] += 1
        try:
            yield
        finally:
            _HELD_LOCKS[key] -= 1
        return
    path = target.parent / f".{sibling_name(target.name)}.normswap.lock"
    with ExitStack() as held:
        try:
            held.enter_context(path_lock(path, wait=False))
        except LockHeld as e:
            who = f" (pid {e.holder})" if e.holder else ""
            raise NormswapError(f"another normswap run{who} is writing {target}; "
                                "try again when it has finished") from None
        _HELD_LOCKS[key] = 1
        try:
            yield
        finally:
            del _HELD_LOCKS[key]


def check_out_target(out: str | os.PathLike, source, force: bool, verb: str, own_dir_hint: str) -> Path:
    """The resolved --out directory, or a one-line error when writing there would be refused or
    would destroy the model being read (`verb`: "patched", "converted"), or cannot be done (a
    read-only folder or filesystem: fileio.unwritable's reason, in cannot_write's words, before the
    load). source: the loading.ModelSource the output is written from. The one check of an --out
    for patch and convert: convert had none of the last, and its refusal came from the lock file
    ("cannot create the lock file /ro/.out.normswap.lock: ...") where patch said "cannot write to"."""
    _recover_through_link(out)
    target = target_path(out)
    source_dir = source.path.resolve()
    name = option_labels(("out",))["out"]
    if target == source_dir:
        raise NormswapError(f"{name} is the model's own directory; {own_dir_hint}")
    if source_dir.is_relative_to(target):
        # --force would replace `target`, and with it the model being read
        raise NormswapError(f"{name} {target} contains the model being {verb}; write elsewhere")
    recover_beside(target)  # before the target is judged: it may be a killed run's, moved aside
    # What --force could not replace either is refused with its reason, not with a hint to --force
    check_replaceable(target, keeps=carried_folders(source, target))
    if target.exists() and not force:
        raise NormswapError(f"{target} already exists; pass {_force()} to replace it")
    check_writable(target, folder=True)
    return target


@contextmanager
def staged_dir(target: str | os.PathLike, replace: bool = False, in_place: bool = False, *,
               source=None) -> Iterator[Path]:
    """Yield a fresh directory beside `target`; publish it there when the block exits cleanly.

    replace=False refuses an existing target (the CLI's --out without --force), also one that
    appears while the block runs. replace=True replaces only what check_replaceable allows
    (in_place: the directory is the model's own). The target's lock is held throughout. Any
    exception, including a failed check inside the block, removes the staging directory and
    leaves the target untouched. source: the loading.ModelSource the output is written from,
    whose modes bound the output's (ModeBounds); None: a folder of normswap's own making.
    """
    target = target_path(target)
    if target.exists() and not replace:
        raise NormswapError(f"{target} already exists; pass {_force()} to replace it")
    if replace:
        check_replaceable(target, in_place=in_place)
    parent = target.parent
    with ExitStack() as folders:
        try:
            # the folders this run makes for --out a/b/c/out go again if it fails
            folders.enter_context(made_folders(parent))
        except OSError as e:
            raise cannot_make(target, e) from None
        with target_lock(target):
            try:
                recover_interrupted_publish(target)
                remove_stale_staging(target)
                tmp = Path(tempfile.mkdtemp(prefix=f"{staging_prefix(target)}{os.getpid()}-", dir=parent))
            except OSError as e:
                raise cannot_make(target, e) from None
            _OUR_STAGING.add(tmp)
            try:
                # mkdtemp's 0700 stays while the run writes (and on what a kill leaves): the new
                # weights are no one else's to read before their modes are settled
                yield tmp
                settle_modes(tmp, target, ModeBounds.of(source))
                _kill_point("before-publish")
                publish_dir(tmp, target, replace=replace, in_place=in_place)
            except OSError as e:
                raise NormswapError(f"cannot write {target}: {_failed_file(e, tmp, target)}"
                                    f"{e.strerror or one_line(e)}") from None
            finally:
                _OUR_STAGING.discard(tmp)
                remove_tree(tmp)


# What only a write fails with: a copy's error then concerns the file it was writing.
_WRITE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def _failed_file(e: OSError, staging: Path, target: Path) -> str:
    """The file an error of the staged block concerns, as 'FILE: ' ('' when it names none): it may be
    one the block read (a source file carried over), not the target. A copy's error names both
    (shutil: filename the source, filename2 the copy); a full disk's is the copy's, where naming the
    source said 'cannot write OUT: MODEL/tokenizer.json: No space left on device', as if the model's
    folder were full. A file in `staging` is named where it was to be published: the staging folder
    is removed before the message is read, and its hidden name is no place the user knows."""
    if not (e.filename and e.strerror):
        return ""
    named = Path(os.fsdecode(e.filename2 if e.filename2 and e.errno in _WRITE_ERRORS else e.filename))
    if named.is_relative_to(staging):
        named = target / named.relative_to(staging)
    return f"{named}: "


def recover_beside(target: Path) -> None:
    """recover_interrupted_publish under the target's lock (which no publishing run holds then),
    where a killed run left anything to recover; before a command judges its target (there, or
    not there): check_out_target, patch --in-place. Where the lock cannot be taken (a run holding
    it, which may be publishing; a read-only folder) nothing is recovered now: the holder's publish
    ends, or the check that follows says why this run cannot write there (its line, not the lock
    file's), and staged_dir recovers under the lock it then holds."""
    if ours_beside(target, aside_prefix(target)):
        with contextlib.suppress(NormswapError), target_lock(target):
            recover_interrupted_publish(target)


def _recover_through_link(out) -> None:
    """recover_beside for an --out given as a link whose folder a run killed between publish_dir's
    fallback renames left aside: the link leads to nothing then, and target_path refused it as
    such before check_out_target's recovery, the old checkpoint left at its hidden name unsaid."""
    if not isinstance(out, str | os.PathLike) or not str(out).strip():
        return  # target_path says what is wrong with it
    given = Path(out).expanduser()
    try:
        dangling = link_to_nothing(given) is not None
    except OSError:  # a folder on the way this user may not enter: target_path says so
        return
    if dangling:
        recover_beside(given.resolve())  # where the link leads, as target_path would resolve it


def recover_interrupted_publish(target: Path) -> list[Path]:
    """Called with the target's lock held (under it no other run is publishing): what a run killed
    in publish_dir's fallback (no atomic exchange) left beside `target`, the old tree under
    aside_prefix. Where the target is missing (killed between the two renames) the old tree is
    complete (it only ever moves whole, and is removed under another name): it is put back, with a
    warning, the target as it was before that run. Where the target is there (killed after the new
    tree went in), it is the replaced tree, and removed; unless that run's new tree never went in
    (_unpublished): then it is what stood there, the target a new one, and it is moved in sight
    (NAME.normswap-kept-*) with a warning. Returns what was put back or removed.
    Names of an older normswap's fallback (".NAME.old-XXXXXXXX") are left alone: nothing in them
    tells them from a user's backup named alike (".model.old-20240101")."""
    asides = ours_beside(target, aside_prefix(target))
    if not asides:
        return []
    done = []
    if not os.path.lexists(target):
        back = last_moved(asides)
        rename_noreplace(back, target)
        asides.remove(back)
        done.append(back)
        warnings.warn(f"{target} was missing: a normswap run killed while replacing it had left it at {back}; "
                      "it is back in place", stacklevel=2)
    for p in asides:
        if _unpublished(p, target) and any(p.iterdir()):  # (empty: killed before it moved the target there)
            # out of the names this recovery reads, in sight: once that run's staging folder is swept
            # nothing would tell it from a replaced tree, and the next run removed it
            kept = Path(tempfile.mkdtemp(prefix=f"{sibling_name(target.name)}.normswap-kept-", dir=target.parent))
            os.rmdir(kept)
            rename_noreplace(p, kept)
            warnings.warn(f"{kept} holds what stood at {target} before a normswap run killed while replacing it; "
                          f"{target} was made anew since, so it is kept: remove it, or put it back yourself",
                          stacklevel=2)
            continue
        # under a staging folder's name first: a kill during the removal leaves no part of a tree
        # under the aside's name, which a later run finding the target gone would put back
        gone = Path(tempfile.mkdtemp(prefix=f"{staging_prefix(target)}{os.getpid()}-", dir=target.parent))
        os.rmdir(gone)
        os.replace(p, gone)
        _remove_old_tree(gone, target)
        done.append(p)
    return done


def _unpublished(aside: Path, target: Path) -> bool:
    """Whether the run that moved `aside` there was killed before its new tree went in: its staging
    folder (the same pid) is still beside the target. Under the target's lock none other can be:
    every run sweeps the dead runs' staging folders before it makes its own, and recovers (here)
    before it sweeps. The target standing there then is none of that run's: made since by someone
    else (the user, finding the model gone, fetched it again), and the aside is the only copy of
    what stood there, which the removal of "the replaced tree" destroyed without a word."""
    pid = aside.name[len(aside_prefix(target)):].partition("-")[0]
    prefix = f"{staging_prefix(target)}{pid}-"
    return any(p.name.startswith(prefix) and p not in _OUR_STAGING for p in ours_beside(target, staging_prefix(target)))


def remove_stale_staging(target: Path) -> list[Path]:
    """Remove the staging directories beside `target` that killed runs left: hidden, named after the
    target and the pid of the run that made it. Called with the target's lock held (staged_dir): every
    run makes its staging directory under that lock, so none but this process's own can belong to a
    run still going, whatever its pid says. A pid is no proof that its run is gone: in a container
    every run is pid 1 (or the same small pid), so a run the OOM killer ended had the pid of the
    next, alive, and its model-sized folder was kept for good, one more for every such kill."""
    removed = []
    for p in ours_beside(target, staging_prefix(target)):
        if p in _OUR_STAGING:
            continue
        remove_tree(p)
        removed.append(p)
    return removed


# The staging directories this process has made and not yet published or removed (staged_dir).
_OUR_STAGING: set[Path] = set()


# The group and other permission bits: what a mode lets users other than the owner do.
_OTHERS = 0o077


@dataclass(frozen=True)
class ModeBounds:
    """The permissions an output may give users other than its owner, read from the model it is
    written from (as group/other bits; _OTHERS where nothing bounds them; only its read and search
    bits count, _bounded): a private model's output
    is private too, whatever names its files take. weights: what every stock weight file of the
    source allows (the most restrictive of them; a GGUF source: the .gguf file), for the weight
    files and indexes written anew, which may be named otherwise than the source's (resharded by
    --max-shard-size, model.safetensors from a pytorch_model.bin). files: each top-level file of
    the source folder by name, for the file of that name in the output (a carried copy, or one
    rewritten from it: config.json, generation_config.json). rest: the source's config.json, for a
    file the source has no namesake of (normswap.json, a GGUF's tokenizer files). folder: the
    source folder's (a GGUF file's read bits, as a folder's read and search bits)."""

    weights: int = _OTHERS
    files: dict = field(default_factory=dict)
    rest: int = _OTHERS
    folder: int = _OTHERS

    @classmethod
    def of(cls, source) -> ModeBounds:
        if source is None:
            return cls()
        if source.gguf_file:
            bits = _others_allowed([source.path / source.gguf_file])
            return cls(weights=bits, rest=bits, folder=bits | (bits & 0o044) >> 2)
        try:
            entries = list(source.path.iterdir())
        except OSError:
            entries = []  # it was read to load the model: nothing to bound by where it is gone
        files = {p.name: _others_allowed([p]) for p in entries if p.is_file()}  # links followed: a hub cache's blobs
        return cls(weights=_others_allowed([p for p in entries if STOCK_WEIGHTS.fullmatch(p.name)]),
                   files=files, rest=files.get("config.json", _OTHERS), folder=_others_allowed([source.path]))

    def file(self, name: str) -> int:
        if STOCK_WEIGHTS.fullmatch(name):
            return self.weights
        return self.files.get(name, self.rest)


def _others_allowed(paths) -> int:
    """The group/other bits that every one of `paths` (followed through links) allows."""
    bits = _OTHERS
    for p in paths:
        try:
            bits &= os.stat(p).st_mode
        except OSError:
            continue
    return bits


def settle_modes(directory: Path, target: Path, bounds: ModeBounds) -> None:
    """The modes of a staged output, settled before it is published in `target`'s place.

    Each top-level file starts from the mode of the file of its name it replaces in `target` (a
    private model's 0640 weights stay 0640 in place, a 0444 one read-only), else from its own: a
    written file's what a plain open gives (0666 less the umask; transformers writes its
    safetensors through 0600 temporary files), a carried copy its source's; the
    folder from the folder it replaces, else 0777 less the umask. Then neither keeps a read or
    search permission for group or others that `bounds` (the source model's) does not allow, nor
    anything for a class left with neither (_bounded): the output of a private model is no more
    readable than the model, whatever its files are named (files matched by name alone gave a
    resharded model's new shards, or a private model's --out copy, 0644). Owner bits are not
    bounded: the output is the user's to rewrite. A hard link (--in-place keeps the user's
    own files so) is left as it is: its mode is the user's file's."""
    for p in directory.iterdir():
        st = p.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            continue
        try:
            old = (target / p.name).lstat()
        except OSError:
            old = None
        if old is not None and stat.S_ISREG(old.st_mode):
            mode = stat.S_IMODE(old.st_mode)
        else:
            # 0600 is a temporary file's (transformers writes its safetensors so), not a chosen mode;
            # a carried private copy comes back to it through the bound of its namesake
            mode = stat.S_IMODE(st.st_mode)
            mode = 0o666 & ~umask() if mode == 0o600 else mode
        os.chmod(p, _bounded(mode, bounds.file(p.name)))
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o777 & ~umask()
    os.chmod(directory, _bounded(mode, bounds.folder))


def _bounded(mode: int, allowed: int) -> int:
    """`mode` with no group/other read or search bit that `allowed` (the source's) lacks, and no
    bit at all for a class left with neither. The bound is on who may read the model: its write
    bits say nothing of the output, which is the user's (a model of another user's, 0644 in a
    0755 folder, written by a group with umask 002 into its shared folder gave 0644 files in a 0755
    folder, which the group could no longer rewrite)."""
    mode &= ~(_OTHERS & 0o055 & ~allowed)
    for who in (0o070, 0o007):
        if not mode & who & 0o055:
            mode &= ~who
    return mode


def parse_shard_size(value: str | int) -> int:
    """--max-shard-size as bytes ("5GB", "500MB", or a plain number of bytes), or a one-line error.
    Checked before anything is loaded: it is only used at the very end, after the long work."""
    from transformers.utils.hub import convert_file_size_to_int

    if isinstance(value, bool) or not isinstance(value, str | int):  # 1.5 reached transformers' str-only parser
        raise TypeError(f"max_shard_size: expected a size such as '5GB' or a number of bytes (int), "
                        f"got {type(value).__name__}")
    try:
        size = int(value) if isinstance(value, str) and value.strip().isdigit() else convert_file_size_to_int(value)
    except (ValueError, TypeError):
        size = None
    if not isinstance(size, int) or size <= 0:
        name = option_labels(("max_shard_size",))["max_shard_size"]
        raise BadInputError(f"{name} {value!r}: give a positive size such as 5GB, 500MB or 1000000 (bytes)")
    return size


def write_model_files(model, out_dir: Path, max_shard_size: str | int = "5GB") -> None:
    """save_pretrained of the original architecture (the patch is lifted while saving)."""
    from normswap.swap import unpatched

    with unpatched(model):
        model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=max_shard_size)
    _kill_point("after-weights")


# save_patched's default conversion: read from the source's normswap.json.
_FROM_SOURCE = object()


def save_patched(model, report, target: str | os.PathLike, *, source=None, conversion=_FROM_SOURCE,
                 replace: bool = False, max_shard_size: str | int = "5GB", probe=None,
                 progress: ProgressFn | None = None) -> Path:
    """Save a patched model as a stock checkpoint with its normswap.json, safely (module doc).

    source: the loading.ModelSource it was loaded from (its tokenizer and other files are carried
    over). conversion: the source's convert section (None: it has none), kept in the saved
    manifest, when the caller has read the source's normswap.json already; by default it is read
    from `source`. replace: allow replacing an existing target (--force / --in-place). Before the result
    is published it is reloaded with stock transformers and its outputs on a probe batch must
    equal, bit for bit, those of the in-memory model with its original norms.

    progress("save", done, 4): the weights written, the other files and the manifest, the reload
    checked, the result published.
    """
    from normswap.manifest import new_manifest, patch_section, write_manifest
    from normswap.swap import unpatched
    from normswap.verify import ProbeConfig, model_output, probe_batch

    if not hasattr(model, "save_pretrained") or not hasattr(type(model), "from_pretrained"):
        raise NormswapError(f"cannot save a {type(model).__name__}: only transformers models can be saved")
    max_shard_size = parse_shard_size(max_shard_size)
    probe = probe or ProbeConfig()
    batch = probe_batch(model, probe)
    with unpatched(model):
        kind, expected = model_output(model, batch)
    target = target_path(target)
    if conversion is _FROM_SOURCE:
        conversion = _conversion_of(source)  # read (and validated) before anything is written
    in_place = source is not None and source.path.resolve() == target
    step(progress, "save", 0, 4)
    with staged_dir(target, replace=replace, in_place=in_place, source=source) as tmp:
        try:
            write_model_files(model, tmp, max_shard_size)
            step(progress, "save", 1, 4)
            if source is not None:
                carry_over(source, tmp, in_place=in_place, target=target)
            # A converted source keeps its convert section: the weights are still the converted
            # ones, and it is what says which LayerNorms may run as RMS norms.
            write_manifest(tmp, new_manifest(
                convert=conversion, patch=patch_section(report, source.ref if source is not None else None),
                # in place the folders are the user's, but those an earlier output was written with
                carried_folders=carried_record(tmp, recorded_carried_folders(target) & real_folders(tmp) if in_place
                                               else real_folders(tmp))))
        except OSError:
            raise
        except NormswapError:
            raise
        except Exception as e:  # safetensors/transformers wrap I/O failures in their own types
            raise NormswapError(f"cannot write {target}: {e.__class__.__name__}: {e}") from None
        _kill_point("after-manifest")
        step(progress, "save", 2, 4)
        check_saved(tmp, type(model), report, kind, expected, batch, _placement(model))
        _kill_point("after-check")
        step(progress, "save", 3, 4)
    step(progress, "save", 4, 4)
    return target


def _conversion_of(source) -> dict | None:
    """The source's convert section (normswap.json), if normswap convert wrote one."""
    from normswap.manifest import conversion_section

    if source is None or source.gguf_file:
        return None
    return conversion_section(source.path)


def _placement(model) -> dict:
    """from_pretrained kwargs that put the reloaded copy where the model is: the comparison is
    bit for bit, and a GPU and a CPU do not compute the same bits."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        return {"device_map": dict(device_map)}
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    return {"device_map": str(device)} if device is not None and device.type != "cpu" else {}


def check_saved(directory: Path, model_cls, report, kind: str, expected, batch, placement=None) -> None:
    """Reload `directory` with stock transformers and compare its outputs with `expected`."""
    import torch

    from normswap.loading import DTYPES, from_pretrained_checked
    from normswap.verify import model_output

    dtype = DTYPES.get(report.dtype, torch.float32)
    try:
        reloaded = from_pretrained_checked(model_cls, directory, str(directory), dtype=dtype,
                                           **(placement or {})).eval()
    except NormswapError as e:
        raise NormswapError(f"the saved checkpoint does not reload with stock transformers: {e}; "
                            "nothing was published") from None
    got_kind, got = model_output(reloaded, batch)
    del reloaded
    if got_kind != kind or got.shape != expected.shape or not torch.equal(got, expected):
        diff = (got - expected).abs().max().item() if got.shape == expected.shape else float("nan")
        raise NormswapError(f"the saved checkpoint reloads with different {kind} (max |Δ| {diff:.3g}); "
                            "nothing was published")
