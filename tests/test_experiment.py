"""normswap experiment: recipe validation, every arm on a tiny pretrained model, resume, DDP."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from normswap.cli import cli
from normswap.experiment import Interrupted, RecipeError, StopFlag, load_recipe, run_experiment
from normswap.experiment.recipe import parse_arm
from normswap.experiment.report import summary_rows

ROOT = Path(__file__).resolve().parents[1]
GENESIS = ROOT / "normswap" / "data" / "genesis-kjv.txt"
JOSHUA = ROOT / "recipes" / "data" / "kjv-joshua.txt.gz"
ALL_ARMS = ["original", "original+ft", "exact", "exact+ft", "approx", "approx+ft", "approx-bias",
            "approx-bias+ft", "approx+distill"]

# A model small enough for CI that still learns something from Genesis 1-3 in a few seconds.
PRETRAIN = f"""
[pretrain]
text = "{GENESIS.name}"
vocab_size = 300
n_layer = 2
n_embd = 32
n_head = 2
context = 64
steps = 80
batch_size = 8
seq_len = 32
lr = 3e-3
warmup_steps = 4
"""

REST = f"""
[data]
train = "{GENESIS.name}"
eval = "{JOSHUA.name}"
eval_max_tokens = 256
eval_max_length = 64
eval_batch_size = 4

[finetune]
steps = 4
eval_every = 2
checkpoint_every = 2
batch_size = 2
seq_len = 32
lr = 1e-3
warmup_steps = 1
"""


def write_recipe(path: Path, body: str, arms=ALL_ARMS, head: str = "") -> Path:
    """A recipe whose texts lie beside it (paths relative to the recipe, as in recipes/)."""
    for text in (GENESIS, JOSHUA):
        if not (path.parent / text.name).exists():
            (path.parent / text.name).write_bytes(text.read_bytes())
    path.write_text(f'name = "tiny"\nimpl = "torch"\narms = {json.dumps(arms)}\n{head}\n{body}{REST}')
    return path


def other_text(folder: Path, name: str = "other.txt") -> str:
    """A training text other than pretrain.text and data.eval (Genesis 2-3), as `name` in `folder`:
    a recipe that trains on its held-out text is warned about."""
    text = GENESIS.read_text()
    (folder / name).write_text(text[text.index("Chapter 2"):])
    return name


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One NORMSWAP_CACHE for the module: the tiny pretraining runs once."""
    d = tmp_path_factory.mktemp("cache")
    old = os.environ.get("NORMSWAP_CACHE")
    os.environ["NORMSWAP_CACHE"] = str(d)
    yield d
    if old is None:
        os.environ.pop("NORMSWAP_CACHE")
    else:
        os.environ["NORMSWAP_CACHE"] = old


@pytest.fixture(scope="module")
def every_arm(cache, tmp_path_factory):
    """The tiny pretraining plus every arm, a few steps each."""
    d = tmp_path_factory.mktemp("every-arm")
    recipe = load_recipe(write_recipe(d / "tiny.toml", PRETRAIN))
    return run_experiment(recipe, d / "out", progress=False)


@pytest.fixture(scope="module")
def pretrained_dir(every_arm) -> Path:
    return Path(every_arm.model_path)


def model_recipe(tmp_path: Path, model_dir: Path, arms, head: str = "") -> Path:
    return write_recipe(tmp_path / "model.toml", f'[model]\npath = "{model_dir}"\n', arms, head)


# --------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("name", [p.name for p in sorted((ROOT / "recipes").glob("*.toml"))])
def test_every_shipped_recipe_validates_without_a_warning(name):
    """recipes/*.toml load as shipped, their texts there, with nothing to warn about (a warm-up as
    long as the run, say); smoke-kjv-tiny.toml is the few-minute trial the README offers."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = load_recipe(ROOT / "recipes" / name)
    assert r.arms == ALL_ARMS and r.pretrain is not None
    assert Path(r.pretrain.text).is_file() and Path(r.data.train).is_file() and Path(r.data.eval).is_file()
    if name == "smoke-kjv-tiny.toml":
        assert r.pretrain.n_layer * r.pretrain.n_embd <= 256 and r.finetune.steps <= 20
    if name == "ln2rms-kjv-gpt2.toml":
        assert r.pretrain.n_layer == 6 and r.pretrain.n_embd == 256


@pytest.mark.parametrize("override, message", [
    ("finetune.stepz=3", "unknown key 'finetune.stepz' \\(did you mean 'steps'\\?"),
    ("finetune.lr=1e-3\nseed=5", "overrides finetune.lr: '1e-3\\\\nseed=5' is not one TOML value"),
    ("colour=3", "unknown key 'colour'"),
    ("finetune.steps=-1", "finetune.steps: -1 is below the minimum 0"),
    ("finetune.steps=1.5", "finetune.steps: expected an integer"),
    ("finetune.steps=true", "finetune.steps: expected an integer"),
    ("name=2024", "name: expected a string, got 2024 \\(quote it: '\"2024\"'\\)"),
    ("name=true", "name: expected a string, got True \\(quote it: '\"true\"'\\)"),  # TOML's word, not Python's
    ("finetune.schedule=sawtooth", "finetune.schedule: 'sawtooth' is not one of constant, linear, cosine"),
    ("finetune.optimizer=lion", "finetune.optimizer: 'lion' is not one of"),
    ("arms=original,approx+magic", r"unknown arm 'approx\+magic'"),
    ("arms=original,original", "listed twice"),
    ("data.eval=nowhere.txt", "data.eval: .*nowhere.txt: no such file"),
    ("pretrain.n_head=3", "pretrain.n_embd: 32 is not a multiple of pretrain.n_head"),
    ("model.path=x", "exactly one of \\[model\\]"),
    ("nosection.key=1", "unknown section 'nosection'"),
    ("finetune", "expected key=value"),
    ("finetune.lr=nan", "finetune.lr: expected a finite number, got nan"),
    ("finetune.max_grad_norm=inf", "finetune.max_grad_norm: expected a finite number"),
    ("seed=4294967296", "seed: 4294967296 is above the maximum 4294967295"),
    ("impl=bogus", "impl: 'bogus' is not one of triton, torch"),
    ('name="../elsewhere"', "name: '../elsewhere' is not a plain folder name"),
    ("finetune.seq_len=65", r"finetune.seq_len: 65 exceeds the model's context \(64 positions\)"),
])
def test_bad_recipes_are_one_line_errors(tmp_path, override, message):
    path = write_recipe(tmp_path / "r.toml", PRETRAIN)
    with pytest.raises(RecipeError, match=message) as e:
        load_recipe(path, [override])
    assert "\n" not in str(e.value)


def test_overrides_are_typed_and_validated(tmp_path):
    path = write_recipe(tmp_path / "r.toml", PRETRAIN)
    r = load_recipe(path, ["finetune.steps=7", "finetune.lr=0.01", "impl=triton", "arms=exact,approx+ft"])
    assert (r.finetune.steps, r.finetune.lr, r.impl, r.arms) == (7, 0.01, "triton", ["exact", "approx+ft"])
    assert r.fingerprint() != load_recipe(path).fingerprint()
    assert load_recipe(path, ["arms=exact"]).fingerprint() == load_recipe(path).fingerprint()
    # Texts count by content, not by where the checkout lies.
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "genesis.txt").write_bytes(GENESIS.read_bytes())
    assert load_recipe(path, [f'data.train="{moved / "genesis.txt"}"']).fingerprint() == load_recipe(path).fingerprint()
    (moved / "genesis.txt").write_text("other text\n")
    assert load_recipe(path, [f'data.train="{moved / "genesis.txt"}"']).fingerprint() != load_recipe(path).fingerprint()


def test_a_model_directory_recipe_checks_seq_len_against_the_model(tmp_path, pretrained_dir):
    recipe = load_recipe(model_recipe(tmp_path, pretrained_dir, ["approx+ft"]), ["finetune.seq_len=65"])
    with pytest.raises(RecipeError, match="finetune.seq_len: 65 exceeds the model's context"):
        run_experiment(recipe, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "arms").exists()  # refused before any arm ran


def test_a_model_directory_is_relative_to_the_recipe(tmp_path, monkeypatch):
    (tmp_path / "models" / "m").mkdir(parents=True)
    recipe = write_recipe(tmp_path / "r.toml", '[model]\npath = "models/m"\n')
    monkeypatch.chdir(ROOT)
    assert load_recipe(recipe).model.path == str(tmp_path / "models" / "m")
    assert load_recipe(recipe, ['model.path="gpt2"']).model.path == "gpt2"  # not a local path: as written


def test_not_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml\n")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "absent.toml")


def test_a_recipe_with_a_byte_order_mark_is_read_as_without(tmp_path):
    """A recipe saved by a Windows editor begins with a UTF-8 byte-order mark: it was refused as "not
    valid TOML (Invalid statement (at line 1, column 1))", a line 1 that looks right. The data texts
    are read past one (normswap.data); the recipe is now too."""
    path = write_recipe(tmp_path / "r.toml", PRETRAIN)
    marked = tmp_path / "marked.toml"
    marked.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_recipe(marked).to_dict() == load_recipe(path).to_dict()


def test_a_recipe_file_past_a_mebibyte_is_not_read_to_the_end(tmp_path):
    """`normswap experiment /dev/zero` read until memory ran out (MemoryError, exit 1): a recipe is
    read up to 1 MiB and refused past it. (A file here, which the read without the bound parsed:
    a test must not fill the machine's memory when the bound is gone.)"""
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * 110_000)  # 1.05 MiB of comments: valid TOML
    with pytest.raises(RecipeError, match=r"^.*big.toml: more than 1 MiB, not a recipe file$"):
        load_recipe(big)
    crlf = write_recipe(tmp_path / "crlf.toml", PRETRAIN)  # the bounded read still takes CRLF and a pipe's text
    crlf.write_bytes(crlf.read_bytes().replace(b"\n", b"\r\n"))
    assert load_recipe(crlf).to_dict() == load_recipe(write_recipe(tmp_path / "lf.toml", PRETRAIN)).to_dict()


def test_cli_bad_recipe_is_one_line_exit_2(tmp_path):
    path = write_recipe(tmp_path / "r.toml", PRETRAIN)
    for args in (["--set", "finetune.stepz=1"], ["--arms", "original,nonsense"], ["--set", "seed=x y"],
                 ["--arms", " , "]):
        res = CliRunner().invoke(cli, ["experiment", str(path), *args])
        assert res.exit_code == 2, res.output
        assert res.stderr.count("\n") == 1 and res.stderr.startswith("normswap: error:")
        assert "--arms" in res.stderr or "--arms" not in args


def test_a_bad_override_names_it_as_the_caller_gave_it(tmp_path):
    """load_recipe's and run_experiment's caller gave `overrides`; the command line's user --set."""
    path = write_recipe(tmp_path / "r.toml", PRETRAIN)
    with pytest.raises(RecipeError, match=r"^overrides 'steps': expected key=value \(e.g. finetune.steps=10\)$"):
        load_recipe(path, ["steps"])
    with pytest.raises(RecipeError, match=r"^overrides nosection.key: unknown section 'nosection'"):
        run_experiment(str(path), tmp_path / "out", overrides=["nosection.key=1"], progress=False)
    res = CliRunner().invoke(cli, ["experiment", str(path), "--set", "steps"])
    assert res.exit_code == 2 and res.stderr == ("normswap: error: --set 'steps': expected key=value "
                                                 "(e.g. finetune.steps=10)\n"), res.stderr


