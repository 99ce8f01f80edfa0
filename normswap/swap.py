"""patch(model, impl) / revert(model): swap every recognised norm for a normswap module, in place.

The shape is torchao's `quantize_(model, config, filter_fn)`: one in-place entry point that walks
the model, asks the registry what each norm is (architecture knowledge lives there, as data), and
swaps it for a replacement that adopts the original's Parameters. What a patch did is a frozen
PatchConfig (report.config): the manifest's patch section serialises it and normswap.load applies
it again with patch(model, config). Each swap is verified before the
call returns (normswap.verify); a failed check undoes the whole call and raises, so a model is
never left half-patched with an unproven module in it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from normswap import verify as verify_mod
from normswap.backends import get_backend
from normswap.dtypes import parse_dtype
from normswap.errors import (
    BadInputError,
    Metavar,
    NormswapError,
    UnknownNormError,
    option_labels,
    require_bool,
    way_out,
)
from normswap.fuse import FusionReport
from normswap.modules import NormswapNorm, RmsForm, build_replacement, originals_in_place, restore_original
from normswap.progress import ProgressFn, require_progress_fn, step
from normswap.specs import NormSpec
from normswap.verify import (
    ModelCheck,
    ModuleCheck,
    ProbeConfig,
    compare_outputs,
    describe_model_check,
    model_dtype,
    named_outputs,
    probe_batch,
    verify_module,
)

FilterFn = Callable[[nn.Module, str], bool]  # (module, path) -> swap it?


class VerificationError(NormswapError):
    """A swapped module (or the whole model) failed verification; the patch was undone."""

    def __init__(self, message: str, report: PatchReport):
        super().__init__(message)
        self.report = report
        self.result = None  # normswap.api.patch_checkpoint sets its PatchResult here


@dataclass(frozen=True)
class PatchConfig:
    """What to patch and how: the implementation, which norms (None: every one the registry
    recognises), which LayerNorms run as RMS norms on a zero-mean stream, and which residual adds
    are fused into the norm that reads them (True: find them; pairs writer -> norm: these). Frozen
    data that round-trips through JSON: the manifest's patch section holds to_dict(),
    normswap.load reads it back with from_dict() and passes it to patch(model, config)."""

    impl: str = "triton"
    paths: tuple[str, ...] | None = None
    # path -> RmsForm; given as a mapping or (path, form) pairs, kept as sorted pairs (hashable)
    rms_forms: tuple[tuple[str, RmsForm], ...] | Mapping[str, RmsForm | dict] = ()
    # False, True, or writer path -> norm path (a mapping or pairs, kept as sorted pairs)
    fuse_residual: bool | tuple[tuple[str, str], ...] | Mapping[str, str] = False
    strict: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.impl, str) or not self.impl:
            raise ValueError(f"impl must be a backend name, got {self.impl!r}")
        require_bool("strict", self.strict)
        for name, allowed in (("paths", type(None)), ("rms_forms", ()), ("fuse_residual", bool)):
            value = getattr(self, name)  # a str would be read letter by letter
            if not isinstance(value, allowed) and (isinstance(value, str | bytes) or not isinstance(value, Iterable)):
                raise TypeError(f"{name}: expected {_CONFIG_KINDS[name]}, got {value!r}")
        if self.paths is not None:
            if not all(isinstance(p, str) for p in self.paths):  # [1, 2] named modules "1" and "2"
                raise TypeError(f"paths: expected {_CONFIG_KINDS['paths']}, got {self.paths!r}")
            object.__setattr__(self, "paths", tuple(sorted(self.paths)))
        pairs = _pairs("rms_forms", self.rms_forms)
        object.__setattr__(self, "rms_forms", tuple(sorted((str(p), RmsForm.coerce(f)) for p, f in pairs)))
        fused = self.fuse_residual
        if not isinstance(fused, bool):
            object.__setattr__(self, "fuse_residual", tuple(sorted((str(w), str(n)) for w, n in _pairs("fuse_residual", fused))))

    @property
    def forms(self) -> dict[str, RmsForm]:
        return dict(self.rms_forms)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; "fuse_residual" (writer -> norm) only when the patch fuses (the manifest's
        patch section leaves it out otherwise)."""
        d = {"impl": self.impl, "paths": None if self.paths is None else list(self.paths),
             "rms_forms": {p: f.to_dict() for p, f in self.rms_forms}, "strict": self.strict}
        if self.fuse_residual is not False:
            d["fuse_residual"] = True if self.fuse_residual is True else dict(self.fuse_residual)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PatchConfig:
        """The config of a to_dict() (or of a manifest's patch section: other keys are ignored)."""
        if not isinstance(d, Mapping):
            raise TypeError(f"PatchConfig.from_dict: expected a mapping (a to_dict()), got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        if isinstance(kwargs.get("paths"), list):  # JSON's list; a str stays one, for __post_init__ to refuse
            kwargs["paths"] = tuple(kwargs["paths"])  # ("abc" was read letter by letter: modules a, b and c)
        if kwargs.get("fuse_residual") is None:
            kwargs.pop("fuse_residual", None)
        elif not isinstance(kwargs["fuse_residual"], (bool, Mapping)):
            raise TypeError("fuse_residual must be a bool or map writer paths to norm paths")
        return cls(**kwargs)


_CONFIG_KINDS = {"paths": "None or a list of module paths",
                 "rms_forms": "a mapping path -> RmsForm (or (path, form) pairs)",
                 "fuse_residual": "a bool or a mapping writer path -> norm path (or pairs)"}


def _pairs(name: str, value) -> list[tuple]:
    """A mapping's items, or (key, value) pairs: TypeError naming `name` for anything else."""
    pairs = list(value.items()) if isinstance(value, Mapping) else list(value)
    if not all(isinstance(p, tuple | list) and len(p) == 2 for p in pairs):
        raise TypeError(f"{name}: expected {_CONFIG_KINDS[name]}, got {value!r}")
    return pairs


@dataclass
class ModuleEntry:
    path: str
    module_class: str
    status: str  # patched | failed | excluded | unknown | already-patched
    spec: NormSpec | None = None
    rms_form: RmsForm | None = None  # set: a zero-mean LayerNorm run as an RMS norm
    reason: str | None = None
    check: ModuleCheck | None = None

    def to_dict(self) -> dict:
        return {
            "path": self.path, "class": self.module_class, "status": self.status,
            "spec": self.spec.to_dict() if self.spec else None,
            "rms_form": self.rms_form.to_dict() if self.rms_form else None,
            "runs_as": self.rms_form.describe() if self.rms_form else None,
            "reason": self.reason, "check": self.check.to_dict() if self.check else None,
        }


@dataclass
class PatchReport:
    impl: str
    dtype: str
    modules: list[ModuleEntry] = field(default_factory=list)
    model_check: ModelCheck | None = None
    verified: bool = True
    fusion: FusionReport | None = None  # patch(fuse_residual=True): the fused residual adds
    strict: bool = False

    @property
    def config(self) -> PatchConfig:
        """What this patch did, as the config that does it again (the patched paths, their forms,
        the residual adds it fused)."""
        return PatchConfig(self.impl, paths=tuple(m.path for m in self.patched),
                           rms_forms={m.path: m.rms_form for m in self.patched if m.rms_form is not None},
                           fuse_residual=dict(self.fusion.pairs) if self.fusion is not None else False,
                           strict=self.strict)

    def by_status(self, status: str) -> list[ModuleEntry]:
        return [m for m in self.modules if m.status == status]

    @property
    def patched(self) -> list[ModuleEntry]:
        return self.by_status("patched")

    @property
    def failed(self) -> list[ModuleEntry]:
        return self.by_status("failed")

    @property
    def ok(self) -> bool:
        return (not self.failed and (self.model_check is None or self.model_check.passed)
                and (self.fusion is None or self.fusion.ok))

    def max_errors(self) -> tuple[float, float]:
        """Largest per-module error vs float64 over the patched modules: (original, replacement)."""
        checks = [m.check for m in self.modules if m.check is not None]
        return (max((c.max_err_original for c in checks), default=0.0),
                max((c.max_err_replacement for c in checks), default=0.0))

    def to_dict(self) -> dict:
        e_orig, e_new = self.max_errors()
        return {
            "impl": self.impl, "dtype": self.dtype, "ok": self.ok, "verified": self.verified,
            "counts": {s: len(self.by_status(s)) for s in
                       ("patched", "failed", "excluded", "unknown", "already-patched")},
            "max_err_original": e_orig, "max_err_replacement": e_new,
            "modules": [m.to_dict() for m in self.modules],
            "model_check": self.model_check.to_dict() if self.model_check else None,
            "fuse_residual": self.fusion.to_dict() if self.fusion else None,
        }


def regex_filter(only: str | re.Pattern | None = None, exclude: str | re.Pattern | None = None) -> FilterFn | None:
    """patch_checkpoint's (the CLI's) only/exclude as a filter_fn (re.search on the module path)."""
    if only is None and exclude is None:
        return None
    def compiled(key: str, pattern: str | re.Pattern | None):
        # re.compile takes a compiled pattern as it is, so the library always accepted one
        if pattern is not None and not isinstance(pattern, str | re.Pattern):
            raise TypeError(f"{key}: expected a regular expression (str), got {type(pattern).__name__}")
        try:
            return re.compile(pattern) if pattern is not None else None
        except (re.error, OverflowError) as e:  # say which of the two it was, as the caller named it
            # OverflowError: a repeat count past re's limit ('a{99999999999}') is not an re.error
            raise BadInputError(f"{option_labels((key,))[key]} {pattern!r}: not a regular expression ({e})") from None

    only_re, excl_re = compiled("only", only), compiled("exclude", exclude)

    def keep(module: nn.Module, path: str) -> bool:
        if only_re is not None and not only_re.search(path):
            return False
        return not (excl_re is not None and excl_re.search(path))

    return keep


def patch(
    model: nn.Module,
    impl: str | PatchConfig = "triton",
    filter_fn: FilterFn | None = None,
    strict: bool = False,
    verify: bool = True,
    *,
    rms_forms: Collection[str] | Mapping[str, RmsForm | dict] = (),
    dtype: torch.dtype | None = None,
    probe: ProbeConfig | None = None,
    check_model: bool | None = None,
    progress: ProgressFn | None = None,
    fuse_residual: bool | Mapping[str, str] = False,
) -> PatchReport:
    """Swap every norm the registry recognises for a `impl` module, in place; verify each one.

    impl: a backend name, or a PatchConfig (torchao style: patch(model, config)); a config's
    paths and rms_forms add to filter_fn and rms_forms, its strict and fuse_residual apply unless
    the arguments say otherwise.
    filter_fn(module, path) -> False leaves a norm alone (reported as excluded). strict=True
    raises UnknownNormError on a norm-like module the registry does not recognise (otherwise it
    is left alone and reported as unknown). rms_forms names LayerNorm paths whose input is known to
    be zero-mean (a `normswap convert` manifest: normswap.manifest.rms_forms), run as RMS norms; a
    mapping path -> RmsForm also says which of γ/β were folded (their multiply/add is skipped; a
    bare path applies both). verify=False skips
    the numeric proof (e.g. on the meta device). On a failed check every swap made by this call
    is undone and VerificationError (a NormswapError, carrying the report) is raised.

    fuse_residual=True then fuses each residual add into the patched norm that reads the sum
    (normswap.fuse: one kernel call computes the add and the norm), found by one forward pass; a
    mapping writer path -> norm path (a manifest's record) applies those pairs without the search.
    The fused model's output is checked against the unfused patched model (when check_model).

    progress("patch", done, total): `done` of the `total` norms to patch swapped (and verified).
    """
    from normswap import walk

    walk.require_module(model)
    require_bool("strict", strict)
    require_bool("verify", verify)
    if check_model is not None:
        require_bool("check_model", check_model)
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn: expected a function (module, path) -> bool, got {type(filter_fn).__name__} "
                        "(normswap.swap.regex_filter(only=...) makes one from a pattern)")
    require_progress_fn(progress)
    if not isinstance(fuse_residual, bool | Mapping):
        raise TypeError(f"fuse_residual: expected a bool or a mapping writer path -> norm path, "
                        f"got {type(fuse_residual).__name__}")
    wanted = None
    if isinstance(impl, PatchConfig):
        config, impl = impl, impl.impl
        strict = strict or config.strict
        rms_forms = {**_coerce_rms_forms(rms_forms), **config.forms}
        if config.paths is not None:
            wanted, outer = set(config.paths), filter_fn
            filter_fn = lambda m, path: path in wanted and (outer is None or outer(m, path))  # noqa: E731
        if fuse_residual is False and config.fuse_residual is not False:
            fuse_residual = True if config.fuse_residual is True else dict(config.fuse_residual)
    probe = probe or verify_mod.DEFAULT_PROBE
    backend = get_backend(impl)  # an unavailable backend fails here, loudly, before any change
    check_model = verify if check_model is None else check_model
    dtype = parse_dtype(dtype) or model_dtype(model)
    if verify or check_model:
        verify_mod.check_weights(model)
    rms_forms = _coerce_rms_forms(rms_forms)
    report = PatchReport(impl=impl, dtype=str(dtype).removeprefix("torch."), verified=verify, strict=strict)

    already = {p for p, m in model.named_modules() if isinstance(m, NormswapNorm)}
    found = [f for f in walk.find_norms(model, strict=False, warn=False)
             if not any(f.path == p or f.path.startswith(p + ".") for p in already)]
    for p in sorted(already):
        m = walk.get_submodule(model, p)
        # Patching again is idempotent; asked for another backend (or an RMS form), keeping the old
        # one and reporting the new impl would be a silently wrong patch.
        # The same call again (an RMS form it already has included) is the idempotent case.
        if ((p in rms_forms and getattr(m, "rms_form", None) != rms_forms[p])
                or (m.impl != impl and (filter_fn is None or filter_fn(m, p)))):
            raise NormswapError(f"{p} is already patched with {m.impl}; normswap.revert(model) first to patch "
                                f"it with {impl}{' as an RMS norm' if p in rms_forms else ''}")
        report.modules.append(ModuleEntry(p, m.original_class.__name__, "already-patched", m.spec,
                                          reason=f"already patched with {m.impl}"))
    unknown = [f for f in found if f.spec is None]
    if strict and unknown:
        f = unknown[0]
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UnknownNormError(f"unknown norm class at {f.path} ({f.module_class}): {f.unknown_reason}{more}")
    if wanted is not None:  # a path that names no norm would patch nothing, silently
        absent = wanted - already - {f.path for f in found if f.spec is not None}
        if absent:
            raise NormswapError(f"paths names modules that are not norms here: {', '.join(sorted(absent))}")
    missing = set(rms_forms) - already - {f.path for f in found if f.spec is not None and f.spec.kind == "layer"}
    if missing:
        raise NormswapError(f"rms_forms names paths that are not LayerNorms here: {', '.join(sorted(missing))}")

    todo: list[tuple[ModuleEntry, nn.Module]] = []
    for f in found:
        if f.spec is None:
            report.modules.append(ModuleEntry(f.path, f.module_class, "unknown", reason=f.unknown_reason))
            continue
        module = walk.get_submodule(model, f.path)
        entry = ModuleEntry(f.path, f.module_class, "patched", f.spec, rms_form=rms_forms.get(f.path))
        if filter_fn is not None and not filter_fn(module, f.path):
            entry.status, entry.reason = "excluded", "filtered out"
        else:
            if entry.rms_form is not None:
                _check_folded(module, f.spec, entry)
            todo.append((entry, module))
        report.modules.append(entry)

    batch = before = None
    if check_model and todo:
        try:
            batch = probe_batch(model, probe)
        except NormswapError:  # not a token model (no config.vocab_size): per-module proof only
            batch = None
        if batch is not None:
            before = named_outputs(model, batch)
            for name, t in before.items():
                verify_mod.check_reference_output(name, t)

    swapped: list[tuple[str, nn.Module]] = []
    step(progress, "patch", 0, len(todo))
    try:
        for entry, original in todo:
            replacement = build_replacement(original, entry.spec, impl, backend, rms_form=entry.rms_form)
            _move_accelerate_hook(original, replacement)
            walk.set_submodule(model, entry.path, replacement)
            swapped.append((entry.path, original))
            if verify:
                entry.check = verify_module(entry.path, original, replacement, entry.spec, dtype, probe)
                if not entry.check.passed:
                    entry.status = "failed"
                    entry.reason = "; ".join(entry.check.failures)
            step(progress, "patch", len(swapped), len(todo))
        if before is not None:
            # The outputs the conversion's verification compares too: the logits, or every
            # output of a model without (a ViTModel's pooler reads its final norm), each on its
            # own scale
            report.model_check = compare_outputs(dtype, before, named_outputs(model, batch))
        if fuse_residual is not False and report.ok:
            report.fusion = _fuse(model, fuse_residual, batch, check_model, dtype)
    except BaseException:
        _undo(model, swapped)
        raise
    if not report.ok:
        _undo(model, swapped)
        raise VerificationError(_failure_message(report), report)
    return report


