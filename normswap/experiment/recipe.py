"""Experiment recipes: a TOML file, validated against the dataclasses below.

Every key a recipe may hold is a field of one of these dataclasses; anything else, a value of the
wrong type or out of range, is a one-line `RecipeError` that names the key. `--set key=value`
overrides (dotted keys, TOML values) are applied to the raw table before validation, so they are
checked the same way. Paths in a recipe are relative to the recipe file.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from normswap.backends import BACKENDS
from normswap.dtypes import RUN_DTYPES
from normswap.errors import NormswapError, named_twice, option_labels

TRANSFORMS = ("original", "exact", "approx", "approx-bias")
TRAININGS = ("ft", "distill")
SCHEDULES = ("constant", "linear", "cosine")
OPTIMIZERS = ("adamw", "sgd")
MIXED_PRECISION = ("auto", "no", "bf16", "fp16")
TRACKERS = ("auto", "none", "tensorboard")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a folder name: it becomes runs/<name> and a cache entry


class RecipeError(NormswapError):
    """A recipe that cannot run: unknown key, bad value, missing file."""


def _spec(default=dataclasses.MISSING, *, choices=None, minimum=None, maximum=None, path=False, doc=""):
    meta = {"choices": choices, "minimum": minimum, "maximum": maximum, "path": path, "doc": doc}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class TrainSettings:
    """How a model is trained: shared by [finetune] and [pretrain]."""

    steps: int = _spec(200, minimum=0, doc="optimizer steps")
    lr: float = _spec(3e-4, minimum=0.0, doc="peak learning rate")
    schedule: str = _spec("cosine", choices=SCHEDULES, doc="decay after the warm-up")
    warmup_steps: int = _spec(20, minimum=0)
    batch_size: int = _spec(8, minimum=1, doc="sequences per micro-batch, per process")
    seq_len: int = _spec(128, minimum=2, doc="tokens per training sequence")
    grad_accum: int = _spec(1, minimum=1, doc="micro-batches per optimizer step, per process")
    optimizer: str = _spec("adamw", choices=OPTIMIZERS)
    weight_decay: float = _spec(0.0, minimum=0.0)
    max_grad_norm: float = _spec(1.0, minimum=0.0, doc="0 turns clipping off")
    dtype: str = _spec("fp32", choices=RUN_DTYPES, doc="dtype of the weights being trained")
    mixed_precision: str = _spec("auto", choices=MIXED_PRECISION, doc="auto: bf16 on a GPU that has it, fp16 on another GPU, else no")
    checkpoint_every: int = _spec(50, minimum=1, doc="steps between resumable checkpoints")


@dataclass(frozen=True)
class FinetuneSection(TrainSettings):
    eval_every: int = _spec(50, minimum=1, doc="steps between evaluations (step 0 is always evaluated)")


@dataclass(frozen=True)
class PretrainSection(TrainSettings):
    """A small GPT-2-architecture model trained from scratch on `text` (cached under ~/.cache/normswap/)."""

    text: str = _spec("", path=True, doc="training text (.txt, .txt.gz, directory, ...)")
    vocab_size: int = _spec(4096, minimum=258, doc="byte-level BPE tokenizer trained on the text")
    n_layer: int = _spec(6, minimum=1)
    n_embd: int = _spec(256, minimum=8)
    n_head: int = _spec(4, minimum=1)
    context: int = _spec(128, minimum=8, doc="n_positions of the model")
    init_std: float = _spec(0.02, minimum=0.0)


@dataclass(frozen=True)
class ModelSection:
    path: str = _spec("", doc="a model directory (or anything `normswap ppl` takes); or use [pretrain]")


@dataclass(frozen=True)
class DataSection:
    train: str = _spec("", path=True, doc="fine-tuning text")
    eval: str = _spec("", path=True, doc="held-out evaluation text")
    eval_max_tokens: int = _spec(8192, minimum=2)
    eval_max_length: int = _spec(128, minimum=2, doc="evaluation window")
    eval_stride: int = _spec(0, minimum=0, doc="0: half the window")
    eval_batch_size: int = _spec(8, minimum=1)


@dataclass(frozen=True)
class Recipe:
    name: str = _spec("experiment", doc="names the default output folder and the pretraining cache entry")
    description: str = _spec("")
    seed: int = _spec(0, minimum=0, maximum=2**32 - 1, doc="numpy's and accelerate's seeds stop at 2**32 - 1")
    impl: str = _spec("torch", choices=BACKENDS, doc="normswap backend the norms of every arm run on (triton, torch, ...)")
    arms: list = _spec(["original", "original+ft", "exact", "exact+ft", "approx", "approx+ft",
                        "approx-bias", "approx-bias+ft", "approx+distill"])
    tracker: str = _spec("auto", choices=TRACKERS, doc="accelerate tracker: auto = tensorboard when installed")
    model: ModelSection | None = None
    pretrain: PretrainSection | None = None
    data: DataSection = field(default_factory=DataSection)
    finetune: FinetuneSection = field(default_factory=FinetuneSection)
    source: str = ""  # the recipe file (set by load_recipe; paths were resolved against its folder)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    def default_out(self) -> Path:
        """Where a run writes when no folder is given: runs/<name>, under the working directory."""
        return Path("runs") / self.name

    def fingerprint(self, digests: dict[str, str] | None = None) -> str:
        """What decides the numbers of a run: everything but the arm selection, the description and
        the tracker, with each text file by its content (a moved checkout is the same recipe).
        digests: text_digests(), when the caller has taken them (a run takes them once for all its
        uses: each is a read of the whole file)."""
        digests = self.text_digests() if digests is None else digests
        d = self.to_dict()
        for k in ("arms", "description", "tracker"):
            d.pop(k)
        for section, key in self._text_keys():
            d[section][key] = digests[d[section][key]]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def text_digests(self) -> dict[str, str]:
        """file_digest of every text the recipe names (pretrain.text, data.train, data.eval), by
        path: each file read once, also where two keys name it (the shipped recipes pretrain on
        their data.train). A file that cannot be read is a RecipeError naming its key, as the
        run's read of the text says it."""
        digests = {}
        for section, key in self._text_keys():
            path = getattr(getattr(self, section), key)
            if path not in digests:
                try:
                    digests[path] = file_digest(path)
                except OSError as e:
                    raise RecipeError(f"{section}.{key}: {e.filename or path}: cannot read ({e.strerror or e})") \
                        from None
        return digests

    def texts_by_key(self, digests: dict[str, str]) -> dict[str, str]:
        """Each text's digest (digests: text_digests()) by the key that names it, {"data.eval": ...}:
        what OUT's recipe.json records, to say which text changed when a rerun is refused."""
        return {f"{section}.{key}": digests[getattr(getattr(self, section), key)] for section, key in self._text_keys()}

    def _text_keys(self) -> list[tuple[str, str]]:
        """The (section, key) of every text path the recipe gives."""
        return [(section, f.name) for section in ("pretrain", "data") if getattr(self, section) is not None
                for f in dataclasses.fields(_SECTIONS[section])
                if f.metadata.get("path") and getattr(getattr(self, section), f.name)]


