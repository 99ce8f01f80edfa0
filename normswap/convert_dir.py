"""Converting a checkpoint directory (safetensors shard by shard; anything else in memory),
and verifying the result: a stock reload whose logits match the original's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from normswap import jsonsafe
from normswap import streaming as st
from normswap.archs import load_arch
from normswap.carry import carry_over, real_folders
from normswap.convert import apply_plan, check_zero_mean, zero_mean_failure
from normswap.errors import NormswapError
from normswap.jobs import keep_dtype, record_infos
from normswap.manifest import carried_record, new_manifest, rms_forms, write_manifest
from normswap.plan import build_manifest, check_refusals, plan_conversion
from normswap.progress import ProgressFn
from normswap.verify import (
    ProbeConfig,
    check_reference_output,
    check_weights,
    compare_outputs,
    logits_rtol,
    named_outputs,
    probe_batch,
)


def convert_directory(
    source,
    out_dir: str | os.PathLike,
    keep_gain: bool = False,
    partial: bool = False,
    dtype: torch.dtype | None = None,
    streaming: bool = True,
    progress: bool | ProgressFn = False,
    config=None,
    manifest: bool = True,
    planned: tuple | None = None,
    target: str | os.PathLike | None = None,
    unused=None,
) -> dict:
    """Convert the checkpoint `source` (a normswap.loading.ModelSource) into the existing empty
    directory `out_dir`: weights, config (untied, dtype), tokenizer and other files, and (unless
    manifest=False: the caller writes it once, verified) the manifest. Returns the convert section.
    Safetensors checkpoints are converted shard by shard; anything else is loaded whole.
    config: loading.load_config(source), and planned: (meta model, plan) with that keep_gain and
    its refusals checked, when the caller already has them (each is built once per conversion).
    target: where `out_dir` (a staging folder) will be published: not carried over from the source
    when the source holds it. unused: what loading.check_stored_tensors returned for the source,
    when the caller gave `planned` (it checked them). The tensors of modules the class does not
    build (UnusedTensors.not_built: a head or pooler it was saved with) are not written: the
    conversion changes the stream those modules read, and its verification covers only the class
    it builds, so carried as they were they would compute something else, unverified, in a class
    that builds them. The buffers no module reads are carried as they are stored, as every name
    transformers drops on load is (a model loaded whole, GGUF or pickled, saves none of them). The
    section's "dropped" names the source's tensors the output does not hold."""
    from normswap import loading

    out = Path(out_dir)
    config = loading.load_config(source) if config is None else config
    if planned is None:
        meta = loading.build_meta_model(source, config)
        unused = loading.check_stored_tensors(source, config, meta)
        plan = plan_conversion(meta, config, keep_gain=keep_gain)
        check_refusals(plan, partial)
    else:
        meta, plan = planned
    policy = keep_dtype(dtype)
    has_safetensors = source.gguf_file is None and (
        (source.path / st.SINGLE_NAME).is_file() or (source.path / st.INDEX_NAME).is_file()
    )
    names = list(meta.state_dict().keys())
    arch = load_arch(plan.model_type)
    if has_safetensors and not _stored_by_name(source, plan, names, arch.prefix if arch else ""):
        # transformers renames this checkpoint's tensors when it loads them (ViT's stored
        # encoder.layer.0.output.dense is the model's layers.0.mlp.fc2): the shard-by-shard path
        # reads tensors by the model's names, so convert in memory and let transformers save
        # them under the stored names again.
        has_safetensors = False
    if has_safetensors:
        if plan.untie is not None:
            reader = st.CheckpointReader(source.path, names, prefix=arch.prefix if arch else "")
            _refuse_a_head_stored_apart(source, plan.untie, lambda name: reader.read(name) if name in reader.raw else None)
        dropped = list(unused.not_built) if unused is not None else []
        # by their stored names: a head kept under a name the load renames (legacy LayerNorm.gamma
        # and .beta, which transformers loads as .weight and .bias) was written out under it
        stored = loading.stored_keys_of(meta, st.checkpoint_layout(source.path)[1], dropped)
        infos = st.convert_files(
            source.path, out, plan, names, prefix=arch.prefix if arch else "",
            out_dtype=policy, streaming=streaming, progress=progress, dropped=stored,
        )
        record_infos(plan, infos)
        cfg = jsonsafe.read_or_refuse(source.path / "config.json", what="config.json")  # load_config read it: changed since?
        if plan.untie is not None:
            _untie_config_dict(cfg)
        if dtype is not None:
            for key in ("dtype", "torch_dtype"):
                if key in cfg or key == "dtype":
                    cfg[key] = str(dtype).replace("torch.", "")
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    else:  # GGUF or pickled weights: load whole, convert in memory, save with transformers
        # With --dtype, load in float64 and cast after the conversion: loading straight into the
        # target dtype would round the weights once before the float64 arithmetic and once after.
        model = loading.load_model(source, dtype=torch.float64 if dtype is not None else None, config=config,
                                   meta=meta)
        if plan.untie is not None and source.gguf_file is None:  # pickled: transformers left them untied or tied
            _refuse_a_head_stored_apart(source, plan.untie, model.state_dict().get)
        apply_plan(model, plan)  # the plan built above from the meta model: it names tensors only
        if dtype is not None:
            model.to(dtype)
        model.save_pretrained(out)
        # what the load dropped (its own record: a GGUF's names are not checked before it): none is saved
        dropped = [name for u in loading.unused_tensors_of(model) for name in (*u.not_built, *u.buffers)]
    carry_over(source, out, target=target)  # tokenizer, README, chat template, code: by patch --out's rule
    # "dropped": the source's tensors the output does not hold, so that the folder itself says a head
    # it was saved with is gone (the run's report alone said it, and was not kept)
    section = build_manifest(plan, config, partial=partial,
                             extra={"source": str(source.ref), "dropped": dropped})
    # Only a convert section: a patch section of the source (if any) was verified against the
    # unconverted weights and is not carried (see normswap.manifest).
    if manifest:
        write_manifest(out, new_manifest(convert=section, carried_folders=carried_record(out, real_folders(out))))
    return section


def _stored_by_name(source, plan, names: list[str], prefix: str) -> bool:
    """Every tensor the plan reads is stored under the model's own name (or the bare base model's)."""
    reader = st.CheckpointReader(source.path, names, prefix=prefix)
    return all(n in reader.raw or plan.aliases.get(n) in reader.raw for job in plan.jobs for n in job.inputs)


def _refuse_a_head_stored_apart(source, untie: tuple[str, str], read) -> None:
    """config.json ties the head to the embedding (tie_word_embeddings), yet the checkpoint stores
    the head with values of its own: transformers then loads the two untied (it warns so), while
    the plan folds the embedding's values into the head. The conversion would not be of the model
    transformers loads; its verification refused it with only "logits differ". A head stored with
    the embedding's own values (an older save of a tied model) is tied, and converts.
    read(name): the tensor as stored (safetensors) or loaded (pickled weights), None when absent."""
    head, table = untie
    a, b = read(head), read(table)
    if a is None or b is None:
        return
    if a.shape != b.shape or not torch.equal(a, b):
        raise NormswapError(f"{source.path / 'config.json'}: tie_word_embeddings is true, but the checkpoint stores "
                            f"{head} apart from {table}, with other values (transformers loads them untied); set "
                            "\"tie_word_embeddings\": false there to convert it")


def _untie_config_dict(cfg: dict) -> None:
    cfg["tie_word_embeddings"] = False
    for sub in ("text_config",):
        if isinstance(cfg.get(sub), dict) and "tie_word_embeddings" in cfg[sub]:
            cfg[sub]["tie_word_embeddings"] = False


def _run_as_rms(model, manifest) -> None:
    """The speedup path on a converted model: every zero-mean LayerNorm as an RMS norm (reference
    backend: float64 stays float64), every other norm left alone. In place, unverified: the
    caller compares logits."""
    from normswap.swap import PatchConfig, patch

    forms = rms_forms(manifest)
    if forms:
        patch(model, PatchConfig("reference", paths=tuple(forms), rms_forms=forms), verify=False)


def verify_conversion(source, converted_dir: str | os.PathLike, manifest: dict, batch=None,
                      config=None, meta=None) -> dict:
    """Reload the converted directory with stock transformers; compare its logits (and those of
    its RMS-patched form; every output of a model without logits) with the original model's on a
    probe batch. Raises when over tolerance.
    config: loading.load_config(source), and meta: loading.build_meta_model(source, config), when
    the caller already has them (the load of the original then builds no meta model of its own)."""
    from normswap import loading

    config = loading.load_config(source) if config is None else config
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    converted_source = loading.resolve(converted_dir)
    conv_cfg = loading.load_config(converted_source)
    conv_dtype = getattr(conv_cfg, "dtype", None) or stored
    if isinstance(conv_dtype, str):
        conv_dtype = getattr(torch, conv_dtype, torch.float32)
    if isinstance(stored, str):
        stored = getattr(torch, stored, torch.float32)
    run_dtype = torch.float64 if conv_dtype == torch.float64 and stored == torch.float64 else torch.float32
    if batch is None:
        meta = loading.build_meta_model(source, config) if meta is None else meta
        batch = probe_batch(meta, ProbeConfig(batch=2, seq_len=32))
    original = loading.load_model(source, dtype=run_dtype, config=config, meta=meta)
    check_weights(original, str(source.ref))  # a NaN in the input is the input's, not the conversion's
    ref = named_outputs(original, batch, raw=True)
    for name, t in ref.items():
        check_reference_output(name, t, f"{source.ref} (the original)")
    del original
    converted = loading.load_model(converted_source, dtype=run_dtype, config=conv_cfg)
    got = named_outputs(converted, batch, raw=True)
    zero_mean = check_zero_mean(converted, manifest, batch, raise_on_failure=False,
                                stored_dtype=conv_dtype if isinstance(conv_dtype, torch.dtype) else None)
    _run_as_rms(converted, manifest)
    got_rms = named_outputs(converted, batch, raw=True)
    tol = logits_rtol(conv_dtype if isinstance(conv_dtype, torch.dtype) else torch.float32)
    if run_dtype == torch.float32:
        tol = max(tol, 1e-4)
    # The RMS path runs normswap's modules with the reference backend: float64 stays float64, so
    # it is held to the same gate as the stock reload.
    tol_rms = tol
    # The check patch runs too (verify.compare_outputs): each output against its own largest
    # magnitude, a pooler's error on the pooler's scale, not on the hidden state's.
    check, check_rms = compare_outputs(run_dtype, ref, got, tol), compare_outputs(run_dtype, ref, got_rms, tol_rms)
    err, err_rms = check.max_rel_diff, check_rms.max_rel_diff
    # "probe": the main input's shape (ids, an image, a spectrogram, a waveform); "compared": the
    # outputs the errors are of ("logits", or every output of a model without: "last_hidden_state,
    # pooler_output"); each error is max|Δ| / max|value| of one output, the max_rel_logit_error
    # keys (kept for scripts) the largest over them, "outputs" each one's
    result = {"probe": list(next(iter(batch.values())).shape), "compute_dtype": str(run_dtype).replace("torch.", ""),
              "compared": check.kind,
              "max_rel_logit_error": err, "max_rel_logit_error_rms": err_rms, "tolerance": tol,
              "tolerance_rms": tol_rms,
              "outputs": {name: {"max_rel_error": check.rel_diff(name), "max_rel_error_rms": check_rms.rel_diff(name)}
                          for name in check.outputs},
              "zero_mean": zero_mean,
              "passed": check.passed and check_rms.passed and zero_mean["passed"]}
    if not zero_mean["passed"]:
        raise NormswapError(f"verification failed: {zero_mean_failure(zero_mean)}; nothing was written")
    if not result["passed"]:
        bad = [n for n in check.outputs if not (check.outputs[n]["passed"] and check_rms.outputs[n]["passed"])]
        worst = max(bad, key=lambda n: max(result["outputs"][n].values()))
        o = result["outputs"][worst]
        more = f" (and {', '.join(b for b in bad if b != worst)})" if len(bad) > 1 else ""
        raise NormswapError(
            f"verification failed: the converted model's {worst}{more} differs by {o['max_rel_error']:.3g} of its own "
            f"largest magnitude as LayerNorms (tolerance {tol:g}) and by {o['max_rel_error_rms']:.3g} as RMSNorms "
            f"(tolerance {tol_rms:g}); nothing was written"
        )
    return result