def _fuse(model, fuse_residual, batch, check, dtype) -> FusionReport:
    from normswap import fusion

    pairs = None if fuse_residual is True else dict(fuse_residual)
    if batch is None and (check or pairs is None):
        try:
            batch = probe_batch(model)
        except NormswapError:
            name = option_labels(("fuse_residual",))["fuse_residual"]
            raise NormswapError(f"{name} needs a token model (config.vocab_size) to find where the "
                                "residual adds go") from None
    return fusion.fuse_residual(model, pairs=pairs, batch=batch, check=check, dtype=dtype)


def _coerce_rms_forms(forms) -> dict[str, RmsForm]:
    if isinstance(forms, Mapping):
        forms = {p: RmsForm.coerce(f) for p, f in forms.items()}
    elif isinstance(forms, str | bytes) or not isinstance(forms, Collection):  # a str would be its letters
        raise TypeError(f"rms_forms: expected a collection of module paths or a mapping path -> RmsForm, "
                        f"got {type(forms).__name__}")
    else:
        forms = {p: RmsForm() for p in forms}
    bad = next((p for p in forms if not isinstance(p, str)), None)
    if bad is not None:
        raise TypeError(f"rms_forms: module paths are strings, got {bad!r}")
    return forms


def _check_folded(module: nn.Module, spec: NormSpec, entry: ModuleEntry) -> None:
    """A form that skips γ (β) is only right while the stored weight is ones (bias zeros), as
    `normswap convert` left it. Checked on every patch (also verify=False, e.g. normswap.load):
    a checkpoint fine-tuned after conversion must not silently lose its new gains."""
    form = entry.rms_form
    for skip, attr, has, fill in ((not form.weight, spec.weight_attr, spec.has_weight, 1.0),
                                  (not form.bias, spec.bias_attr, spec.has_bias, 0.0)):
        t = getattr(module, attr, None) if (skip and has) else None
        if t is None or t.is_meta:
            continue
        if not bool((t.detach() == fill).all()):
            way = way_out("rms", False, "rms_forms leaving it out")  # None: the caller has no such option
            raise NormswapError(
                f"{entry.path}: its {'γ' if fill else 'β'} was folded by normswap convert, so its {attr} should be "
                f"all {fill:g}, but it is not (changed after the conversion?)" + (f"; patch with {way}" if way else "")
            )


