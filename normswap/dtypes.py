"""dtype names as users write them ("fp16", "bfloat16"), for every entry point that takes one: the
loader, patch(dtype=...), the command line. A leaf module, so that each can import it.

Importing it imports no torch: the command line lists RUN_DTYPES and STORE_DTYPES in --help, which
torch's import (1-2 s) made as slow as a command. DTYPES, the names' torch dtypes, is built on first
use."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from normswap.errors import BadInputError

if TYPE_CHECKING:
    import torch

# The short names the commands offer: what a model is loaded and run in; a conversion may also
# store float64 (its arithmetic is float64 anyway).
RUN_DTYPES = ("fp32", "fp16", "bf16")
STORE_DTYPES = (*RUN_DTYPES, "fp64")
# Each name's torch dtype, by its attribute name in torch (DTYPES holds the dtypes themselves).
_TORCH_NAMES = {
    "fp32": "float32", "float32": "float32",
    "fp16": "float16", "float16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp64": "float64", "float64": "float64",
}


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, attr) for name, attr in _TORCH_NAMES.items()}


def __getattr__(name: str):
    # DTYPES, on first use (`from normswap.dtypes import DTYPES` included): then a plain attribute.
    if name == "DTYPES":
        globals()["DTYPES"] = table = _dtypes()
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A torch.dtype (or None) from a name or a torch.dtype; BadInputError for anything else,
    a torch.dtype no model runs in (int32, bool, complex) included: torch.finfo or from_pretrained
    would fail on it later, with their own message, after the model is loaded."""
    if name is None:
        return name
    import torch

    if isinstance(name, torch.dtype):
        if name not in _dtypes().values():
            raise BadInputError(f"dtype {name}: normswap runs models in {', '.join(RUN_DTYPES)} "
                                "(and stores float64)")
        return name
    if not isinstance(name, str):
        raise TypeError(f"dtype must be a name such as 'fp16' or a torch.dtype, not {type(name).__name__}")
    try:
        return _dtypes()[name.lower().removeprefix("torch.")]
    except KeyError:
        raise BadInputError(f"unknown dtype {name!r}; choose one of {', '.join(RUN_DTYPES)}") from None
