"""What a new model folder carries over from its source: `normswap patch --out` and `normswap
convert` follow one rule (normswap/carry.py). They used to follow two: convert copied the top
level's regular files only (hidden ones, .onnx exports and a stale pytorch_model.bin.index.json
included, custom-code subfolders not) and, from a pickled or GGUF checkpoint, nothing but the
tokenizer; patch copied subfolders too and left hidden entries and every weight-like file out."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_models import save_tiny

from normswap.carry import WEIGHT_SUFFIXES, carry_over
from normswap.cli import cli

# What the writers write themselves (weights, config, manifest); the rest of an output is carried.
WRITTEN = {"model.safetensors", "config.json", "generation_config.json", "normswap.json"}


pytestmark = pytest.mark.usefixtures("small_probes")


def _source(root, weights: str, seed: int):
    """A tiny GPT-2 (which both commands take) among the files real model folders hold, a few of
    them with random names and sizes, plus everything the rule leaves out. Returns the folder and
    the relative paths the rule carries."""
    rng = random.Random(seed)
    src = root / "models" / "m"
    model = save_tiny("gpt2", src)
    if weights == "bin":  # the in-memory path of convert (GGUF takes it too)
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, src / "pytorch_model.bin")
        (src / "model.safetensors").unlink()
    carried = {"tokenizer.json", "tokenizer_config.json"}

    def put(rel, data: bytes, kept: bool):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
        if kept:
            carried.add(rel)

    for rel in ("README.md", "LICENSE", "chat_template.jinja", "special_tokens_map.json", "code/modeling_x.py",
                "code/sub/helpers.py", "original/params.json", "original/tokenizer.model"):
        put(rel, rng.randbytes(rng.randrange(1, 300)), kept=True)
    # a sentence-transformers pipeline: 2_Dense/ is a model of its own (its config.json), weights and all
    for rel in ("modules.json", "2_Dense/config.json", "2_Dense/model.safetensors", "2_Dense/pytorch_model.bin"):
        put(rel, rng.randbytes(rng.randrange(1, 300)), kept=True)
    for _ in range(4):  # names nobody planned for, large and small
        put(f"{rng.choice(['notes', 'eval', 'data', 'x'])}{rng.randrange(10**6)}.{rng.choice(['txt', 'csv', 'dat'])}",
            rng.randbytes(rng.choice([0, 17, 1 << 20])), kept=True)
    for rel in (".gitattributes", ".cache/huggingface/download/model.safetensors.metadata", "code/.DS_Store",
                "training_args.bin", "optimizer.pt", "model.onnx", "original/consolidated.00.pth",
                "pytorch_model.bin.index.json", "tf_model.h5"):
        put(rel, b"{}", kept=False)
    (root / "blob").write_text("a hub cache's files are links to blobs")
    (src / "merges_link.txt").symlink_to(root / "blob")
    carried.add("merges_link.txt")
    (root / "shared").mkdir()
    (root / "shared" / "prompts.txt").write_text("shared")
    (src / "prompts").symlink_to(root / "shared")  # a folder outside the model: carried as a link
    carried.add("prompts")
    (src / "self").symlink_to(src)  # a loop: followed, it copies the folder into itself
    (src / "code" / "up").symlink_to("../..")  # a loop from inside a subfolder
    (root / "shared" / "back").symlink_to(root / "shared")  # a loop outside the model
    (src / "gone").symlink_to(root / "nothing")
    (src / "code" / "gone").symlink_to(root / "nothing")
    os.mkfifo(src / "progress.pipe")
    os.mkfifo(src / "code" / "progress.pipe")  # copytree read it: the copy blocked forever
    carried |= {"code", "code/sub", "original", "2_Dense"}
    return src, carried


def _tree(d) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_patch_out_and_convert_carry_the_same_files(tmp_path, weights):
    src, carried = _source(tmp_path, weights, seed=len(weights))
    outs = {}
    for name, args in (("convert", ["convert", src, "--to", "rms", "--out", tmp_path / "conv"]),
                       ("patch", ["patch", src, "--impl", "torch", "--out", tmp_path / "pat"])):
        r = CliRunner().invoke(cli, [str(a) for a in args])
        assert r.exit_code == 0, r.output
        outs[name] = _tree(args[-1])
    assert outs["convert"] == outs["patch"]
    assert outs["patch"] - WRITTEN == carried
    for rel in ("original/params.json", "2_Dense/model.safetensors"):
        assert (tmp_path / "pat" / rel).read_bytes() == (src / rel).read_bytes()
    assert not (tmp_path / "conv" / "merges_link.txt").is_symlink()  # a link is carried as its content
    assert os.readlink(tmp_path / "conv" / "prompts") == str(tmp_path / "shared")  # ... but not a folder outside


@pytest.mark.parametrize("command", ["patch", "convert"])
def test_a_link_to_a_folder_outside_the_model_is_carried_as_a_link(tmp_path, command):
    """A link in the model folder to a folder outside it (a dataset, a shared folder, a home
    folder) was followed and the whole tree it led to copied into the output: a model's output
    grew by whatever the link reached. It is carried as a link to the same place, with a warning
    naming it, at any depth, also in a subfolder carried whole (2_Dense/); a link to a file
    outside is still carried as its content (a hub cache's files are links into blobs/), and a
    link to a folder inside the model as its content too. Replacing the output with --force
    removes the links, never what they lead to."""
    src = tmp_path / "m"
    save_tiny("gpt2", src)
    data = tmp_path / "datasets"
    for i in range(3):
        (data / f"part{i}").mkdir(parents=True)
        (data / f"part{i}" / "shard.txt").write_bytes(os.urandom(1 << 16))
    (tmp_path / "blob").write_text("a file outside")
    (src / "code").mkdir()
    (src / "code" / "tok").mkdir()
    (src / "code" / "tok" / "vocab.txt").write_text("inside")
    (src / "2_Dense").mkdir()
    (src / "2_Dense" / "config.json").write_text("{}")
    links = {"data": data, "code/part1": Path("../../datasets/part1"), "2_Dense/ds": data / "part2"}
    for rel, to in links.items():
        (src / rel).symlink_to(to)
    (src / "code" / "tok_again").symlink_to("tok")  # inside the model: its content
    (src / "notes.txt").symlink_to(tmp_path / "blob")  # a file outside: its content
    before = {str(p.relative_to(data)): p.read_bytes() for p in data.rglob("*") if p.is_file()}
    out = tmp_path / "out"
    args = ["patch", src, "--impl", "torch"] if command == "patch" else ["convert", src, "--to", "rms"]
    for force in ([], ["--force"]):
        r = CliRunner().invoke(cli, [str(a) for a in (*args, "--out", out, *force)])
        assert r.exit_code == 0, r.output
        for rel in links:
            assert os.readlink(out / rel) == str((src / rel).resolve())
            assert f"normswap: warning: {src / rel} leads to a folder outside the model folder" in r.stderr
        assert r.stderr.count("normswap: warning:") == len(links)
        assert not any(p.name == "shard.txt" for p in out.rglob("*")), sorted(_tree(out))
        assert (out / "code" / "tok_again" / "vocab.txt").read_text() == "inside"
        assert not (out / "code" / "tok_again").is_symlink()
        assert (out / "notes.txt").read_text() == "a file outside" and not (out / "notes.txt").is_symlink()
        assert {str(p.relative_to(data)): p.read_bytes() for p in data.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("command,where", [("patch", "fast"), ("convert", "runs/fast")])
def test_an_out_inside_the_model_folder_is_not_carried_into_itself(tmp_path, monkeypatch, command, where):
    """`cd model && normswap patch . --out fast`, run again with --force: the earlier result (a
    subfolder with a config.json, carried whole as another model) was copied into the new one, one
    level deeper each run (fast/fast/fast/...), and the model folder grew by a model every time."""
    src = tmp_path / "m"
    save_tiny("gpt2", src)
    (src / "runs").mkdir()
    (src / "runs" / "notes.txt").write_text("the user's")
    monkeypatch.chdir(src)
    args = ["patch", ".", "--impl", "torch"] if command == "patch" else ["convert", ".", "--to", "rms"]
    for _ in range(2):
        r = CliRunner().invoke(cli, [*args, "--out", where, "--force"])
        assert r.exit_code == 0, r.output
    out = src / where
    assert (out / "config.json").is_file() and (out / "normswap.json").is_file()
    assert not any(p.name == "fast" for p in out.rglob("*")), sorted(_tree(out))
    # what else the folder holds is still carried
    assert (out / "tokenizer.json").is_file()
    assert where == "runs/fast" or (out / "runs" / "notes.txt").read_text() == "the user's"


@pytest.mark.parametrize("command", ["patch", "convert"])
def test_an_earlier_output_inside_the_model_folder_is_not_carried(tmp_path, monkeypatch, command):
    """`normswap patch . --out fast`, then `--out fast2`: fast (a subfolder with a config.json,
    carried whole as another model) was copied into fast2, weights and all, and a third output
    held both: each run grew the model folder by every earlier result. An earlier output (its
    normswap.json beside its config.json) is left behind, at any depth; a model's own subfolder
    with a config.json (2_Dense/) is still carried."""
    src = tmp_path / "m"
    save_tiny("gpt2", src)
    (src / "2_Dense").mkdir()
    (src / "2_Dense" / "config.json").write_text("{}")
    monkeypatch.chdir(src)
    args = ["patch", ".", "--impl", "torch"] if command == "patch" else ["convert", ".", "--to", "rms"]
    for where in ("fast", "runs/fast", "fast2"):
        r = CliRunner().invoke(cli, [*args, "--out", where])
        assert r.exit_code == 0, r.output
    out = src / "fast2"
    assert (out / "normswap.json").is_file() and (out / "2_Dense" / "config.json").is_file()
    assert not (out / "fast").exists(), sorted(_tree(out))
    assert [p for p in out.rglob("normswap.json") if p.parent != out] == [], sorted(_tree(out))
    # A link to an earlier output is judged by where it leads: inside the model, left behind as
    # the output itself; outside it, a folder outside the model, carried as the link (with the
    # warning), as before the earlier-output rule
    r = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "elsewhere")])
    assert r.exit_code == 0, r.output
    (src / "latest").symlink_to("fast")
    (src / "shared").symlink_to(tmp_path / "elsewhere")
    r = CliRunner().invoke(cli, [*args, "--out", "fast3"])
    assert r.exit_code == 0, r.output
    assert not os.path.lexists(src / "fast3" / "latest"), sorted(_tree(src / "fast3"))
    assert os.readlink(src / "fast3" / "shared") == str(tmp_path / "elsewhere")


def test_in_place_keeps_every_entry_but_the_stock_weights(tmp_path):
    """--in-place shares the module with --out but keeps the user's folder as it is: hidden
    entries, weight-like files that are not stock weights, links as links, pipes."""
    src, _ = _source(tmp_path, "safetensors", seed=3)
    out = tmp_path / ".staging"
    out.mkdir()
    carried = carry_over(src, out, in_place=True)
    replaced = {"model.safetensors", "tf_model.h5", "pytorch_model.bin.index.json", "config.json"}
    assert sorted(carried) == sorted(set(os.listdir(src)) - replaced) == sorted(os.listdir(out))
    assert os.readlink(out / "self") == str(src) and (out / "progress.pipe").exists()
    assert (out / ".cache" / "huggingface").is_dir() and (out / "original" / "consolidated.00.pth").is_file()


def test_the_readme_names_every_weight_suffix_left_behind():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    said = readme.split("left behind are", 1)[1].split("with their indexes", 1)[0]
    assert sorted(WEIGHT_SUFFIXES) == sorted(f".{s}" for s in re.findall(r"`\.(\w+)`", said))