def test_run_experiment_takes_the_arms_as_given_and_checks_them(tmp_path):
    """The arm selection is the library's: a list or "a,b" as a command line takes it, checked
    before anything is written, the error naming the parameter (or the flag, option_names)."""
    from normswap.experiment import select_arms

    recipe = load_recipe(write_recipe(tmp_path / "r.toml", PRETRAIN))
    assert select_arms(recipe, " exact, approx+ft,") == ["exact", "approx+ft"] == select_arms(recipe, ["exact", "approx+ft"])
    assert select_arms(recipe, None) == ALL_ARMS
    out = tmp_path / "out"
    for arms, message in ((",", "arms: no arm named"), ([], "arms: no arm named"),
                          ("original,nonsense", "arms: unknown arm 'nonsense'"),
                          ("exact, original,exact", "arms: exact named twice")):
        with pytest.raises(RecipeError, match=f"^{message}"):
            run_experiment(recipe, out, arms, progress=False)
    with pytest.raises(RecipeError, match="^--arms: unknown arm 'x'"):
        run_experiment(recipe, out, "x", progress=False, option_names={"arms": "--arms"})
    assert not out.exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(recipe=None), "recipe: expected the path of a TOML recipe"),
    (dict(recipe={"name": "x"}), "recipe: expected the path .* got dict"),
    (dict(out=3), "out: expected a folder path"),
    (dict(arms=3), "arms: expected arm names"),
    (dict(arms=["original", 3]), "arms: expected arm names"),  # was an AttributeError
    (dict(overrides="finetune.steps=1"), "overrides: expected a list of 'key=value' strings"),  # was read letter by letter
    (dict(overrides=[3]), "overrides: expected a list"),  # was an AttributeError
    (dict(on_step=3), "on_step: expected a function"),  # was found at the first training step, OUT made
    (dict(out=" "), "the output folder is empty"),  # an unset $OUT: was the current directory (BadInputError)
])
def test_run_experiment_refuses_a_wrong_kind_of_argument_naming_it(tmp_path, monkeypatch, kwargs, message):
    from normswap.experiment import runner

    def ran(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(runner, "make_accelerator", ran)
    call = dict(recipe=write_recipe(tmp_path / "r.toml", PRETRAIN), out=tmp_path / "out", arms=None, progress=False)
    call.update(kwargs)
    from normswap.errors import BadInputError

    with pytest.raises(BadInputError if call["out"] == " " else TypeError, match=f"^{message}"):
        run_experiment(**call)
    assert not (tmp_path / "out").exists()


def test_an_impl_that_cannot_run_here_is_refused_before_pretraining(tmp_path, monkeypatch):
    """The recipe's impl was first used when the first arm was built: after OUT was made and the
    pretraining (30 min for the shipped recipe) had run."""
    from normswap.backends import available_backends
    from normswap.errors import NormswapError
    from normswap.experiment import runner

    missing = [n for n, why in available_backends().items() if why is not None]
    if not missing:
        pytest.skip("every backend is available here")

    def ran(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(runner, "make_accelerator", ran)
    path = write_recipe(tmp_path / "r.toml", PRETRAIN)
    with pytest.raises(NormswapError, match=f"^backend '{missing[0]}' is not available here"):
        run_experiment(path, tmp_path / "out", overrides=[f"impl={missing[0]}"], progress=False)
    assert not (tmp_path / "out").exists()


def test_run_experiment_reads_a_recipe_path_with_its_overrides(tmp_path, monkeypatch, pretrained_dir):
    """One call does what the command does: a recipe path and its `--set` overrides are read by
    run_experiment itself (load_recipe), checked the same way, and the run is that recipe's."""
    path = model_recipe(tmp_path, pretrained_dir, ["original"])
    out = tmp_path / "out"
    with pytest.raises(RecipeError, match=f"^{path}: .*stepz"):
        run_experiment(path, out, overrides=["finetune.stepz=1"], progress=False)
    with pytest.raises(RecipeError, match="^--arms: unknown arm 'x'"):
        run_experiment(str(path), out, "x", overrides=["seed=3"], progress=False, option_names={"arms": "--arms"})
    with pytest.raises(TypeError, match="overrides apply to a recipe file"):
        run_experiment(load_recipe(path), out, overrides=["seed=3"], progress=False)
    assert not out.exists()
    result = run_experiment(path, out, overrides=["seed=3"], progress=False, plot=False)
    written = json.loads((out / "recipe.json").read_text())
    assert written["fingerprint"] == load_recipe(path, ["seed=3"]).fingerprint() != load_recipe(path).fingerprint()
    assert written["recipe"]["seed"] == 3 and list(result.data["arms"]) == ["original"]


def test_the_command_is_one_library_call(tmp_path, monkeypatch):
    """`normswap experiment` hands the recipe path and its --set overrides to run_experiment; it
    reads no recipe itself."""
    import normswap.experiment as experiment
    from normswap.experiment import ExperimentResult

    calls = []
    monkeypatch.setattr(experiment, "load_recipe", lambda *a, **kw: calls.append("load_recipe"))
    monkeypatch.setattr(experiment, "run_experiment", lambda *a, **kw: calls.append((a, kw)) or
                        ExperimentResult(tmp_path, {}, {}))
    path = str(tmp_path / "r.toml")
    res = CliRunner().invoke(cli, ["experiment", path, "--set", "seed=3", "--set", "finetune.steps=2",
                                   "--arms", "original", "--out", str(tmp_path / "o"), "--no-progress"])
    assert res.exit_code == 0, res.output
    ((args, kwargs),) = calls
    assert args == (path, str(tmp_path / "o"), "original")
    assert kwargs["overrides"] == ("seed=3", "finetune.steps=2") and kwargs["progress"] is False
    assert kwargs["option_names"] == {"arms": "--arms", "out": "--out", "overrides": "--set", "force": "--force"}
    assert kwargs["force"] is False


def test_the_default_out_folder_is_the_librarys(tmp_path, monkeypatch, pretrained_dir):
    recipe = load_recipe(model_recipe(tmp_path, pretrained_dir, ["original"]))
    assert recipe.default_out() == Path("runs") / "tiny"
    monkeypatch.chdir(tmp_path)
    result = run_experiment(recipe, arms="original", progress=False, plot=False)
    assert result.out == tmp_path / "runs" / "tiny" and (result.out / "results.json").is_file()


def test_committed_results_name_no_machine_paths():
    for results in (ROOT / "recipes" / "results").glob("*/results.json"):
        data = json.loads(results.read_text())

        def strings(node):
            if isinstance(node, dict):
                for v in node.values():
                    yield from strings(v)
            elif isinstance(node, list):
                for v in node:
                    yield from strings(v)
            elif isinstance(node, str):
                yield node

        absolute = [s for s in strings(data) if s.startswith(("/", "~")) or ":\\" in s]
        assert not absolute, f"{results}: {absolute}"
        recipe = results.parents[2] / f"{data['recipe']['name']}.toml"
        assert (recipe.parent / data["recipe"]["data"]["eval"]).is_file()  # relative to the recipe


def test_arm_names():
    assert parse_arm("approx-bias+ft") == ("approx-bias", "ft")
    assert parse_arm("approx+distill") == ("approx", "distill")
    assert parse_arm("exact") == ("exact", None)
    with pytest.raises(RecipeError):
        parse_arm("exact+ft+ft")


# --------------------------------------------------------------------------- pretraining


def test_pretraining_gives_a_stock_checkpoint_that_beats_unigram(every_arm, pretrained_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

    info = every_arm.data["pretrain"]
    assert info["steps"] == 80 and info["heldout_ppl"] < info["unigram_ppl"]
    assert str(pretrained_dir).startswith(os.environ["NORMSWAP_CACHE"])
    model = AutoModelForCausalLM.from_pretrained(pretrained_dir)
    assert isinstance(model, GPT2LMHeadModel) and model.config.n_layer == 2
    ids = AutoTokenizer.from_pretrained(pretrained_dir)("In the beginning God")["input_ids"]
    assert max(ids) < model.config.vocab_size
    # The norms trained away from their init: the approx arms are meaningful on this model.
    assert not torch.allclose(model.transformer.h[0].ln_1.bias, torch.zeros(32))


def test_pretraining_is_cached(every_arm, cache, pretrained_dir):
    from accelerate import Accelerator

    from normswap.experiment.pretrain import ensure_pretrained, read_text

    recipe = load_recipe(Path(json.loads((every_arm.out / "recipe.json").read_text())["source"]))
    stamp = (pretrained_dir / "model.safetensors").stat().st_mtime_ns
    again, info = ensure_pretrained(Accelerator(), recipe.pretrain, recipe.seed, recipe.name,
                                    read_text(recipe.data.eval))
    reported = every_arm.data["pretrain"]  # the same, but results.json names the text relative to the recipe
    assert again == pretrained_dir and info == {**reported, "section": {**reported["section"], "text": recipe.pretrain.text}}
    assert (pretrained_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not trained again
    assert [p.name for p in (cache / "pretrain").iterdir()] == [pretrained_dir.name]  # no .partial left


# --------------------------------------------------------------------------- every arm


def test_every_arm_runs_and_reports(every_arm):
    out = every_arm.out
    for name in ("results.json", "results.csv", "summary.md", "curves.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    data = json.loads((out / "results.json").read_text())
    assert list(data["arms"]) == ALL_ARMS
    for name, arm in data["arms"].items():
        steps = [e["step"] for e in arm["evals"]]
        trained = "+" in name
        assert steps == ([0, 2, 4] if trained else [0])
        assert len(arm["losses"]) == (4 if trained else 0)
        for e in arm["evals"]:
            assert math.isfinite(e["ppl"]) and e["ppl"] > 1 and 0 <= e["top1_agreement"] <= 1 and e["kl_mean"] >= 0
    rows = {r["arm"]: r for r in every_arm.summary}
    assert rows["original"]["kl_mean"] < 1e-10 and rows["original"]["top1_agreement"] == 1.0
    # Fine-tuning moves the control away from the original.
    assert rows["original+ft"]["kl_mean"] > 1e-6
    for name in ("original+ft", "exact+ft", "exact", "approx"):
        assert rows[name]["recovered"] is None  # only for the trained approximate arms
    summary = (out / "summary.md").read_text()
    assert all(f"| {a} |" in summary for a in ALL_ARMS)
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("arm,step,ppl") and len(csv_lines) == 1 + 4 * 1 + 5 * 3
    # accelerate's tracker (tracker = "auto": TensorBoard, installed by the dev extra) logged the run.
    assert importlib.util.find_spec("tensorboard"), "pip install -e '.[dev]' (tensorboard) to test the tracker"
    assert any((out / "logs").rglob("events.out.tfevents*"))
    # No machine's paths in what a run writes (results get committed): texts relative to the
    # recipe, the pretrained model by its cache entry.
    assert data["recipe"]["data"]["train"] == GENESIS.name and data["recipe"]["pretrain"]["text"] == GENESIS.name
    assert data["pretrain"]["section"]["text"] == GENESIS.name
    assert data["model"] == f"<normswap cache>/pretrain/{Path(every_arm.model_path).name}"
    text = (out / "results.json").read_text()
    assert str(out.parent) not in text and str(Path.home()) not in text and os.environ["NORMSWAP_CACHE"] not in text
    # The arms' resumable state is gone once they are done; their results stay.
    assert not any((out / "arms" / a / "state").exists() for a in ALL_ARMS)


def test_the_command_ends_its_process_and_keeps_the_tracker_file(every_arm, cache, tmp_path):
    """`normswap experiment` ends the process itself after the report, without Python's teardown
    of every module (cli._exit_without_teardown): TensorBoard's event file still holds every scalar
    (accelerate's end_training closed it before), the results are written, no lock file is left."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_startup import marked_env

    path = write_recipe(tmp_path / "tiny.toml", PRETRAIN, arms=["original", "original+ft"])  # pretrained: cached
    env = {**marked_env(tmp_path), "NORMSWAP_CACHE": str(cache)}
    p = subprocess.run([sys.executable, "-m", "normswap", "experiment", str(path), "--out", str(tmp_path / "out"),
                        "--no-progress", "--json"], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["files"]["results.json"]
    # start-up's atexit handler ran, the teardown did not (the process was ended before it)
    assert "atexit: registered at start-up" in p.stderr.splitlines() and "teardown ran" not in p.stderr
    [events] = (tmp_path / "out" / "logs").rglob("events.out.tfevents*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    steps = {tag: [e.step for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
    assert steps["original+ft/train/loss"] == steps["original+ft/train/lr"] == [1, 2, 3, 4]
    for metric in ("ppl", "nll", "kl_mean", "kl_max", "top1_agreement"):
        assert steps[f"original+ft/eval/{metric}"] == [0, 2, 4]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(results["arms"]["original+ft"]["losses"]) == 4
    assert [f for f in [*tmp_path.rglob("*"), *cache.rglob("*")] if "lock" in f.name] == []


def test_a_report_file_that_is_a_link_is_written_through_it(every_arm, tmp_path):
    """The reports were renamed into place by hand (a fixed temporary name each), which replaced a
    link in OUT (summary.md linked into a notes folder, curves.png into a web folder) with a regular
    file. They are written as every normswap output file is (fileio.replaced_atomically): through
    the link, which stays, to the file it leads to; a link to nothing is refused, as every writer
    refuses it, and left as it was."""
    from normswap.errors import BadInputError
    from normswap.experiment import report

    out, notes = tmp_path / "out", tmp_path / "notes"
    out.mkdir()
    notes.mkdir()
    for name in ("summary.md", "curves.png"):
        (notes / name).write_bytes(b"earlier")
        (out / name).symlink_to(Path("..") / "notes" / name)
    files = report.write_reports(every_arm.data, out)
    assert set(files) == {"results.json", "results.csv", "summary.md", "curves.png"}
    assert all((out / name).is_symlink() for name in ("summary.md", "curves.png"))
    assert (notes / "summary.md").read_text(encoding="utf-8") == (every_arm.out / "summary.md").read_text(encoding="utf-8")
    assert (notes / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in notes.iterdir()) == ["curves.png", "summary.md"]  # no temporary left
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "results.csv", "results.json", "summary.md"]
    (out / "results.csv").unlink()
    (out / "results.csv").symlink_to(tmp_path / "nowhere" / "results.csv")
    with pytest.raises(BadInputError, match=f"^cannot write to {re.escape(str(out / 'results.csv'))}: .* is a link "
                                            "to nothing$"):
        report.write_reports(every_arm.data, out)
    assert (out / "results.csv").is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("name, leads_to, says", [
    ("summary.md", "nowhere", "is a link to nothing"),
    ("curves.png", "folder", "it is a folder"),
    ("results.csv", "pipe", "it is not a regular file (a pipe, socket or device); refusing to replace it"),
    ("arms/exact/result.json", "nowhere", "is a link to nothing")])
def test_a_report_link_that_cannot_be_written_through_is_refused_before_the_run(every_arm, tmp_path, monkeypatch,
                                                                               name, leads_to, says):
    """A report (or an unfinished arm's record) in OUT that is a link is written through it; one to
    nothing, to a folder or to a pipe failed that write only when the reports were written, after
    the pretraining and every arm had run (an arm's record after its training). Refused with OUT's
    checks instead, before anything runs, the link left as it was; the command says it in one line."""
    from normswap.errors import BadInputError
    from normswap.experiment import runner

    def ran(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(runner, "make_accelerator", ran)
    out = tmp_path / "out"
    link = out / name
    link.parent.mkdir(parents=True)
    shutil.copy(every_arm.out / "recipe.json", out / "recipe.json")  # an earlier run of this recipe
    target = {"nowhere": tmp_path / "nowhere" / "x", "folder": tmp_path / "folder", "pipe": tmp_path / "pipe"}[leads_to]
    if leads_to == "folder":
        target.mkdir()
    elif leads_to == "pipe":
        os.mkfifo(target)
    link.symlink_to(target)
    source = json.loads((out / "recipe.json").read_text())["source"]
    with pytest.raises(BadInputError, match=f"^cannot write to {re.escape(str(link))}: .*{re.escape(says)}$"):
        run_experiment(load_recipe(Path(source)), out, progress=False)
    r = CliRunner().invoke(cli, ["experiment", source, "--out", str(out)])
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and says in r.stderr, r.output
    assert link.is_symlink() and os.readlink(link) == str(target) and not (tmp_path / "nowhere").exists()
    assert not (out / "results.json").exists()
    if name == "curves.png":  # not drawn: not written, not asked
        with pytest.raises(AssertionError, match="the run started"):
            run_experiment(load_recipe(Path(source)), out, progress=False, plot=False)


def test_an_arm_record_linked_into_a_folder_one_may_not_enter_is_refused_first():
    """An unfinished arm's result.json in OUT, a link into another user's 0700 folder: the check of
    OUT's links asked is_file() of it, which raised PermissionError where the run is to say the
    folder in one line, before anything runs."""
    import tempfile

    from normswap.errors import BadInputError
    from normswap.experiment import runner
    from tests.test_fileio import _as_a_user_the_bits_bind

    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o711)
        out, locked = base / "out", base / "locked"
        (out / "arms" / "exact").mkdir(parents=True)
        for d in (out, out / "arms", out / "arms" / "exact"):
            d.chmod(0o755)
        (out / "recipe.json").write_text(json.dumps({"fingerprint": "f"}))
        (out / "recipe.json").chmod(0o644)
        locked.mkdir(mode=0o700)
        locked.chmod(0o700)
        link = out / "arms" / "exact" / "result.json"
        link.symlink_to(locked / "result.json")

        def said():
            try:
                runner._check_out(out, "f", ["exact"])
            except BadInputError as e:
                return str(e)
            return "passed"

        assert _as_a_user_the_bits_bind(said) == f"cannot write to {link}: {locked} cannot be entered (Permission denied)"
    finally:
        shutil.rmtree(base)


def test_exact_starts_at_the_original_and_approx_does_not(every_arm):
    arms = every_arm.data["arms"]
    original = arms["original"]["evals"][0]["ppl"]
    for name in ("exact", "exact+ft"):
        assert abs(arms[name]["evals"][0]["ppl"] - original) / original < 1e-6
    assert arms["exact"]["evals"][0]["kl_mean"] < 1e-9
    for name in ("approx", "approx+ft", "approx+distill"):
        assert abs(arms[name]["evals"][0]["ppl"] - original) / original > 1e-3
        assert arms[name]["evals"][0]["kl_mean"] > 1e-5
    # approx drops β: a different model from approx-bias, which keeps it.
    assert arms["approx"]["evals"][0]["ppl"] != arms["approx-bias"]["evals"][0]["ppl"]


def test_rerun_skips_finished_arms(every_arm):
    before = json.loads((every_arm.out / "results.json").read_text())["arms"]
    recipe = load_recipe(Path(json.loads((every_arm.out / "recipe.json").read_text())["source"]))
    again = run_experiment(recipe, every_arm.out, ["original", "approx+ft"], progress=False)
    assert again.data["arms"]["approx+ft"] == before["approx+ft"]


def test_the_reports_cover_every_arm_finished_in_out(tmp_path, pretrained_dir):
    """OUT is one run of the recipe: an arm finished by an earlier call with other arms stays in
    results.json, summary.md and results.csv (it was dropped from them, though still on disk), in
    the recipe's order; a folder under arms/ that names no arm is not part of the run."""
    path = model_recipe(tmp_path, pretrained_dir, ["original", "exact", "approx"])
    out = tmp_path / "out"
    first = run_experiment(load_recipe(path), out, ["approx"], progress=False)
    (out / "arms" / "notes").mkdir()
    (out / "arms" / "notes" / "result.json").write_text("{}")
    second = run_experiment(load_recipe(path), out, ["exact", "original"], progress=False)
    assert list(second.data["arms"]) == ["original", "exact", "approx"]
    assert second.data["arms"]["approx"] == first.data["arms"]["approx"]
    assert [r["arm"] for r in second.summary] == ["original", "exact", "approx"]
    saved = json.loads((out / "results.json").read_text())
    assert list(saved["arms"]) == ["original", "exact", "approx"]
    summary = (out / "summary.md").read_text()
    assert "| approx | 0 |" in summary and "| original | 0 |" in summary
    assert [line.split(",")[0] for line in (out / "results.csv").read_text().splitlines()[1:]] == \
        ["original", "exact", "approx"]


def test_the_summary_says_what_the_fine_tuning_ran(every_arm):
    """summary.md states the fine-tuning settings used, whatever the recipe's description says (the
    shipped one says 100 steps; after --set finetune.steps=4 its summary still said only that)."""
    summary = (every_arm.out / "summary.md").read_text()
    assert ("Fine-tuning: 4 steps of 2 sequences × 32 tokens (2 per micro-batch × 1 accumulated × 1 process), "
            "adamw at lr 0.001 (cosine, after 1 warm-up step), fp32; evaluated every 2 steps.") in summary
    # and the units of its KL column (it gave none)
    assert "KL: the mean KL(original‖arm) per token, in nats; top-1: the share of tokens" in summary
    from normswap.experiment.report import summary_markdown

    result = json.loads((every_arm.out / "results.json").read_text())
    result["recipe"]["finetune"].update(steps=1, warmup_steps=0, eval_every=1)
    # Each trained arm records its process count (arms in one OUT may come from calls launched
    # differently); an arm result from before that counts as this call's.
    assert all(a.get("num_processes") == (1 if parse_arm(arm)[1] else None) for arm, a in result["arms"].items())
    trained = [arm for arm in result["arms"] if parse_arm(arm)[1]]
    for arm in trained:
        del result["arms"][arm]["num_processes"]
    result["environment"]["num_processes"] = 2
    assert ("Fine-tuning: 1 step of 4 sequences × 32 tokens (2 per micro-batch × 1 accumulated × 2 processes), "
            "adamw at lr 0.001 (cosine, no warm-up), fp32; evaluated every step.") in summary_markdown(result)
    for arm in trained:
        result["arms"][arm]["num_processes"] = 2 if arm in ("exact+ft", "approx+ft") else 1
    result["environment"]["num_processes"] = 1
    assert ("Fine-tuning: 1 step of 2 or 4 sequences × 32 tokens (2 per micro-batch × 1 accumulated × 1 or 2 "
            "processes; 1: original+ft, approx-bias+ft, approx+distill; 2: exact+ft, approx+ft), ") in \
        summary_markdown(result)
    result["arms"] = {arm: a for arm, a in result["arms"].items() if parse_arm(arm)[1] is None}
    assert "Fine-tuning:" not in summary_markdown(result)  # no arm trained


def test_the_summary_names_the_control_the_recovered_share_was_measured_against(every_arm):
    """Without original+ft, recovered is measured against the untrained original (summary_rows):
    the summary's line still said "final nll of original+ft" and "each model compared with the
    original trained the same way"."""
    from normswap.experiment.report import summary_markdown, summary_rows

    result = json.loads((every_arm.out / "results.json").read_text())
    assert "1 − (final nll − final nll of original+ft) / (nll at step 0 − nll of original)" in summary_markdown(result)
    del result["arms"]["original+ft"]
    row = next(r for r in summary_rows(result["arms"]) if r["arm"] == "approx+ft")
    arms = result["arms"]
    gap_start = arms["approx+ft"]["evals"][0]["nll"] - arms["original"]["evals"][0]["nll"]
    assert row["recovered"] == pytest.approx(
        1 - (arms["approx+ft"]["evals"][-1]["nll"] - arms["original"]["evals"][-1]["nll"]) / gap_start)
    summary = summary_markdown(result)
    assert "1 − (final nll − final nll of original) / (nll at step 0 − nll of original)" in summary
    assert "final nll of original+ft" not in summary and "trained the same way" not in summary
    assert "against the untrained original" in summary


@pytest.mark.parametrize("overrides, says", [
    (["finetune.steps=4", "finetune.warmup_steps=10"],
     r"finetune.steps \(4\) is not more than finetune.warmup_steps \(10\): the whole run is the warm-up, its "
     r"learning rate rising to 0.0004 at the last step \(finetune.lr 0.001\), and the cosine schedule after it never runs"),
    (["pretrain.steps=3", "pretrain.warmup_steps=3"], r"pretrain.steps \(3\) is not more than pretrain.warmup_steps"),
])
def test_a_run_that_never_leaves_its_warm_up_is_warned_about(tmp_path, overrides, says):
    """A quick trial (--set finetune.steps=4 on the shipped recipe, which warms up for 10 steps)
    runs, but its learning rate is not the recipe's: said, not silent."""
    path = write_recipe(tmp_path / "tiny.toml", PRETRAIN)
    with pytest.warns(UserWarning, match=says):
        load_recipe(path, overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_recipe(path, ["finetune.steps=2"])  # 2 steps after 1 warm-up step: nothing to say


@pytest.mark.parametrize("overrides, arms, same", [
    ([f'data.eval="{GENESIS.name}"'], ["original"], "pretrain.text"),
    ([f'data.eval="{GENESIS.name}"'], ["original", "approx+ft"], "pretrain.text and data.train"),
    (['data.eval="copy.txt"', 'data.train="copy.txt"', f'pretrain.text="{JOSHUA.name}"'], ["approx+ft"],
     "data.train"),
])
def test_a_held_out_text_that_is_a_training_text_is_warned_about(tmp_path, monkeypatch, overrides, arms, same):
    """data.eval the same text as pretrain.text or data.train (a copy under another name too) ran
    without a word, its perplexity reported as held-out. Said before anything runs."""
    from normswap.experiment import runner

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "make_accelerator", lambda *a, **k: pytest.fail("the run started"))
    path = write_recipe(tmp_path / "tiny.toml", PRETRAIN)
    (tmp_path / "copy.txt").write_bytes(GENESIS.read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first warning stops the run where it is said
        with pytest.raises(UserWarning, match=rf"^data\.eval is the same text as {same}: its perplexity is not held "
                                              r"out \(the reports call it so\), it measures how well the models fit "
                                              r"the text they trained on$"):
            run_experiment(path, tmp_path / "out", arms, overrides=overrides, progress=False)
        # data.train that no arm trains on, a held-out text of its own: nothing to say
        with pytest.raises(pytest.fail.Exception, match="the run started"):
            run_experiment(path, tmp_path / "out", ["original"], overrides=[f'data.train="{JOSHUA.name}"'],
                           progress=False)


def test_under_a_launcher_only_rank_0_prints_normswap_warnings(tmp_path, monkeypatch):
    """`accelerate launch -m normswap experiment` runs the command in every process, and each reads
    the recipe: the warm-up warning came once per process. Rank 0 says it; the others do not (an
    error is still said by every process). Here the run stops at an unknown arm, after the recipe."""
    path = write_recipe(tmp_path / "tiny.toml", PRETRAIN)
    command = ["experiment", str(path), "--out", str(tmp_path / "out"), "--arms", "nonesuch",
               "--set", "finetune.steps=1", "--set", "finetune.warmup_steps=5"]
    said = {}
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        r = CliRunner().invoke(cli, command)
        assert r.exit_code == 2, r.stderr
        said[rank] = [line for line in r.stderr.splitlines() if line.startswith("normswap: warning:")]
        assert r.stderr.splitlines()[-1].startswith("normswap: error: --arms: "), r.stderr
    assert said["1"] == []
    assert len(said["0"]) == 1 and "finetune.steps (1) is not more than finetune.warmup_steps (5)" in said["0"][0]


@pytest.mark.parametrize("raised, code, every_process", [
    (None, 2, True),  # a usage error: every process parses the same arguments
    ("EveryProcessError", 2, True), ("Interrupted", 130, True),
    ("NormswapError", 2, False),  # a process's own failure: said by the process that has it
])
def test_under_a_launcher_what_every_process_stops_for_is_said_by_the_main_one(tmp_path, monkeypatch, raised, code,
                                                                               every_process):
    """Under `accelerate launch` each process said the error it stopped with: a refusal, the
    stop of a Ctrl-C, a mistyped option came once per process. Rank 0 says what every process
    stops for; a failure of one process's own is still said by it."""
    import normswap.experiment
    from normswap import errors

    def run(*a, **k):
        raise getattr(errors, raised, Interrupted)("what stopped it")

    monkeypatch.setattr(normswap.experiment, "run_experiment", run)
    path = write_recipe(tmp_path / "tiny.toml", PRETRAIN)
    command = ["experiment", str(path), "--arms"] + (["original"] if raised else [])
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        r = CliRunner().invoke(cli, command)
        assert r.exit_code == code, r.stderr
        if raised:
            assert r.stderr == ("" if rank == "1" and every_process else
                                f"normswap: {'' if raised == 'Interrupted' else 'error: '}what stopped it\n")
        else:
            assert r.stderr == ("" if rank == "1" else "normswap: error: Option '--arms' requires an argument.\n")


@pytest.mark.parametrize("bad", ["{}", '{"evals": []}', '{"evals": [{"step": 0}]}', '{"evals": [1]}',
                                 '{"evals": [{"step": 0, "ppl": 1, "nll": 0, "kl_mean": 0, "kl_max": 0, '
                                 '"top1_agreement": 1}], "losses": 3}'])
def test_a_finished_arm_whose_result_is_not_one_is_bad_input(tmp_path, pretrained_dir, bad):
    """An arms/<arm>/result.json the reports cannot read (here one an earlier call did not write,
    while this call runs another arm) is refused naming the file and the way out; it was an
    internal error (KeyError, IndexError) after this call's arms had run. Their results stay."""
    from normswap.errors import NormswapError

    path = model_recipe(tmp_path, pretrained_dir, ["original", "exact", "approx"])
    out = tmp_path / "out"
    run_experiment(load_recipe(path), out, ["approx"], progress=False)
    (out / "arms" / "exact").mkdir(parents=True)
    (out / "arms" / "exact" / "result.json").write_text(bad)
    for arms in (["original"], ["exact"]):  # an earlier call's arm, and one asked for
        with pytest.raises(NormswapError, match=r"exact/result.json: not an arm result .*delete it to run the arm "
                                                r"exact again"):
            run_experiment(load_recipe(path), out, arms, progress=False)
    assert (out / "arms" / "original" / "result.json").is_file()


def test_another_recipe_in_the_same_out_is_refused(every_arm, tmp_path):
    """Refused naming what differs: it said only "a different recipe (or other --set values)", also
    to a user who had changed neither but edited a text the recipe names."""
    from normswap.errors import NormswapError

    recipe = load_recipe(Path(json.loads((every_arm.out / "recipe.json").read_text())["source"]),
                         ["finetune.lr=0.5"])
    with pytest.raises(NormswapError, match=r"holds a run of a different recipe \(finetune\.lr 0\.001 there, 0\.5 "
                                            r"here\); remove it or choose another out, or pass force=True to "
                                            r"replace it and the 9 arms finished there \(approx, approx\+distill, approx\+ft and 6 more\)$"):
        run_experiment(recipe, every_arm.out, progress=False)
    # The recipe as it was, in another folder (a moved checkout: the same run), its held-out text edited
    out = tmp_path / "out"
    shutil.copytree(every_arm.out, out, ignore=shutil.ignore_patterns("logs", "state"))
    path = write_recipe(tmp_path / "tiny.toml", PRETRAIN)
    assert load_recipe(path).fingerprint() == json.loads((out / "recipe.json").read_text())["fingerprint"]
    import gzip

    (tmp_path / JOSHUA.name).write_bytes(gzip.compress(gzip.decompress(JOSHUA.read_bytes()) + b"Amen.\n"))
    with pytest.raises(NormswapError, match=r"holds a run of a different recipe \(data\.eval: its text has changed\);"):
        run_experiment(path, out, ["original"], progress=False)
    # a recipe.json from before the texts were recorded: which one changed cannot be told
    record = json.loads((out / "recipe.json").read_text())
    del record["texts"]
    (out / "recipe.json").write_text(json.dumps(record))
    with pytest.raises(NormswapError, match=r"different recipe \(the same keys: a text it names has changed "
                                            r"\(pretrain\.text, data\.train, data\.eval\)\);"):
        run_experiment(path, out, ["original"], progress=False)



def test_a_run_that_failed_is_replaced_with_force_when_out_holds_only_the_run(tmp_path, pretrained_dir):
    """An arm that trained into a NaN loss left OUT holding that learning rate's run: the rerun with
    a lower one was refused as another recipe's, and OUT had to be deleted by hand. The NaN's line
    now names the key and the way out, the refusal offers --force and says what it replaces, and
    --force replaces OUT once every check of the run has passed, only when OUT holds nothing but
    what a run writes."""
    path = model_recipe(tmp_path, pretrained_dir, ["original", "approx+ft"])
    out = tmp_path / "out"
    unstable = ["--set", 'finetune.optimizer="sgd"', "--set", "finetune.max_grad_norm=0", "--set",
                "finetune.warmup_steps=0"]

    def run(*args):
        return CliRunner().invoke(cli, ["experiment", str(path), "--out", str(out), "--no-progress", *unstable,
                                        *args])

    r = run("--set", "finetune.lr=1e6")
    assert r.exit_code == 2 and re.fullmatch(
        r"normswap: error: \[2/2\] approx\+ft: the training loss is nan at step \d: lower finetune\.lr \(1000000\.0 "
        r"now\), then run again with --force to replace this run\n", r.stderr), r.stderr
    assert (out / "arms" / "original" / "result.json").is_file() and (out / "arms" / "approx+ft" / "state").is_dir()
    r = run("--set", "finetune.lr=1e-3")
    assert r.exit_code == 2 and r.stderr == (
        f"normswap: error: {out} holds a run of a different recipe (finetune.lr 1000000.0 there, 0.001 here); remove "
        "it or choose another --out, or pass --force to replace it and the 1 arm finished there (original)\n")
    (out / "notes.txt").write_text("mine")
    before = _files(out)
    r = run("--set", "finetune.lr=1e-3", "--force")
    assert r.exit_code == 2 and r.stderr == (
        f"normswap: error: {out} holds a run of another recipe and what no run writes (notes.txt): not replaced, "
        "even with --force; remove it or choose another --out\n")
    r = run("--set", "finetune.lr=1e-3")  # and --force is not offered for it
    assert r.stderr.endswith("; remove it or choose another --out\n"), r.stderr
    (out / "notes.txt").unlink()
    before = _files(out)
    r = run("--set", "finetune.lr=1e-3", "--set", "finetune.seq_len=100000", "--force")  # refused after OUT's check
    assert r.exit_code == 2 and "finetune.seq_len" in r.stderr, r.stderr
    assert _files(out) == before  # nothing replaced before every check had passed
    r = run("--set", "finetune.lr=1e-3", "--force")
    assert r.exit_code == 0, r.stderr
    record = json.loads((out / "recipe.json").read_text())
    assert record["recipe"]["finetune"]["lr"] == 1e-3
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(loss) for loss in results["arms"]["approx+ft"]["losses"])
    assert {p.name for p in out.iterdir()} <= {"arms", "logs", "recipe.json", "results.csv", "results.json",
                                               "summary.md", "curves.png"}
    assert sorted(str(p.relative_to(out)) for p in (out / "arms").rglob("*")) == [
        "arms/approx+ft", "arms/approx+ft/result.json", "arms/original", "arms/original/result.json"]
    # the same recipe again: resumed (here: every arm finished), force or not, nothing rerun
    before = _files(out / "arms")
    assert run("--set", "finetune.lr=1e-3", "--force").exit_code == 0
    assert _files(out / "arms") == before


DEEP = "[" * 100_000 + "]" * 100_000  # past json's recursion limit: json.loads raised RecursionError


@pytest.mark.parametrize("content, says", [(DEEP, "malformed JSON (nested too deeply: more than 100 levels)"),
                                           ("[1, 2]", "not a")])
@pytest.mark.parametrize("record", ["arm result", "training state", "pretraining record"])
def test_a_malformed_record_of_an_earlier_run_is_bad_input(every_arm, cache, tmp_path, monkeypatch, record,
                                                           content, says):
    """What an earlier run left (an arm's result.json, a checkpoint's trainer.json, the cached
    pretraining's normswap-pretrain.json), nested too deeply or of the wrong shape: one line naming
    the file and what to delete, exit 2. Nesting was an internal error (RecursionError) and a list
    in place of the object an AttributeError or TypeError."""
    import shutil

    from normswap.experiment.pretrain import INFO_FILE
    from normswap.experiment.trainer import LATEST, TRAINER_STATE

    out = tmp_path / "out"
    shutil.copytree(every_arm.out, out)
    arm = "original" if record == "arm result" else "approx+ft"
    if record == "arm result":
        bad = out / "arms" / arm / "result.json"
        remedy = f"delete it to run the arm {arm} again"
    elif record == "training state":  # an arm stopped at its step-2 checkpoint
        (out / "arms" / arm / "result.json").unlink()
        state = out / "arms" / arm / "state"
        bad = state / "step-000002" / TRAINER_STATE
        bad.parent.mkdir(parents=True)
        (state / LATEST).write_text(bad.parent.name)
        remedy = f"delete {state} to train from the start"
    else:
        shutil.copytree(cache, tmp_path / "cache")
        monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
        (bad,) = (tmp_path / "cache").glob(f"pretrain/*/{INFO_FILE}")
        remedy = f"delete {bad.parent} to pretrain again"
    bad.write_text(content)
    source = json.loads((out / "recipe.json").read_text())["source"]
    r = CliRunner().invoke(cli, ["experiment", source, "--out", str(out), "--arms", arm])
    assert r.exit_code == 2 and r.stdout == "", (r.exit_code, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("normswap:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines[0].startswith(f"normswap: error: {bad}: {says}") and lines[0].endswith(remedy), lines


def test_a_rerun_on_a_full_disk_keeps_the_record_of_the_earlier_run(tmp_path):
    """A rerun (a resume) writes recipe.json again first; on a full disk the plain write truncated
    it, and every later run was refused ("recipe.json: malformed JSON; remove OUT"): the way out
    offered lost every finished arm. Written through a temporary file, it stays as it was."""
    import resource

    from tiny_models import save_tiny

    save_tiny("gpt2", tmp_path / "gpt2")
    path = model_recipe(tmp_path, tmp_path / "gpt2", ["original"])
    out = tmp_path / "out"
    code = (f"from normswap.experiment import run_experiment; "
            f"run_experiment({str(path)!r}, {str(out)!r}, progress=False, plot=False)")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300, capture_output=True)
    record = (out / "recipe.json").read_bytes()

    def full_disk():  # no file may grow past 100 bytes: recipe.json is larger
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))

    p = subprocess.run([sys.executable, "-c", code], env=env, timeout=300, capture_output=True, text=True,
                       preexec_fn=full_disk)
    assert p.returncode != 0 and "File too large" in p.stderr, p.stderr[-2000:]
    assert (out / "recipe.json").read_bytes() == record
    assert [q.name for q in out.iterdir() if q.name.startswith(".")] == []  # no temporary file left


def test_an_out_folder_that_holds_no_run_is_refused(tmp_path, monkeypatch):
    """`--out ~/thesis`: a folder with files in it and no recipe.json is not an earlier run, and a
    run writes results.csv, summary.md, curves.png, logs/ and arms/ into it, replacing the user's
    files of those names. Refused before anything is written; an empty folder is fine."""
    from normswap.errors import NormswapError
    from normswap.experiment import runner

    def ran(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(runner, "make_accelerator", ran)
    recipe = load_recipe(write_recipe(tmp_path / "r.toml", PRETRAIN))
    user = tmp_path / "thesis"
    user.mkdir()
    (user / "summary.md").write_text("years of work")
    with pytest.raises(NormswapError, match=r"holds files and no earlier run of normswap experiment; refusing to "
                                            r"write into it \(choose a new or empty out\)$"):  # the parameter
        run_experiment(recipe, user, progress=False)
    r = CliRunner().invoke(cli, ["experiment", str(tmp_path / "r.toml"), "--out", str(user)])
    assert r.exit_code == 2 and r.stderr.rstrip().endswith("(choose a new or empty --out)"), r.stderr  # the flag
    assert [p.name for p in user.iterdir()] == ["summary.md"]
    assert (user / "summary.md").read_text() == "years of work"
    (tmp_path / "empty").mkdir()
    with pytest.raises(AssertionError, match="the run started"):
        run_experiment(recipe, tmp_path / "empty", progress=False)

def _hold_lock(lock: Path) -> int:
    """Lock as another normswap run holding `lock` does (flock conflicts between open files, also
    within one process), its pid written in it."""
    import fcntl

    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    os.write(fd, b"4242")
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_second_run_into_the_same_out_is_refused_at_once(tmp_path, monkeypatch):
    """Two `normswap experiment` runs into one OUT (a rerun started while the first still runs)
    trained the same arm into one state folder, each removing the other's checkpoints, and wrote
    each other's reports: the second is now refused at once by the lock patch and convert take."""
    from normswap.errors import NormswapError
    from normswap.experiment import runner

    def ran(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(runner, "make_accelerator", ran)
    recipe = load_recipe(write_recipe(tmp_path / "r.toml", PRETRAIN))
    out = tmp_path / "runs" / "x"
    fd = _hold_lock(tmp_path / "runs" / ".x.normswap.lock")
    try:
        with pytest.raises(NormswapError, match=r"another normswap run \(pid 4242\) is writing .*runs/x"):
            run_experiment(recipe, out, progress=False)
    finally:
        os.close(fd)
    assert not out.exists()
    with pytest.raises(AssertionError, match="the run started"):  # released: the run goes ahead
        run_experiment(recipe, out, progress=False)
    assert list((tmp_path / "runs").iterdir()) == []  # the failed run's OUT and its lock file are gone


def test_a_pretraining_another_run_is_doing_is_refused_at_once(tmp_path, monkeypatch):
    """Two experiments sharing a [pretrain] section (two --out folders) trained into one .partial
    cache folder at once."""
    from types import SimpleNamespace

    from normswap.errors import NormswapError
    from normswap.experiment import pretrain

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe(write_recipe(tmp_path / "r.toml", PRETRAIN))
    final = pretrain.pretrain_dir(recipe.pretrain, recipe.seed, recipe.name)
    fd = _hold_lock(final.parent / f".{final.name}.normswap.lock")
    try:
        with pytest.raises(NormswapError, match=r"another normswap run \(pid 4242\) is writing"):
            pretrain.ensure_pretrained(SimpleNamespace(is_main_process=True), recipe.pretrain, recipe.seed,
                                       recipe.name, pretrain.read_text(recipe.data.eval), progress=False)
    finally:
        os.close(fd)
    assert not final.with_name(final.name + ".partial").exists()


def test_a_run_refused_for_a_pretraining_another_run_is_doing_leaves_no_out(tmp_path, monkeypatch):
    """The second of two experiments sharing a [pretrain] section (two --out folders) was refused once
    it had written OUT/recipe.json and OUT/logs/: a run of nothing, which a rerun with another recipe
    was refused for. Refused before OUT is made now. And the entry's lock is let go once it is
    trained: another run may use it while this one's arms run."""
    from normswap.errors import NormswapError
    from normswap.experiment import pretrain

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    path = write_recipe(tmp_path / "r.toml", PRETRAIN, ["original", "original+ft"])
    recipe = load_recipe(path)
    final = pretrain.pretrain_dir(recipe.pretrain, recipe.seed, recipe.name)
    lock = final.parent / f".{final.name}.normswap.lock"
    fd = _hold_lock(lock)
    try:
        with pytest.raises(NormswapError, match=r"another normswap run \(pid 4242\) is writing .*; try again"):
            run_experiment(path, tmp_path / "out", progress=False)
    finally:
        os.close(fd)
    assert not (tmp_path / "out").exists()
    free = []

    def on_step(arm, step, loss):  # during the fine-tuning, as another run would take it (at once or not)
        import fcntl

        fd = os.open(lock, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free.append(arm)
        finally:
            os.close(fd)

    run_experiment(path, tmp_path / "out", progress=False, on_step=on_step,
                   overrides=["finetune.steps=1", "finetune.warmup_steps=0"])
    assert free == ["original+ft"]


@pytest.mark.parametrize("arms, train", [(["original"], None), (["original", "approx+ft"], None),
                                         (["original", "approx+ft"], "other.txt")])
def test_a_pretraining_reads_its_texts_once(tmp_path, monkeypatch, arms, train):
    """pretrain.text was read whole for the check before the run (the most tokens it can make) and
    again by the pretraining, and a third time as data.train when it is that file (the shipped
    recipes pretrain on their data.train): 2 s a read for a 100 MB text here. Read once now, and the
    pretraining's tokenizer is trained on what was read. The pretraining read data.eval again for
    its held-out perplexity, which the run had read for its own evaluations: once now, and the
    pretraining scores what was read."""
    from normswap.experiment import pretrain, runner

    class Pretraining(Exception):
        pass

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe(write_recipe(tmp_path / "r.toml", PRETRAIN, arms))
    if train:
        other_text(tmp_path, train)
    real, real_encode = pretrain.read_text, pretrain.encode
    whole, reads, trained_on, encoded = real(recipe.pretrain.text), [], [], []

    def counted(path):
        reads.append(Path(path).name)
        return real(path)

    def train_tokenizer(text, vocab_size):
        trained_on.append(text)
        return real_train_tokenizer(text, vocab_size)

    def encode(tokenizer, text):
        encoded.append(text)
        return real_encode(tokenizer, text)

    def build_model(*args):  # the texts are encoded: the rest is the training
        raise Pretraining

    bounded = []

    def most_tokens(text):
        bounded.append(text)
        return real_most_tokens(text)

    real_train_tokenizer, real_most_tokens = pretrain.train_tokenizer, pretrain.most_tokens
    digested = _count_digests(monkeypatch)
    monkeypatch.setattr(pretrain, "most_tokens", most_tokens)
    monkeypatch.setattr(runner, "most_tokens", most_tokens)
    monkeypatch.setattr(pretrain, "read_text", counted)
    monkeypatch.setattr(runner, "read_text", counted)
    monkeypatch.setattr(pretrain, "train_tokenizer", train_tokenizer)
    monkeypatch.setattr(pretrain, "encode", encode)
    monkeypatch.setattr(pretrain, "build_model", build_model)
    with pytest.raises(Pretraining):
        run_experiment(tmp_path / "r.toml", tmp_path / "out", overrides=[f'data.train="{train}"'] if train else [],
                       progress=False)
    assert trained_on == [whole]
    held_out = real(recipe.data.eval)
    assert encoded == [whole, held_out]  # the training text, the held-out one
    # The bound on the tokens (the UTF-8 encode of a whole text) once per text read: pretrain.text's
    # served the check of one sequence and of the model's size (it was counted for each), data.eval's
    # the pretraining's window and the evaluation's; and once more for the tokenizer's vocabulary cap
    texts = [whole, held_out, *([real(tmp_path / train)] if train and "approx+ft" in arms else [])]
    assert sorted(map(len, bounded)) == sorted(map(len, [*texts, whole])), [len(t) for t in bounded]
    # pretrain.text (GENESIS) once, also when data.train is that file; data.eval (JOSHUA) once, also
    # for the pretraining's held-out perplexity; data.train when it is another file and an arm trains
    assert sorted(reads) == sorted([GENESIS.name, JOSHUA.name, *([train] if train else [])]), reads
    # each file's digest once too: the fingerprint's (in recipe.json) and the cache entry's, looked
    # up before the run and again by the pretraining
    assert sorted(digested) == sorted([GENESIS.name, JOSHUA.name, *([train] if train else [])]), digested


@pytest.mark.filterwarnings("ignore:pretraining did not beat the unigram baseline")
@pytest.mark.parametrize("train", [GENESIS.name, "copy.txt"])
def test_a_training_text_that_is_the_pretraining_text_is_tokenized_once(tmp_path, monkeypatch, train):
    """The shipped recipes fine-tune on the text they pretrain on: a first run tokenized it for the
    pretraining, then again with the same tokenizer for the arms (8 s for the smoke recipe's 3 MB
    under load). Once now, also when data.train is a copy under another name; and the arms train on
    the same tokens as a run that finds the pretraining cached (and so tokenizes data.train itself)."""
    from normswap.experiment import pretrain, runner

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    path = write_recipe(tmp_path / "r.toml", PRETRAIN, ["original", "approx+ft"])
    (tmp_path / "copy.txt").write_bytes(GENESIS.read_bytes())
    whole = pretrain.read_text(GENESIS)
    encoded = []

    def encode(tokenizer, text):
        encoded.append(text == whole)
        return real_encode(tokenizer, text)

    real_encode = pretrain.encode
    monkeypatch.setattr(pretrain, "encode", encode)
    monkeypatch.setattr(runner, "encode", encode)
    overrides = ["pretrain.steps=4", "pretrain.warmup_steps=1", "finetune.steps=2", "finetune.eval_every=2",
                 f'data.train="{train}"']
    first = run_experiment(path, tmp_path / "first", overrides=overrides, progress=False)
    assert first.data["pretrain"]["steps"] == 4  # it pretrained
    assert encoded.count(True) == 1, encoded
    encoded.clear()
    cached = run_experiment(path, tmp_path / "cached", overrides=overrides, progress=False)
    assert encoded.count(True) == 1, encoded  # data.train's, by the runner
    assert cached.data["arms"]["approx+ft"]["losses"] == first.data["arms"]["approx+ft"]["losses"]


def _count_digests(monkeypatch) -> list[str]:
    """The names of the files whose digest (recipe.file_digest: a read of the whole file) is taken
    from now on, one entry per digest."""
    from normswap.experiment import pretrain, recipe

    real, digested = recipe.file_digest, []

    def counted(path):
        digested.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(recipe, "file_digest", counted)
    monkeypatch.setattr(pretrain, "file_digest", counted)
    return digested


def test_tokenizing_a_long_text_is_a_stage_on_stderr(tmp_path, monkeypatch, capsys, pretrained_dir):
    """Training the tokenizer on a long text and tokenizing it (the smoke recipe's 3 MB: 8 s of encode
    under load; a 100 MB text, minutes) ran with nothing on stderr: the first bar came after them, and
    the training text was tokenized again, silently, before the first arm. Each is a stage now, when
    the text is LONG_TEXT or longer (here every text is)."""
    from normswap.experiment import pretrain

    class Pretraining(Exception):
        pass

    def build_model(*args):  # the texts are tokenized: the rest is the training
        raise Pretraining

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrain, "LONG_TEXT", 0)
    monkeypatch.setattr(pretrain, "build_model", build_model)
    with pytest.raises(Pretraining):
        run_experiment(write_recipe(tmp_path / "r.toml", PRETRAIN), tmp_path / "out", ["original+ft"])
    stages = [line for line in capsys.readouterr().err.splitlines() if line.endswith(" ...")]
    assert stages == ["pretrain: train the tokenizer ...", "pretrain: tokenize pretrain.text ...",
                      "pretrain: tokenize data.eval ..."]
    path = model_recipe(tmp_path, pretrained_dir, ["original+ft"])
    run_experiment(path, tmp_path / "out2", overrides=["finetune.steps=1", "finetune.warmup_steps=0"])
    stages = [line for line in capsys.readouterr().err.splitlines() if line.endswith(" ...")]
    assert stages[:2] == ["tokenize data.train ...", "tokenize data.eval ..."], stages
    monkeypatch.setattr(pretrain, "LONG_TEXT", 1 << 20)  # texts of kilobytes: no line
    run_experiment(path, tmp_path / "out3", overrides=["finetune.steps=1", "finetune.warmup_steps=0"])
    assert "tokenize" not in capsys.readouterr().err


def test_a_text_that_cannot_be_read_for_its_digest_is_one_line_naming_its_key():
    """The run takes the texts' digests before it reads them (its fingerprint, checked against an
    earlier run in OUT before anything else): a text this user may not read is the line the read
    would give, naming the key, not an OSError naming a file alone."""
    import tempfile

    from tests.test_fileio import _as_a_user_the_bits_bind

    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o711)  # nobody may pass through it
        recipe = load_recipe(write_recipe(base / "r.toml", PRETRAIN))
        for f in (GENESIS.name, JOSHUA.name, "r.toml"):
            (base / f).chmod(0o644)
        (base / JOSHUA.name).chmod(0o600)  # data.eval: this user's alone

        def said():
            try:
                recipe.text_digests()
            except RecipeError as e:
                return str(e)
            return "read"

        assert _as_a_user_the_bits_bind(said) == f"data.eval: {base / JOSHUA.name}: cannot read (Permission denied)"
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("arms", [["original"], ["original", "approx+ft"]])
def test_a_run_takes_each_texts_digest_once(tmp_path, monkeypatch, pretrained_dir, arms):
    """A run on a cached pretraining took pretrain.text's digest six times (the fingerprint in
    recipe.json and in results.json, each with data.train, the same file; the cache entry looked
    up before the run and by the pretraining) and data.eval's twice; a rerun into the same OUT
    once more each (its recipe.json's fingerprint checked): 0.36 s per 100 MB each here. Once per
    run now, the same fingerprint recorded and the cached pretraining used."""
    path = write_recipe(tmp_path / "r.toml", PRETRAIN, arms)
    if len(arms) > 1:  # data.train another file than pretrain.text
        (tmp_path / "r.toml").write_text((tmp_path / "r.toml").read_text().replace(
            f'train = "{GENESIS.name}"', f'train = "{other_text(tmp_path)}"'))
    recipe = load_recipe(path)
    digested = _count_digests(monkeypatch)
    first = run_experiment(path, tmp_path / "out", progress=False)
    distinct = sorted({GENESIS.name, JOSHUA.name, *(["other.txt"] if len(arms) > 1 else [])})
    assert sorted(digested) == distinct, digested
    assert json.loads((tmp_path / "out" / "recipe.json").read_text())["fingerprint"] == first.data["fingerprint"]
    del digested[:]
    again = run_experiment(path, tmp_path / "out", progress=False)  # a rerun: every arm finished already
    assert sorted(digested) == distinct, digested
    monkeypatch.undo()
    assert again.data["fingerprint"] == first.data["fingerprint"] == recipe.fingerprint()
    assert Path(first.model_path) == pretrained_dir  # the cached pretraining, found through the digest given


def test_a_pretraining_published_while_the_lock_was_awaited_is_used(tmp_path, monkeypatch):
    """A run that found no cached pretraining, then took the lock just as the run holding it
    published the entry and let go, trained it all again (minutes) and replaced the entry the
    other experiment was about to load: the entry is looked for again under the lock."""
    import contextlib
    from types import SimpleNamespace

    from normswap import checkpoint
    from normswap.experiment import pretrain

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe(write_recipe(tmp_path / "r.toml", PRETRAIN))
    final = pretrain.pretrain_dir(recipe.pretrain, recipe.seed, recipe.name)

    @contextlib.contextmanager
    def other_run_finishes(target):
        final.mkdir(parents=True)
        (final / pretrain.INFO_FILE).write_text(json.dumps({"steps": 7}))
        yield

    def trains(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(checkpoint, "target_lock", other_run_finishes)
    monkeypatch.setattr(pretrain, "_pretrain", trains)
    assert pretrain.ensure_pretrained(SimpleNamespace(is_main_process=True), recipe.pretrain, recipe.seed,
                                      recipe.name, "", progress=False) == (final, {"steps": 7})


@pytest.mark.parametrize("model, arms, override, message", [
    ("gpt2", ["original"], "data.eval=bin.txt", "data.eval: .*bin.txt: a binary file"),
    ("gpt2", ["original", "exact+ft"], "data.train=bin.txt", "data.train: .*bin.txt: a binary file"),
    ("gpt2", ["original", "approx+ft"], "data.train=short.txt", "data.train: the training text has"),
    ("gpt2", ["original", "approx+ft"], f"finetune.batch_size={10**15}",
     f"finetune: a step of {10**15} sequences .* cannot allocate it"),
    ("gpt2", ["original", "approx+ft"], f"finetune.grad_accum={10**19}",  # past int64: randint's TypeError
     "finetune: a step of .* cannot allocate it"),
    ("llama", ["original", "approx"], "", "approx: the model has no LayerNorm to replace"),
    ("llama", ["original", "exact+ft"], "", "nothing to convert: this llama model has no LayerNorm"),
    ("bert", ["original"], "", "BertModel has no language-model head"),  # found at the first evaluation
    ("t5", ["original"], "", "T5ForConditionalGeneration is an encoder-decoder model"),
])
def test_bad_texts_and_arms_the_model_cannot_make_are_refused_before_out(tmp_path, monkeypatch, model, arms,
                                                                          override, message):
    """Found when the arm that needs them starts, they stopped a run after the arms before it (and
    after pretraining), leaving OUT behind: refused before OUT is made, nothing run."""
    from tiny_models import save_tiny

    from normswap.errors import NormswapError
    from normswap.experiment import runner

    def ran(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(runner, "make_accelerator", ran)
    save_tiny(model, tmp_path / model)
    (tmp_path / "bin.txt").write_bytes(b"\x00\x01binary" * 50)
    (tmp_path / "short.txt").write_text("Too short.")
    path = model_recipe(tmp_path, tmp_path / model, arms)
    with pytest.raises(NormswapError, match=message):
        run_experiment(path, tmp_path / "out", overrides=[override] if override else [], progress=False)
    assert not (tmp_path / "out").exists()
    if arms == ["original", "exact+ft"] and model == "gpt2":  # a run without a training arm reads no data.train
        with pytest.raises(AssertionError, match="the run started"):
            run_experiment(path, tmp_path / "out", ["original"], overrides=[override], progress=False)


EVAL_TEXT = "In the beginning God created the heaven and the earth."  # 54 tokens: under a 64-token window


@pytest.mark.parametrize("overrides, message", [
    (["data.eval=short.txt"], "data.eval: the text is shorter than one window: 54 tokens, window 64; "
                              "pass data.eval_max_length 54 or less, or more text"),
    (["data.eval_max_tokens=20"], "data.eval_max_tokens 20 is shorter than one window (64 tokens)"),
    # 100 is capped at the model's 64 positions; the recipe only holds the stride to the 100
    (["data.eval_max_length=100", "data.eval_stride=80"], "data.eval_stride 80 is larger than the window (64 tokens): "
                                                          "tokens between windows would never be scored"),
])
def test_the_evaluation_window_messages_name_the_recipe_keys(tmp_path, monkeypatch, overrides, message):
    """An experiment's evaluation windows come from its recipe's data.eval_* keys, and its
    messages said max_length, max_tokens and stride, names its user never wrote; library and
    command line alike (both write the recipe)."""
    from tiny_models import save_tiny

    from normswap.errors import NormswapError
    from normswap.experiment import runner

    def ran(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(runner, "make_accelerator", ran)
    save_tiny("gpt2", tmp_path / "gpt2")  # 64 positions
    (tmp_path / "short.txt").write_text(EVAL_TEXT)
    path = model_recipe(tmp_path, tmp_path / "gpt2", ["original"])
    with pytest.raises(NormswapError) as e:
        run_experiment(path, tmp_path / "out", overrides=overrides, progress=False)
    assert str(e.value) == message
    sets = [a for o in overrides for a in ("--set", o)]
    r = CliRunner().invoke(cli, ["experiment", str(path), "--out", str(tmp_path / "out"), *sets, "--no-progress"])
    assert r.exit_code == 2 and r.stderr == f"normswap: error: {message}\n", r.output


BOUND = "one per byte of the text at most: the tokenizer [pretrain] trains is byte-level BPE"


@pytest.mark.parametrize("overrides, message", [
    # the pretraining's own held-out perplexity (a window of pretrain.context) is the first to score it
    (["data.eval=short.txt"], f"data.eval: the text is shorter than one window: at most 54 tokens ({BOUND}), "
                              "window 64; "
                              "pass pretrain.context no more than its token count, which only the tokenizer tells "
                              "(likely under 54), or more text"),
    (["data.eval_max_tokens=20"], "data.eval_max_tokens 20 is shorter than one window (64 tokens)"),
    (["data.eval_max_length=100", "data.eval_stride=80"], "data.eval_stride 80 is larger than the window (64 tokens): "
                                                          "tokens between windows would never be scored"),
    (["data.train=short.txt", "finetune.seq_len=60"],
     f"data.train: the training text has at most 54 tokens ({BOUND}), fewer than one sequence of 61"),
    (["pretrain.text=short.txt", "pretrain.seq_len=60"],
     f"pretrain.text: the training text has at most 54 tokens ({BOUND}), fewer than one sequence of 61"),
])
def test_a_pretraining_recipe_is_refused_before_pretraining(tmp_path, monkeypatch, overrides, message):
    """With [pretrain] the tokenizer is trained with the model, so the evaluation's window options
    (against each other and pretrain.context) and texts too short for a window or a sequence were
    refused only after the pretraining. Refused before it, with the messages of the check after it:
    the options exactly, the texts by their bytes (the byte-level BPE makes at most one token of each)."""
    from normswap.errors import NormswapError
    from normswap.experiment import runner

    def ran(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))  # nothing pretrained
    monkeypatch.setattr(runner, "make_accelerator", ran)
    path = write_recipe(tmp_path / "r.toml", PRETRAIN)
    (tmp_path / "short.txt").write_text(EVAL_TEXT)
    with pytest.raises(NormswapError) as e:
        run_experiment(path, tmp_path / "out", overrides=overrides, progress=False)
    assert str(e.value) == message
    assert not (tmp_path / "out").exists()
    sets = [a for o in overrides for a in ("--set", o)]
    r = CliRunner().invoke(cli, ["experiment", str(path), "--out", str(tmp_path / "out"), *sets, "--no-progress"])
    assert r.exit_code == 2 and r.stderr == f"normswap: error: {message}\n", r.output


@pytest.mark.parametrize("override", ["pretrain.n_layer=1099511627776", "pretrain.n_embd=1099511627776",
                                      "pretrain.context=1099511627776"])
def test_a_pretrained_model_larger_than_the_machine_is_refused_before_pretraining(tmp_path, monkeypatch, override):
    """n_embd = 2**40 was an internal error from the allocator (exit 1); n_layer = 2**40 built layer
    after layer until the machine's memory ran out. Refused from the shape, before anything is built."""
    from normswap.errors import NormswapError
    from normswap.experiment import pretrain, runner

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "make_accelerator", lambda *a, **k: pytest.fail("the run started"))
    monkeypatch.setattr(pretrain, "physical_memory", lambda: 2**30)
    path = write_recipe(tmp_path / "r.toml", PRETRAIN)
    big = [override] + (["pretrain.seq_len=8"] if "context" in override else [])
    with pytest.raises(NormswapError, match=r"^pretrain: a model of [\d,]+ parameters takes [\d,.]+ GiB in float32, "
                                            r"more than this machine's 1\.0 GiB of memory; lower n_layer, n_embd, "
                                            r"context or vocab_size$"):
        run_experiment(path, tmp_path / "out", overrides=big, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
    pretrain.check_model_fits(load_recipe(path).pretrain, pretrain.most_tokens(GENESIS.read_text()))


def test_a_pretraining_under_another_mixed_precision_than_its_own_is_refused_before_it(tmp_path, monkeypatch):
    """accelerate keeps one mixed precision per process, the run's (finetune.mixed_precision): with
    finetune.mixed_precision = "bf16" on a CPU the pretraining ran under bf16 autocast whatever
    pretrain.mixed_precision said, and was cached under the key of the float32 one, which every
    later run of the [pretrain] section then reused. Refused before anything is made."""
    from types import SimpleNamespace

    from normswap.experiment import pretrain, runner

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "auto" is "no", as on this machine
    monkeypatch.setattr(runner, "make_accelerator", lambda *a, **k: pytest.fail("the run started"))
    path = write_recipe(tmp_path / "r.toml", PRETRAIN)
    with pytest.raises(RecipeError, match=r"^pretrain\.mixed_precision: 'auto' is 'no' here, but this run trains "
                                          r"under 'bf16' \(finetune\.mixed_precision; accelerate keeps one mixed "
                                          r"precision per process\): set pretrain\.mixed_precision = 'bf16' or "
                                          r"finetune\.mixed_precision = 'no'$"):
        run_experiment(path, tmp_path / "out", overrides=['finetune.mixed_precision="bf16"'], progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
    # and by the pretraining itself, under a caller's accelerator
    recipe = load_recipe(path)
    accelerator = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None, num_processes=1,
                                  mixed_precision="fp16")
    with pytest.raises(RecipeError, match=r"^pretrain\.mixed_precision: 'auto' is 'no' here, but this run trains "
                                          r"under 'fp16'"):
        pretrain.ensure_pretrained(accelerator, recipe.pretrain, recipe.seed, recipe.name, EVAL_TEXT, progress=False)


def test_a_pretraining_of_auto_precision_is_keyed_by_what_auto_is_on_the_machine(monkeypatch):
    """"auto" is bf16 on a GPU and none on a CPU: one cache key named both trainings (a cache shared
    by a GPU machine and a CPU one handed either the other's weights). On a CPU it keeps the key
    entries had before: the committed result names its model by it."""
    from normswap.experiment import pretrain

    recipe = load_recipe(ROOT / "recipes" / "ln2rms-kjv-gpt2.toml")
    section = recipe.pretrain
    committed = json.loads((ROOT / "recipes" / "results" / "ln2rms-kjv-gpt2" / "results.json").read_text())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = pretrain.cache_key(section, recipe.seed)
    assert committed["model"] == f"<normswap cache>/pretrain/{recipe.name}-{cpu}"
    assert pretrain.cache_key(replace(section, mixed_precision="no"), recipe.seed) != cpu  # as before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpu = pretrain.cache_key(section, recipe.seed)
    assert gpu != cpu and gpu == pretrain.cache_key(replace(section, mixed_precision="bf16"), recipe.seed)


@pytest.mark.parametrize("recorded, refused", [("<normswap cache>/pretrain/tiny-000000000000", True),
                                               ("{entry}", False), ("/elsewhere/cache/pretrain/{name}", False),
                                               (None, False)])
def test_an_out_whose_arms_ran_on_another_pretraining_is_refused(tmp_path, monkeypatch, recorded, refused):
    """pretrain.mixed_precision "auto" is keyed by what it is on the machine: an OUT whose arms ran on
    a GPU before it was keyed so, or on a CPU, then resumed on a GPU (`--arms` by `--arms`), was not
    refused by its fingerprint: the run pretrained anew and reported its arms beside the earlier
    ones, run on other weights. Refused before anything runs; the same entry (also under another
    cache folder) or no finished arm runs."""
    from normswap.errors import NormswapError
    from normswap.experiment import pretrain, runner
    from normswap.experiment.runner import portable_path

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "make_accelerator", lambda *a, **k: pytest.fail("the run started"))
    path = write_recipe(tmp_path / "r.toml", PRETRAIN, ["original"])
    recipe = load_recipe(path)
    entry = pretrain.pretrain_dir(recipe.pretrain, recipe.seed, recipe.name)
    out = tmp_path / "out"
    out.mkdir()
    (out / "recipe.json").write_text(json.dumps({"fingerprint": recipe.fingerprint()}))
    if recorded is not None:
        recorded = recorded.format(entry=portable_path(str(entry), None), name=entry.name)
        (out / "results.json").write_text(json.dumps({"model": recorded}))
    if refused:
        with pytest.raises(NormswapError, match=rf"^{re.escape(str(out))} holds arms run on the pretrained model {re.escape(recorded)}, "
                                                rf"and this run's is {entry.name} \(pretrain\.mixed_precision "
                                                r'"auto" is keyed by what it is on the machine\): its arms would be '
                                                rf"reported beside them on other weights; remove {re.escape(str(out))} or choose "
                                                r"another out, or pass force=True to replace it$"):
            run_experiment(path, out, progress=False)
        before = _files(out)
        with pytest.raises(pytest.fail.Exception, match="the run started"):  # replaced once the run starts
            run_experiment(path, out, progress=False, force=True)
        assert _files(out) == before
    else:
        with pytest.raises(pytest.fail.Exception, match="the run started"):
            run_experiment(path, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["recipe.json", *(["results.json"] if recorded else [])]


def _another_run(out: Path, fingerprint: str) -> None:
    """OUT as a run of `fingerprint` left it, its arms on the pretraining tiny-000000000000: every
    kind of entry a run writes (reports, logs, a finished arm, a part-trained arm's checkpoint)."""
    (out / "logs" / "tiny").mkdir(parents=True)
    (out / "logs" / "tiny" / "events.out.tfevents.1").write_bytes(b"event")
    (out / "recipe.json").write_text(json.dumps({"fingerprint": fingerprint}))
    (out / "results.json").write_text(json.dumps({"model": "<normswap cache>/pretrain/tiny-000000000000"}))
    for name in ("results.csv", "summary.md", "curves.png"):
        (out / name).write_text("report")
    (out / "arms" / "original").mkdir(parents=True)
    (out / "arms" / "original" / "result.json").write_text("{}")
    (out / "arms" / "approx+ft" / "state" / "step-000002").mkdir(parents=True)
    (out / "arms" / "approx+ft" / "state" / "step-000002" / "model.bin").write_bytes(b"weights")


@pytest.mark.parametrize("order", ["by name", "reversed"])
@pytest.mark.parametrize("other", ["recipe", "pretraining"])
def test_a_kill_at_any_point_of_the_force_replacement_leaves_out_consistent(tmp_path, monkeypatch, other, order):
    """--force empties OUT (runner._replace_out) before the run writes its own: a kill at any point
    of it must leave what the next run either still refuses as another's, or runs on without a
    finished arm of the replaced run. For OUT refused because its arms ran on another pretraining,
    the evidence is results.json (recipe.json is this recipe's): removed while arms/ was left (as
    the folder listed them), a kill there left the other pretraining's finished arms, and the next
    run, without --force, resumed and reported them beside its own."""
    import pathlib

    from normswap.errors import NormswapError
    from normswap.experiment import runner

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "make_accelerator", lambda *a, **k: pytest.fail("the run started"))
    path = write_recipe(tmp_path / "r.toml", PRETRAIN, ["original", "approx+ft"])
    recipe = load_recipe(path)
    fingerprint = "another" if other == "recipe" else recipe.fingerprint()
    listed = pathlib.Path.iterdir
    for kill_at in range(1, 20):
        out = tmp_path / f"out-{kill_at}"
        out.mkdir()
        _another_run(out, fingerprint)
        removed = []

        def removal(real, removed=removed, kill_at=kill_at):
            def remove(p, *a, **k):
                if len(removed) + 1 == kill_at:
                    raise KeyboardInterrupt  # the kill, before this entry goes
                removed.append(Path(p).name)
                return real(p, *a, **k)
            return remove

        with monkeypatch.context() as m:
            m.setattr(runner, "remove_tree", removal(runner.remove_tree))
            m.setattr(pathlib.Path, "unlink", removal(pathlib.Path.unlink))
            m.setattr(pathlib.Path, "iterdir", lambda self: iter(sorted(listed(self), reverse=order == "reversed")))
            try:
                runner._replace_out(out)
            except KeyboardInterrupt:
                pass
            else:
                assert not any(out.iterdir())
                break
        try:
            run_experiment(path, out, progress=False)
        except NormswapError as e:
            assert f"{out} holds " in str(e), (kill_at, removed)
        except pytest.fail.Exception:  # the run starts: a new one, or this recipe's with no arm to mix with
            assert not list(out.glob("arms/*/result.json")), (kill_at, removed)
    else:
        pytest.fail("the replacement was never finished")


@pytest.mark.parametrize("where", ["summary.md", "results.json", "arms/original/result.json",
                                   ".summary.md.abc.tmp"])
def test_force_does_not_remove_a_folder_where_a_run_writes_a_file(tmp_path, monkeypatch, where):
    """A run writes its reports and records as files: a folder of that name in OUT is not one it
    wrote (a user's summary.md/ of notes, say). _not_a_runs took any entry by its name alone, so
    --force removed such a folder, and what was in it, with the run."""
    from normswap.errors import NormswapError
    from normswap.experiment import runner

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "make_accelerator", lambda *a, **k: pytest.fail("the run started"))
    path = write_recipe(tmp_path / "r.toml", PRETRAIN, ["original"])
    out = tmp_path / "out"
    out.mkdir()
    _another_run(out, "another")
    mine = out / where
    if mine.exists():
        mine.unlink()
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    before = _files(out)
    with pytest.raises(NormswapError, match=rf"^{re.escape(str(out))} holds a run of another recipe and what no run "
                                            rf"writes \({re.escape(where)}\): not replaced, even with force=True"):
        run_experiment(path, out, progress=False, force=True)
    assert _files(out) == before



@pytest.mark.parametrize("where", ["logs/run.log", "logs/tiny/notes.txt", "logs/tiny/sub/"])
def test_force_does_not_remove_a_users_file_in_logs(tmp_path, monkeypatch, where):
    """logs/ is the tracker's (tensorboard's event files, logs/<name>/events.out.tfevents.*), and a
    name a user may well give their own logs (a run's output redirected there): _not_a_runs took
    everything under it as the run's, and --force removed a user's file there with the run."""
    from normswap.errors import NormswapError
    from normswap.experiment import runner

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "make_accelerator", lambda *a, **k: pytest.fail("the run started"))
    path = write_recipe(tmp_path / "r.toml", PRETRAIN, ["original"])
    out = tmp_path / "out"
    out.mkdir()
    _another_run(out, "another")
    (out / "logs" / "tiny" / "events.out.tfevents.1795581047.vm.11083.0").write_bytes(b"event")
    assert runner._not_a_runs(out) == []  # the tracker's files are the run's
    mine = out / where
    if where.endswith("/"):
        mine.mkdir()
        (mine / "notes.txt").write_text("mine")
    else:
        mine.write_text("mine")
    before = _files(out)
    with pytest.raises(NormswapError, match=rf"^{re.escape(str(out))} holds a run of another recipe and what no run "
                                            rf"writes \({re.escape(where.rstrip('/'))}\): not replaced, even with "
                                            "force=True"):
        run_experiment(path, out, progress=False, force=True)
    assert _files(out) == before


def test_a_second_run_in_one_process_under_another_mixed_precision_is_one_line(tmp_path):
    """accelerate keeps one mixed precision per process: a second run_experiment with another
    finetune.mixed_precision was accelerate's ValueError ("restart your runtime completely"), an
    internal error."""
    from accelerate import Accelerator

    from normswap.experiment import runner

    Accelerator()  # as an earlier run in this process left it (or finds it so)
    mixed = "fp16" if Accelerator().mixed_precision != "fp16" else "bf16"
    recipe = load_recipe(write_recipe(tmp_path / "r.toml", PRETRAIN), [f'finetune.mixed_precision="{mixed}"'])
    with pytest.raises(RecipeError, match=rf"^finetune\.mixed_precision: '{mixed}' \({mixed}\), but an earlier run "
                                          r"set accelerate up in this process with '\w+' \(it keeps one mixed "
                                          r"precision per process\): run this one in a new process$"):
        runner.make_accelerator(recipe, tmp_path / "out")


@pytest.mark.parametrize("shape", [dict(n_layer=2, n_embd=32, n_head=2, context=64), dict(n_layer=3, n_embd=24,
                                                                                          n_head=4, context=16)])
def test_the_pretrained_models_parameter_count_is_the_models(shape):
    from transformers import GPT2LMHeadModel

    from normswap.experiment.pretrain import model_config, parameter_count
    from normswap.experiment.recipe import PretrainSection

    section = PretrainSection(text="t.txt", **shape)
    with torch.device("meta"):
        model = GPT2LMHeadModel(model_config(section, 300, 0))
    assert parameter_count(section, 300) == sum(p.numel() for p in model.parameters())


def test_a_vocabulary_larger_than_the_text_allows_trains_the_same_tokenizer():
    """The tokenizers trainer reserves room for vocab_size entries first: 2**62 panicked inside Rust
    (a traceback past normswap's handler), 10**9 aborted the process. It cannot make more than
    most_vocabulary's entries, so the request is capped there, and the result is the same."""
    from normswap.experiment.pretrain import most_tokens, most_vocabulary, train_tokenizer

    text = "In the beginning God created the heaven and the earth. " * 20
    capped = train_tokenizer(text, most_vocabulary(most_tokens(text)))
    assert train_tokenizer(text, 2**62).get_vocab() == capped.get_vocab()
    assert len(capped) < most_vocabulary(most_tokens(text))


def test_a_bound_on_the_tokens_is_not_offered_as_a_window_that_fits(tmp_path, monkeypatch):
    """Before the pretraining the held-out text's tokens are known only as a bound (its bytes), and
    the refusal said "pass pretrain.context 54 or less": a user who did was refused after the
    pretraining (hours in, on a real recipe), the trained tokenizer making 26 tokens of the 54
    bytes ("26 tokens, window 54; pass pretrain.context 26 or less"). The advice names no number
    the count could be under, and following the old one shows why."""
    from normswap.errors import NormswapError

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    path = write_recipe(tmp_path / "r.toml", PRETRAIN)
    (tmp_path / "short.txt").write_text(EVAL_TEXT)
    with pytest.raises(NormswapError) as before:
        run_experiment(path, tmp_path / "out", overrides=["data.eval=short.txt"], progress=False)
    assert "54 or less" not in str(before.value) and "pretrain.context no more than its token count" in str(
        before.value), str(before.value)
    # what the old advice led to: the check before passes, the pretraining runs, the count refuses it
    with pytest.raises(NormswapError, match=r"^data\.eval: the text is shorter than one window: \d+ tokens, window 54"):
        run_experiment(path, tmp_path / "out", overrides=["data.eval=short.txt", "pretrain.context=54",
                                                          "pretrain.steps=2", "data.eval_max_length=16"],
                       progress=False)


def test_a_training_text_of_one_token_is_counted_in_the_singular():
    """c05bdd8 made check_training_text say '1 token', not '1 tokens', but its test takes either
    ('(1 token|\\d+ tokens)', and 200 bytes of one letter make more than one): the count itself,
    exact and as a bound."""
    from normswap.errors import NormswapError
    from normswap.experiment.trainer import check_training_text

    with pytest.raises(NormswapError) as e:
        check_training_text(1, 32)
    assert str(e.value) == "the training text has 1 token, fewer than one sequence of 33"
    with pytest.raises(NormswapError) as e:
        check_training_text(1, 32, "why")
    assert str(e.value) == "the training text has at most 1 token (why), fewer than one sequence of 33"
    with pytest.raises(NormswapError) as e:
        check_training_text(2, 32)
    assert str(e.value) == "the training text has 2 tokens, fewer than one sequence of 33"


def test_a_text_long_in_bytes_but_short_in_tokens_is_still_refused_once_the_tokenizer_exists(tmp_path, monkeypatch):
    """The bound lets through what only the trained tokenizer can tell: 200 bytes of one letter,
    merged into a few tokens, pass the check before the pretraining (seq_len 32) and are refused
    after the tokenizer is trained, before any training step, naming pretrain.text (it named no key)."""
    import re

    from normswap.errors import NormswapError
    from normswap.experiment import pretrain

    def no_training(*a, **k):
        raise AssertionError("the pretraining started")

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrain, "train", no_training)
    path = write_recipe(tmp_path / "r.toml", PRETRAIN)
    (tmp_path / "same.txt").write_text("a" * 200)
    with pytest.raises(NormswapError) as e:
        run_experiment(path, tmp_path / "out", overrides=["pretrain.text=same.txt"], progress=False)
    assert re.fullmatch(r"pretrain\.text: the training text has (1 token|\d+ tokens), fewer than one sequence of 33",
                        str(e.value)), str(e.value)


def test_a_training_text_short_in_tokens_is_refused_before_the_arms(tmp_path, pretrained_dir, monkeypatch):
    """With [pretrain] a data.train long enough in bytes (80, past a sequence of 33) but not in
    tokens (' the' twenty times: twenty tokens) passes the check before the pretraining; it was
    tokenized, and refused, only when the first arm that trains began, after the arms before it
    had run their evaluations. Refused once the tokenizer exists, before any arm."""
    import re

    import normswap.evaluate
    from normswap.errors import NormswapError

    def evaluated(*a, **k):
        raise AssertionError("an arm ran")

    monkeypatch.setattr(normswap.evaluate, "diff_models", evaluated)
    path = write_recipe(tmp_path / "r.toml", PRETRAIN, ["original", "approx+ft"])
    (tmp_path / "words.txt").write_text(" the" * 20)
    with pytest.raises(NormswapError) as e:
        run_experiment(path, tmp_path / "out", overrides=["data.train=words.txt"], progress=False)
    assert re.fullmatch(r"data\.train: the training text has \d+ tokens?, fewer than one sequence of 33",
                        str(e.value)), str(e.value)
    assert not (tmp_path / "out" / "arms").exists()


def test_a_cached_pretraining_is_not_held_to_its_held_out_window(tmp_path, pretrained_dir):
    """The check before pretraining holds the held-out text to the pretraining's own window
    (pretrain.context) only when the pretraining is to run: a cached one scores nothing again, so a
    held-out text shorter than that context but long enough for the evaluation's windows runs."""
    path = write_recipe(tmp_path / "r.toml", PRETRAIN, ["original"])
    (tmp_path / "short.txt").write_text(EVAL_TEXT)  # 54 bytes: under pretrain.context's 64 positions
    result = run_experiment(path, tmp_path / "out", overrides=["data.eval=short.txt", "data.eval_max_length=16"],
                            progress=False)
    assert Path(result.model_path) == pretrained_dir
    assert result.data["eval"]["max_length"] == 16 and result.data["arms"]["original"]["evals"][0]["ppl"] > 1


def test_the_pretrained_tokenizer_makes_at_most_one_token_per_byte():
    """The bound the checks before pretraining rest on (pretrain.most_tokens), on texts that a
    tokenizer could make more tokens of than characters: multi-byte letters, emoji, control
    characters, the special token's own spelling, random code points."""
    import random

    from normswap.experiment.pretrain import encode, most_tokens, train_tokenizer

    rng = random.Random(0)
    noise = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x800),
                                    rng.randrange(0x800, 0xD800), rng.randrange(0x10000, 0x110000)]))
                    for _ in range(3000))
    training = GENESIS.read_text()[:20000] + noise[:1000]
    tokenizer = train_tokenizer(training, 400)
    for text in ("a", " ", "\n\n", "naïve café ☃ 🤖 日本語", "<|endoftext|>x<|endoftext|>", "\x00\x01\t\r\x7f",
                 noise, GENESIS.read_text()[:5000]):
        tokens = encode(tokenizer, text).numel()
        assert 1 <= tokens <= most_tokens(text), (text[:40], tokens, most_tokens(text))
    assert most_tokens("naïve") == 6 and most_tokens("🤖") == 4


