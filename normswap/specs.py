"""NormSpec: everything needed to reproduce one normalization module exactly.

A spec is data: frozen, comparable, and round-trips through JSON (to_dict/from_dict), so that
scan output, patch manifests and conversion reports all speak the same language.

Casting modes (how each family orders its roundings; see docs/ARCHITECTURE.md, "Numerics"):
  llama  y = weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)     # rounded twice
  gemma  y = ((x.float() * rsqrt(mean(x²) + eps)) * (offset + weight.float())).to(x.dtype)
  t5     h = x.float() * rsqrt(mean(x²) + eps); h = h.to(w.dtype) if w is half else h; y = w * h
  none   everything in fp32, one cast of the result to x.dtype (nn.RMSNorm, nn.LayerNorm)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from normswap.errors import BadInputError

Kind = Literal["rms", "layer"]
Casting = Literal["llama", "gemma", "t5", "none"]

KINDS: tuple[str, ...] = ("rms", "layer")
CASTINGS: tuple[str, ...] = ("llama", "gemma", "t5", "none")


@dataclass(frozen=True)
class NormSpec:
    kind: Kind
    eps: float
    eps_attr: str | None = "eps"  # where the module keeps eps (Llama: "variance_epsilon")
    offset: float = 0.0  # 1.0 for Gemma-style (1 + weight) scaling
    casting: Casting = "none"
    has_weight: bool = True
    has_bias: bool = False
    shape: tuple[int, ...] = ()  # normalized shape (the trailing dimensions reduced over)
    dtype: str | None = None  # parameter dtype, e.g. "float32"; None when there are no parameters
    weight_attr: str = "weight"
    bias_attr: str = "bias"
    # Per-head norm (Cohere's q/k LayerNorm): parameters of `shape` (..., N) broadcast over the
    # input's matching leading dims and only the last dim (N) is reduced over; False: every
    # dimension of `shape` is reduced over (nn.LayerNorm((H, W))).
    per_head: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.casting not in CASTINGS:
            raise ValueError(f"casting must be one of {CASTINGS}, got {self.casting!r}")
        if self.kind == "rms" and self.has_bias:
            raise ValueError("an RMS norm with a bias is not a family normswap knows")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "eps", float(self.eps))
        if not (math.isfinite(self.eps) and self.eps >= 0):
            # NaN would fail the bit-for-bit eps check with "eps differs: original nan, spec nan"
            raise BadInputError(f"eps is {self.eps!r}; an eps must be finite and not negative")
        object.__setattr__(self, "offset", float(self.offset))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NormSpec:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown NormSpec fields: {sorted(unknown)}")
        return cls(**{k: (tuple(v) if k == "shape" else v) for k, v in d.items()})
