"""Backend registry: which implementations of the norm ops exist, and which run here.

Every backend exposes the same functional signatures as normswap.kernels.reference:
    rms_norm(x, weight, eps, offset=0.0, casting="llama", residual=None, out_dtype=None, residual_in_fp32=False)
    layer_norm(x, weight, bias, eps, offset=0.0, residual=None, out_dtype=None, residual_in_fp32=False)
Asking for a backend that cannot load here is an error that says why, never a silent fallback.
(Interim registry: reference only; the kernels work adds triton, torch, compile, liger, quack.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from normswap.errors import NormswapError


@dataclass(frozen=True)
class Backend:
    name: str
    rms_norm: Callable
    layer_norm: Callable


def _load_reference() -> Backend:
    from normswap.kernels.reference import layer_norm_ref, rms_norm_ref

    return Backend("reference", rms_norm_ref, layer_norm_ref)


_LOADERS: dict[str, Callable[[], Backend]] = {"reference": _load_reference}


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
    if name not in _LOADERS:
        raise NormswapError(f"unknown backend {name!r}; known: {', '.join(_LOADERS)}")
    try:
        return _LOADERS[name]()
    except NormswapError:
        raise
    except Exception as e:  # noqa: BLE001
        ok = [n for n, why in available_backends().items() if why is None]
        raise NormswapError(f"backend {name!r} is not available here ({e}); available: {', '.join(ok)}") from None
