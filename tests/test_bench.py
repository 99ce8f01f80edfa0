"""`normswap bench` end to end on tiny configs (CPU numbers: only the plumbing is checked)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_models import tiny_config, tiny_model

from normswap import bench
from normswap.cli import cli


def _config_only(arch, directory):
    """A directory holding nothing but config.json: bench builds random weights from it."""
    cfg = tiny_config(arch)
    cfg.architectures = [type(tiny_model(arch)).__name__]
    cfg.save_pretrained(directory)
    return directory


def test_bench_cli_end_to_end(tmp_path):
    model = _config_only("llama", tmp_path / "cfg")
    out = tmp_path / "results" / "r.json"
    r = CliRunner().invoke(cli, ["bench", str(model), "--impls", "torch", "--fuse-residual", "--seq", "8",
                                 "--dtype", "fp32", "--warmup", "1", "--repeats", "2", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    saved = json.loads(out.read_text())
    assert data["saved_to"] == str(out) and saved["rows"] == data["rows"]
    assert saved["format"] == "normswap-bench/1"
    assert saved["device"]["type"] == "cpu" and saved["device"]["cpu_numbers"] is True
    assert any("CPU numbers" in n for n in saved["notes"])
    assert {"torch", "transformers", "normswap"} <= set(saved["versions"])
    assert saved["model"]["weights"].startswith("random")
    rows = {(row["variant"], row["mode"]): row for row in saved["rows"]}
    assert set(rows) == {(v, m) for v in ("eager", "torch", "torch+fused") for m in ("train", "prefill", "decode")}
    for (variant, mode), row in rows.items():
        assert row["error"] is None
        assert row["median_ms"] > 0 and row["method"] == "perf_counter" and row["peak_memory_bytes"] is None
        tokens = 1 if mode == "decode" else 8
        assert row["tokens_per_s"] == pytest.approx(tokens / (row["median_ms"] / 1e3))
        assert (row["speedup"] is None) == (variant == "eager")
        assert row["fused_writers"] == (4 if variant == "torch+fused" else None)

    # The human table says where the numbers come from.
    r = CliRunner().invoke(cli, ["bench", str(model), "--impls", "torch", "--modes", "prefill", "--seq", "4",
                                 "--warmup", "0", "--repeats", "1", "--out", str(tmp_path / "r2.json")])
    assert r.exit_code == 0, r.output
    assert "CPU numbers" in r.stdout and "torch" in r.stdout


def test_bench_compiled_variant(tmp_path):
    model = _config_only("gpt2", tmp_path / "cfg")
    cfg = bench.BenchConfig(str(model), impls=("torch",), fuse_residual=True, modes=("prefill",), seq=4,
                            dtype="fp32", compile=True, compile_backend="aot_eager", warmup=1, repeats=1)
    result = bench.run_bench(cfg)
    assert [r.variant for r in result.rows] == ["eager", "torch", "torch+fused"]
    assert all(r.error is None and r.median_ms > 0 for r in result.rows)
    assert result.to_dict()["config"]["compile"] is True


@pytest.mark.parametrize("arch,fused", [("llama", False), ("gpt2", False), ("llama", True)])
def test_decode_step_is_the_next_token_of_the_prompt(arch, fused):
    """The timed decode step (static cache reset to the prompt before every call) computes the
    logits a full forward gives at the next position, every time it is called (fused too: the
    static cache's in-place writes must not meet a precomputed norm)."""
    model = tiny_model(arch)
    if fused:
        import normswap

        assert normswap.patch(model, "torch", fuse_residual=True).fusion.pairs
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(1))
    step, static = bench._decode(model, ids)
    with torch.no_grad():
        full = model(torch.cat([ids, ids[:, -1:]], dim=1)).logits[:, -1]
    for _ in range(2):
        torch.testing.assert_close(step()[:, -1], full, rtol=1e-5, atol=1e-5)
    assert static


def test_decode_passes_the_cache_under_the_name_the_forward_takes():
    """`normswap bench` printed transformers 5.24's "FutureWarning: `past_key_values` is deprecated
    and will be removed in version 5.40.0 ... Use `cache` instead." (two lines, once per variant)
    among its progress lines: decode passed the cache under its old name. It passes it under the
    name the forward's signature takes (a compiled model's: the module it wraps)."""
    import inspect
    import warnings

    model = tiny_model("llama")
    ids = torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, static = bench._decode(model, ids)
        step()
    assert static and not [w for w in caught if "past_key_values" in str(w.message)], caught
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert bench._cache_argument(model) == name
    assert bench._cache_argument(torch.compile(model, backend="eager")) == name  # wrapping compiles nothing yet


