"""Messages name options as the caller wrote them: the library's parameter names (`out`,
`force=True`) for a library caller, the flags (`--out`, `--force`) through the command line. Each
case fails the same way through both and compares the two lines: a library caller of
patch_checkpoint(m, out=..., in_place=True) once read "--out and --in-place are exclusive"."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from normswap import api
from normswap.cli import cli
from normswap.errors import NormswapError, option_labels, option_setting, using_option_names, way_out
from tests.tiny_models import save_tiny

pytestmark = pytest.mark.usefixtures("small_probes")  # conftest's

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form. " * 6
FLAG = re.compile(r"(?<![\w-])--[a-z]")  # a command-line flag, as no library message should name one


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("names")
    save_tiny("llama", root / "llama")
    (root / "text.txt").write_text(TEXT)
    (root / "rows.jsonl").write_text(json.dumps({"body": TEXT}) + "\n")
    return root


def cli_error(*args) -> str:
    """The one error line the command prints (exit 2), without its `normswap: error: ` prefix."""
    r = CliRunner().invoke(cli, [*map(str, args)])
    assert r.exit_code == 2, (r.exit_code, r.output, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("normswap: error: ")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0].removeprefix("normswap: error: ")


def library_error(call, *args, **kwargs) -> str:
    with pytest.raises(NormswapError) as e:
        call(*args, **kwargs)
    message = str(e.value)
    assert not FLAG.search(message), message  # names no flag the library caller never wrote
    return message


def test_the_helpers_spell_each_option_as_its_caller_does():
    assert option_setting("force", True) == "force=True" and option_setting("--force", True) == "--force"
    assert option_setting("rms", False) == "rms=False" and option_setting("--rms", False) == "--no-rms"
    assert option_setting("impl", "torch") == "impl='torch'" and option_setting("--impl", "torch") == "--impl torch"
    assert option_labels(("out", "force")) == {"out": "out", "force": "force"}
    with using_option_names({"out": "--out"}):
        assert option_labels(("out", "force")) == {"out": "--out", "force": "force"}
        with using_option_names({"force": "--force"}):  # an inner entry point adds to the outer's names
            assert option_labels(("out", "force")) == {"out": "--out", "force": "--force"}
        assert option_labels(("out",), {"out": "OUT"}) == {"out": "OUT"}  # given names win
        assert way_out("out", "x", "elsewhere") == "--out x"
        assert way_out("exclude", "R", "filter_fn") is None  # the entry point has no such option: none to suggest
    assert option_labels(("out",)) == {"out": "out"}  # the block's names end with it
    assert way_out("out", "x", "elsewhere") == "elsewhere"
    for wrong in (5, {"only": 1}, ["--only"]):  # 5 was "'int' object is not iterable"; {"only": 1} the label 1
        with pytest.raises(TypeError, match=r"^option_names: expected a mapping of parameter names"):
            option_labels(("only",), wrong)
        with pytest.raises(TypeError, match=r"^option_names: expected a mapping"), using_option_names(wrong):
            pass
    import normswap

    with pytest.raises(TypeError, match=r"^option_names: expected a mapping"):  # the settings' own, as the call's
        normswap.evaluate_checkpoint("unused", normswap.EvalSettings("unused.txt", option_names=5))


# -- patch -----------------------------------------------------------------------------------------


def test_patch_out_and_in_place(root, tmp_path):
    src = root / "llama"
    assert cli_error("patch", src, "--out", tmp_path / "o", "--in-place") == \
        "--out and --in-place are exclusive; pick one"
    assert library_error(api.patch_checkpoint, src, out=tmp_path / "o", in_place=True) == \
        "out and in_place are exclusive; pick one"


def test_patch_out_targets(root, tmp_path):
    src = root / "llama"
    assert cli_error("patch", src, "--impl", "torch", "--out", src) == \
        "--out is the model's own directory; use --in-place for that"
    assert library_error(api.patch_checkpoint, src, "torch", out=src) == \
        "out is the model's own directory; use in_place=True for that"
    assert cli_error("patch", src, "--impl", "torch", "--out", root).startswith(f"--out {root} contains the model")
    assert library_error(api.patch_checkpoint, src, "torch", out=root).startswith(f"out {root} contains the model")
    (tmp_path / "empty").mkdir()
    assert cli_error("patch", src, "--impl", "torch", "--out", tmp_path / "empty") == \
        f"{tmp_path / 'empty'} already exists; pass --force to replace it"
    assert library_error(api.patch_checkpoint, src, "torch", out=tmp_path / "empty") == \
        f"{tmp_path / 'empty'} already exists; pass force=True to replace it"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    assert cli_error("patch", src, "--impl", "torch", "--out", tmp_path / "notes", "--force").endswith(
        "refusing to replace it, even with --force")
    assert library_error(api.patch_checkpoint, src, "torch", out=tmp_path / "notes", force=True).endswith(
        "refusing to replace it, even with force=True")


def test_patch_filters_and_shard_size(root, tmp_path):
    src = root / "llama"
    assert cli_error("patch", src, "--impl", "torch", "--only", "nothing-matches").startswith(
        "--only/--exclude leave no recognised norm to patch in")
    assert library_error(api.patch_checkpoint, src, "torch", only="nothing-matches").startswith(
        "only/exclude leave no recognised norm to patch in")
    assert cli_error("patch", src, "--exclude", "(").startswith("--exclude '(': not a regular expression")
    assert library_error(api.patch_checkpoint, src, exclude="(").startswith("exclude '(': not a regular expression")
    assert cli_error("patch", src, "--out", tmp_path / "o", "--max-shard-size", "x").startswith(
        "--max-shard-size 'x': give a positive size")
    assert library_error(api.patch_checkpoint, src, out=tmp_path / "o", max_shard_size="x").startswith(
        "max_shard_size 'x': give a positive size")


def test_patch_in_place_in_another_dtype(root, tmp_path):
    mine = tmp_path / "mine"
    shutil.copytree(root / "llama", mine)
    assert cli_error("patch", mine, "--in-place", "--dtype", "bf16") == (
        f"--in-place with --dtype would rewrite the float32 weights of {mine} as bfloat16; save the conversion "
        "with --out DIR instead")
    assert library_error(api.patch_checkpoint, mine, in_place=True, dtype="bf16") == (
        f"in_place with dtype would rewrite the float32 weights of {mine} as bfloat16; save the conversion "
        "with out=DIR instead")


def test_a_failed_verification_names_the_callers_way_to_exclude_a_norm(tmp_path, monkeypatch):
    """patch_checkpoint's caller excludes with exclude=REGEX, the command line's with --exclude
    REGEX, a caller of normswap.patch itself with its filter_fn."""
    from normswap import backends
    from normswap.kernels.reference import layer_norm_ref, rms_norm_ref
    from normswap.loading import load_model, resolve
    from normswap.swap import patch

    def broken_on_heads(x, w, eps, offset=0.0, casting="llama", **kw):
        y = rms_norm_ref(x, w, eps, offset, casting, **kw)
        return y * 1.01 if x.shape[-1] == 16 else y  # wrong only for the q/k head norms

    monkeypatch.setitem(backends._LOADERS, "reference",
                        lambda: backends.Backend("reference", broken_on_heads, layer_norm_ref))
    save_tiny("qwen3", tmp_path / "qwen3")
    assert cli_error("patch", tmp_path / "qwen3", "--impl", "reference").endswith(
        "nothing was changed (exclude it with --exclude REGEX)")
    assert library_error(api.patch_checkpoint, tmp_path / "qwen3", "reference").endswith(
        "nothing was changed (exclude it with exclude=REGEX)")
    model = load_model(resolve(tmp_path / "qwen3"))
    assert library_error(patch, model, "reference").endswith("nothing was changed (exclude it with filter_fn)")
    with using_option_names({"patched": "--patched"}):  # `normswap diff A --patched IMPL`: no --exclude to name
        assert library_error(patch, model, "reference").endswith("nothing was changed")
    # normswap.load(verify=True) re-runs the proof: its caller has no filter_fn either (it read
    # "exclude it with filter_fn", and "--exclude REGEX" before)
    import normswap

    api.patch_checkpoint(tmp_path / "qwen3", "torch", out=tmp_path / "patched")
    assert library_error(normswap.load, tmp_path / "patched", impl="reference", verify=True).endswith(
        "nothing was changed")


def test_what_force_cannot_replace_names_force_to_a_caller_that_has_it(tmp_path):
    """An experiment publishes its pretraining cache entry with staged_dir(replace=True): a folder
    of someone else's files there is refused, and the experiment's force (which replaces an OUT, not
    the cache) is not named (it read "even with force=True"; "--force" before 2091a04)."""
    from normswap.checkpoint import staged_dir
    from normswap.experiment.runner import EXPERIMENT_OPTIONS

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    from normswap.experiment import pretrain

    for names in ({k: k for k in EXPERIMENT_OPTIONS}, {"arms": "--arms", "out": "--out", "overrides": "--set",
                                                       "force": "--force"}):
        with using_option_names(names), pytest.raises(NormswapError) as e, pretrain._using_cache_entry_names(), \
                staged_dir(notes, replace=True):
            pass
        assert str(e.value).endswith("weights or normswap.json); refusing to replace it"), e.value
    assert (notes / "todo.txt").read_text() == "mine"


# -- convert ---------------------------------------------------------------------------------------


def test_convert_refusals(tmp_path):
    save_tiny("gpt2", tmp_path / "gpt2")
    (tmp_path / "empty").mkdir()
    assert cli_error("convert", tmp_path / "gpt2", "--to", "rms", "--out", tmp_path / "empty") == \
        f"{tmp_path / 'empty'} already exists; pass --force to replace it"
    assert library_error(api.convert_checkpoint, tmp_path / "gpt2", tmp_path / "empty") == \
        f"{tmp_path / 'empty'} already exists; pass force=True to replace it"
    # phi with q/k LayerNorms: some norms convert, some not (tests/test_convert_cli.py)
    model = save_tiny("phi", tmp_path / "phi", qk_layernorm=True)
    assert cli_error("convert", tmp_path / "phi", "--to", "rms", "--out", tmp_path / "o").endswith(
        "pass --partial to convert the other 3")
    assert library_error(api.convert_checkpoint, tmp_path / "phi", tmp_path / "o").endswith(
        "pass partial=True to convert the other 3")
    # an experiment's exact arm converts whole: no partial option to suggest (it said --partial)
    from normswap.plan import check_refusals, plan_conversion

    with using_option_names({"arms": "--arms"}):
        message = library_error(check_refusals, plan_conversion(model, model.config), False)
    assert message.startswith("4 of 7 norms cannot be converted") and "partial" not in message


# -- ppl and diff ----------------------------------------------------------------------------------


def test_an_impl_for_a_model_without_a_recorded_patch(root):
    src, text = root / "llama", root / "text.txt"
    assert cli_error("ppl", src, "--data", text, "--impl", "torch") == (
        f"--impl torch runs the patch a normswap.json records with another implementation, and no normswap.json "
        f"records one ({src}); to score a model patched in memory, use normswap diff MODEL --patched torch")
    assert library_error(api.evaluate_checkpoint, src, api.EvalSettings(text), impl="torch") == (
        f"impl='torch' runs the patch a normswap.json records with another implementation, and no normswap.json "
        f"records one ({src}); to score a model patched in memory, use "
        "normswap.diff_checkpoints(MODEL, patched='torch', settings=...)")


def test_diff_needs_b_or_patched(root):
    src, text = root / "llama", root / "text.txt"
    assert cli_error("diff", src, "--data", text) == "give either a second model B or --patched IMPL (exactly one)"
    assert library_error(api.diff_checkpoints, src, settings=api.EvalSettings(text)) == \
        "give either a second model B or patched=IMPL (exactly one)"


def test_diff_patched_of_a_patched_folder(root, tmp_path):
    patched, text = tmp_path / "patched", root / "text.txt"
    api.patch_checkpoint(root / "llama", "torch", out=patched)
    assert "so --patched torch would compare it with itself" in cli_error("diff", patched, "--data", text,
                                                                          "--patched", "torch")
    assert "so patched='torch' would compare it with itself" in library_error(
        api.diff_checkpoints, patched, settings=api.EvalSettings(text), patched="torch")


def test_a_missing_text_field(root, tmp_path):
    """Each caller's way to pick the field: ppl's --text-field, patch's --eval-text-field (patch
    --eval read "pick one with text_field", a flag it had not), EvalSettings' text_field; an
    experiment's recipe has none, so it names none (it said text_field, and --text-field before)."""
    src, rows = root / "llama", root / "rows.jsonl"
    assert cli_error("ppl", src, "--data", rows).endswith(
        "no field 'text' (fields: body); pick one with --text-field FIELD")
    assert library_error(api.evaluate_checkpoint, src, api.EvalSettings(rows)).endswith(
        "no field 'text' (fields: body); pick one with text_field=FIELD")
    assert cli_error("patch", src, "--impl", "torch", "--eval", rows).endswith(
        "no field 'text' (fields: body); pick one with --eval-text-field FIELD")
    assert library_error(api.patch_checkpoint, src, "torch", evaluation=api.EvalSettings(rows)).endswith(
        "no field 'text' (fields: body); pick one with text_field=FIELD")
    from normswap.evaluate import perplexity
    from normswap.loading import load_model, load_tokenizer, resolve

    source = resolve(src)  # perplexity itself, on a data path: its parameter (named as the file's path is)
    assert library_error(perplexity, load_model(source), load_tokenizer(source), rows, progress=False).endswith(
        "no field 'text' (fields: body); pick one with text_field=FIELD")
    r = CliRunner().invoke(cli, ["patch", str(src), "--impl", "torch", "--eval", str(rows), "--eval-text-field", "body",
                                 "--eval-max-length", "32", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["eval"]["tokens"] > 0  # the body field read
    assert cli_error("patch", src, "--eval-text-field", "body").startswith(
        "--eval-text-field only applies to --eval PATH; add --eval or drop --eval-text-field")

    from normswap.experiment.runner import run_experiment
    from tests.test_experiment import PRETRAIN, write_recipe

    recipe = write_recipe(tmp_path / "r.toml", PRETRAIN)
    for message in (library_error(run_experiment, recipe, tmp_path / "a", "original", overrides=[f'data.eval="{rows}"'],
                                  progress=False),
                    cli_error("experiment", recipe, "--out", tmp_path / "b", "--arms", "original", "--set",
                              f'data.eval="{rows}"')):
        assert message.endswith("no field 'text' (fields: body)"), message


def test_the_window_options_are_named_as_each_caller_gave_them(root, tmp_path):
    """The evaluation's window options reach their messages one way, the names in effect
    (errors.using_option_names; perplexity and diff_models took them as a parameter beside it), at
    each place one is refused: before anything is read (check_window_options), against the model's
    context (plan_window) and against the text (sliding_windows). ppl's and diff's user reads
    --stride, patch --eval's --eval-max-tokens, the demo's --max-tokens; a library caller the
    parameter, a caller of perplexity itself too, in a process where the command line ran first."""
    from normswap.evaluate import perplexity
    from normswap.loading import load_model, load_tokenizer, resolve

    src, text = root / "llama", root / "text.txt"
    short = tmp_path / "short.txt"
    short.write_text("In the beginning")  # 16 tokens: shorter than a window of 48
    E = api.EvalSettings
    cases = [  # (the command line's error, the library's, what each says after the option's name)
        # before anything is read
        (cli_error("ppl", src, "--data", text, "--max-length", 1), library_error(api.evaluate_checkpoint, src, E(
            text, max_length=1)), ("--max-length", "max_length", " 1: a window needs at least 2 tokens")),
        (cli_error("patch", src, "--impl", "torch", "--eval", text, "--eval-max-length", 1),
         library_error(api.patch_checkpoint, src, "torch", evaluation=E(text, max_length=1)),
         ("--eval-max-length", "max_length", " 1: a window needs at least 2 tokens")),
        (cli_error("demo", "--max-tokens", 1), library_error(api.demo_evaluation, 1),
         ("--max-tokens", "max_tokens", " 1: at least 2 tokens are needed to score one")),
        # against the model's context (64 positions)
        (cli_error("ppl", src, "--data", text, "--stride", 100), library_error(api.evaluate_checkpoint, src, E(
            text, stride=100)), ("--stride", "stride", " 100 is larger than the window (64 tokens)")),
        (cli_error("diff", src, "--patched", "torch", "--data", text, "--stride", 100),
         library_error(api.diff_checkpoints, src, patched="torch", settings=E(text, stride=100)),
         ("--stride", "stride", " 100 is larger than the window (64 tokens)")),
        # against the text
        (cli_error("patch", src, "--impl", "torch", "--eval", text, "--eval-max-length", 32, "--eval-max-tokens", 20),
         library_error(api.patch_checkpoint, src, "torch", evaluation=E(text, max_length=32, max_tokens=20)),
         ("--eval-max-tokens", "max_tokens", " 20 is shorter than one window (32 tokens)")),
        (cli_error("ppl", src, "--data", short, "--max-length", 48),
         library_error(api.evaluate_checkpoint, src, E(short, max_length=48)),
         (f"{short}: the text is shorter than one window: 16 tokens, window 48; pass --max-length",
          f"{short}: the text is shorter than one window: 16 tokens, window 48; pass max_length",
          " 16 or less, or more text")),
    ]
    for cli_says, library_says, (flag, parameter, rest) in cases:
        assert (cli_says, library_says) == (flag + rest, parameter + rest) or (
            cli_says.startswith(flag + rest) and library_says.startswith(parameter + rest)), (cli_says, library_says)
    source = resolve(src)
    model, tokenizer = load_model(source), load_tokenizer(source)
    assert library_error(perplexity, model, tokenizer, short.read_text(), max_length=48, progress=False) == \
        "data: the text is shorter than one window: 16 tokens, window 48; pass max_length 16 or less, or more text"
    assert library_error(perplexity, model, tokenizer, TEXT, stride=100, progress=False).startswith(
        "stride 100 is larger than the window (64 tokens)")


def test_a_text_too_short_for_a_window_is_named_as_its_caller_gave_it(root, tmp_path):
    """"the text is shorter than one window" and "the text has 1 token" named no text, where a
    command reads one (ppl/diff --data, patch --eval) and an experiment two or three (data.eval,
    data.train, pretrain.text: the training ones said theirs). A file is named by its path, as
    normswap.data's other refusals of it are; a text given in memory by the parameter (as the
    caller calls it); an experiment's held-out text by data.eval (test_experiment)."""
    from normswap.evaluate import perplexity
    from normswap.loading import load_model, load_tokenizer, resolve

    src = root / "llama"
    short, one = tmp_path / "short.txt", tmp_path / "one.txt"
    short.write_text("In the beginning")  # 16 tokens
    one.write_text("I")  # 1 token
    window = "the text is shorter than one window: 16 tokens, window 48; pass {} 16 or less, or more text"
    assert cli_error("ppl", src, "--data", short, "--max-length", 48) == f"{short}: " + window.format("--max-length")
    assert cli_error("diff", src, "--patched", "torch", "--data", short, "--max-length", 48) == \
        f"{short}: " + window.format("--max-length")
    assert cli_error("patch", src, "--impl", "torch", "--out", tmp_path / "p", "--eval", short,
                     "--eval-max-length", 48) == f"{short}: " + window.format("--eval-max-length")
    assert library_error(api.evaluate_checkpoint, src, api.EvalSettings(short, max_length=48)) == \
        f"{short}: " + window.format("max_length")
    assert cli_error("ppl", src, "--data", one) == f"{one}: the text has 1 token; at least 2 are needed to score one"
    source = resolve(src)
    model, tokenizer = load_model(source), load_tokenizer(source)
    assert library_error(perplexity, model, tokenizer, "I", progress=False) == \
        "data: the text has 1 token; at least 2 are needed to score one"
    assert library_error(perplexity, model, tokenizer, "In the beginning", max_length=48, progress=False,
                         option_names={"data": "held_out"}) == "held_out: " + window.format("max_length")


def test_the_window_checks_read_the_names_in_effect_and_take_none():
    """One way for names to reach the window checks, the names in effect: below the entry points
    (api's, perplexity, diff_models) nothing takes them as a parameter. check_window_options,
    plan_window and sliding_windows took `names`, _Scoring and check_before_loading
    `option_names`, and EvalSettings.window_kwargs carried them down beside the context variable:
    two ways to say one thing, free to disagree."""
    import inspect

    from normswap import evaluate
    from normswap.errors import BadInputError

    for f in (evaluate.check_window_options, evaluate.plan_window, evaluate.sliding_windows,
              evaluate.check_before_loading, evaluate._Scoring):
        assert not {"names", "option_names"} & set(inspect.signature(f).parameters), f
    assert set(api.EvalSettings("x").window_kwargs) == {"max_length", "stride", "max_tokens", "batch_size",
                                                         "text_field"}
    with using_option_names({"stride": "--stride"}), pytest.raises(BadInputError, match="^--stride 0: "):
        evaluate.check_window_options(None, 0)


def test_each_helper_that_installs_names_has_a_name_of_its_own():
    """One name per concept: api's helper that installs an entry point's names (its options' and its
    evaluation settings') and evaluate's that installs the scoring options' names only when a caller
    gives them were both `_naming`. Every module-level function of normswap that returns
    errors.using_option_names(...) is named for what it installs, none twice."""
    import ast
    from pathlib import Path

    import normswap

    installers = {}
    for path in sorted(Path(normswap.__file__).parent.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(r, ast.Return) and isinstance(r.value, ast.Call)
                    and getattr(r.value.func, "id", None) == "using_option_names" for r in ast.walk(node)):
                installers.setdefault(node.name, []).append(path.name)
    assert installers == {"_using_entry_point_names": ["api.py"], "_using_given_scoring_names": ["evaluate.py"],
                          "_using_cache_entry_names": ["pretrain.py"]}


def test_a_gain_kept_on_request_says_so_as_it_was_asked(tmp_path):
    save_tiny("gpt2", tmp_path / "gpt2")
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "gpt2"), "--to", "rms", "--out", str(tmp_path / "a"),
                                 "--keep-gain", "--json"])
    assert r.exit_code == 0, r.stderr
    assert {n["kept_gain_why"] for n in json.loads(r.stdout)["norms"] if n["kept_gain"] and not n["baked"]} == {"--keep-gain"}
    result = api.convert_checkpoint(tmp_path / "gpt2", tmp_path / "b", keep_gain=True)
    assert {n["kept_gain_why"] for n in result.section["norms"] if n["kept_gain"] and not n["baked"]} == {"keep_gain=True"}


