"""The scan: every norm of a model with its spec, its readers and (for a LayerNorm) whether
`normswap convert` makes it an RMSNorm and why not, as one JSON-ready document.

Readers and conversion come from one traced forward (normswap.discover): the readers a converted
LayerNorm folds into are the readers listed here.

Built on the meta device from the config alone, so it reads no weights and a 70B config scans in
about a second.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

from torch import nn

from normswap.discover import Trace, norm_readers, trace
from normswap.progress import ProgressFn
from normswap.walk import FoundNorm, UnknownNormWarning, find_norms

ROOT = "<model>"  # how a reader that is the model's own forward ("" in the trace) is shown


def norm_row(found: FoundNorm, readers: list[str] | None) -> dict[str, Any]:
    """One norm: its NormSpec's fields under the spec's own names (has_weight, has_bias: what a
    patch manifest's "spec" holds), then its readers."""
    return {
        "path": found.path,
        "class": found.module_class,
        **found.spec.to_dict(),
        "readers": None if readers is None else [r or ROOT for r in readers],
        "recognised_by": found.recognised_by,
        "bit_exact": found.bit_exact,
    }


def scan_model(model: nn.Module, strict: bool = False, with_readers: bool = True,
               warn: bool = True) -> dict[str, Any]:
    """The scan document of a model (any device; meta is the usual one). with_readers=False skips
    the traced forward: no readers, no conversion rows."""
    with warnings.catch_warnings():
        if not warn:
            warnings.simplefilter("ignore", UnknownNormWarning)
        found = find_norms(model, strict=strict, warn=warn)
    known = [f for f in found if f.spec is not None]
    unknown = [f for f in found if f.spec is None]
    config = getattr(model, "config", None)
    if with_readers:
        tr = trace(model)
        readers, note = norm_readers(model, [f.path for f in known], tr)
        to_rms = conversion_rows(model, config, tr)
    else:
        readers, note, to_rms = None, "readers not computed", {}
    rows = [norm_row(f, None if readers is None else readers[f.path]) for f in known]
    for row in rows:
        row["to_rms"] = to_rms.get(row["path"])
    converting = [r for r in to_rms.values() if r["converts"]]
    return {
        "model_class": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "norms": rows,
        "unknown": [{"path": f.path, "class": f.module_class, "reason": f.unknown_reason} for f in unknown],
        "summary": {
            "norms": len(known),
            "by_kind": dict(Counter(f.spec.kind for f in known)),
            "by_class": dict(Counter(f.module_class for f in known)),
            "by_casting": dict(Counter(f.spec.casting for f in known)),
            "unknown": len(unknown),
            "to_rms": {"converts": len(converting), "refused": dict(Counter(
                r["category"] for r in to_rms.values() if not r["converts"]))},
        },
        "readers_note": note,
    }


def conversion_rows(model: nn.Module, config, tr: Trace | None = None) -> dict[str, dict[str, Any]]:
    """Per LayerNorm, whether `normswap convert` turns it into an RMSNorm and why not: the plan it
    would make (the same discovery, from the trace `tr` when given, and any normswap/archs
    override)."""
    from normswap.errors import NormswapError
    from normswap.plan import plan_conversion

    if config is None:
        return {}
    try:
        plan = plan_conversion(model, config, tr=tr)
    except NormswapError:  # nothing to convert (no LayerNorm), or an override file that does not fit
        return {}
    return {d.path: {"converts": d.rms, "category": d.category, "why_not": d.why_not} for d in plan.norms}


def scan(ref: str, strict: bool = False, with_readers: bool = True, warn: bool = True,
         progress: bool | ProgressFn | None = None) -> dict[str, Any]:
    """Scan a model reference (hub id, directory, .gguf, built-in name) without reading weights.
    progress (normswap.progress.bar) hears a built-in model's first-use conversion and the read of
    a GGUF's config (normswap.loading.load_config), the slow parts of a scan."""
    from normswap.loading import build_meta_model, load_config, resolve

    source = resolve(ref, progress=progress)
    model = build_meta_model(source, load_config(source, progress))
    # where the model was read: the file itself for a .gguf (its folder may hold several)
    doc = {"model": ref, "path": str(source.path / source.gguf_file if source.gguf_file else source.path)}
    doc.update(scan_model(model, strict=strict, with_readers=with_readers, warn=warn))
    return doc