def test_the_pretraining_evaluation_window_is_named_as_pretrain_context(tmp_path, monkeypatch):
    """The pretraining's held-out perplexity takes its window from pretrain.context, not from the
    data.eval_* keys run_experiment names for the experiment's evaluations: a held-out text shorter
    than it is refused naming pretrain.context (the training itself is skipped here)."""
    from types import SimpleNamespace

    from normswap.errors import NormswapError, using_option_names
    from normswap.experiment import pretrain, runner

    def no_training(accelerator, model, section, batches, state, **kwargs):
        return SimpleNamespace(step=0, train_seconds=0.0, losses=[])

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrain, "train", no_training)
    recipe = load_recipe(write_recipe(tmp_path / "r.toml", PRETRAIN))
    accelerator = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None, num_processes=1,
                                  mixed_precision=pretrain.resolve_mixed_precision("auto"))
    with using_option_names(runner.EVAL_WINDOW_KEYS), pytest.raises(NormswapError) as e:  # as run_experiment runs it
        pretrain.ensure_pretrained(accelerator, recipe.pretrain, recipe.seed, recipe.name, EVAL_TEXT, progress=False)
    assert re.fullmatch(r"data\.eval: the text is shorter than one window: (\d+) tokens, window 64; "
                        r"pass pretrain\.context \1 or less, or more text", str(e.value)), str(e.value)


