"""Fused residual add + norm inside transformers' own decoder layers (patch(fuse_residual=True)).

A pre-norm block writes `h = residual + sublayer(norm(residual))`, and the next thing that reads h
is a norm: the block's second norm, the next block's input norm, or the final norm. vLLM fuses that
add into the norm in its own model code; here the model's code is left as it is, and the fusion
happens by *anticipation* at the add:

1. A forward hook on each writer (the module whose output is added into the stream, named per
   architecture in residual_writers.toml or the convert data, or found by normswap.discover's
   traced forward for other LayerNorm models) tags its output as a StreamTensor
   that knows which norm will read the sum ("write" role).
2. Python's `residual + output` reaches StreamTensor.__torch_function__, which calls that norm's
   fused kernel once: (y, h) = norm(residual + output), h = the sum as stored. It returns h,
   tagged with y ("sum" role).
3. The norm's forward (NormswapNorm) receives exactly that h and returns y without computing.

Everything stays value-correct by construction: h is bit for bit the add the model asked for
(same dtypes and shapes, one rounding of the fp32 sum); y is only used by the norm it was computed
for and only on the very tensor object it was computed from (an in-place change drops it); any
other op on a StreamTensor runs unchanged and returns a plain tensor. Where a tag is lost (a
dropout that is active, an op between the add and the norm) the model simply runs unfused.

Which norm reads each writer's sum is not data: normswap.fusion.discover runs one forward pass
(through `recording`) with the writers tagged for discovery and records, per writer, the norm that receives its sum directly (or the
first op that consumed the sum instead: the reason it stays unfused). Sums of several writers
(parallel blocks: GPT-NeoX, Phi, Falcon compute `attn + mlp + residual`) combine before the add
that meets the stream; reshapes that keep the hidden dimension (OPT flattens the tokens between
the add and the norm) carry the precomputed y along.

Under torch.compile dynamo traces __torch_function__ like any Python code: the graph holds the
backend's fused op (normswap::rms_norm_fwd / layer_norm_fwd with a residual for triton) and no
graph break. No host syncs are added, so CUDA-graph capture of a decode step is unaffected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


_ADDS = (torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.add, torch.add)
_IADDS = (torch.Tensor.__iadd__, torch.Tensor.add_)
_SHAPE_OPS = (torch.Tensor.view, torch.Tensor.reshape)

# The discovery recorder of the forward pass in progress (None: not discovering).
_RECORDER: Recorder | None = None
# The counter of `counting()` in progress (None: not counting).
_USED: FusedCount | None = None


@dataclass
class FusedCount:
    norms: set[int] = field(default_factory=set)  # id() of each norm that returned a fused add's value


@contextmanager
def counting() -> Iterator[FusedCount]:
    """Count the norms that returned a fused add's precomputed value while the block runs (eager
    forwards only: a compiled graph runs no Python). A pair patch found fuses only where nothing
    comes between the add and the norm; this says how many did in a real call."""
    global _USED
    outer, _USED = _USED, FusedCount()
    try:
        yield _USED
    finally:
        _USED = outer


class StreamTensor(torch.Tensor):
    """A tensor on its way into, or just added to, the residual stream (see the module doc).

    Roles, as attributes (absent = not in that role):
      _ns_into     write: adding this to another tensor computes _ns_into's norm of the sum
      _ns_norm     sum: _ns_normed is _ns_norm(self), computed by the add that produced self
      _ns_normed
      _ns_key      sum: what y depends on besides the sum's values (see precomputed)
      _ns_writers  discovery: the writer paths this term (or sum) comes from
      _ns_summed   discovery: True once the writers met the stream
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Everything below sees plain tensors (shape reads, the kernels, the add itself).
        with torch._C.DisableTorchFunctionSubclass():
            return _dispatch(func, args, kwargs or {})


