"""The arms of a LayerNorm -> RMSNorm experiment: how each one's starting model is made.

An arm is `<transform>[+<training>]`:
- original: the model as it is (its norms running on the recipe's backend);
- exact: normswap's exact conversion (centre the residual-stream writers, fold γ/β into the
  readers), then every converted LayerNorm runs as an RMSNorm (normswap.patch with rms_forms=normswap.manifest.rms_forms(...));
- approx: every LayerNorm becomes an RMSNorm that keeps γ and drops the centering and β
  (the β tensor is zeroed and frozen: the arm has no β);
- approx-bias: the same, keeping β;
and the training: none (evaluated at step 0 only), `ft` (the language-modelling loss on the
recipe's text), or `distill` (KL(original ‖ arm) over the logits, the original as teacher).
"""

from __future__ import annotations

import copy

import torch

from normswap.dtypes import parse_dtype
from normswap.errors import NormswapError
from normswap.experiment.recipe import parse_arm


def _layer_norm_paths(model) -> list[str]:
    from normswap import walk

    return [f.path for f in walk.find_norms(model, strict=False, warn=False)
            if f.spec is not None and f.spec.kind == "layer"]


def check_arms(original: torch.nn.Module, arms: list[str]) -> None:
    """Refuse, before any arm runs, what build_arm would refuse for one of `arms` midway through a
    run (after hours of other arms): a model with no LayerNorm, or one the exact conversion
    cannot convert. Reads `original` only (the conversion plan traces one forward, changes nothing)."""
    from normswap.plan import check_refusals, plan_conversion

    planned = False
    for arm in arms:
        transform, _training = parse_arm(arm)
        if transform in ("approx", "approx-bias") and not _layer_norm_paths(original):
            raise NormswapError(f"{arm}: the model has no LayerNorm to replace")
        if transform == "exact" and not planned:
            check_refusals(plan_conversion(original, original.config), partial=False)
            planned = True


def build_arm(original: torch.nn.Module, arm: str, impl: str, dtype: str = "fp32") -> torch.nn.Module:
    """A new model for `arm`, made from a copy of `original` (which is left untouched)."""
    from normswap.modules import RmsForm
    from normswap.swap import patch

    transform, _training = parse_arm(arm)
    model = copy.deepcopy(original)
    if transform == "exact":
        from normswap.convert import convert_model
        from normswap.manifest import rms_forms

        forms = rms_forms(convert_model(model))
        # The speedup path, as `normswap patch` takes it on a converted checkpoint (and verified
        # as there): the zero-mean LayerNorms run as RMS norms.
        patch(model, impl, filter_fn=lambda _m, path: path in forms, rms_forms=forms)
    elif transform in ("approx", "approx-bias"):
        keep_bias = transform == "approx-bias"
        paths = _layer_norm_paths(model)
        if not paths:
            raise NormswapError(f"{arm}: the model has no LayerNorm to replace")
        if not keep_bias:
            with torch.no_grad():
                for path in paths:
                    bias = getattr(model.get_submodule(path), "bias", None)
                    if bias is not None:
                        bias.zero_()
        # No numeric proof: these modules are meant to compute something else than the LayerNorm.
        patch(model, impl, rms_forms={p: RmsForm(weight=True, bias=keep_bias) for p in paths}, verify=False)
    # Every norm not swapped above runs on the recipe's backend too (already-patched ones are skipped).
    patch(model, impl)
    _freeze_unused(model)
    return model.to(parse_dtype(dtype))


def _freeze_unused(model) -> None:
    """γ/β tensors an RMS form skips (folded by the exact conversion, dropped by approx) are not
    part of the arm's model: frozen, so no optimizer touches them and DDP does not wait for
    gradients that never come."""
    from normswap.modules import NormswapLayerNorm

    for mod in model.modules():
        form = getattr(mod, "rms_form", None) if isinstance(mod, NormswapLayerNorm) else None
        if form is None:
            continue
        for used, tensor in ((form.weight, mod.norm_weight), (form.bias, mod.norm_bias)):
            if not used and tensor is not None:
                tensor.requires_grad_(False)