def test_the_default_results_file_is_named_after_the_models_own_folder(tmp_path, monkeypatch):
    """`cd my-model && normswap bench .` wrote benchmarks/results/bench-x-cpu-DATE.json: the name as
    typed, '.', has no name, and the slug fell back to 'x'; a folder named in another script lost
    its letters ('modèle ü' was 'mod-le'). The folder's own name, letters kept."""
    import time

    model = _config_only("llama", tmp_path / "Modèle ü")
    monkeypatch.chdir(model)
    r = CliRunner().invoke(cli, ["bench", ".", "--impls", "torch", "--modes", "prefill", "--seq", "4",
                                 "--warmup", "0", "--repeats", "1"])
    assert r.exit_code == 0, r.output
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert [p.name for p in (model / "benchmarks" / "results").iterdir()] == [f"bench-modèle-ü-cpu-{day}.json"]


def test_the_default_results_file_keeps_the_name_a_link_was_given(tmp_path, monkeypatch):
    """`normswap bench ~/.cache/huggingface/hub/models--o--m/snapshots/SHA/model.Q4.gguf` wrote
    bench-<the blob's sha256>-cpu-DATE.json: the cache's .gguf is a link into blobs/, and the
    name was taken from where it leads; a folder linked as `llama` was named after its target's
    'run-17'. The name as given, '.' and '..' still their folder's; '.GGUF' loads as .gguf too."""
    import time
    from types import SimpleNamespace

    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "3f9a8c2b").write_bytes(b"")
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "model.Q4.gguf").symlink_to(tmp_path / "blobs" / "3f9a8c2b")
    (tmp_path / "Other.GGUF").symlink_to(tmp_path / "blobs" / "3f9a8c2b")
    (tmp_path / "runs" / "run-17").mkdir(parents=True)
    (tmp_path / "llama").symlink_to(tmp_path / "runs" / "run-17")
    monkeypatch.chdir(tmp_path / "runs" / "run-17")
    day = time.strftime("%Y-%m-%d", time.gmtime())

    def named(model):
        result = SimpleNamespace(config=SimpleNamespace(model=model), device={"type": "cpu", "name": "cpu"})
        return bench.default_output(result).name.removesuffix(f"-cpu-{day}.json")

    assert [named(str(tmp_path / "snap" / "model.Q4.gguf")), named("../../llama"), named(str(tmp_path / "Other.GGUF")),
            named("."), named(".."), named("org/Some.Model")] == \
        ["bench-model-q4", "bench-llama", "bench-other", "bench-run-17", "bench-runs", "bench-some-model"]


def test_the_default_results_file_never_replaces_an_earlier_result(tmp_path, monkeypatch):
    """`normswap bench a/model`, then `normswap bench b/model` (or the same model again with other
    options) the same day: the second run's default file had the first's name and replaced its
    numbers without a word. The default takes the next free name; only a named --out replaces."""
    import time

    first, second = _config_only("llama", tmp_path / "a" / "model"), _config_only("gpt2", tmp_path / "b" / "model")
    monkeypatch.chdir(tmp_path)
    docs = []
    for model in (first, second, first):
        r = CliRunner().invoke(cli, ["bench", str(model), "--impls", "torch", "--modes", "prefill", "--seq", "4",
                                     "--warmup", "0", "--repeats", "1", "--json"])
        assert r.exit_code == 0, r.output
        docs.append(json.loads(r.stdout))
    day = time.strftime("%Y-%m-%d", time.gmtime())
    stem = f"benchmarks/results/bench-model-cpu-{day}"
    assert [d["saved_to"] for d in docs] == [f"{stem}.json", f"{stem}-2.json", f"{stem}-3.json"]
    for doc in docs:  # each file still holds its own run
        saved = Path(doc.pop("saved_to"))
        assert json.loads(saved.read_text()) == doc


