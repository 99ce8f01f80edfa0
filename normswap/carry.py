"""What a new model folder carries over from its source: the one rule behind `patch --out`,
`patch --in-place` and `convert`. Each writes its weights and config first, then carries the
rest; what the writer wrote is never replaced by the source's copy.

Into a new folder (patch --out, convert), at every depth: regular files and folders, links as
their content, except a link to a folder outside the model folder: that is carried as a link to
the same place, with a warning (copied, it pulled whatever tree it led to into the output, a
dataset's or a home folder's; the model's own entries are what an output carries). A link to a
file is carried as its content wherever the file is: a hub cache's files are links into its
blobs/, outside the snapshot folder, and an output that linked there would break when the cache
is cleaned. Left behind: the source's weights and their indexes (the new ones replace them;
any other weight-like file, such as training_args.bin, optimizer.pt, an .onnx export or Meta's
original/consolidated.00.pth, would be stale beside them) except in a subfolder that holds a
config.json of its own: that is a model of its own, such as a sentence-transformers pipeline's
2_Dense/ (its weights are not the source's; without them the pipeline does not load), carried
whole; its config.json and normswap.json
(written anew), hidden entries (.git, .cache/huggingface: they describe the source's files), and
what cannot be copied as content: a link to nothing, a link that loops back into a folder the
copy is inside, a pipe, socket or device node (reading a pipe would block forever), and the
output folder itself where it lies inside the source (`--out MODEL/fast`): carried, each run
would copy the previous result into the new one, one level deeper every time; and for the same
reason every earlier normswap output inside the source, a folder holding a normswap.json beside
its config.json (`--out MODEL/fast2` after `--out MODEL/fast` copied fast, weights and all, into
fast2, and a third output both: the model folder grew by more each run).

Over the model's own folder (--in-place) the published folder is the user's only copy, so every
entry is kept as it is (hidden ones, links as links, pipes) except the stock weight files the new
ones replace.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from normswap.manifest import MANIFEST_NAME
from normswap.streaming import STOCK_WEIGHTS  # what the new safetensors replace

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
# Written anew by every output: the source's would describe the weights it no longer holds.
_REWRITTEN = ("config.json", MANIFEST_NAME)


def carry_over(source, out_dir: str | os.PathLike, in_place: bool = False, *,
               target: str | os.PathLike | None = None) -> list[str]:
    """Carry what the writer did not write from `source` (a loading.ModelSource, or a folder) into
    `out_dir` by the module's rule; returns the top-level names carried. A GGUF file holds its
    tokenizer inside: it is written out as files (a GGUF without a usable one carries nothing).
    target: where `out_dir` (a staging folder) is published, left out where the source holds it."""
    out_dir = Path(out_dir)
    target = Path(target).resolve() if target is not None else None
    if isinstance(source, (str, os.PathLike)):
        return _carry_folder(Path(source), out_dir, in_place, target)
    if source.gguf_file:
        from normswap.errors import NormswapError
        from normswap.loading import load_tokenizer

        before = set(os.listdir(out_dir))
        try:
            load_tokenizer(source).save_pretrained(out_dir)
        except NormswapError:
            return []
        return sorted(set(os.listdir(out_dir)) - before)
    return _carry_folder(source.path, out_dir, in_place, target)


def _carry_folder(source_dir: Path, out_dir: Path, in_place: bool, target: Path | None = None) -> list[str]:
    carried = []
    entries = sorted(source_dir.iterdir())
    outward: list[Path] = []  # the links to folders outside the model that the walk met
    left_out = _left_out(source_dir, out_dir, target, outward)  # leaves out `target` too (--out MODEL/fast)
    skipped = {p.name for p in entries if STOCK_WEIGHTS.fullmatch(p.name)} if in_place else \
        left_out(source_dir, [p.name for p in entries])
    for p in entries:
        if p.name in _REWRITTEN or os.path.lexists(out_dir / p.name):
            continue  # the writer's own file wins over the source's
        if in_place:
            if p.name in skipped:
                continue
            _keep(p, out_dir / p.name)
        elif p in outward:
            _link_outward(p, out_dir / p.name)
        elif p.name in skipped:
            continue
        elif p.is_dir():
            shutil.copytree(p, out_dir / p.name, ignore=left_out)
        else:
            shutil.copy2(p, out_dir / p.name)
        carried.append(p.name)
    for p in outward:  # the deeper ones, once copytree has made the folders that hold them
        if p.parent != source_dir:
            _link_outward(p, out_dir / p.relative_to(source_dir))
    return carried


def _link_outward(link: Path, dst: Path) -> None:
    """A link to a folder outside the model, carried as a link to the same place (absolute: a
    relative one would lead elsewhere from the output)."""
    where = link.resolve()
    os.symlink(where, dst)
    warnings.warn(f"{link} leads to a folder outside the model folder ({where}): carried as a link "
                  "to it, not copied", stacklevel=2)


def carried_folders(source, target: str | os.PathLike) -> set[str]:
    """The names of the top-level folders a new folder written to `target` from `source` (a
    loading.ModelSource; as for carry_over) will hold: what `--force` may replace of an old tree's
    folders before the write has made them (checkpoint.check_replaceable). A GGUF carries files only;
    a link to a folder outside the model is carried as a link, not a folder."""
    if source.gguf_file:
        return set()
    source_dir, target = Path(source.path), Path(target).resolve()
    try:
        names = [p.name for p in source_dir.iterdir()]
    except OSError:
        return set()  # the load names the reason
    left_out = _left_out(source_dir, target, target)(source_dir, names)  # with the links to folders outside
    return {n for n in names if n not in left_out and n not in _REWRITTEN and (source_dir / n).is_dir()}


def real_folders(directory: str | os.PathLike) -> set[str]:
    """The names of the folders `directory` holds at its top level, links aside (a link is removed
    with the tree that holds it, never what it points at). Of a new output folder, the folders it
    carried (the writers write files only): what its normswap.json records as carried_folders."""
    return {p.name for p in Path(directory).iterdir() if p.is_dir() and not p.is_symlink()}


def _keep(p: Path, dst: Path) -> None:
    """--in-place: the entry as it is. Files are hard links where the filesystem allows (no second
    copy of a large .git on disk); the old tree they also belong to is removed once the new one is
    in place."""
    if p.is_symlink():
        os.symlink(os.readlink(p), dst)
    elif p.is_dir():
        shutil.copytree(p, dst, symlinks=True, copy_function=_link_or_copy)
    elif p.is_file():
        _link_or_copy(p, dst)
    else:
        os.link(p, dst)  # a pipe, socket or device node: the user's entry, kept as is


def _left_out(source_dir: Path, out_dir: Path, target: Path | None = None, outward: list[Path] | None = None):
    """copytree's ignore(folder, names) for a new folder: the names the module's rule leaves
    behind, or carries otherwise. A link is judged by what it points at; one to a folder that holds
    the source, the output, or any folder the copy is already inside is left out (followed, it
    would copy a tree into itself until the path grew too long; as a link, the output would hold
    a loop); one to any other folder outside the model is not followed but added to `outward`
    (carried as a link). `target`, the published output, deeper in the source (--out
    MODEL/runs/fast) is left out too."""
    roots = (source_dir.resolve(), out_dir.resolve())

    def ignore(folder, names):
        folder = Path(folder)
        # a subfolder with a config of its own is another model (2_Dense/): its weights are its own
        own_model = folder != source_dir and "config.json" in names
        # Every real folder on the way down from the source, not only `folder`: two links outside
        # the model that point at each other's folders loop as surely as one that points up.
        inside = {q.resolve() for q in (folder, *folder.parents) if q.is_relative_to(source_dir)}
        skip = set()
        for name in names:
            p = folder / name
            if name.startswith(".") or not own_model and (name.endswith(WEIGHT_SUFFIXES)
                                                          or STOCK_WEIGHTS.fullmatch(name)):
                skip.add(name)
            elif target is not None and p.resolve() == target:
                skip.add(name)
            elif _earlier_output(p) and p.resolve().is_relative_to(roots[0]):
                # another run's result, not a part of the model; one outside it that a link leads
                # to is a folder outside the model like any other (carried as the link)
                skip.add(name)
            elif p.is_dir():
                if p.is_symlink() and any(r.is_relative_to(p.resolve()) for r in (*roots, *inside)):
                    skip.add(name)
                elif p.is_symlink() and not p.resolve().is_relative_to(roots[0]):
                    skip.add(name)
                    if outward is not None:
                        outward.append(p)
            elif not p.is_file():  # a link to nothing, a pipe, a socket, a device node
                skip.add(name)
        return skip

    return ignore


def _earlier_output(p: Path) -> bool:
    """Whether `p` is a folder a normswap run wrote (patch --out, convert): its manifest beside
    its config. A model's own parts (2_Dense/) hold no normswap.json."""
    return p.is_dir() and (p / MANIFEST_NAME).is_file() and (p / "config.json").is_file()


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
