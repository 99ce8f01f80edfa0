"""`normswap demo`: the main job on the embedded default model (no hub, no GPU needed)."""

from __future__ import annotations

import click

from normswap.cli.main import cli


@cli.command()
@click.pass_context
def demo(ctx: click.Context) -> None:
    """Run the main job on the embedded SmolLM2-135M: scan its norms (later: patch and diff)."""
    from normswap.io import DEFAULT_MODEL

    click.echo(f"normswap demo on the embedded default model {DEFAULT_MODEL}", err=True)
    scan_cmd = cli.get_command(ctx, "scan")
    if scan_cmd is not None:
        ctx.invoke(scan_cmd, model=DEFAULT_MODEL)
