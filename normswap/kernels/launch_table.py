"""The measured launch tables: the tile each kernel pass launches with, as measured by the tuner
(tune.py) on a real device. Two files of one schema: the committed launch_table.json beside this
module (per GPU architecture, measured by benchmarks/tune.py on the project's GPUs), and the user
table `normswap tune` writes on a user's machine (user_path(): $NORMSWAP_LAUNCH_TABLE, `off` for
none, else $XDG_CACHE_HOME or ~/.cache, /normswap/launch_table.json), whose entries override the
committed ones key by key but only on a device whose name is their measured.device (another GPU
model of the same architecture has other bandwidths and SM counts). `_common.launch_config`
consults them first and falls back to its static heuristics where neither has an entry (and the
CPU interpreter never reads them). Both are read once per process (reload() reads them again).
A user entry also applies only to the kernels it was measured with: its measured.kernel_build
(kernel_build(): the triton version and the kernel sources) must be this process's, so that an
upgraded normswap or triton (other code, other registers, other co-residency) never launches a
tile that was checked and timed against other kernels; `normswap tune` measures such keys again.
The committed table is reviewed with the kernels it ships with and checked statically in CI.

Why measured tables and not runtime autotuning (triton.autotune): a different tile or warp count
changes the order in which a row's sum of squares (and the backward's dW partial sums) are added,
so the output can differ in the last bit. An autotuner picks the fastest candidate by timing at
run time, so which candidate wins, and therefore the bits of the output, would depend on timing
noise, differ between two processes on one machine, and change with load. A table measured once,
reviewed and committed makes the choice a pure function of (GPU architecture, op, pass, dtype,
hidden-size bucket, row-count bucket): the same bits on every run on the same kind of GPU. It also
costs no tuning time at the first call and never specialises on the exact row count. A user table
is the same idea per machine: timed once, explicitly, then only read.

Schema of launch_table.json (checked by `problems`; tests/test_launch_table.py validates the
committed file):

    {"schema": 1,
     "about": "<free text>",
     "row_buckets": [2048],          # must equal _common.ROW_BUCKETS, else the table is ignored
     "archs": {"sm_90": {"entries": [ENTRY, ...]}, ...}}

    ENTRY = {"op": "rms_norm" | "layer_norm", "pass": "fwd" | "bwd", "dtype": "bf16" | "fp16" | "fp32",
             "hidden": 4096,           # a power of two: the entry serves hidden sizes in (hidden/2, hidden]
             "rows": ">2048",          # a row-count bucket label (bucket_labels): never an exact count
             "tile": {"block_m": 2, "block_n": 4096, "num_warps": 8, "num_stages": 1},
             "measured": {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-23", "torch": "2.x",
                          "triton": "3.x", "commit": "<git sha the tuner ran at>",
                          "us": {"4096": 11.2, "32768": 85.0},          # the winner, per row count timed
                          "static": {"tile": {...}, "us": {...}},         # the heuristic's choice, same rows
                          "runner_up": {"tile": {...}, "us": {...}} | null}}

A key appears once per architecture in the committed table; in a user table once per architecture
and measuring device (problems(..., per_device=True)).

A tile whose block_n is smaller than the hidden size splits each row into ceil(hidden / block_n)
chunks, one program each (block_m is then 1); otherwise block_n is the hidden bucket itself and a
program holds block_m whole rows. Variants of one op and pass (with or without weight, bias,
residual) share an entry: the tuner measures the plain variant (rms with weight, layer_norm with
weight and bias) and accepts only tiles that also pass the static check with the residual.

The committed table holds only measured entries; a key without one uses the static heuristics.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import warnings
from pathlib import Path

from normswap import jsonsafe
from normswap.dtypes import RUN_DTYPES
from normswap.errors import NormswapError
from normswap.fileio import made_folders, path_lock, write_text_atomic, written_at

SCHEMA = 1
PATH = Path(__file__).with_name("launch_table.json")
OPS = ("rms_norm", "layer_norm")
PASSES = ("fwd", "bwd")
DTYPES = RUN_DTYPES  # normswap.dtypes' short names
TILE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
MEASURED_FIELDS = ("device", "date", "torch", "triton", "commit", "us", "static", "runner_up")
ARCH_RE = re.compile(r"^sm_\d+$")
KEY_FIELDS = ("op", "pass", "dtype", "hidden", "rows")


# The file's "about", with and without entries (benchmarks/tune.py switches it with the first one).
ABOUT_EMPTY = ("Launch tiles measured on real GPUs by benchmarks/tune.py, per architecture (schema and why a committed "
               "table instead of runtime autotuning: normswap/kernels/launch_table.py). No entries yet: no GPU has "
               "tuned these kernels, and an entry is only ever written from a measurement. Until then every launch "
               "uses the static heuristics of normswap/kernels/_common.py (chosen from the sm_90 static analysis, "
               "benchmarks/kernel_static.py).")
ABOUT_MEASURED = ("Launch tiles measured on real GPUs by benchmarks/tune.py, per architecture (schema and why a committed "
                  "table instead of runtime autotuning: normswap/kernels/launch_table.py). Every entry was written from "
                  "a measurement and carries its provenance (device, date, versions, commit, times); keys without an "
                  "entry use the static heuristics of normswap/kernels/_common.py.")

# A user table's (normswap tune's).
ABOUT_USER = ("Launch tiles measured on this machine by `normswap tune` (schema: normswap/kernels/launch_table.py). "
              "Each entry applies only on a GPU whose name is its measured.device, over the committed table; "
              "delete the file to go back to the committed table and the static heuristics.")


def bucket_labels(row_buckets) -> list[str]:
    """Labels of the row-count buckets, in bucket order: (2048,) -> ["<=2048", ">2048"]."""
    bounds = list(row_buckets)
    return [f"<={b}" for b in bounds] + [f">{bounds[-1]}" if bounds else "all"]


def hidden_bucket(n: int) -> int:
    """The power of two at or above n: the table's hidden key (whole-row tiles are that wide)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