def test_bad_input_is_one_line(tmp_path):
    model = _config_only("llama", tmp_path / "cfg")
    r = CliRunner().invoke(cli, ["bench", str(model), "--modes", "sprint"])
    assert r.exit_code == 2 and "unknown mode 'sprint'" in r.stderr and "Traceback" not in r.output
    r = CliRunner().invoke(cli, ["bench", str(tmp_path / "nope")])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1


def test_every_list_option_is_spelled_as_the_library_names_it():
    """One convention for the comma-separated list options: the flag is the library parameter's
    name, plural (tune's --ops/--dtypes/--passes, experiment's --arms, bench_checkpoint's impls and
    modes). bench spelled its lists --impl and --mode, singular beside tune's plurals."""
    import click

    lists = {(name, p.name): p.opts[0] for name, command in cli.commands.items() for p in command.params
             if isinstance(p, click.Option) and (p.metavar in ("LIST", "A,B") or "omma-separated" in (p.help or ""))}
    assert {("bench", "impls"), ("bench", "modes"), ("tune", "ops"), ("tune", "dtypes"), ("tune", "passes"),
            ("experiment", "arms")} <= set(lists)
    assert {k: flag for k, flag in lists.items() if flag != "--" + k[1].replace("_", "-")} == {}


def test_bench_takes_its_lists_old_singular_names_and_hides_them(tmp_path):
    """--impl and --mode, bench's spellings before --impls and --modes, still run (the scripts and
    notes that wrote them), and --help shows only the new names."""
    model = _config_only("llama", tmp_path / "cfg")
    docs = []
    for impls, modes in (("--impls", "--modes"), ("--impl", "--mode")):
        out = tmp_path / f"{impls}.json"
        r = CliRunner().invoke(cli, ["bench", str(model), impls, "torch", modes, "prefill", "--seq", "4", "--dtype",
                                     "fp32", "--warmup", "0", "--repeats", "1", "--out", str(out)])
        assert r.exit_code == 0, r.output
        docs.append(json.loads(out.read_text()))
    assert [(d["config"]["impls"], d["config"]["modes"]) for d in docs] == [(["torch"], ["prefill"])] * 2
    shown = CliRunner().invoke(cli, ["bench", "--help"]).stdout
    assert "--impls LIST" in shown and "--modes LIST" in shown
    assert "--impl " not in shown and "--mode " not in shown and "--impl," not in shown and "--mode," not in shown


def test_bench_runs_where_loading_device_label_puts_parse_devices_cpu(monkeypatch):
    """f2a5b0c made bench ask loading.device_label, as patch's, ppl's and diff's reports do, where
    it had its own `or "cpu"`; test_api's check of the reports could not see bench's (a label
    torch cannot parse). device_label is made to answer another real device for the CPU."""
    from normswap import loading

    monkeypatch.setattr(loading, "device_label", lambda device: "meta" if device is None else device)
    assert bench._device("cpu") == torch.device("meta")


def test_unwritable_out_fails_before_measuring(tmp_path):
    """The destination is checked first: a bench must not run for minutes and then lose its numbers."""
    model = _config_only("llama", tmp_path / "cfg")
    r = CliRunner().invoke(cli, ["bench", str(model), "--impls", "torch", "--modes", "prefill", "--seq", "4",
                                 "--repeats", "1", "--warmup", "0", "--out", "/proc/normswap-bench.json"])
    assert r.exit_code == 2 and "cannot write to /proc" in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and "eager" not in r.stderr  # no progress: nothing ran


