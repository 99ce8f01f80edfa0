"""The `normswap` command line: a Click group, one module per command.

Commands build configs and call the library; they hold no logic of their own."""

from normswap.cli.main import cli, main  # noqa: F401

# Each import registers its command on the group.
from normswap.cli import demo  # noqa: F401,E402  isort: skip
from normswap.cli import bench, convert, diff, experiment, patch, ppl, scan  # noqa: F401,E402  isort: skip
