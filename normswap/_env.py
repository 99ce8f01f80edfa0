"""Process-wide switches that must be set before triton is imported.

Importing any transformers model class imports triton, and triton reads TRITON_INTERPRET once,
at import. On a machine without a CUDA device the interpreter is the only way triton kernels run,
so normswap switches it on, unless the user already decided either way.

Deciding needs torch (is there a CUDA device?), and importing torch takes seconds; `import
normswap` must stay instant (the command line answers Ctrl-C during its start-up with one line,
which it can only do once its own code runs). So importing normswap installs a finder that makes
the decision at the moment something first imports triton, before triton reads the variable.

launched_main: whether this process is the first (or only) one of a launch, read from the launcher's
variables, for work done before an Accelerator exists.
"""

import os
import sys

# Imported by the command line's entry point before it can answer Ctrl-C (cli.main): nothing here
# but what the interpreter has loaded already. importlib.abc alone pulled in tempfile, shutil and
# the compression modules (20 ms idle, far longer on a loaded machine), and an interrupt in them
# ended the process with a traceback.


def prepare_triton_env() -> None:
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


class _BeforeTriton:
    """Runs prepare_triton_env when triton is first imported, then steps aside (finds nothing). A
    meta path finder needs only find_spec (importlib.abc.MetaPathFinder adds nothing it uses)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "triton":
            remove_triton_hook()
            prepare_triton_env()
        return None


def install_triton_hook() -> None:
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    if "torch" in sys.modules:  # deciding now costs nothing
        prepare_triton_env()
        return
    if not any(isinstance(f, _BeforeTriton) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTriton())


def remove_triton_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _BeforeTriton)]


def launched_main() -> bool:
    """True unless a launcher (accelerate launch, torchrun) gave this process a rank other than 0."""
    return os.environ.get("RANK", "0") == "0"
