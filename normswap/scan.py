"""The scan: every norm of a model with its spec and its consumers, as one JSON-ready document.

Built on the meta device from the config alone, so it reads no weights and a 70B config scans in
about a second.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

from torch import nn

from normswap.consumers import find_consumers
from normswap.walk import FoundNorm, UnknownNormWarning, find_norms

ROOT = "<model>"  # how a consumer that is the model's own forward is shown


def norm_row(found: FoundNorm, consumers: list[str] | None) -> dict[str, Any]:
    s = found.spec
    return {
        "path": found.path,
        "class": found.module_class,
        "kind": s.kind,
        "eps": s.eps,
        "eps_attr": s.eps_attr,
        "offset": s.offset,
        "casting": s.casting,
        "dtype": s.dtype,
        "shape": list(s.shape),
        "weight": s.has_weight,
        "bias": s.has_bias,
        "consumers": None if consumers is None else [c or ROOT for c in consumers],
        "recognised_by": found.recognised_by,
        "bit_exact": found.bit_exact,
    }


def scan_model(model: nn.Module, strict: bool = False, with_consumers: bool = True,
               warn: bool = True) -> dict[str, Any]:
    """The scan document of a model (any device; meta is the usual one)."""
    with warnings.catch_warnings():
        if not warn:
            warnings.simplefilter("ignore", UnknownNormWarning)
        found = find_norms(model, strict=strict, warn=warn)
    known = [f for f in found if f.spec is not None]
    unknown = [f for f in found if f.spec is None]
    consumers, note = (None, "consumers not computed") if not with_consumers else \
        find_consumers(model, [f.path for f in known])
    config = getattr(model, "config", None)
    return {
        "model_class": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "norms": [norm_row(f, None if consumers is None else consumers[f.path]) for f in known],
        "unknown": [{"path": f.path, "class": f.module_class, "reason": f.unknown_reason} for f in unknown],
        "summary": {
            "norms": len(known),
            "by_kind": dict(Counter(f.spec.kind for f in known)),
            "by_class": dict(Counter(f.module_class for f in known)),
            "by_casting": dict(Counter(f.spec.casting for f in known)),
            "unknown": len(unknown),
        },
        "consumers_note": note,
    }


def scan(ref: str, strict: bool = False, with_consumers: bool = True, warn: bool = True) -> dict[str, Any]:
    """Scan a model reference (hub id, directory, .gguf, built-in name) without reading weights."""
    from normswap.loading import build_meta_model, resolve

    source = resolve(ref)
    model = build_meta_model(source)
    doc = {"model": ref, "path": str(source.path)}
    doc.update(scan_model(model, strict=strict, with_consumers=with_consumers, warn=warn))
    return doc