def tile_problems(tile, hidden: int) -> list[str]:
    """What is wrong with one tile for a hidden bucket (empty when nothing)."""
    if not isinstance(tile, dict) or set(tile) != set(TILE_FIELDS):
        return [f"tile must have exactly the fields {', '.join(TILE_FIELDS)}"]
    out = []
    for f in ("block_m", "block_n", "num_warps"):
        if not _pow2(tile[f]):
            out.append(f"{f} must be a power of two >= 1, got {tile[f]!r}")
    s = tile["num_stages"]
    if not (isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= 8):
        out.append(f"num_stages must be an integer 1..8, got {s!r}")
    if out:
        return out
    if tile["num_warps"] > 32:
        out.append(f"num_warps {tile['num_warps']} > 32")
    if tile["block_n"] > hidden:
        out.append(f"block_n {tile['block_n']} is wider than the hidden bucket {hidden}")
    if tile["block_n"] < hidden and tile["block_m"] != 1:
        out.append("a split-row tile (block_n < hidden) must have block_m 1")
    if tile["block_m"] > 256:
        out.append(f"block_m {tile['block_m']} > 256")
    return out


def entry_key(e: dict, per_device: bool = False) -> tuple:
    """(op, pass, dtype, hidden, rows) of an entry; with `per_device` (a user table, whose entries
    apply per device name) also its measured.device: one table then holds an entry per GPU model
    for one key (a home folder shared by an H100 and an H200 machine)."""
    key = tuple(e[f] for f in KEY_FIELDS)
    if per_device:
        m = e.get("measured")
        key += (m.get("device") if isinstance(m, dict) else None,)
    return key