# --------------------------------------------------------------------------- resume


def test_resume_continues_and_matches_an_uninterrupted_run(tmp_path, pretrained_dir, capsys):
    path = model_recipe(tmp_path, pretrained_dir, ["approx+ft"])
    full = run_experiment(load_recipe(path, ["finetune.steps=6"]), tmp_path / "full", progress=False)

    stop = StopFlag()
    seen = []

    def hook(arm, step, loss):
        seen.append(step)
        if step == 3:
            stop.set()  # what Ctrl-C does

    recipe = load_recipe(path, ["finetune.steps=6"])
    with pytest.raises(Interrupted, match="stopped at step 3 of 6"):
        run_experiment(recipe, tmp_path / "cut", progress=False, stop=stop, on_step=hook)
    state = tmp_path / "cut" / "arms" / "approx+ft" / "state"
    assert (state / "LATEST").read_text() == "step-000003"
    seen.clear()
    capsys.readouterr()
    resumed = run_experiment(recipe, tmp_path / "cut", on_step=lambda a, s, loss: seen.append(s))
    assert seen == [4, 5, 6]  # continued, not restarted
    # and says so (stderr is no terminal here: the bar's first line; it looked like a fresh start)
    assert "[1/1] approx+ft (resumed at step 3) ...\n" in capsys.readouterr().err
    a, b = full.data["arms"]["approx+ft"], resumed.data["arms"]["approx+ft"]
    assert a["losses"] == b["losses"]
    assert [e["ppl"] for e in a["evals"]] == [e["ppl"] for e in b["evals"]]
    assert [e["step"] for e in b["evals"]] == [0, 2, 4, 6]


