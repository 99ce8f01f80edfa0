"""Drop-in replacement modules that run a norm through a normswap backend.

A replacement *adopts* the original module's Parameters and buffers: the very same tensor objects
are registered under the very same names, so `state_dict()` keys, dtypes, devices, `requires_grad`
and optimizer state are unchanged, and gradients flow into the weights the model already owns.
Plain attributes the model's code may read (`variance_epsilon`, `eps`, `normalized_shape`, ...) are
copied too, and the original module is kept (unregistered, so it is invisible to state_dict and
`.to()`) so that `restore_original` can put it back exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import nn

from normswap import fuse
from normswap.backends import Backend, get_backend
from normswap.errors import require_bool
from normswap.specs import NormSpec

# Attribute values worth carrying over from the original: configuration, never callables (an
# accelerate-hooked module keeps a wrapped `forward` in its __dict__) and never tensors (those
# live in _parameters/_buffers and are adopted separately).
_PLAIN = (bool, int, float, str, tuple, list, type(None), torch.dtype, torch.Size)


def default_eps(dtype: torch.dtype) -> float:
    """What torch's rms_norm uses for eps=None: the machine epsilon of the dtype it computes in
    (float32 for half inputs; the docs say the input dtype's, the kernel uses its opmath type's)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


class NormswapNorm(nn.Module):
    """Common base: adoption, eps lookup, bookkeeping for revert. Subclasses define forward."""

    spec: NormSpec
    impl: str

    def __init__(self, original: nn.Module, spec: NormSpec, impl: str, backend: Backend | None = None):
        super().__init__()
        for key, value in vars(original).items():
            if not key.startswith("_") and key != "training" and isinstance(value, _PLAIN):
                setattr(self, key, value)
        for name, param in original._parameters.items():
            self._parameters[name] = param  # the same object: adoption, not a copy
        for name, buf in original._buffers.items():
            self._buffers[name] = buf
        self._non_persistent_buffers_set = set(original._non_persistent_buffers_set)
        self.training = original.training
        self.spec = spec
        self.impl = impl
        self.original_class = type(original)
        # Not registered as a child: it must not appear in state_dict, named_modules or `.to()`.
        object.__setattr__(self, "_normswap_original", original)
        self._backend = backend if backend is not None else get_backend(impl)
        if spec.eps_attr and not hasattr(self, spec.eps_attr):
            setattr(self, spec.eps_attr, spec.eps)

    # -- what the forward needs -------------------------------------------------------------
    @property
    def norm_eps(self) -> float | None:
        """The eps attribute, read like the original reads it. None only for torch's
        nn.RMSNorm(eps=None), whose eps then depends on the input's dtype (see eps_for)."""
        if not self.spec.eps_attr:
            return self.spec.eps
        eps = getattr(self, self.spec.eps_attr)
        return None if eps is None else float(eps)

    def eps_for(self, x: torch.Tensor) -> float:
        """The eps this call uses."""
        eps = self.norm_eps
        return default_eps(x.dtype) if eps is None else eps

    def _param(self, attr: str) -> torch.Tensor | None:
        return self._parameters.get(attr, self._buffers.get(attr))

    @property
    def norm_weight(self) -> torch.Tensor | None:
        return self._param(self.spec.weight_attr) if self.spec.has_weight else None

    @property
    def norm_bias(self) -> torch.Tensor | None:
        return self._param(self.spec.bias_attr) if self.spec.has_bias else None

    def _flatten(self, x: torch.Tensor, *params):
        """Backends reduce over the last dimension only. A multi-dimensional normalized_shape
        (nn.LayerNorm((H, W))) is flattened into one and restored afterwards. A per-head norm
        (spec.per_head: parameters (heads, N) broadcast over x's matching dims, only N reduced)
        passes its (heads, N) parameters as they are; deeper parameter shapes are merged into
        that form."""
        shape = self.spec.shape
        if len(shape) <= 1 or (self.spec.per_head and len(shape) == 2):
            return x, params
        lead, n = (math.prod(shape[:-1]), shape[-1]) if self.spec.per_head else (None, math.prod(shape))
        x2 = x.reshape(*x.shape[:-len(shape)], *((lead, n) if lead else (n,)))
        return x2, tuple(p.reshape(*((lead, n) if lead else (n,))) if p is not None else None for p in params)

    def _flat(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None else self._flatten(t)[0]

    def _unflatten(self, y, x: torch.Tensor):
        """y, or (y, h) from a fused residual call, in x's shape."""
        if isinstance(y, tuple):
            return tuple(t.reshape(x.shape) for t in y)
        return y.reshape(x.shape)

    def extra_repr(self) -> str:
        return (f"{tuple(self.spec.shape)}, eps={self.norm_eps}, impl={self.impl}, "
                f"was={self.original_class.__name__}")


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(x) is fuse.StreamTensor:  # the add that produced x may have computed us already
            y = fuse.precomputed(x, self)
            if y is not None:
                return y
        return self._norm(x)

    def fused_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual) in one backend call; the sum is stored in the
        stream's dtype, exactly as `residual + x` would be (see normswap.fuse)."""
        y, h = self._norm(x, residual)
        return y, h

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        raise NotImplementedError

    def fusion_refusal(self, dtype: torch.dtype) -> str | None:
        """Why an add into this norm cannot be fused on a `dtype` stream (None: it can)."""
        return None


