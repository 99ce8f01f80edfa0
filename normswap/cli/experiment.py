"""`normswap experiment RECIPE`: run a LayerNorm -> RMSNorm comparison (see normswap.experiment)."""

from __future__ import annotations

import signal

import click

from normswap._env import launched_main
from normswap.cli.main import cli, emit, json_option
from normswap.cli.signals import EXIT_INTERRUPTED, EXIT_TERMINATED

# What run_experiment's messages call its options here: the flags they came from.
OPTION_NAMES = {"arms": "--arms", "out": "--out", "overrides": "--set", "force": "--force"}


@cli.command()
@click.argument("recipe", metavar="RECIPE")
@click.option("--out", default=None, metavar="DIR",
              help="Where results and resumable state go (default: runs/<recipe name>).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe value (dotted key, TOML value), e.g. --set finetune.steps=50. Repeatable.")
@click.option("--arms", default=None, metavar="A,B",
              help="Run only these arms (comma-separated), e.g. original,approx+ft.")
@click.option("--force", is_flag=True,
              help="Replace an --out that holds a run of another recipe (and its finished arms), when it holds "
                   "nothing else.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@json_option
def experiment(recipe, out, overrides, arms, force, no_progress, as_json) -> None:
    """Run every arm of RECIPE (original, exact, approx, ... each alone and fine-tuned), evaluate them
    on held-out text from step 0, and write results.json, results.csv, summary.md and curves.png.

    Rerunning the same command resumes where it stopped (Ctrl-C or SIGTERM checkpoints first). Under
    `accelerate launch -m normswap experiment ...` the fine-tuning runs on several processes (DDP).
    """
    from normswap.experiment import Interrupted, StopFlag, run_experiment

    stop = StopFlag()
    try:
        with stop.on_interrupt():
            result = run_experiment(recipe, out, arms, overrides=overrides, progress=not no_progress,
                                    stop=stop, option_names=OPTION_NAMES, force=force)
    except Interrupted as e:
        if launched_main():  # every process of a launch stops together (trainer.any_process): said once
            click.echo(f"normswap: {e}", err=True)
        raise SystemExit(EXIT_TERMINATED if stop.signal == signal.SIGTERM else EXIT_INTERRUPTED) from None
    if not result.data:  # not the main process of an `accelerate launch`: it reports nothing
        return
    data = result.to_dict()

    def render(d: dict) -> None:
        from normswap.experiment.report import summary_markdown

        click.echo(summary_markdown(d), nl=False)
        click.echo("")
        for name, path in d["files"].items():
            click.echo(f"{name}: {path if path else 'not written (pip install matplotlib)'}")

    emit(data, as_json, render)
