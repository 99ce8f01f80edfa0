"""A hostile new user's sweep: bad inputs to every command, each judged against the error contract.

    python benchmarks/hostile_sweep.py [--only SUBSTRING] [--json]

A case is clean when the command exits with the expected code (2: bad input), prints exactly one
`normswap: error:` line on stderr and no traceback or warning, leaves stdout empty (or, where the
contract allows a report, one JSON document), and leaves every input directory byte for byte as
it was (checksummed before and after). Anything else is a defect, listed with what broke.

The commands run in-process through click's test runner (one import of torch for the whole sweep);
tests/test_hostile_sweep.py runs the cases marked `ci` in the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Case:
    name: str
    args: list  # the command line after `normswap` (Paths and str)
    says: str = ""  # a fragment the error line must contain
    report: bool = False  # the contract allows a JSON report on stdout (--json failures)
    ci: bool = False  # cheap and representative: run in the test suite
    cwd: Path | None = None
    setup: object = None  # a context manager factory (e.g. a permission error)
    code: int = 2


@dataclass
class Outcome:
    case: Case
    exit_code: int
    problems: list = field(default_factory=list)
    error_line: str = ""

    @property
    def clean(self) -> bool:
        return not self.problems


def _checksum(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(d)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def fixtures(root: Path) -> dict:
    from test_safety import _corrupt, _retyped
    from test_safety import _edited_copy as _edited
    from tiny_models import save_tiny

    fx = {"root": root}
    fx["llama"] = root / "llama"
    save_tiny("llama", fx["llama"])
    fx["gpt2"] = root / "gpt2"
    save_tiny("gpt2", fx["gpt2"])
    fx["bert"] = root / "bert"
    save_tiny("bert", fx["bert"])
    for name, change in {"neg_layers": dict(num_hidden_layers=-1), "zero_hidden": dict(hidden_size=0),
                         "zero_vocab": dict(vocab_size=0), "str_hidden": dict(hidden_size="big"),
                         "nan_eps": dict(rms_norm_eps=float("nan")), "unknown_type": dict(model_type="no_such_xyz"),
                         "fewer": dict(num_hidden_layers=1), "more": dict(num_hidden_layers=3),
                         "wide": dict(intermediate_size=64), "neg_kv": dict(num_key_value_heads=-2),
                         "huge_layers": dict(num_hidden_layers=10**12),
                         "arch_str": dict(architectures="LlamaForCausalLM"),
                         "unknown_arch": dict(architectures=["NoSuchForCausalLM"])}.items():
        fx[name] = _edited(fx["llama"], root / name, **change)
    fx["nan_w"] = _corrupt(fx["llama"], root / "nan_w", "model.norm.weight", float("nan"))
    fx["inf_w"] = _corrupt(fx["llama"], root / "inf_w", "model.layers.0.mlp.up_proj.weight", float("inf"))
    fx["nan_gpt2"] = _corrupt(fx["gpt2"], root / "nan_gpt2", "transformer.h.0.ln_1.weight", float("nan"))
    import torch

    # float tensors stored as integers: transformers would cast them to float without a word
    fx["int_norm"] = _retyped(fx["llama"], root / "int_norm", "model.norm.weight", torch.int64)
    fx["int_linear"] = _retyped(fx["llama"], root / "int_linear", "model.layers.0.mlp.up_proj.weight", torch.int32)
    fx["bool_gpt2"] = _retyped(fx["gpt2"], root / "bool_gpt2", "transformer.h.0.ln_1.weight", torch.bool)
    fx["trunc"] = root / "trunc"
    shutil.copytree(fx["llama"], fx["trunc"])
    f = fx["trunc"] / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    fx["trunc_gpt2"] = root / "trunc_gpt2"
    shutil.copytree(fx["gpt2"], fx["trunc_gpt2"])
    f = fx["trunc_gpt2"] / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    fx["badjson"] = root / "badjson"
    shutil.copytree(fx["llama"], fx["badjson"])
    (fx["badjson"] / "config.json").write_text('{"model_type": "llama",')
    fx["listjson"] = root / "listjson"
    shutil.copytree(fx["llama"], fx["listjson"])
    (fx["listjson"] / "config.json").write_text("[1, 2, 3]")
    fx["dirjson"] = root / "dirjson"
    shutil.copytree(fx["llama"], fx["dirjson"])
    (fx["dirjson"] / "config.json").unlink()
    (fx["dirjson"] / "config.json").mkdir()
    fx["latin1json"] = root / "latin1json"
    shutil.copytree(fx["llama"], fx["latin1json"])
    (fx["latin1json"] / "config.json").write_bytes(b'{"model_type": "llama", "name": "caf\xe9"}')
    fx["badgen"] = root / "badgen"  # transformers would silently put a default in its place
    shutil.copytree(fx["llama"], fx["badgen"])
    (fx["badgen"] / "generation_config.json").write_text('{"max_length": 50, "temperature": 0.7,')
    fx["deepgen"] = root / "deepgen"
    shutil.copytree(fx["gpt2"], fx["deepgen"])
    (fx["deepgen"] / "generation_config.json").write_text("[" * 100_000 + "]" * 100_000)
    fx["dirgen"] = root / "dirgen"
    shutil.copytree(fx["llama"], fx["dirgen"])
    (fx["dirgen"] / "generation_config.json").unlink()
    (fx["dirgen"] / "generation_config.json").mkdir()
    (fx["dirgen"] / "generation_config.json" / "notes.txt").write_text("mine")
    # JSON nested past json's recursion limit (a RecursionError, no ValueError) in each JSON file
    # normswap reads from a model folder or from an --out left by an earlier run.
    deep = b"[" * 100_000 + b"]" * 100_000
    for name, src, file in (("deep_manifest", "llama", "normswap.json"), ("deep_manifest_gpt2", "gpt2", "normswap.json"),
                            ("deep_index", "gpt2", "model.safetensors.index.json"),
                            ("deep_index_llama", "llama", "model.safetensors.index.json"),
                            ("deep_tokenizer", "llama", "tokenizer.json"), ("deep_header", "gpt2", "model.safetensors")):
        fx[name] = root / name
        shutil.copytree(fx[src], fx[name])
        if file == "model.safetensors.index.json":  # sharded: the index names the one shard
            (fx[name] / "model.safetensors").rename(fx[name] / "model-00001-of-00001.safetensors")
        (fx[name] / file).write_bytes(struct.pack("<Q", len(deep)) + deep if file.endswith(".safetensors") else deep)
    # What transformers reads itself (its errors name no file): Latin-1, and not JSON.
    for name, file, content in (("latin1_tokcfg", "tokenizer_config.json", b'{"name": "caf\xe9"}'),
                                ("bad_special", "special_tokens_map.json", b'{"eos_token": ')):
        fx[name] = root / name
        shutil.copytree(fx["llama"], fx[name])
        (fx[name] / file).write_bytes(content)
    fx["dangling"] = root / "dangling"  # an --out that is a link to nothing: never written where it points
    fx["dangling"].symlink_to(root / "elsewhere" / "x")
    fx["pipe"] = root / "pipe"
    os.mkfifo(fx["pipe"])
    fx["partial"] = root / "partial"  # a hub snapshot whose weights link to a blob still downloading
    shutil.copytree(fx["llama"], fx["partial"])
    (fx["partial"] / "model.safetensors").unlink()
    (fx["partial"] / "model.safetensors").symlink_to(root / "blobs" / "1d8412fb")
    from safetensors.torch import load_file, save_file

    fx["long_gain"] = root / "long_gain"  # a LayerNorm gain stored with twice the values the config gives
    shutil.copytree(fx["gpt2"], fx["long_gain"])
    weights = load_file(fx["long_gain"] / "model.safetensors")
    weights["transformer.h.0.ln_1.weight"] = weights["transformer.h.0.ln_1.weight"].repeat(2)
    save_file(weights, fx["long_gain"] / "model.safetensors", metadata={"format": "pt"})
    fx["deep_user"] = root / "deep_user"  # --force: a folder whose config.json is not a model's
    fx["deep_user"].mkdir()
    (fx["deep_user"] / "config.json").write_bytes(deep)
    (fx["deep_user"] / "notes.txt").write_text("keep")
    fx["deep_run"] = root / "deep_run"  # an experiment --out whose recipe.json is not ours
    fx["deep_run"].mkdir()
    (fx["deep_run"] / "recipe.json").write_bytes(deep)
    fx["badgguf"] = root / "gguf" / "model.gguf"
    fx["badgguf"].parent.mkdir()
    fx["badgguf"].write_text("not a gguf file " * 8)
    fx["locked"] = root / "locked"
    shutil.copytree(fx["llama"], fx["locked"])
    fx["empty_dir"] = root / "empty_dir"
    fx["empty_dir"].mkdir()
    fx["user_dir"] = root / "thesis"
    fx["user_dir"].mkdir()
    (fx["user_dir"] / "chapter1.tex").write_text("years of work")
    (fx["user_dir"] / "config.json").write_text('{"editor": "vim"}')
    fx["done"] = root / "done"  # an earlier output: exists, so --out without --force is refused
    shutil.copytree(fx["llama"], fx["done"])
    fx["done_sub"] = root / "done-sub"  # a checkpoint holding a folder of the user's (the cwd cases)
    shutil.copytree(fx["llama"], fx["done_sub"])
    (fx["done_sub"] / "sub").mkdir()
    texts = root / "texts"
    texts.mkdir()
    fx["text"] = texts / "t.txt"
    fx["text"].write_text("In the beginning God created the heaven and the earth. " * 40)
    # the experiment recipes' held-out text: another than their training text (the same one is warned about)
    fx["heldout"] = texts / "heldout.txt"
    fx["heldout"].write_text("And the earth was without form, and void. " * 40)
    fx["short"] = texts / "short.txt"
    fx["short"].write_text("Hi there.")
    fx["empty_txt"] = texts / "empty.txt"
    fx["empty_txt"].write_text("")
    fx["binary"] = texts / "bin.txt"
    fx["binary"].write_bytes(b"\x00\x01\x02binary" * 100)
    fx["latin1"] = texts / "latin1.txt"
    fx["latin1"].write_bytes("caf\xe9 ".encode("latin-1") * 50)
    fx["badjsonl"] = texts / "bad.jsonl"
    fx["badjsonl"].write_text('{"text": "ok"}\n{not json}\n')
    fx["nofield"] = texts / "nofield.jsonl"
    fx["nofield"].write_text('{"body": "some text here"}\n')
    fx["notxt"] = texts / "notxt"
    fx["notxt"].mkdir()
    (fx["notxt"] / "a.csv").write_text("x,y\n")
    fx["deep_json"] = texts / "deep.json"
    fx["deep_json"].write_bytes(deep)
    fx["deep_jsonl"] = texts / "deep.jsonl"
    fx["deep_jsonl"].write_bytes(b'{"text": "fine"}\n' + deep + b"\n")
    fx["recipe"] = ROOT / "recipes" / "ln2rms-kjv-gpt2.toml"
    fx["long_recipe"] = texts / "long.toml"  # found once the model is loaded
    fx["long_recipe"].write_text(f'name = "t"\narms = ["original"]\n[model]\npath = "{fx["gpt2"]}"\n[data]\n'
                                 f'train = "{fx["text"]}"\neval = "{fx["heldout"]}"\n[finetune]\nseq_len = 500\n')
    for arch in ("gpt2", "llama"):  # a tiny [model] recipe: refused before any arm runs, in seconds
        fx[f"{arch}_recipe"] = texts / f"{arch}.toml"
        fx[f"{arch}_recipe"].write_text(
            f'name = "t"\narms = ["original", "exact+ft"]\n[model]\npath = "{fx[arch]}"\n[data]\n'
            f'train = "{fx["text"]}"\neval = "{fx["heldout"]}"\n[finetune]\nseq_len = 16\nbatch_size = 2\n')
    fx["deep_recipe"] = texts / "deep.toml"  # tomllib recurses per level: a RecursionError, no TOMLDecodeError
    fx["deep_recipe"].write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    fx["bad_recipe"] = texts / "bad.toml"
    fx["bad_recipe"].write_text("this is = not [valid toml")
    return fx


def _deny(path: Path):
    from test_safety import _denied

    return _denied(path)


@contextlib.contextmanager
def _cuda(available: bool, interpreting: bool = False):
    """`normswap tune` as on a machine with (or without) a CUDA device, whatever this one has: the
    no-GPU cases must not start tuning on a GPU machine."""
    from unittest import mock

    import torch

    from normswap.kernels import _common

    with mock.patch.object(torch.cuda, "is_available", lambda: available), \
            mock.patch.object(_common, "interpreting", lambda kernel: interpreting):
        yield


def fixtures_stub() -> dict:
    """Placeholder paths: enough to list the cases (names, count) without building any model."""
    import collections

    return collections.defaultdict(lambda: Path("/nonexistent"), root=Path("/nonexistent"))


def cases(fx: dict) -> list[Case]:
    L, G, T = fx["llama"], fx["gpt2"], fx["text"]
    out = fx["root"] / "out"
    P = ["patch"]
    c = [
        # ---- scan
        Case("scan: no such path", ["scan", fx["root"] / "missing"], "no such file", ci=True),
        Case("scan: a file that is not .gguf", ["scan", T], "not .gguf", ci=True),
        Case("scan: empty directory", ["scan", fx["empty_dir"]], "no config.json", ci=True),
        Case("scan: malformed config.json", ["scan", fx["badjson"]], "malformed config.json", ci=True),
        Case("scan: config.json is a list", ["scan", fx["listjson"]], "config", ci=True),
        Case("scan: config.json is a directory", ["scan", fx["dirjson"]], "config.json: cannot read (Is a directory)",
             ci=True),
        Case("scan: num_hidden_layers -1", ["scan", fx["neg_layers"]], "num_hidden_layers is -1", ci=True),
        Case("scan: hidden_size 0", ["scan", fx["zero_hidden"]], "hidden_size is 0", ci=True),
        Case("scan: vocab_size 0", ["scan", fx["zero_vocab"]], "vocab_size is 0", ci=True),
        Case("scan: hidden_size 'big'", ["scan", fx["str_hidden"]], "expected int, got str", ci=True),
        Case("scan: NaN eps", ["scan", fx["nan_eps"]], "rms_norm_eps is nan", ci=True),
        Case("scan: negative kv heads", ["scan", fx["neg_kv"]], "num_key_value_heads is -2", ci=True),
        Case("scan: unknown model_type", ["scan", fx["unknown_type"]], "no_such_xyz", ci=True),
        Case("scan: unreadable directory", ["scan", fx["locked"]], "Permission denied", ci=True,
             setup=lambda: _deny(fx["locked"])),
        Case("scan: unreadable config.json", ["scan", fx["locked"]], "config.json: cannot read (Permission denied)", ci=True,
             setup=lambda: _deny(fx["locked"] / "config.json")),
        Case("scan: config.json not UTF-8", ["scan", fx["latin1json"]], "not UTF-8", ci=True),
        Case("scan: config.json nested too deeply", ["scan", fx["deep_user"]], "config.json: malformed config.json "
             "(nested too deeply", ci=True),
        Case("scan: num_hidden_layers 10**12", ["scan", fx["huge_layers"]], "normswap takes at most", ci=True),
        Case("scan: architectures a string", ["scan", fx["arch_str"]], "architectures is a str", ci=True),
        Case("scan: an unknown architectures name", ["scan", fx["unknown_arch"]],
             "architectures ['NoSuchForCausalLM']: transformers", ci=True),
        Case("scan: generation_config.json is a directory", ["scan", fx["dirgen"]],
             "generation_config.json: cannot read (Is a directory)", ci=True),
        Case("scan: a .gguf that is not one", ["scan", fx["badgguf"]], "model.gguf: a truncated or malformed GGUF file",
             ci=True),
        Case("scan: empty MODEL", ["scan", ""], "the model is empty", ci=True),
        Case("scan: a newline in the path", ["scan", fx["root"] / "two\nlines"], "two\\nlines: no such file",
             ci=True),
        Case("scan: not a hub id", ["scan", "a/b/c"], "no such file", ci=True),
        Case("scan: MODEL is a pipe", ["scan", fx["pipe"]], "not a regular file or folder", ci=True),
        Case("scan: hub id not cached", ["scan", "nobody-xyz/nothing-xyz"], "not in the local Hugging Face cache",
             ci=True),
        Case("scan: unknown option", ["scan", L, "--bogus"], "No such option", ci=True),
        # ---- patch: options and targets (checked before any load)
        Case("patch: unknown impl", [*P, L, "--impl", "nope"], "nope", ci=True),
        Case("patch: --out ''", [*P, L, "--impl", "torch", "--out", ""], "output directory is empty", ci=True),
        Case("patch: --out blank --force", [*P, L, "--impl", "torch", "--out", "   ", "--force"],
             "output directory is empty", ci=True),
        Case("patch: --force on a user directory", [*P, L, "--impl", "torch", "--out", fx["user_dir"], "--force"],
             "not a model checkpoint", ci=True),
        Case("patch: --out . --force in a checkpoint", [*P, L, "--impl", "torch", "--out", ".", "--force"],
             "current directory", ci=True, cwd=fx["done"]),
        Case("patch: --out .. --force", [*P, L, "--impl", "torch", "--out", "..", "--force"],
             "holds the current directory", ci=True, cwd=fx["done_sub"] / "sub"),
        Case("patch: --force onto a checkpoint holding a folder of its own",
             [*P, L, "--impl", "torch", "--out", fx["done_sub"], "--force"], "which the new output would not hold",
             ci=True),
        Case("patch: --out / --force", [*P, L, "--impl", "torch", "--out", "/", "--force"], "write elsewhere", ci=True),
        Case("patch: --out HOME --force", [*P, L, "--impl", "torch", "--out", Path.home(), "--force"], "refusing",
             ci=True),
        Case("patch: --force on a folder whose config.json nests too deeply",
             [*P, L, "--impl", "torch", "--out", fx["deep_user"], "--force"], "not a model checkpoint", ci=True),
        Case("patch: normswap.json nested too deeply", [*P, fx["deep_manifest"], "--impl", "torch"],
             "normswap.json: malformed manifest (nested too deeply", ci=True),
        Case("patch: existing --out without --force", [*P, L, "--impl", "torch", "--out", fx["done"]],
             "already exists; pass --force", ci=True),
        Case("patch: --out and --in-place", [*P, L, "--out", out, "--in-place"], "exclusive", ci=True),
        Case("patch: empty MODEL --in-place inside a checkpoint", [*P, "", "--impl", "torch", "--in-place"],
             "the model is empty", ci=True, cwd=fx["done"]),
        Case("patch: --in-place on a file", [*P, T, "--in-place"], "not .gguf", ci=True),
        Case("patch: --out is the model", [*P, L, "--impl", "torch", "--out", L, "--force"], "own directory", ci=True),
        Case("patch: --out a link to nothing", [*P, L, "--impl", "torch", "--out", fx["dangling"], "--force"],
             "is a link to nothing", ci=True),
        Case("patch: weights a link to an unfinished download", [*P, fx["partial"], "--impl", "torch"],
             "model.safetensors is a link to nothing", ci=True),
        Case("patch: --out holds the model", [*P, L, "--impl", "torch", "--out", fx["root"], "--force"],
             "contains the model", ci=True),
        Case("patch: --dtype fp8", [*P, L, "--dtype", "fp8"], "fp8", ci=True),
        Case("patch: --max-shard-size banana", [*P, L, "--impl", "torch", "--out", out, "--max-shard-size", "banana"],
             "--max-shard-size 'banana'", ci=True),
        Case("patch: --max-shard-size -5GB", [*P, L, "--impl", "torch", "--out", out, "--max-shard-size", "-5GB"],
             "--max-shard-size", ci=True),
        Case("patch: --only with a bad regex", [*P, L, "--impl", "torch", "--only", "["], "--only '['", ci=True),
        Case("patch: --only with a repeat count past re's limit", [*P, L, "--impl", "torch", "--only", "a{99999999999}"],
             "--only 'a{99999999999}': not a regular expression", ci=True),
        Case("patch: --exclude with a bad regex", [*P, L, "--impl", "torch", "--exclude", "(a"], "--exclude '(a'",
             ci=True),
        Case("patch: --device tpu", [*P, L, "--impl", "torch", "--device", "tpu"], "unknown device", ci=True),
        Case("patch: --eval missing file", [*P, L, "--impl", "torch", "--eval", fx["root"] / "nope.txt"],
             "no such file", ci=True),
        Case("patch: --eval empty file", [*P, L, "--impl", "torch", "--eval", fx["empty_txt"]], "empty", ci=True),
        Case("patch: --eval binary file", [*P, L, "--impl", "torch", "--eval", fx["binary"]], "binary", ci=True),
        Case("patch: --eval-max-length 0", [*P, L, "--impl", "torch", "--eval", T, "--eval-max-length", "0"],
             "--eval-max-length 0", ci=True),
        Case("patch: --eval-max-tokens 1", [*P, L, "--impl", "torch", "--eval", T, "--eval-max-tokens", "1"],
             "--eval-max-tokens 1", ci=True),
        Case("patch: --eval-max-length without --eval", [*P, L, "--impl", "torch", "--eval-max-length", "0"],
             "--eval-max-length only applies to --eval", ci=True),
        Case("patch: --eval-max-tokens without --eval", [*P, L, "--impl", "torch", "--eval-max-tokens", "64"],
             "--eval-max-tokens only applies to --eval", ci=True),
        # ---- patch: models that are broken (these load the tiny model)
        Case("patch: --only matches nothing", [*P, L, "--impl", "torch", "--only", "nothing_here"], "leave no"),
        Case("patch: config one layer short, --in-place", [*P, fx["fewer"], "--impl", "torch", "--in-place"],
             "no place for", ci=True),
        Case("patch: config one layer long, --out", [*P, fx["more"], "--impl", "torch", "--out", out],
             "missing from the checkpoint"),
        Case("patch: a size mismatch", [*P, fx["wide"], "--impl", "torch"], "(checkpoint [32, 48], config [32, 64])"),
        Case("patch: NaN in a norm weight", [*P, fx["nan_w"], "--impl", "torch"], "model.norm.weight holds", ci=True),
        Case("patch: Inf in a linear weight", [*P, fx["inf_w"], "--impl", "torch", "--json"], "up_proj.weight holds"),
        Case("patch: an unknown architectures name", [*P, fx["unknown_arch"], "--impl", "torch", "--out", out],
             "has no model class of that name", ci=True),
        Case("patch: malformed generation_config.json, --in-place", [*P, fx["badgen"], "--impl", "torch", "--in-place"],
             "malformed generation_config.json (Expecting", ci=True),
        Case("patch: a norm weight stored as I64, --in-place", [*P, fx["int_norm"], "--impl", "torch", "--in-place"],
             "model.norm.weight is stored as I64", ci=True),
        Case("patch: truncated safetensors", [*P, fx["trunc"], "--impl", "torch"], "cannot load the weights"),
        Case("patch: NaN eps (verification)", [*P, fx["nan_eps"], "--impl", "torch"], "rms_norm_eps is nan"),
        # ---- a deep new --out (out/a/b/c): a failure after the folders were made removes them
        Case("patch: unreadable tokenizer.json, deep new --out",
             [*P, fx["locked"], "--impl", "torch", "--out", out / "a" / "b" / "c"], "tokenizer.json: Permission denied",
             ci=True, setup=lambda: _deny(fx["locked"] / "tokenizer.json")),
        Case("convert: --out through a link to nothing", ["convert", G, "--to", "rms", "--out", fx["dangling"] / "c"],
             "a link to nothing", ci=True),
        Case("convert: a LayerNorm gain longer than the config gives",
             ["convert", fx["long_gain"], "--to", "rms", "--out", out / "c"], "of another shape than the config gives",
             ci=True),
        Case("convert: truncated safetensors, deep new --out",
             ["convert", fx["trunc_gpt2"], "--to", "rms", "--out", out / "a" / "b" / "c"], "unreadable safetensors",
             ci=True),
        Case("experiment: seq_len past the context, deep new --out",
             ["experiment", fx["long_recipe"], "--out", out / "a" / "b" / "c"], "exceeds the model's context", ci=True),
        # ---- ppl / diff
        Case("ppl: --data missing", ["ppl", L], "--data", ci=True),
        Case("ppl: BERT (no language-model head)", ["ppl", fx["bert"], "--data", T], "has no language-model head",
             ci=True),
        Case("ppl: an unknown architectures name", ["ppl", fx["unknown_arch"], "--data", T],
             "has no model class of that name", ci=True),
        Case("ppl: --data no such file", ["ppl", L, "--data", fx["root"] / "none.txt"], "no such file", ci=True),
        Case("ppl: --max-length 1", ["ppl", L, "--data", T, "--max-length", "1"], "--max-length 1", ci=True),
        Case("ppl: --max-length abc", ["ppl", L, "--data", T, "--max-length", "abc"], "abc", ci=True),
        Case("ppl: --stride 0", ["ppl", L, "--data", T, "--stride", "0"], "--stride 0", ci=True),
        Case("ppl: --stride > --max-length", ["ppl", L, "--data", T, "--max-length", "8", "--stride", "9"],
             "larger than --max-length", ci=True),
        Case("ppl: --batch-size 0", ["ppl", L, "--data", T, "--batch-size", "0"], "--batch-size 0", ci=True),
        Case("ppl: --max-tokens 1", ["ppl", L, "--data", T, "--max-tokens", "1"], "--max-tokens 1", ci=True),
        Case("ppl: latin-1 text", ["ppl", L, "--data", fx["latin1"]], "not UTF-8", ci=True),
        Case("ppl: --data ''", ["ppl", L, "--data", ""], "the data path is empty", ci=True, cwd=fx["text"].parent),
        Case("ppl: --max-tokens 10**23", ["ppl", L, "--data", T, "--max-tokens", str(10**23)],
             "more tokens than any text holds", ci=True),
        Case("ppl: jsonl with a bad row", ["ppl", L, "--data", fx["badjsonl"]], "not valid JSON"),
        Case("ppl: jsonl row nested too deeply", ["ppl", L, "--data", fx["deep_jsonl"]],
             "deep.jsonl:2: not valid JSON (nested too deeply", ci=True),
        Case("ppl: tokenizer.json nested too deeply", ["ppl", fx["deep_tokenizer"], "--data", T],
             "tokenizer.json: malformed tokenizer.json (nested too deeply", ci=True),
        Case("ppl: tokenizer_config.json not UTF-8", ["ppl", fx["latin1_tokcfg"], "--data", T],
             "tokenizer_config.json: malformed tokenizer_config.json (not UTF-8: invalid byte at offset 13)", ci=True),
        Case("ppl: sharded index nested too deeply", ["ppl", fx["deep_index_llama"], "--data", T],
             "model.safetensors.index.json: malformed model.safetensors.index.json (nested too deeply", ci=True),
        Case("ppl: jsonl without the field", ["ppl", L, "--data", fx["nofield"]], "--text-field"),
        Case("ppl: directory without .txt", ["ppl", L, "--data", fx["notxt"]], "no .txt files", ci=True),
        Case("ppl: text shorter than the window", ["ppl", L, "--data", fx["short"], "--max-length", "32"],
             "shorter than one window"),
        Case("ppl: unreadable text", ["ppl", L, "--data", T], "Permission denied",
             setup=lambda: _deny(T)),
        Case("ppl: a Linear weight stored as I32", ["ppl", fx["int_linear"], "--data", T],
             "up_proj.weight is stored as I32", ci=True),
        Case("ppl: config disagrees with weights", ["ppl", fx["more"], "--data", T, "--max-length", "16"],
             "missing from the checkpoint"),
        Case("diff: neither B nor --patched", ["diff", L, "--data", T], "exactly one", ci=True),
        Case("diff: both B and --patched", ["diff", L, L, "--patched", "torch", "--data", T], "exactly one", ci=True),
        Case("diff: --patched nope", ["diff", L, "--patched", "nope", "--data", T], "nope", ci=True),
        Case("diff: B missing", ["diff", L, fx["root"] / "missing", "--data", T], "no such file", ci=True),
        Case("ppl: special_tokens_map.json not JSON", ["ppl", fx["bad_special"], "--data", T],
             "special_tokens_map.json: malformed special_tokens_map.json (Expecting value", ci=True),
        Case("patch: sharded index nested too deeply", [*P, fx["deep_index_llama"], "--impl", "torch"],
             "model.safetensors.index.json: malformed model.safetensors.index.json (nested too deeply", ci=True),
        Case("diff: B with an unknown architectures name", ["diff", L, fx["unknown_arch"], "--data", T],
             "unknown_arch/config.json: architectures ['NoSuchForCausalLM']", ci=True),
        Case("diff: --stride -1", ["diff", L, "--patched", "torch", "--data", T, "--stride", "-1"], "--stride -1",
             ci=True),
        # ---- convert
        Case("convert: a model without LayerNorm", ["convert", L, "--to", "rms", "--out", out], "nothing to convert",
             report=True),
        Case("convert: --to foo", ["convert", G, "--to", "foo", "--out", out], "foo", ci=True),
        Case("convert: --out missing", ["convert", G, "--to", "rms"], "--out", ci=True),
        Case("convert: --out ''", ["convert", G, "--to", "rms", "--out", ""], "output directory is empty", ci=True),
        Case("convert: --force on a user directory", ["convert", G, "--to", "rms", "--out", fx["user_dir"], "--force"],
             "not a model checkpoint", ci=True),
        Case("convert: --out is the model", ["convert", G, "--to", "rms", "--out", G, "--force"], "own directory",
             ci=True),
        Case("convert: post-LN BERT", ["convert", fx["bert"], "--to", "rms", "--out", out, "--json"], "nothing converts",
             report=True),
        Case("convert: generation_config.json nested too deeply", ["convert", fx["deepgen"], "--to", "rms", "--out", out],
             "malformed generation_config.json (nested too deeply: more than 100 levels)", ci=True),
        Case("convert: normswap.json nested too deeply", ["convert", fx["deep_manifest_gpt2"], "--to", "rms", "--out",
                                                         out], "normswap.json: malformed manifest (nested too deeply",
             ci=True),
        Case("convert: safetensors index nested too deeply", ["convert", fx["deep_index"], "--to", "rms", "--out", out],
             "model.safetensors.index.json: malformed index (nested too deeply", ci=True),
        Case("convert: safetensors header nested too deeply", ["convert", fx["deep_header"], "--to", "rms", "--out",
                                                               out], "not a safetensors file (unreadable header: "
             "nested too deeply", ci=True),
        Case("convert: a LayerNorm weight stored as BOOL", ["convert", fx["bool_gpt2"], "--to", "rms", "--out", out],
             "ln_1.weight is stored as BOOL", ci=True),
        Case("convert: an unknown architectures name", ["convert", fx["unknown_arch"], "--to", "rms", "--out", out],
             "has no model class of that name", ci=True),
        Case("convert: NaN in a LayerNorm weight", ["convert", fx["nan_gpt2"], "--to", "rms", "--out", out],
             "ln_1.weight holds"),
        # ---- demo, bench, experiment, the group
        Case("demo: --max-tokens -5", ["demo", "--max-tokens", "-5"], "--max-tokens -5", ci=True),
        Case("demo: --max-tokens x", ["demo", "--max-tokens", "x"], "'x'", ci=True),
        Case("demo: --impl nope", ["demo", "--impl", "nope"], "--impl", ci=True),
        Case("bench: --batch 0", ["bench", L, "--batch", "0", "--impls", "torch"], "batch", ci=True),
        Case("bench: --seq -1", ["bench", L, "--seq", "-1", "--impls", "torch"], "seq", ci=True),
        Case("bench: --modes nonsense", ["bench", L, "--modes", "nonsense", "--impls", "torch"], "nonsense", ci=True),
        Case("bench: --modes ','", ["bench", L, "--modes", ",", "--impls", "torch"], "--modes names no workload", ci=True),
        Case("bench: --impls nope", ["bench", L, "--impls", "nope"], "nope", ci=True),
        Case("bench: --out is the model's config.json", ["bench", L, "--impls", "torch", "--modes", "prefill", "--seq",
                                                         "4", "--out", L / "config.json"],
             "is not a normswap bench result", ci=True),
        Case("bench: --out nested too deeply", ["bench", L, "--impls", "torch", "--modes", "prefill", "--seq", "4",
                                                "--out", fx["deep_json"]], "is not a normswap bench result", ci=True),
        Case("bench: --seq past GPT-2's positions", ["bench", G, "--impls", "torch", "--modes", "prefill", "--seq",
                                                     "100", "--out", out / "b.json"], "the model's context is 64",
             ci=True),
        Case("bench: --batch 10**23", ["bench", L, "--impls", "torch", "--modes", "prefill", "--seq", "4", "--batch",
                                       str(10**23), "--out", out / "b.json"], "cannot allocate", ci=True),
        Case("bench: an unknown architectures name", ["bench", fx["unknown_arch"], "--impls", "torch", "--modes", "prefill",
                                                      "--seq", "4", "--out", out / "b.json"],
             "has no model class of that name", ci=True),
        Case("bench: --out a named pipe", ["bench", L, "--impls", "torch", "--modes", "prefill", "--seq", "4",
                                           "--out", fx["pipe"]], "it is not a regular file (a pipe, socket or device)",
             ci=True),
        Case("bench: --repeats 0", ["bench", L, "--repeats", "0", "--impls", "torch"], "repeats", ci=True),
        # --seq past G's 64 positions: a cap that stopped working fails the case at once (the context
        # check comes after the count checks) instead of timing for years
        Case("bench: --repeats 10**9 (a typo: years of timing)", ["bench", G, "--repeats", str(10**9), "--impls",
                                                                  "torch", "--seq", "100"],
             "--repeats 1000000000: at most 10,000", ci=True),
        Case("bench: --load-weights, config one layer long", ["bench", fx["more"], "--load-weights", "--impls", "torch",
                                                              "--modes", "prefill", "--seq", "4", "--out", out / "b.json"],
             "missing from the checkpoint", ci=True),
        Case("bench: --load-weights, a size mismatch", ["bench", fx["wide"], "--load-weights", "--impls", "torch",
                                                        "--modes", "prefill", "--seq", "4", "--out", out / "b.json"],
             "(checkpoint [32, 48], config [32, 64])", ci=True),
        Case("experiment: no such recipe", ["experiment", fx["root"] / "none.toml"], "none.toml", ci=True),
        Case("experiment: the recipe is /dev/zero", ["experiment", "/dev/zero"], "/dev/zero: more than 1 MiB, not a recipe",
             ci=True),
        Case("experiment: invalid TOML", ["experiment", fx["bad_recipe"]], "bad.toml", ci=True),
        Case("experiment: a recipe nested too deeply", ["experiment", fx["deep_recipe"], "--out", out / "x"],
             "deep.toml: not valid TOML (nested too deeply)", ci=True),
        Case("experiment: --set a value nested too deeply",
             ["experiment", fx["gpt2_recipe"], "--set", "seed=" + "[" * 100_000 + "]" * 100_000, "--out", out / "x"],
             "--set seed: the value is nested too deeply", ci=True),
        Case("experiment: --set without =", ["experiment", fx["recipe"], "--set", "garbage"], "garbage", ci=True),
        Case("experiment: --out's recipe.json nested too deeply", ["experiment", fx["recipe"], "--out", fx["deep_run"]],
             "recipe.json: malformed JSON (nested too deeply", ci=True),
        Case("experiment: --arms ','", ["experiment", fx["recipe"], "--arms", ","], "--arms", ci=True),
        Case("experiment: --arms nope", ["experiment", fx["recipe"], "--arms", "nope"], "--arms: unknown arm 'nope'",
             ci=True),
        Case("experiment: --out ''", ["experiment", fx["gpt2_recipe"], "--out", ""], "the output folder is empty",
             ci=True, cwd=fx["user_dir"]),
        Case("experiment: --arms names one twice", ["experiment", fx["gpt2_recipe"], "--arms", "exact,original,exact",
                                                   "--out", out / "x"],
             "--arms: exact named twice", ci=True),
        Case("experiment: --set a typo'd key", ["experiment", fx["gpt2_recipe"], "--set", "finetune.stepz=3", "--out", out / "x"],
             "did you mean 'steps'?", ci=True),
        Case("experiment: --set two values in one", ["experiment", fx["gpt2_recipe"], "--set", "finetune.lr=1e-3\nseed=5",
                                                    "--out", out / "x"],
             "is not one TOML value", ci=True),
        Case("experiment: --set a string for an int", ["experiment", fx["gpt2_recipe"], "--set", "finetune.steps='5'",
                                                      "--out", out / "x"],
             "finetune.steps: expected an integer, got '5'", ci=True),
        Case("experiment: --set seed -1", ["experiment", fx["gpt2_recipe"], "--set", "seed=-1", "--out", out / "x"],
             "seed: -1 is below the minimum 0", ci=True),
        Case("experiment: --set a list for a table", ["experiment", fx["gpt2_recipe"], "--set", "data=[1]", "--out", out / "x"],
             "data: expected a table", ci=True),
        Case("experiment: a binary data.train, deep new --out",
             ["experiment", fx["gpt2_recipe"], "--set", f"data.train={fx['binary']}", "--out", out / "a" / "b" / "c"],
             "data.train: ", ci=True),
        Case("experiment: a Latin-1 data.eval", ["experiment", fx["gpt2_recipe"], "--set", f"data.eval={fx['latin1']}",
                                                 "--out", out / "x"], "data.eval: ", ci=True),
        Case("experiment: data.train shorter than one sequence",
             ["experiment", fx["gpt2_recipe"], "--set", f"data.train={fx['short']}", "--out", out / "x"],
             "data.train: the training text has", ci=True),
        Case("experiment: data.eval_max_tokens under one window",  # named by its recipe key, not max_tokens
             ["experiment", fx["gpt2_recipe"], "--set", "data.eval_max_tokens=20", "--out", out / "x"],
             "data.eval_max_tokens 20 is shorter than one window", ci=True),
        Case("experiment: finetune.batch_size 10**15",
             ["experiment", fx["gpt2_recipe"], "--set", f"finetune.batch_size={10**15}", "--out", out / "x"],
             "cannot allocate it", ci=True),
        Case("experiment: an approx arm, a model with no LayerNorm",
             ["experiment", fx["llama_recipe"], "--arms", "original,approx", "--out", out / "x"],
             "approx: the model has no LayerNorm", ci=True),
        Case("experiment: an exact arm, a model with no LayerNorm",
             ["experiment", fx["llama_recipe"], "--out", out / "x"], "this llama model has no LayerNorm", ci=True),
        Case("experiment: [model] BERT (no language-model head)",
             ["experiment", fx["gpt2_recipe"], "--set", f"model.path={fx['bert']}", "--arms", "original",
              "--out", out / "x"], "BertModel has no language-model head", ci=True),
        Case("experiment: [model] a GGUF that is not one",
             ["experiment", fx["gpt2_recipe"], "--set", f"model.path={fx['badgguf']}", "--out", out / "x"],
             "GGUF", ci=True),
        # ---- tune (--out inside out/: the sweep fails a case that writes there)
        Case("tune: no CUDA device", ["tune", "--out", out / "t.json"], "tuning needs a CUDA device", ci=True,
             setup=lambda: _cuda(False)),
        Case("tune: TRITON_INTERPRET on a GPU machine", ["tune", "--out", out / "t.json"], "TRITON_INTERPRET is set",
             ci=True, setup=lambda: _cuda(True, interpreting=True)),
        Case("tune: --ops nope", ["tune", "--ops", "rms_norm,nope", "--out", out / "t.json"], "--ops: unknown 'nope'",
             ci=True, setup=lambda: _cuda(False)),
        Case("tune: --hidden x", ["tune", "--hidden", "4096,x", "--out", out / "t.json"], "--hidden: 'x'", ci=True),
        Case("tune: --hidden 0", ["tune", "--hidden", "0", "--out", out / "t.json"], "--hidden: 0 is outside", ci=True),
        Case("tune: --budget -1", ["tune", "--budget", "-1", "--out", out / "t.json"], "--budget must be a positive",
             ci=True),
        Case("tune: --dtypes fp64", ["tune", "--dtypes", "fp64", "--out", out / "t.json"], "--dtypes: unknown 'fp64'",
             ci=True),
        Case("tune: --out is not a launch table", ["tune", "--out", T], "is not a valid launch table", ci=True),
        Case("tune: --out ''", ["tune", "--out", ""], "the output file is empty", ci=True, cwd=fx["user_dir"]),
        Case("tune: --out nested too deeply", ["tune", "--out", fx["deep_json"]], "nested too deeply", ci=True),
        Case("tune: --out a named pipe", ["tune", "--out", fx["pipe"]], "it is not a regular file (a pipe, socket",
             ci=True),
        Case("tune: --out is a directory", ["tune", "--out", fx["root"] / "llama"], "is a directory", ci=True),
        Case("normswap: unknown command", ["nosuchcommand"], "No such command", ci=True),
    ]
    return c


def run_case(case: Case, inputs: list[Path]) -> Outcome:
    from click.testing import CliRunner

    from normswap.cli import cli

    before = {d: _checksum(d) for d in inputs}
    cwd = os.getcwd()
    try:
        if case.cwd is not None:
            os.chdir(case.cwd)
        with case.setup() if case.setup else contextlib.nullcontext():
            r = CliRunner().invoke(cli, [str(a) for a in case.args])
    finally:
        os.chdir(cwd)
    o = Outcome(case, r.exit_code)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        o.problems.append(f"raised {type(r.exception).__name__}: {r.exception}")
    if r.exit_code != case.code:
        o.problems.append(f"exit {r.exit_code}, want {case.code}")
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("normswap:")]
    o.error_line = lines[0] if lines else ""
    if len(lines) != 1:
        o.problems.append(f"{len(lines)} 'normswap:' lines on stderr")
    elif not lines[0].startswith("normswap: error:"):
        o.problems.append(f"not a bad-input line: {lines[0][:120]}")
    elif case.says and case.says not in lines[0]:
        o.problems.append(f"the line does not say {case.says!r}")
    # Beside our line only normswap's own progress may stand (stderr by design, README contract),
    # never a library's log lines: transformers' config warnings come as "[transformers] ...".
    others = [ln for ln in r.stderr.splitlines() if re.match(r"\[\w[\w.-]*\] ", ln)]
    if others:
        o.problems.append(f"{len(others)} other line(s) on stderr: {others[0][:120]}")
    if "Traceback" in r.stderr:
        o.problems.append("traceback on stderr")
    if any("Warning" in ln or "warnings.warn" in ln for ln in r.stderr.splitlines()):
        o.problems.append("a warning on stderr")
    if r.stdout.strip():
        if not case.report:
            o.problems.append("stdout is not empty")
        elif "--json" in map(str, case.args):
            try:
                json.loads(r.stdout)
            except ValueError:
                o.problems.append("stdout is not one JSON document")
    for d, digest in before.items():
        if _checksum(d) != digest:
            o.problems.append(f"{d.name} changed")
    return o


def sweep(root: Path, only: str | None = None, ci_only: bool = False) -> list[Outcome]:
    fx = fixtures(root)
    inputs = [p for p in root.iterdir() if p.is_dir()]
    chosen = [c for c in cases(fx) if (not ci_only or c.ci) and (only is None or only in c.name)]
    outcomes = []
    for case in chosen:
        outcomes.append(run_case(case, inputs))
        out = root / "out"
        if out.exists():
            outcomes[-1].problems.append("out was written")
            shutil.rmtree(out)
    return outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="Run the cases whose name contains this.")
    ap.add_argument("--ci", action="store_true", help="Only the cases the test suite runs.")
    ap.add_argument("--json", action="store_true", help="One JSON document on stdout.")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = sweep(Path(tmp), args.only, args.ci)
    clean = sum(o.clean for o in outcomes)
    rows = [{"case": o.case.name, "exit": o.exit_code, "clean": o.clean, "problems": o.problems,
             "line": o.error_line} for o in outcomes]
    commands = sorted({str(o.case.args[0]) for o in outcomes})
    if args.json:
        print(json.dumps({"cases": len(outcomes), "clean": clean, "defects": len(outcomes) - clean,
                          "commands": commands, "rows": rows}, indent=2))
    else:
        for r in rows:
            mark = "ok  " if r["clean"] else "FAIL"
            print(f"{mark} {r['case']:<45} exit {r['exit']}  {r['line'][:110]}")
            for p in r["problems"]:
                print(f"       - {p}")
        print(f"\n{len(outcomes)} bad inputs across {len(commands)} commands ({', '.join(commands)}): "
              f"{clean} clean, {len(outcomes) - clean} defects")
    sys.exit(0 if clean == len(outcomes) else 1)


if __name__ == "__main__":
    main()
