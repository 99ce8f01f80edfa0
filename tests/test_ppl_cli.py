"""`normswap ppl` and `normswap diff` through Click: --json documents, one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_models import save_tiny, tiny_tokenizer

from normswap.cli import cli
from normswap.evaluate import diff_models, perplexity

DATA = Path(__file__).parent / "data"
TEXT = DATA / "lighthouse.txt"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    a = save_tiny("llama", root / "a")
    b = save_tiny("llama", root / "b")
    with torch.no_grad():  # B = A with a perturbed final norm
        g = torch.Generator().manual_seed(1)
        b.model.norm.weight.mul_(1 + 0.2 * torch.randn(b.model.norm.weight.shape, generator=g))
    b.save_pretrained(root / "b")
    save_tiny("llama", root / "other-tokenizer")
    renumbered_tokenizer().save_pretrained(root / "other-tokenizer")
    save_tiny("llama", root / "foreign-tokenizer")
    renumbered_tokenizer(offset=1000).save_pretrained(root / "foreign-tokenizer")
    save_tiny("t5", root / "t5")  # encoder-decoder: refused from its config, before any weight loads
    save_tiny("bert", root / "bert")  # BertModel: no language-model head, refused from its config too
    save_tiny("llama", root / "no-tokenizer")
    for f in os.listdir(root / "no-tokenizer"):
        if "token" in f:
            os.remove(root / "no-tokenizer" / f)
    return root, a, b


def renumbered_tokenizer(offset: int = 0):
    """The tiny tokenizer's tokens with their ids reversed (the same vocabulary size, other ids),
    and moved up by `offset` (past the model's embeddings when offset > 0)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    base = tiny_tokenizer()
    vocab = base.get_vocab()
    new_ids = [i + offset for i in sorted(vocab.values(), reverse=True)]
    reversed_ids = dict(zip(sorted(vocab, key=vocab.get), new_ids, strict=True))
    backend = Tokenizer(WordLevel(vocab=reversed_ids, unk_token="<unk>"))
    backend.pre_tokenizer = base.backend_tokenizer.pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def ok_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_ppl_json_equals_the_library(models):
    root, a, _ = models
    d = ok_json("ppl", root / "a", "--data", TEXT, "--max-length", 32, "--stride", 16)
    lib = perplexity(a, tiny_tokenizer(), TEXT.read_text(), max_length=32, stride=16, progress=False)
    assert {k: d[k] for k in lib.to_dict()} == lib.to_dict()
    assert d["model"] == str(root / "a") and d["dtype"] == "float32" and d["tokens"] == len(TEXT.read_text()) - 1


def test_ppl_human_output_and_options(models, tmp_path):
    root, _, _ = models
    result = run("ppl", root / "a", "--data", TEXT, "--max-length", 32, "--max-tokens", 100, "--batch-size", 3)
    assert result.exit_code == 0, result.output
    assert "perplexity" in result.stdout and "99 scored tokens" in result.stdout
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"body": line}) for line in TEXT.read_text().split("\n\n")) + "\n")
    d = ok_json("ppl", root / "a", "--data", rows, "--text-field", "body", "--max-length", 32, "--dtype", "bf16")
    assert d["dtype"] == "bfloat16" and d["ppl"] > 1


def test_progress_is_whole_lines_when_stderr_is_not_a_terminal(models):
    """CliRunner's stderr is no terminal, as a log file or CI's is: a redrawn tqdm bar there is a
    run of carriage returns. Each stage is a line when it starts and one when it ends, with what
    it counted and how long it took."""
    root, _, _ = models
    result = run("ppl", root / "a", "--data", TEXT, "--max-length", 32, "--max-tokens", 100)
    assert result.exit_code == 0, result.output
    assert "\r" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[:2] == ["load ...", lines[1]] and lines[1].startswith("load: 1/1 step, ")
    assert lines[2:] == ["perplexity ...", lines[3]], result.stderr
    assert re.fullmatch(r"perplexity: 100/100 tok, \d+\.\d s", lines[3]), lines[3]


