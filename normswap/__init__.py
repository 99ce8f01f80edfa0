"""normswap: find, swap, fold and measure the normalization layers of Hugging Face models."""

from normswap._env import prepare_triton_env

prepare_triton_env()

from normswap._version import __version__  # noqa: E402
from normswap.errors import NormswapError  # noqa: E402
from normswap.loading import load  # noqa: E402
from normswap.modules import RmsForm  # noqa: E402
from normswap.specs import NormSpec  # noqa: E402
from normswap.swap import PatchConfig, patch, revert  # noqa: E402

# The rest of the public API, imported on first use (each pulls in more of transformers).
# (The scan is normswap.scan.scan: a top-level `scan` function would clash with that submodule.)
_LAZY = {
    "convert_model": "normswap.convert",
    "perplexity": "normswap.evaluate",
    "diff_models": "normswap.evaluate",
    # checkpoint level: one call per command (normswap.api)
    "patch_checkpoint": "normswap.api",
    "convert_checkpoint": "normswap.api",
    "evaluate_checkpoint": "normswap.api",
    "diff_checkpoints": "normswap.api",
    "EvalSettings": "normswap.api",
}

__all__ = ["NormSpec", "NormswapError", "PatchConfig", "RmsForm", "__version__", "load", "patch", "revert", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'normswap' has no attribute {name!r}")