@pytest.mark.parametrize("terminal", [False, True])
def test_the_stop_notice_is_one_line_that_ends_an_open_bar_only_on_a_terminal(capsys, monkeypatch, terminal):
    """The first Ctrl-C's notice: on a terminal the bar's line is open and is ended first; in a log
    or a pipe the leading line break was a blank line. It says an evaluation under way finishes too."""
    import signal

    stop = StopFlag()
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    with stop.on_interrupt():
        signal.raise_signal(signal.SIGINT)
    assert stop.is_set() and stop.signal == signal.SIGINT
    assert capsys.readouterr().err == ("\n" if terminal else "") + \
        "normswap: stopping after this step or evaluation (checkpointing; Ctrl-C to stop now)\n"
    # Under `accelerate launch` the launcher passes the signal to every process: rank 0 says it (the
    # notice came once per process); every process stops.
    monkeypatch.setenv("RANK", "1")
    stop = StopFlag()
    with stop.on_interrupt():
        signal.raise_signal(signal.SIGINT)
    assert stop.is_set() and capsys.readouterr().err == ""


def test_a_stop_between_arms_is_not_ignored(tmp_path, pretrained_dir):
    """Ctrl-C during an arm's last step, or during an evaluation, stops before the next arm: training
    checks the flag only after its steps, so an arm that only evaluates ran on, and a run whose
    remaining arms only evaluate finished with exit 0 as if nothing had been asked."""
    path = model_recipe(tmp_path, pretrained_dir, ["approx+ft", "exact"])
    recipe = load_recipe(path, ["finetune.steps=2"])
    stop = StopFlag()

    def hook(arm, step, loss):
        if step == 2:
            stop.set()  # Ctrl-C during the last step: the arm completes, the next one must not start

    with pytest.raises(Interrupted, match=r"stopped before \[2/2\] exact; run the same command again to resume"):
        run_experiment(recipe, tmp_path / "out", progress=False, stop=stop, on_step=hook)
    assert (tmp_path / "out" / "arms" / "approx+ft" / "result.json").is_file()
    assert not (tmp_path / "out" / "arms" / "exact").exists()
    again = run_experiment(recipe, tmp_path / "out", progress=False)
    assert list(again.data["arms"]) == ["approx+ft", "exact"]


def _two_processes_accelerator():
    """An Accelerator that is rank 0 of 2 as the batch split, the checkpoint and the process-count
    check see it (its reduce is a one-process reduce: the steps run, as the other rank's would)."""
    from accelerate import Accelerator

    class TwoProcesses(Accelerator):
        num_processes = 2

        def save_state(self, output_dir=None, **kwargs):
            saved = super().save_state(output_dir, **kwargs)
            # and the file rank 1's save_state writes (a checkpoint without it is refused as not whole)
            shutil.copyfile(Path(output_dir) / "random_states_0.pkl", Path(output_dir) / "random_states_1.pkl")
            return saved

    return TwoProcesses(cpu=True)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_float16_weights_train_with_adamw(tmp_path):
    """finetune.dtype = "fp16": AdamW added its eps (1e-8, which is 0 in float16) to sqrt(v) in the
    weights' dtype, so every weight whose gradient was 0 (the embedding rows no batch used) became
    0/0 = NaN at the first step, at any learning rate, lr = 0 included: every fp16 recipe stopped
    with "the training loss is nan at step 2 (lower the learning rate?)"."""
    from accelerate import Accelerator

    from normswap.experiment.recipe import TrainSettings
    from normswap.experiment.trainer import RandomWindows, build_optimizer, train

    model = random_layer_norm_gpt2().half()
    batches = RandomWindows(torch.randint(0, 32, (500,), generator=torch.Generator().manual_seed(0)), 8, 2, 0)
    history = train(Accelerator(cpu=True), model, TrainSettings(steps=3, warmup_steps=0, dtype="fp16"), batches,
                    tmp_path / "state", progress=False)
    assert len(history.losses) == 3 and all(math.isfinite(x) for x in history.losses), history.losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the float32 optimizer is torch's own
    assert build_optimizer(random_layer_norm_gpt2(), TrainSettings()).defaults["eps"] == 1e-8


@pytest.fixture(scope="module")
def two_step_state(tmp_path_factory):
    """A training state checkpointed at steps 1 and 2 (LATEST -> step-000002), as train leaves it."""
    from accelerate import Accelerator

    from normswap.experiment.recipe import TrainSettings
    from normswap.experiment.trainer import RandomWindows, train

    state = tmp_path_factory.mktemp("two-steps") / "state"
    batches = RandomWindows(torch.randint(0, 64, (500,), generator=torch.Generator().manual_seed(0)), 8, 2, 0)
    train(Accelerator(cpu=True), random_layer_norm_gpt2(), TrainSettings(steps=2, warmup_steps=0, checkpoint_every=1),
          batches, state, progress=False)
    assert sorted(p.name for p in state.iterdir()) == ["LATEST", "step-000002"]
    return state, batches


def _edited_history(**fields):
    def edit(state):
        path = state / "step-000002" / "trainer.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | fields))
    return edit


@pytest.mark.parametrize("damage, says", [
    # read as "no checkpoint": training began at step 0 and its first checkpoint removed step-000002
    (lambda s: (s / "LATEST").write_text(""), "LATEST names '', which is no checkpoint in"),
    (lambda s: (s / "LATEST").write_text("step-000099"), "LATEST names 'step-000099', which is no checkpoint in"),
    # another run's checkpoint, resumed as this one's
    (lambda s: (s / "LATEST").write_text("../../elsewhere/step-000002"), "LATEST names '../../elsewhere/step-000002'"),
    # internal errors: UnicodeDecodeError, IsADirectoryError at the first save
    (lambda s: (s / "LATEST").write_bytes(b"\xff\xfe"), "LATEST: cannot read it ('utf-8' codec can't decode"),
    (lambda s: ((s / "LATEST").unlink(), (s / "LATEST").mkdir()), "LATEST: cannot read it ("),
    # fields of another kind: TypeError / AttributeError / RuntimeError deep in the training loop
    (_edited_history(step="2"), "trainer.json: not a training state that normswap wrote (step is '2')"),
    (_edited_history(step=None), "(step is None)"),
    (_edited_history(step=2.5), "(step is 2.5)"),
    (_edited_history(losses="abc"), "(losses is 'abc')"),
    (_edited_history(train_seconds="x"), "(train_seconds is 'x')"),
    (_edited_history(num_processes="1"), "(num_processes is '1')"),  # was "trained on 1 processes and this run has 1"
    # a step past the run's end "finished" the arm with two losses
    (_edited_history(step=10**6), "(2 losses for step 1000000, one per step)"),
    # accelerate's reader on files it did not write: torch's RuntimeError, FileNotFoundError
    (lambda s: [f.write_bytes(f.read_bytes()[:100]) for f in (s / "step-000002").glob("*model*.bin")],
     "train: cannot resume from its checkpoint"),
    (lambda s: [f.unlink() for f in (s / "step-000002").glob("optimizer*.bin")], "train: cannot resume from its "),
])
def test_a_damaged_checkpoint_is_refused_and_kept(two_step_state, tmp_path, damage, says):
    """A training state that is not what train wrote is one line naming it and the way out, and
    nothing in the folder is removed or rewritten (the checkpoint may be all the run has)."""
    import shutil

    from accelerate import Accelerator

    from normswap.errors import NormswapError
    from normswap.experiment.recipe import TrainSettings
    from normswap.experiment.trainer import train

    base, batches = two_step_state
    state = tmp_path / "run" / "state"
    shutil.copytree(base, state)
    damage(state)
    before = _files(state)
    with pytest.raises(NormswapError) as refused:
        train(Accelerator(cpu=True), random_layer_norm_gpt2(), TrainSettings(steps=4, warmup_steps=0,
              checkpoint_every=1), batches, state, progress=False)
    assert says in str(refused.value) and str(refused.value).endswith(f"delete {state} to train from the start")
    assert _files(state) == before and (state / "step-000002").is_dir()


