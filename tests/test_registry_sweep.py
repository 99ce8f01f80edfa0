"""Sweep every modeling module of the installed transformers: each norm-like class must be
recognised (and its spec must reproduce an instance numerically) or be listed in
registry.UNSUPPORTED with a reason. A new norm class in a new transformers fails this test until
the registry learns it or lists it.

Runtime: importing the ~530 modeling modules takes ~8-10 s on this machine; the checks ~3 s.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from norm_checks import max_ulps, random_input, randomised_copy, reference_output

from normswap import registry

H = 24  # hidden size used to instantiate classes whose constructor asks for one


class AnyConfig:
    """A stand-in config: any attribute a norm's constructor reads gets a plausible value."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        low = name.lower()
        if "eps" in low:
            return 1e-5
        if "dropout" in low or "prob" in low or low.endswith("_rate"):
            return 0.0
        if low.startswith(("use_", "is_", "add_", "output_")) or low.endswith("bias"):
            return False
        if "head" in low or "group" in low or "rank" in low:
            return 4
        return H


def _guess_argument(name: str, param: inspect.Parameter):
    low = name.lower()
    if "config" in low:
        return AnyConfig()
    if "eps" in low:
        return 1e-5
    if "head" in low or "group" in low:
        return 4
    if param.annotation in (bool, "bool"):
        return False
    return H


def instantiate(cls: type) -> torch.nn.Module:
    """Call the constructor with guesses for the arguments it needs (sizes, eps, a config)."""
    kwargs = {}
    for name, param in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        sized = name in ("dim", "hidden_size", "normalized_shape", "size", "feat_size")
        if param.default is param.empty or (param.default is None and sized):
            kwargs[name] = _guess_argument(name, param)
    if issubclass(cls, torch.nn.LayerNorm) and "normalized_shape" not in kwargs:
        try:
            return cls(**kwargs)
        except TypeError:  # a subclass passing *args through to nn.LayerNorm
            kwargs["normalized_shape"] = H
    return cls(**kwargs)


@lru_cache(maxsize=1)
def norm_like_classes() -> tuple[dict[str, type], list[str]]:
    """Every norm-like nn.Module class defined in transformers.models.*.modeling_*, and the names
    of the modules that could not be imported (missing optional dependencies)."""
    import transformers.models as models

    found: dict[str, type] = {}
    failed: list[str] = []

    def import_or_note(name: str):
        try:
            return importlib.import_module(name)
        except Exception:
            failed.append(name)
            return None

    for pkg_info in pkgutil.iter_modules(models.__path__):
        pkg_name = f"transformers.models.{pkg_info.name}"
        pkg = import_or_note(pkg_name)
        if pkg is None:
            continue
        for sub in pkgutil.iter_modules(getattr(pkg, "__path__", [])):
            if not sub.name.startswith("modeling_"):
                continue
            name = f"{pkg_name}.{sub.name}"
            module = import_or_note(name)
            if module is None:
                continue
            for cls_name, obj in vars(module).items():
                if (inspect.isclass(obj) and issubclass(obj, torch.nn.Module) and obj.__module__ == name
                        and registry.is_norm_like_name(cls_name)):
                    found[cls_name] = obj
    return found, failed


def check_class(cls: type) -> str | None:
    """None when the class is handled (recognised and verified, or unsupported), else the problem."""
    name = cls.__name__
    if name in registry.UNSUPPORTED or registry._other_inputs(cls):  # refused by its forward's signature
        return None
    try:
        module = instantiate(cls)
    except Exception as e:
        if registry._class_family(cls) is not None:  # recognised by its code alone
            return None
        return f"cannot instantiate to check it ({e.__class__.__name__}: {str(e)[:60]})"
    if next(iter(module.children()), None) is not None:
        return "a block holding submodules: list it in UNSUPPORTED (its norms are found on their own)"
    rec = registry.recognise(module)
    if rec.spec is None:
        return f"not recognised: {rec.reason}"
    spec = rec.spec
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        m = randomised_copy(module, dtype, seed=3)
        x = random_input(spec.shape or (H,), dtype, seed=4)
        try:
            with torch.no_grad():
                y = m(x)
        except Exception:
            if dtype != torch.float32:  # fp32-pinned modules refuse half parameters
                continue
            raise
        ulps = max_ulps(y, reference_output(x, m, spec))
        # Bit for bit when the probe said so; else the probe's tolerance (LayerNorm statistics
        # accumulated in another order, or an offset added in the parameters' precision).
        limit = 0.0 if rec.exact else (4.0 if y.dtype == torch.float32 else 1.0)
        if ulps > limit:
            return f"spec {spec} is {ulps:.2f} ulps off in {dtype}"
    return None


def test_sweep_every_norm_like_class_is_recognised_or_unsupported():
    classes, failed = norm_like_classes()
    # Missing optional dependencies (torchaudio, ...) skip a few modules; a broken environment
    # would skip most of them, and this test would prove nothing.
    assert len(failed) < 20, f"{len(failed)} modeling modules failed to import: {failed[:5]}"
    assert len(classes) > 150, f"only {len(classes)} norm-like classes found"
    print(f"{len(classes)} norm-like classes; {len(failed)} modeling modules skipped (failed to import)")
    problems = {}
    for name, cls in sorted(classes.items()):
        problem = check_class(cls)
        if problem:
            problems[name] = problem
    assert not problems, "\n".join(f"{k}: {v}" for k, v in problems.items())


