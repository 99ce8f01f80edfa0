"""Backend registry: which implementations of the norm ops exist, and which run here.

Every backend exposes the same functional signatures as normswap.kernels.reference:
    rms_norm(x, weight, eps, offset=0.0, casting="llama", residual=None, out_dtype=None, residual_in_fp32=False)
    layer_norm(x, weight, bias, eps, offset=0.0, residual=None, out_dtype=None, residual_in_fp32=False)
With `residual` they return (y, h) where h = x + residual as stored.
Asking for a backend that cannot load here is an error that says why, never a silent fallback.

Backends:
- triton    normswap's fused kernels (normswap/kernels/rms_norm.py, layer_norm.py); all modes.
            Needs CUDA, or TRITON_INTERPRET=1 set before triton was imported (CPU interpreter).
- torch     PyTorch's native F.rms_norm / F.layer_norm; all modes, some composed around the native
            op (normswap/kernels/native.py lists which).
- compile   torch.compile of the reference; all modes.
- liger     Liger-Kernel, when it imports (CUDA only): rms llama (offset 0, weight in x's dtype)
            and gemma with a weight; layer_norm with weight and bias.
- quack     quack, when it imports (CUDA, Hopper/Blackwell): rms without weight, gemma, none,
            llama, t5 with a half weight of x's dtype; layer_norm forward only.
- reference the pure-torch contract (normswap/kernels/reference.py); all modes.
Never imports transformers.
"""

from __future__ import annotations

import functools
import importlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from normswap.errors import NormswapError
from normswap.specs import CASTINGS


@dataclass(frozen=True)
class Backend:
    name: str
    rms_norm: Callable
    layer_norm: Callable


_EVERY_MODE = {mode: None for mode in CASTINGS}
# What each backend's rms_norm runs with the reference's numerics: casting mode -> the condition it
# needs (None: none). Anything else raises a NormswapError naming what is unsupported.
CASTING_SUPPORT: dict[str, dict[str, str | None]] = {
    "triton": dict(_EVERY_MODE),
    "torch": dict(_EVERY_MODE),
    "compile": dict(_EVERY_MODE),
    "liger": {"llama": "offset 0 and a weight in the input's dtype", "gemma": "a weight"},
    "quack": {"llama": None, "gemma": None, "t5": "no weight, or a half weight in the input's dtype",
              "none": None},
    "reference": dict(_EVERY_MODE),
}
# What each backend's layer_norm needs (None: every form, forward and backward).
LAYER_NORM_SUPPORT: dict[str, str | None] = {
    "triton": None, "torch": None, "compile": None,
    "liger": "a weight and a bias, offset 0",
    "quack": "a weight; forward only (no gradients)",
    "reference": None,
}


def _load_reference() -> Backend:
    from normswap.kernels.reference import layer_norm_ref, rms_norm_ref

    return Backend("reference", rms_norm_ref, layer_norm_ref)


def _load_triton() -> Backend:
    from normswap.kernels import _common
    from normswap.kernels import layer_norm as ln
    from normswap.kernels import rms_norm as rms

    why = _common.triton_unavailable_reason(rms._rms_fwd_kernel)
    if why:
        raise RuntimeError(why)
    return Backend("triton", rms.rms_norm, ln.layer_norm)


def _load_torch() -> Backend:
    import torch.nn.functional as F

    if not hasattr(F, "rms_norm"):
        raise RuntimeError("this torch has no F.rms_norm (needs torch >= 2.4)")
    from normswap.kernels import native

    return Backend("torch", native.rms_norm, native.layer_norm)


# Inductor fuses `normed.to(bf16) * weight` and by default skips the intermediate rounding, which
# silently turns Llama casting into Gemma-like arithmetic (~25% of bf16 outputs differ by an ulp).
# emulate_precision_casts keeps every cast the reference writes.
_EXACT_CASTS = {"emulate_precision_casts": True}
# Every (dtypes, casting, offset, residual, grad mode) combination the reference is called with is
# a graph of its own. Dynamo's default of 8 graphs per function, with fullgraph=True, turns the 9th
# combination in a process into a hard FailOnRecompileLimitHit; raised (never lowered) to this.
_MIN_RECOMPILE_LIMIT = 64


@functools.cache  # one compiled wrapper per process: torch.compile caches its graphs on the wrapper
def _load_compile() -> Backend:
    import torch

    if not torch.cuda.is_available() and shutil.which("cc") is None and shutil.which("gcc") is None:
        raise RuntimeError("torch.compile on CPU needs a C++ compiler (no cc/gcc on PATH) and there is no CUDA device")
    import torch._dynamo

    from normswap.kernels.reference import layer_norm_ref, rms_norm_ref

    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, _MIN_RECOMPILE_LIMIT)
    return Backend(
        "compile", torch.compile(rms_norm_ref, fullgraph=True, options=_EXACT_CASTS),
        torch.compile(layer_norm_ref, fullgraph=True, options=_EXACT_CASTS),
    )


def _load_adapted(name: str, package: str, modules: tuple[str, ...], install: str, vendor: str) -> Backend:
    """A third-party backend: its `modules` must import and its kernels need a CUDA device; the
    functions are adapters.<name>_rms_norm and adapters.<name>_layer_norm."""
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(f"{package} does not import ({e}); {install}") from None
    from normswap.kernels import adapters

    adapters.require_cuda(vendor)
    return Backend(name, getattr(adapters, f"{name}_rms_norm"), getattr(adapters, f"{name}_layer_norm"))


def _load_liger() -> Backend:
    return _load_adapted("liger", "liger_kernel", ("liger_kernel.ops.layer_norm", "liger_kernel.ops.rms_norm"),
                         "pip install liger-kernel", "Liger-Kernel")


def _load_quack() -> Backend:
    return _load_adapted("quack", "quack", ("quack.rmsnorm",),
                         "pip install quack-kernels (needs an H100/B200-class GPU)", "quack")


_LOADERS: dict[str, Callable[[], Backend]] = {
    "triton": _load_triton,
    "torch": _load_torch,
    "compile": _load_compile,
    "liger": _load_liger,
    "quack": _load_quack,
    "reference": _load_reference,
}


BACKENDS: tuple[str, ...] = tuple(_LOADERS)  # every backend name, in the order they are listed


def available_backends() -> dict[str, str | None]:
    """name -> None when it runs here, else the reason it does not."""
    out: dict[str, str | None] = {}
    for name, load in _LOADERS.items():
        try:
            load()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the reason is what we report
            out[name] = str(e) or e.__class__.__name__
    return out


def get_backend(name: str) -> Backend:
    if not isinstance(name, str) or name not in _LOADERS:  # impl=["torch"] was "unhashable type: 'list'"
        raise NormswapError(f"unknown backend {name!r}; known: {', '.join(_LOADERS)}")
    try:
        return _LOADERS[name]()
    except NormswapError:
        raise
    except Exception as e:  # noqa: BLE001
        ok = [n for n, why in available_backends().items() if why is None]
        raise NormswapError(f"backend {name!r} is not available here ({e}); available: {', '.join(ok)}") from None
