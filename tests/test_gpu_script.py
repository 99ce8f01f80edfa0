"""benchmarks/gpu.py, the GPU-evidence runner, checked on CPU: its stash of wheels carried in parts
across device calls, its argument handling, and that it writes test outcomes as they happen (a run
stopped at its time cap keeps what finished). Nothing here measures a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def gpu():
    return load_script("gpu")


@pytest.fixture
def isolated(gpu, tmp_path, monkeypatch):
    """The machine's folders and the carried ones, all under tmp_path (never the repo's .whl/.stash)."""
    for name, sub in (("HOME", "machine"), ("WHL", "carried/.whl"), ("STASH_SRC", "carried/.stash")):
        monkeypatch.setattr(gpu, name, tmp_path / sub)
    monkeypatch.setattr(gpu, "MANIFEST", tmp_path / "carried/.whl/stash.json")
    (tmp_path / "carried/.whl").mkdir(parents=True)
    return tmp_path


def test_stash_parts_reassemble_across_calls(gpu, isolated):
    rng = __import__("random").Random(0)
    files = []
    for name, size in (("a.whl", 2500), ("b.whl", 7), ("c.whl", 4100)):  # a spans parts 1-2, c parts 2-4
        p = isolated / "src" / name
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(bytes(rng.randrange(256) for _ in range(size)))
        files.append(p)
    carried = isolated / "all-parts"
    manifest = gpu.write_stash(files, parts=4, src=carried, manifest_path=isolated / "carried/.whl/stash.json")
    assert manifest["parts"] == 4 and sum(e["size"] for e in manifest["files"]) == 6607
    machine = isolated / "machine"

    def call(k):  # one device call carries .stash/<k> only
        src = isolated / f"call{k}"
        (src / str(k)).mkdir(parents=True)
        (src / str(k) / "part").write_bytes((carried / str(k) / "part").read_bytes())
        held = gpu.ingest_parts(src, machine)
        return held, gpu.assemble(manifest, machine)

    assert gpu.next_part(manifest, []) == 1
    held, (ready, missing) = call(1)
    assert held == [1] and ready == [] and gpu.next_part(manifest, held) == 2
    assert "part(s) 2 not carried" in missing["a.whl"] and "2, 3, 4" in missing["c.whl"]
    held, (ready, missing) = call(2)
    assert held == [1, 2] and [p.name for p in ready] == ["a.whl", "b.whl"] and list(missing) == ["c.whl"]
    call(3)
    held, (ready, missing) = call(4)
    assert held == [1, 2, 3, 4] and not missing and gpu.next_part(manifest, held) is None
    assert gpu.next_part(manifest, [1, 2, 4]) == 3
    for got, want in zip(ready, files, strict=True):
        assert got.read_bytes() == want.read_bytes()

    # Parts from another prepare: the checksum catches them, the wheel is not used.
    (ready[2]).unlink()
    part3 = machine / "stash" / "part-3"
    data = bytearray(part3.read_bytes())
    data[5] ^= 0xFF
    part3.write_bytes(bytes(data))
    ready, missing = gpu.assemble(manifest, machine)
    assert [p.name for p in ready] == ["a.whl", "b.whl"] and "sha256" in missing["c.whl"]


def test_install_falls_back_to_one_wheel_at_a_time(gpu, tmp_path):
    """A wheel that does not install must not keep the others out (pip fails a whole batch)."""
    import zipfile

    good = tmp_path / "tiny_pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(good, "w") as z:
        z.writestr("tiny_pkg/__init__.py", "VALUE = 1\n")
        z.writestr("tiny_pkg-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-pkg\nVersion: 0.1\n")
        z.writestr("tiny_pkg-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("tiny_pkg-0.1.dist-info/RECORD", "")
    bad = tmp_path / "broken_pkg-0.1-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    lines: list[str] = []
    gpu.install([good, bad], lines.append, tmp_path / "machine")
    site = tmp_path / "machine" / "site"
    assert (site / "tiny_pkg" / "__init__.py").is_file() and (site / f".installed-{good.name}").exists()
    assert not (site / f".installed-{bad.name}").exists()
    assert len(lines) == 3 and "exit 0" in lines[1] and "exit 0" not in lines[2]


def test_pytest_outcome_lines(gpu):
    plain = "tests/test_kernels_gpu.py::test_large_shapes[dtype0-shape1] PASSED    [ 12%]"
    xdist = "[gw3] [ 40%] FAILED tests/test_swap.py::test_smollm2_triton_on_cuda[bf16]"
    for line, tid, outcome in ((plain, "tests/test_kernels_gpu.py::test_large_shapes[dtype0-shape1]", "PASSED"),
                               (xdist, "tests/test_swap.py::test_smollm2_triton_on_cuda[bf16]", "FAILED")):
        m = gpu._OUTCOME.search(line)
        assert (m.group("id1") or m.group("id2"), m.group("o1") or m.group("o2")) == (tid, outcome)
    assert gpu._SHORT.match("SKIPPED [1] tests/test_kernels_gpu.py:66: not enough GPU memory")
    assert gpu._FINAL.match("==== 3 passed, 1 failed in 12.50s ====").group(1) == "3 passed, 1 failed in 12.50s"


def test_json_report_found_among_progress_lines(gpu):
    lines = ["load smollm2-135m:   0%|          | 0/1\r\n", "{not json\n", '{"ok": true,\n', ' "n": 61}\n', "tail\n"]
    assert gpu._last_json(lines) == {"ok": True, "n": 61}
    assert gpu._last_json(["normswap: error: bad input\n"]) is None


def test_bench_command_follows_what_the_tree_offers(gpu, tmp_path, monkeypatch):
    run = type("FakeRun", (), {"out": tmp_path, "prefix": "dev-2000-01-01", "bench_model": "cfg/llama-1b",
                               "dry_run": False, "log": lambda self, line: logged.append(line)})()
    logged: list[str] = []
    ctx = {"backends": {"triton": None, "torch": None, "compile": None, "liger": "no CUDA", "quack": "absent"}}
    monkeypatch.setattr(gpu, "_normswap_help", lambda r, c: "")
    assert gpu.bench_command(run, ctx) == (None, None) and "does not exist" in logged[0]
    offered = "--impls LIST\n--fuse-residual\n--dtype\n--seq N\n--warmup N\n--repeats N\n--out FILE"
    monkeypatch.setattr(gpu, "_normswap_help", lambda r, c: offered)
    cmd, wrapper = gpu.bench_command(run, ctx)
    assert wrapper is None and cmd == ["bench", "cfg/llama-1b", "--impls", "triton,torch", "--json",
                                       "--fuse-residual", "--dtype", "bf16", "--seq", "2048", "--out",
                                       str(tmp_path / "dev-2000-01-01-bench-llama-1b.json")]
    run.dry_run = True  # CPU plumbing: no inductor, short calls
    cmd, _ = gpu.bench_command(run, ctx)
    assert cmd[3] == "triton,torch" and cmd[8:14] == ["--seq", "16", "--warmup", "1", "--repeats", "2"]
    run.dry_run = False
    monkeypatch.setattr(gpu, "_normswap_help", lambda r, c: "--impls LIST")
    cmd, wrapper = gpu.bench_command(run, ctx)
    assert cmd[-1] == "--json" and wrapper == tmp_path / "dev-2000-01-01-bench-llama-1b.json"


def test_kernel_calls_are_options_kernels_py_takes(gpu):
    """gpu.py drives benchmarks/kernels.py by its options: a rename there must fail here, on CPU,
    not on a GPU lease."""
    kernels = load_script("kernels")
    calls = [*gpu.grid("rms_norm", "bf16"), *gpu.grid("layer_norm", "fp32"), *gpu.grid("rms_norm,layer_norm", "bf16")]
    for opts in calls:
        args = kernels.parse_args([*opts, "--impls", "triton,torch", "--out", "x.json"])
        assert args.ops in ("rms_norm", "layer_norm", "rms_norm,layer_norm") and args.passes and args.rows
    assert kernels.parse_args(["--dry-run"]).dry_run


def test_default_bench_model_is_a_1b_class_llama(gpu):
    """The config `normswap bench` times on the GPU (issue 14's targets name a 1B-class Llama): it
    builds (on the meta device, no weights) with ~1.2B parameters and 33 RMSNorms."""
    from normswap import walk
    from normswap.loading import build_meta_model, resolve

    model = build_meta_model(resolve(str(gpu.BENCH_MODEL)))
    params = sum(p.numel() for p in model.parameters())
    assert 1.2e9 < params < 1.3e9, params
    assert sum(1 for f in walk.find_norms(model, warn=False) if f.spec is not None) == 2 * 16 + 1


def test_bad_part_is_one_line_exit_2(gpu, tmp_path, capsys):
    assert gpu.main(["run", str(tmp_path), "tests", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown part 'nope'" in err[0] and "rms" in err[0]
    assert gpu.main(["run", str(tmp_path)]) == 2  # no part: argparse's usage error, exit 2
    capsys.readouterr()
    for bad in ("layer", "layer=x", "nope=10"):
        assert gpu.main(["run", str(tmp_path), "layer", "--cap", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "want PART=SECONDS" in err[0]
    assert gpu.expand(["tests", "rms", "tests-gpu"]) == ["tests-gpu", "tests-kernels", "rms"]


def test_dry_run_writes_outcomes_as_they_happen(gpu, isolated, monkeypatch):
    """A pytest run stopped at its cap: the tests file already holds the outcome that finished and
    says the run was cut; then a dry run of the kernel-tests part through the CLI entry point."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = isolated / "out"
    run = gpu.Run(out, budget=200, dry_run=True, commit="abc123", home=isolated / "machine")
    slow = isolated / "test_slow_fixture.py"
    slow.write_text("import time\n\ndef test_quick():\n    pass\n\ndef test_stuck():\n    time.sleep(600)\n")
    monkeypatch.setitem(gpu.CAPS, "stuck", 12)
    gpu.run_pytest(run, "stuck", [str(slow)])
    text = run.tests_path.read_text()
    assert "DRY RUN" in text and "commit abc123" in text
    assert "## stuck: stopped at its time cap" in text and "outcomes so far: 1 passed" in text
    assert "test_quick PASSED" in run.log_path.read_text() and run.log_path.name.endswith("-log-run.txt")

    # Every child records the commit given, not what a stale .git in the tree copy says (the first
    # H100 run's kernels.py JSON said a9893d0-dirty for a copy of d28bbfb).
    assert run.env["NORMSWAP_COMMIT"] == "abc123"
    probe = "from normswap._version import git_commit; print(git_commit())"
    assert subprocess.run([sys.executable, "-c", probe], env=run.env, capture_output=True, text=True,
                          check=True).stdout.strip() == "abc123"

    assert gpu.main(["run", str(out), "tests-kernels", "--dry-run", "--budget", "200", "--commit", "abc123"]) == 0
    text = run.tests_path.read_text()  # same device and date: the same file, rewritten by the new run
    assert "## tests-kernels: pytest exit 0" in text and "outcomes so far: 1 passed" in text
    assert os.path.basename(run.tests_path).startswith("cpu-dry-run-")
    assert "stash: the next call" not in (out / run.log_path.name.replace("-log-run", "-log-tests-kernels")).read_text()


def test_tune_part_follows_the_tests_and_drives_tune_py_by_its_options(gpu, isolated, monkeypatch):
    """The launch-table tuner runs right after the tests (its table then serves every benchmark
    after it); its command line is one benchmarks/tune.py accepts; a dry run does not tune."""
    assert gpu.PARTS[:3] == ("tests-gpu", "tests-kernels", "tune")
    assert gpu.expand(["tests", "tune", "rms"]) == ["tests-gpu", "tests-kernels", "tune", "rms"]
    seen = []
    run = gpu.Run(isolated / "out", budget=100, dry_run=False, commit="abc", home=isolated / "machine")
    monkeypatch.setattr(run, "stream", lambda cmd, cap, on_line=None: seen.append((cmd, cap)) or (0, 1.0))
    gpu.part_tune(run, {})
    (cmd, cap), = seen
    assert cmd[1] == "benchmarks/tune.py" and cap <= 100
    args = load_script("tune").parse_args(cmd[2:])
    assert args.budget < cap and args.commit == "abc" and args.out.endswith("-launch-table.json")
    run.dry_run = True
    gpu.part_tune(run, {})
    assert len(seen) == 1 and "tune: not run in a dry run" in run.log_path.read_text()


def test_tuned_table_reaches_the_tree_copy_only_as_a_superset(gpu, tmp_path):
    """A table tuned earlier on this (warm) machine replaces the tree copy's when it holds every
    entry the tree's has; an older, smaller one never drops entries the session committed."""
    import json

    from normswap.kernels import launch_table as T

    def doc(*hidden):
        e = [{"op": "rms_norm", "pass": "fwd", "dtype": "bf16", "hidden": h, "rows": ">2048",
              "tile": {"block_m": 1, "block_n": h, "num_warps": 8, "num_stages": 1},
              "measured": {"device": "test fixture, not a measurement"}} for h in hidden]
        return {"schema": T.SCHEMA, "about": "", "row_buckets": [2048], "archs": {"sm_90": {"entries": e}}}

    home, tree = tmp_path / "machine", tmp_path / "launch_table.json"
    home.mkdir()
    lines = []
    tree.write_text(json.dumps(doc(4096)))
    gpu.install_tuned_table(lines.append, home, tree)  # nothing tuned on this machine yet
    assert json.loads(tree.read_text()) == doc(4096) and lines == []
    (home / "launch_table.json").write_text(json.dumps(doc(4096, 8192)))
    gpu.install_tuned_table(lines.append, home, tree)
    assert json.loads(tree.read_text()) == doc(4096, 8192) and "2 entries" in lines[-1]
    tree.write_text(json.dumps(doc(1024, 4096)))  # the session committed an entry the machine lacks
    gpu.install_tuned_table(lines.append, home, tree)
    assert json.loads(tree.read_text()) == doc(1024, 4096) and len(lines) == 1
