"""The package version and the checkout it runs from, in a module of its own: the manifest writer
and the benchmarks read them without importing the package (whose __init__ imports the modules
that write manifests)."""

import os

__version__ = "0.1.0"


# A copy of the tree made elsewhere (the GPU machine's) may carry no .git, or a stale one: whoever
# made the copy knows its commit and says so here (benchmarks/gpu.py sets it from --commit).
COMMIT_ENV = "NORMSWAP_COMMIT"


def git_commit() -> str | None:
    """HEAD of the checkout normswap runs from ("-dirty" with uncommitted changes to tracked
    files), or None outside a git checkout: the provenance every benchmark result records.
    $NORMSWAP_COMMIT, when set, is the answer instead."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    # Imported here: `import normswap` reads __version__ before the command line can answer Ctrl-C
    # (cli.main), and subprocess brings threading, selectors and locale with it.
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=5, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