def file_digest(path: str | Path) -> str:
    """sha256 of a file, or of a directory's files in sorted order."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


_SECTIONS = {"model": ModelSection, "pretrain": PretrainSection, "data": DataSection, "finetune": FinetuneSection}


def recipe_key(section, name: str) -> str:
    """What a recipe calls the field `name` of `section` (one of its sections, as validate built
    it): `finetune.lr`, `pretrain.lr`, as the recipe's own errors name keys; the bare field name for
    settings a library caller made (a TrainSettings belongs to no section)."""
    where = next((key for key, cls in _SECTIONS.items() if type(section) is cls), None)
    return f"{where}.{name}" if where else name


def parse_arm(name: str) -> tuple[str, str | None]:
    """'approx+ft' -> ('approx', 'ft'); 'exact' -> ('exact', None). RecipeError when unknown."""
    transform, _, training = name.partition("+")
    if transform not in TRANSFORMS or (training and training not in TRAININGS):
        known = ", ".join(f"{t}[+{'|+'.join(TRAININGS)}]" for t in TRANSFORMS)
        raise RecipeError(f"unknown arm {name!r} (arms: {known})")
    return transform, training or None


def select_arms(recipe: Recipe, arms: str | Sequence[str] | None, name: str = "arms") -> list[str]:
    """The arms a run runs: `arms` as given (a list, or "a,b" as a command line takes it), else all of
    the recipe's. RecipeError naming `name` (the parameter, or the flag it came from) when it
    names no arm or an unknown one."""
    if arms is None:
        return list(recipe.arms)
    if not isinstance(arms, str) and (not isinstance(arms, Sequence) or not all(isinstance(a, str) for a in arms)):
        raise TypeError(f"{name}: expected arm names, as \"a,b\" or a list of str, got {arms!r}")
    chosen = [a.strip() for a in (arms.split(",") if isinstance(arms, str) else arms) if a.strip()]
    if not chosen:
        raise RecipeError(f"{name}: no arm named")
    for arm in chosen:
        try:
            parse_arm(arm)
        except RecipeError as e:
            raise RecipeError(f"{name}: {e}") from None
    if twice := named_twice(chosen):  # as a recipe's arms list: a typo'd second name, not a request to run one arm twice
        raise RecipeError(f"{name}: {', '.join(twice)} named twice")
    return chosen


def _type_name(t) -> str:
    return {"int": "an integer", "float": "a number", "str": "a string", "list": "a list of strings"}.get(t, t)


def _check_value(where: str, f: dataclasses.Field, value: Any, base: Path):
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    meta = f.metadata
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise RecipeError(f"{where}: expected {_type_name(kind)}, got {value!r}")
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RecipeError(f"{where}: expected {_type_name(kind)}, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise RecipeError(f"{where}: expected a finite number, got {value!r}")
    if kind == "str" and not isinstance(value, str):
        # --set name=2024 reads a TOML integer: say how to mean the text
        # (as TOML spells it: true, not Python's True)
        typed = str(value).lower() if isinstance(value, bool) else value
        hint = f" (quote it: '\"{typed}\"')" if isinstance(value, int | float) else ""
        raise RecipeError(f"{where}: expected {_type_name(kind)}, got {value!r}{hint}")
    if kind == "list" and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
        raise RecipeError(f"{where}: expected {_type_name(kind)}, got {value!r}")
    if meta.get("choices") and value not in meta["choices"]:
        raise RecipeError(f"{where}: {value!r} is not one of {', '.join(meta['choices'])}")
    if meta.get("minimum") is not None and value < meta["minimum"]:
        raise RecipeError(f"{where}: {value!r} is below the minimum {meta['minimum']}")
    if meta.get("maximum") is not None and value > meta["maximum"]:
        raise RecipeError(f"{where}: {value!r} is above the maximum {meta['maximum']}")
    if meta.get("path") and value:
        value = str((base / Path(value).expanduser()).resolve())
    return value


def _build(cls, table: Any, where: str, base: Path):
    if not isinstance(table, dict):
        raise RecipeError(f"{where}: expected a table, got {table!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    values = {}
    for key, value in table.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RecipeError(f"unknown key {name!r} ({hint}known{' in [' + where + ']' if where else ''}: "
                              f"{', '.join(fields)})")
        if key in _SECTIONS:
            values[key] = _build(_SECTIONS[key], value, key, base)
        else:
            values[key] = _check_value(name, fields[key], value, base)
    return cls(**values)


def _apply_override(table: dict, assignment: str) -> None:
    name = option_labels(("overrides",))["overrides"]  # run_experiment's parameter, the command line's --set
    key, eq, raw = assignment.partition("=")
    key = key.strip()
    if not eq or not key:
        raise RecipeError(f"{name} {assignment!r}: expected key=value (e.g. finetune.steps=10)")
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        parsed = {"v": raw}  # a bare word: a string (e.g. impl=triton)
    except RecursionError:  # tomllib recurses per nesting level
        raise RecipeError(f"{name} {key}: the value is nested too deeply") from None
    if list(parsed) != ["v"]:  # "1e-3\nseed=5": more than one value, the others silently dropped
        raise RecipeError(f"{name} {key}: {raw!r} is not one TOML value")
    value = parsed["v"]
    *parents, leaf = key.split(".")
    node = table
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise RecipeError(f"{name} {key}: {p} is not a table")
    if parents and parents[0] not in _SECTIONS:
        raise RecipeError(f"{name} {key}: unknown section {parents[0]!r} (sections: {', '.join(_SECTIONS)})")
    if key == "arms" and isinstance(value, str):
        value = [a.strip() for a in value.split(",") if a.strip()]
    node[leaf] = value


def validate(table: dict, base: Path, source: str = "") -> Recipe:
    """A Recipe from a raw table (paths resolved against `base`); RecipeError on anything wrong."""
    recipe = _build(Recipe, table, "", base)
    recipe = dataclasses.replace(recipe, source=source)
    if not NAME.fullmatch(recipe.name):
        raise RecipeError(f"name: {recipe.name!r} is not a plain folder name (letters, digits, '.', '_', '-')")
    for arm in recipe.arms:
        parse_arm(arm)
    if not recipe.arms:
        raise RecipeError("arms: the list is empty")
    if twice := named_twice(recipe.arms):
        raise RecipeError(f"arms: {', '.join(twice)} listed twice")
    if (recipe.model is None) == (recipe.pretrain is None):
        raise RecipeError("a recipe needs exactly one of [model] (path = a model directory) and [pretrain]")
    if recipe.model is not None and not recipe.model.path:
        raise RecipeError("model.path: missing")
    if recipe.model is not None and (base / recipe.model.path).expanduser().exists():
        # A local model directory is relative to the recipe like every other path (a hub id is not a path).
        local = str((base / recipe.model.path).expanduser().resolve())
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, path=local))
    if recipe.pretrain is not None:
        p = recipe.pretrain
        if not p.text:
            raise RecipeError("pretrain.text: missing")
        if p.n_embd % p.n_head:
            raise RecipeError(f"pretrain.n_embd: {p.n_embd} is not a multiple of pretrain.n_head ({p.n_head})")
        if p.seq_len > p.context:
            raise RecipeError(f"pretrain.seq_len: {p.seq_len} exceeds pretrain.context ({p.context})")
        check_seq_len(recipe.finetune.seq_len, p.context)
    for key in ("train", "eval"):
        value = getattr(recipe.data, key)
        if not value:
            raise RecipeError(f"data.{key}: missing")
        if not Path(value).exists():
            raise RecipeError(f"data.{key}: {value}: no such file or directory")
    if recipe.pretrain is not None and not Path(recipe.pretrain.text).exists():
        raise RecipeError(f"pretrain.text: {recipe.pretrain.text}: no such file or directory")
    if recipe.data.eval_stride > recipe.data.eval_max_length:
        raise RecipeError("data.eval_stride: larger than data.eval_max_length")
    for section, s in (("pretrain", recipe.pretrain), ("finetune", recipe.finetune)):
        if s is not None and 0 < s.steps <= s.warmup_steps:
            # Kept (a quick trial run: --set finetune.steps=4 on a recipe warming up for 10), but
            # said: the run's learning rate is not the recipe's.
            warnings.warn(f"{section}.steps ({s.steps}) is not more than {section}.warmup_steps ({s.warmup_steps}): "
                          f"the whole run is the warm-up, its learning rate rising to {s.lr * s.steps / s.warmup_steps:.3g} "
                          f"at the last step ({section}.lr {s.lr:g}), and the {s.schedule} schedule after it never runs",
                          stacklevel=2)
    return recipe


def check_seq_len(seq_len: int, context: int | None) -> None:
    """A training sequence must fit the model's positions (else the embedding lookup fails mid-run)."""
    if context and seq_len > context:
        raise RecipeError(f"finetune.seq_len: {seq_len} exceeds the model's context ({context} positions)")