def _dispatch(func, args, kwargs):
    if func in _ADDS and len(args) == 2 and not kwargs:
        out = _add(func, args[0], args[1])
        if out is not None:
            return out
    elif func in _IADDS and len(args) == 2 and not kwargs:
        return _iadd(func, args[0], args[1])
    elif func is F.dropout and _dropout_is_identity(args, kwargs):
        return args[0]  # eval mode or p = 0: the tag survives it
    elif func in _SHAPE_OPS and args:
        return _reshape(func, args, kwargs)
    if _RECORDER is not None:
        _RECORDER.consumed_by(func, args)
    if args and type(args[0]) is StreamTensor and _in_place(func):
        _forget(args[0])  # its values change: a precomputed norm (or a fusion target) is stale
    return func(*args, **kwargs)


def _dropout_is_identity(args, kwargs) -> bool:
    # F.dropout(input, p=0.5, training=True, inplace=False), its arguments positional or not
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    return not training or p == 0


# In-place ops that a model may apply to a stream value; under torch.compile (which cannot trace
# the name test below) only these are recognised.
_KNOWN_IN_PLACE = (torch.Tensor.__setitem__, torch.Tensor.mul_, torch.Tensor.div_, torch.Tensor.sub_,
                   torch.Tensor.copy_, torch.Tensor.zero_, torch.Tensor.fill_, torch.Tensor.clamp_,
                   torch.Tensor.masked_fill_, torch.Tensor.__imul__, torch.Tensor.__isub__,
                   torch.Tensor.__itruediv__)


def _in_place(func) -> bool:
    if torch.compiler.is_compiling():
        return func in _KNOWN_IN_PLACE
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or name == "__setitem__"


def _forget(t: StreamTensor, keep_into: bool = False) -> None:
    for name in ("_ns_norm", "_ns_normed", "_ns_key", "_ns_summed", *(() if keep_into else ("_ns_into",))):
        if getattr(t, name, None) is not None:
            setattr(t, name, None)  # (not __dict__.pop: dynamo loses the other tags then)


def _tag(t: torch.Tensor, **attrs) -> StreamTensor:
    out = t.as_subclass(StreamTensor)
    for k, v in attrs.items():
        setattr(out, k, v)
    return out


def _role(t, name: str):
    return getattr(t, name, None) if type(t) is StreamTensor else None