def _failure_message(report: PatchReport) -> str:
    if report.failed:
        first = report.failed[0]
        more = f" (and {len(report.failed) - 1} more)" if len(report.failed) > 1 else ""
        way = way_out("exclude", Metavar("REGEX"), "filter_fn")  # None: the caller has no such option
        return (f"verification failed for {first.path} ({first.module_class}, impl {report.impl}): "
                f"{first.reason}{more}; nothing was changed" + (f" (exclude it with {way})" if way else ""))
    mc = report.model_check
    if report.fusion is not None and not report.fusion.ok:
        fc = report.fusion.model_check
        return (f"the fused residual adds change the output beyond the dtype's rounding: "
                f"{describe_model_check(fc.to_dict(), failed=True)} against the unfused patch; nothing was changed")
    return (f"whole-model check failed with impl {report.impl}: {describe_model_check(mc.to_dict(), failed=True)}; "
            "nothing was changed")


def _undo(model: nn.Module, swapped: list[tuple[str, nn.Module]]) -> None:
    from normswap import fuse, walk

    fuse.disable(model)
    for path, original in reversed(swapped):
        current = walk.get_submodule(model, path)
        if isinstance(current, NormswapNorm):
            walk.set_submodule(model, path, restore_original(current))
        else:
            walk.set_submodule(model, path, original)


