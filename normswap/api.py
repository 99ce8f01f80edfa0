"""The checkpoint-level API: one call per command, on a model reference (a local directory, a .gguf
file, a cached hub id, or the embedded default), doing everything the command does.

    patch_checkpoint(model, impl, out=..., in_place=..., ...)   `normswap patch`
    convert_checkpoint(model, out, ...)                          `normswap convert --to rms`
    evaluate_checkpoint(model, EvalSettings(data, ...))          `normswap ppl`
    diff_checkpoints(a, b | patched=impl, settings=...)          `normswap diff`
    bench_checkpoint(model, impls, out=..., ...)                 `normswap bench`

The other commands' calls live beside what they do: `normswap scan` is normswap.scan.scan,
`normswap tune` normswap.kernels.tune.tune_launches (`--show`: launch_table_status),
`normswap experiment` normswap.experiment.run_experiment, and `normswap demo` is scan plus
patch_checkpoint(..., evaluation=demo_evaluation(max_tokens)).

Each returns a result whose to_dict() is the command's --json document, and takes a progress
callback progress(stage, done, total) (normswap.progress). Bad input raises NormswapError with a
one-line message, before any weights are read where it can be told from the config. The command
line only parses options, calls one of these and renders the result (normswap/cli/).

In half precision the diffs carry a noise floor: the original loaded again in float32 is scored on
the same windows, and the patch is judged against the original's own distance from it
(normswap.evaluate.NoiseFloor).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from normswap.bench import BenchResult
from normswap.dtypes import parse_dtype
from normswap.errors import (
    Metavar,
    NormswapError,
    is_flag,
    option_labels,
    option_setting,
    require_bool,
    using_option_names,
)
from normswap.evaluate import HALF_DTYPES, SCORING_OPTIONS, DiffResult, PerplexityResult
from normswap.fileio import check_writable
from normswap.progress import ProgressFn, require_progress_fn, step
from normswap.swap import PatchReport, VerificationError

# ---------------------------------------------------------------------------------------------
# Evaluation settings and results
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalSettings:
    """What to score and how to cut it into windows (see normswap.evaluate.perplexity)."""

    data: str | os.PathLike  # a text file, .jsonl, a directory of .txt files, a saved datasets dataset
    text_field: str = "text"
    max_length: int | None = None  # window length; default and cap: the model's context
    stride: int | None = None  # default: half the window
    max_tokens: int | None = None  # score only the first tokens of the data
    batch_size: int = 1
    # what messages call max_length, stride, max_tokens, batch_size and text_field (SCORING_OPTIONS):
    # the parameter names, or the flags a command line took them from (ppl's --max-length, patch's
    # --eval-max-*). The entry point given these settings installs them (_using_entry_point_names):
    # everything below reads them from there (errors.option_labels), none takes them as a parameter.
    option_names: Mapping[str, str] | None = None

    def check(self) -> None:
        """The checks that need no model (window options)."""
        from normswap.evaluate import check_window_options

        if not isinstance(self.data, str | os.PathLike):
            raise TypeError(f"EvalSettings.data: expected a data path (str or path), got {type(self.data).__name__}")
        with using_option_names(self.option_names):  # as an entry point given them would name them
            check_window_options(self.max_length, self.stride, self.max_tokens, self.batch_size)

    @property
    def window_kwargs(self) -> dict[str, Any]:
        return dict(max_length=self.max_length, stride=self.stride, max_tokens=self.max_tokens,
                    batch_size=self.batch_size, text_field=self.text_field)


def _using_entry_point_names(options, option_names, settings):
    """Installs (errors.using_option_names) the names an api entry point's messages use: its own
    options', and its evaluation settings' (their field names unless settings.option_names, or the
    entry point's option_names, renames them; the settings' own win: the demo's --max-tokens over
    patch's --eval-max-tokens). Every field is named, so a message deep in the scoring
    (errors.way_out) knows the caller has it. evaluate._using_given_scoring_names is the scoring
    functions' own: the scoring options only, and only when their caller names them."""
    names = option_labels(options, option_names)
    if isinstance(settings, EvalSettings):  # else _require_settings refuses it
        names = option_labels(SCORING_OPTIONS) | names | option_labels((), settings.option_names)
    return using_option_names(names)


def _require_settings(name: str, value, optional: bool = False) -> EvalSettings | None:
    """`value` when it is an EvalSettings (or None, when optional), checked (EvalSettings.check:
    every entry point's options are checked before anything is read), else a TypeError naming
    `name`."""
    if not (isinstance(value, EvalSettings) or (optional and value is None)):
        raise TypeError(f"{name}: expected normswap.EvalSettings(data, ...), got {type(value).__name__}")
    if value is not None:
        value.check()
    return value


def _require_flags(**flags) -> None:
    """Each flag True or False (None too: a default decided later); "no" would mean yes."""
    for name, value in flags.items():
        if value is not None:
            require_bool(name, value)


def _require_path(name: str, value, optional: bool = False, what: str = "folder") -> None:
    if not (isinstance(value, str | os.PathLike) or (optional and value is None)):
        raise TypeError(f"{name}: expected a {what} path (str or path), got {type(value).__name__}")


# What `normswap demo` scores: the embedded text (Genesis, KJV), in windows of at most this many
# tokens (short enough for the CPU interpreter).
DEMO_TEXT = Path(__file__).resolve().parent / "data" / "genesis-kjv.txt"
DEMO_WINDOW = 256


def demo_evaluation(max_tokens: int, *, option_names: Mapping[str, str] | None = None) -> EvalSettings:
    """The evaluation `normswap demo` passes to patch_checkpoint: the first max_tokens tokens of
    DEMO_TEXT in windows of min(DEMO_WINDOW, max_tokens). A max_tokens that cannot be scored
    raises BadInputError naming it as option_names says (the demo's {"max_tokens": "--max-tokens"}),
    before anything is loaded: the window is derived from it, so it is checked first (else the
    message would name a window length the user never gave)."""
    from normswap.evaluate import check_window_options

    with using_option_names(option_names):
        check_window_options(None, None, max_tokens)
    return EvalSettings(DEMO_TEXT, max_length=min(DEMO_WINDOW, max_tokens), max_tokens=max_tokens,
                        option_names=option_names)


@dataclass(frozen=True)
class CheckpointPerplexity:
    """`normswap ppl`: the perplexity of one checkpoint."""

    model: str
    data: str
    dtype: str
    result: PerplexityResult
    # The implementation normswap ran the model's norms with (the patch its normswap.json records);
    # None: the model's own modules.
    impl: str | None = None
    device: str = field(kw_only=True)  # where it ran: loading.device_label's name, as PatchResult's
    # what its load dropped that cannot change what it computes (loading.unused_tensors)
    unused_tensors: list = field(default_factory=list, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "impl": self.impl, "data": self.data, "dtype": self.dtype,
                "device": self.device, **self.result.to_dict(), **_unused_dict(self.unused_tensors)}


@dataclass(frozen=True)
class CheckpointDiff:
    """`normswap diff` and `normswap patch --eval`: two models on the same windows (B is A patched
    in memory when model_b says `--patched IMPL` / `--impl IMPL`)."""

    model_a: str
    model_b: str
    data: str
    dtype: str
    result: DiffResult
    # As CheckpointPerplexity.impl, per model: B's is also the impl it was patched with in memory.
    impl_a: str | None = None
    impl_b: str | None = None
    device: str = field(kw_only=True)  # where both ran (CheckpointPerplexity's)
    unused_tensors: list = field(default_factory=list, kw_only=True)  # A's and B's (CheckpointPerplexity's)

    def to_dict(self) -> dict[str, Any]:
        return {"model_a": self.model_a, "model_b": self.model_b, "impl_a": self.impl_a, "impl_b": self.impl_b,
                "data": self.data, "dtype": self.dtype, "device": self.device, **self.result.to_dict(),
                **_unused_dict(self.unused_tensors)}


@dataclass
class PatchResult:
    """`normswap patch`: the verified report, where it was saved, and the --eval diff."""

    model: str
    device: str  # where it ran: loading.device_label's name for parse_device's answer
    report: PatchReport
    saved_to: Path | None = None
    eval: CheckpointDiff | None = None
    unused_tensors: list = field(default_factory=list)  # CheckpointPerplexity's: not in the output either

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, **self.report.to_dict(), "device": self.device,
                "saved_to": str(self.saved_to) if self.saved_to else None,
                "eval": self.eval.to_dict() if self.eval else None, **_unused_dict(self.unused_tensors)}


