"""Finding and switching on the residual-add fusions of a patched model (patch(fuse_residual=...)).

normswap.fuse is what runs inside the model's forward (the tagged stream tensor that carries a
norm's precomputed output from the add to the norm); this module drives it: one discovery pass
over the patched norms, the writer hooks, and the whole-model check of the fused model against
the unfused one. Split so that the modules the forward needs (normswap.modules imports fuse)
never import the verification that imports them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from normswap import fuse
from normswap.errors import NormswapError, option_labels
from normswap.modules import NormswapNorm, originals_in_place
from normswap.verify import compare_outputs, model_dtype, model_output, named_outputs, probe_batch


def _norm_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {p: m for p, m in model.named_modules() if isinstance(m, NormswapNorm)}


def discover(model: nn.Module, batch: dict[str, torch.Tensor], writers: list[str]) -> tuple[dict, dict]:
    """One forward pass (eval mode, no grad) with `writers` tagged: (writer -> norm it feeds,
    writer -> why not)."""
    norms = _norm_modules(model)
    recorder = fuse.Recorder({id(m): p for p, m in norms.items()})
    handles = [model.get_submodule(w).register_forward_hook(
        fuse.tagging_hook(lambda w=w: {"_ns_writers": frozenset((w,))})) for w in writers]
    try:
        with fuse.recording(recorder):
            model_output(model, batch)
    finally:
        for h in handles:
            h.remove()
    other = {}
    for w in writers:
        if w in recorder.target:
            continue
        other[w] = recorder.other.get(w, "its sum reaches no norm directly (or the module did not run)")
    return dict(recorder.target), other


def enable(model: nn.Module, pairs: dict[str, str]) -> None:
    """Install the writer hooks for `pairs` (writer path -> norm path; both must exist, the norm
    patched). Replaces a previous fusion of the same model."""
    fuse.disable(model)
    norms = _norm_modules(model)
    fusion = fuse.Fusion(dict(pairs))
    for writer, norm_path in pairs.items():
        norm = norms.get(norm_path)
        if norm is None:
            raise NormswapError(f"cannot fuse {writer} into {norm_path}: not a patched norm of this model")
        try:
            module = model.get_submodule(writer)
        except AttributeError:
            raise NormswapError(f"cannot fuse {writer}: no such module in this model") from None
        fusion.handles.append(module.register_forward_hook(fuse.tagging_hook(lambda n=norm: {"_ns_into": n})))
    model._normswap_fusion = fusion


def find_writers(model: nn.Module) -> list[str]:
    """Paths of the modules in `model` that write into its residual stream, in module order.

    From the data when normswap has it (a pattern names the modules of a *ForCausalLM model; a
    bare base model is matched without the pattern's first component); otherwise, for LayerNorm
    models, the writers that stream discovery (normswap.discover, one traced forward) finds."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    regexes = []
    for pattern in fuse.writer_patterns(model_type):
        for p in (pattern, pattern.split(".", 1)[-1]):
            parts = [re.escape(s) for s in p.split("{i}")]
            regexes.append(re.compile("^" + r"\d+".join(parts) + "$"))
    if regexes:
        return [path for path, _ in model.named_modules() if path and any(r.match(path) for r in regexes)]
    from normswap.discover import discover

    # Discovery reads the original LayerNorm modules, without a fusion's tagged sums.
    fuse.disable(model)
    with originals_in_place(model):
        found = discover(model)
    return [path for path, _ in found.writers]


def fuse_residual(model: nn.Module, *, pairs: dict[str, str] | None = None,
                  batch: dict[str, torch.Tensor] | None = None, check: bool = True,
                  dtype: torch.dtype | None = None) -> fuse.FusionReport:
    """Fuse every residual add that a patched norm reads directly (the module doc).

    pairs: writer -> norm as recorded in a manifest (skips discovery); otherwise the writers come
    from the architecture data and one forward pass on `batch` (default: verify's probe batch)
    finds their norms. check=True compares the fused model's output with the unfused one (the
    dtype's whole-model tolerance) and removes the fusion again if it fails (report.ok False).
    """
    report = fuse.FusionReport()
    if pairs is None or check:
        batch = batch if batch is not None else probe_batch(model)
    if pairs is None:
        writers = find_writers(model)
        if not writers:
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            name = option_labels(("fuse_residual",))["fuse_residual"]
            raise NormswapError(f"{name}: no residual writers known or discovered for model_type "
                                f"{model_type!r} (normswap/residual_writers.toml; discovery covers LayerNorm models)")
        pairs, report.unfused = discover(model, batch, writers)
    before = named_outputs(model, batch) if check else None
    enable(model, pairs)
    report.pairs = dict(pairs)
    if check:
        report.model_check = compare_outputs(dtype or model_dtype(model), before, named_outputs(model, batch))
        if not report.model_check.passed:
            fuse.disable(model)
    return report
