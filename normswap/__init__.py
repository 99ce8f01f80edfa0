"""normswap: find, swap, fold and measure the normalization layers of Hugging Face models."""

from normswap._env import install_triton_hook

install_triton_hook()

from normswap._version import __version__  # noqa: E402

# The public API, imported on first use: `import normswap` stays instant (no torch), and each
# name pulls in only what it needs of torch and transformers. The command line's entry point
# imports this package before it can answer Ctrl-C (cli.main): what runs here imports no module
# the interpreter has not loaded already (normswap.errors brought re; an interrupt in it was a
# traceback).
# (The scan is normswap.scan.scan: a top-level `scan` function would clash with that submodule.)
_LAZY = {
    "BadInputError": "normswap.errors",
    "NormswapError": "normswap.errors",
    "NormSpec": "normswap.specs",
    "RmsForm": "normswap.modules",
    "PatchConfig": "normswap.swap",
    # what the calls below raise with their report attached (a NormswapError each)
    "VerificationError": "normswap.swap",
    "ConversionRefused": "normswap.api",
    "load": "normswap.loading",
    "patch": "normswap.swap",
    "revert": "normswap.swap",
    "convert_model": "normswap.convert",
    "perplexity": "normswap.evaluate",
    "diff_models": "normswap.evaluate",
    # checkpoint level: one call per command (normswap.api)
    "patch_checkpoint": "normswap.api",
    "convert_checkpoint": "normswap.api",
    "evaluate_checkpoint": "normswap.api",
    "diff_checkpoints": "normswap.api",
    "bench_checkpoint": "normswap.api",
    "EvalSettings": "normswap.api",
    # launch tiles measured on this machine's GPU (normswap tune, normswap tune --show)
    "tune_launches": "normswap.kernels.tune",
    "launch_table_status": "normswap.kernels.tune",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'normswap' has no attribute {name!r}")