def test_sweep_covers_the_families_by_their_own_route():
    classes, _ = norm_like_classes()
    methods = {}
    for name in ("LlamaRMSNorm", "MistralRMSNorm", "GemmaRMSNorm", "Gemma3RMSNorm", "T5LayerNorm",
                 "CohereLayerNorm", "OlmoLayerNorm"):
        if name in classes:
            methods[name] = registry.recognise(instantiate(classes[name])).method
    assert methods.get("MistralRMSNorm") == "fingerprint:LlamaRMSNorm"
    assert methods.get("Gemma3RMSNorm") == "fingerprint:GemmaRMSNorm"
    assert methods.get("OlmoLayerNorm") == "probe"


def installed_class(name: str) -> type:
    """The class `name` of the installed transformers, or a skip where that release has none (as
    5.23 has no DoryL2Norm). A class its source defines but the sweep could not import (a modeling
    module that failed on a missing dependency) fails: skipping it would pass off an unchecked class
    as one the release lacks."""
    import transformers
    import transformers.models

    classes, failed = norm_like_classes()
    if name in classes:
        return classes[name]
    root = Path(transformers.models.__file__).parent
    defined = sorted(str(f.relative_to(root)) for f in root.glob("*/modeling_*.py")
                     if f"class {name}(" in f.read_text(encoding="utf-8"))
    assert not defined, f"{name} is defined in {defined} but was not imported (failed imports: {failed})"
    pytest.skip(f"{name} is not in transformers {transformers.__version__}")


def test_a_class_that_failed_to_import_fails_its_checks_instead_of_skipping(monkeypatch):
    classes, failed = norm_like_classes()
    assert installed_class("DebertaLayerNorm") is classes["DebertaLayerNorm"]
    without = {k: v for k, v in classes.items() if k != "DebertaLayerNorm"}
    monkeypatch.setattr(f"{__name__}.norm_like_classes", lambda: (without, failed))
    with pytest.raises(AssertionError, match=r"DebertaLayerNorm is defined in \['deberta/modeling_deberta.py'\]"):
        try:
            installed_class("DebertaLayerNorm")
        except pytest.skip.Exception as skip:  # a skip would leave this test skipped, not failed
            pytest.fail(f"skipped a class its release defines: {skip}")
    with pytest.raises(pytest.skip.Exception, match="NoSuchRMSNorm is not in transformers"):
        installed_class("NoSuchRMSNorm")


@pytest.mark.parametrize("name", ["DebertaLayerNorm", "EomtLayerNorm2d", "ImageGPTLayerNorm", "DoryL2Norm",
                                  "HYV4UnweightedRMSNorm", "HYV4VLUnweightedRMSNorm"])
def test_unsupported_classes_really_are_not_recognised(name):
    """The list is not a dumping ground: these would not pass as norms without it."""
    cls = installed_class(name)
    saved = registry.UNSUPPORTED.pop(name)
    try:
        assert check_class(cls) is not None
    finally:
        registry.UNSUPPORTED[name] = saved


# What the UNSUPPORTED reasons of these weightless classes say they compute, in float64 from
# (x, eps). DoryL2Norm (transformers 5.24) is an L2 norm, not an RMS norm; the HYV4 pair returns
# the inverse RMS scale. Each is held to the class's own output below, so a reason cannot
# misdescribe its class.
SAID_TO_COMPUTE = {
    "DoryL2Norm": lambda x, eps: x * (x.pow(2).sum(-1, keepdim=True) + eps).rsqrt(),
    "HYV4UnweightedRMSNorm": lambda x, eps: (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt(),
    "HYV4VLUnweightedRMSNorm": lambda x, eps: (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt(),
}


@pytest.mark.parametrize("name", sorted(SAID_TO_COMPUTE))
def test_unsupported_arithmetic_is_what_its_reason_says(name):
    module = instantiate(installed_class(name))
    assert not list(module.parameters()), "weightless: no gain to randomise"
    g = torch.Generator().manual_seed(5)
    x64 = torch.randn(3, 5, H, generator=g, dtype=torch.float64) * 1.5 + 0.4
    x64[2] *= 1e-3  # rows small enough that where eps is added (sum or mean of squares) shows
    for dtype in (torch.float32, torch.bfloat16):
        x = x64.to(dtype)
        expected = SAID_TO_COMPUTE[name](x.double(), module.eps)
        with torch.no_grad():
            y = module(x)
        assert y.dtype == dtype and y.shape == expected.shape, (y.dtype, y.shape, expected.shape)
        # Computed in float32, rounded once to the input dtype: within a few float32 ulps, or one
        # ulp of a bfloat16 output, of each row's scale.
        err = ((y.double() - expected).abs() / expected.abs().amax(-1, keepdim=True)).max().item()
        limit = 4 * torch.finfo(torch.float32).eps if dtype == torch.float32 else torch.finfo(dtype).eps
        assert err <= limit, f"{name} in {dtype}: {err:.3g} of the row scale from its reason's arithmetic"


class BrandNewRMSNorm(torch.nn.Module):
    """What a future transformers might add: a norm-like class with arithmetic no family has."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.eps)  # mean-abs, not RMS


def test_sweep_fails_on_a_new_class_that_is_neither():
    assert registry.is_norm_like_name(BrandNewRMSNorm.__name__)
    problem = check_class(BrandNewRMSNorm)
    assert problem is not None and "not recognised" in problem
    registry.UNSUPPORTED["BrandNewRMSNorm"] = "mean-absolute normalization (test entry)"
    try:
        assert check_class(BrandNewRMSNorm) is None
    finally:
        del registry.UNSUPPORTED["BrandNewRMSNorm"]
