"""`normswap tune`: measure launch tiles on this machine's GPU into the user launch table (see
normswap.kernels.tune.tune_launches); `normswap tune --show`: which tables are in effect."""

from __future__ import annotations

import click

from normswap.cli.main import cli, emit, json_option

# What tune_launches' messages call its options here: the flags they came from.
OPTION_NAMES = {k: f"--{k}" for k in ("ops", "passes", "dtypes", "hidden", "budget")}


@cli.command()
@click.option("--budget", type=float, default=None, metavar="SECONDS",
              help="Stop starting keys when this is nearly spent (default 600); a later run goes on.")
@click.option("--ops", default=None, metavar="LIST", help="Comma-separated ops (default: rms_norm,layer_norm).")
@click.option("--dtypes", default=None, metavar="LIST", help="Comma-separated dtypes (default: bf16,fp32).")
@click.option("--passes", default=None, metavar="LIST", help="Comma-separated passes (default: fwd,bwd).")
@click.option("--hidden", default=None, metavar="N[,N...]",
              help="Only these hidden sizes (your model's), each at 512 and many rows; default: the benchmark "
                   "grid, 1,024 to 262,144.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Table to write (default: the user table: $NORMSWAP_LAUNCH_TABLE, else "
                   "normswap/launch_table.json under $XDG_CACHE_HOME or ~/.cache); an existing file is "
                   "the starting point.")
@click.option("--retune", is_flag=True, help="Measure keys the table already has for this GPU again.")
@click.option("--show", is_flag=True, help="Only say which launch tables are in effect here; tune nothing.")
@json_option
def tune(budget, ops, dtypes, passes, hidden, out, retune, show, as_json) -> None:
    """Measure the kernels' launch tiles on this GPU and keep the fastest in the user table.

    Every later normswap launch on this machine reads the table (never times anything itself), so
    the same tiles, and the same output bits, are used on every run. Needs a CUDA device."""
    from normswap.kernels import tune as tuner

    if show:
        emit(tuner.launch_table_status(), as_json, render_status)
        return

    def log(line: str) -> None:
        click.echo(line, err=True)

    given = {k: v for k, v in dict(ops=ops, passes=passes, dtypes=dtypes, budget=budget).items() if v is not None}
    result = tuner.tune_launches(hidden=hidden, out=out, retune=retune, log=log, option_names=OPTION_NAMES, **given)
    emit(result, as_json, render_result)


def render_result(d: dict) -> None:
    from normswap.kernels.tune import fmt_tile

    click.echo(f"{d['device']} ({d['arch']}): {len(d['tuned'])} of {d['keys']} keys tuned, {d['already']} already "
               f"in the table, {len(d['not_tuned'])} not tuned, {d['not_attempted']} left for a later run")
    for e in d["tuned"]:
        same = e["tile"] == e["static_tile"]
        click.echo(f"  {e['op']} {e['pass']} {e['dtype']} hidden {e['hidden']} rows {e['rows']}: "
                   + ("the static tile stays" if same else f"{fmt_tile(e['tile'])} instead of {fmt_tile(e['static_tile'])}")
                   + " (" + ", ".join(f"{m} rows {us:.1f} us" for m, us in e["us"].items()) + ")")
    for e in d["not_tuned"]:
        click.echo(f"  {e['op']} {e['pass']} {e['dtype']} hidden {e['hidden']} rows {e['rows']}: not tuned: {e['why']}")
    click.echo(f"table {d['out']}\nreport {d['report']}")


def render_status(d: dict) -> None:
    where = f"{d['device']} ({d['arch']})" if d["device"] else "no CUDA device (launches use the interpreter's tiles)"
    click.echo(f"device: {where}")
    for what in ("committed", "user"):
        s = d[what]
        if s["state"] == "off":  # no path to name: the environment switched it off ("user table: -: off" said neither)
            from normswap.kernels.launch_table import USER_ENV

            click.echo(f"{what} table: none is read ({USER_ENV}={(d.get('user_env') or '').strip()}); launches use the "
                       "committed table and the static heuristics")
            continue
        line = f"{what} table: {s['path']}: {s['state']}"
        if s["state"] == "loaded":
            line += f", {s['entries']} entries, {s['apply']} for this device"
        if s.get("stale"):
            line += f", {s['stale']} stale (measured with other kernels: not used; normswap tune measures them again)"
        if s.get("problem"):
            line += f" ({s['problem']})"
        if s.get("other_devices"):
            line += f"; measured on other devices (not used here): {', '.join(s['other_devices'])}"
        click.echo(line)