def test_a_recorded_patch_that_cannot_run_here(root, tmp_path):
    """A folder patched with liger on a GPU machine, read where liger cannot run: the way out each
    caller reads is its own option."""
    fast, text = tmp_path / "liger", root / "text.txt"
    api.patch_checkpoint(root / "llama", "torch", out=fast)
    manifest = json.loads((fast / "normswap.json").read_text())
    manifest["patch"]["impl"] = "liger"
    (fast / "normswap.json").write_text(json.dumps(manifest))
    assert cli_error("ppl", fast, "--data", text).endswith("; run its norms with another implementation: --impl torch")
    assert library_error(api.evaluate_checkpoint, fast, api.EvalSettings(text)).endswith(
        "; run its norms with another implementation: impl='torch'")
    assert cli_error("diff", fast, "--patched", "torch", "--data", text).endswith(
        "; --patched patches a model that runs no patch: give the unpatched model as A, or a second model B")
    assert library_error(api.diff_checkpoints, fast, patched="torch", settings=api.EvalSettings(text)).endswith(
        "; patched patches a model that runs no patch: give the unpatched model as A, or a second model B")
    assert cli_error("patch", fast, "--impl", "torch", "--eval", text).endswith(
        "; --eval compares the new patch with the model as that folder loads, so there is nothing to compare it "
        "with here; drop --eval, or run where the recorded patch runs")
    assert library_error(api.patch_checkpoint, fast, "torch", evaluation=api.EvalSettings(text)).endswith(
        "; evaluation compares the new patch with the model as that folder loads, so there is nothing to compare "
        "it with here; drop evaluation, or run where the recorded patch runs")