def problems(doc, row_buckets, per_device: bool = False) -> list[str]:
    """Every schema violation of a launch-table document (empty when it is valid); `per_device`:
    a user table (a key may appear once per measuring device)."""
    if not isinstance(doc, dict):
        return ["the table must be a JSON object"]
    out = []
    if doc.get("schema") != SCHEMA:
        out.append(f"schema must be {SCHEMA}, got {doc.get('schema')!r}")
    if doc.get("row_buckets") != list(row_buckets):
        out.append(f"row_buckets {doc.get('row_buckets')!r} differ from the library's {list(row_buckets)}")
    archs = doc.get("archs")
    if not isinstance(archs, dict):
        return out + ["archs must be an object of architecture -> {entries: [...]}"]
    labels = bucket_labels(row_buckets)
    for arch, body in archs.items():
        if not ARCH_RE.match(str(arch)):
            out.append(f"architecture {arch!r} is not of the form sm_<major><minor>")
        entries = body.get("entries") if isinstance(body, dict) else None
        if not isinstance(entries, list):
            out.append(f"{arch}: entries must be a list")
            continue
        seen = set()
        for i, e in enumerate(entries):
            where = f"{arch} entry {i}"
            if not isinstance(e, dict):
                out.append(f"{where}: not an object")
                continue
            missing = [f for f in (*KEY_FIELDS, "tile", "measured") if f not in e]
            if missing:
                out.append(f"{where}: missing {', '.join(missing)}")
                continue
            if e["op"] not in OPS or e["pass"] not in PASSES or e["dtype"] not in DTYPES:
                out.append(f"{where}: op/pass/dtype must be among {OPS}/{PASSES}/{DTYPES}")
            if not _pow2(e["hidden"]):
                out.append(f"{where}: hidden must be a power of two (the bucket), got {e['hidden']!r}")
                continue
            if e["rows"] not in labels:
                out.append(f"{where}: rows must be a bucket label {labels}, got {e['rows']!r}")
            out += [f"{where}: {p}" for p in tile_problems(e["tile"], e["hidden"])]
            m = e["measured"]
            if not isinstance(m, dict) or any(f not in m for f in MEASURED_FIELDS):
                out.append(f"{where}: measured must hold {', '.join(MEASURED_FIELDS)}")
            elif not (isinstance(m["us"], dict) and m["us"]
                      and all(isinstance(v, (int, float)) and v > 0 for v in m["us"].values())):
                out.append(f"{where}: measured.us must map row counts to positive times")
            key = entry_key(e, per_device)
            if key in seen:
                out.append(f"{where}: duplicate key {key}")
            seen.add(key)
    return out


def index(doc) -> dict:
    """{(arch, op, pass, dtype, hidden, rows): tile} of a valid document."""
    return {(arch, *entry_key(e)): dict(e["tile"])
            for arch, body in doc["archs"].items() for e in body["entries"]}


def empty(row_buckets) -> dict:
    return {"schema": SCHEMA, "about": ABOUT_EMPTY, "row_buckets": list(row_buckets), "archs": {}}


def read(path: Path = PATH) -> dict:
    """The parsed document; ValueError ("malformed JSON (the reason)") for a file that is not
    JSON, as for one nested too deeply or not UTF-8: a table is only ever ignored with a warning
    or refused as bad input, never a crash."""
    try:
        return jsonsafe.read(path)
    except ValueError as e:
        raise ValueError(f"malformed JSON ({e})") from None


def stamp(arch: str, path: Path | None = None) -> dict:
    """Which table a measurement ran with (benchmark provenance: a tuned table may not be committed
    yet when a GPU session benchmarks it): its sha256 (first 12) and entries for `arch`."""
    import hashlib

    path = Path(path or PATH)
    try:
        data = path.read_bytes()
        entries = len(jsonsafe.loads(data).get("archs", {}).get(arch, {}).get("entries", []))
    except (OSError, ValueError, AttributeError, TypeError):  # not a table: no provenance
        return {"arch": arch, "sha256": None, "entries": None}
    return {"arch": arch, "sha256": hashlib.sha256(data).hexdigest()[:12], "entries": entries}


# The user table: what `normswap tune` writes by default, one per machine (per user).
USER_ENV = "NORMSWAP_LAUNCH_TABLE"
# The files whose code a tuned tile was checked and timed against (kernel_build).
KERNEL_SOURCES = ("_common.py", "rms_norm.py", "layer_norm.py")


@functools.cache
def kernel_build() -> str:
    """What a tuned tile is only valid for: the first 12 hex of a sha256 over the triton version
    and the kernel sources (a user entry measured with another is stale: not applied). Once per
    process: the sources a process runs do not change under it."""
    import hashlib

    import triton

    h = hashlib.sha256(f"triton {triton.__version__}".encode())
    for name in KERNEL_SOURCES:
        h.update(b"\0" + Path(__file__).with_name(name).read_bytes())
    return h.hexdigest()[:12]


def user_path() -> Path | None:
    """Where the user table is read from: $NORMSWAP_LAUNCH_TABLE (a path, or `off` for none), else
    $XDG_CACHE_HOME/normswap/launch_table.json, else ~/.cache/normswap/launch_table.json."""
    env = os.environ.get(USER_ENV, "").strip()
    if env.lower() == "off":
        return None
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(cache) if cache else Path.home() / ".cache") / "normswap" / "launch_table.json"


