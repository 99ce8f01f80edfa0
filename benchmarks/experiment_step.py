"""What one training step of each `normswap experiment` loss costs, on a recipe's model shape (CPU).

The language-modelling loss of the `+ft` arms against the distillation loss of the `+distill` arms.

The model is a GPT-2 of the recipe's [pretrain] shape with its initial weights (the time of a step
does not depend on what the weights are); the arm is `approx` (what `approx+ft` and `approx+distill`
train), the teacher the original; one micro-batch of the recipe's [finetune] batch_size x seq_len.
Each case is timed --repeat times, interleaved (lm, distill, teacher forward, lm, ...), after a
warm-up; medians and minimums of wall-clock and of this process's CPU time (on a shared machine the
wall-clock mostly measures the other processes; one thread by default, so CPU time is the work).
--threads 1,2 times each thread count too, in the same process, one count after the other (see
_measure), with the wall-clock's maximum: what oversubscribed threads cost on a loaded machine.

    python benchmarks/experiment_step.py recipes/smoke-kjv-tiny.toml [--repeat 60] [--threads 1[,2]]

Writes a table to stdout and JSON to benchmarks/results/experiment-step-<recipe>-<host>-<date>.json
(--out to choose; --out - for none). A recipe that does not load (or has no [pretrain]): one line, exit 2.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def measure(recipe_path: str, repeat: int, threads: list[int]) -> dict:
    before = torch.get_num_threads()
    try:
        return _measure(recipe_path, repeat, threads)
    finally:  # a caller's process (a test) keeps its own thread count
        torch.set_num_threads(before)


def _measure(recipe_path: str, repeat: int, threads: list[int]) -> dict:
    import transformers

    from normswap.errors import NormswapError
    from normswap.experiment import load_recipe
    from normswap.experiment.arms import build_arm
    from normswap.experiment.pretrain import build_model
    from normswap.experiment.trainer import LOSSES

    recipe = load_recipe(recipe_path)
    if recipe.pretrain is None:
        raise NormswapError(f"{recipe_path}: needs a [pretrain] section (the model shape to build)")
    section, ft = recipe.pretrain, recipe.finetune
    teacher = build_model(section, section.vocab_size, 0, recipe.seed).eval()
    arm = build_arm(teacher, "approx", recipe.impl, ft.dtype).train()
    ids = torch.randint(0, section.vocab_size, (ft.batch_size, ft.seq_len), generator=torch.Generator().manual_seed(0))

    def step(loss):
        LOSSES[loss](arm, ids, teacher).backward()
        arm.zero_grad(set_to_none=True)

    def teacher_forward():
        with torch.no_grad():
            teacher(input_ids=ids)

    cases = {"lm step (fwd+bwd)": lambda: step("lm"), "distill step (fwd+bwd)": lambda: step("distill"),
             "teacher forward": teacher_forward}
    keys = [(n, name) for n in threads for name in cases]
    wall = {key: [] for key in keys}
    cpu = {key: [] for key in keys}
    # One thread count after the other, each after its own warm-up (first-call allocations, dispatch
    # caches, the thread pool), not interleaved: a worker thread of a larger count keeps spinning a while
    # after its parallel region, and this process's CPU time would charge that to the next count's case.
    for n in threads:
        torch.set_num_threads(n)
        for run in cases.values():
            run()
        for _ in range(repeat):
            for name, run in cases.items():
                w, c = time.perf_counter(), time.process_time()
                run()
                cpu[n, name].append(time.process_time() - c)
                wall[n, name].append(time.perf_counter() - w)
    rows = [{"threads": n, "case": name, "wall_ms_median": 1e3 * statistics.median(wall[n, name]),
             "wall_ms_min": 1e3 * min(wall[n, name]), "wall_ms_max": 1e3 * max(wall[n, name]),
             "cpu_ms_median": 1e3 * statistics.median(cpu[n, name]), "cpu_ms_min": 1e3 * min(cpu[n, name])}
            for n, name in keys]
    return {"recipe": recipe.name, "model": {k: getattr(section, k) for k in ("n_layer", "n_embd", "n_head",
                                                                              "vocab_size")},
            "batch": [ft.batch_size, ft.seq_len], "impl": recipe.impl, "dtype": ft.dtype, "threads": threads,
            "repeat": repeat, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "host": socket.gethostname(), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(), "rows": rows}


def _counts(text: str) -> list[int]:
    """--threads: one count or several, comma-separated, each >= 1."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected thread counts such as 1 or 1,2, got {text!r}") from None
    if not counts or min(counts) < 1 or len(set(counts)) < len(counts):
        raise argparse.ArgumentTypeError(f"expected distinct thread counts >= 1, got {text!r}")
    return counts


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, got {text!r}")
    return n


def main(argv=None) -> int:
    from normswap.errors import NormswapError
    from normswap.fileio import write_text_atomic

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", help="a recipe TOML with a [pretrain] section (its model shape)")
    ap.add_argument("--repeat", type=_positive, default=60, help="timed calls per case (default 60)")
    ap.add_argument("--threads", type=_counts, default=[1], help="thread count(s), e.g. 1 or 1,2 (default 1)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...; '-' for none)")
    args = ap.parse_args(argv)
    try:
        result = measure(args.recipe, args.repeat, args.threads)
    except NormswapError as e:
        print(f"benchmarks/experiment_step.py: {e}", file=sys.stderr)
        return 2
    lm = {r["threads"]: r for r in result["rows"] if r["case"] == "lm step (fwd+bwd)"}
    print(f"{result['recipe']}: {result['model']}, batch {result['batch']}, {args.repeat} repeats, load average "
          f"{result['load_avg'][0]:.1f} on {result['cpus']} CPUs")
    print(f"{'threads':>7} {'case':24} {'cpu ms med':>10} {'cpu ms min':>10} {'wall ms med':>11} {'wall ms max':>11} "
          f"{'x lm (cpu med)':>15}")
    for r in result["rows"]:
        print(f"{r['threads']:7d} {r['case']:24} {r['cpu_ms_median']:10.2f} {r['cpu_ms_min']:10.2f} "
              f"{r['wall_ms_median']:11.2f} {r['wall_ms_max']:11.2f} "
              f"{r['cpu_ms_median'] / lm[r['threads']]['cpu_ms_median']:15.2f}")
    if args.out != "-":
        out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
            f"experiment-step-{result['recipe']}-{socket.gethostname()}-{dt.date.today().isoformat()}.json"
        write_text_atomic(out, json.dumps(result, indent=1) + "\n")  # makes its folders; never a half-written file
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