def patched_modules(model: nn.Module) -> list[tuple[str, NormswapNorm]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, NormswapNorm)]


def revert(model: nn.Module) -> list[str]:
    """Put every original norm back (holding the current Parameters) and remove a residual
    fusion; return the paths."""
    from normswap import fuse, walk

    walk.require_module(model)
    fuse.disable(model)
    paths = []
    for path, rep in patched_modules(model):
        original = restore_original(rep)
        if "_hf_hook" in vars(rep) and "_hf_hook" not in vars(original):
            _move_accelerate_hook(rep, original)  # hooks added after the patch follow the weights
        walk.set_submodule(model, path, original)
        paths.append(path)
    return paths


@contextmanager
def unpatched(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily the original architecture (for saving exactly what stock transformers would):
    the original modules back, and no residual fusion."""
    from normswap import fuse, fusion

    pairs = fuse.disable(model)
    try:
        with originals_in_place(model):
            yield model
    finally:
        if pairs:
            fusion.enable(model, pairs)


def _move_accelerate_hook(src: nn.Module, dst: nn.Module) -> None:
    """Give `dst` the accelerate hook that `src` carries (device alignment, CPU/disk offload).

    accelerate's own add_hook_to_module installs the forward wrapper; init_hook is skipped
    because the adopted tensors are already where the hook put them (on offload: the meta
    device, with the real values in the hook's weights_map, keyed by the same names).
    The hook also stays on `src`, which is what revert puts back.
    """
    hook = vars(src).get("_hf_hook")
    if hook is None:
        return
    from accelerate.hooks import add_hook_to_module

    hook.init_hook = lambda module: module
    try:
        add_hook_to_module(dst, hook)
    finally:
        del hook.init_hook
