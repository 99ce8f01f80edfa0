"""Saving a patched model: stock checkpoint + normswap.json, reload checks, never a broken target."""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
import torch
from tiny_models import ARCHS, save_tiny, tiny_model

from normswap import checkpoint
from normswap.carry import carry_over
from normswap.errors import NormswapError
from normswap.loading import load, load_model, model_class, resolve
from normswap.manifest import MANIFEST_NAME, read_manifest
from normswap.modules import NormswapNorm
from normswap.swap import patch
from normswap.verify import ProbeConfig, model_output, probe_batch

# These tests are about saving; the numeric proof is tested in test_swap/test_verify. The torch
# backend matches the families bit for bit or nearly, so a small probe suffices here.
SMALL = ProbeConfig(elements=4096)


def _stock_output(directory, dtype, batch):
    from transformers import AutoConfig

    cls = model_class(AutoConfig.from_pretrained(directory))
    return model_output(cls.from_pretrained(directory, dtype=dtype).eval(), batch)[1]


def _leftovers(parent):
    return [p for p in os.listdir(parent) if p.startswith(".")]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_save_stock_reload_and_normswap_load(arch, tmp_path):
    dtype = torch.bfloat16 if arch in ("llama", "gemma3_text", "gpt2") else torch.float32
    src = tmp_path / "src"
    original = save_tiny(arch, src, dtype)
    batch = probe_batch(original)
    # the reference is the source checkpoint as stock transformers loads it (a model cast with
    # .to(bf16) in memory differs: its rotary buffers were cast too)
    want = _stock_output(src, dtype, batch)

    source = resolve(src)
    model = load_model(source, dtype=dtype)
    keys = sorted(model.state_dict())
    report = patch(model, "torch", probe=SMALL)
    out = checkpoint.save_patched(model, report, tmp_path / "out", source=source)

    # stock transformers: original classes, original keys, equal logits (bit for bit)
    assert torch.equal(_stock_output(out, dtype, batch), want)
    from safetensors import safe_open

    def saved(d):
        with safe_open(d / "model.safetensors", "pt") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}

    assert saved(out) == saved(src)  # the same tensors, names and dtypes as a stock save
    assert keys == sorted(model.state_dict())
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (out / "tokenizer.json").is_file()  # carried over from the source

    whole = read_manifest(out)
    assert whole["format"] == "normswap/2" and whole["normswap_version"] and "convert" not in whole
    # the top-level keys the manifest module's docstring documents (3181104 renamed "updated" by mistake)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", whole["updated"]) and "created" not in whole
    m = whole["patch"]
    assert m["impl"] == "torch"
    assert [e["path"] for e in m["modules"]] == [e.path for e in report.patched]
    assert all(e["verification"]["passed"] for e in m["modules"])

    # normswap.load re-applies the patch from the manifest
    again = load(out, impl="reference")
    patched = [p for p, mod in again.named_modules() if isinstance(mod, NormswapNorm)]
    assert patched == [e.path for e in report.patched]
    got = model_output(again, batch)[1]
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    assert not _leftovers(tmp_path)


def test_triton_patch_saves_and_reloads(tmp_path):
    src = tmp_path / "src"
    original = save_tiny("qwen3", src)
    batch = probe_batch(original)
    source = resolve(src)
    model = load_model(source)
    report = patch(model, "triton")
    out = checkpoint.save_patched(model, report, tmp_path / "out", source=source)
    assert torch.equal(_stock_output(out, torch.float32, batch), model_output(original, batch)[1])
    again = load(out)  # impl from the manifest: triton
    assert {m.impl for m in again.modules() if isinstance(m, NormswapNorm)} == {"triton"}


def test_sharded_save(tmp_path):
    model = tiny_model("gpt2")
    batch = probe_batch(model)
    want = model_output(model, batch)[1]
    report = patch(model, "torch", probe=SMALL)
    out = checkpoint.save_patched(model, report, tmp_path / "out", max_shard_size="20KB")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    assert torch.equal(_stock_output(out, torch.float32, batch), want)


