"""Find the norms in a model (any device, meta included) and replace a child in its parent."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from torch import nn

from normswap import registry
from normswap.errors import BadInputError, NormswapError, UnknownNormError
from normswap.specs import NormSpec


def require_module(value, name: str = "model", *, weights: bool = False) -> nn.Module:
    """`value` when it is a torch module, else a TypeError naming the parameter (a path, or None,
    fails here instead of as an AttributeError deep inside). weights=True also refuses a model
    whose weights are on the meta device (nothing to run)."""
    if not isinstance(value, nn.Module):
        hint = (" (a model reference: load it with normswap.load, or pass it to the *_checkpoint functions)"
                if isinstance(value, str | os.PathLike) else "")
        raise TypeError(f"{name}: expected a torch.nn.Module, got {type(value).__name__}{hint}")
    if weights:
        meta = next((n for n, p in value.named_parameters() if p.is_meta), None)
        if meta is not None:
            raise BadInputError(f"{name}: {meta} is on the meta device (no weights); load the weights first")
    return value

@dataclass(frozen=True)
class FoundNorm:
    """One norm-like module: its spec when the registry recognises it, else why not."""

    path: str  # dotted path from the model root, as named_modules() spells it
    module_class: str
    spec: NormSpec | None
    unknown_reason: str | None = None
    recognised_by: str | None = None  # "torch-class", "fingerprint:<family>" or "probe"
    bit_exact: bool = True  # False: the spec matches the module within an ulp, not bit for bit

    @property
    def recognised(self) -> bool:
        return self.spec is not None


class UnknownNormWarning(UserWarning):
    """A norm-like module the registry does not recognise; normswap leaves it alone."""


def find_norms(model: nn.Module, strict: bool = False, warn: bool = True) -> list[FoundNorm]:
    """Every norm in `model`, in module order: recognised ones with a spec, and norm-like modules
    the registry does not know (spec None, with the reason). Children of a recognised norm are not
    visited. Unknown ones warn (naming path and class), or raise UnknownNormError when strict."""
    found: list[FoundNorm] = []
    inside: list[str] = []  # prefixes of recognised norms, whose children are part of them
    for path, module in model.named_modules():
        if inside and any(path.startswith(p + ".") for p in inside):
            continue
        if not registry.is_norm_like(module):
            continue
        try:
            rec = registry.recognise(module)
        except BadInputError as e:  # e.g. a NaN eps: name the module it belongs to
            raise BadInputError(f"{path} ({type(module).__name__}): {e}") from None
        found.append(FoundNorm(path, type(module).__name__, rec.spec, rec.reason, rec.method,
                               rec.exact if rec.spec is not None else False))
        if rec.spec is not None:
            inside.append(path)
    unknown = [f for f in found if f.spec is None]
    if unknown and strict:
        f = unknown[0]
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UnknownNormError(f"unknown norm-like module {f.path} ({f.module_class}): {f.unknown_reason}{more}")
    if unknown and warn:
        for f in unknown:
            warnings.warn(
                f"normswap leaves {f.path} ({f.module_class}) alone: {f.unknown_reason}",
                UnknownNormWarning, stacklevel=2,
            )
    return found


def _split(path: str) -> tuple[str, str]:
    parent, _, child = path.rpartition(".")
    return parent, child


def get_submodule(model: nn.Module, path: str) -> nn.Module:
    """The module at a dotted path ("" is the model itself); NormswapError when there is none."""
    if path == "":
        return model
    module = model
    for part in path.split("."):
        nxt = module._modules.get(part) if isinstance(module, nn.Module) else None
        if nxt is None:
            raise NormswapError(f"no module at {path!r} (stopped at {part!r})")
        module = nxt
    return module


def set_submodule(model: nn.Module, path: str, new_module: nn.Module) -> nn.Module:
    """Put `new_module` where `path` is, in its parent (ModuleList/Sequential indices included);
    return the module that was there."""
    if path == "":
        raise NormswapError("cannot replace the model root itself")
    parent_path, child = _split(path)
    parent = get_submodule(model, parent_path)
    old = parent._modules.get(child)
    if old is None:
        raise NormswapError(f"no module at {path!r}")
    # ModuleList/Sequential/ModuleDict keep children in _modules under their index or key, so
    # setattr with the string key works for all of them (and keeps the registration order).
    parent._modules[child] = new_module
    return old
