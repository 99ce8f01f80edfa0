"""Exact LayerNorm → RMSNorm conversion of a model object, in memory.

normswap.plan decides per norm what folds where; normswap.jobs does the arithmetic;
convert_model applies it to a live model. normswap.convert_dir does the same for a
checkpoint directory (shard by shard) and verifies the result.

The converted model is a checkpoint of the *original* class: the LayerNorms stay LayerNorms
(weight ones / bias zeros where γ / β were folded), and give the same outputs because their
input is now zero-mean. The "convert" section of the manifest (normswap.json, see
normswap.manifest) records which norms may instead run as RMSNorm kernels, and which of their
γ/β were folded (the RMS form skips those): normswap.manifest.rms_forms(...).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from normswap.errors import NormswapError, require_bool
from normswap.inputs import text_config
from normswap.jobs import keep_dtype, record_infos, run_jobs
from normswap.manifest import rms_forms
from normswap.plan import build_manifest, check_refusals, plan_conversion
from normswap.verify import ProbeConfig, check_weights, model_output, probe_batch


def convert_model(model: torch.nn.Module, keep_gain: bool = False, partial: bool = False, check: bool = True):
    """Convert `model` in place (same class, same outputs); return the manifest.

    check=True runs one short probe batch and measures, at every RMS-eligible norm, how far its
    input is from zero-mean (the manifest's zero_mean_check); a failure raises NormswapError. The
    model then still computes what it computed before (LayerNorm ignores the mean), but the
    architecture data missed a writer, so no norm may run as an RMSNorm."""
    from normswap.walk import require_module

    if getattr(require_module(model), "config", None) is None:
        raise TypeError(f"model: expected a transformers model (with a .config), got {type(model).__name__}")
    for name, flag in (("keep_gain", keep_gain), ("partial", partial), ("check", check)):
        require_bool(name, flag)
    plan = plan_conversion(model, model.config, keep_gain=keep_gain)
    check_refusals(plan, partial)
    apply_plan(model, plan)
    manifest = build_manifest(plan, model.config, partial=partial)
    if check and not any(p.is_meta for p in model.parameters()):
        manifest["zero_mean_check"] = check_zero_mean(model, manifest, probe_batch(model, ProbeConfig(batch=1, seq_len=16)))
    return manifest


def apply_plan(model: torch.nn.Module, plan) -> None:
    """Fold and center `model`'s weights in place as `plan` says (a plan of this model, or of its
    meta-device twin: it names tensors, never holds them), recording each tensor's info in it."""
    if not any(p.is_meta for p in model.parameters()):
        check_weights(model)  # folding a NaN spreads it into every reader: name it here instead
    state = model.state_dict()

    def read(name: str) -> torch.Tensor:
        return state[plan.aliases.get(name, name) if name not in state else name].detach()

    results, infos = run_jobs(plan, read, keep_dtype(None))
    record_infos(plan, infos)
    with torch.no_grad():
        if plan.untie is not None:
            # Every tied tensor gets its own Parameter: with tie_word_embeddings false transformers
            # ties none of the model's pairs on load (a tied MLM decoder bias too), so each must be
            # saved on its own.
            for name in plan.aliases:
                mod_path, attr = name.rsplit(".", 1)
                mod = model.get_submodule(mod_path)
                trainable = getattr(mod, attr).requires_grad
                setattr(mod, attr, torch.nn.Parameter(results[name].clone(), requires_grad=trainable))
            untie_config(model)
        for name, t in results.items():
            model.get_parameter(name).data.copy_(t)


def zero_mean_tolerance(dtype: torch.dtype) -> float:
    """Largest accepted |mean(x)| / rms(x) at a norm's input, per dtype of the stored weights
    (each writer's centering is exact up to one rounding of its weights to that dtype)."""
    return {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2}.get(dtype, 5e-2)


def check_zero_mean(model, manifest, batch: dict, raise_on_failure: bool = True,
                    stored_dtype: torch.dtype | None = None) -> dict:
    """Measure, on a probe batch, |mean(x)| / rms(x) of the input of every RMS-eligible norm (the
    property the conversion promises). Returns the worst ratio, where, the tolerance and a
    verdict; raises NormswapError (unless told not to) when it is over the tolerance."""
    worst: dict[str, float] = {}
    handles = []
    for path in rms_forms(manifest):
        mod = model.get_submodule(path)

        def hook(mod, args, path=path):
            x = args[0].detach().to(torch.float64)
            ratio = x.mean(-1).abs() / x.pow(2).mean(-1).sqrt().clamp_min(1e-30)
            worst[path] = max(worst.get(path, 0.0), float(ratio.max()))

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        model_output(model, batch, raw=True)
    finally:
        for h in handles:
            h.remove()
    dtype = next(model.parameters()).dtype
    tol = zero_mean_tolerance(dtype)
    if stored_dtype is not None:
        tol = max(tol, zero_mean_tolerance(stored_dtype))
    where = max(worst, key=worst.get) if worst else None
    # A norm the probe never ran was not measured, and the outputs compared never depended on it
    # (a tower traced through its get_<x>_features method, which the forward runs only on inputs
    # the probe does not hold): passing it would be a verification of nothing.
    unmeasured = [p for p in rms_forms(manifest) if p not in worst]
    result = {"max_mean_over_rms": worst.get(where, 0.0) if where else 0.0, "where": where,
              "tolerance": tol, "unmeasured": unmeasured,
              "passed": not unmeasured and all(v <= tol for v in worst.values())}
    if raise_on_failure and not result["passed"]:
        raise NormswapError(zero_mean_failure(result) + ": the architecture data misses a writer into the "
                            "residual stream" * (not unmeasured))
    return result


def zero_mean_failure(result: dict) -> str:
    """What a failed check_zero_mean says: a norm the probe never ran, or the worst mean."""
    if result["unmeasured"]:
        more = f" (and {len(result['unmeasured']) - 1} more)" if len(result["unmeasured"]) > 1 else ""
        return (f"the probe batch never ran {result['unmeasured'][0]}{more}, so its input was not checked to be "
                "zero-mean after conversion")
    return (f"the input of {result['where']} is not zero-mean after conversion (|mean|/rms = "
            f"{result['max_mean_over_rms']:.3g}, tolerance {result['tolerance']:g})")


def untie_config(model) -> None:
    """Write tie_word_embeddings: false where transformers reads it, so loading does not re-tie."""
    for cfg in {id(c): c for c in _configs(model.config)}.values():
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):
        model.all_tied_weights_keys = {}


def _configs(config) -> Iterable:
    yield config
    yield text_config(config)