# What is loaded, per process: the committed index {(arch, op, pass, dtype, hidden, rows): tile},
# the user table's {(device name, arch, ...): tile}, tiles forced on top (the tuner's candidates),
# each file's status, the merged view per device name, and a counter that changes whenever any of
# it does (launch_config's cache key).
_state = {"committed": None, "user": None, "forced": {}, "status": {}, "views": {}, "generation": 0}


def _load_file(path: Path | None, row_buckets, what: str) -> tuple[dict | None, dict]:
    """(valid document or None, status). A missing user table is normal (nothing tuned yet); a
    file that fails validation is ignored with one warning: launches never fail over a table."""
    status = {"path": None if path is None else str(path), "state": "off", "entries": 0}
    if path is None:
        return None, status
    if what == "user" and not path.exists():
        return None, dict(status, state="missing")
    try:
        doc = read(path)
        bad = problems(doc, row_buckets, per_device=what == "user")
    except (OSError, ValueError) as e:
        bad = [str(e)]
    if bad:
        warnings.warn(f"normswap: ignoring the {what} launch table {path} ({bad[0]}); static launch heuristics "
                      "used where no other table has an entry", stacklevel=4)
        return None, dict(status, state="invalid", problem=bad[0])
    return doc, dict(status, state="loaded", entries=sum(len(b["entries"]) for b in doc["archs"].values()))


def _ensure_loaded(row_buckets) -> None:
    if _state["committed"] is not None:
        return
    doc, committed = _load_file(PATH, row_buckets, "package")
    _state["committed"] = index(doc) if doc else {}
    doc, user = _load_file(user_path(), row_buckets, "user")
    # A user entry is keyed by the device it was measured on: another GPU model of the same
    # architecture (an H200 beside an H100, a 4090 beside an L40) has other bandwidths and SMs;
    # and it applies only to the kernels it was measured with (kernel_build).
    entries = [] if doc is None else [(arch, e) for arch, body in doc["archs"].items() for e in body["entries"]]
    fresh = [(arch, e) for arch, e in entries if e["measured"].get("kernel_build") == kernel_build()]
    _state["user"] = {(e["measured"]["device"], arch, *entry_key(e)): dict(e["tile"])
                      for arch, e in fresh}
    if doc is not None:
        user["stale"] = len(entries) - len(fresh)
    _state["status"] = {"committed": committed, "user": user}
    _state["views"] = {}
    _state["generation"] += 1


def active(row_buckets, device_name: str | None = None) -> tuple[dict, int]:
    """(index, generation) of the tiles in use on a device named `device_name` (as
    torch.cuda.get_device_name says; None: no device, e.g. meta tensors): the package's committed
    table, overridden key by key by the user table's entries measured on a device of that name,
    and by forced tiles. Loaded once per process, so the choice never changes during a run."""
    _ensure_loaded(row_buckets)
    view = _state["views"].get(device_name)
    if view is None:
        mine = {k[1:]: t for k, t in _state["user"].items() if k[0] == device_name}
        view = _state["views"][device_name] = {**_state["committed"], **mine, **_state["forced"]}
    return view, _state["generation"]


def generation(row_buckets) -> int:
    """A number that changes whenever the tables in use do (launch_config's cache key); loads them
    on first use."""
    _ensure_loaded(row_buckets)
    return _state["generation"]


def reload() -> None:
    """Read the committed and user tables again at the next launch (after `normswap tune` wrote the
    user table in this process, or NORMSWAP_LAUNCH_TABLE changed)."""
    _state.update(committed=None, user=None, views={}, status={})
    _state["generation"] += 1