@dataclass
class ConvertResult:
    """`normswap convert`: the convert section of the manifest (per norm what was folded, kept or
    refused and why; the verification), where it was written, or why nothing was."""

    model: str
    section: dict[str, Any] = field(default_factory=dict)
    out: Path | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)  # for the user, not part of the report
    # CheckpointPerplexity's; those of modules the class does not build are not written (convert_directory)
    unused_tensors: list = field(default_factory=list)

    @property
    def saved_to(self) -> Path | None:
        """Where the checkpoint was written: the name PatchResult and CheckpointBench use."""
        return self.out

    def to_dict(self) -> dict[str, Any]:
        # "saved_to" as in patch's and bench's reports; "out", its older name here, stays for
        # scripts that read it.
        saved = str(self.out) if self.out else None
        d = dict(self.section, model=self.model, saved_to=saved, out=saved, **_unused_dict(self.unused_tensors))
        if self.error is not None:
            d["error"] = self.error
        return d


@dataclass
class CheckpointBench:
    """`normswap bench`: the measurements (normswap.bench.BenchResult, what the results file holds)
    and the file they were written to."""

    result: BenchResult
    saved_to: Path

    def to_dict(self) -> dict[str, Any]:
        return {**self.result.to_dict(), "saved_to": str(self.saved_to)}