def test_existing_target_refused_then_replaced(tmp_path):
    model = tiny_model("llama")
    report = patch(model, "torch", probe=SMALL)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(NormswapError, match="already exists"):
        checkpoint.save_patched(model, report, out)
    # replace=True (--force) replaces a checkpoint, never an arbitrary directory (test_safety)
    with pytest.raises(NormswapError, match="not a model checkpoint"):
        checkpoint.save_patched(model, report, out, replace=True)
    assert (out / "keep.txt").read_text() == "user data"
    (out / "model.safetensors").write_bytes(b"an earlier checkpoint")
    checkpoint.save_patched(model, report, out, replace=True)
    assert (out / MANIFEST_NAME).is_file() and not (out / "keep.txt").exists()
    assert not _leftovers(tmp_path)


def test_disk_full_leaves_nothing(tmp_path, monkeypatch):
    model = tiny_model("llama")
    report = patch(model, "torch", probe=SMALL)

    def full(self, directory, **kw):
        (directory / "model.safetensors").write_bytes(b"\0" * 100)  # a partial write
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(model), "save_pretrained", full)
    with pytest.raises(NormswapError, match="No space left on device"):
        checkpoint.save_patched(model, report, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_a_full_disk_while_carrying_names_the_copy_not_the_models_file(tmp_path, monkeypatch):
    """A disk that filled up while the tokenizer was carried over said 'cannot write OUT:
    MODEL/tokenizer.json: No space left on device', naming the model's own file, as if its folder
    were full: shutil's copy names both files, the source first. A write's error names the copy."""
    from normswap import carry

    src = tmp_path / "m"
    model = save_tiny("llama", src)
    report = patch(model, "torch", probe=SMALL)

    def full(a, b, **kw):  # as shutil's sendfile copy raises it
        raise OSError(errno.ENOSPC, "No space left on device", str(a), None, str(b))

    monkeypatch.setattr(carry.shutil, "copy2", full)
    with pytest.raises(NormswapError) as e:
        checkpoint.save_patched(model, report, tmp_path / "out", source=resolve(str(src)))
    said = str(e.value)
    # the copy as it was to be published: the hidden staging folder is gone when this is read
    assert said == f"cannot write {tmp_path / 'out'}: {tmp_path / 'out' / 'tokenizer.json'}: No space left on device"
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def _changed_on_the_way_to_disk(monkeypatch, change) -> None:
    """save_patched's weights are written, then change(out_dir) alters them before the reload check."""
    real = checkpoint.write_model_files

    def writing(model, out_dir, *a, **k):
        real(model, out_dir, *a, **k)
        change(out_dir)
    monkeypatch.setattr(checkpoint, "write_model_files", writing)


def test_failed_reload_check_publishes_nothing(tmp_path, monkeypatch):
    model = tiny_model("llama")
    report = patch(model, "torch", probe=SMALL)
    _changed_on_the_way_to_disk(monkeypatch,
                                lambda out_dir: (out_dir / "model.safetensors").write_bytes(b"not safetensors"))
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    (target / "normswap.json").write_text("{}")  # an earlier output: --force may replace it
    with pytest.raises(NormswapError, match="does not reload"):
        checkpoint.save_patched(model, report, target, replace=True)
    assert (target / "old.txt").read_text() == "old" and not _leftovers(tmp_path)


def test_reload_with_different_logits_publishes_nothing(tmp_path, monkeypatch):
    # the file is valid safetensors, but a norm weight changed on the way to disk
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    report = patch(model, "torch", probe=SMALL)

    def tampering(out_dir):
        f = out_dir / "model.safetensors"
        tensors = load_file(f)
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.001
        save_file(tensors, f, metadata={"format": "pt"})
    _changed_on_the_way_to_disk(monkeypatch, tampering)
    with pytest.raises(NormswapError, match="reloads with different logits"):
        checkpoint.save_patched(model, report, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_exchange_and_fallback(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "f").write_text("A")
    (b / "f").write_text("B")
    assert checkpoint.exchange_dirs(a, b)  # Linux renameat2(RENAME_EXCHANGE)
    assert (a / "f").read_text() == "B" and (b / "f").read_text() == "A"
    # the documented fallback (no atomic exchange available) still ends with the new tree
    monkeypatch.setattr(checkpoint, "exchange_dirs", lambda x, y: False)
    new = tmp_path / "new"
    new.mkdir()
    (new / "f").write_text("N")
    (b / "normswap.json").write_text("{}")  # an earlier output: replace=True may replace it
    checkpoint.publish_dir(new, b, replace=True)
    assert (b / "f").read_text() == "N" and not new.exists() and not _leftovers(tmp_path)


def test_load_rejects_missing_or_tampered_manifest(tmp_path):
    src = tmp_path / "src"
    save_tiny("llama", src)
    with pytest.raises(NormswapError, match="not a normswap checkpoint"):
        load(src)
    source = resolve(src)
    model = load_model(source)
    out = checkpoint.save_patched(model, patch(model, "torch", probe=SMALL), tmp_path / "out", source=source)
    data = json.loads((out / MANIFEST_NAME).read_text())
    data["patch"]["modules"][0]["spec"]["eps"] = 1e-3
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(NormswapError, match="no longer matches"):
        load(out, impl="torch")
    (out / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(NormswapError, match=r"normswap.json: malformed manifest \(Expecting property name"):
        load(out, impl="torch")


def test_load_refuses_a_recorded_patch_that_cannot_run_here_before_the_weights(tmp_path, monkeypatch):
    """A folder patched with liger on a GPU machine, loaded on a CPU-only one: refused naming the
    folder and the way out (impl='torch'), before any weight is read; it failed after the load,
    with the backend's own message alone. impl='torch' loads it; an impl that cannot run is
    refused before the load too."""
    import sys

    from normswap import loading

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not importable, on a GPU machine with it too
    src = tmp_path / "src"
    save_tiny("llama", src)
    source = resolve(src)
    model = load_model(source)
    out = checkpoint.save_patched(model, patch(model, "torch", probe=SMALL), tmp_path / "out", source=source)
    data = json.loads((out / MANIFEST_NAME).read_text())
    data["patch"]["impl"] = "liger"
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    real = loading.load_model
    with monkeypatch.context() as m:
        m.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the weights loaded before the refusal"))
        with pytest.raises(NormswapError) as e:
            load(out)
        assert str(e.value).startswith(f"{out}: its normswap.json records a liger patch, which cannot run here (")
        assert str(e.value).endswith("; load it with another implementation: impl='torch'")
        with pytest.raises(NormswapError, match="^backend 'liger' is not available here"):
            load(out, impl="liger")
    assert loading.load_model is real
    loaded = load(out, impl="torch")
    assert {m.impl for m in loaded.modules() if isinstance(m, NormswapNorm)} == {"torch"}


def test_convert_section_is_kept_and_an_old_patch_section_replaced(tmp_path):
    src = tmp_path / "src"
    save_tiny("gpt2", src)
    convert_section = {"norms": [{"path": "transformer.ln_f", "rms": False}]}
    (src / MANIFEST_NAME).write_text(json.dumps({"format": "normswap/1", "convert": convert_section,
                                                 "patch": {"impl": "old", "modules": []}}))
    source = resolve(src)
    model = load_model(source)
    report = patch(model, "torch", probe=SMALL)
    out = checkpoint.save_patched(model, report, tmp_path / "out", source=source)
    m = read_manifest(out)
    assert m["format"] == "normswap/2" and m["convert"] == convert_section and m["patch"]["impl"] == "torch"
    # conversion=: the section as the caller read it (patch_checkpoint reads normswap.json once),
    # in place of the file's; None says there is none
    given = {"norms": [{"path": "transformer.h.0.ln_1", "rms": False}]}
    assert read_manifest(checkpoint.save_patched(model, report, tmp_path / "given", source=source,
                                                 conversion=given))["convert"] == given
    assert "convert" not in read_manifest(checkpoint.save_patched(model, report, tmp_path / "none", source=source,
                                                                  conversion=None))


def test_a_malformed_source_manifest_is_refused_before_writing(tmp_path):
    src = tmp_path / "src"
    save_tiny("gpt2", src)
    (src / MANIFEST_NAME).write_text(json.dumps({"format": "normswap.convert/1", "norms": []}))
    source = resolve(src)
    model = load_model(source)
    with pytest.raises(NormswapError, match="not a normswap manifest"):
        checkpoint.save_patched(model, patch(model, "torch", probe=SMALL), tmp_path / "out", source=source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_published_modes_are_ordinary(tmp_path):
    model = tiny_model("llama")
    out = checkpoint.save_patched(model, patch(model, "torch", probe=SMALL), tmp_path / "out")
    umask = os.umask(0o022)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask  # not mkdtemp's 0700
    assert all((p.stat().st_mode & 0o777) == 0o666 & ~umask for p in out.iterdir())


@pytest.mark.gpu
def test_save_from_cuda(tmp_path):
    """The bit-for-bit reload check runs the reloaded copy on the model's own device."""
    src = tmp_path / "src"
    save_tiny("llama", src, torch.bfloat16)
    source = resolve(src)
    model = load_model(source, device="cuda")
    out = checkpoint.save_patched(model, patch(model, "triton"), tmp_path / "out", source=source)
    assert (out / MANIFEST_NAME).is_file()


def test_stale_staging_is_removed_whatever_its_pid(tmp_path):
    """Every staging folder of the target but the holder's own is a killed run's: it is made under the
    target's lock. The pid in its name may be alive again: in a container every run is pid 1, so a
    run the OOM killer ended had this run's pid, and its model-sized folder was kept for good."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    target = tmp_path / "model"
    stale = tmp_path / f".model.normswap-{dead}-abc"
    reused = tmp_path / f".model.normswap-{os.getpid()}-def"  # a killed run's, with this run's pid
    other = tmp_path / ".other.normswap-1-x"
    probe = tmp_path / ".model.normswap-probe-x"  # not a staging folder (fileio.unwritable's)
    alike = tmp_path / ".model.normswap-1-x.normswap-7-abcdefgh"  # target model.normswap-1-x's, not model's
    for p in (stale, reused, other, probe, alike):
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"x")
    with checkpoint.staged_dir(target) as tmp:
        assert checkpoint.remove_stale_staging(target) == []  # its own staging folder is not stale
        assert tmp.is_dir()
        (tmp / "config.json").write_text("{}")
    assert not stale.exists() and not reused.exists()
    assert other.exists() and probe.exists() and alike.exists()


def test_carry_over_does_not_follow_links_that_loop(tmp_path):
    """A link in the model directory to the directory itself, to one that holds it, or to the
    folder the output is staged in was followed by copytree until the path grew too long: a copy
    of everything there, many times over (the model folder's parent may hold every other model),
    then a failure after all the work, reported in one 19 KB line. Such links are left out; a link
    to a file is still carried as its content (an HF cache snapshot's files are links to blobs),
    one to an unrelated folder outside the model as a link (test_carry)."""
    parent = tmp_path / "models"
    src = parent / "m"
    src.mkdir(parents=True)
    (src / "tokenizer.json").write_text("{}")
    (tmp_path / "blob").write_text("chat template")
    (src / "chat_template.jinja").symlink_to(tmp_path / "blob")
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "notes.txt").write_text("kept")
    (src / "extra").symlink_to(tmp_path / "extra")
    (src / "self").symlink_to(src)
    (src / "up").symlink_to("..")
    (src / "code").mkdir()
    (src / "code" / "model.py").write_text("# custom code")
    (src / "code" / "root").symlink_to(tmp_path)
    (src / "gone").symlink_to(tmp_path / "nothing")
    out = parent / ".staging"
    out.mkdir()
    with pytest.warns(UserWarning, match="extra leads to a folder outside the model folder"):
        carried = carry_over(src, out)
    assert sorted(carried) == ["chat_template.jinja", "code", "extra", "tokenizer.json"]
    assert (out / "chat_template.jinja").read_text() == "chat template" and not (out / "chat_template.jinja").is_symlink()
    assert (out / "extra" / "notes.txt").read_text() == "kept" and (out / "extra").is_symlink()
    assert sorted(p.name for p in (out / "code").iterdir()) == ["model.py"]
    assert sorted(p.name for p in out.iterdir()) == ["chat_template.jinja", "code", "extra", "tokenizer.json"]


def test_carry_over_does_not_follow_two_links_that_point_at_each_other(tmp_path):
    """A cycle need not pass through the folder being copied: a link in the model to x, where x
    links to y and y back to x, copied x and y into each other until the path grew too long. The
    link back to a folder the copy is already inside is left out; the rest is carried once. A link
    to a folder outside the model is now carried as a link, so the walk never goes out there: the
    two links out there stay as they are."""
    src, x, y = tmp_path / "m", tmp_path / "x", tmp_path / "y"
    for d in (src, x, y):
        d.mkdir()
    (x / "a.txt").write_text("x")
    (y / "b.txt").write_text("y")
    (x / "to_y").symlink_to(y)
    (y / "to_x").symlink_to(x)
    (src / "shared").symlink_to(x)
    out = tmp_path / "out"
    out.mkdir()
    (src / "code").mkdir()
    (src / "code" / "x").symlink_to("../shared")  # a link inside the model, to the link out
    with pytest.warns(UserWarning, match="outside the model folder") as said:
        assert carry_over(src, out) == ["code", "shared"]
    assert len(said) == 2
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["code", "code/x", "shared"]
    assert os.readlink(out / "shared") == os.readlink(out / "code" / "x") == str(x)


@pytest.mark.parametrize("manifest", [
    {"format": "normswap/2", "patch": [1]},
    {"format": "normswap/1", "patch": 5},
    {"format": "normswap/2", "convert": "folded"},
    {"format": "normswap/2", "convert": {"norms": [7]}},
])
def test_a_manifest_section_of_the_wrong_shape_is_malformed_not_a_crash(tmp_path, manifest):
    """A section that is not an object ("patch": [1]) raised AttributeError from PatchConfig's
    reading (d.items()): `normswap patch` on such a directory was an internal error (exit 1)."""
    from normswap.manifest import read_manifest

    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(NormswapError, match="malformed manifest"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("paths", ["model.norm", [1, 2]])
def test_a_manifest_whose_paths_are_not_module_paths_is_malformed(tmp_path, paths):
    """The patch section's paths, a string or numbers: "model.norm" was read letter by letter and
    [1, 2] as modules "1" and "2", and loading the folder said "paths names modules that are not
    norms here: ., a, d, e, ..." without naming normswap.json."""
    from normswap.manifest import read_manifest

    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": "normswap/2", "patch": {
        "impl": "torch", "paths": paths, "rms_forms": {}, "strict": False, "modules": []}}))
    with pytest.raises(NormswapError, match=r"normswap.json: malformed manifest \(TypeError: paths: expected None or "
                                            r"a list of module paths, got "):
        read_manifest(tmp_path)


def test_in_place_keeps_every_other_entry_even_a_fifo(tmp_path):
    """--in-place promises every other entry of the directory survives; one that is neither a
    file, a folder nor a link (a named pipe a training job left) was dropped from the new tree."""
    src = tmp_path / "m"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"old weights")
    (src / "notes.txt").write_text("kept")
    os.mkfifo(src / "progress.pipe")
    out = tmp_path / ".staging"
    out.mkdir()
    carried = carry_over(src, out, in_place=True)
    assert sorted(carried) == ["notes.txt", "progress.pipe"]
    assert (out / "progress.pipe").exists() and not (out / "progress.pipe").is_file()
    assert not (out / "model.safetensors").exists()  # the new weights replace the stock ones