def _compatible(a, b) -> bool:
    """The fused kernel stores h in the stream's dtype: only an add that torch would compute in
    that dtype, without broadcasting, is the same add."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device and a.is_floating_point())


def _add(func, a, b):
    if not _compatible(a, b):
        return None
    if _RECORDER is not None:
        return _RECORDER.add(func, a, b)
    into_a, into_b = _role(a, "_ns_into"), _role(b, "_ns_into")
    if into_a is not None and into_b is not None:
        # Two writers summed before they meet the stream (parallel attention + MLP).
        return _tag(func(a, b), _ns_into=into_a) if into_a is into_b else None
    if into_a is None and into_b is None:
        return None
    write, stream, norm = (a, b, into_a) if into_a is not None else (b, a, into_b)
    y, h = norm.fused_add(write, stream)
    return _tag(h, _ns_norm=norm, _ns_normed=y, _ns_key=_key(h, norm))


def _iadd(func, a, b):
    """`a += b` (Falcon adds the attention output into the MLP output in place)."""
    keep = _role(a, "_ns_into") is not None and _role(a, "_ns_into") is _role(b, "_ns_into")
    writers = _role(a, "_ns_writers"), _role(b, "_ns_writers")
    if keep and torch.compiler.is_compiling():
        # Dynamo rebinds the target of an in-place op to a plain tensor, dropping the tag; out
        # of place, the result keeps it. Only the two writers' own sum is affected (a local of
        # the block's forward), and a compiled graph is functional anyway.
        return _tag(torch.add(a, b), _ns_into=a._ns_into)
    out = func(a, b)
    if type(a) is StreamTensor:
        # The values changed: a precomputed norm of `a` is stale, and `a` stays a writer only
        # when both terms are writers feeding the same norm.
        _forget(a, keep_into=keep)
        if _RECORDER is not None and writers[0] is not None:
            a._ns_writers = writers[0] | (writers[1] or frozenset())
        return a  # in-place: `a` itself, with its tags (dynamo's traced result would drop them)
    return out


def _reshape(func, args, kwargs):
    src = args[0]
    out = func(*args, **kwargs)
    if not isinstance(out, torch.Tensor) or out.shape[-1:] != src.shape[-1:] or out.dtype != src.dtype:
        return out
    normed = _role(src, "_ns_normed")
    if normed is not None:  # rows regrouped, the hidden dimension kept: the norm commutes with it
        # (a view shares src's version counter, so src's key stays valid for it)
        return _tag(out, _ns_norm=src._ns_norm, _ns_normed=func(normed, *args[1:], **kwargs),
                    _ns_key=_role(src, "_ns_key"))
    into = _role(src, "_ns_into")
    if into is not None:
        return _tag(out, _ns_into=into)
    writers = _role(src, "_ns_writers")
    if writers is not None:
        return _tag(out, _ns_writers=writers, _ns_summed=_role(src, "_ns_summed"))
    return out


def precomputed(x: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
    """What `norm` returns for x when the add that produced x already computed it (else None).
    Called first thing by every NormswapNorm forward."""
    if _RECORDER is not None:
        _RECORDER.reached(x, norm)
        return None
    if getattr(x, "_ns_norm", None) is not norm:
        return None
    y = x._ns_normed
    if torch.compiler.is_compiling():
        return y  # traced within one forward: nothing can change in between
    with torch._C.DisableTorchFunctionSubclass():
        # y is only norm(x) while neither x (through any view of it) nor the norm's tensors were
        # changed in place since the add (a tagged sum kept across forwards, e.g. a returned
        # hidden state fed back after an optimizer step) ...
        if x._ns_key != _key(x, norm):
            return None
        # ... and while y's graph still reaches x's inputs: a sum returned through an autograd
        # Function (reentrant gradient checkpointing runs the block without grad, then gives the
        # output a new grad_fn) carries a y computed without grad, which would cut every
        # gradient upstream of this norm.
        if torch.is_grad_enabled() and x.requires_grad and not y.requires_grad:
            return None
        if _USED is not None:
            _USED.norms.add(id(norm))
    return y


def _key(h: torch.Tensor, norm: nn.Module):
    """What must not change between the fused add and the norm's call for the precomputed value
    to stay norm(h): h's version counter (shared by its views) and the norm's tensors (object,
    storage, version). None under torch.compile, which does not check it (see precomputed)."""
    if torch.compiler.is_compiling():
        return None
    with torch._C.DisableTorchFunctionSubclass():
        return (_version(h), *((id(p), p.data_ptr(), _version(p)) for p in (norm.norm_weight, norm.norm_bias)
                               if p is not None))


def _version(t: torch.Tensor) -> int | None:
    # Tensors made under torch.inference_mode keep no version counter (reading it raises); there
    # only an in-place op on the tensor itself is seen (_forget), not one through a view of it.
    return None if t.is_inference() else t._version


# ---------------------------------------------------------------------------------------------
# Discovery: which norm reads each writer's sum
# ---------------------------------------------------------------------------------------------


class Recorder:
    def __init__(self, norm_paths: dict[int, str]):
        self.norm_paths = norm_paths
        self.target: dict[str, str] = {}  # writer path -> norm path
        self.other: dict[str, str] = {}  # writer path -> what consumed its sum instead
        self.seen: set[str] = set()

    def add(self, func, a, b):
        wa, wb = _role(a, "_ns_writers"), _role(b, "_ns_writers")
        out = func(a, b)
        terms = [w for w, t in ((wa, a), (wb, b)) if w is not None and not _role(t, "_ns_summed")]
        if len(terms) == 2:  # writer + writer: still one term of the stream
            return _tag(out, _ns_writers=terms[0] | terms[1])
        if len(terms) == 1:  # the term meets the stream: this is the add a fusion replaces
            return _tag(out, _ns_writers=terms[0], _ns_summed=True)
        self.consumed_by(func, (a, b))
        return out

    def reached(self, x, norm) -> None:
        writers = _role(x, "_ns_writers")
        if writers is None:
            return
        if not _role(x, "_ns_summed"):
            self._other(writers, f"a norm ({self.norm_paths.get(id(norm), type(norm).__name__)}) reads the "
                                 "sublayer output before it is added")
            return
        path = self.norm_paths[id(norm)]
        for w in writers:
            if w in self.target:
                continue  # a second norm reading the same sum (Falcon's ln_attn and ln_mlp)
            refusal = norm.fusion_refusal(x.dtype)
            if refusal is not None:
                self.other[w] = f"its sum is read by {path}: {refusal}"
            else:
                # The very tensor reached the norm: ops that only read it on the way do not matter.
                self.target[w] = path
                self.other.pop(w, None)

    def consumed_by(self, func, args) -> None:
        name = getattr(func, "__name__", str(func))
        for a in args:
            writers = _role(a, "_ns_writers")
            if writers is not None:
                what = "its sum" if _role(a, "_ns_summed") else "its output"
                self._other(writers, f"{what} is used by `{name}` before any norm reads the sum")

    def _other(self, writers, why: str) -> None:
        for w in writers:
            if w not in self.target:
                self.other.setdefault(w, why)


@contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Route the stream's adds and the norms it reaches to `recorder` for the block (discovery)."""
    global _RECORDER
    _RECORDER = recorder
    try:
        yield recorder
    finally:
        _RECORDER = None