class ConversionRefused(NormswapError):
    """Some norm cannot be converted (without partial=True) or none can; nothing was written.
    `.result` holds the per-norm report with the reasons."""

    def __init__(self, message: str, result: ConvertResult):
        super().__init__(message)
        self.result = result


# ---------------------------------------------------------------------------------------------
# patch
# ---------------------------------------------------------------------------------------------


def patch_checkpoint(
    model: str | os.PathLike,
    impl: str = "triton",
    *,
    out: str | os.PathLike | None = None,
    in_place: bool = False,
    only: str | None = None,
    exclude: str | None = None,
    dtype: str | torch.dtype | None = None,
    device: str = "auto",
    strict: bool = False,
    force: bool = False,
    max_shard_size: str | int = "5GB",
    rms: bool = True,
    fuse_residual: bool = False,
    evaluation: EvalSettings | None = None,
    noise_floor: bool | None = None,
    progress: ProgressFn | None = None,
    option_names: Mapping[str, str] | None = None,
) -> PatchResult:
    """Load `model`, swap every recognised norm for an `impl` module, verify each one and the
    whole model, optionally diff against the model as it loads (`evaluation`: the original, or a
    folder's recorded patch, as evaluate/diff_checkpoints score it) and save (`out`, or
    `in_place` over the model's own directory, atomically).

    only/exclude: regular expressions on module paths. rms: run the LayerNorms a `normswap
    convert` manifest marks zero-mean as RMS norms. fuse_residual: also fuse each residual add
    into the norm that reads the sum (normswap.fuse). noise_floor (default: in half precision)
    adds the original's float32 self to the evaluation. A failed verification raises
    VerificationError; its `.result` is this call's PatchResult (nothing was saved).
    option_names: what messages call these parameters (default: their names; the CLI passes its
    flags, {"in_place": "--in-place", ...}), here and in everything the call runs.
    """
    with contextlib.ExitStack() as held:
        held.enter_context(_using_entry_point_names(PATCH_OPTIONS, option_names, evaluation))
        return _patch_checkpoint(held, model, impl, out, in_place, only, exclude, dtype, device, strict, force,
                                 max_shard_size, rms, fuse_residual, evaluation, noise_floor, progress)


# The options patch_checkpoint's messages name (and those of what it calls: checkpoint, swap, the
# evaluation), as option_names renames them.
PATCH_OPTIONS = ("impl", "out", "in_place", "only", "exclude", "dtype", "force", "max_shard_size", "rms",
                 "fuse_residual", "evaluation")


