"""The launch-table tuner (normswap/kernels/tune.py, run by `normswap tune` and
benchmarks/tune.py), checked on CPU: the candidates it would time, the keys it walks (never an
exact row count), and the whole selection and table writing with the GPU work injected (fake
static verdicts, fake times, fake outputs), so that the choice rules are proven without a GPU.
Nothing here measures anything."""

from __future__ import annotations

import math

import pytest
import torch

from normswap.errors import NormswapError
from normswap.kernels import _common as C
from normswap.kernels import launch_table as T
from tests.fake_device import RMS, cuda_devices


@pytest.fixture(scope="module")
def tune():
    from normswap.kernels import tune

    return tune


@pytest.fixture(autouse=True)
def _own_tempdir(monkeypatch, tmp_path_factory):
    """The per-GPU timing locks (tune.timing_lock_path) go in a temporary folder of the test's own."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("locks")))


def test_candidates_start_with_the_heuristics_and_stay_valid(tune):
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    for pass_ in ("fwd", "bwd"):
        for dtype, dt in dtypes.items():
            for n in (1024, 4096, 8192, 16384, 32768, 262144):
                for m in (512, 32768):
                    tiles = tune.candidates(pass_, dtype, n, m)
                    assert tiles[0] == C.tile_fields(C.heuristic_config(m, n, dt, pass_))
                    assert 3 <= len(tiles) <= 12 and len({tuple(t.values()) for t in tiles}) == len(tiles)
                    for t in tiles:
                        assert T.tile_problems(t, n) == [], (pass_, dtype, n, t)
                        # at least one 16-byte vector of the tile per thread
                        assert t["block_m"] * t["block_n"] * dt.itemsize >= t["num_warps"] * 32 * 16
                        if pass_ == "fwd":
                            assert t["num_stages"] == 1  # the forward has no loop to pipeline
    # At the whole-row limit both layouts are tried: whole rows and the row split over programs.
    at_limit = tune.candidates("fwd", "bf16", C.MAX_BLOCK_N, 32768)
    assert {t["block_n"] < C.MAX_BLOCK_N for t in at_limit} == {True, False}
    past = tune.candidates("fwd", "bf16", 2 * C.MAX_BLOCK_N, 32768)
    assert past[0]["block_n"] < 2 * C.MAX_BLOCK_N and any(t["block_n"] == 2 * C.MAX_BLOCK_N for t in past)
    # The backward's pipelining depth is tuned around its default, and unpipelined (depth 1: the
    # rows' loads keep their L2 hint under every triton).
    assert {t["num_stages"] for t in tune.candidates("bwd", "bf16", 4096, 32768)} == {
        1, C.STAGES["bwd"] - 1, C.STAGES["bwd"], C.STAGES["bwd"] + 1}


def test_grid_keys_are_buckets_in_priority_order(tune):
    keys = tune.grid_keys(["rms_norm", "layer_norm"], ["fwd", "bwd"], ["bf16", "fp32"])
    labels = T.bucket_labels(C.ROW_BUCKETS)
    assert all(k["rows"] in labels for k in keys)
    assert len({tuple(k[f] for f in T.KEY_FIELDS) for k in keys}) == len(keys)
    # 9 hidden sizes in the bucket of many rows (4096 and 32768 both timed), 512 x 4096 in the other.
    assert len(keys) == 2 * 2 * 2 * 10
    first = keys[0]
    assert (first["op"], first["pass"], first["dtype"], first["rows"]) == ("rms_norm", "fwd", "bf16", ">2048")
    assert first["row_counts"] == [4096, 32768]
    few = [k for k in keys if k["rows"] == "<=2048"]
    assert {(k["hidden"], tuple(k["row_counts"])) for k in few} == {(4096, (512,))}
    assert [k["dtype"] for k in keys].index("fp32") == len(keys) // 2  # every bf16 key first
    assert all(k["n"] == k["hidden"] for k in keys)  # the grid's widths are their own buckets


def test_user_hidden_sizes_are_tuned_in_their_buckets_at_their_own_width(tune):
    """--hidden: a model's widths (any size), each at many rows and at 512 (decode-sized batches),
    keyed by its power-of-two bucket; two widths of one bucket make one key, timed at the wider."""
    keys = tune.grid_keys(["rms_norm"], ["bwd"], ["bf16"], hidden=[65536])
    assert keys == [
        {"op": "rms_norm", "pass": "bwd", "dtype": "bf16", "hidden": 65536, "rows": ">2048", "row_counts": [4096, 32768],
         "n": 65536},
        {"op": "rms_norm", "pass": "bwd", "dtype": "bf16", "hidden": 65536, "rows": "<=2048", "row_counts": [512],
         "n": 65536}]
    keys = tune.grid_keys(["rms_norm"], ["fwd"], ["bf16"], hidden=[2560, 3072, 5120])
    assert [(k["hidden"], k["rows"], k["n"]) for k in keys] == [
        (4096, ">2048", 3072), (8192, ">2048", 5120), (4096, "<=2048", 3072), (8192, "<=2048", 5120)]


def _fake(tiles, times, rejected_static=(), disagree=(), broken=()):
    """Injected GPU work: times[i] = us of tiles[i] at every row count (scaled by rows)."""
    idx = {tuple(t.values()): i for i, t in enumerate(tiles)}

    def static_check(ts):
        return [["spills 8 bytes"] if idx[tuple(t.values())] in rejected_static else [] for t in ts]

    def measure(tile, m):
        i = idx[tuple(tile.values())]
        if i in broken:
            raise RuntimeError("launch failed\nsecond line")
        return times[i] * m / 4096

    def outputs(tile):
        return ["off"] if idx[tuple(tile.values())] in disagree else ["same"]

    def agree(outs, ref):
        return None if outs == ref else "3 elements off by more than 2 ulp"
    return static_check, measure, outputs, agree


KEY = ("sm_90", "rms_norm", "fwd", "bf16", 4096, ">2048")


def test_selection_takes_the_fastest_sound_candidate(tune):
    tiles = tune.candidates("fwd", "bf16", 4096, 32768)
    times = [10.0] + [11.0] * (len(tiles) - 1)
    times[1], times[2], times[3], times[4] = 5.0, 6.0, 8.0, 9.0  # 1: spills, 2: wrong output, 3: fails
    entry, trials = tune.tune_key(KEY, [4096, 32768], tiles, *_fake(tiles, times, {1}, {2}, {3}), log=lambda s: None)
    assert entry["tile"] == tiles[4] and entry["static"]["tile"] == tiles[0]
    assert entry["us"] == {"4096": 9.0, "32768": 72.0} and entry["static"]["us"] == {"4096": 10.0, "32768": 80.0}
    assert entry["runner_up"]["tile"] == tiles[0]  # the next best sound candidate
    why = [t["why"] or "" for t in trials]
    assert why[1].startswith("static: spills") and "differs from the baseline" in why[2]
    assert why[3] == "error: RuntimeError: launch failed" and not why[0] and not why[4]
    assert not trials[1]["us"] and not trials[2]["us"]  # rejected before any timing


def test_noise_never_moves_the_choice(tune):
    tiles = tune.candidates("fwd", "bf16", 4096, 32768)
    times = [10.0] + [10.5] * (len(tiles) - 1)
    times[5] = 10.0 * (1 - tune.MIN_GAIN / 2)  # 1% faster: within noise
    entry, _ = tune.tune_key(KEY, [4096], tiles, *_fake(tiles, times), log=lambda s: None)
    assert entry["tile"] == tiles[0] and entry["runner_up"]["tile"] == tiles[5]
    times[5] = 10.0 * (1 - 2 * tune.MIN_GAIN)
    entry, _ = tune.tune_key(KEY, [4096], tiles, *_fake(tiles, times), log=lambda s: None)
    assert entry["tile"] == tiles[5] and entry["runner_up"]["tile"] == tiles[0]
    # Scored over every row count: faster at one, slower at the other, by the geometric mean.
    assert math.isclose(tune.score({1: 8.0, 2: 12.5}, {1: 10.0, 2: 10.0}), 1.0)


def test_no_baseline_no_entry(tune):
    tiles = tune.candidates("fwd", "bf16", 4096, 32768)
    entry, trials = tune.tune_key(KEY, [4096], tiles, *_fake(tiles, [1.0] * len(tiles), broken={0}),
                                  log=lambda s: None)
    assert entry is None and trials[0]["why"].startswith("error")
    assert all(not t["us"] for t in trials)  # nothing is compared with a baseline that did not run
    entry, trials = tune.tune_key(KEY, [4096], tiles, *_fake(tiles, [1.0] * len(tiles)), deadline=0.0,
                                  log=lambda s: None)
    assert entry is None and trials[0]["why"] == "not measured (time limit)"


def test_a_key_cut_by_the_budget_is_not_written(tune, monkeypatch):
    """The budget runs out after three candidates: the key gets no entry (a later run tunes it
    whole), although the baseline and two others were timed."""
    tiles = tune.candidates("fwd", "bf16", 4096, 32768)
    clock = iter(range(1000))
    monkeypatch.setattr(tune.time, "monotonic", lambda: next(clock))
    entry, trials = tune.tune_key(KEY, [4096], tiles, *_fake(tiles, [3.0, 1.0] + [2.0] * (len(tiles) - 2)),
                                  deadline=2.5, log=lambda s: None)
    assert entry is None
    assert [bool(t["us"]) for t in trials[:4]] == [True, True, True, False]
    assert trials[3]["why"] == "not measured (time limit)"


def test_tuned_table_is_written_after_every_key_and_read_back(tune, tmp_path):
    """The whole loop with injected GPU work: the table validates after each key, launch_config
    picks every winner for its key (any row count in the bucket), the report names winner and
    static choice, and a second run skips what the table has."""
    keys = [k for k in tune.grid_keys(["rms_norm"], ["fwd", "bwd"], ["bf16"]) if k["hidden"] in (4096, 65536)]
    out, rep = tmp_path / "table.json", tmp_path / "tune.md"
    meta = {"device": "injected (test)", "arch": "sm_90", "date": "2000-01-01", "torch": "-", "triton": "-",
            "commit": "abc"}
    picks: dict = {}
    seen_files = []

    def measure(key, n):
        assert n == key[4]  # the grid's widths are their buckets
        tiles = tune.candidates(key[2], key[3], key[4], 32768 if key[5] == ">2048" else 512)
        fastest = len(tiles) - 1  # the last candidate is much faster than the rest
        picks[key] = tiles[fastest]
        seen_files.append(out.exists() and not T.problems(T.read(out), C.ROW_BUCKETS))
        return lambda tile, m: (1.0 if tile == tiles[fastest] else 2.0) * m

    done = tune.tune_keys(keys, T.empty(C.ROW_BUCKETS), meta, out, rep, retune=False, deadline=math.inf,
                          fits=lambda k, m: m < 32768 or k["hidden"] < 65536,
                          static_check=lambda key: lambda ts: [[] for _ in ts], measure=measure,
                          outputs=lambda key, n, m: lambda tile: [0], agree=lambda dt: lambda a, b: None,
                          log=lambda s: None)
    assert len(done) == len(keys) == 6 and all(d["entry"] for d in done)
    assert seen_files[0] is False and all(seen_files[1:])  # rewritten, valid, after every key
    doc = T.read(out)
    assert T.problems(doc, C.ROW_BUCKETS) == []
    entries = doc["archs"]["sm_90"]["entries"]
    assert len(entries) == 6 and all(e["measured"]["commit"] == "abc" for e in entries)
    wide = next(e for e in entries if e["hidden"] == 65536 and e["pass"] == "fwd")
    assert set(wide["measured"]["us"]) == {"4096"}  # 32768 rows did not fit: not timed
    with T._using(doc, C.ROW_BUCKETS):
        for key, tile in picks.items():
            _, op, pass_, dtype, hidden, label = key
            for m in ((512, 7, 2048) if label == "<=2048" else (2049, 4096, 32768, 100000)):
                got = C.launch_config(m, hidden, torch.bfloat16, pass_, RMS)
                assert C.tile_fields(got) == tile, (key, m)
    text = rep.read_text()
    assert "| rms_norm | fwd | bf16 | 4096 | >2048 |" in text and "+50.0%" in text
    # Run again: every key is in the table, nothing is re-measured.
    again = tune.tune_keys(keys, doc, meta, out, rep, retune=False, deadline=math.inf, fits=lambda k, m: True,
                           static_check=None, measure=None, outputs=None, agree=None, log=lambda s: None)
    assert again == []


def test_a_table_written_meanwhile_by_another_tuner_keeps_its_entries(tune, tmp_path):
    """While this run times a key, another tuner (another `normswap tune` on the same user table)
    writes an entry of its own: this run's write merges into the file as it is then, so both
    entries are in it (written from this run's copy, read before, the other's would be lost)."""
    keys = [k for k in tune.grid_keys(["rms_norm"], ["fwd"], ["bf16"]) if k["hidden"] == 4096 and k["rows"] == ">2048"]
    out, rep = tmp_path / "table.json", tmp_path / "tune.md"
    meta = {"device": "injected (test)", "arch": "sm_90", "date": "-", "torch": "-", "triton": "-", "commit": "-"}
    other = {"op": "layer_norm", "pass": "bwd", "dtype": "fp32", "hidden": 1024, "rows": "<=2048",
             "tile": {"block_m": 4, "block_n": 1024, "num_warps": 4, "num_stages": 2},
             "measured": dict(meta, device="the other tuner's GPU", us={"512": 3.0}, static=None, runner_up=None)}

    def measure(key, n):
        def timed(tile, m):
            if not out.exists():  # the other tuner finishes its key first
                T.write(out, T.merge(T.empty(C.ROW_BUCKETS), "sm_90", [other]), C.ROW_BUCKETS)
            return 1.0
        return timed

    tune.tune_keys(keys, T.empty(C.ROW_BUCKETS), meta, out, rep, retune=False, deadline=math.inf,
                   fits=lambda k, m: True, static_check=lambda key: lambda ts: [[] for _ in ts], measure=measure,
                   outputs=lambda key, n, m: lambda tile: [0], agree=lambda dt: lambda a, b: None, log=lambda s: None)
    entries = T.read(out)["archs"]["sm_90"]["entries"]
    assert {(e["op"], e["measured"]["device"]) for e in entries} == {("rms_norm", "injected (test)"),
                                                                       ("layer_norm", "the other tuner's GPU")}


def _tune_one_key(tune, out, pass_="fwd"):
    """tune_keys on one key (rms_norm PASS_ bf16 4096, >2048 rows) into `out`, the GPU work injected."""
    keys = [k for k in tune.grid_keys(["rms_norm"], [pass_], ["bf16"]) if k["hidden"] == 4096 and k["rows"] == ">2048"]
    meta = {"device": "injected (test)", "arch": "sm_90", "date": "-", "torch": "-", "triton": "-", "commit": "-"}
    doc = T.read(out) if out.exists() else T.empty(C.ROW_BUCKETS)
    return tune.tune_keys(keys, doc, meta, out, out.with_suffix(".md"), retune=False, deadline=math.inf,
                          fits=lambda k, m: True, static_check=lambda key: lambda ts: [[] for _ in ts],
                          measure=lambda key, n: lambda tile, m: 1.0, outputs=lambda key, n, m: lambda tile: [0],
                          agree=lambda dt: lambda a, b: None, log=lambda s: None)


@pytest.mark.parametrize("error, raised", [(OSError(28, "No space left on device"), OSError),
                                           (ValueError("refusing to write an invalid launch table: x"), NormswapError),
                                           (KeyboardInterrupt(), KeyboardInterrupt)])
def test_a_failed_first_table_write_leaves_nothing_the_run_made(tune, tmp_path, monkeypatch, error, raised):
    """The first write of a table in a new folder fails (a full disk, a refused table, Ctrl-C):
    no folder is left behind (a lock file left there kept the folder that the write made). In a
    folder that was there, the folder stays as it was. No write leaves its lock file."""
    def failing(*a, **k):
        raise error

    new = tmp_path / "new" / "deeper"
    there = tmp_path / "there"
    there.mkdir()
    (there / "keep.txt").write_text("mine")
    for out in (new / "table.json", there / "table.json"):
        with monkeypatch.context() as m:
            m.setattr(T, "write", failing)
            with pytest.raises(raised):
                _tune_one_key(tune, out)
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in there.iterdir()) == ["keep.txt"]
    assert _tune_one_key(tune, new / "table.json")[0]["entry"] is not None  # a write that succeeds: all stays
    assert (new / "table.json").is_file() and not (new / "table.json.lock").exists()
    with monkeypatch.context() as m:
        m.setattr(T, "write", failing)
        with pytest.raises(raised):
            _tune_one_key(tune, new / "table.json", "bwd")
    assert (new / "table.json").is_file() and not (new / "table.json.lock").exists()  # a later write's failure: kept


def test_agreement_runs_where_the_candidate_launches(tune, tmp_path):
    """A forced tile answers only for row counts in its own bucket: the agreement check must run
    at such a count, or the candidate is never launched there and every candidate 'agrees' (the
    heuristics' tile compared with itself). Asked of tune_keys with the GPU work injected, and
    checked against launch_config under the forced tile."""
    keys = [k for k in tune.grid_keys(["rms_norm"], ["fwd"], ["bf16"]) if k["hidden"] == 4096]
    meta = {"device": "injected (test)", "arch": "sm_90", "date": "-", "torch": "-", "triton": "-", "commit": "-"}
    asked = []

    def outputs(key, n, m):
        asked.append((key, m))
        return lambda tile: [0]

    tune.tune_keys(keys, T.empty(C.ROW_BUCKETS), meta, tmp_path / "t.json", tmp_path / "t.md", retune=False,
                   deadline=math.inf, fits=lambda k, m: True, static_check=lambda key: lambda ts: [[] for _ in ts],
                   measure=lambda key, n: lambda tile, m: 1.0, outputs=outputs, agree=lambda dt: lambda a, b: None,
                   log=lambda s: None)
    assert sorted(key[5] for key, _ in asked) == sorted(T.bucket_labels(C.ROW_BUCKETS))
    for key, m in asked:
        assert m <= max(tune.AGREE_ROWS, C.ROW_BUCKETS[-1] + 1)  # few rows: the check stays cheap
        tile = tune.candidates("fwd", "bf16", 4096, m)[-1]
        assert tile != C.tile_fields(C.heuristic_config(m, 4096, torch.bfloat16, "fwd"))
        with T.forced(key, tile, C.ROW_BUCKETS):
            assert C.tile_fields(C.launch_config(m, 4096, torch.bfloat16, "fwd", RMS)) == tile, (key, m)


def test_without_cuda_nothing_is_written(tune, monkeypatch, capsys, tmp_path):
    """The library raises one NormswapError before touching the table; benchmarks/tune.py (the GPU
    runbook's entry) turns it into one line and exit 2."""
    from benchmark_scripts import load_script

    from normswap.errors import NormswapError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NormswapError, match="^tuning needs a CUDA device"):
        tune.tune_launches(out=tmp_path / "t.json")
    assert load_script("tune").main(["--out", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["benchmarks/tune.py: tuning needs a CUDA device (it times kernel launches on it); nothing written"]
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, but the interpreter on
    monkeypatch.setattr(C, "interpreting", lambda kernel: True)
    with pytest.raises(NormswapError, match="TRITON_INTERPRET is set"):
        tune.tune_launches(out=tmp_path / "t.json")
    assert list(tmp_path.iterdir()) == []


def test_agreement_rule_allows_rounding_and_catches_wrong_outputs(tune):
    """gpu_agree is plain torch: a last-bit difference (another reduction order) passes, a wrong
    element, a non-finite one or a parameter grad off by 5% does not (dW is rounded to the weight's dtype: a bf16 ulp is 0.8%)."""
    g = torch.Generator().manual_seed(0)
    for dtype, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        agree = tune.gpu_agree(dtype)
        y = torch.randn(64, 256, generator=g).to(dt)
        dx = torch.randn(64, 256, generator=g).to(dt)
        dw = torch.randn(256, generator=g) * 100
        one_ulp = torch.nextafter(y.float(), torch.full_like(y.float(), math.inf)).to(dt)
        if dt == torch.bfloat16:  # nextafter in fp32 rounds back to y: step one bf16 ulp by hand
            one_ulp = (y.float() * (1 + torch.finfo(dt).eps)).to(dt)
        assert agree([one_ulp, dx, dw * (1 + 1e-6)], [y, dx, dw]) is None
        wrong = y.clone()
        wrong[3, 7] += 1.0
        assert "1 elements off" in agree([wrong, dx, dw], [y, dx, dw])
        nan = dx.clone()
        nan[0, 0] = float("nan")
        assert "non-finite" in agree([y, nan, dw], [y, dx, dw])
        assert "parameter grad 0" in agree([y, dx, dw * 1.05], [y, dx, dw])


@pytest.mark.parametrize("op", ("rms_norm", "layer_norm"))
def test_gpu_side_plumbing_runs_through_the_interpreter(tune, tmp_path, op):
    """The functions that do the GPU work (inputs, outputs under a forced tile, agreement,
    timing.py's case and timer), wired by the same _factories tune_launches uses, on CPU through
    the interpreter (which never reads the table: this proves the plumbing, never a choice), so
    that an API slip fails here and not on a GPU lease. Backward keys: y, dx and every parameter
    grad compared."""
    from normswap.kernels.rms_norm import _rms_fwd_kernel

    if not C.interpreting(_rms_fwd_kernel):
        pytest.skip("the CPU plumbing check runs through the interpreter")
    # An interpreter that cannot run the kernels (triton <= 3.6 with numpy >= 2.4) fails every
    # candidate of a persistent launch: that says nothing about the plumbing.
    why = C.triton_unavailable_reason(_rms_fwd_kernel)
    if why:
        pytest.skip(f"triton kernels cannot run here: {why}")
    keys = [{"op": op, "pass": p, "dtype": "bf16", "hidden": 64, "rows": ">2048", "row_counts": [8], "n": 48}
            for p in ("fwd", "bwd")]
    meta = {"device": "cpu plumbing (test)", "arch": "sm_90", "date": "-", "torch": "-", "triton": "-",
            "commit": "-"}
    out = tmp_path / "table.json"
    done = tune.tune_keys(
        keys, T.empty(C.ROW_BUCKETS), meta, out, tmp_path / "r.md", retune=False, deadline=math.inf,
        log=lambda s: None, **tune._factories(1 << 20, lambda key: lambda ts: [[] for _ in ts], device="cpu"))
    assert [d["entry"] is not None for d in done] == [True, True]
    for d in done:
        assert not [t["why"] for t in d["trials"] if t["why"]]  # every candidate ran and agreed
        assert all(t["us"][8] > 0 for t in d["trials"])
    outs = tune.gpu_outputs(("sm_90", op, "bwd", "bf16", 64, ">2048"), done[1]["entry"]["tile"], 8, 48, device="cpu")
    assert len(outs) == (3 if op == "rms_norm" else 4) and outs[1].shape == (8, 48)
    doc = T.read(out)
    assert T.problems(doc, C.ROW_BUCKETS) == []
    assert {e["measured"]["hidden_timed"] for e in doc["archs"]["sm_90"]["entries"]} == {48}


# ----------------------------------------------------------------------------------------------
# tune_launches and `normswap tune` end to end, with a fake GPU: the environment check passes,
# the device is named, and the GPU work (static check, outputs, times) is injected; the last
# candidate of every key is the fastest.

FAKE = "Fake GPU 80GB (test)"


def _fake_gpu(monkeypatch, tune, name=FAKE, static_targets=None):
    """static_targets: a list that receives the static check's target of every run."""
    import contextlib

    from normswap.kernels.static_check import h100

    monkeypatch.setattr(tune, "_environment_problem", lambda: None)
    monkeypatch.setattr(tune, "_this_device", lambda: {"device": name, "arch": "sm_90", "l2": 1 << 20,
                                                       "target": h100(), "torch": "-", "triton": "-"})
    measured = []

    @contextlib.contextmanager
    def work(l2, target=None):
        if static_targets is not None:
            static_targets.append(target)

        def measure(key, n):
            tiles = tune.candidates(key[2], key[3], key[4], 32768 if key[5] == ">2048" else 512)
            measured.append((key, n))
            return lambda tile, m: (1.0 if tile == tiles[-1] else 2.0) * m
        yield {"fits": lambda k, m: True, "static_check": lambda key: lambda ts: [[] for _ in ts],
               "measure": measure, "outputs": lambda key, n, m: lambda tile: [0], "agree": lambda dt: lambda a, b: None}
    monkeypatch.setattr(tune, "_gpu_work", work)
    return measured


def _on(monkeypatch, name):
    """launch_config's view of cuda:0 as an sm_90 device called `name` (no CUDA here)."""
    cuda = cuda_devices(monkeypatch, "sm_90", name)
    return lambda m: C.tile_fields(C.launch_config(m, 5000, torch.bfloat16, "fwd", RMS, cuda))


@pytest.fixture
def user_cache(monkeypatch, tmp_path):
    """The default user table under $XDG_CACHE_HOME (the test suite runs with the user table off)."""
    monkeypatch.delenv(T.USER_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    T.reload()
    yield tmp_path / "cache" / "normswap" / "launch_table.json"
    T.reload()


def test_tuned_user_table_serves_this_device_from_the_next_launch(tune, monkeypatch, user_cache):
    """tune_launches writes the user table at its default path; the launches that follow in the
    same process (no restart: the cached tile of the old table is not reused) take the winners on
    the device they were measured on, and only there; a second run measures nothing again, a run
    on another GPU of the same architecture measures its own, kept beside the first's."""
    measured = _fake_gpu(monkeypatch, tune)
    tile = _on(monkeypatch, FAKE)
    heuristic = {m: tile(m) for m in (512, 32768)}
    result = tune.tune_launches(ops="rms_norm", passes="fwd", dtypes=["bf16"], hidden=[5000, 4500])
    assert result["out"] == str(user_cache) and user_cache.is_file() and user_cache.with_suffix(".md").is_file()
    assert (result["keys"], result["already"], len(result["tuned"]), result["not_tuned"], result["not_attempted"]) == (
        2, 0, 2, [], 0)
    assert {(k[5], n) for k, n in measured} == {(">2048", 5000), ("<=2048", 5000)}  # the wider width timed
    winners = {e["rows"]: e["tile"] for e in result["tuned"]}
    assert all(e["static_tile"] != e["tile"] for e in result["tuned"])
    assert tile(32768) == winners[">2048"] != heuristic[32768] and tile(4096) == winners[">2048"]
    assert tile(512) == winners["<=2048"] != heuristic[512] and tile(1) == winners["<=2048"]
    doc = T.read(user_cache)
    assert doc["about"] == T.ABOUT_USER
    assert {e["measured"]["device"] for e in doc["archs"]["sm_90"]["entries"]} == {FAKE}
    assert {e["measured"]["hidden_timed"] for e in doc["archs"]["sm_90"]["entries"]} == {5000}
    # Another device name (an H200 beside the H100 that tuned): the heuristics.
    assert _on(monkeypatch, "Another GPU")(32768) == heuristic[32768]
    # Again on the same device: nothing measured, the table unchanged.
    measured.clear()
    again = tune.tune_launches(ops="rms_norm", passes="fwd", dtypes="bf16", hidden="5000")
    assert (again["already"], again["tuned"], measured) == (2, [], [])
    assert T.read(user_cache) == doc
    # On another GPU model of the same architecture sharing the table (one home folder, two
    # machines): measured there, kept beside the first device's entries; each device launches its own.
    _fake_gpu(monkeypatch, tune, name="Another GPU")
    other = tune.tune_launches(ops="rms_norm", passes="fwd", dtypes="bf16", hidden="5000")
    assert (other["already"], len(other["tuned"])) == (0, 2)
    both = T.read(user_cache)
    assert T.problems(both, C.ROW_BUCKETS, per_device=True) == []
    assert T.problems(both, C.ROW_BUCKETS) != []  # as a committed table: one key twice
    assert sorted(e["measured"]["device"] for e in both["archs"]["sm_90"]["entries"]) == [
        "Another GPU", "Another GPU", FAKE, FAKE]
    assert _on(monkeypatch, "Another GPU")(32768) == winners[">2048"]
    assert _on(monkeypatch, FAKE)(32768) == winners[">2048"]
    T.reload()
    assert _on(monkeypatch, FAKE)(32768) == winners[">2048"] != _on(monkeypatch, "A third GPU")(32768)
    # And the first device, asked again, finds its own entries: nothing measured.
    measured = _fake_gpu(monkeypatch, tune)
    assert tune.tune_launches(ops="rms_norm", passes="fwd", dtypes="bf16", hidden="5000")["already"] == 2
    assert measured == []


def test_stale_user_entries_are_measured_again(tune, monkeypatch, user_cache):
    """Entries record the kernel build they were measured with; after an upgrade (another build)
    launches ignore them, and the next `normswap tune` on the device measures those keys again
    instead of counting them as already tuned."""
    measured = _fake_gpu(monkeypatch, tune)
    tile = _on(monkeypatch, FAKE)
    heuristic = tile(32768)
    first = tune.tune_launches(ops="rms_norm", passes="fwd", dtypes="bf16", hidden=[5000])
    assert {e["measured"]["kernel_build"] for e in T.read(user_cache)["archs"]["sm_90"]["entries"]} == {
        T.kernel_build()}
    winner = {e["rows"]: e["tile"] for e in first["tuned"]}[">2048"]
    assert tile(32768) == winner != heuristic
    doc = T.read(user_cache)
    for e in doc["archs"]["sm_90"]["entries"]:
        if e["rows"] == ">2048":
            e["measured"]["kernel_build"] = "0123456789ab"  # measured with other kernels
    T.write(user_cache, doc, C.ROW_BUCKETS)
    T.reload()
    assert _on(monkeypatch, FAKE)(32768) == heuristic  # not launched
    measured.clear()
    again = tune.tune_launches(ops="rms_norm", passes="fwd", dtypes="bf16", hidden=[5000])
    assert (again["already"], [e["rows"] for e in again["tuned"]]) == (1, [">2048"])
    assert [k[5] for k, _ in measured] == [">2048"]
    assert _on(monkeypatch, FAKE)(32768) == winner


def test_the_static_check_targets_the_timing_gpu(tune, monkeypatch, tmp_path):
    """tune_launches hands the static check the device's own target (device_target: its compute
    capability, SM count and per-SM limits as torch reports them), not an H100's."""
    from normswap.kernels import static_check as S

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 9))
    monkeypatch.setattr(C, "_cuda_props", lambda index: {"sms": 128, "regs": 65536, "threads": 1536, "blocks": 24,
                                                         "smem": 100 * 1024})
    ada = S.device_target(0)
    assert ada == S.Target(89, 128, 65536, 1536, 100 * 1024) and ada.ptxas_arch == "sm_89"
    assert S.h100().ptxas_arch == "sm_90a" and S.h100().limits == C.H100_LIMITS
    seen = []
    _fake_gpu(monkeypatch, tune, static_targets=seen)
    monkeypatch.setattr(tune, "_this_device", lambda: {"device": FAKE, "arch": "sm_89", "l2": 1 << 20,
                                                       "target": ada, "torch": "-", "triton": "-"})
    lines = []
    tune.tune_launches(ops="rms_norm", passes="fwd", dtypes="bf16", hidden=[4096], out=tmp_path / "t.json",
                       log=lines.append)
    assert seen == [ada]
    assert "static check compiled for sm_89, 128 SMs (65536 registers, 1536 threads, 100 KiB" in lines[0]


def test_a_second_tuner_on_one_gpu_is_refused(tune, monkeypatch, tmp_path):
    """While one tuner times on a GPU (it holds the GPU's lock), a second one on the same GPU is
    refused at once, before any timing, with nothing written; another GPU is not held by it."""
    from normswap.errors import NormswapError
    from normswap.fileio import path_lock

    measured = _fake_gpu(monkeypatch, tune)
    first = path_lock(tune.timing_lock_path(tune._this_device()), wait=False)
    kwargs = dict(ops="rms_norm", passes="fwd", dtypes="bf16", hidden=[4096], out=tmp_path / "t.json")
    with first:
        with pytest.raises(NormswapError, match=r"^another normswap tune is timing on this GPU \(Fake GPU"):
            tune.tune_launches(**kwargs)
        assert measured == [] and list(tmp_path.iterdir()) == []
        _fake_gpu(monkeypatch, tune, name="Another GPU")
        assert len(tune.tune_launches(**kwargs)["tuned"]) == 2
    measured = _fake_gpu(monkeypatch, tune)
    assert len(tune.tune_launches(**kwargs)["tuned"]) == 2 and measured


def test_a_candidate_the_static_check_cannot_compile_is_rejected_not_fatal(tune, monkeypatch):
    from normswap.kernels import static_check as S

    def broken(*args, **kwargs):
        raise RuntimeError("PTX .target sm_35 is not supported\nmore")
    monkeypatch.setattr(S, "check_tile", broken)
    assert tune.static_problems(KEY, tune.candidates("fwd", "bf16", 4096, 32768)[0]) == [
        "static check failed: RuntimeError: PTX .target sm_35 is not supported"]


def test_tune_refuses_bad_arguments_and_an_invalid_table_before_any_work(tune, monkeypatch, tmp_path):
    from pathlib import Path

    from normswap.errors import BadInputError

    measured = _fake_gpu(monkeypatch, tune)
    for kwargs, says in (({"ops": "rms_norm,group_norm"}, "ops: unknown 'group_norm'"),
                         ({"passes": ""}, "passes: empty list"), ({"dtypes": "fp64"}, "dtypes: unknown 'fp64'"),
                         ({"hidden": "4096,big"}, "hidden: 'big' is not a whole number"),
                         ({"hidden": [0]}, "hidden: 0 is outside"), ({"budget": -1}, "budget must be a positive"),
                         ({"budget": math.nan}, "budget must be a positive")):
        with pytest.raises(BadInputError, match=says):
            tune.tune_launches(out=tmp_path / "t.json", **kwargs)
    monkeypatch.setenv(T.USER_ENV, "off")
    with pytest.raises(BadInputError, match="NORMSWAP_LAUNCH_TABLE=off"):
        tune.tune_launches()
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema": 1}')
    with pytest.raises(BadInputError, match="is not a valid launch table"):
        tune.tune_launches(out=broken, hidden=[4096])
    # Paths that cannot be written are refused up front, not after the first key's timing.
    for kwargs, says in (({"out": broken / "t.json"}, f"cannot write the launch table {broken}/t.json: {broken} is not"),
                         ({"out": tmp_path}, f"cannot write the launch table {tmp_path}: it is a folder"),
                         # permission bits let root write here; the filesystem does not
                         ({"out": Path("/proc/normswap-t.json")}, "cannot write the launch table /proc/normswap-t.json: "
                                                                  "/proc is not writable"),
                         ({"out": tmp_path / "t.json", "report_path": broken / "sub" / "r.md"},
                          "cannot write the report"),
                         # the report (TABLE.md), rewritten after every key, replaced the table itself
                         ({"out": tmp_path / "t.md"}, f"the launch table {tmp_path}/t.md and its report would be one "
                                                      "file; name the table t.json, or give the report a path"),
                         ({"out": tmp_path / "t.json", "report_path": tmp_path / "t.json"}, "would be one file")):
        with pytest.raises(BadInputError, match=says):
            tune.tune_launches(hidden=[4096], **kwargs)
    with pytest.raises(TypeError, match=r"^out: expected the output file's path \(str or path\), got int$"):
        tune.tune_launches(hidden=[4096], out=5)  # was pathlib's message, naming no parameter
    assert broken.read_text() == '{"schema": 1}' and measured == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.json"]


def test_cli_tune_json_and_show(tune, monkeypatch, user_cache):
    """`normswap tune --json`: one document (progress went to stderr); `--show --json` then names
    the user table with its entries for this device."""
    import json

    from click.testing import CliRunner

    from normswap.cli import cli

    _fake_gpu(monkeypatch, tune)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    _on(monkeypatch, FAKE)
    r = CliRunner().invoke(cli, ["tune", "--ops", "layer_norm", "--passes", "bwd", "--dtypes", "fp32",
                                 "--hidden", "1024", "--budget", "100", "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"out", "report", "device", "arch", "keys", "already", "tuned", "not_tuned", "not_attempted"}
    assert doc["device"] == FAKE and doc["out"] == str(user_cache) and len(doc["tuned"]) == 2
    assert set(doc["tuned"][0]) == {"op", "pass", "dtype", "hidden", "rows", "tile", "static_tile", "us", "static_us"}
    assert "[1/2] layer_norm bwd fp32 1024 >2048" in r.stderr
    r = CliRunner().invoke(cli, ["tune", "--show", "--json"])
    assert r.exit_code == 0, r.stderr
    shown = json.loads(r.stdout)
    assert (shown["device"], shown["arch"]) == (FAKE, "sm_90")
    assert shown["user"] == {"path": str(user_cache), "state": "loaded", "entries": 2, "apply": 2, "stale": 0,
                             "other_devices": []}
    assert shown["committed"]["state"] == "loaded"
    r = CliRunner().invoke(cli, ["tune", "--show"])
    assert f"user table: {user_cache}: loaded, 2 entries, 2 for this device" in r.stdout
    # Without --json: what was tuned, against which static tile; again without --retune: nothing.
    r = CliRunner().invoke(cli, ["tune", "--ops", "layer_norm", "--passes", "bwd", "--dtypes", "fp32",
                                 "--hidden", "1024", "--retune"])
    assert r.exit_code == 0, r.stderr
    assert f"{FAKE} (sm_90): 2 of 2 keys tuned, 0 already in the table" in r.stdout
    assert r.stdout.count(" instead of ") == 2 and f"table {user_cache}" in r.stdout
    r = CliRunner().invoke(cli, ["tune", "--ops", "layer_norm", "--passes", "bwd", "--dtypes", "fp32",
                                 "--hidden", "1024"])
    assert f"{FAKE} (sm_90): 0 of 2 keys tuned, 2 already in the table" in r.stdout


def test_cli_tune_show_names_an_invalid_user_table_once(monkeypatch, tmp_path):
    """--show reports an invalid user table in its own output (state and problem), without the
    launch-time warning on stderr beside it."""
    import warnings

    from click.testing import CliRunner

    from normswap.cli import cli

    bad = tmp_path / "user.json"
    bad.write_text("{not json")
    monkeypatch.setenv(T.USER_ENV, str(bad))
    T.reload()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            r = CliRunner().invoke(cli, ["tune", "--show"])
    finally:
        T.reload()
    assert r.exit_code == 0 and f"user table: {bad}: invalid (" in r.stdout
    assert r.stderr == "" and not [w for w in seen if "launch table" in str(w.message)]


@pytest.mark.parametrize("args, says", [
    ([], "tuning needs a CUDA device"),
    (["--ops", "bogus"], "--ops: unknown 'bogus'"),
    (["--passes", ","], "--passes: empty list"),
    (["--dtypes", "fp64"], "--dtypes: unknown 'fp64'"),
    (["--hidden", "4096,-5"], "--hidden: -5 is outside"),
    (["--hidden", "4k"], "--hidden: '4k' is not a whole number"),
    (["--budget", "-1"], "--budget must be a positive number of seconds"),
    (["--json"], "tuning needs a CUDA device"),
])
def test_cli_tune_bad_input_is_one_line_exit_2(args, says, monkeypatch, tmp_path):
    from click.testing import CliRunner

    from normswap.cli import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(cli, ["tune", "--out", str(tmp_path / "t.json"), *args])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("normswap: error: ")
    assert says in r.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", ["", "   "])
def test_cli_tune_empty_out_is_bad_input_and_the_cwd_survives(out, monkeypatch, tmp_path):
    """An empty --out (an unset "$OUT") is refused as checkpoint outputs are, not an internal error
    from Path("") being "." (which has no name to give the report a .md suffix)."""
    from click.testing import CliRunner

    from normswap.cli import cli

    (tmp_path / "notes.txt").write_text("keep")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["tune", "--out", out])
    assert r.exit_code == 2 and r.stdout == "", (r.exit_code, r.stderr)
    assert r.stderr.strip() == "normswap: error: the output file is empty; pass a file name"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_launch_table_nested_too_deeply_is_invalid_not_a_crash(monkeypatch, tmp_path):
    """json's recursion limit raises RecursionError, which no table reader caught: `tune --show`
    (and every launch) died on a deep user table. It is an invalid table like any other, named in
    --show's report and refused as bad input by `tune`."""
    from click.testing import CliRunner

    from normswap.cli import cli

    deep = tmp_path / "user.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        T.read(deep)
    monkeypatch.setenv(T.USER_ENV, str(deep))
    T.reload()
    try:
        r = CliRunner().invoke(cli, ["tune", "--show"])
    finally:
        T.reload()
    why = "malformed JSON (nested too deeply: more than 100 levels)"
    assert r.exit_code == 0 and f"user table: {deep}: invalid ({why})" in r.stdout
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(cli, ["tune"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip() == f"normswap: error: {deep} is not a valid launch table ({why}); move it away or write elsewhere"


@pytest.mark.parametrize("content", ["[" * 100_000 + "]" * 100_000, '{"archs": {"sm_90": {"entries": 5}}}',
                                     '{"archs": [1]}', "caf\xe9"])
def test_the_stamp_of_a_file_that_is_not_a_table_is_no_provenance(tmp_path, content):
    """benchmarks/kernels.py stamps its results with the launch tables in use; a user table nested
    past json's limit (RecursionError) or with entries that are no list (TypeError) failed the run."""
    p = tmp_path / "user.json"
    p.write_bytes(content.encode("latin-1"))
    assert T.stamp("sm_90", p) == {"arch": "sm_90", "sha256": None, "entries": None}


STATIC_SCRIPT = '''
import json
import os
import tempfile
from pathlib import Path

from normswap.kernels import _common as C
from normswap.kernels import tune
from normswap.kernels.static_check import Target, check_tile

KEY = ("sm_90", "rms_norm", "fwd", "bf16", 4096, ">2048")
TILES = [tune.candidates("fwd", "bf16", 4096, 32768)[0],
         {"block_m": 2, "block_n": 4096, "num_warps": 1, "num_stages": 1}]  # 256 elements a thread
SPLIT = ("sm_90", "rms_norm", "fwd", "bf16", 65536, ">2048")  # the heuristics split it in 16 chunks
A100 = Target(80, sms=108, regs=65536, threads=2048, smem=164 * 1024)
ONE_SM = Target(90, sms=1, regs=65536, threads=2048, smem=228 * 1024)


def direct(key, tiles, target):
    """check_tile in this process, one row per variant: what each worker's verdict is the
    distinct problems of, and the registers its occupancy rule reads."""
    with tempfile.TemporaryDirectory() as tmp:
        return [[{"residual": r["residual"], "problems": r["problems"], "regs": r["regs"], "smem": r["smem"],
                  "num_warps": r["num_warps"], "chunks": r["tile"].get("CHUNKS", 1)}
                 for r in check_tile(key, tile, Path(tmp), target=target)] for tile in tiles]


if __name__ == "__main__":
    out = {}
    split_tiles = tune.candidates("fwd", "bf16", 65536, 32768)[:1]
    with tune._gpu_work(l2=1 << 20) as work:  # the default target: an H100
        out["h100"] = work["static_check"](KEY)(TILES)
        out["split"] = work["static_check"](SPLIT)(split_tiles)
    with tune._gpu_work(l2=1 << 20, target=A100) as work:
        out["a100"] = work["static_check"](KEY)(TILES)
    with tune._gpu_work(l2=1 << 20, target=ONE_SM) as work:
        out["split_one_sm"] = work["static_check"](SPLIT)(split_tiles)
    # This process compiles too (only workers are under test for the FP-fusion warning): the
    # per-variant rows, and one launch analysed for a target with a quarter of the threads per SM.
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
    out["direct"] = {"h100": direct(KEY, TILES, None), "a100": direct(KEY, TILES, A100),
                     "split": direct(SPLIT, split_tiles, None)}
    # What one SM holds of each split variant, by the occupancy rule from its measured registers.
    out["one_sm_holds"] = [ONE_SM.sms * C.programs_per_sm(r["regs"], r["num_warps"], r["smem"], ONE_SM.limits)
                           for r in out["direct"]["split"][0] if r["chunks"] > 1]
    few = Target(80, sms=108, regs=65536, threads=512, smem=164 * 1024)
    with tempfile.TemporaryDirectory() as tmp:
        row = check_tile(KEY, TILES[0], Path(tmp), variants=[("rms_norm", True, False, False)], target=few)[0]
    out["row"] = {"target": row["target"], "programs_per_sm": row["programs_per_sm"],
                  "h100": C.programs_per_sm(row["regs"], row["num_warps"], row["smem"], C.H100_LIMITS),
                  "rule": C.programs_per_sm(row["regs"], row["num_warps"], row["smem"], few.limits)}
    print(json.dumps(out))
'''


def test_static_check_runs_in_spawned_workers_for_the_timing_gpu(tmp_path):
    """The static check exactly as tune_launches runs it (its _gpu_work factory: spawned worker
    processes; no GPU needed for this part), in a process where TRITON_DEFAULT_FP_FUSION is unset:
    no worker prints triton's FP-fusion warning (they compile with the tuning process's default).
    For an H100 (the default) and an A100 (sm_80) target: the heuristics' tile passes, a tile
    with 256 elements per thread is rejected for its spills, in both variants it is checked in
    (plain and with the fused residual). The target's SM count decides whether a split row's 16
    chunks are co-resident (an H100: yes; one SM: rejected), its capability what is compiled
    (the PTX's .target) and its limits the programs per SM. Expectations follow from the rules and
    the registers measured here, never one triton's particular counts (triton 3.6 compiles both
    split variants to the same registers, triton 3.9 not). Skipped only where triton ships no
    ptxas / nvdisasm."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from normswap.kernels.static_check import tools_missing

    why = tools_missing()
    if why:
        pytest.skip(why)
    script = tmp_path / "static.py"
    script.write_text(STATIC_SCRIPT)
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(root))
    env.pop("TRITON_DEFAULT_FP_FUSION", None)
    out = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TRITON_DEFAULT_FP_FUSION is unset" not in out.stderr, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for target in ("h100", "a100"):
        # A worker's verdict on a tile is the distinct problems of its variants, as check_tile
        # finds them in this process: none for the heuristics' tile; for 256 elements a thread
        # (256 fp32 values, more than a thread's 255 registers) a spill in every variant.
        (ok, spilling), (ok_rows, spilling_rows) = got[target], got["direct"][target]
        assert [r["residual"] for r in spilling_rows] == [False, True], (target, spilling_rows)
        assert ok == [] and all(r["problems"] == [] for r in ok_rows), (target, ok_rows)
        assert all(r["problems"] and all(p.startswith("spills ") for p in r["problems"]) for r in spilling_rows), (
            target, spilling_rows)
        assert spilling == sorted({p for r in spilling_rows for p in r["problems"]}), (target, spilling)
    assert got["split"] == [[]]
    # One SM holds fewer programs of each split variant than its 16 chunks (8 warps a program: 8
    # by threads alone, fewer where registers bind); the rejection names what the occupancy rule
    # gives for that variant's registers, once per distinct count (the variants may compile alike).
    holds = got["one_sm_holds"]
    assert len(holds) == 2 and all(h < 16 for h in holds), holds
    assert got["split_one_sm"] == [sorted({f"cannot launch: rows of 16 chunks need 16 programs running at once, but "
                                           f"this device holds only {h} of them" for h in holds})]
    row = got["row"]
    assert row["target"] == "sm_80" and row["programs_per_sm"] == row["rule"] < row["h100"]


def test_cli_tune_show_says_the_user_table_is_switched_off(monkeypatch):
    """With NORMSWAP_LAUNCH_TABLE=off, --show printed "user table: -: off": neither why nor what
    launches use instead. It names the setting and the tables that decide; --json keeps the state."""
    import json

    from click.testing import CliRunner

    from normswap.cli import cli

    monkeypatch.setenv(T.USER_ENV, "off")
    T.reload()
    try:
        r = CliRunner().invoke(cli, ["tune", "--show"])
        shown = json.loads(CliRunner().invoke(cli, ["tune", "--show", "--json"]).stdout)
    finally:
        T.reload()
    assert r.exit_code == 0, r.stderr
    [line] = [ln for ln in r.stdout.splitlines() if ln.startswith("user table")]
    assert line == ("user table: none is read (NORMSWAP_LAUNCH_TABLE=off); launches use the committed table and the "
                    "static heuristics")
    assert shown["user"]["state"] == "off" and shown["user"]["path"] is None