def status(row_buckets, arch: str | None, device_name: str | None) -> dict:
    """Which tables are in effect and what they hold for one device (`arch` and `device_name` of a
    CUDA device; None for none): per file its path, state (loaded, missing, invalid, off) and
    entries, and how many keys it answers on this device; for a loaded user table also how many
    entries are stale (measured with other kernels: never applied)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an invalid table is reported here (state, problem), not warned about too
        _ensure_loaded(row_buckets)
    out = {"device": device_name, "arch": arch, "user_env": os.environ.get(USER_ENV)}
    for what in ("committed", "user"):
        s = dict(_state["status"][what])
        if what == "committed":
            s["apply"] = sum(1 for k in _state["committed"] if k[0] == arch) if arch else 0
        else:
            s["apply"] = sum(1 for k in _state["user"] if k[:2] == (device_name, arch)) if arch else 0
            s["other_devices"] = sorted({k[0] for k in _state["user"] if k[0] != device_name})
        out[what] = s
    return out


@contextlib.contextmanager
def _using(doc, row_buckets):
    """Run with `doc` as the only launch table (tests' injected tables: no user table). Raises
    ValueError on an invalid document."""
    bad = problems(doc, row_buckets)
    if bad:
        raise ValueError("invalid launch table: " + "; ".join(bad[:3]))
    _ensure_loaded(row_buckets)
    with _installed(committed=index(doc), user={}, forced={}):
        yield


@contextlib.contextmanager
def forced(key: tuple, tile: dict, row_buckets):
    """Run with `tile` answering for one key (arch, op, pass, dtype, hidden, rows) on every device
    of that architecture, on top of the tables in use: how the tuner and the static check try a
    candidate before it has a measurement."""
    bad = tile_problems(tile, key[4])
    if bad:
        raise ValueError(f"invalid tile {tile} for {key}: {bad[0]}")
    _ensure_loaded(row_buckets)
    with _installed(forced={**_state["forced"], tuple(key): dict(tile)}):
        yield


@contextlib.contextmanager
def _installed(**layers):
    old = {k: _state[k] for k in layers}
    _state.update(layers, views={})
    _state["generation"] += 1
    try:
        yield
    finally:
        _state.update(old, views={})
        _state["generation"] += 1


def write(path: Path, doc, row_buckets, per_device: bool = False) -> None:
    """Validate, then write atomically (a temporary file renamed into place)."""
    bad = problems(doc, row_buckets, per_device)
    if bad:
        raise ValueError("refusing to write an invalid launch table: " + "; ".join(bad[:3]))
    write_text_atomic(Path(path), json.dumps(doc, indent=1) + "\n")


def update(path: Path, arch: str, entries: list[dict], row_buckets, base: dict | None = None,
           per_device: bool = False) -> dict:
    """Merge `entries` (under `arch`) into the table at `path` and write it back, holding an
    exclusive lock on it (`path` + ".lock") from the read to the rename: the file is read again
    inside the lock, so entries another writer added since (a second `normswap tune` on the same
    table, another machine sharing the home folder) are kept, never overwritten by a stale copy.
    `base`: the document to start from where `path` does not exist yet (default: an empty table);
    `per_device`: a user table (entries replace only those of their key measured on their device).
    Returns the document written. ValueError when the file on disk is not a valid table.
    The lock file goes with the lock (fileio.path_lock), so a first write that fails leaves
    nothing it made: made_folders removes the folder it made for the table. A second writer that
    was waiting on that first write then finds the folder gone: it makes it again and writes.
    `path` a link: the lock is the table's it leads to (fileio.written_at), which the write replaces;
    beside the link, a writer through it and one of the table itself each held a lock of its own."""
    path = written_at(path)
    while True:
        with made_folders(path.parent), contextlib.ExitStack() as held:
            try:
                held.enter_context(path_lock(Path(str(path) + ".lock"), wait=True))
            except NormswapError:
                if path.parent.is_dir():
                    raise
                continue  # removed by the failed first write this one waited on: made again
            if path.exists():
                doc = read(path)
                bad = problems(doc, row_buckets, per_device)
                if bad:
                    raise ValueError(f"{path} is no longer a valid launch table ({bad[0]}); not overwritten")
            else:
                doc = base if base is not None else empty(row_buckets)
            doc = merge(doc, arch, entries, per_device)
            write(path, doc, row_buckets, per_device)
            return doc


def merge(doc, arch: str, entries: list[dict], per_device: bool = False) -> dict:
    """doc with `entries` added under `arch`, each replacing any entry of the same key (with
    `per_device`: of the same key and measuring device)."""
    out = json.loads(json.dumps(doc))
    body = out["archs"].setdefault(arch, {"entries": []})
    fresh = {entry_key(e, per_device) for e in entries}
    kept = [e for e in body["entries"] if entry_key(e, per_device) not in fresh]
    order = lambda e: (OPS.index(e["op"]), PASSES.index(e["pass"]), DTYPES.index(e["dtype"]), e["hidden"],  # noqa: E731
                       str(e["rows"]), str(e["measured"].get("device")))
    body["entries"] = sorted(kept + list(entries), key=order)
    if out.get("about") in (ABOUT_EMPTY, ABOUT_MEASURED):  # the committed file's: it says whether it has entries
        out["about"] = ABOUT_MEASURED if any(b["entries"] for b in out["archs"].values()) else ABOUT_EMPTY
    return out