@pytest.mark.parametrize("error, then", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "with more memory free"),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"), "with more memory free"),
    (PermissionError(13, "Permission denied", "optimizer.bin"), "as a user who may read it"),
])
def test_a_sound_checkpoint_that_cannot_be_loaded_now_is_not_called_damaged(two_step_state, tmp_path,
                                                                            monkeypatch, error, then):
    """Out of memory while loading (a GPU another job holds) or a file this user may not read says
    nothing of the checkpoint: the refusal told the user to delete the state folder, throwing away a
    sound checkpoint. It says what to change instead, and nothing is removed."""
    import shutil

    from accelerate import Accelerator

    from normswap.errors import NormswapError
    from normswap.experiment.recipe import TrainSettings
    from normswap.experiment.trainer import train

    base, batches = two_step_state
    state = tmp_path / "run" / "state"
    shutil.copytree(base, state)
    before = _files(state)

    def load_state(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(Accelerator, "load_state", load_state)
    with pytest.raises(NormswapError) as refused:
        train(Accelerator(cpu=True), random_layer_norm_gpt2(), TrainSettings(steps=4, warmup_steps=0,
              checkpoint_every=1), batches, state, progress=False)
    assert str(refused.value).startswith(f"train: cannot resume from its checkpoint {state / 'step-000002'} (")
    assert str(refused.value).endswith(f"; it is kept: run again {then}") and "delete" not in str(refused.value)
    assert _files(state) == before


def test_a_latest_this_user_may_not_read_is_not_called_damaged(two_step_state, tmp_path, monkeypatch):
    """LATEST unreadable for this user (another user's run) told the user to delete the state folder."""
    import pathlib

    from normswap.errors import NormswapError
    from normswap.experiment.trainer import latest_checkpoint

    read_text = pathlib.Path.read_text

    def refuse(self, *args, **kwargs):
        if self.name == "LATEST":
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", refuse)
    base, _batches = two_step_state
    with pytest.raises(NormswapError) as refused:
        latest_checkpoint(base)
    assert str(refused.value).startswith(f"{base / 'LATEST'}: cannot read it (") and "Permission denied" in str(
        refused.value) and str(refused.value).endswith("); it is kept: run again as a user who may read it")


def _stopped_at_step_2(state, accelerator):
    """A 4-step training (a checkpoint every 2 steps) of random_layer_norm_gpt2 on `accelerator`,
    stopped at step 2 with its state in `state`: the (batches, settings) that resume it."""
    from normswap.experiment.recipe import TrainSettings
    from normswap.experiment.trainer import RandomWindows, train

    batches = RandomWindows(torch.randint(0, 64, (500,), generator=torch.Generator().manual_seed(0)), 8, 2, 0)
    settings = TrainSettings(steps=4, warmup_steps=0, checkpoint_every=2)
    stop = StopFlag()
    with pytest.raises(Interrupted, match="stopped at step 2 of 4"):
        train(accelerator, random_layer_norm_gpt2(), settings, batches, state, progress=False,
              stop=stop, on_step=lambda s, loss: s == 2 and stop.set())
    return batches, settings


def test_a_checkpoint_is_resumed_only_under_the_process_count_that_wrote_it(tmp_path):
    """A step's sequences depend on the process count (grad_accum x processes draws): a checkpoint
    written by 2 processes resumed by 1 would go on with other, smaller batches. Refused, naming
    both counts and the way out, the checkpoint untouched; the same count resumes it."""
    from accelerate import Accelerator

    from normswap.errors import NormswapError
    from normswap.experiment.trainer import train

    state = tmp_path / "state"
    batches, settings = _stopped_at_step_2(state, _two_processes_accelerator())
    assert json.loads((state / "step-000002" / "trainer.json").read_text())["num_processes"] == 2
    before = _files(state)
    with pytest.raises(NormswapError) as refused:
        train(Accelerator(cpu=True), random_layer_norm_gpt2(), settings, batches, state, progress=False, desc="arm")
    assert str(refused.value) == (
        f"arm: its checkpoint at step 2 was trained on 2 processes and this run has 1: the process count decides "
        f"the batches, so the resumed steps would see other data; run it again on 2 processes, or delete {state} "
        "to train it from the start on 1")
    assert _files(state) == before  # nothing removed or rewritten
    seen = []
    train(_two_processes_accelerator(), random_layer_norm_gpt2(), settings, batches, state, progress=False,
          on_step=lambda s, loss: seen.append(s))
    assert seen == [3, 4]


def test_a_checkpoint_from_before_the_count_was_recorded_counts_accelerates_files(tmp_path):
    """trainer.json had no num_processes: accelerate's save_state wrote one random_states_<rank>.pkl
    per process, which says how many there were."""
    from accelerate import Accelerator

    from normswap.errors import NormswapError
    from normswap.experiment.trainer import check_resumable

    step = tmp_path / "state" / "step-000003"
    step.mkdir(parents=True)
    (tmp_path / "state" / "LATEST").write_text("step-000003")
    (step / "trainer.json").write_text(json.dumps({"step": 3, "losses": [1.0] * 3, "evals": [], "train_seconds": 1.0}))
    (step / "random_states_0.pkl").write_bytes(b"")
    check_resumable(tmp_path / "state", Accelerator(cpu=True).num_processes, "arm")  # 1 and 1: resumed
    (step / "random_states_1.pkl").write_bytes(b"")
    with pytest.raises(NormswapError, match="trained on 2 processes and this run has 1"):
        check_resumable(tmp_path / "state", 1, "arm")
    check_resumable(tmp_path / "state", 2, "arm")
    check_resumable(tmp_path / "absent", 2, "arm")  # no checkpoint: nothing to resume


def test_a_checkpoint_from_before_the_count_was_recorded_is_counted_by_its_highest_rank(tmp_path):
    """Without a recorded count the count was how many random_states_*.pkl there are: a checkpoint
    of N processes that lost a file below the top rank read as one of N - 1, so its resume on N was
    refused as 'trained on N - 1 processes ... run it again on N - 1', and a run on N - 1 was then
    refused for the file it lacks, each line naming the wrong count; and a file of another name the
    glob matched (random_states_0 copy.pkl) made a sound checkpoint of 1 read as one of 2, refused.
    The count is one more than the highest rank named by a file: the lost file is named under the
    right count, and other names do not count."""
    import random

    from normswap.errors import NormswapError
    from normswap.experiment.trainer import check_resumable

    rng = random.Random(0)
    for case in range(6):
        state = tmp_path / f"state{case}"
        step = state / "step-000003"
        step.mkdir(parents=True)
        (state / "LATEST").write_text("step-000003")
        (step / "trainer.json").write_text(json.dumps({"step": 3, "losses": [1.0] * 3, "evals": [],
                                                       "train_seconds": 1.0}))
        count = rng.randint(2, 8)
        lost = sorted(rng.sample(range(count - 1), rng.randint(1, count - 1)))  # never the top rank's
        for rank in set(range(count)) - set(lost):
            (step / f"random_states_{rank}.pkl").write_bytes(b"")
        stray = rng.choice(["random_states_0 copy.pkl", "random_states_1 (1).pkl", "random_states_old.pkl",
                            "random_states_.pkl", f"random_states_{count + 5}.pkl.pkl"])
        (step / stray).write_bytes(b"")
        with pytest.raises(NormswapError) as refused:
            check_resumable(state, count, "arm")
        assert str(refused.value) == (
            f"arm: its checkpoint {step} was written by {count} processes but lacks "
            f"{', '.join(f'random_states_{r}.pkl' for r in lost)} (accelerate writes one random-state file per "
            "process; resumed without it, the steps would go on from another random state than the interrupted "
            f"run's, unsaid); put it back, or delete {state} to train it from the start"), (count, lost, stray)
        other = rng.choice([n for n in range(1, 10) if n != count])
        with pytest.raises(NormswapError, match=rf"^arm: its checkpoint at step 3 was trained on {count} processes "
                                                rf"and this run has {other}: "):
            check_resumable(state, other, "arm")
        for rank in lost:
            (step / f"random_states_{rank}.pkl").write_bytes(b"")
        assert check_resumable(state, count, "arm")[0] == step  # whole again: resumed, the stray name ignored


def test_a_sound_checkpoint_beside_a_copy_of_its_random_state_is_resumed(tmp_path):
    """A checkpoint of 1 process from before the count was recorded, with a copy of its random-state
    file beside it (random_states_0 copy.pkl, as a file manager names one): read as a checkpoint of
    2 processes and refused; resumed now as the run uninterrupted goes on."""
    from accelerate import Accelerator

    from normswap.experiment.trainer import train

    state = tmp_path / "state"
    batches, settings = _stopped_at_step_2(state, Accelerator(cpu=True))
    whole = train(Accelerator(cpu=True), random_layer_norm_gpt2(), settings, batches, tmp_path / "whole",
                  progress=False)
    step = state / "step-000002"
    written = json.loads((step / "trainer.json").read_text())
    (step / "trainer.json").write_text(json.dumps({k: v for k, v in written.items() if k != "num_processes"}))
    shutil.copyfile(step / "random_states_0.pkl", step / "random_states_0 copy.pkl")
    resumed = train(Accelerator(cpu=True), random_layer_norm_gpt2(), settings, batches, state, progress=False)
    assert resumed.losses == whole.losses


def test_a_checkpoint_that_says_no_process_count_is_refused(tmp_path):
    """A checkpoint with neither a recorded process count nor accelerate's random-state files was
    resumed unchecked: whatever count wrote it, this run went on from it with its own batches.
    Every checkpoint normswap writes has both (save_state writes one random_states_<rank>.pkl per
    process, also before the count was recorded), so such a folder is not normswap's, or not whole:
    refused, naming it and what it lacks, nothing removed. Either one alone still says the count
    (a recorded count without its files is then refused for the files it lacks, 24a70ae)."""
    from accelerate import Accelerator

    from normswap.errors import NormswapError
    from normswap.experiment.trainer import check_resumable, train

    state = tmp_path / "state"
    batches, settings = _stopped_at_step_2(state, Accelerator(cpu=True))
    step = state / "step-000002"
    assert (step / "random_states_0.pkl").is_file() and json.loads((step / "trainer.json").read_text())["num_processes"]
    (step / "random_states_0.pkl").unlink()
    with pytest.raises(NormswapError, match="was written by 1 process but lacks random_states_0.pkl"):
        check_resumable(state, 1, "arm")  # the recorded count alone says it, and that a file is missing
    written = json.loads((step / "trainer.json").read_text())
    (step / "trainer.json").write_text(json.dumps({k: v for k, v in written.items() if k != "num_processes"}))
    before = _files(state)
    message = (f"arm: its checkpoint {step} records no process count (num_processes in trainer.json) and holds no "
               "random-state files (random_states_*.pkl); every checkpoint normswap writes has one or the other, "
               "so it is not one normswap wrote, or not whole, and cannot be resumed as the run it belongs to; "
               f"delete {state} to train it from the start")
    with pytest.raises(NormswapError) as refused:
        check_resumable(state, 1, "arm")
    assert str(refused.value) == message
    with pytest.raises(NormswapError) as refused:
        train(Accelerator(cpu=True), random_layer_norm_gpt2(), settings, batches, state, progress=False, desc="arm")
    assert str(refused.value) == message
    assert _files(state) == before  # nothing removed or rewritten


def test_a_checkpoint_that_lacks_a_processs_random_state_file_is_refused(tmp_path):
    """accelerate's load_state reads random_states_<rank>.pkl and, when it is not there, only logs
    it: a checkpoint whose count says 2 with one file (a file lost; a node of a run without a shared
    file system) resumed from this start's random state, not the interrupted run's (the dropout of
    the resumed steps changed, unsaid). Refused on every process (each sees every rank's file), one
    line naming the folder and the file, nothing removed; the file back, it resumes as the run
    uninterrupted would have gone on."""

    from normswap.errors import NormswapError
    from normswap.experiment.trainer import check_resumable, train

    state = tmp_path / "state"
    batches, settings = _stopped_at_step_2(state, _two_processes_accelerator())
    assert random_layer_norm_gpt2().config.resid_pdrop > 0  # dropout draws from the saved random state
    whole = train(_two_processes_accelerator(), random_layer_norm_gpt2(), settings, batches, tmp_path / "whole",
                  progress=False)
    step = state / "step-000002"
    kept = step / "random_states_1.pkl"
    kept.rename(tmp_path / "kept.pkl")
    before = _files(state)
    message = (f"arm: its checkpoint {step} was written by 2 processes but lacks random_states_1.pkl (accelerate "
               "writes one random-state file per process; resumed without it, the steps would go on from another "
               f"random state than the interrupted run's, unsaid); put it back, or delete {state} to train it "
               "from the start")
    with pytest.raises(NormswapError) as refused:
        check_resumable(state, 2, "arm")  # on either rank: check_resumable looks at every rank's file
    assert str(refused.value) == message
    with pytest.raises(NormswapError) as refused:
        train(_two_processes_accelerator(), random_layer_norm_gpt2(), settings, batches, state, progress=False,
              desc="arm")
    assert str(refused.value) == message
    assert _files(state) == before  # nothing removed or rewritten
    (tmp_path / "kept.pkl").rename(kept)
    # random_layer_norm_gpt2 seeds torch: this start's random state is the one step 1 began from,
    # and only the checkpoint's (step 3's) makes the resumed steps those of the uninterrupted run
    resumed = train(_two_processes_accelerator(), random_layer_norm_gpt2(), settings, batches, state,
                    progress=False)
    assert resumed.losses == whole.losses


def test_a_checkpoint_of_another_process_count_is_refused_for_its_count_first(tmp_path):
    """A checkpoint of another count lacks this run's ranks' random-state files or holds others:
    the count is what to change (rerun on it, or start over), so its message comes first, and the
    files are then looked for over this run's ranks only: a count written by hand (10**9) does not
    set how many files are looked for (c32b04a)."""
    from accelerate import Accelerator

    from normswap.errors import NormswapError
    from normswap.experiment.trainer import check_resumable

    state = tmp_path / "state"
    batches, settings = _stopped_at_step_2(state, Accelerator(cpu=True))
    record = state / "step-000002" / "trainer.json"
    written = json.loads(record.read_text())
    for count, trained_on in ((3, "3 processes"), (10**9, "1000000000 processes")):
        record.write_text(json.dumps(written | {"num_processes": count}))
        with pytest.raises(NormswapError) as refused:
            check_resumable(state, 1, "arm")  # holds random_states_0.pkl only, as 1 process writes
        assert str(refused.value) == (
            f"arm: its checkpoint at step 2 was trained on {trained_on} and this run has 1: the process count "
            f"decides the batches, so the resumed steps would see other data; run it again on {trained_on}, "
            f"or delete {state} to train it from the start on 1")
    record.write_text(json.dumps(written))
    assert check_resumable(state, 1, "arm")[0] == state / "step-000002"


def test_an_arm_part_trained_under_another_process_count_is_refused_before_any_arm(tmp_path, pretrained_dir,
                                                                                    monkeypatch):
    """`normswap experiment` stopped mid-arm on 1 process, rerun under `accelerate launch
    --num_processes 2`: one line, exit 2, before the arms ahead of it run, nothing deleted. The
    same count then resumes it; a finished arm is reused under any count (its result records it)."""
    import normswap.experiment.runner as runner

    path = model_recipe(tmp_path, pretrained_dir, ["exact", "approx+ft"])
    out = tmp_path / "out"
    stop = StopFlag()
    with pytest.raises(Interrupted, match="stopped at step 2 of 4"):
        run_experiment(path, out, "approx+ft", progress=False, stop=stop,
                       on_step=lambda arm, s, loss: s == 2 and stop.set())
    before = _files(out)
    with monkeypatch.context() as m:
        m.setattr(runner, "make_accelerator", lambda recipe, out: _two_processes_accelerator())
        res = CliRunner().invoke(cli, ["experiment", str(path), "--out", str(out), "--no-progress"])
    assert res.exit_code == 2, res.output
    assert res.stderr == (f"normswap: error: approx+ft: its checkpoint at step 2 was trained on 1 process and this "
                          "run has 2: the process count decides the batches, so the resumed steps would see other "
                          f"data; run it again on 1 process, or delete {out / 'arms' / 'approx+ft' / 'state'} to "
                          "train it from the start on 2\n")
    assert _files(out) == before and not (out / "arms" / "exact").exists()
    seen = []
    done = run_experiment(path, out, progress=False, on_step=lambda arm, s, loss: seen.append(s))
    assert seen == [3, 4] and done.data["arms"]["approx+ft"]["num_processes"] == 1
    with monkeypatch.context() as m:
        m.setattr(runner, "make_accelerator", lambda recipe, out: _two_processes_accelerator())
        again = run_experiment(path, out, progress=False)
    assert again.data["arms"]["approx+ft"] == done.data["arms"]["approx+ft"]


def test_an_interrupted_pretraining_resumes_only_under_the_process_count_that_started_it(tmp_path, monkeypatch):
    """README: an interrupted pretraining is refused under another process count as an arm is (its
    checkpoint lies in the cache's .partial folder, not in OUT): one line naming that folder, nothing removed."""
    import normswap.experiment.runner as runner
    from normswap.errors import NormswapError
    from normswap.experiment import pretrain

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    path = write_recipe(tmp_path / "r.toml", PRETRAIN, ["original"])
    recipe = load_recipe(path)
    final = pretrain.pretrain_dir(recipe.pretrain, recipe.seed, recipe.name)
    partial = final.with_name(final.name + ".partial")
    stop = StopFlag()
    stop.set()  # the pretraining checks it after its first step
    with pytest.raises(Interrupted, match="pretrain: stopped at step 1 of 80"):
        run_experiment(path, tmp_path / "out", progress=False, stop=stop)
    before = _files(partial)
    monkeypatch.setattr(runner, "make_accelerator", lambda recipe, out: _two_processes_accelerator())
    with pytest.raises(NormswapError) as refused:
        run_experiment(path, tmp_path / "out", progress=False)
    assert str(refused.value) == (
        "pretrain: its checkpoint at step 1 was trained on 1 process and this run has 2: the process count decides "
        "the batches, so the resumed steps would see other data; run it again on 1 process, or delete "
        f"{partial / 'state'} to train it from the start on 2")
    assert _files(partial) == before and not final.exists()


# --------------------------------------------------------------------------- kernels


def count_rms_kernel_calls(monkeypatch) -> dict:
    """Counts the launches of normswap's Triton RMS kernels (forward and backward) from now on."""
    from normswap.kernels import rms_norm

    calls = {"forward": 0, "backward": 0}
    def counting(key, real):
        def counted(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)
        return counted

    for name, key in (("_rms_forward", "forward"), ("_rms_backward", "backward")):
        monkeypatch.setattr(rms_norm, name, counting(key, getattr(rms_norm, name)))
    return calls


@pytest.mark.slow
def test_triton_fine_tuning_matches_torch(tmp_path, pretrained_dir, monkeypatch):
    """--impl triton: the arms train through normswap's Triton kernels (forward and backward)."""
    arms = ["approx-bias+ft", "exact+ft"]
    path = model_recipe(tmp_path, pretrained_dir, arms)
    sets = ["finetune.steps=2", "finetune.eval_every=2", "data.eval_max_tokens=64"]
    calls = count_rms_kernel_calls(monkeypatch)
    ref = run_experiment(load_recipe(path, sets), tmp_path / "torch", progress=False)
    assert calls == {"forward": 0, "backward": 0}
    tri = run_experiment(load_recipe(path, [*sets, "impl=triton"]), tmp_path / "triton", progress=False)
    # Both arms run as RMS norms: the Triton RMS kernels ran in the training steps, both ways
    # (5 norms x 2 arms x 2 steps x 2 micro-batches... at least one per norm per step).
    assert calls["forward"] >= 5 * 2 * 2 and calls["backward"] >= 5 * 2 * 2
    for arm in arms:
        a, b = ref.data["arms"][arm], tri.data["arms"][arm]
        for x, y in zip(a["losses"], b["losses"], strict=True):
            assert abs(x - y) / x < 1e-5
        assert abs(a["evals"][-1]["ppl"] - b["evals"][-1]["ppl"]) / a["evals"][-1]["ppl"] < 1e-5


def test_triton_arm_is_built_on_normswap_modules(pretrained_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from normswap.experiment.arms import build_arm
    from normswap.modules import NormswapNorm

    original = AutoModelForCausalLM.from_pretrained(pretrained_dir)
    model = build_arm(original, "approx+ft", "triton")
    norms = [m for m in model.modules() if isinstance(m, NormswapNorm)]
    assert len(norms) == 5 and all(m.impl == "triton" and m.rms_form is not None for m in norms)
    ids = torch.randint(0, 300, (2, 16))
    calls = count_rms_kernel_calls(monkeypatch)
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls == {"forward": 5, "backward": 5}  # every norm, through the Triton kernels both ways
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in norms)
    assert all(m.bias.grad is None and not m.bias.requires_grad for m in norms)  # approx has no β
    exact = build_arm(original, "exact", "torch")
    frozen = [n for n, p in exact.named_parameters() if not p.requires_grad]
    assert frozen and all(".ln_" in n for n in frozen)  # the folded γ/β (ones/zeros) only
    assert not any(isinstance(m, NormswapNorm) for m in original.modules())


def random_layer_norm_gpt2(seed: int = 0):
    """A tiny GPT-2 whose LayerNorms have random γ and β (ones/zeros would hide a dropped one)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0)).eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.copy_(1 + 0.5 * torch.randn_like(mod.weight))
                mod.bias.copy_(0.5 * torch.randn_like(mod.bias))
    return model


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_approx_arms_are_rms_norms_keeping_gamma(impl):
    """approx: x / sqrt(mean(x²) + eps) · γ (no centering, no β); approx-bias: the same + β.
    Against float64 on an input whose mean is far from 0 (centering would show)."""
    from normswap.experiment.arms import build_arm

    original = random_layer_norm_gpt2()
    paths = [n for n, m in original.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    x = torch.randn(3, 5, 16, dtype=torch.float64) * 3 + 1.5
    for arm, keep_bias in (("approx", False), ("approx-bias", True)):
        model = build_arm(original, arm, impl)
        for path in paths:
            ln = original.get_submodule(path)
            want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + ln.eps) * ln.weight.double()
            if keep_bias:
                want = want + ln.bias.double()
            got = model.get_submodule(path)(x.float()).double()
            assert (got - want).abs().max() < 1e-5 * want.abs().max(), (arm, path)
    assert isinstance(original.get_submodule(paths[0]), torch.nn.LayerNorm)  # the original is untouched


def test_distill_loss_is_kl_from_the_original_to_the_arm():
    """KL(original ‖ arm) = Σ p_original (log p_original − log p_arm), mean over positions; not the
    reverse KL, not cross-entropy."""
    from normswap.experiment.arms import build_arm
    from normswap.experiment.trainer import distill_loss

    original = random_layer_norm_gpt2()
    arm = build_arm(original, "approx", "torch")
    # Far enough from the original that the two KL directions differ clearly, whatever the random
    # initialisation of this transformers version left the approximation's error at.
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in arm.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        p = torch.log_softmax(original(input_ids=ids).logits.double(), -1)
        q = torch.log_softmax(arm(input_ids=ids).logits.double(), -1)
    forward = (p.exp() * (p - q)).sum(-1).mean().item()
    reverse = (q.exp() * (q - p)).sum(-1).mean().item()
    assert abs(reverse - forward) > 1e-3 * forward  # the two directions are told apart here
    got = distill_loss(arm, ids, original)
    assert abs(got.item() - forward) < 1e-4 * forward
    got.backward()  # the arm learns from it; the teacher does not
    assert any(p.grad is not None for p in arm.parameters())
    assert all(p.grad is None for p in original.parameters())


def test_the_teachers_half_precision_weights_are_not_held_through_the_step():
    """The teacher (the original) is no longer frozen (later arms train from it), so autocast's weight
    cache would keep the half-precision copy of each of its matrices until the step's autocast ends,
    through the arm's forward and backward: a second, half-size teacher at the step's peak. Its casts
    are freed once used; the arm's are cached as before, and the cache setting is restored."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    from normswap.experiment.arms import build_arm
    from normswap.experiment.trainer import distill_loss

    original = random_layer_norm_gpt2()
    arm = build_arm(original, "approx", "torch").train()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    owner = {id(p): who for who, model in (("teacher", original), ("arm", arm)) for p in model.parameters()}
    casts = {"teacher": [], "arm": []}

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and id(args[0]) in owner:
                casts[owner[id(args[0])]].append(weakref.ref(out))
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with Casts():
            distill_loss(arm, ids, original)
        held = {who: sum(ref() is not None for ref in refs) for who, refs in casts.items()}
        assert torch.is_autocast_cache_enabled()
    assert all(p.requires_grad for p in original.parameters())  # not frozen: the arms after it train
    assert len(casts["teacher"]) > 0 and held["teacher"] == 0
    assert held["arm"] == len(casts["arm"]) > 0  # autocast's cache, kept for the arm's backward

def test_the_distill_arm_trains_on_kl_from_the_original(every_arm, pretrained_dir):
    """approx+distill's first training loss is KL(original ‖ approx) on step 0's batch (the
    language-modelling loss of the same batch is what approx+ft starts from)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from normswap.experiment.arms import build_arm
    from normswap.experiment.pretrain import encode, read_text
    from normswap.experiment.trainer import RandomWindows

    recipe = load_recipe(Path(json.loads((every_arm.out / "recipe.json").read_text())["source"]))
    original = AutoModelForCausalLM.from_pretrained(pretrained_dir, dtype=torch.float64).eval()
    arm = build_arm(original, "approx", "torch", "fp32").double()
    ids = encode(AutoTokenizer.from_pretrained(pretrained_dir), read_text(recipe.data.train))
    batch = RandomWindows(ids, recipe.finetune.seq_len, recipe.finetune.batch_size, recipe.seed).micro_batches(0, 0, 1, 1)[0]
    with torch.no_grad():
        p = torch.log_softmax(original(input_ids=batch).logits, -1)
        q = torch.log_softmax(arm(input_ids=batch).logits, -1)
        ce = arm(input_ids=batch, labels=batch).loss.item()
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    arms = every_arm.data["arms"]
    assert arms["approx+distill"]["losses"][0] == pytest.approx(kl, rel=1e-3)
    assert arms["approx+ft"]["losses"][0] == pytest.approx(ce, rel=1e-4)


def test_a_distillation_arm_leaves_the_original_trainable_for_the_arms_after_it(every_arm, pretrained_dir,
                                                                                 tmp_path):
    """The teacher is the original every arm is copied from: freezing it for the distillation froze
    every later arm (`--arms approx+distill,original+ft` failed at its first step: nothing to train).
    The arm after it trains exactly as it does with no distillation before it."""
    path = model_recipe(tmp_path, pretrained_dir, ["approx+distill", "original+ft"])
    result = run_experiment(path, tmp_path / "out", progress=False)
    after, alone = result.data["arms"]["original+ft"], every_arm.data["arms"]["original+ft"]
    assert after["losses"] == alone["losses"] and len(after["losses"]) == 4
    assert [e["ppl"] for e in after["evals"]] == [e["ppl"] for e in alone["evals"]]


def test_the_step_benchmark_times_each_loss_on_the_recipes_shape(tmp_path, monkeypatch, capsys):
    """benchmarks/experiment_step.py: each loss run on the recipe's micro-batch under each thread count
    (a warm-up, then --repeat times), the distillation with a teacher apart from the arm, one row per count and case,
    the caller's thread count kept (plumbing only: its times are for reading, not for asserting)."""
    from collections import Counter

    from benchmark_scripts import load_script

    from normswap.experiment import trainer

    calls = Counter()

    def counted(name, loss):
        def run(model, ids, teacher):
            assert name == "lm" or (teacher is not None and teacher is not model)  # the original, not the arm
            calls[name, tuple(ids.shape), torch.get_num_threads()] += 1
            return loss(model, ids, teacher)
        return run

    for name, loss in list(trainer.LOSSES.items()):
        monkeypatch.setitem(trainer.LOSSES, name, counted(name, loss))
    threads = torch.get_num_threads()
    out = tmp_path / "step.json"
    assert load_script("experiment_step").main([str(ROOT / "recipes" / "smoke-kjv-tiny.toml"), "--repeat", "2",
                                                "--threads", "1,2", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads
    assert calls == {(name, (8, 64), n): 3 for name in ("lm", "distill") for n in (1, 2)}
    result = json.loads(out.read_text())
    assert result["model"] == {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1024}
    assert result["batch"] == [8, 64] and result["threads"] == [1, 2] and result["repeat"] == 2
    assert result["torch"] == torch.__version__ and result["transformers"]
    cases = ["lm step (fwd+bwd)", "distill step (fwd+bwd)", "teacher forward"]
    assert [(r["threads"], r["case"]) for r in result["rows"]] == [(n, c) for n in (1, 2) for c in cases]
    assert all(math.isfinite(r[k]) and r[k] >= 0 for r in result["rows"] for k in r if k != "case")
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table if "step (fwd+bwd)" in line or "teacher forward" in line] == \
        ["1"] * 3 + ["2"] * 3


@pytest.mark.parametrize("args, says", [
    (["--repeat", "0"], "--repeat: expected a count >= 1"),
    (["--threads", "0"], "--threads: expected distinct thread counts >= 1"),
    (["--threads", "1,x"], "--threads: expected thread counts such as 1 or 1,2"),
])
def test_the_step_benchmark_refuses_bad_counts(capsys, args, says):
    from benchmark_scripts import load_script

    with pytest.raises(SystemExit) as exited:
        load_script("experiment_step").main([str(ROOT / "recipes" / "smoke-kjv-tiny.toml"), *args, "--out", "-"])
    assert exited.value.code == 2 and says in capsys.readouterr().err


def test_the_step_benchmark_refuses_a_recipe_without_a_model_shape_in_one_line(tmp_path, capsys):
    from benchmark_scripts import load_script

    path = model_recipe(tmp_path, tmp_path / "model", ["approx+ft"])
    assert load_script("experiment_step").main([str(path), "--out", "-"]) == 2
    err = capsys.readouterr().err
    assert err == f"benchmarks/experiment_step.py: {path}: needs a [pretrain] section (the model shape to build)\n"


# --------------------------------------------------------------------------- DDP


@pytest.mark.slow
def test_two_processes_match_one_with_twice_the_accumulation(tmp_path, pretrained_dir):
    """`accelerate launch` on 2 CPU processes (DDP over gloo), grad_accum 1, against one process with
    grad_accum 2: the same sequences per step, so the same losses up to float32 reduction order
    (tolerance: 1e-5 relative; measured ~1e-7)."""
    arms = ["original+ft", "approx+ft"]  # approx+ft: its dropped β must not stall DDP
    path = model_recipe(tmp_path, pretrained_dir, arms)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    common = ["-m", "normswap", "experiment", str(path), "--no-progress", "--json",
              "--set", "finetune.steps=3", "--set", "finetune.eval_every=3"]
    # accelerate 1.x's `--cpu --num_processes 2` runs ONE process (its simple launcher); `--multi_gpu`
    # with ACCELERATE_USE_CPU=1 is what starts torchrun with 2 CPU ranks.
    ddp = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                          *common, "--out", str(tmp_path / "ddp"), "--set", "finetune.grad_accum=1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    one = subprocess.run([sys.executable, *common, "--out", str(tmp_path / "one"), "--set", "finetune.grad_accum=2"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    printed = json.loads(one.stdout)  # --json: one document on stdout
    assert [r["arm"] for r in printed["summary"]] == arms and printed["files"]["results.json"]
    assert ddp.stdout.count('"summary"') == 1  # only the main process reports
    a = json.loads((tmp_path / "ddp" / "results.json").read_text())
    b = json.loads((tmp_path / "one" / "results.json").read_text())
    assert a["environment"]["num_processes"] == 2 and b["environment"]["num_processes"] == 1
    for arm in arms:
        la, lb = a["arms"][arm]["losses"], b["arms"][arm]["losses"]
        assert len(la) == len(lb) == 3
        for x, y in zip(la, lb, strict=True):
            assert abs(x - y) / abs(y) < 1e-5
        pa, pb = a["arms"][arm]["evals"][-1]["ppl"], b["arms"][arm]["evals"][-1]["ppl"]
        assert abs(pa - pb) / pb < 1e-5


def _two_ranks(args: list[str], env: dict, timeout: float = 180) -> list[tuple[int | None, str]]:
    """`normswap experiment ARGS` as the 2 CPU processes of a launch (the variables torchrun sets), each
    process's (exit code, stderr): what `accelerate launch` hides (its agent SIGTERMs the other processes
    once one has failed, and SIGKILLs them 30 s later). A process still running after `timeout` is
    killed (exit code -9)."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "normswap", "experiment", *args], text=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
             for rank in (0, 1)]
    deadline = time.monotonic() + timeout
    said = []
    for p in procs:
        try:
            err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[1]
        except subprocess.TimeoutExpired:
            p.kill()
            err = p.communicate()[1]
        said.append((p.returncode, err))
    return said


@pytest.mark.slow
@pytest.mark.parametrize("case", ["out locked", "pretraining locked", "another recipe in out", "record not written",
                                  "pretraining record malformed"])
def test_under_a_launcher_every_process_stops_at_a_refusal_and_the_main_one_says_it(tmp_path, pretrained_dir,
                                                                                      case):
    """Under `accelerate launch` the main process alone takes OUT's lock and the pretraining's and writes
    the records: a refusal there ended it while the others waited for it in the process group's start
    or a barrier until the launcher killed them (30 s, then its traceback). And a refusal every process
    reached was said once per process. Now every process stops at once with exit 2, and the main
    process says it, once."""
    env = {**os.environ, "NORMSWAP_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "out"
    args = ["--out", str(out), "--no-progress"]
    fd = None
    if case.startswith("pretraining"):
        from normswap.experiment import pretrain

        path = write_recipe(tmp_path / "r.toml", PRETRAIN, ["original"])
        recipe = load_recipe(path)
        with pytest.MonkeyPatch.context() as m:
            m.setenv("NORMSWAP_CACHE", env["NORMSWAP_CACHE"])
            final = pretrain.pretrain_dir(recipe.pretrain, recipe.seed, recipe.name)
        if case == "pretraining locked":
            fd = _hold_lock(final.parent / f".{final.name}.normswap.lock")
            says = rf"another normswap run \(pid 4242\) is writing .*{final.name}; try again when it has finished"
        else:  # read by every process once the run has begun
            final.mkdir(parents=True)
            (final / pretrain.INFO_FILE).write_text("[1, 2]")
            says = rf".*{pretrain.INFO_FILE}: not a pretraining record .*; delete .* to pretrain again"
    else:
        path = model_recipe(tmp_path, pretrained_dir, ["original"])
        if case == "out locked":
            fd = _hold_lock(tmp_path / ".out.normswap.lock")
            says = r"another normswap run \(pid 4242\) is writing .*out; try again when it has finished"
        elif case == "another recipe in out":
            out.mkdir()
            (out / "recipe.json").write_text('{"fingerprint": "another"}')
            says = r".*out holds a run of a different recipe .*; remove it or choose another --out, or pass --force .*"
        else:  # the main process's write of the arm's record fails, once the run has begun
            run_experiment(path, out, progress=False)
            record = out / "arms" / "original" / "result.json"
            record.unlink()
            record.mkdir()
            says = r".*result\.json.*"
    try:
        (rc0, err0), (rc1, err1) = _two_ranks([str(path), *args], env)
    finally:
        if fd is not None:
            os.close(fd)
    assert (rc0, rc1) == (2, 2), (err0, err1)
    assert re.fullmatch(f"normswap: error: {says}\n", err0), err0
    assert err1 == ""


# --------------------------------------------------------------------------- report


def test_recovered_share_is_against_the_fine_tuned_control():
    def arm(nll0, nll1, steps=10):
        evals = [{"step": 0, "ppl": math.exp(nll0), "nll": nll0, "kl_mean": 0.0, "top1_agreement": 1.0}]
        if steps:
            evals.append({"step": steps, "ppl": math.exp(nll1), "nll": nll1, "kl_mean": 0.1, "top1_agreement": 0.9})
        return {"steps": steps, "evals": evals}

    arms = {"original": arm(2.0, 2.0, 0), "original+ft": arm(2.0, 1.8), "approx": arm(3.0, 3.0, 0),
            "approx+ft": arm(3.0, 2.4), "approx-bias+ft": arm(2.5, 2.3), "approx+distill": arm(1.9, 1.7),
            "exact+ft": arm(2.0, 1.9)}
    rows = {r["arm"]: r for r in summary_rows(arms)}
    # A gap of 1.0 nats at step 0, 0.6 left against the fine-tuned control: 40 % taken back.
    assert rows["approx+ft"]["recovered"] == pytest.approx(0.4)
    # Fine-tuning lowered it by exactly what it lowered the control: nothing recovered (comparing its
    # end with its own start would credit it with 0.2 / 0.7 of the gap).
    assert rows["approx-bias+ft"]["recovered"] == pytest.approx(0.0, abs=1e-12)
    assert rows["approx+distill"]["recovered"] is None  # started below the original: no gap
    assert rows["exact+ft"]["recovered"] is None
    assert rows["approx+ft"]["delta_vs_original_ft"] == pytest.approx(math.exp(2.4) - math.exp(1.8))
    assert rows["approx"]["recovered"] is None and rows["original+ft"]["recovered"] is None
    # Without the control the reference is the untouched original.
    del arms["original+ft"]
    assert {r["arm"]: r for r in summary_rows(arms)}["approx+ft"]["recovered"] == pytest.approx(0.6)


def test_a_stop_on_another_process_stops_every_process(tmp_path):
    """Under `accelerate launch` each process gets Ctrl-C at its own moment: all of them must stop
    (and checkpoint) at the same step, here seen from a process whose own flag is never set while
    another process's is (its reduce reports one stopping process)."""
    from accelerate import Accelerator

    from normswap.experiment.recipe import TrainSettings
    from normswap.experiment.trainer import RandomWindows, train

    class SecondProcess(Accelerator):
        num_processes = 2  # as seen by the flag exchange (and the batch split: this is rank 0 of 2)

        def reduce(self, tensor, reduction="sum", scale=1.0):
            return tensor + 1 if reduction == "sum" else tensor  # the other process is stopping

    accelerator = SecondProcess(cpu=True)
    model = random_layer_norm_gpt2()
    batches = RandomWindows(torch.randint(0, 64, (500,), generator=torch.Generator().manual_seed(0)), 8, 2, 0)
    settings = TrainSettings(steps=5, warmup_steps=0, checkpoint_every=10)
    with pytest.raises(Interrupted, match="stopped at step 1 of 5"):
        train(accelerator, model, settings, batches, tmp_path / "state", progress=False, stop=StopFlag())
    assert (tmp_path / "state" / "LATEST").read_text() == "step-000001"  # checkpointed before stopping


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
                                   RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: 8 GB")])
def test_a_step_that_runs_out_of_memory_is_one_line_naming_the_knobs(tmp_path, monkeypatch, error):
    """An out-of-memory forward was an internal error (exit 1); another RuntimeError still is."""
    from accelerate import Accelerator

    from normswap.errors import NormswapError
    from normswap.experiment import trainer
    from normswap.experiment.recipe import TrainSettings

    def loss(model, ids, teacher=None):
        raise error

    monkeypatch.setitem(trainer.LOSSES, "lm", loss)
    batches = trainer.RandomWindows(torch.randint(0, 64, (500,), generator=torch.Generator().manual_seed(0)), 8, 2, 0)
    settings = TrainSettings(steps=2, warmup_steps=0)
    with pytest.raises(NormswapError, match=r"^arm: step 1: out of memory \(.*\); lower batch_size or seq_len"):
        trainer.train(Accelerator(cpu=True), random_layer_norm_gpt2(), settings, batches, tmp_path / "s",
                      progress=False, desc="arm")
    monkeypatch.setitem(trainer.LOSSES, "lm", lambda *a: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        trainer.train(Accelerator(cpu=True), random_layer_norm_gpt2(), settings, batches, tmp_path / "t",
                      progress=False)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("section", ["finetune", "pretrain", None])
def test_a_learning_rate_past_the_dtypes_range_is_one_line_naming_the_recipe_key(tmp_path, optimizer, section):
    """finetune.lr = 1e308 passed the recipe's checks (finite, not negative) and then torch refused
    to turn the step size into float32 inside optimizer.step(): an internal error (exit 1). Its line
    then said 'the update at learning rate 2.5e+307' (the warm-up's rate at step 1, never written by
    the user) and named no key: it names the key and the value the user wrote, as the recipe's
    errors do (finetune.lr, pretrain.lr; lr for settings made in code), the schedule's rate beside
    it where it differs, and SGD's weight decay (added to the gradient in the weights' dtype) when
    it is not 0."""
    import random

    from accelerate import Accelerator

    from normswap.errors import NormswapError
    from normswap.experiment import trainer
    from normswap.experiment.recipe import FinetuneSection, PretrainSection, TrainSettings

    cls = {"finetune": FinetuneSection, "pretrain": PretrainSection, None: TrainSettings}[section]
    key = f"{section}." if section else ""
    rng = random.Random(f"{optimizer}-{section}")
    batches = trainer.RandomWindows(torch.randint(0, 64, (500,), generator=torch.Generator().manual_seed(0)), 8, 2, 0)
    for i in range(3):
        # past float32's 3.4e38 at step 1 whatever the warm-up's share of it (AdamW's step is lr / 0.1)
        lr = rng.uniform(1, 10) * 10.0 ** rng.randint(40, 307)
        warmup = rng.randint(0, 4)
        decay = optimizer == "sgd" and i == 2  # SGD's weight decay alone overflows too
        if decay:
            lr, weight_decay = rng.uniform(1e-5, 1e-2), rng.uniform(1, 10) * 10.0 ** rng.randint(40, 307)
        settings = cls(steps=2, warmup_steps=warmup, lr=lr, optimizer=optimizer, schedule="constant",
                       weight_decay=weight_decay if decay else 0.0)
        said = f"{key}lr = {lr!r}"
        if warmup > 1:  # step 1 of the warm-up trains at lr / warmup_steps
            said += f" ({lr / warmup:g} at this step of the schedule)"
        lower = f"{key}lr"
        if decay:
            said += f" and {key}weight_decay = {weight_decay!r}"
            lower += f" or {key}weight_decay"
        with pytest.raises(NormswapError) as refused:
            trainer.train(Accelerator(cpu=True), random_layer_norm_gpt2(), settings, batches, tmp_path / f"s{i}",
                          progress=False, desc="arm")
        assert re.fullmatch(rf"arm: step 1: the update at {re.escape(said)} overflows the weights' dtype "
                            rf"\(value cannot be converted to type float without overflow\); lower {re.escape(lower)}",
                            str(refused.value)), str(refused.value)


def test_ctrl_c_sets_the_flag_first_and_interrupts_the_second_time():
    import signal

    stop = StopFlag()
    with stop.on_interrupt():
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.is_set() and stop.signal == signal.SIGINT  # the step finishes and checkpoints
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigint_ignored_by_the_parent_leaves_the_training_running():
    """A shell script's background job starts with SIGINT ignored, so that a Ctrl-C meant for the
    script's foreground command leaves it running: on_interrupt's handler stopped the training."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop = StopFlag()
        with stop.on_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            assert not stop.is_set()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


class _Terminated(Exception):
    pass


@pytest.fixture
def sigterm_raises():
    """SIGTERM raises _Terminated here, as the command line's handler raises its Terminated (and
    so a test whose SIGTERM is not caught fails instead of ending pytest)."""
    import signal

    def raise_terminated(*_):
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    yield raise_terminated
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_checkpoints_like_ctrl_c_and_the_second_one_stops_now(sigterm_raises):
    """SIGTERM is what a batch scheduler's cancel and `docker stop` send, with a grace period before
    SIGKILL: the first one finishes the step and checkpoints, as Ctrl-C does (it used to interrupt
    the step, losing everything since the last checkpoint); a second one goes to the handler that
    was there before, at once."""
    import signal

    stop = StopFlag()
    with stop.on_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set() and stop.signal == signal.SIGTERM
        with pytest.raises(_Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is sigterm_raises


def test_experiment_stopped_by_sigterm_exits_143(tmp_path, monkeypatch, sigterm_raises):
    """The command's exit code says which signal stopped it: 143 (128 + SIGTERM), 130 for Ctrl-C."""
    import signal

    from click.testing import CliRunner

    import normswap.experiment
    from normswap.cli import cli

    def run(recipe, out, arms, *, stop, **_):
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set()
        raise Interrupted("original+ft: stopped at step 1 of 5; run the same command again to resume")

    monkeypatch.setattr(normswap.experiment, "run_experiment", run)
    r = CliRunner().invoke(cli, ["experiment", str(write_recipe(tmp_path / "r.toml", PRETRAIN))])
    assert r.exit_code == 128 + signal.SIGTERM, r.output
    assert "stopped at step 1 of 5" in r.stderr and "a second SIGTERM to stop now" in r.stderr


# --------------------------------------------------------------------------- half-precision noise floor

HALF_ARMS = ["original", "exact", "approx", "approx+ft"]
HALF_SETS = ["finetune.dtype=bf16", "finetune.steps=2", "finetune.eval_every=2"]


@pytest.fixture(scope="module")
def bf16_run(pretrained_dir, tmp_path_factory):
    """Four arms in bf16: the original (the floor itself), exact (faithful), approx (another model)."""
    d = tmp_path_factory.mktemp("bf16")
    recipe = load_recipe(model_recipe(d, pretrained_dir, HALF_ARMS), HALF_SETS)
    return run_experiment(recipe, d / "out", progress=False)


def test_half_precision_arms_are_judged_against_the_noise_floor(bf16_run):
    data = json.loads((bf16_run.out / "results.json").read_text())
    floor = data["noise_floor"]
    assert floor["dtype"] == "bfloat16" and floor["limit"] == 2.0
    assert math.isfinite(floor["ppl_reference"]) and floor["ppl_reference"] > 1
    assert all(math.isfinite(v) for v in floor["original"].values())
    # bf16 really is away from float32 on this model: there is a floor to judge against
    assert floor["original"]["kl_mean"] > 0 and 0 < floor["original"]["top1_agreement"] <= 1
    assert floor["description"].startswith("bfloat16 noise floor: the original is")
    arms = data["arms"]
    for name, arm in arms.items():
        for e in arm["evals"]:
            assert set(e["noise_floor"]) == {"kl_ratio", "within", "verdict"}, name
            assert f"the {name} arm" in e["noise_floor"]["verdict"]
    # The original arm is the floor's own model: zero distance from it, ratio exactly 1.
    original = arms["original"]["evals"][0]
    assert original["kl_mean"] == floor["original"]["kl_mean"]
    assert original["noise_floor"]["kl_ratio"] == 1.0 and original["noise_floor"]["within"]
    # approx is another model (no centering, no β): far outside the rounding.
    approx = arms["approx"]["evals"][0]["noise_floor"]
    assert not approx["within"] and approx["kl_ratio"] > 10 and "OUTSIDE the bfloat16 noise" in approx["verdict"]
    rows = {r["arm"]: r for r in bf16_run.to_dict()["summary"]}  # what --json prints
    assert rows["original"]["within_noise"] is True and rows["approx"]["within_noise"] is False
    assert rows["approx+ft"]["noise_verdict"] == arms["approx+ft"]["evals"][-1]["noise_floor"]["verdict"]
    summary = (bf16_run.out / "summary.md").read_text()
    assert floor["description"] in summary and "vs bfloat16 noise" in summary
    assert "| original | 0 |" in summary and summary.split("| original | 0 |")[1].split("\n")[0].endswith("within (1x) |")
    assert summary.split("| approx | 0 |")[1].split("\n")[0].endswith(f"OUTSIDE ({approx['kl_ratio']:.3g}x) |")
    assert all(f"- {rows[a]['noise_verdict']}" in summary for a in HALF_ARMS)
    header, *lines = (bf16_run.out / "results.csv").read_text().splitlines()
    assert header.endswith(",within_noise,noise_kl_ratio") and len(lines) == 3 + 2  # steps 0 and 2 of approx+ft
    # The arms' own result.json hold measurements only: the judgement is made when the report is.
    assert "noise_floor" not in (bf16_run.out / "arms" / "approx" / "result.json").read_text()


def test_the_experiment_judges_as_diff_models_does(bf16_run, pretrained_dir):
    """An untrained arm's judgement is the one diff_models(half original, arm, reference=float32
    original) gives on the same windows: one noise-floor judgement, not two."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from normswap.evaluate import diff_models
    from normswap.experiment.arms import build_arm
    from normswap.experiment.pretrain import encode, read_text

    recipe = load_recipe(Path(json.loads((bf16_run.out / "recipe.json").read_text())["source"]))
    d = recipe.data
    reference = AutoModelForCausalLM.from_pretrained(pretrained_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(pretrained_dir)
    arms = bf16_run.data["arms"]
    for name in ("approx", "exact"):
        got = diff_models(build_arm(reference, "original", recipe.impl, "bf16"), build_arm(reference, name, recipe.impl, "bf16"),
                          tokenizer, encode(tokenizer, read_text(d.eval)), max_length=d.eval_max_length,
                          max_tokens=d.eval_max_tokens, batch_size=d.eval_batch_size, progress=False,
                          reference=reference).noise_floor
        judged = arms[name]["evals"][0]["noise_floor"]
        assert judged["kl_ratio"] == pytest.approx(got.kl_ratio, rel=1e-9) and judged["within"] == got.within
        assert judged["verdict"] == got.verdict.replace("the patched model", f"the {name} arm")
    assert bf16_run.data["noise_floor"]["ppl_reference"] == pytest.approx(got.ppl_reference, rel=1e-12)


def test_a_resumed_half_precision_run_reports_the_same_judgements(bf16_run):
    """Arms finished by an earlier invocation are judged against this invocation's floor, like the rest."""
    before = json.loads((bf16_run.out / "results.json").read_text())
    recipe = load_recipe(Path(json.loads((bf16_run.out / "recipe.json").read_text())["source"]), HALF_SETS)
    again = run_experiment(recipe, bf16_run.out, progress=False, plot=False)  # every arm done: none runs
    assert again.data["noise_floor"] == before["noise_floor"]
    resumed = json.loads((bf16_run.out / "results.json").read_text())
    assert resumed["arms"] == before["arms"]  # every arm still judged, identically
    assert resumed["arms"]["approx"]["evals"][0]["noise_floor"]["within"] is False


def test_the_verdict_is_the_arm_kl_over_the_floor_kl():
    """_judged(): within while KL(float32 ‖ arm) <= 2x KL(float32 ‖ half original), whatever the
    perplexity says; an arm moved far away is OUTSIDE."""
    from normswap.evaluate import DiffResult
    from normswap.experiment.runner import _judged

    floor = DiffResult(ppl_a=10.0, ppl_b=10.1, delta_ppl=0.1, relative_delta=0.01, nll_a=math.log(10),
                       nll_b=math.log(10.1), kl_mean=1e-3, kl_max=1e-2, top1_agreement=0.99, max_abs_logit_diff=0.1,
                       tokens=100, windows=1, max_length=100, stride=50)

    def arm(kl):
        return {"evals": [{"step": 0, "ppl": 10.05, "nll": math.log(10.05), "kl_mean": kl, "kl_max": 10 * kl,
                           "top1_agreement": 0.98}]}

    arms = {"near": arm(1.9e-3), "at": arm(2e-3), "far": arm(5e-2), "better": arm(1e-4)}
    out = _judged(arms, floor, "bf16")
    got = {k: v["evals"][0]["noise_floor"] for k, v in out.items()}
    assert {k: v["within"] for k, v in got.items()} == {"near": True, "at": True, "far": False, "better": True}
    assert got["far"]["kl_ratio"] == pytest.approx(50) and got["near"]["kl_ratio"] == pytest.approx(1.9)
    assert got["far"]["verdict"] == ("bfloat16 noise floor: the original is +1% ppl, KL 0.001, top-1 99.00% from its "
                                     "float32 self, the far arm +0.5% ppl, KL 0.05, top-1 98.00%: OUTSIDE the "
                                     "bfloat16 noise (KL to float32 50x the original's, limit 2x)")
    assert "noise_floor" not in arms["far"]["evals"][0]  # the arms' own results are left alone
    assert _judged(arms, None, "fp32") is arms  # float32: nothing to judge


def test_float32_runs_have_no_noise_floor(every_arm):
    data = json.loads((every_arm.out / "results.json").read_text())
    assert "noise_floor" in data and data["noise_floor"] is None
    assert not any("noise_floor" in e for arm in data["arms"].values() for e in arm["evals"])
    assert all(r["within_noise"] is None for r in every_arm.summary)
    assert "noise" not in (every_arm.out / "summary.md").read_text()
    assert "noise" not in (every_arm.out / "results.csv").read_text().splitlines()[0]


def test_the_command_prints_the_noise_floor_in_text_and_json(bf16_run):
    """`normswap experiment` on the finished bf16 run (every arm resumed): --json is results.json's
    data with the floor and every judgement; the text output has the floor and one verdict per arm."""
    source = json.loads((bf16_run.out / "recipe.json").read_text())["source"]
    args = ["experiment", source, "--out", str(bf16_run.out), "--no-progress",
            *(x for s in HALF_SETS for x in ("--set", s))]
    printed = CliRunner().invoke(cli, [*args, "--json"])
    assert printed.exit_code == 0, printed.output
    doc = json.loads(printed.stdout)
    saved = json.loads((bf16_run.out / "results.json").read_text())
    assert doc["noise_floor"] == saved["noise_floor"] and doc["noise_floor"]["dtype"] == "bfloat16"
    assert doc["arms"] == saved["arms"]
    assert {r["arm"]: r["within_noise"] for r in doc["summary"]} == {
        "original": True, "exact": saved["arms"]["exact"]["evals"][-1]["noise_floor"]["within"],
        "approx": False, "approx+ft": False}
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0, text.output
    assert saved["noise_floor"]["description"] in text.stdout
    assert all(saved["arms"][a]["evals"][-1]["noise_floor"]["verdict"] in text.stdout for a in HALF_ARMS)


def test_every_arm_shows_progress_on_stderr(tmp_path, pretrained_dir):
    """An arm that does not train is still an evaluation of seconds: it has its line too (stderr
    is no terminal here, so every stage is a line when it starts and one when it ends)."""
    from click.testing import CliRunner

    from normswap.cli import cli

    recipe = model_recipe(tmp_path, pretrained_dir, ["original", "approx+ft", "approx+distill"])
    r = CliRunner().invoke(cli, ["experiment", str(recipe), "--out", str(tmp_path / "out"), "--set",
                                 "finetune.steps=2", "--json"])
    assert r.exit_code == 0, r.stderr[-2000:]
    losses = {arm: a["losses"][-1] for arm, a in json.loads(r.stdout)["arms"].items() if a["losses"]}
    lines = r.stderr.splitlines()
    assert lines[:2] == ["[1/3] original ...", lines[1]] and re.fullmatch(r"\[1/3\] original: 1/1 eval, \d+\.\d s",
                                                                           lines[1]), r.stderr
    for at, arm in ((2, "approx+ft"), (4, "approx+distill")):
        assert lines[at] == f"[{at // 2 + 1}/3] {arm} ...", r.stderr
        shown = re.fullmatch(rf"\[{at // 2 + 1}/3\] {re.escape(arm)}: 2/2 step, \d+\.\d s, loss=(\S+)", lines[at + 1])
        assert shown, r.stderr
        # the last step's loss to 5 significant digits: the distillation loss, far below 1, showed
        # as loss=0.0000 or with one or two digits (4 decimals)
        assert float(shown[1]) == pytest.approx(losses[arm], rel=1e-4), (shown[1], losses[arm])
    assert losses["approx+distill"] < 0.1


def test_a_library_warning_is_one_line_and_every_stage_shows(tmp_path, monkeypatch):
    """normswap's own warnings (here: a pretraining of one step does not beat the unigram baseline)
    are one `normswap: warning:` line, as scan's are; they were Python's two lines, naming
    runner.py's path and line and quoting its source. Scoring the pretrained model on every
    held-out token (a minute on a CPU for the shipped recipe) has a bar named for it (it ran
    silently after the last step), and a rerun of a finished run says each arm is done (it printed
    nothing at all). stdout stays one JSON document."""
    from click.testing import CliRunner

    from normswap.cli import cli

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    one_step = PRETRAIN.replace("steps = 80", "steps = 1").replace("warmup_steps = 4", "warmup_steps = 0")
    recipe = write_recipe(tmp_path / "tiny.toml", one_step, ["original"])
    (tmp_path / "short.txt").write_text(GENESIS.read_text()[:3000])  # the held-out scoring: seconds, not 30
    command = ["experiment", str(recipe), "--out", str(tmp_path / "out"), "--json", "--set", 'data.eval="short.txt"']
    r = CliRunner().invoke(cli, command)
    assert r.exit_code == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["pretrain"]["steps"] == 1
    lines = r.stderr.splitlines()
    warned = [line for line in lines if "warning" in line.lower()]
    assert len(warned) == 1 and re.fullmatch(
        r"normswap: warning: pretraining did not beat the unigram baseline \(held-out perplexity [\d.]+ vs [\d.]+\): "
        r"more steps or another learning rate", warned[0]), r.stderr
    at = lines.index("pretrain: held-out perplexity ...")
    assert re.fullmatch(r"pretrain: held-out perplexity: \d+ tok, \d+\.\d s", lines[at + 1]), r.stderr
    # The same command again: every arm finished, and it says so.
    again = CliRunner().invoke(cli, command)
    assert again.exit_code == 0, again.stderr[-2000:]
    arm_dir = tmp_path / "out" / "arms" / "original"
    assert again.stderr == f"[1/1] original: finished by an earlier run (delete {arm_dir} to run it again)\n"


def test_the_kl_plot_shows_small_distances_and_whole_steps():
    """curves.png's KL axis is logarithmic down to the smallest distance drawn: with a fixed linear
    part below 1e-3, approx-bias's 1e-5 was drawn at 0 on top of exact's 1e-13. The step axis has
    whole-number ticks (it had 0.5, 1.5, ... on a 4-step run)."""
    from normswap.experiment.report import curves_figure

    def arm(steps, kls):
        return {"evals": [{"step": s, "ppl": 50.0 + k, "kl_mean": k} for s, k in zip(steps, kls, strict=True)]}

    result = {"recipe": {"name": "t"}, "noise_floor": None,
              "arms": {"original": arm([0], [0.0]), "exact": arm([0], [1e-13]), "approx-bias": arm([0], [1.1e-5]),
                       "approx+ft": arm([0, 2, 4], [1e-2, 3e-2, 2e-2])}}
    fig = curves_figure(result)
    ax_kl = fig.axes[1]
    assert ax_kl.get_yscale() == "symlog"
    linthresh = ax_kl.yaxis.get_transform().linthresh
    assert linthresh <= 1e-13  # every positive KL on the log part, apart from each other
    assert ax_kl.get_ylim()[0] == 0
    for ax in fig.axes[:2]:
        assert list(ax.get_xticks()) == [0, 2, 4]


def test_curves_figure_leaves_the_callers_matplotlib_alone_and_takes_any_kl(monkeypatch):
    """report.curves_figure is public (draw a run's curves in a notebook): it switched matplotlib's
    backend to Agg (a notebook's plots stopped showing) and left its figure open in pyplot. An
    evaluation of this run that is not finite (an infinite KL: results.json holds null for it)
    stopped the plot with an OverflowError after the other reports were written."""
    import matplotlib
    import matplotlib.pyplot as plt

    from normswap.experiment.report import curves_figure

    def arm(kls):
        return {"evals": [{"step": 2 * i, "ppl": 50.0, "kl_mean": k} for i, k in enumerate(kls)]}

    result = {"recipe": {"name": "t"}, "noise_floor": None,
              "arms": {"original": arm([0.0]), "approx+ft": arm([1e-2, math.inf, float("nan")]),
                       "exact+ft": arm([1e-9, None, 1e-6])}}
    monkeypatch.setitem(matplotlib.rcParams, "backend", "pdf")  # the caller's (not Agg, which the test runs)
    figures = plt.get_fignums()
    fig = curves_figure(result)
    assert matplotlib.get_backend() == "pdf" and plt.get_fignums() == figures
    assert fig.axes[1].yaxis.get_transform().linthresh == pytest.approx(1e-9)  # the finite ones decide it
    fig.savefig(io.BytesIO(), format="png")  # it draws


def test_a_step_batch_is_the_windows_at_its_random_starts():
    """micro_batches gathers the rows in one call: row i is ids[start_i: start_i + seq_len] for the
    starts the step's generator draws, as the loop it replaced built them (a resumed run, and the
    results of earlier ones, depend on these exact batches)."""
    from normswap.experiment.trainer import RandomWindows

    ids = torch.randint(0, 64, (500,), generator=torch.Generator().manual_seed(0))
    windows = RandomWindows(ids, 8, 3, 7)
    for step in range(3):
        g = torch.Generator().manual_seed(7 * 1_000_003 + step)
        starts = torch.randint(0, ids.numel() - 8, (2 * 2 * 3,), generator=g)
        expected = torch.stack([ids[s: s + 8] for s in starts.tolist()]).view(4, 3, 8)
        for rank in range(2):
            got = windows.micro_batches(step, rank, 2, 2)
            assert torch.equal(torch.stack(got), expected[rank * 2:(rank + 1) * 2])


def test_a_step_larger_than_the_machines_memory_is_refused_before_any_work(tmp_path, monkeypatch):
    """finetune.batch_size 10**9 (a recipe with [pretrain]) pretrained, ran the original arm, then built
    the first fine-tuning step's batch row by row in a Python loop: minutes and gigabytes of tensors
    (with the kernel's overcommit, an OOM kill) before anything said it was too large. The size is
    refused from the recipe before the pretraining, and micro_batches refuses it before allocating."""
    from normswap.experiment import runner, trainer

    monkeypatch.setattr(trainer, "physical_memory", lambda: 1 << 30, raising=False)  # 1 GiB: a step of 2**22 x 64 ids is 2 GiB

    def pretraining(*args, **kwargs):
        raise AssertionError("pretrained before the sizes were checked")
    monkeypatch.setattr(runner, "ensure_pretrained", pretraining)
    too_large = (r"a step of 4194304 sequences \(batch_size x grad_accum x processes\) of 64 tokens: cannot allocate "
                 r"it \(2.0 GiB of token ids, more than this machine's 1.0 GiB of memory\)")
    with pytest.raises(trainer.NormswapError, match="^finetune: " + too_large):
        run_experiment(ROOT / "recipes" / "smoke-kjv-tiny.toml", tmp_path / "out",
                       overrides=[f"finetune.batch_size={1 << 22}"], progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(trainer.NormswapError, match="^" + too_large):
        trainer.RandomWindows(torch.arange(500), 64, 1 << 22, 0).micro_batches(0, 0, 1, 1)


def test_results_say_what_the_models_load_dropped(tmp_path, pretrained_dir):
    """A model folder whose weights hold 2020-era GPT-2's attn.masked_bias (a buffer no module of
    transformers 5 has, which the load drops): every other command's report said so, results.json
    did not, though the arms were made from the model without it. It records the class and the
    tensor names, the model named as results.json names it (no machine's path), and the command
    says the note once."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "recipe" / "legacy"
    shutil.copytree(pretrained_dir, model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    tensors.update({f"transformer.h.{i}.attn.masked_bias": torch.tensor(-1e4) for i in range(2)})
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    path = write_recipe(tmp_path / "recipe" / "model.toml", '[model]\npath = "legacy"\n', ["original"])
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["experiment", str(path), "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    [unused] = json.loads((out / "results.json").read_text())["unused_tensors"]
    assert (unused["class"], unused["not_built"], unused["buffers"]) == (
        "GPT2LMHeadModel", [], ["transformer.h.0.attn.masked_bias", "transformer.h.1.attn.masked_bias"])
    assert str(tmp_path) not in json.dumps(unused)
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("note:")] == [f"note: {unused['note']}"]
    assert json.loads(r.stdout)["unused_tensors"] == [unused]