def test_a_recorded_patch_runs_after_its_load_has_ended(models, tmp_path):
    """The patch a directory's normswap.json records is a stage of its own after the load: it split
    the load in two ('load ...', 'load: 0/1', 'patch ...', 'load ...', 'load: 1/1')."""
    import normswap

    root, _, _ = models
    normswap.patch_checkpoint(root / "a", "torch", out=tmp_path / "fast")
    for args, loads in ((("ppl", tmp_path / "fast"), ["load: 1/1"]),
                        (("diff", root / "a", tmp_path / "fast"), ["load: 2/2"])):
        result = run(*args, "--data", TEXT, "--max-length", 32, "--max-tokens", 100)
        assert result.exit_code == 0, result.output
        starts = [line for line in result.stderr.splitlines() if line.startswith(("load", "patch"))]
        assert [line.split(" step")[0] for line in starts] == ["load ...", *loads, "patch ...", "patch: 5/5"], starts


def test_progress_lines_while_a_stage_runs_come_at_most_every_interval(monkeypatch, capsys):
    from normswap import progress

    clock = iter([0.0, 3.0, 9.0, 10.5, 12.0, 21.0, 30.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    with progress.stderr_bar(total=5_000_000, desc="convert", unit="B", unit_scale=True) as bar:
        for _ in range(5):
            bar.update(1_000_000)  # MB as tqdm's bar on a terminal counts them (unit_divisor 1000)
    assert capsys.readouterr().err.splitlines() == [
        "convert ...",
        "convert: 3.00MB/5.00MB, 10.5 s",  # 3.0 and 9.0 s: under LINE_INTERVAL since the start
        "convert: 5.00MB/5.00MB, 21.0 s",  # 12.0 s: too soon after the last line
    ]  # and the close at 30.0 s adds no line: the last one gave the final count


def test_a_notebook_keeps_tqdms_widget(monkeypatch):
    """Jupyter's stderr is no terminal either, but tqdm.auto draws a widget there: library users'
    progress=True bars stay tqdm's."""
    import tqdm.auto
    import tqdm.notebook

    from normswap import progress

    assert isinstance(progress.stderr_bar(total=3, desc="perplexity"), progress._LineBar)

    class NotebookBar(tqdm.notebook.tqdm_notebook):  # tqdm.auto's class under a Jupyter kernel
        def __init__(self, *args, **kwargs):
            self.kwargs = kwargs

        def __del__(self):  # nothing was drawn: nothing to close
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", NotebookBar)
    bar = progress.stderr_bar(total=3, desc="perplexity")
    assert isinstance(bar, NotebookBar) and bar.kwargs["total"] == 3


def test_diff_json(models):
    root, a, b = models
    same = ok_json("diff", root / "a", root / "a", "--data", TEXT, "--max-length", 32)
    assert same["delta_ppl"] == 0 and same["kl_mean"] == 0 and same["kl_max"] == 0
    assert same["top1_agreement"] == 1.0 and same["max_abs_logit_diff"] == 0
    d = ok_json("diff", root / "a", root / "b", "--data", TEXT, "--max-length", 32)
    lib = diff_models(a, b, tiny_tokenizer(), TEXT.read_text(), max_length=32, progress=False)
    numbers = {k: v for k, v in lib.to_dict().items() if k != "noise_floor"}
    assert {k: d[k] for k in numbers} == pytest.approx(numbers, rel=1e-9)
    assert d["noise_floor"] is None and lib.noise_floor is None  # fp32: no half-precision noise floor
    assert d["kl_mean"] > 0 and d["model_b"] == str(root / "b")
    human = run("diff", root / "a", root / "b", "--data", TEXT, "--max-length", 32)
    assert human.exit_code == 0 and "KL(A||B)" in human.stdout


def test_a_directory_normswap_patched_is_scored_with_its_recorded_patch(models, tmp_path, monkeypatch):
    """`normswap patch --out fast`, then `normswap diff original fast`: B must run the kernels
    fast's normswap.json records (as normswap.load does), not the stock modules its weights also
    load into, which made the diff exactly zero whatever the kernels do."""
    import sys

    import normswap
    from normswap import evaluate

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not importable, on a GPU machine with it too
    root, _, _ = models
    fast = tmp_path / "fast"
    normswap.patch_checkpoint(root / "a", "torch", out=fast)
    scored = []
    for name in ("perplexity", "diff_models"):
        real = getattr(evaluate, name)
        monkeypatch.setattr(evaluate, name, lambda *a, _real=real, **k: scored.append(a[:-2]) or _real(*a, **k))

    def patched(model) -> bool:
        return any(hasattr(m, "original_class") for m in model.modules())

    d = ok_json("ppl", fast, "--data", TEXT, "--max-length", 32, "--max-tokens", 100)
    assert d["impl"] == "torch" and patched(scored.pop()[0])
    assert ok_json("ppl", root / "a", "--data", TEXT, "--max-length", 32, "--max-tokens", 100)["impl"] is None
    assert not patched(scored.pop()[0])
    d = ok_json("diff", root / "a", fast, "--data", TEXT, "--max-length", 32, "--max-tokens", 100)
    assert (d["impl_a"], d["impl_b"], d["model_b"]) == (None, "torch", str(fast))
    model_a, model_b = scored.pop()
    assert not patched(model_a) and patched(model_b)
    human = run("diff", root / "a", fast, "--data", TEXT, "--max-length", 32, "--max-tokens", 100)
    assert f"B: {fast} (its normswap.json's patch, run with torch)\n" in human.stdout, human.stdout
    human = run("ppl", fast, "--data", TEXT, "--max-length", 32, "--max-tokens", 100)
    assert human.stdout.startswith(f"{fast} (its normswap.json's patch, run with torch) on "), human.stdout
    assert ok_json("diff", root / "a", "--patched", "torch", "--data", TEXT, "--max-length", 32, "--max-tokens", 100)["impl_b"] == "torch"
    # A patch that cannot run here is named before any weight loads; a patched A is not patched again.
    manifest = json.loads((fast / "normswap.json").read_text())
    manifest["patch"]["impl"] = "liger"
    (tmp_path / "liger").mkdir()
    for f in fast.iterdir():
        (tmp_path / "liger" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "liger" / "normswap.json").write_text(json.dumps(manifest))
    r = run("ppl", tmp_path / "liger", "--data", TEXT, "--json")
    assert r.exit_code == 2 and r.stdout == "" and "records a liger patch, which cannot run here" in r.stderr
    assert "--impl torch" in r.stderr  # the way out, named
    # --patched refuses an A that runs a patch whatever it is: its way out is another A, not --impl
    # (which ran the recorded patch with torch, and was refused in turn as comparing A with itself)
    r = run("diff", tmp_path / "liger", "--patched", "torch", "--data", TEXT, "--json")
    assert r.exit_code == 2 and r.stdout == "" and "records a liger patch, which cannot run here" in r.stderr
    assert "give the unpatched model as A" in r.stderr and "--impl" not in r.stderr
    r = run("diff", fast, "--patched", "torch", "--data", TEXT, "--json")
    assert r.exit_code == 2 and r.stdout == "" and "would compare it with itself" in r.stderr


def test_a_recorded_patch_that_cannot_run_here_is_scored_with_impl(models, tmp_path, monkeypatch):
    """A model patched with liger on a GPU machine, scored on a CPU-only one: --impl (normswap.load's
    impl) runs the recorded patch with another implementation, rather than a refusal with no way out
    or the stock modules, which would report no difference whatever the patch changed."""
    import normswap
    from normswap import evaluate

    root, _, _ = models
    fast = tmp_path / "liger"
    normswap.patch_checkpoint(root / "a", "torch", out=fast)
    manifest = json.loads((fast / "normswap.json").read_text())
    manifest["patch"]["impl"] = "liger"
    (fast / "normswap.json").write_text(json.dumps(manifest))
    scored = []
    real = evaluate.diff_models
    monkeypatch.setattr(evaluate, "diff_models", lambda *a, **k: scored.append(a[:2]) or real(*a, **k))

    d = ok_json("ppl", fast, "--impl", "reference", "--data", TEXT, "--max-length", 32, "--max-tokens", 100)
    assert d["impl"] == "reference"
    human = run("ppl", fast, "--impl", "reference", "--data", TEXT, "--max-length", 32, "--max-tokens", 100)
    assert human.stdout.startswith(f"{fast} (its normswap.json's patch, run with reference) on "), human.stdout
    d = ok_json("diff", root / "a", fast, "--impl", "torch", "--data", TEXT, "--max-length", 32, "--max-tokens", 100)
    assert (d["impl_a"], d["impl_b"]) == (None, "torch")
    model_a, model_b = scored.pop()
    kinds = {type(m).__name__ for m in model_b.modules() if hasattr(m, "original_class")}
    assert kinds and not any(hasattr(m, "original_class") for m in model_a.modules())
    assert normswap.evaluate_checkpoint(fast, normswap.EvalSettings(TEXT, max_length=32, max_tokens=100), impl="torch").impl == "torch"
    # An override of nothing is refused, not ignored: the user expected IMPL to run.
    for args in (("ppl", root / "a"), ("diff", root / "a", root / "b")):
        r = run(*args, "--impl", "torch", "--data", TEXT, "--json")
        assert r.exit_code == 2 and r.stdout == "" and "no normswap.json records one" in r.stderr, r.output


def test_diff_patched(models):
    root, _, _ = models
    d = ok_json("diff", root / "a", "--patched", "torch", "--data", TEXT, "--max-length", 32)
    assert d["model_b"].endswith("--patched torch")
    assert abs(d["relative_delta"]) < 1e-5 and d["kl_mean"] < 1e-8 and d["top1_agreement"] > 0.99


@pytest.mark.parametrize("impl, says", [("liger", "not available here"), ("nonsense", "is not one of")])
def test_diff_patched_with_an_unusable_impl_is_a_clear_error(models, impl, says):
    root, _, _ = models
    result = run("diff", root / "a", "--patched", impl, "--data", TEXT)
    assert result.exit_code == 2 and says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def bad(tmp_path: Path, name: str, content: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(content)
    return p


@pytest.mark.parametrize("cmd", ["ppl", "diff"])
def test_a_model_without_a_language_model_head_is_refused_before_its_weights_load(models, monkeypatch, cmd):
    """The config names the class (BertModel) and the class says it has no head: loading the
    weights first only to find no logits costs a whole checkpoint's read for one error line."""
    from normswap import loading

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(loading, "load_model", no_load)
    root, _, _ = models
    args = ["ppl", root / "bert"] if cmd == "ppl" else ["diff", root / "a", root / "bert"]
    result = run(*args, "--data", TEXT)
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert result.stderr.strip().splitlines()[-1] == ("normswap: error: BertModel has no language-model head (no "
                                                      "logits to score); perplexity needs a causal language model")


@pytest.mark.parametrize("args,message", [
    (lambda r, t: ("ppl", r / "a", "--data", bad(t, "e.txt", b"")), "empty file"),
    (lambda r, t: ("ppl", r / "a", "--data", bad(t, "b.bin", b"\x00\x01\x02binary")), "a binary file"),
    (lambda r, t: ("ppl", r / "a", "--data", t / "missing.txt"), "no such file or directory"),
    (lambda r, t: ("ppl", r / "a", "--data", bad(t, "s.txt", b"too short"), "--max-length", 32),
     "s.txt: the text is shorter than one window: 9 tokens, window 32; pass --max-length 9 or less, or more text"),
    (lambda r, t: ("ppl", r / "no-tokenizer", "--data", TEXT), "no usable tokenizer"),
    (lambda r, t: ("ppl", r / "a", "--data", TEXT, "--max-length", 16, "--stride", 17), "larger than"),
    (lambda r, t: ("ppl", r / "a", "--data", TEXT, "--stride", 100), "larger than the window (64 tokens)"),
    (lambda r, t: ("ppl", r / "a", "--data", TEXT, "--stride", 0), "positive"),
    (lambda r, t: ("ppl", t / "nomodel", "--data", TEXT), "no such file or directory"),
    (lambda r, t: ("ppl", r / "a", "--data", bad(t, "r.jsonl", b'{"body": "x"}\n')), "no field 'text'"),
    (lambda r, t: ("ppl", r / "t5", "--data", TEXT), "encoder-decoder model"),
    (lambda r, t: ("diff", r / "a", "--patched", "torch", "--data", bad(t, "s.txt", b"too short"),
                   "--max-length", 32), "s.txt: the text is shorter than one window: 9 tokens, window 32"),
    (lambda r, t: ("diff", r / "a", r / "t5", "--data", TEXT), "encoder-decoder model"),
    (lambda r, t: ("ppl", r / "bert", "--data", TEXT), "BertModel has no language-model head"),
    (lambda r, t: ("diff", r / "a", r / "bert", "--data", TEXT), "BertModel has no language-model head"),
    (lambda r, t: ("diff", r / "a", r / "other-tokenizer", "--data", TEXT), "different tokenizers"),
    (lambda r, t: ("ppl", r / "foreign-tokenizer", "--data", TEXT, "--max-length", 32),
     "the tokenizer does not belong to this model"),
    (lambda r, t: ("diff", r / "a", "--data", TEXT), "exactly one"),
    (lambda r, t: ("diff", r / "a", r / "b", "--patched", "triton", "--data", TEXT), "exactly one"),
    (lambda r, t: ("ppl", r / "a", "--data", TEXT, "--device", "meta"), "unknown device 'meta'"),
    (lambda r, t: ("diff", r / "a", "--patched", "torch", "--data", TEXT, "--device", "tpu"), "unknown device 'tpu'"),
])
def test_bad_input_is_one_line_and_exit_2(models, tmp_path, args, message):
    root, _, _ = models
    result = run(*args(root, tmp_path), "--json")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    # Exactly one line: bad input is caught before weights load, so not even transformers'
    # loading bar precedes it (lines a progress bar blanked out with \r and spaces do not count).
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("normswap: error:") and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("cmd, loads", [
    (lambda r: ("ppl", r / "a"), 1),
    (lambda r: ("diff", r / "a", "--patched", "torch"), 1),  # B is A's copy, on A's device
    (lambda r: ("diff", r / "a", r / "b", "--dtype", "bf16"), 3),  # A, B and A's float32 reference
])
def test_models_are_scored_on_the_device_given(models, monkeypatch, cmd, loads):
    """ppl and diff load every model they score (A, B, the float32 reference) where --device says,
    as patch does: they loaded on the CPU whatever the machine, where natively the Triton kernels
    refuse to run. No CUDA here, so parse_device is made to answer cuda:0 and the load is
    recorded, then done on the CPU. `loads` counts them, so a load left on the CPU is missed by
    no case."""
    from normswap import loading

    root, _, _ = models
    asked, load = [], loading.load_model

    def recording_load(source, *args, device=None, **kwargs):
        asked.append(device)
        return load(source, *args, **kwargs)

    monkeypatch.setattr(loading, "parse_device", lambda name: {"cuda:0": "cuda:0", "auto": None}[name])
    monkeypatch.setattr(loading, "load_model", recording_load)
    args = (*cmd(root), "--data", TEXT, "--max-length", 32, "--max-tokens", 64)
    assert ok_json(*args, "--device", "cuda:0")["device"] == "cuda:0"  # the report says where
    assert asked == ["cuda:0"] * loads
    asked.clear()
    assert ok_json(*args)["device"] == "cpu"  # auto: the CPU here
    assert asked == [None] * loads
