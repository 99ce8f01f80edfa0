"""Process-wide switches that must be set before triton is imported.

Importing any transformers model class imports triton, and triton reads TRITON_INTERPRET once,
at import. On a machine without a CUDA device the interpreter is the only way triton kernels run,
so normswap switches it on here, first thing, unless the user already decided either way.
"""

import os
import sys


def prepare_triton_env() -> None:
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