def test_bench_checkpoint_is_the_bench_command(tmp_path, monkeypatch):
    """normswap.bench_checkpoint does all that `normswap bench` does: measure, write the results
    file, and return a result whose to_dict() is the --json document (saved_to included)."""
    import normswap
    from normswap.jsonsafe import finite_or_null

    model = _config_only("llama", tmp_path / "cfg")
    calls = []
    kwargs = dict(modes="prefill,decode", seq=4, dtype="fp32", warmup=0, repeats=1)
    result = normswap.bench_checkpoint(model, "torch", results_dir=tmp_path / "res",
                                       progress=lambda *a: calls.append(a), **kwargs)
    assert result.saved_to.parent == tmp_path / "res" and result.saved_to.name.startswith("bench-cfg-cpu-")
    doc = json.loads(json.dumps(finite_or_null(result.to_dict())))
    assert doc.pop("saved_to") == str(result.saved_to)
    assert json.loads(result.saved_to.read_text()) == doc  # the file is the document, less where it is
    assert [(r["variant"], r["mode"]) for r in doc["rows"]] == [(v, m) for v in ("eager", "torch")
                                                                 for m in ("prefill", "decode")]
    assert all(len(c) == 3 and c[2] == 4 for c in calls) and max(c[1] for c in calls) == 4
    # Each measurement's stage ends at its own count (a bar or a log line shows it done), not at
    # the count before it.
    assert {stage: done for stage, done, _ in calls} == {"eager prefill": 1, "eager decode": 2, "torch prefill": 3,
                                                          "torch decode": 4}
    # The command is this call and a renderer: the same document, apart from the timings.
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["bench", str(model), "--impls", "torch", "--modes", "prefill,decode", "--seq", "4",
                                 "--dtype", "fp32", "--warmup", "0", "--repeats", "1", "--json"])
    assert r.exit_code == 0, r.output
    cli_doc = json.loads(r.stdout)
    saved = Path(cli_doc.pop("saved_to"))
    assert saved.parent == Path("benchmarks/results") and json.loads(saved.read_text()) == cli_doc

    def shape(d):
        timed = ("median_ms", "tokens_per_s", "speedup")
        return {**d, "created": None, "rows": [{k: (v is None) if k in timed else v for k, v in row.items()}
                                               for row in d["rows"]]}

    assert shape(cli_doc) == shape(doc)


def test_bench_checkpoint_refuses_an_unwritable_destination_before_measuring(tmp_path):
    import normswap

    model = _config_only("llama", tmp_path / "cfg")
    calls = []
    with pytest.raises(normswap.NormswapError, match="cannot write to /proc"):
        normswap.bench_checkpoint(model, "torch", modes="prefill", seq=4, out="/proc/normswap-bench.json",
                                  progress=lambda *a: calls.append(a))
    assert calls == []


def test_fused_writers_are_counted_not_assumed(tmp_path):
    """GPT-2 in training runs resid_dropout between each writer's output and the add: patch finds
    the pairs, but no add can run inside a norm kernel there. The train row must say 0 (with a
    note), while prefill and decode (eval mode: dropout is the identity) fuse every writer."""
    cfg = tiny_config("gpt2")
    cfg.architectures = [type(tiny_model("gpt2")).__name__]
    cfg.resid_pdrop = 0.5
    cfg.save_pretrained(tmp_path / "cfg")
    result = bench.run_bench(bench.BenchConfig(str(tmp_path / "cfg"), impls=("torch",), fuse_residual=True, seq=8,
                                               dtype="fp32", warmup=0, repeats=1))
    fused = {row.mode: row.fused_writers for row in result.rows if row.fused}
    assert fused == {"train": 0, "prefill": 4, "decode": 4}
    assert [n for n in result.notes if "fused writers" in n] == [
        "torch+fused train: 0 of the 4 fused writers had their residual add run inside a norm kernel (the others "
        "met an op between the add and its norm, e.g. an active dropout)"]


def test_out_replaces_only_an_earlier_bench_result(tmp_path):
    """`bench MODEL --out MODEL/config.json` (a slip of the shell's tab completion) replaced the
    model's config.json with the results and exited 0; --out MODEL/model.safetensors would have
    replaced the weights. The results file may replace an earlier results file, nothing else,
    and the refusal comes before anything is measured."""
    model = _config_only("llama", tmp_path / "cfg")
    config = (model / "config.json").read_bytes()
    args = ["bench", str(model), "--impls", "torch", "--modes", "prefill", "--seq", "4", "--repeats", "1",
            "--warmup", "0", "--dtype", "fp32"]
    r = CliRunner().invoke(cli, [*args, "--out", str(model / "config.json"), "--json"])
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert "is not a normswap bench result; refusing to replace it" in r.stderr and "eager" not in r.stderr
    assert (model / "config.json").read_bytes() == config
    out = tmp_path / "r.json"
    assert CliRunner().invoke(cli, [*args, "--out", str(out)]).exit_code == 0
    first = json.loads(out.read_text())
    assert CliRunner().invoke(cli, [*args, "--out", str(out)]).exit_code == 0  # an earlier result: replaced
    assert json.loads(out.read_text())["created"] >= first["created"]


