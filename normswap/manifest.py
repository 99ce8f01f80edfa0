"""normswap.json: what was patched, with which implementation, and the proof.

Written beside the weights of a saved checkpoint. The checkpoint itself is stock (original
classes, original keys, stock config), so the manifest is the only place the patch lives:
`normswap.load(DIR)` loads the model with stock transformers and re-applies the patch to exactly
the modules listed, after checking that each one still is what the manifest says it was.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from normswap.errors import NormswapError
from normswap.specs import NormSpec

MANIFEST_NAME = "normswap.json"
FORMAT = "normswap.patch/1"


def build_manifest(report, source: str | None = None) -> dict[str, Any]:
    import normswap

    return {
        "format": FORMAT,
        "normswap_version": normswap.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source,
        "impl": report.impl,
        "dtype": report.dtype,
        "verified": report.verified,
        "modules": [
            {"path": m.path, "class": m.module_class, "spec": m.spec.to_dict(), "as_rms": m.as_rms,
             "verification": m.check.to_dict() if m.check else None}
            for m in report.patched
        ],
        "left_alone": [{"path": m.path, "class": m.module_class, "status": m.status, "reason": m.reason}
                       for m in report.modules if m.status in ("excluded", "unknown")],
        "model_check": report.model_check.to_dict() if report.model_check else None,
    }


def write_manifest(directory: Path, manifest: dict[str, Any]) -> Path:
    path = Path(directory) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise NormswapError(f"{directory}: not a normswap checkpoint (no {MANIFEST_NAME})")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise NormswapError(f"{path}: unreadable manifest ({e.__class__.__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise NormswapError(f"{path}: not a {FORMAT} manifest")
    try:
        for m in data["modules"]:
            m["spec"] = NormSpec.from_dict(m["spec"])
        str(data["impl"])
    except (KeyError, TypeError, ValueError) as e:
        raise NormswapError(f"{path}: malformed manifest ({e.__class__.__name__}: {e})") from None
    return data


def zero_mean_layernorms(directory: str | os.PathLike) -> set[str]:
    """LayerNorm paths that `normswap convert` made zero-mean in this checkpoint (they may run as
    RMS norms): from convert's own normswap.json, or from the one a patch kept inside ours."""
    from normswap.convert import rms_eligible, rms_eligible_in

    paths = set(rms_eligible_in(directory))
    path = Path(directory) / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return paths
    if isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("carried"), dict):
        try:
            paths |= rms_eligible(data["carried"])
        except (NormswapError, KeyError, TypeError):
            pass  # carried something that is not a conversion manifest
    return paths


def _same_family(a: NormSpec, b: NormSpec) -> bool:
    """Equal apart from the parameter dtype (a checkpoint may be loaded in another dtype)."""
    da, db = a.to_dict(), b.to_dict()
    da.pop("dtype")
    db.pop("dtype")
    return da == db


def load(directory: str | os.PathLike, impl: str | None = None, dtype=None, device: str | None = None,
         verify: bool = False, progress: Callable[[str], None] | None = None):
    """Load a checkpoint saved by `normswap patch --out` and re-apply its patch.

    impl overrides the manifest's implementation (e.g. "torch" on a machine without triton);
    verify=True re-runs the per-module proof. Returns the patched model, in eval mode.
    """
    from normswap.io import load_model, parse_dtype, resolve
    from normswap.swap import patch

    source = resolve(directory)
    manifest = read_manifest(source.path)
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    model = load_model(source, dtype=dtype, device=device)
    wanted = {m["path"]: m for m in manifest["modules"]}
    report = patch(model, impl or manifest["impl"], filter_fn=lambda _m, path: path in wanted,
                   verify=verify, rms_for={p for p, m in wanted.items() if m.get("as_rms")},
                   progress=progress)
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
