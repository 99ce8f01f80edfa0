"""Measure the committed launch table (normswap/kernels/launch_table.json) on a CUDA device.

    python benchmarks/tune.py                                   # every key of the benchmark grid
    python benchmarks/tune.py --ops rms_norm --dtypes bf16 --passes fwd --hidden 4096,65536
    python benchmarks/tune.py --budget 240 --out OUT/table.json --report OUT/tune.md --commit SHA

The tuner is the library's (normswap/kernels/tune.py, which `normswap tune` runs into a user's
own table); this is its project entry: by default it writes the package's committed table,
starts from it when --out does not exist yet, and skips every key the table has for this GPU's
architecture, whichever device of that architecture measured it (--retune measures them again).
Needs a CUDA device: elsewhere it exits 2 with one line and writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# This checkout's normswap, also where another copy is installed (a second clone, a worktree): a
# script measures the kernels of the tree it is in.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="rms_norm,layer_norm", help="comma list (default rms_norm,layer_norm)")
    p.add_argument("--passes", default="fwd,bwd", help="comma list (default fwd,bwd)")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma list (default bf16,fp32)")
    p.add_argument("--hidden", default=None, help="comma list: only these hidden sizes")
    p.add_argument("--budget", type=float, default=540.0, help="seconds; no key starts with < 25 s left")
    p.add_argument("--out", default=None, help="table to write (default: the package's launch_table.json); "
                   "an existing file is the starting point")
    p.add_argument("--report", default=None, help="markdown report (default: next to --out, .md)")
    p.add_argument("--retune", action="store_true", help="measure keys the table already has again")
    p.add_argument("--commit", default=None, help="the commit the tree is at (no .git on a device copy)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from normswap.errors import NormswapError
    from normswap.kernels import launch_table as T
    from normswap.kernels.tune import tune_launches

    try:
        result = tune_launches(ops=args.ops, passes=args.passes, dtypes=args.dtypes, hidden=args.hidden,
                               budget=args.budget, out=args.out or T.PATH, retune=args.retune,
                               report_path=args.report, base=T.PATH, commit=args.commit, same_device_only=False,
                               log=lambda s: print(s, file=sys.stderr))
    except NormswapError as e:
        print(f"benchmarks/tune.py: {e}", file=sys.stderr)
        return 2
    n = len(result["tuned"])
    print(f"{n} keys tuned" + (f", written to {result['out']}" if n else " (table unchanged)")
          + f"; report {result['report']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as kernel_static.py compiles
    import normswap  # noqa: F401 - decides TRITON_INTERPRET before anything imports triton

    raise SystemExit(main())