class NormswapRMSNorm(NormswapNorm):
    """RMS norm of any family (Llama, Gemma 1+w, T5, q/k head norms) via backend.rms_norm."""

    def _norm(self, x, residual=None):
        s = self.spec
        x2, (w,) = self._flatten(x, self.norm_weight)
        out = self._backend.rms_norm(x2, w, self.eps_for(x), s.offset, s.casting, residual=self._flat(residual))
        return self._unflatten(out, x)


@dataclass(frozen=True)
class RmsForm:
    """How a LayerNorm with a zero-mean input runs as an RMS norm (the speedup path). The one
    name of that concept: patch(rms_forms=...), NormswapLayerNorm.rms_form, the manifest's patch
    section "rms_forms" (its one place there), and normswap.manifest.rms_forms (the reader of a
    convert section).

    LN(x) = RMS(x)·γ + β when mean(x) = 0. After `normswap convert` folded γ (β) into the layers
    that read the norm, the stored weight is ones (bias zeros): multiplying (adding) them changes
    nothing, so weight=False (bias=False) skips that work. The module's own tensors are still the
    ones the float64 proof uses, so a weight that is not ones would be caught by verification.
    """

    weight: bool = True  # multiply by the module's weight (False: γ was folded, the weight is ones)
    bias: bool = True  # add the module's bias (False: β was folded, the bias is zeros)

    def __post_init__(self) -> None:
        require_bool("RmsForm.weight", self.weight)
        require_bool("RmsForm.bias", self.bias)

    @classmethod
    def coerce(cls, value) -> RmsForm:
        if isinstance(value, RmsForm):
            return value
        if isinstance(value, Mapping):
            return cls(weight=bool(value.get("weight", True)), bias=bool(value.get("bias", True)))
        if value is True:
            return cls()
        raise TypeError(f"not an RMS form: {value!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return "RMS" + ("·γ" if self.weight else "") + ("+β" if self.bias else "")


class NormswapLayerNorm(NormswapNorm):
    """LayerNorm (with or without weight/bias) via backend.layer_norm.

    rms_form is the hook for converted checkpoints: when the input stream is known to be zero-mean
    (normswap convert centred every writer), LN(x) = RMS(x)·γ + β, so the mean subtraction can be
    skipped, and with it the multiply/add of a folded γ/β (see RmsForm). It is only valid on such
    models; verification probes it with zero-mean inputs against the LayerNorm's own float64 value.
    """

    def __init__(self, original: nn.Module, spec: NormSpec, impl: str, backend: Backend | None = None,
                 rms_form: RmsForm | None = None):
        super().__init__(original, spec, impl, backend)
        self.rms_form = rms_form

    def _norm(self, x, residual=None):
        s = self.spec
        x2, (w, b) = self._flatten(x, self.norm_weight, self.norm_bias)
        r2 = self._flat(residual)
        form = self.rms_form
        if form is None:
            out = self._backend.layer_norm(x2, w, b, self.eps_for(x), s.offset, residual=r2)
            return self._unflatten(out, x)
        w = w if form.weight else None
        b = b if form.bias else None
        if b is None:
            out = self._backend.rms_norm(x2, w, self.eps_for(x), s.offset, "none", residual=r2)
            return self._unflatten(out, x)
        # Keep LayerNorm's single rounding: normalise, scale and shift in (at least) fp32, cast
        # once; float64 stays float64.
        acc = torch.promote_types(x2.dtype, torch.float32)
        if r2 is None:
            y = self._backend.rms_norm(x2.to(acc), w, self.eps_for(x), s.offset, "none")
            return self._unflatten((y + b.to(acc)).to(x.dtype), x)
        if acc != x2.dtype:
            raise ValueError(self.fusion_refusal(x2.dtype))
        y, h = self._backend.rms_norm(x2, w, self.eps_for(x), s.offset, "none", residual=r2)
        return self._unflatten((y + b, h), x)

    def fusion_refusal(self, dtype: torch.dtype) -> str | None:
        if self.rms_form is not None and self.rms_form.bias and torch.promote_types(dtype, torch.float32) != dtype:
            return (f"it runs as RMS + β in fp32 on a {str(dtype).removeprefix('torch.')} stream (one rounding); "
                    "the fused kernel would round the normalised value before β is added")
        return None

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", rms_form={self.rms_form.describe()}" if self.rms_form else "")


