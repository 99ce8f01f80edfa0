"""README.md's Python examples run as written, on tiny models standing in for the ones they name.

Each ```python block is executed in order in one namespace (a reader who pastes them one after
another), inside a directory that holds the paths the examples name. The few edits that keep CI
quick are listed in EDITS; each must still match README.md, so a changed example is noticed here
rather than kept out of the test silently."""

from __future__ import annotations

import inspect
import re
import shutil
from pathlib import Path

import pytest
from tiny_models import save_tiny, tiny_model, tiny_tokenizer

README = Path(__file__).resolve().parent.parent / "README.md"
TEXT = "In the beginning God created the heaven and the earth. And the earth was without form. " * 30

# (README text, what the test runs instead, why)
EDITS = [
    ('"smollm2-135m"', '"llama-dir"', "the embedded model: a tiny llama stands in"),
    ("seq=2048", "seq=16, modes='prefill', warmup=0, repeats=1", "a bench of a few ms, not minutes"),
    ('normswap.tune_launches(hidden=[2048], dtypes="bf16", budget=300)',
     '__import__("inspect").signature(normswap.tune_launches).bind(hidden=[2048], dtypes="bf16", budget=300)',
     "it needs a CUDA device: checked against its signature only (tests/test_tune.py runs it on a fake GPU)"),
]


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.fixture()
def workdir(tmp_path, monkeypatch, small_probes):
    """The paths the examples name, as tiny checkpoints."""
    import normswap

    monkeypatch.chdir(tmp_path)
    for name in ("llama-dir", "path/to/model"):
        save_tiny("llama", tmp_path / name)
    save_tiny("gpt2", tmp_path / "gpt2-dir")
    (tmp_path / "llama-config-dir").mkdir()
    shutil.copy(tmp_path / "llama-dir" / "config.json", tmp_path / "llama-config-dir")
    normswap.patch_checkpoint("llama-dir", "torch", out="patched-dir")
    (tmp_path / "notes.txt").write_text(TEXT)
    return tmp_path


def _stub_experiment(ns: dict) -> None:
    """The experiment example names a recipe that trains for minutes: its calls are bound to the
    real signatures (and the result's attribute checked) instead of run."""
    from normswap.experiment import ExperimentResult, load_recipe, run_experiment

    assert isinstance(inspect.getattr_static(ExperimentResult, "summary"), property)

    class Result:
        summary: list = []

    def bound(fn):
        def call(*args, **kwargs):
            inspect.signature(fn).bind(*args, **kwargs)
            return Result()
        return call

    ns["load_recipe"], ns["run_experiment"] = bound(load_recipe), bound(run_experiment)


def test_the_readme_python_examples_run(workdir):
    blocks = _blocks()
    assert len(blocks) >= 3
    text = README.read_text()
    for old, _new, why in EDITS:
        assert old in text, f"README no longer has {old!r} ({why}): update EDITS"
    ns: dict = {"model": tiny_model("llama"), "tokenizer": tiny_tokenizer(), "text": TEXT,
                "model_a": tiny_model("llama"), "model_b": tiny_model("llama", seed=1)}
    for i, block in enumerate(blocks):
        source = block
        for old, new, _why in EDITS:
            source = source.replace(old, new)
        if "run_experiment" in source:
            source = source.replace("from normswap.experiment import load_recipe, run_experiment\n", "")
            _stub_experiment(ns)
        if "convert_model" in source:
            ns["model"] = tiny_model("gpt2")  # the library example converts LayerNorms: a GPT-2
        exec(compile(source, f"README.md python block {i}", "exec"), ns)  # noqa: S102


def test_the_readme_commands_exist():
    """The two commands README.md opens with (make demo, make test) are Makefile targets."""
    makefile = (README.parent / "Makefile").read_text()
    head = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    targets = re.findall(r"^make (\w+)", head, re.M)
    assert targets == ["demo", "test"]
    for t in targets:
        assert re.search(rf"^{t}:", makefile, re.M), t
