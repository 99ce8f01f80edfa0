"""normswap.json: the one manifest of a checkpoint directory that normswap wrote.

The weights beside it are stock (original classes, original keys, stock config): transformers
loads them as they are. What normswap did lives only here, one section per command:

    {
      "format": "normswap/2",
      "normswap_version": "0.1.0",
      "updated": "2026-11-21T09:30:00Z",
      "convert": {...},   # normswap convert: which norms now read a zero-mean stream, and what
                          # was folded or kept (γ, β) -- they may run as RMS norms; absent if not
                          # converted
      "patch": {...},     # normswap patch: its PatchConfig (impl, paths, rms_forms, strict) and
                          # per-module spec and proof; absent if not patched
      "carried_folders": {...}  # the top-level folders a new output folder (patch --out, convert)
                          # was written with, copies of its source's (carry.py), name -> [inode,
                          # change time in ns] as written: what a later --force may remove with
                          # it while each is still that folder; absent where the folders are the
                          # user's own (--in-place) and in files of older versions
    }

"Runs as RMS" is held once. A patch section's "rms_forms" (path -> RmsForm) says which norms the
patch runs as RMS norms and how; nothing else in the file spells an RmsForm. A convert section
records facts of the conversion (per norm "rms": its input is zero-mean; "kept_gain", "kept_bias",
"baked"): rms_forms() derives from them the forms a patch may use (`normswap patch --no-rms` uses
none, so "may" and "does" are different facts). Manifests of format normswap/1 held the form
also as the convert section's "rms_weight"/"rms_bias" and per patched module ("rms_form", earlier
"as_rms"), and the oldest patch sections had no "paths"/"rms_forms": read_manifest brings such a
file to this shape (_upgrade), so every reader, and a patch that carries a convert section over,
sees one place.

Why the format number changed with that layout: a normswap/1 reader derives a converted norm's
form from "rms_weight"/"rms_bias" and takes their absence for "no gain, no bias", so it would load
a normswap/2 converted-only directory as a silently different model. Under the new number it
refuses the file instead. This version refuses a format newer than its own the same way, with one
line that says so ("written by a newer normswap"), before any weight is loaded.

Composition rules (the convert -> patch speedup path):
- `normswap patch` on a converted directory keeps its "convert" section verbatim and adds (or
  replaces) "patch"; the LayerNorms the convert section marks run as RMS norms in that patch.
- `normswap convert` reads stock weights and writes a new "convert" section only. A "patch"
  section of its input is not carried: the patch was verified against the input's weights, not
  the converted ones (run `normswap patch` on the output). A "convert" section of its input is
  replaced by the new one (converting again folds ones and zeros: a no-op).
- `normswap.load(DIR)` (normswap.loading) applies the "patch" section's PatchConfig (impl, paths,
  RMS forms, and the residual adds fused into their norms under "fuse_residual", writer -> norm);
  a directory that is only converted gets its zero-mean LayerNorms run as RMS norms.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from normswap import jsonsafe
from normswap._version import __version__
from normswap.errors import NormswapError
from normswap.fileio import write_text_atomic
from normswap.modules import RmsForm
from normswap.specs import NormSpec

MANIFEST_NAME = "normswap.json"
FORMAT = "normswap/2"  # what this version writes
# What it reads: FORMAT, and the older formats _upgrade brings to FORMAT's shape.
READ_FORMATS = ("normswap/1", FORMAT)
SECTIONS = ("convert", "patch")


# ---------------------------------------------------------------------------------------------
# Building and writing
# ---------------------------------------------------------------------------------------------


def new_manifest(convert: dict | None = None, patch: dict | None = None,
                 carried_folders: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The whole file; a section that is None is left out. carried_folders: the folders a new
    output folder holds (carried_record of it), None for a folder that is the user's own."""
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "normswap_version": __version__,
        "updated": _now(),
    }
    for name, section in (("convert", convert), ("patch", patch)):
        if section is not None:
            manifest[name] = section
    if carried_folders is not None:
        manifest["carried_folders"] = dict(sorted(carried_folders.items()))
    return manifest


