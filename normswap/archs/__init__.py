"""Architecture knowledge as data: one TOML file per model_type, read by this small loader.

Each file names, for one transformers model family (paths as in its *ForCausalLM class, with
"{i}" standing for the block index):
  model_type    the config's model_type
  prefix        the base model's attribute name (stripped when a bare base model is converted)
  orientation   "linear" (nn.Linear, [out, in]) or "conv1d" (GPT-2 Conv1D, [in, out])
  embeddings    tables whose rows are added into the residual stream (token, position, type)
  writers       linear layers whose outputs are added into the residual stream
  [[norms]]     path, readers (the linear layers that read the norm's output), optional
                when = {config_key = value} for layouts chosen by the config
  [embedding_norm]  path, table: a norm whose output *is* the stream, directly after a table
  [orientations]    per-module exceptions to `orientation` (GPT-2's lm_head is an nn.Linear)
  [tied]        head -> table it may be tied to (untied when the table is centered)
  [[refuse]]    path, reason, category: norms known not to be convertible, and why
  [[refuse_if]] config = {...} or module = "...", reason, category: layouts where nothing converts
(category: one of normswap.discover.REFUSALS)

A file is an override: without one, normswap.discover finds the same from the model's forward
(tests/test_discover.py holds every file equal to discovery on its tiny models).

"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from normswap.discover import REFUSALS
from normswap.errors import NormswapError

_ORIENTATIONS = ("linear", "conv1d")


@dataclass(frozen=True)
class NormEntry:
    path: str
    readers: tuple[str, ...]
    when: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    reason: str
    category: str = "arch-data"  # one of normswap.discover.REFUSALS
    path: str | None = None  # [[refuse]]: a norm pattern
    config: dict[str, Any] | None = None  # [[refuse_if]]: config values
    module: str | None = None  # [[refuse_if]]: a module whose presence refuses the layout


@dataclass(frozen=True)
class ArchData:
    model_type: str
    source: str  # file name, for messages
    prefix: str
    orientation: str
    embeddings: tuple[str, ...]
    writers: tuple[str, ...]
    norms: tuple[NormEntry, ...]
    embedding_norm: dict[str, str] | None
    orientations: dict[str, str]
    tied: dict[str, str]
    refuse: tuple[Refusal, ...]
    refuse_if: tuple[Refusal, ...]

    def orientation_of(self, path_pattern: str) -> str:
        return self.orientations.get(path_pattern, self.orientation)


def pattern_regex(pattern: str) -> re.Pattern:
    """'transformer.h.{i}.ln_1' -> a regex whose group `i` captures the block index."""
    parts = [re.escape(p) for p in pattern.split("{i}")]
    return re.compile("^" + r"(?P<i>\d+)".join(parts) + "$")


def expand(pattern: str, i: str | None) -> str:
    return pattern if i is None else pattern.replace("{i}", i)


def load_arch(model_type: str) -> ArchData | None:
    """The data for `model_type`, or None when normswap has no file for it."""
    name = f"{model_type}.toml"
    res = resources.files(__package__) / name
    if not res.is_file():
        return None
    try:
        raw = tomllib.loads(res.read_text(encoding="utf-8"))
        return _parse(raw, name)
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
        raise NormswapError(f"normswap/archs/{name} is malformed: {e}") from None


def _parse(raw: dict, name: str) -> ArchData:
    orientation = raw.get("orientation", "linear")
    orientations = dict(raw.get("orientations", {}))
    for o in [orientation, *orientations.values()]:
        if o not in _ORIENTATIONS:
            raise ValueError(f"orientation {o!r} is not one of {_ORIENTATIONS}")
    norms = tuple(
        NormEntry(n["path"], tuple(n["readers"]), dict(n.get("when", {}))) for n in raw.get("norms", [])
    )
    refuse = tuple(Refusal(r["reason"], r.get("category", "arch-data"), path=r["path"]) for r in raw.get("refuse", []))
    refuse_if = tuple(
        Refusal(r["reason"], r.get("category", "arch-data"), config=r.get("config"), module=r.get("module"))
        for r in raw.get("refuse_if", [])
    )
    for r in refuse + refuse_if:
        if r.category not in REFUSALS:
            raise ValueError(f"refusal category {r.category!r} is not one of {sorted(REFUSALS)}")
    if raw["model_type"] != name[: -len(".toml")]:
        raise ValueError(f"model_type {raw['model_type']!r} does not match the file name")
    return ArchData(
        model_type=raw["model_type"],
        source=name,
        prefix=raw.get("prefix", ""),
        orientation=orientation,
        embeddings=tuple(raw.get("embeddings", [])),
        writers=tuple(raw.get("writers", [])),
        norms=norms,
        embedding_norm=raw.get("embedding_norm"),
        orientations=orientations,
        tied=dict(raw.get("tied", {})),
        refuse=refuse,
        refuse_if=refuse_if,
    )
