"""docs/ARCHITECTURE.md stays a map of the package as it is: its layer table names every module
(and every kernels/ module, every subpackage), and every file the document names exists."""

from __future__ import annotations

import re
from pathlib import Path

from test_import_graph import _graph

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "normswap"
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _layer_table() -> str:
    """The code block under '## Layers'."""
    section = DOC.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


def _named(text: str) -> set[str]:
    return set(re.findall(r"[\w./-]*\w\.py\b", text))


def test_the_layer_table_covers_every_module():
    table = _layer_table()
    words = set(re.findall(r"[\w.]+\.py\b|\w+/", table))
    wanted = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    wanted |= {p.name for p in (PACKAGE / "kernels").glob("*.py") if p.name != "__init__.py"}
    wanted |= {f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert sorted(wanted - words) == []


def test_every_file_the_document_names_exists():
    files = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    missing = []
    for name in _named(DOC.read_text()):
        if "<" in name:
            continue
        if not any(f == name or f.endswith("/" + name) for f in files):
            missing.append(name)
    assert sorted(missing) == []
    assert "swap.py" in _named(DOC.read_text())  # the check sees the names


def _entries() -> list[str]:
    """The table's rows in order: "api.py", "cli/", ... (continuation lines belong to the row above)."""
    return [line.split()[0] for line in _layer_table().strip("\n").splitlines() if line and not line[0].isspace()]


def test_the_layer_table_is_a_layering():
    """What the document says: every module imports only from its own row or the rows below it."""
    rows = _entries()

    def row(module: str) -> int | None:
        top = module.split(".")[1] if "." in module else None
        for i, entry in enumerate(rows):
            if top is not None and entry in (f"{top}.py", f"{top}/"):
                return i
        return None  # errors, _env, _version: leaves every layer may import

    upward = sorted((m, d) for m, deps in _graph().items() for d in deps
                    if row(m) is not None and row(d) is not None and row(d) < row(m))
    assert upward == []
    assert row("normswap.cli.patch") == 0 and row("normswap.kernels.reference") is not None  # the check sees rows