def tagging_hook(attrs: Callable[[], dict[str, Any]]):
    def hook(module, args, out):
        if isinstance(out, torch.Tensor):
            return _tag(out, **attrs())
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (_tag(out[0], **attrs()), *out[1:])
        return None
    return hook


# ---------------------------------------------------------------------------------------------
# Where the writers are (data)
# ---------------------------------------------------------------------------------------------


def _writer_data() -> dict[str, list[str]]:
    raw = tomllib.loads((resources.files("normswap") / "residual_writers.toml").read_text(encoding="utf-8"))
    return {k: list(v["writers"]) for k, v in raw.items()}


def writer_patterns(model_type: str | None) -> list[str]:
    """The residual writers of `model_type` ("{i}" = block index): residual_writers.toml, else
    the `writers` of the architecture's convert data; [] when normswap knows neither."""
    if not model_type:
        return []
    data = _writer_data()
    if model_type in data:
        return data[model_type]
    from normswap.archs import load_arch

    arch = load_arch(model_type)
    return list(arch.writers) if arch is not None else []


# ---------------------------------------------------------------------------------------------
# Applying and removing
# ---------------------------------------------------------------------------------------------


@dataclass
class FusionReport:
    """Which adds were fused into which norm, and why the others were not."""

    pairs: dict[str, str] = field(default_factory=dict)  # writer path -> norm path
    unfused: dict[str, str] = field(default_factory=dict)  # writer path -> reason
    model_check: Any = None  # verify.ModelCheck: fused logits vs the unfused patched model

    @property
    def ok(self) -> bool:
        return self.model_check is None or self.model_check.passed

    def to_dict(self) -> dict:
        return {
            "fused": len(self.pairs), "unfused_count": len(self.unfused),
            "pairs": [{"writer": w, "norm": n} for w, n in self.pairs.items()],
            "unfused": [{"writer": w, "reason": r} for w, r in self.unfused.items()],
            "model_check": self.model_check.to_dict() if self.model_check is not None else None,
        }


@dataclass
class Fusion:
    """What fuse_residual installed on a model (kept on it as `_normswap_fusion`)."""

    pairs: dict[str, str]
    handles: list = field(default_factory=list)


def disable(model: nn.Module) -> dict[str, str]:
    """Remove the fusion hooks; returns the pairs that were fused ({} when none)."""
    fusion = vars(model).pop("_normswap_fusion", None)
    if fusion is None:
        return {}
    for h in fusion.handles:
        h.remove()
    return fusion.pairs


def _fused_pairs(model: nn.Module) -> dict[str, str]:
    fusion = vars(model).get("_normswap_fusion")
    return dict(fusion.pairs) if fusion is not None else {}