def _patch_checkpoint(held, model, impl, out, in_place, only, exclude, dtype, device, strict, force,
                      max_shard_size, rms, fuse_residual, evaluation, noise_floor, progress) -> PatchResult:
    from normswap import walk
    from normswap.backends import get_backend
    from normswap.checkpoint import (
        check_out_target,
        check_replaceable,
        parse_shard_size,
        recover_beside,
        save_patched,
        target_lock,
    )
    from normswap.loading import (
        apply_recorded_patch,
        build_meta_model,
        device_label,
        load_config,
        load_model,
        load_tokenizer,
        parse_device,
        resolve,
        unused_tensors_of,
    )
    from normswap.manifest import read_manifest_if_any, rms_forms
    from normswap.swap import patch, regex_filter

    _require_path("out", out, optional=True)
    require_progress_fn(progress)
    _require_settings("evaluation", evaluation, optional=True)
    _require_flags(in_place=in_place, strict=strict, force=force, rms=rms, fuse_residual=fuse_residual,
                   noise_floor=noise_floor)
    n = option_labels(PATCH_OPTIONS)  # as patch_checkpoint installed them
    if out is not None and in_place:
        raise NormswapError(f"{n['out']} and {n['in_place']} are exclusive; pick one")
    filter_fn = regex_filter(only, exclude)
    parse_shard_size(max_shard_size)  # every option is checked before the (long) load
    device = parse_device(device)
    get_backend(impl)  # an unavailable implementation fails before the model is loaded
    torch_dtype = parse_dtype(dtype)
    if in_place and isinstance(model, str | os.PathLike) and str(model).strip():
        # a run killed while publishing (no atomic exchange here) may have left the folder aside
        recover_beside(Path(model).expanduser().resolve())
    source = resolve(model, progress=progress)
    target = None
    if in_place:
        if source.gguf_file or not Path(model).expanduser().is_dir():
            raise NormswapError(f"{n['in_place']} rewrites a local safetensors model directory; {model} is not "
                                f"one (use {option_setting(n['out'], Metavar('DIR'))})")
        target = source.path
        check_replaceable(target, in_place=True)  # before the load: the save would be refused after it
        # A second --in-place run is refused before it loads anything. Taken before the folder is
        # read: a run that held it may just have published a new folder (convert --force), and
        # what the save keeps from the manifest must be what the load reads.
        held.enter_context(target_lock(target))
    config = load_config(source, progress)  # read once: the checks below and the load use it (a GGUF's takes seconds)
    # The source's manifest too, before the (long) load: a malformed one, or a newer normswap's
    # layout, is refused before any work. Read once: its convert section, the patch --eval
    # compares with and what the save keeps all come from this one reading.
    manifest = None if source.gguf_file else read_manifest_if_any(source.path)
    converted = None if manifest is None else manifest.get("convert")
    meta = None  # built here only for --in-place or a filter; else the load's check of the stored tensors builds it
    if in_place:
        _refuse_lossy_in_place(source, config, torch_dtype)
        meta = _refuse_dropping_in_place(source, config)
        check_writable(target, folder=True)  # what check_out_target checks of an --out
    elif out is not None:
        target = check_out_target(out, source, force, "patched", f"use {option_setting(n['in_place'], True)} for that")
    if target is not None:
        if not in_place and target.parent.is_dir():
            # a second run for this --out is refused now, not after its load and proof; the save takes
            # the lock again (re-entrant), and for a deep new --out only then
            held.enter_context(target_lock(target))
    scoring = _prepare_scoring(evaluation, source, [config], progress=progress) if evaluation is not None else None
    baseline = _eval_baseline(source, manifest) if scoring else None
    if filter_fn is not None:  # on the meta model: a filter that matches nothing fails before the (long) load
        meta = build_meta_model(source, config) if meta is None else meta
        if not any(f.spec is not None and filter_fn(None, f.path) for f in walk.find_norms(meta, warn=False)):
            raise NormswapError(f"{n['only']}/{n['exclude']} leave no recognised norm to patch in {model}")

    if out is not None and source.gguf_file:
        # the tokenizer the output carries (carry_over writes it after the save), made now from the
        # config's parse, which the load lets go: read after it, the file was parsed once more
        with contextlib.suppress(NormswapError):  # none usable: the output carries none, as before
            load_tokenizer(source)
    step(progress, "load", 0, 1)
    m = load_model(source, dtype=torch_dtype, device=device, config=config, meta=meta)
    del meta
    step(progress, "load", 1, 1)
    if in_place:  # again from what the load dropped, before anything is written: the check before the
        # load reads no names of sharded pickled weights (its index's are not what the load reads), and
        # a BertForPreTraining's pooler and head stored so were gone from the folder after --in-place
        _refuse_dropping(source, getattr(m, "normswap_unused_tensors", None))

    original = copy.deepcopy(m) if scoring else None
    if baseline is not None:  # no bar: a swap without the per-module proof takes no time
        apply_recorded_patch(original, source.ref, baseline)
    forms = rms_forms(converted) if rms and converted is not None else {}
    ran_on = device_label(device)
    try:
        report = patch(m, impl, filter_fn=filter_fn, strict=strict, rms_forms=forms, fuse_residual=fuse_residual,
                       progress=progress)
    except VerificationError as e:
        e.result = PatchResult(str(model), ran_on, e.report, unused_tensors=unused_tensors_of(m))
        raise
    result = PatchResult(str(model), ran_on, report, unused_tensors=unused_tensors_of(m))
    if scoring:
        corpus, tokenizer = scoring
        reference = _float32_reference(source, config, m, device, noise_floor, progress)
        diff = _diff(original, m, tokenizer, corpus, evaluation, reference, progress)
        del original, reference
        result.eval = CheckpointDiff(str(model), f"{model} --impl {impl}", str(evaluation.data), _dtype_name(m), diff,
                                     impl_a=baseline["impl"] if baseline else None, impl_b=impl, device=result.device)
    if target is not None:
        result.saved_to = save_patched(m, report, target, source=source, conversion=converted,
                                       replace=in_place or force, max_shard_size=max_shard_size, progress=progress)
    return result


def _eval_baseline(source, manifest: dict | None) -> dict | None:
    """The patch --eval's A runs: the one the folder's normswap.json records (None: none);
    `manifest`: that file as the caller read it (None: there is none). A is the model as the
    folder loads, as ppl and diff score it and normswap.load loads it; the new patch replaces the
    recorded one from the stock weights, so a stock A would credit (or blame) the new patch for
    what the recorded one already did. Checked before the weights load: a recorded patch that
    cannot run here leaves nothing honest to compare with."""
    from normswap.loading import runnable_patch

    name = option_labels(PATCH_OPTIONS)["evaluation"]
    return runnable_patch(None if manifest is None else manifest.get("patch"), source.ref, None,
                          way_out=f"{name} compares the new patch with the model as that folder loads, so there "
                          f"is nothing to compare it with here; drop {name}, or run where the recorded patch runs")


