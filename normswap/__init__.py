"""normswap: find, swap, fold and measure the normalization layers of Hugging Face models."""

from normswap._env import prepare_triton_env

prepare_triton_env()

from normswap.errors import NormswapError  # noqa: E402
from normswap.manifest import load  # noqa: E402
from normswap.specs import NormSpec  # noqa: E402
from normswap.swap import patch, revert  # noqa: E402

__version__ = "0.1.0"

__all__ = ["NormSpec", "NormswapError", "__version__", "load", "patch", "revert"]
