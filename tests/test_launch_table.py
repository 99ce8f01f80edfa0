"""The measured launch table (normswap/kernels/launch_table.py): the committed file validates, an
entry answers launch_config for its own key only (architecture, op, pass, dtype, hidden bucket,
row bucket), every row count of a bucket gets one tile, a broken table is ignored with a warning
instead of breaking launches, and the interpreter never reads it. No GPU: the key is the planning
architecture (meta tensors) or a CUDA device whose capability is stubbed."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from normswap.kernels import _common
from normswap.kernels import launch_table as T
from normswap.kernels.rms_norm import _rms_fwd_kernel
from tests.fake_device import LN, RMS, cuda_devices

BF16, FP32 = torch.bfloat16, torch.float32
MEASURED = {"device": "test fixture, not a measurement", "date": "2000-01-01", "torch": "-", "triton": "-",
            "commit": "-", "us": {"32768": 1.0}, "static": None, "runner_up": None}


def entry(op="rms_norm", pass_="fwd", dtype="bf16", hidden=4096, rows=">2048", **tile):
    t = {"block_m": 1, "block_n": hidden, "num_warps": 4, "num_stages": 1}
    t.update(tile)
    return {"op": op, "pass": pass_, "dtype": dtype, "hidden": hidden, "rows": rows, "tile": t,
            "measured": dict(MEASURED)}


def table(*entries, arch="sm_90"):
    return T.merge(T.empty(_common.ROW_BUCKETS), arch, list(entries))


def test_committed_table_is_valid_and_holds_only_measurements():
    doc = T.read(T.PATH)
    assert T.problems(doc, _common.ROW_BUCKETS) == []
    # The file says whether it holds measurements (merge switches the text with the first entry).
    has_entries = any(b["entries"] for b in doc["archs"].values())
    assert doc["about"] == (T.ABOUT_MEASURED if has_entries else T.ABOUT_EMPTY)
    assert T.merge(T.empty(_common.ROW_BUCKETS), "sm_90", [entry()])["about"] == T.ABOUT_MEASURED
    for arch, body in doc["archs"].items():
        for e in body["entries"]:
            m = e["measured"]
            # Written by benchmarks/tune.py on a real device: a device name, a commit, the winner's times.
            assert m["device"] and "fixture" not in m["device"] and "cpu" not in m["device"].lower(), (arch, e)
            assert m["commit"] and m["us"], (arch, e)


def test_entry_answers_its_key_only(monkeypatch):
    doc = table(entry(block_m=2, num_warps=8), entry(pass_="bwd", block_m=4, num_warps=8, num_stages=2),
                entry(hidden=65536, block_n=8192, num_warps=4))
    static_fwd = _common.launch_config(32768, 4096, BF16, "fwd", RMS)
    with T._using(doc, _common.ROW_BUCKETS):
        assert _common.launch_config(32768, 4096, BF16, "fwd", RMS) == _common.Tile(2, 4096, 1, 8, 1)
        assert _common.launch_config(32768, 4096, BF16, "bwd", RMS) == _common.Tile(4, 4096, 1, 8, 2)
        # Any hidden size of the bucket (2048, 4096] uses it; 4097 is the next bucket's.
        assert _common.launch_config(32768, 3000, BF16, "fwd", RMS) == _common.Tile(2, 4096, 1, 8, 1)
        assert _common.launch_config(32768, 4097, BF16, "fwd", RMS).block_n == 8192
        # A split-row entry: chunks follow from the hidden size.
        assert _common.launch_config(32768, 65536, BF16, "fwd", RMS) == _common.Tile(1, 8192, 8, 4, 1)
        assert _common.launch_config(32768, 40000, BF16, "fwd", RMS) == _common.Tile(1, 8192, 5, 4, 1)
        # Other op, dtype, row bucket: the heuristics.
        for args in ((32768, 4096, BF16, "fwd", LN), (32768, 4096, FP32, "fwd", RMS),
                     (32768, 4096, torch.float16, "fwd", RMS), (100, 4096, BF16, "fwd", RMS)):
            with T._using(T.empty(_common.ROW_BUCKETS), _common.ROW_BUCKETS):
                want = _common.launch_config(*args)
            assert _common.launch_config(*args) == want, args
        # Per device, by its capability: cuda:0 an sm_80 (no entry), cuda:1 an sm_90.
        cuda0 = cuda_devices(monkeypatch, ("sm_80", "sm_90"), ("Fake A100", "Fake H100"))
        cuda1 = torch.device("cuda", 1)
        assert _common.launch_config(32768, 4096, BF16, "fwd", RMS, cuda0) == static_fwd
        assert _common.launch_config(32768, 4096, BF16, "fwd", RMS, cuda1) == _common.Tile(2, 4096, 1, 8, 1)
    # Leaving the table: the heuristics again (the cache never answers with the old table).
    assert _common.launch_config(32768, 4096, BF16, "fwd", RMS) == static_fwd
    with T._using(table(entry(block_m=2, num_warps=8), arch="sm_80"), _common.ROW_BUCKETS):
        assert _common.launch_config(32768, 4096, BF16, "fwd", RMS) == static_fwd  # planned for sm_90


def test_one_tile_per_row_bucket_never_per_row_count():
    doc = table(entry(block_m=2, num_warps=8), entry(rows="<=2048", block_m=1, num_warps=4))
    few, many = (1, 3, 16, 511, 512, 2048), (2049, 3000, 4096, 32768, 1 << 20)
    with T._using(doc, _common.ROW_BUCKETS):
        for op in (RMS, LN):
            for n in (1000, 4096, 70000):
                for pass_ in ("fwd", "bwd"):
                    for group in (few, many):
                        tiles = {_common.launch_config(m, n, BF16, pass_, op) for m in group}
                        assert len(tiles) == 1, (op, n, pass_, tiles)
        assert _common.launch_config(7, 4096, BF16, "fwd", RMS) == _common.Tile(1, 4096, 1, 4, 1)
        assert _common.launch_config(7000, 4096, BF16, "fwd", RMS) == _common.Tile(2, 4096, 1, 8, 1)


def test_interpreter_never_reads_the_table():
    if not _common.interpreting(_rms_fwd_kernel):
        pytest.skip("the kernels are compiled here, not interpreted")
    before = _common.launch_config(64, 4096, BF16, "fwd", _rms_fwd_kernel)
    with T._using(table(entry(block_m=2, num_warps=8)), _common.ROW_BUCKETS):
        assert _common.launch_config(64, 4096, BF16, "fwd", _rms_fwd_kernel) == before
    assert before.block_m == 16  # the interpreter's own tiles: 64K elements, shrunk to the rows


def _broken(change):
    doc = table(entry(), entry(pass_="bwd", hidden=65536, block_n=4096, num_stages=3))
    change(doc)
    return doc


BROKEN = {
    "schema": lambda d: d.update(schema=2),
    "row buckets": lambda d: d.update(row_buckets=[1024]),
    "arch name": lambda d: d["archs"].update({"hopper": {"entries": []}}),
    "hidden not a power of two": lambda d: d["archs"]["sm_90"]["entries"][0].update(hidden=4000),
    "exact row count": lambda d: d["archs"]["sm_90"]["entries"][0].update(rows=4096),
    "op": lambda d: d["archs"]["sm_90"]["entries"][0].update(op="group_norm"),
    "split with block_m": lambda d: d["archs"]["sm_90"]["entries"][1]["tile"].update(block_m=2),
    "warps": lambda d: d["archs"]["sm_90"]["entries"][0]["tile"].update(num_warps=6),
    "wider than hidden": lambda d: d["archs"]["sm_90"]["entries"][0]["tile"].update(block_n=8192),
    "extra tile field": lambda d: d["archs"]["sm_90"]["entries"][0]["tile"].update(chunks=2),
    "no measurement": lambda d: d["archs"]["sm_90"]["entries"][0].pop("measured"),
    "no times": lambda d: d["archs"]["sm_90"]["entries"][0]["measured"].update(us={}),
    "no provenance": lambda d: d["archs"]["sm_90"]["entries"][0]["measured"].pop("commit"),
    "duplicate": lambda d: d["archs"]["sm_90"]["entries"].append(copy.deepcopy(d["archs"]["sm_90"]["entries"][0])),
}


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_schema_violations_are_named(what):
    assert T.problems(table(entry()), _common.ROW_BUCKETS) == []
    bad = T.problems(_broken(BROKEN[what]), _common.ROW_BUCKETS)
    assert bad, what
    with pytest.raises(ValueError):
        T.write(T.PATH.with_name("never-written.json"), _broken(BROKEN[what]), _common.ROW_BUCKETS)
    assert not T.PATH.with_name("never-written.json").exists()


def test_broken_package_table_is_ignored_with_a_warning(monkeypatch, tmp_path):
    bad = tmp_path / "launch_table.json"
    bad.write_text(json.dumps(_broken(BROKEN["split with block_m"])))
    monkeypatch.setattr(T, "PATH", bad)
    T.reload()
    with pytest.warns(UserWarning, match="ignoring the package launch table"):
        tile = _common.launch_config(32768, 4096, BF16, "fwd", RMS)
    with T._using(T.empty(_common.ROW_BUCKETS), _common.ROW_BUCKETS):
        assert tile == _common.launch_config(32768, 4096, BF16, "fwd", RMS)
    bad.write_text("{not json")
    T.reload()
    with pytest.warns(UserWarning, match="ignoring the package launch table"):
        _common.launch_config(32768, 4096, BF16, "fwd", RMS)


def test_write_is_atomic_and_merge_replaces_one_key(tmp_path):
    path = tmp_path / "t.json"
    doc = table(entry(num_warps=4), entry(pass_="bwd"))
    T.write(path, doc, _common.ROW_BUCKETS)
    assert T.read(path) == doc and [p.name for p in tmp_path.iterdir()] == ["t.json"]
    newer = T.merge(doc, "sm_90", [entry(num_warps=8)])
    tiles = {(e["pass"], e["tile"]["num_warps"]) for e in newer["archs"]["sm_90"]["entries"]}
    assert tiles == {("fwd", 8), ("bwd", 4)}
    assert doc["archs"]["sm_90"]["entries"][0]["tile"]["num_warps"] == 4  # merge copies


def test_forced_tile_layers_on_the_table_and_is_checked():
    key = ("sm_90", "rms_norm", "fwd", "bf16", 4096, ">2048")
    with T._using(table(entry(pass_="bwd", block_m=4, num_warps=8, num_stages=2)), _common.ROW_BUCKETS):
        with T.forced(key, {"block_m": 4, "block_n": 4096, "num_warps": 16, "num_stages": 1}, _common.ROW_BUCKETS):
            assert _common.launch_config(9999, 4096, BF16, "fwd", RMS) == _common.Tile(4, 4096, 1, 16, 1)
            assert _common.launch_config(9999, 4096, BF16, "bwd", RMS) == _common.Tile(4, 4096, 1, 8, 2)
        with pytest.raises(ValueError, match="block_m"):
            with T.forced(key, {"block_m": 2, "block_n": 1024, "num_warps": 4, "num_stages": 1}, _common.ROW_BUCKETS):
                pass


def test_stamp_names_the_table_a_benchmark_ran_with(tmp_path):
    path = tmp_path / "t.json"
    T.write(path, table(entry(), entry(pass_="bwd")), _common.ROW_BUCKETS)
    s = T.stamp("sm_90", path)
    assert s["entries"] == 2 and len(s["sha256"]) == 12
    assert T.stamp("sm_80", path)["entries"] == 0
    T.write(path, table(entry()), _common.ROW_BUCKETS)
    assert T.stamp("sm_90", path)["sha256"] != s["sha256"]
    assert T.stamp("sm_90", tmp_path / "missing.json") == {"arch": "sm_90", "sha256": None, "entries": None}


# ----------------------------------------------------------------------------------------------
# The user table (normswap tune's, per machine): on top of the committed one, per device name.

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def test_user_table_path(monkeypatch, tmp_path):
    monkeypatch.delenv(T.USER_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert T.user_path() == tmp_path / "home" / ".cache" / "normswap" / "launch_table.json"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert T.user_path() == tmp_path / "xdg" / "normswap" / "launch_table.json"
    monkeypatch.setenv(T.USER_ENV, str(tmp_path / "mine.json"))
    assert T.user_path() == tmp_path / "mine.json"
    monkeypatch.setenv(T.USER_ENV, "off")
    assert T.user_path() is None


@pytest.fixture
def tables(monkeypatch, tmp_path):
    """A committed table with one sm_90 entry and a user table (at $NORMSWAP_LAUNCH_TABLE) with an
    entry for the same key and one for a key the committed table lacks, both measured on an H100;
    cuda:0 is an sm_90 whose name the test sets."""
    committed, user = tmp_path / "committed.json", tmp_path / "user.json"
    T.write(committed, table(entry(block_m=2, num_warps=8)), _common.ROW_BUCKETS)
    mine = [entry(block_m=4, num_warps=16), entry(pass_="bwd", block_m=1, num_warps=4, num_stages=2)]
    for e in mine:
        e["measured"].update(device=H100, kernel_build=T.kernel_build())
    T.write(user, table(*mine), _common.ROW_BUCKETS)
    monkeypatch.setattr(T, "PATH", committed)
    monkeypatch.setenv(T.USER_ENV, str(user))
    cuda_devices(monkeypatch, "sm_90", H100)
    T.reload()

    def tiles(device_name):
        cuda = cuda_devices(monkeypatch, "sm_90", device_name)
        return (_common.launch_config(32768, 4096, BF16, "fwd", RMS, cuda),
                _common.launch_config(32768, 4096, BF16, "bwd", RMS, cuda))
    yield user, tiles
    T.reload()


def test_user_entry_wins_on_the_device_it_was_measured_on(tables):
    user, tiles = tables
    with T._using(T.empty(_common.ROW_BUCKETS), _common.ROW_BUCKETS):
        static_bwd = _common.launch_config(32768, 4096, BF16, "bwd", RMS)
    assert tiles(H100) == (_common.Tile(4, 4096, 1, 16, 1), _common.Tile(1, 4096, 1, 4, 2))
    # Same architecture, another GPU model: the committed entry, the heuristics for the rest.
    assert tiles(H200) == (_common.Tile(2, 4096, 1, 8, 1), static_bwd)
    # Meta tensors (the static analysis' plan) have no device name: the committed table.
    assert _common.launch_config(32768, 4096, BF16, "fwd", RMS, torch.device("meta")) == _common.Tile(2, 4096, 1, 8, 1)
    s = T.status(_common.ROW_BUCKETS, "sm_90", H200)
    assert s["user"]["state"] == "loaded" and (s["user"]["entries"], s["user"]["apply"]) == (2, 0)
    assert s["user"]["other_devices"] == [H100] and s["committed"]["apply"] == 1
    assert T.status(_common.ROW_BUCKETS, "sm_90", H100)["user"]["apply"] == 2


def test_user_table_off_and_reload(tables, monkeypatch):
    user, tiles = tables
    assert tiles(H100)[0] == _common.Tile(4, 4096, 1, 16, 1)
    monkeypatch.setenv(T.USER_ENV, "off")
    assert tiles(H100)[0] == _common.Tile(4, 4096, 1, 16, 1)  # read once per process: still the user's
    T.reload()  # the next launch reads the tables again: the committed entry
    assert tiles(H100)[0] == _common.Tile(2, 4096, 1, 8, 1)
    assert T.status(_common.ROW_BUCKETS, "sm_90", H100)["user"] == {"path": None, "state": "off", "entries": 0,
                                                                     "apply": 0, "other_devices": []}
    # A table rewritten on disk (normswap tune in this process reloads): the new tile, not a cached one.
    monkeypatch.setenv(T.USER_ENV, str(user))
    doc = T.read(user)
    doc["archs"]["sm_90"]["entries"][0]["tile"]["num_warps"] = 32
    T.write(user, doc, _common.ROW_BUCKETS)
    gen = T.generation(_common.ROW_BUCKETS)
    T.reload()
    assert T.generation(_common.ROW_BUCKETS) != gen
    assert _common.launch_config(32768, 4096, BF16, "fwd", RMS, torch.device("cuda", 0)) == _common.Tile(4, 4096, 1, 32, 1)


def test_invalid_user_table_warns_once_and_is_ignored(tables):
    import warnings

    user, tiles = tables
    for broken in ("{not json", json.dumps(_broken(BROKEN["split with block_m"]))):
        user.write_text(broken)
        T.reload()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert tiles(H100)[0] == _common.Tile(2, 4096, 1, 8, 1)  # the committed entry answers
            tiles(H200)
            _common.launch_config(100, 1000, FP32, "bwd", LN, torch.device("cuda", 0))
        assert [str(w.message) for w in seen if "launch table" in str(w.message)] == [
            next(str(w.message) for w in seen)]
        assert "ignoring the user launch table" in str(seen[0].message) and str(user) in str(seen[0].message)
        assert T.status(_common.ROW_BUCKETS, "sm_90", H100)["user"]["state"] == "invalid"


UPDATER = '''
import sys
from pathlib import Path

from normswap.kernels import _common as C
from normswap.kernels import launch_table as T

path, which, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
# Start together (both past their imports), so that the writes interleave.
(path.parent / ("ready-" + which)).touch()
while len(list(path.parent.glob("ready-*"))) < 2:
    pass
for i in range(count):
    e = {"op": "rms_norm", "pass": "fwd", "dtype": "bf16", "hidden": 2 ** (i % 20),
         "rows": ">2048" if which == "a" else "<=2048", "tile": {"block_m": 1, "block_n": 2 ** (i % 20),
         "num_warps": 1, "num_stages": 1}, "measured": {"device": "writer " + which, "date": "-", "torch": "-",
         "triton": "-", "commit": "-", "us": {"1": 1.0 + i}, "static": None, "runner_up": None}}
    T.update(path, "sm_%d" % (80 + i // 20), [e], C.ROW_BUCKETS)
'''


def test_two_writers_of_one_table_keep_each_others_entries(tmp_path):
    """Two processes updating one table at once (two `normswap tune` on one user table), each
    adding 60 entries of its own keys one by one: every entry of both is in the file at the end,
    no writer failed and no temporary file is left. Without the lock around the read-merge-write
    (each merging into the copy it read before the other wrote) entries are lost; with a shared
    temporary name one writer renames the other's file away and fails."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "updater.py"
    script.write_text(UPDATER)
    table_path = tmp_path / "user.json"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    procs = [subprocess.Popen([sys.executable, str(script), str(table_path), w, "100"], env=env,
                              stderr=subprocess.PIPE, text=True) for w in ("a", "b")]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    doc = T.read(table_path)
    assert T.problems(doc, _common.ROW_BUCKETS) == []
    got = {(arch, e["rows"], e["hidden"], e["measured"]["device"]) for arch, b in doc["archs"].items()
           for e in b["entries"]}
    assert len(got) == 200 and {d for *_, d in got} == {"writer a", "writer b"}
    left = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("ready-a", "ready-b"))
    assert left == ["updater.py", "user.json"]  # no lock file either