def test_out_through_a_link_replaces_the_result_it_leads_to(tmp_path):
    """`bench --out latest.json`, latest.json a link to an earlier result (kept in a folder of
    dated results), replaced the link itself with a regular file: the link was gone and the result
    it led to unchanged. Written through the link now, as any --out link is: the link stays and the
    result it leads to is replaced (it must still be a bench result); a link to nothing, to a folder
    or to another file is refused before anything is measured, each left as it was."""
    model = _config_only("llama", tmp_path / "cfg")
    args = ["bench", str(model), "--impls", "torch", "--modes", "prefill", "--seq", "4", "--repeats", "1",
            "--warmup", "0", "--dtype", "fp32"]
    dated = tmp_path / "results" / "2026-11-24.json"
    assert CliRunner().invoke(cli, [*args, "--out", str(dated)]).exit_code == 0
    first = dated.read_text()
    latest = tmp_path / "latest.json"
    latest.symlink_to(Path("results") / dated.name)
    r = CliRunner().invoke(cli, [*args, "--out", str(latest), "--json"])
    assert r.exit_code == 0, r.output
    assert latest.is_symlink() and os.readlink(latest) == str(Path("results") / dated.name)
    assert dated.read_text() != first and json.loads(dated.read_text())["format"] == json.loads(first)["format"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg", "latest.json", "results"]  # no temporary left
    assert [p.name for p in dated.parent.iterdir()] == [dated.name]
    (tmp_path / "notes.txt").write_text("mine")
    link = tmp_path / "elsewhere.json"
    for target, says in ((tmp_path / "nowhere" / "x.json", f"cannot write to {link}: {link} is a link to nothing"),
                         (tmp_path / "results", f"File '{link}' is a directory"),  # click's own check
                         (tmp_path / "notes.txt", f"{link} exists and is not a normswap bench result; refusing to "
                                                  "replace it")):
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        r = CliRunner().invoke(cli, [*args, "--out", str(link), "--json"])
        assert r.exit_code == 2 and r.stdout == "" and says in r.stderr and len(r.stderr.splitlines()) == 1, r.output
        assert link.is_symlink() and not (tmp_path / "nowhere").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine" and [p.name for p in dated.parent.iterdir()] == [dated.name]


def test_out_never_replaces_a_pipe_or_device(tmp_path):
    """As root, `bench MODEL --out /dev/null` (a user keeping only the --json report) renamed its
    results file over the null device and exited 0: /dev/null was a regular file for the whole
    machine from then on. A named pipe went the same way. Only a regular file may be replaced,
    and the refusal comes before anything is measured. (A pipe here: a test must not risk
    /dev/null.)"""
    model = _config_only("llama", tmp_path / "cfg")
    fifo = tmp_path / "results.pipe"
    os.mkfifo(fifo)
    r = CliRunner().invoke(cli, ["bench", str(model), "--impls", "torch", "--modes", "prefill", "--seq", "4",
                                 "--repeats", "1", "--warmup", "0", "--dtype", "fp32", "--out", str(fifo), "--json"])
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.strip() == (f"normswap: error: cannot write to {fifo}: it is not a regular file (a pipe, "
                                "socket or device); refusing to replace it"), r.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_failing_variant_is_a_row_not_a_crash(tmp_path, monkeypatch):
    """One variant failing (a compile backend that does not exist, a CUDA graph that cannot be
    captured, memory) is reported in its rows and the others are still measured. The handler
    imported errors.first_line, which no longer exists: every such failure became an internal
    error (exit 1) and every measurement already taken was lost."""
    model = _config_only("llama", tmp_path / "cfg")
    real = bench._measure

    def measure(cfg, m, ids, mode, device, pairs):
        if any(type(x).__name__.startswith("Normswap") for x in m.modules()):
            raise RuntimeError("boom\nsecond line")
        return real(cfg, m, ids, mode, device, pairs)

    monkeypatch.setattr(bench, "_measure", measure)
    out = tmp_path / "r.json"
    r = CliRunner().invoke(cli, ["bench", str(model), "--impls", "torch", "--modes", "prefill", "--seq", "4",
                                 "--repeats", "1", "--warmup", "0", "--dtype", "fp32", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["variant"]: row for row in json.loads(r.stdout)["rows"]}
    assert rows["eager"]["error"] is None and rows["eager"]["median_ms"] > 0
    assert rows["torch"]["error"] == "RuntimeError: boom second line" and rows["torch"]["median_ms"] is None
    assert json.loads(out.read_text())["rows"][1]["error"] == rows["torch"]["error"]


def test_a_bench_that_measured_nothing_is_an_error_and_keeps_an_earlier_result(tmp_path, monkeypatch):
    """--batch 100000000 on a tiny model: every row, the unpatched model's too, failed to allocate;
    bench printed a table of dashes, wrote it over the earlier result at --out and exited 0."""
    model = _config_only("llama", tmp_path / "cfg")

    def measure(cfg, m, ids, mode, device, pairs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 51200000000 bytes")

    args = ["bench", str(model), "--impls", "torch", "--modes", "prefill,train", "--seq", "4", "--repeats", "1",
            "--warmup", "0", "--dtype", "fp32", "--out", str(tmp_path / "r.json")]
    assert CliRunner().invoke(cli, args).exit_code == 0
    earlier = (tmp_path / "r.json").read_text()
    monkeypatch.setattr(bench, "_measure", measure)
    r = CliRunner().invoke(cli, [*args, "--json"])
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert [line for line in r.stderr.splitlines() if line.startswith("normswap:")] == [
        "normswap: error: nothing was measured: eager prefill: RuntimeError: DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 51200000000 bytes; use a smaller --batch or --seq"], r.stderr
    assert (tmp_path / "r.json").read_text() == earlier


@pytest.mark.parametrize("mode, seq", [("prefill", 65), ("decode", 64)])
def test_a_sequence_longer_than_the_context_is_refused_before_building(tmp_path, mode, seq):
    """GPT-2's learned positions end at n_positions (64 here): --seq 100 ran every variant into
    'IndexError: index out of range in self' and exited 0 with a table of dashes; decode needs
    one position more than the prompt."""
    model = _config_only("gpt2", tmp_path / "cfg")
    r = CliRunner().invoke(cli, ["bench", str(model), "--impls", "torch", "--modes", mode, "--seq", str(seq),
                                 "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "r.json")])
    assert r.exit_code == 2, r.output
    assert f"--seq {seq}" in r.stderr and "the model's context is 64 positions" in r.stderr
    assert "eager" not in r.stderr and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("batch", [10**12, 10**23])
def test_a_batch_that_cannot_be_allocated_is_bad_input(tmp_path, batch):
    """--batch 10**12 made torch fail to allocate the token ids (32 TB), 10**23 overflowed its size
    argument: internal errors (exit 1) for a number the user chose. Bad input naming the options."""
    model = _config_only("llama", tmp_path / "cfg")
    r = CliRunner().invoke(cli, ["bench", str(model), "--impls", "torch", "--modes", "prefill", "--seq", "4",
                                 "--batch", str(batch), "--out", str(tmp_path / "r.json")])
    assert r.exit_code == 2, r.output
    assert f"--batch {batch} x --seq 4: cannot allocate" in r.stderr


# (CLI arguments, the same as bench_checkpoint arguments, what each caller's message starts with):
# check_config is the library's check, and the CLI's too; each caller's message names its own
# options (the parameter, or the flag it came from), as EvalSettings.check's do.
BAD_OPTIONS = [
    (["--impls", ""], dict(impls=""), "--impls names no implementation", "impls names no implementation"),
    (["--modes", ""], dict(modes=""), "--modes names no workload", "modes names no workload"),
    (["--modes", "sprint"], dict(modes="sprint"), "--modes: unknown mode 'sprint'", "modes: unknown mode 'sprint'"),
    (["--batch", "0"], dict(batch=0), "--batch 0: must be at least 1", "batch 0: must be at least 1"),
    (["--seq", "1"], dict(seq=1), "--seq 1: must be at least 2", "seq 1: must be at least 2"),
    (["--repeats", "0"], dict(repeats=0), "--repeats 0: must be at least 1", "repeats 0: must be at least 1"),
    (["--warmup", "-1"], dict(warmup=-1), "--warmup -1: must be at least 0", "warmup -1: must be at least 0"),
    # a typo'd count timed one row for years (1,000,000,000 calls), every later row waiting on it
    (["--repeats", "1000000000"], dict(repeats=10**9), "--repeats 1000000000: at most 10,000;",
     "repeats 1000000000: at most 10,000;"),
    (["--warmup", "10000000"], dict(warmup=10**7), "--warmup 10000000: at most 1,000;", "warmup 10000000: at most 1,000;"),
    (["--seq", "100"], dict(seq=100), "--seq 100 does not fit", "seq 100 does not fit"),
    # timed twice, two rows under one variant name (a reader keyed by variant kept one)
    (["--impls", "torch,torch"], dict(impls="torch,torch"), "--impls: torch named twice", "impls: torch named twice"),
    # every row was 'not measured: InvalidBackend', the results file written (replacing an earlier
    # result at --out), exit 0
    (["--compile", "--compile-backend", "bogus"], dict(compile=True, compile_backend="bogus"),
     "--compile-backend 'bogus': not a torch.compile backend here; known: ", "compile_backend 'bogus': not a"),
]


@pytest.mark.parametrize("kwargs, says", [
    # "no" is truthy: load_weights="no" loaded the weights, compile="yes" compiled, fuse_residual=2 fused
    (dict(load_weights="no"), "load_weights: expected True or False, got 'no'"),
    (dict(compile="yes"), "compile: expected True or False, got 'yes'"),
    (dict(fuse_residual=2), "fuse_residual: expected True or False, got 2"),
    # timed in full, then every number lost: "Object of type dtype is not JSON serializable"
    (dict(dtype=torch.float32), "dtype: expected a name such as 'fp32', 'fp16', 'bf16', got torch.float32"),
    # pathlib's own "expected str, bytes or os.PathLike object, not int", naming no parameter
    (dict(out=5), "out: expected a file path (str or path), got int"),
    (dict(results_dir=None, out=None), "results_dir: expected a folder path (str or path), got NoneType"),
])
def test_a_wrong_kind_of_value_is_refused_before_anything_is_timed(tmp_path, monkeypatch, kwargs, says):
    import normswap
    from normswap import bench

    monkeypatch.setattr(bench, "time_calls", lambda *a, **k: pytest.fail("a bad option reached the timing"))
    model = _config_only("gpt2", tmp_path / "cfg")
    out = tmp_path / "r.json"
    with pytest.raises(TypeError) as e:
        normswap.bench_checkpoint(model, "torch", **dict(modes="prefill", seq=4, repeats=1, warmup=0, out=out) | kwargs)
    assert str(e.value) == says and not out.exists()


def test_train_and_decode_on_a_model_without_a_language_model_head_are_refused_before_it_is_built(tmp_path):
    """bench on BertModel: every train and decode variant failed inside the timing ("'BaseModelOutput...'
    object has no attribute 'loss'"), beside a FutureWarning of transformers', and the run ended in
    "nothing was measured: eager decode: AttributeError: ...". Prefill times its forward."""
    import normswap
    from normswap.errors import NormswapError

    model = _config_only("bert", tmp_path / "cfg")
    args = ["bench", str(model), "--impls", "torch", "--seq", "4", "--repeats", "1", "--warmup", "0", "--dtype", "fp32"]
    r = CliRunner().invoke(cli, [*args, "--modes", "prefill,decode", "--out", str(tmp_path / "r.json")])
    assert r.exit_code == 2 and r.stderr == ("normswap: error: BertModel has no language-model head, which --modes "
                                             "decode needs; time its forward alone with --modes prefill\n"), r.stderr
    with pytest.raises(NormswapError, match=r"^BertModel has no language-model head, which modes train and decode need;"):
        normswap.bench_checkpoint(model, "torch", modes="train,decode", seq=4, out=tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()
    r = CliRunner().invoke(cli, [*args, "--modes", "prefill", "--out", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output


def test_train_on_a_masked_language_model_is_timed(tmp_path):
    """A masked LM (BertForMaskedLM, the class bert-base-uncased names) gives the loss train asks
    for from labels, though it cannot generate: train was timed before the check for a head, which
    then refused it ("has no language-model head, which --modes train needs"). Decode, which
    generates, is still refused, naming the modes it can time."""
    cfg = tiny_config("bert")
    cfg.architectures = ["BertForMaskedLM"]
    cfg.save_pretrained(tmp_path / "cfg")
    args = ["bench", str(tmp_path / "cfg"), "--impls", "torch", "--seq", "4", "--repeats", "1", "--warmup", "0",
            "--dtype", "fp32", "--out", str(tmp_path / "r.json")]
    r = CliRunner().invoke(cli, [*args, "--modes", "train"])
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {(row["variant"], row["mode"]) for row in rows if row["error"] is None} == {("eager", "train"),
                                                                                     ("torch", "train")}
    r = CliRunner().invoke(cli, [*args, "--modes", "train,decode"])
    assert r.exit_code == 2 and r.stderr == ("normswap: error: BertForMaskedLM cannot generate, which --modes decode "
                                             "needs; time it with --modes prefill,train\n"), r.stderr


def test_the_count_limits_themselves_are_accepted():
    """AT_MOST is the largest count allowed, not the first refused."""
    from normswap.bench import AT_MOST, BenchConfig, check_config

    check_config(BenchConfig("unused", **AT_MOST))


@pytest.mark.parametrize("cli_args,kwargs,cli_says,library_says", BAD_OPTIONS, ids=[b[3] for b in BAD_OPTIONS])
def test_bad_options_are_named_as_each_caller_gave_them(tmp_path, monkeypatch, cli_args, kwargs, cli_says,
                                                       library_says):
    import normswap
    from normswap import bench
    from normswap.errors import BadInputError, NormswapError

    def no_timing(*args, **kwargs):  # refused before anything is timed (a count let through times for years)
        raise AssertionError("a bad option reached the timing")

    monkeypatch.setattr(bench, "time_calls", no_timing)
    model = _config_only("gpt2", tmp_path / "cfg")  # learned positions: 64
    out = tmp_path / "r.json"
    base = dict(impls="torch", modes="prefill", seq=4, repeats=1, warmup=0)
    r = CliRunner().invoke(cli, ["bench", str(model), "--impls", "torch", "--modes", "prefill", "--seq", "4",
                                 "--repeats", "1", "--warmup", "0", *cli_args, "--out", str(out)])
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.output
    assert r.stderr.startswith(f"normswap: error: {cli_says}"), r.stderr
    kwargs = base | kwargs
    with pytest.raises(NormswapError) as e:
        normswap.bench_checkpoint(model, kwargs.pop("impls"), out=out, **kwargs)
    assert str(e.value).startswith(library_says) and "--" not in str(e.value), e.value
    assert isinstance(e.value, BadInputError) or "does not fit" in library_says
    assert not out.exists()


@pytest.mark.parametrize("device, says", [
    # meta timed a model that computes nothing and wrote its "tokens/s" as a result, exit 0
    ("meta", "unknown device 'meta'; choose auto, cpu, cuda or cuda:N"),
    # mps / xpu were torch's multi-kilobyte dispatcher listing, after the config was read
    ("mps", "unknown device 'mps'"),
    ("xpu", "unknown device 'xpu'"),
    ("cuda", "no CUDA device here"),
])
def test_a_device_bench_cannot_time_on_is_refused_before_anything_runs(tmp_path, device, says):
    import normswap
    from normswap.errors import NormswapError

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    model = _config_only("llama", tmp_path / "cfg")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(cli, ["bench", str(model), "--impls", "torch", "--modes", "prefill", "--seq", "4",
                                 "--repeats", "1", "--warmup", "0", "--device", device, "--out", str(out)])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("normswap: error: "), r.stderr[:500]
    assert says in lines[0] and "eager" not in r.stderr  # nothing was built or timed
    with pytest.raises(NormswapError, match=says):
        normswap.bench_checkpoint(model, "torch", modes="prefill", seq=4, repeats=1, warmup=0, device=device, out=out)
    assert not out.exists()


def test_a_fused_variant_that_cannot_fuse_names_the_option_as_the_caller_did(tmp_path, monkeypatch):
    """The row error of a fused variant names fuse_residual as run_bench's caller did: the command
    line's --fuse-residual (bench's OPTION_NAMES), a library caller's fuse_residual."""
    from normswap import fusion

    monkeypatch.setattr(fusion, "find_writers", lambda model: [])  # a model with no residual writers known
    model = _config_only("llama", tmp_path / "cfg")
    for names, says in ((None, "fuse_residual"), ({"fuse_residual": "--fuse-residual"}, "--fuse-residual")):
        result = bench.run_bench(bench.BenchConfig(str(model), impls=("torch",), fuse_residual=True, modes=("prefill",),
                                                   seq=4, dtype="fp32", warmup=0, repeats=1), option_names=names)
        (row,) = [r for r in result.rows if r.fused]
        assert row.error.startswith(f"{says}: no residual writers known or discovered"), row.error