def _refuse_lossy_in_place(source, config, dtype: torch.dtype | None) -> None:
    """--in-place saves in the dtype the model was loaded in: with another --dtype it would
    rewrite the user's only copy of the weights (fp32 -> bf16 cannot be undone)."""
    if dtype is None:
        return
    stored = getattr(config, "dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if isinstance(stored, torch.dtype) and stored != dtype:
        name = str(stored).removeprefix("torch.")
        n = option_labels(PATCH_OPTIONS)
        raise NormswapError(f"{n['in_place']} with {n['dtype']} would rewrite the {name} weights of {source.ref} as "
                            f"{str(dtype).removeprefix('torch.')}; save the conversion with "
                            f"{option_setting(n['out'], Metavar('DIR'))} instead")


def _refuse_dropping_in_place(source, config):
    """--in-place rewrites the model's own folder with what the class loads: stored tensors of
    modules it does not build (bert-base's pooler and next-sentence head under BertForMaskedLM,
    loading.unused_tensors) would be gone from the user's only copy, though another class (the
    one they were saved with) reads them. Refused before the load, naming them. Returns the meta
    model it built, for the load (buffers no module reads are no loss: those are dropped)."""
    from normswap.loading import build_meta_model, check_stored_tensors

    meta = build_meta_model(source, config)
    _refuse_dropping(source, check_stored_tensors(source, config, meta))
    return meta


def _refuse_dropping(source, unused) -> None:
    """_refuse_dropping_in_place's refusal, given what a check of the stored tensors or the load
    (loading.UnusedTensors, None) found."""
    from normswap.loading import first_names

    if unused is not None and unused.not_built:
        n = option_labels(PATCH_OPTIONS)
        names = unused.not_built
        # the class that reads them, where one class holds them all with the model's own tensors
        reads = f"which {unused.saved_from} reads" if unused.saved_from else "which the class they were saved with reads"
        raise NormswapError(f"{n['in_place']} would remove from {source.ref} {len(names)} stored tensor(s) of modules "
                            f"{unused.model_class} does not build ({first_names(names)}), {reads}; write the patched model with "
                            f"{option_setting(n['out'], Metavar('DIR'))} instead")


# ---------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------


def convert_checkpoint(
    model: str | os.PathLike,
    out: str | os.PathLike,
    *,
    keep_gain: bool = False,
    partial: bool = False,
    dtype: str | torch.dtype | None = None,
    force: bool = False,
    progress: ProgressFn | None = None,
    option_names: Mapping[str, str] | None = None,
) -> ConvertResult:
    """Exact LayerNorm -> RMSNorm of a checkpoint into `out`: plan (from the config alone), fold
    shard by shard, reload with stock transformers and compare logits, write the manifest once,
    publish atomically. A model that cannot be converted (some norm, without partial=True)
    raises ConversionRefused with the per-norm report; nothing is written. option_names: what
    messages call these parameters (patch_checkpoint's)."""
    with using_option_names(option_labels(CONVERT_OPTIONS, option_names)):
        return _convert_checkpoint(model, out, keep_gain, partial, dtype, force, progress)


# The options convert_checkpoint's messages name, as option_names renames them.
CONVERT_OPTIONS = ("out", "keep_gain", "partial", "dtype", "force")


def _convert_checkpoint(model, out, keep_gain, partial, dtype, force, progress) -> ConvertResult:
    from normswap.carry import real_folders
    from normswap.checkpoint import check_out_target, staged_dir
    from normswap.convert_dir import convert_directory, verify_conversion
    from normswap.loading import build_meta_model, check_stored_tensors, gguf_parse_held, load_config, resolve
    from normswap.manifest import carried_record, new_manifest, read_manifest_if_any, write_manifest
    from normswap.plan import build_manifest, check_refusals, plan_conversion

    _require_path("out", out)
    require_progress_fn(progress)
    _require_flags(keep_gain=keep_gain, partial=partial, force=force)
    source = resolve(model, progress=progress)
    config = load_config(source, progress)
    meta = build_meta_model(source, config)
    unused = check_stored_tensors(source, config, meta)  # before the streaming fold reads them as they are
    unused_tensors = [unused] if unused is not None else []
    plan = plan_conversion(meta, config, keep_gain=keep_gain)
    try:
        check_refusals(plan, partial)
    except NormswapError as e:
        report = build_manifest(plan, config, partial=partial)
        raise ConversionRefused(str(e), ConvertResult(str(model), report, error=str(e),
                                                      unused_tensors=unused_tensors)) from None
    target = check_out_target(out, source, force, "converted", "write the conversion elsewhere")
    earlier = None if source.gguf_file else read_manifest_if_any(source.path)
    notes = []
    if earlier is not None and "patch" in earlier:
        notes.append(f"{model} carries a normswap patch ({earlier['patch']['impl']}); it is not carried into the "
                     "conversion (run `normswap patch` on the output)")
    # Same staging and publishing as patch: a fresh directory beside the target, verified there,
    # then renamed into place (an existing one is exchanged atomically).
    # the original's .gguf, if it is one, parsed once for all its reads: the load that converts,
    # the tokenizer carried, the load the verification compares with (each had a parse of its own)
    with gguf_parse_held(source), staged_dir(target, replace=force, source=source) as tmp:
        step(progress, "convert", 0, None)
        section = convert_directory(source, tmp, keep_gain=keep_gain, partial=partial, dtype=parse_dtype(dtype),
                                    progress=progress or False, config=config, manifest=False,
                                    planned=(meta, plan), target=target, unused=unused)
        step(progress, "verify", 0, 1)
        section["verification"] = verify_conversion(source, tmp, section, config=config, meta=meta)
        step(progress, "verify", 1, 1)
        write_manifest(tmp, new_manifest(convert=section, carried_folders=carried_record(tmp, real_folders(tmp))))
    return ConvertResult(str(model), section, out=target, notes=notes, unused_tensors=unused_tensors)


# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------


def bench_checkpoint(
    model: str | os.PathLike,
    impls: str | Sequence[str] = ("torch", "triton"),
    *,
    modes: str | Sequence[str] = ("train", "prefill", "decode"),
    out: str | os.PathLike | None = None,
    results_dir: str | os.PathLike = "benchmarks/results",
    progress: ProgressFn | None = None,
    option_names: Mapping[str, str] | None = None,
    **options: Any,
) -> CheckpointBench:
    """Time `model` unpatched and patched with each of `impls` (a list or "torch,triton") in each
    of `modes`, and write the results as JSON to `out` (default:
    results_dir/bench-<model>-<device>-<date>.json). options: the other fields of
    normswap.bench.BenchConfig (fuse_residual, batch, seq, dtype, device, compile, warmup,
    repeats, load_weights, ...). Bad input, an unavailable impl and an unwritable destination
    raise NormswapError before anything is measured. option_names: what those messages call
    impls, modes, batch, seq, warmup, repeats and fuse_residual (the CLI's {"impls": "--impls", ...}; default:
    these names)."""
    from normswap.bench import BENCH_OPTIONS

    with using_option_names(option_labels(BENCH_OPTIONS, option_names)):
        return _bench_checkpoint(model, impls, modes, out, results_dir, progress, options)


def _bench_checkpoint(model, impls, modes, out, results_dir, progress, options) -> CheckpointBench:
    from normswap.bench import (
        BenchConfig,
        check_config,
        check_result_target,
        default_output,
        parse_list,
        run_bench,
        write_result,
    )
    from normswap.loading import require_reference

    require_progress_fn(progress)
    _require_path("out", out, optional=True, what="file")  # Path(5) failed inside pathlib
    _require_path("results_dir", results_dir)
    config = BenchConfig(model=str(require_reference(model)), impls=parse_list(impls),
                         modes=parse_list(modes, "modes"), **options)
    check_config(config)
    # Before minutes of measuring, not after: an unwritable destination would lose every number.
    check_writable(Path(out) if out is not None else Path(results_dir) / "bench.json", folder=False)
    if out is not None:
        check_result_target(out)
    result = run_bench(config, progress=progress)  # under this call's names
    saved = write_result(result, out if out is not None else default_output(result, results_dir))
    return CheckpointBench(result, saved)


# ---------------------------------------------------------------------------------------------
# ppl and diff
# ---------------------------------------------------------------------------------------------


# The options evaluate_checkpoint's and diff_checkpoints' messages name, as option_names renames them
# (the settings' own are EvalSettings.option_names').
EVALUATE_OPTIONS = ("impl", "dtype", "device")
DIFF_OPTIONS = (*EVALUATE_OPTIONS, "patched")


def evaluate_checkpoint(model: str | os.PathLike, settings: EvalSettings, *, impl: str | None = None,
                        dtype: str | torch.dtype | None = None, device: str = "auto",
                        progress: ProgressFn | None = None,
                        option_names: Mapping[str, str] | None = None) -> CheckpointPerplexity:
    """Sliding-window perplexity of a checkpoint on `settings.data`; a directory normswap patched
    runs its norms with the patch its normswap.json records (as normswap.load does), with `impl`
    in place of the recorded implementation when given (normswap.load's impl). device: where the
    model runs, as patch_checkpoint's (auto: the CUDA device when there is one, where natively the
    Triton kernels must run). option_names: what messages call impl, dtype and device
    (patch_checkpoint's)."""
    with _using_entry_point_names(EVALUATE_OPTIONS, option_names, settings):
        return _evaluate_checkpoint(model, settings, impl, dtype, device, progress)


def _evaluate_checkpoint(model, settings, impl, dtype, device, progress) -> CheckpointPerplexity:
    from normswap.evaluate import perplexity
    from normswap.loading import (
        device_label,
        load_config,
        parse_device,
        recorded_patch,
        resolve,
        unused_tensors_of,
    )

    _require_settings("settings", settings)
    require_progress_fn(progress)
    device = parse_device(device)
    source = resolve(model, progress=progress)
    config = load_config(source, progress)
    recorded = recorded_patch(source, impl)
    _require_recorded(impl, [model], recorded)
    corpus, tokenizer = _prepare_scoring(settings, source, [config], progress=progress)
    step(progress, "load", 0, 1)
    loaded = _load_scored(source, parse_dtype(dtype), device, config, recorded, progress, (1, 1))
    result = perplexity(loaded, tokenizer, corpus, progress=progress or False, **settings.window_kwargs)
    return CheckpointPerplexity(str(model), str(settings.data), _dtype_name(loaded), result,
                                impl=recorded["impl"] if recorded else None, device=device_label(device),
                                unused_tensors=unused_tensors_of(loaded))


def diff_checkpoints(a: str | os.PathLike, b: str | os.PathLike | None = None, *, settings: EvalSettings,
                     patched: str | None = None, impl: str | None = None, dtype: str | torch.dtype | None = None,
                     device: str = "auto", noise_floor: bool | None = None, progress: ProgressFn | None = None,
                     option_names: Mapping[str, str] | None = None) -> CheckpointDiff:
    """A against B, or against A patched in memory with `patched` (an impl; each module verified),
    on the same windows, tokenised with A's tokenizer. A directory normswap patched runs its norms
    with the patch its normswap.json records (as normswap.load does), with `impl` in place of the
    recorded implementation when given. noise_floor (default: in half precision) also scores A
    loaded in float32 (stock) and judges B against A's own distance from it. device: where all of
    them run (evaluate_checkpoint's). option_names: what messages call patched, impl, dtype and
    device (patch_checkpoint's)."""
    with _using_entry_point_names(DIFF_OPTIONS, option_names, settings):
        return _diff_checkpoints(a, b, settings, patched, impl, dtype, device, noise_floor, progress)


def _diff_checkpoints(a, b, settings, patched, impl, dtype, device, noise_floor, progress) -> CheckpointDiff:
    from normswap.backends import get_backend
    from normswap.evaluate import patched_copy
    from normswap.loading import (
        device_label,
        load_config,
        parse_device,
        recorded_patch,
        resolve,
        unused_tensors_of,
    )

    n = option_labels(DIFF_OPTIONS)  # as diff_checkpoints installed them
    if (b is None) == (patched is None):
        raise NormswapError(f"give either a second model B or {option_setting(n['patched'], Metavar('IMPL'))} "
                            "(exactly one)")
    _require_settings("settings", settings)
    require_progress_fn(progress)
    _require_flags(noise_floor=noise_floor)
    device = parse_device(device)
    if patched is not None:
        get_backend(patched)  # an unavailable implementation fails before anything loads
    source_a = resolve(a, "a", progress)
    source_b = resolve(b, "b", progress) if b is not None else None
    config_a = load_config(source_a, progress)
    config_b = load_config(source_b, progress) if source_b is not None else config_a
    # --patched refuses an A that runs a patch (below): its way out is another A, never --impl
    way_a = {} if patched is None else {"way_out": f"{n['patched']} patches a model that runs no patch: give the "
                                                   "unpatched model as A, or a second model B"}
    recorded_a = recorded_patch(source_a, impl, **way_a)
    recorded_b = recorded_patch(source_b, impl) if source_b is not None else None
    _require_recorded(impl, [a] if b is None else [a, b], recorded_a or recorded_b)
    if patched is not None and recorded_a is not None:  # patch() leaves patched modules as they are
        raise NormswapError(f"{a} already runs the {recorded_a['impl']} patch its normswap.json records, so "
                            f"{option_setting(n['patched'], patched)} would compare it with itself; give the "
                            "unpatched model as A, or a second model B")
    corpus, tokenizer = _prepare_scoring(settings, source_a, [config_a, config_b], source_b, progress)
    torch_dtype = parse_dtype(dtype)
    step(progress, "load", 0, 2)
    model_a = _load_scored(source_a, torch_dtype, device, config_a, recorded_a, progress, (1, 2))
    if source_b is not None:
        model_b = _load_scored(source_b, torch_dtype, device, config_b, recorded_b, progress, (2, 2))
    else:
        model_b = patched_copy(model_a, patched)
        step(progress, "load", 2, 2)
    reference = _float32_reference(source_a, config_a, model_a, device, noise_floor, progress)
    diff = _diff(model_a, model_b, tokenizer, corpus, settings, reference, progress)
    name_b = str(b) if b is not None else f"{a} --patched {patched}"
    impl_b = patched if patched is not None else (recorded_b["impl"] if recorded_b else None)
    return CheckpointDiff(str(a), name_b, str(settings.data), _dtype_name(model_a), diff,
                          impl_a=recorded_a["impl"] if recorded_a else None, impl_b=impl_b, device=device_label(device),
                          unused_tensors=unused_tensors_of(model_a, *([model_b] if source_b is not None else [])))


def _require_recorded(impl: str | None, models: list, recorded: dict | None) -> None:
    """An override of nothing is refused rather than ignored: the user expected IMPL to run. The
    way to what they meant is a diff against the model patched in memory: the command for a
    command line's user, the call for a library caller."""
    if impl is not None and recorded is None:
        name = option_labels(EVALUATE_OPTIONS)["impl"]
        way = (f"normswap diff MODEL --patched {impl}" if is_flag(name) else
               f"normswap.diff_checkpoints(MODEL, patched={impl!r}, settings=...)")
        raise NormswapError(f"{option_setting(name, impl)} runs the patch a normswap.json records with another "
                            f"implementation, and no normswap.json records one ({', '.join(map(str, models))}); to "
                            f"score a model patched in memory, use {way}")


def _load_scored(source, dtype, device, config, recorded: dict | None, progress, loaded: tuple[int, int]):
    """Load one scored model; `loaded` is the "load" count it completes, given before the recorded
    patch runs, so the patch's own stage follows a finished load instead of splitting it in two."""
    from normswap.loading import apply_recorded_patch, load_model

    model = load_model(source, dtype=dtype, device=device, config=config)
    step(progress, "load", *loaded)
    return model if recorded is None else apply_recorded_patch(model, source.ref, recorded, progress=progress)


def _prepare_scoring(settings: EvalSettings, source, configs: list, source_b=None, progress=None):
    """(corpus, tokenizer), after every check that needs no weights: the data, A's tokenizer (and
    B's, which must be the same), the configs' context and vocabulary. The window options were
    checked by each caller's _require_settings, before it read anything."""
    from normswap.data import open_corpus
    from normswap.evaluate import check_before_loading, check_language_model_heads
    from normswap.loading import load_tokenizer, model_class

    corpus = open_corpus(settings.data, settings.text_field)
    # A vision or audio model ships no tokenizer: say what is wrong with it, not with its folder.
    check_language_model_heads(configs, model_class)
    tokenizer = load_tokenizer(source, progress)
    if source_b is not None:
        _check_same_tokenizer(tokenizer, source_b, progress)
    kwargs = settings.window_kwargs
    check_before_loading(configs, tokenizer, corpus, **kwargs, model_class=model_class)
    return corpus, tokenizer


def _check_same_tokenizer(tokenizer_a, source_b, progress=None) -> None:
    """Both models read A's token ids: B must map them to the same strings, or the numbers compare
    unrelated predictions (same-sized vocabularies would not even fail the logit-width check)."""
    from normswap.loading import load_tokenizer

    try:
        tokenizer_b = load_tokenizer(source_b, progress)
    except NormswapError:
        return  # B ships no tokenizer (a bare re-save of A's weights): it reads A's ids by design
    if tokenizer_a.get_vocab() != tokenizer_b.get_vocab():
        raise NormswapError(f"A and B have different tokenizers ({len(tokenizer_a)} vs {len(tokenizer_b)} "
                            f"tokens, or the same tokens numbered differently); a diff needs one tokenizer")


def _float32_reference(source, config, model, device, wanted: bool | None, progress=None):
    """A's float32 self for the noise floor: by default only when A runs in half precision. A
    stage of its own ("reference"): a second load of A, as long as the first."""
    from normswap.loading import load_model

    half = _model_dtype(model) in HALF_DTYPES
    if wanted is False or (wanted is None and not half):
        return None
    step(progress, "reference", 0, 1)
    reference = load_model(source, dtype=torch.float32, device=device, config=config)
    step(progress, "reference", 1, 1)
    return reference


def _diff(model_a, model_b, tokenizer, corpus, settings: EvalSettings, reference, progress) -> DiffResult:
    from normswap.evaluate import diff_models

    return diff_models(model_a, model_b, tokenizer, corpus, progress=progress or False, reference=reference,
                       **settings.window_kwargs)


def _unused_dict(unused: list) -> dict[str, Any]:
    """A report's "unused_tensors": per model loaded, what its load dropped that cannot change what it
    computes (loading.UnusedTensors.to_dict(), with the note the command prints); [] when nothing."""
    return {"unused_tensors": [u.to_dict() for u in unused]}


def _model_dtype(model) -> torch.dtype:
    from normswap.verify import model_dtype

    return model_dtype(model)


def _dtype_name(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")