def test_a_writer_waiting_on_a_first_write_that_fails_makes_the_folder_again(tmp_path, monkeypatch):
    """Two writers start one table in a new folder; the first one's write fails (a full disk,
    Ctrl-C) and its clean-up removes the folder it made, while the second waits on its lock: the
    second failed ('cannot create the lock file'), its measured entry lost. It makes the folder
    again and writes; the first leaves nothing."""
    import errno
    import threading

    from tests.lock_checks import wait_until_someone_waits_on

    path = tmp_path / "new" / "t.json"
    real = T.write
    second_done = []

    def second():
        second_done.append(T.update(path, "sm_90", [entry(pass_="bwd")], _common.ROW_BUCKETS))

    waiter = threading.Thread(target=second)

    def write(*a, **k):
        if threading.current_thread() is waiter:
            return real(*a, **k)
        waiter.start()  # the first holds the lock: the second finds the folder and waits on it
        wait_until_someone_waits_on(path.with_name("t.json.lock"))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(T, "write", write)
    with pytest.raises(OSError, match="No space left"):
        T.update(path, "sm_90", [entry()], _common.ROW_BUCKETS)
    waiter.join(60)
    assert second_done, "the second writer failed"
    doc = T.read(path)
    assert [e["pass"] for e in doc["archs"]["sm_90"]["entries"]] == ["bwd"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["t.json"]


def test_a_writer_through_a_link_holds_the_lock_of_the_table_it_leads_to(tmp_path, monkeypatch):
    """A write to a link goes through it to the table (fileio.replaced_atomically), but update's
    lock was taken beside the link: one writer through a link (latest.json) and one of the table
    itself each held a lock of their own, and the later rename dropped the other's entries. The
    writer through the link waits on the table's lock; both entries are kept, the link stays."""
    import threading
    from pathlib import Path

    from tests.lock_checks import wait_until_someone_waits_on

    target = tmp_path / "tables" / "t.json"
    T.update(target, "sm_90", [entry()], _common.ROW_BUCKETS)
    link = tmp_path / "latest.json"
    link.symlink_to(Path("tables") / "t.json")
    real = T.write
    through_link = threading.Thread(target=lambda: T.update(link, "sm_90", [entry(pass_="bwd")], _common.ROW_BUCKETS))

    def write(*a, **k):
        if threading.current_thread() is not through_link:  # the table's own writer, holding its lock
            through_link.start()
            wait_until_someone_waits_on(target.with_name("t.json.lock"), timeout=10)
        return real(*a, **k)

    monkeypatch.setattr(T, "write", write)
    T.update(target, "sm_90", [entry(dtype="fp16")], _common.ROW_BUCKETS)
    through_link.join(60)
    entries = T.read(target)["archs"]["sm_90"]["entries"]
    assert sorted((e["pass"], e["dtype"]) for e in entries) == [("bwd", "bf16"), ("fwd", "bf16"), ("fwd", "fp16")]
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "tables"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["t.json"]


def test_update_refuses_a_table_broken_on_disk(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(ValueError):
        T.update(path, "sm_90", [entry()], _common.ROW_BUCKETS)
    assert path.read_text() == "{not json"
    fresh = tmp_path / "new.json"
    doc = T.update(fresh, "sm_90", [entry()], _common.ROW_BUCKETS, base=table(entry(pass_="bwd")))
    assert T.read(fresh) == doc and len(doc["archs"]["sm_90"]["entries"]) == 2
    assert oct(fresh.stat().st_mode & 0o777) == oct(0o644)  # not mkstemp's 0600


def test_user_entry_of_other_kernels_is_stale(tables, capsys):
    """A user entry measured with other kernels (another triton, another normswap: its kernel_build
    differs, or it has none) is never launched: the committed entry and the heuristics answer, and
    status counts it as stale. The build is a fingerprint of the triton version and the sources."""
    user, tiles = tables
    with T._using(T.empty(_common.ROW_BUCKETS), _common.ROW_BUCKETS):
        static_bwd = _common.launch_config(32768, 4096, BF16, "bwd", RMS)
    assert len(T.kernel_build()) == 12 and T.kernel_build() == T.kernel_build()
    doc = T.read(user)
    doc["archs"]["sm_90"]["entries"][0]["measured"]["kernel_build"] = "0123456789ab"  # the fwd entry
    del doc["archs"]["sm_90"]["entries"][1]["measured"]["kernel_build"]
    T.write(user, doc, _common.ROW_BUCKETS)
    T.reload()
    assert tiles(H100) == (_common.Tile(2, 4096, 1, 8, 1), static_bwd)
    s = T.status(_common.ROW_BUCKETS, "sm_90", H100)["user"]
    assert (s["state"], s["entries"], s["stale"], s["apply"]) == ("loaded", 2, 2, 0)
    doc["archs"]["sm_90"]["entries"][0]["measured"]["kernel_build"] = T.kernel_build()
    T.write(user, doc, _common.ROW_BUCKETS)
    T.reload()
    assert tiles(H100) == (_common.Tile(4, 4096, 1, 16, 1), static_bwd)
    assert T.status(_common.ROW_BUCKETS, "sm_90", H100)["user"]["stale"] == 1
    from normswap.cli.tune import render_status

    render_status(T.status(_common.ROW_BUCKETS, "sm_90", H100))
    assert ", 1 for this device, 1 stale (measured with other kernels" in capsys.readouterr().out
