"""dtype names as users write them ("fp16", "bfloat16"), for every entry point that takes one: the
loader, patch(dtype=...), the command line. A leaf module, so that each can import it."""

from __future__ import annotations

import torch

from normswap.errors import BadInputError

# The short names the commands offer: what a model is loaded and run in; a conversion may also
# store float64 (its arithmetic is float64 anyway).
RUN_DTYPES = ("fp32", "fp16", "bf16")
STORE_DTYPES = (*RUN_DTYPES, "fp64")
DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp64": torch.float64, "float64": torch.float64,
}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A torch.dtype (or None) from a name or a torch.dtype; BadInputError for anything else,
    a torch.dtype no model runs in (int32, bool, complex) included: torch.finfo or from_pretrained
    would fail on it later, with their own message, after the model is loaded."""
    if name is None:
        return name
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise BadInputError(f"dtype {name}: normswap runs models in {', '.join(RUN_DTYPES)} "
                                "(and stores float64)")
        return name
    if not isinstance(name, str):
        raise TypeError(f"dtype must be a name such as 'fp16' or a torch.dtype, not {type(name).__name__}")
    try:
        return DTYPES[name.lower().removeprefix("torch.")]
    except KeyError:
        raise BadInputError(f"unknown dtype {name!r}; choose one of {', '.join(RUN_DTYPES)}") from None