def _folder_identity(path: Path) -> list[int] | None:
    """A folder as it is now: [inode, change time in ns], None for anything but a real folder. A
    folder removed and made again under its name (the user's own code/ where normswap's was) has
    another: the change time is the kernel's and no copy or touch sets it back, and it also tells
    a reused inode apart."""
    try:
        s = os.lstat(path)
    except (OSError, ValueError):
        return None
    return [s.st_ino, s.st_ctime_ns] if stat.S_ISDIR(s.st_mode) else None


def carried_record(directory: str | os.PathLike, names: Iterable[str]) -> dict[str, list[int]]:
    """new_manifest's carried_folders: each of `names` (folders of `directory`, a staging folder)
    with its identity, taken once the folder is complete; the publish renames the staging folder,
    which keeps its folders' identities."""
    record = {name: _folder_identity(Path(directory) / name) for name in names}
    return {name: ident for name, ident in record.items() if ident is not None}


def recorded_carried_folders(directory: str | os.PathLike) -> set[str]:
    """The folders an earlier output's normswap.json says normswap wrote into it (new_manifest's
    carried_folders) and that are still the folders it wrote (same identity): none where it says
    nothing, or cannot be read (only what it names for certain may be removed with the old tree).
    A plain top-level, non-hidden name only, whatever a hand-edited file holds."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():  # a pipe in its place blocked --force's check forever on the read
        return set()
    try:
        data = jsonsafe.read(path)
    except (OSError, ValueError):
        return set()
    folders = data.get("carried_folders") if isinstance(data, dict) else None
    if not isinstance(folders, dict):
        return set()
    return {name for name, ident in folders.items()
            if isinstance(name, str) and name and not name.startswith(".") and "/" not in name and "\0" not in name
            and ident is not None and ident == _folder_identity(Path(directory) / name)}


def patch_section(report, source: str | None = None) -> dict[str, Any]:
    """What `normswap patch` did: its PatchConfig (impl, paths, rms_forms, strict, and
    "fuse_residual" writer -> norm of each residual add fused into its norm, absent when the patch
    did not fuse: what normswap.load applies again), and per patched module its spec and proof
    (its RMS form is the config's rms_forms[path]: held once)."""
    return {
        **report.config.to_dict(),
        "created": _now(),
        "source": None if source is None else str(source),
        "dtype": report.dtype,
        "verified": report.verified,
        "modules": [
            {"path": m.path, "class": m.module_class, "spec": m.spec.to_dict(),
             "verification": m.check.to_dict() if m.check else None}
            for m in report.patched
        ],
        "left_alone": [{"path": m.path, "class": m.module_class, "status": m.status, "reason": m.reason}
                       for m in report.modules if m.status in ("excluded", "unknown")],
        "model_check": report.model_check.to_dict() if report.model_check else None,
    }


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    path = Path(directory) / MANIFEST_NAME
    text = json.dumps(manifest, indent=2, default=_json_default) + "\n"
    _validate(json.loads(text), path)  # never write a file that read_manifest would refuse
    return write_text_atomic(path, text)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _json_default(o):
    if isinstance(o, NormSpec):
        return o.to_dict()
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_manifest(where: str | os.PathLike) -> dict[str, Any]:
    """The validated manifest of a directory (or of the normswap.json file itself)."""
    path = Path(where)
    if path.is_dir() or not path.name.endswith(".json"):
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise NormswapError(f"{path.parent}: not a normswap checkpoint (no {MANIFEST_NAME})")
    return _upgrade(_validate(jsonsafe.read_or_refuse(path, what="manifest"), path))


def read_manifest_if_any(directory: str | os.PathLike) -> dict[str, Any] | None:
    """read_manifest, or None when the directory has no normswap.json (a malformed one raises:
    silently dropping it would lose what the conversion promised)."""
    if not (Path(directory) / MANIFEST_NAME).is_file():
        return None
    return read_manifest(directory)


def _format_number(fmt: Any) -> int | None:
    """N of a "normswap/N" format string; None for anything else."""
    hit = re.fullmatch(r"normswap/(\d+)", fmt) if isinstance(fmt, str) else None
    return int(hit.group(1)) if hit else None


def _validate(data: Any, path: Path) -> dict[str, Any]:
    found = data.get("format") if isinstance(data, dict) else type(data).__name__
    if found not in READ_FORMATS:
        number = _format_number(found)
        if number is not None and number > _format_number(FORMAT):
            raise NormswapError(f"{path}: written by a newer normswap (manifest format {found!r}; normswap "
                                f"{__version__} reads up to {FORMAT}): upgrade normswap to load it")
        raise NormswapError(f"{path}: not a normswap manifest (format {found!r}; normswap {__version__} reads "
                            f"{' and '.join(READ_FORMATS)})")
    if not any(name in data for name in SECTIONS):
        raise NormswapError(f"{path}: malformed manifest (neither a convert nor a patch section)")
    for name in SECTIONS:
        if name in data and not isinstance(data[name], dict):
            raise NormswapError(f"{path}: malformed manifest (its {name} section is a "
                                f"{type(data[name]).__name__}, not an object)")
    try:
        if "convert" in data:
            for n in data["convert"]["norms"]:
                str(n["path"]), bool(n["rms"])
                if n["rms"]:  # what rms_forms() reads
                    bool(n["kept_gain"]), bool(n["baked"]), bool(n["kept_bias"])
        if "patch" in data:
            from normswap.swap import PatchConfig

            p = data["patch"]
            PatchConfig.from_dict(p)
            fused = p.get("fuse_residual", {})
            if not isinstance(fused, dict) or not all(isinstance(v, str) for v in fused.values()):
                raise TypeError("fuse_residual must map writer paths to norm paths")
            for m in p["modules"]:
                if not isinstance(m["spec"], NormSpec):
                    m["spec"] = NormSpec.from_dict(m["spec"])
                if m.get("rms_form") is not None:
                    RmsForm.coerce(m["rms_form"])
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise NormswapError(f"{path}: malformed manifest ({e.__class__.__name__}: {e})") from None
    return data


# What older writers stored besides the one place (module doc): the convert section's spelling of
# the form (derived from kept_gain/baked and kept_bias, so dropping it loses nothing) and the
# per-module copies of the patch section's rms_forms.
_OLD_NORM_KEYS = ("rms_weight", "rms_bias")
_OLD_MODULE_KEYS = ("rms_form", "as_rms")


def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A validated manifest in the current shape (FORMAT's), "runs as RMS" in one place (changed in
    place)."""
    if data["format"] == FORMAT:
        return data
    data["format"] = FORMAT
    for n in data.get("convert", {}).get("norms", ()):
        for key in _OLD_NORM_KEYS:
            n.pop(key, None)
    p = data.get("patch")
    if p is not None:
        if "paths" not in p:  # the oldest patch sections: the patched modules were the config
            p["paths"] = [m["path"] for m in p["modules"]]
            p["rms_forms"] = {m["path"]: RmsForm.coerce(m["rms_form"]).to_dict()
                              for m in p["modules"] if m.get("rms_form") is not None}
        for m in p["modules"]:
            for key in _OLD_MODULE_KEYS:
                m.pop(key, None)
    return data


def conversion_section(where: str | os.PathLike | dict) -> dict[str, Any] | None:
    """The "convert" section of a manifest, given a directory, a whole manifest, or the section
    itself (what convert_model returns); None when nothing was converted."""
    if isinstance(where, dict):
        if "format" in where:
            return _upgrade(_validate(where, Path("<manifest>"))).get("convert")
        return where  # a bare convert section
    data = read_manifest_if_any(where)
    return None if data is None else data.get("convert")


def rms_forms(where: str | os.PathLike | dict) -> dict[str, RmsForm]:
    """path -> RmsForm of each LayerNorm that `normswap convert` made zero-mean (it may run as an
    RMS norm; γ/β applied only where they were kept). `where`: a directory, a whole manifest or its
    convert section (what convert_model returns). Empty when there is no manifest or only a patch
    section. The one reader of that part of the manifest: `normswap patch`, `normswap.load` and
    the conversion's own checks pass it as patch(rms_forms=...)."""
    section = conversion_section(where)
    if section is None:
        return {}
    # γ applies where it was kept, or baked (BLOOM's embedding norm: its weight is s·1); where it
    # was folded the weight is ones. β applies where it was kept; else it was folded (zeros).
    return {n["path"]: RmsForm(weight=bool(n["kept_gain"] or n["baked"]), bias=bool(n["kept_bias"]))
            for n in section["norms"] if n["rms"]}
