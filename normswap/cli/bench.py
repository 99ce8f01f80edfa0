"""`normswap bench`: model-level speed of the unpatched model against each impl (normswap.bench)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from normswap.backends import BACKENDS
from normswap.choices import AT_MOST, MODES
from normswap.cli.main import (
    OldSpellings,
    ProgressBars,
    cli,
    device_option,
    emit,
    json_option,
    model_epilog,
    report_console,
)
from normswap.dtypes import RUN_DTYPES

# What bench_checkpoint's messages call its options here: the flags they came from.
OPTION_NAMES = {"impls": "--impls", "modes": "--modes", "batch": "--batch", "seq": "--seq", "warmup": "--warmup",
                "repeats": "--repeats", "compile_backend": "--compile-backend", "fuse_residual": "--fuse-residual"}


@cli.command("bench", epilog=model_epilog())
@click.argument("model")
@click.option("--impls", "--impl", "impls", cls=OldSpellings, default="torch,triton", show_default=True, metavar="LIST",
              help=f"Comma-separated impls to compare with the unpatched model ({', '.join(BACKENDS)}).")
@click.option("--fuse-residual", is_flag=True, help="Also measure each impl with its residual adds fused into the norms.")
@click.option("--modes", "--mode", "modes", cls=OldSpellings, default=",".join(MODES), show_default=True, metavar="LIST",
              help=f"Comma-separated workloads ({', '.join(MODES)}): train is a fwd+bwd step, decode one step "
                   "with a KV cache.")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences per call.")
@click.option("--seq", type=int, default=512, show_default=True, help="Tokens per sequence (the prompt, for decode).")
@click.option("--dtype", type=click.Choice(RUN_DTYPES), default="bf16", show_default=True,
              help="The dtype the model is built (or its weights loaded) and timed in.")
@device_option
@click.option("--compile", "use_compile", is_flag=True, help="torch.compile every variant.")
@click.option("--compile-backend", default="inductor", show_default=True, help="torch.compile backend (aot_eager: no codegen).")
@click.option("--warmup", type=int, default=3, show_default=True,
              help=f"Untimed calls before the timed ones (at most {AT_MOST['warmup']:,}).")
@click.option("--repeats", type=int, default=10, show_default=True,
              help=f"Timed calls (at most {AT_MOST['repeats']:,}); the median is reported.")
@click.option("--load-weights", is_flag=True, help="Load MODEL's weights (default: random weights from its config).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Results file (default: benchmarks/results/bench-<model>-<device>-<date>.json under the "
                   "current directory).")
@json_option
def bench_cmd(model, impls, fuse_residual, modes, batch, seq, dtype, device, use_compile, compile_backend, warmup,
              repeats, load_weights, out, as_json):
    """Time MODEL unpatched and patched with each of --impls (and fused with --fuse-residual): a training
    step, a prefill and one decode step, side by side in one process; print a table and write JSON.

    MODEL may also be a directory holding only a config.json: by default the weights are random
    (seeded) from the config, so any size can be timed without its weights.
    On a CPU the numbers are CPU numbers and say nothing about GPU speed.
    """
    from normswap.api import bench_checkpoint

    with ProgressBars() as bars:
        result = bench_checkpoint(model, impls, modes=modes, out=out, progress=bars, fuse_residual=fuse_residual,
                                  batch=batch, seq=seq, dtype=dtype, device=device, compile=use_compile,
                                  compile_backend=compile_backend, warmup=warmup, repeats=repeats,
                                  load_weights=load_weights, option_names=OPTION_NAMES)
    emit(result.to_dict(), as_json, _render)


def _render(data: dict) -> None:
    from rich.table import Table

    console = report_console(highlight=False, width=None if sys.stdout.isatty() else 200)
    dev = data["device"]
    where = f"{dev['name']} (CPU numbers: they say nothing about GPU speed)" if dev["cpu_numbers"] else dev["name"]
    c = data["config"]
    table = Table(title=f"normswap bench {c['model']}: batch {c['batch']} x seq {c['seq']}, {c['dtype']}"
                        f"{', compiled' if c['compile'] else ''}, on {where}")
    for col in ("variant", "mode", "median ms", "tokens/s", "vs eager", "peak mem", "timed by", "fused writers"):
        table.add_column(col, justify="left" if col in ("variant", "mode", "timed by") else "right")
    for r in data["rows"]:
        if r["error"]:
            table.add_row(r["variant"], r["mode"], "-", "-", "-", "-", "-", "-")
            continue
        mem = f"{r['peak_memory_bytes'] / 2**30:.2f} GiB" if r["peak_memory_bytes"] is not None else "-"
        table.add_row(r["variant"], r["mode"], f"{r['median_ms']:.3f}", f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup']:.3f}x" if r["speedup"] else "-", mem, r["method"],
                      str(r["fused_writers"]) if r["fused_writers"] is not None else "-")
    console.print(table)
    for r in data["rows"]:
        if r["error"] and r["mode"] == c["modes"][0]:
            console.print(f"{r['variant']}: not measured: {r['error']}")
    for note in data["notes"]:
        console.print(f"note: {note}")
    console.print(f"results written to {data['saved_to']}")