def build_replacement(original: nn.Module, spec: NormSpec, impl: str, backend: Backend | None = None,
                      rms_form: RmsForm | None = None) -> NormswapNorm:
    """The replacement module for `original`, described by `spec` (from the registry). rms_form
    (a LayerNorm on a zero-mean stream only) says it runs as an RMS norm, and which of γ/β apply."""
    if spec.kind == "rms":
        if rms_form is not None:
            raise ValueError("rms_form applies to LayerNorms only")
        return NormswapRMSNorm(original, spec, impl, backend)
    return NormswapLayerNorm(original, spec, impl, backend, rms_form=rms_form)


def restore_original(replacement: NormswapNorm) -> nn.Module:
    """The original module, holding the replacement's *current* tensors (a `.to()`, a
    load_state_dict or accelerate may have swapped Parameter objects since the patch)."""
    original: nn.Module = replacement._normswap_original
    for name in list(original._parameters):
        original._parameters[name] = replacement._parameters.get(name)
    for name in list(original._buffers):
        original._buffers[name] = replacement._buffers.get(name)
    if replacement.spec.eps_attr and replacement.spec.eps_attr in vars(replacement):
        setattr(original, replacement.spec.eps_attr, getattr(replacement, replacement.spec.eps_attr))
    original.train(replacement.training)
    return original


@contextmanager
def originals_in_place(model: nn.Module) -> Iterator[nn.Module]:
    """Every replacement in `model` swapped back for its original module (holding the current
    tensors) for the block, then put back. The caller takes care of a residual fusion (its hooks
    would hand the originals tagged sums): swap.unpatched does both."""
    from normswap import walk

    reps = [(p, m) for p, m in model.named_modules() if isinstance(m, NormswapNorm)]
    for path, rep in reps:
        walk.set_submodule(model, path, restore_original(rep))
    try:
        yield model
    finally:
        for path, rep in reps:
            walk.set_submodule(model, path, rep)