# A recipe is a page of TOML. The read stops past this: `normswap experiment /dev/zero` (or a
# multi-gigabyte file named by mistake) read until memory ran out, an internal error (MemoryError).
# Read, not stat'ed: a recipe may come through a pipe (`normswap experiment <(sed ... r.toml)`).
_MOST_RECIPE_CHARS = 1 << 20


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override (`key=value`, dotted) and validate a TOML recipe."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"recipe: expected the path of a TOML recipe (or a Recipe), got {type(path).__name__}")
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        # a str would be taken letter by letter
        raise TypeError(f"overrides: expected a list of 'key=value' strings, got {overrides!r}")
    p = Path(path).expanduser()
    try:
        # text mode: newlines as read_text gives them; utf-8-sig: the byte-order mark a Windows
        # editor writes is no TOML (it was "not valid TOML (Invalid statement (at line 1, column 1))")
        with p.open(encoding="utf-8-sig") as f:
            text = f.read(_MOST_RECIPE_CHARS + 1)
        if len(text) > _MOST_RECIPE_CHARS:
            raise RecipeError(f"{path}: more than {_MOST_RECIPE_CHARS >> 20} MiB, not a recipe file")
        table = tomllib.loads(text)
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file") from None
    except IsADirectoryError:
        raise RecipeError(f"{path}: a directory, not a recipe file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot read ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML ({e})") from None
    except RecursionError:  # tomllib recurses per nesting level: [[[[...]]]] past Python's limit
        raise RecipeError(f"{path}: not valid TOML (nested too deeply)") from None
    for assignment in overrides:
        _apply_override(table, assignment)
    try:
        return validate(table, p.resolve().parent, source=str(p.resolve()))
    except RecipeError as e:
        raise RecipeError(f"{path}: {e}") from None
