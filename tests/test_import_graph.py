"""The layering of the package, checked on its source: the library never reaches into the command
line, and no two modules import each other (directly or round a longer circle).

Every import counts, also one inside a function: an import moved into a function to dodge a
circular-import error at load time is still a circle in the design (see docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "normswap"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The normswap modules `name` imports. `from normswap.x import y` is an import of
    normswap.x.y when that is a module, else of normswap.x; a relative import is resolved first."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "normswap")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "normswap":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_package():
    graph = _graph()
    assert "normswap.swap" in graph and "normswap.cli.patch" in graph
    assert "normswap.cli.main" in graph["normswap.cli.patch"]  # the parser sees `from normswap.cli.main import`
    assert "normswap.modules" in graph["normswap.swap"]


def _is_cli(name: str) -> bool:
    # `python -m normswap` (normswap/__main__.py) is the command line's second entry point.
    return name in ("normswap.cli", "normswap.__main__") or name.startswith("normswap.cli.")


def test_no_library_module_imports_the_cli():
    offenders = {name: sorted(m for m in deps if _is_cli(m)) for name, deps in _graph().items() if not _is_cli(name)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_import_circle():
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_cycle_finder(graph, expected):
    assert _cycles(graph) == expected


def _dtype_tables(path: Path) -> list[int]:
    """Lines of `path` holding a table from dtype names ("bf16", "float16", ...) to torch dtypes,
    or a tuple of those names: what normswap/dtypes.py owns."""
    from normswap.dtypes import DTYPES

    def name(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in DTYPES

    def torch_dtype(node) -> bool:
        return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
                and node.attr in {str(d).removeprefix("torch.") for d in DTYPES.values()})

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Dict) and any(name(k) and torch_dtype(v) for k, v in zip(node.keys, node.values, strict=True)):
            found.append(node.lineno)
        elif isinstance(node, ast.Tuple) and len(node.elts) > 1 and all(name(e) for e in node.elts):
            found.append(node.lineno)
    return found


def test_dtype_names_have_one_registry():
    """The loader, the commands and the experiment read dtype names through normswap.dtypes; a
    second table drifts (one accepts "bfloat16", another does not)."""
    tables = {name: _dtype_tables(path) for name, path in _modules().items() if name != "normswap.dtypes"}
    assert {k: v for k, v in tables.items() if v} == {}
    assert _dtype_tables(PACKAGE / "dtypes.py")  # the check sees the registry itself


def _private_library_imports(path: Path) -> list[str]:
    """`from normswap.x import _y` where normswap.x is not part of the command line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("normswap") and not _is_cli(node.module):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_the_cli_calls_only_public_library_names():
    """A command that needs a private helper of the library is doing the library's work itself
    (bench once called api._check_writable and wrote its results file)."""
    offenders = {name: _private_library_imports(path) for name, path in _modules().items() if _is_cli(name)}
    assert {k: v for k, v in offenders.items() if v} == {}


def _progress_parameters(path: Path) -> dict[str, str]:
    """function -> the annotation of its `progress` parameter, for every function that has one."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if a.arg == "progress":
                    found[node.name] = ast.unparse(a.annotation) if a.annotation is not None else ""
    return found


def test_progress_callbacks_have_one_shape():
    """Every library callback is normswap.progress.ProgressFn, progress(stage, done, total) (or a
    plain bool: draw a bar or not); swap.patch, loading.load, save_patched and run_bench each took
    progress(str) once, and api.py wrapped them in lambdas."""
    allowed = {"ProgressFn | None", "bool | ProgressFn", "bool | ProgressFn | None", "ProgressFn", "bool"}
    odd = {}
    for name, path in _modules().items():
        if _is_cli(name):
            continue
        for fn, annotation in _progress_parameters(path).items():
            if annotation not in allowed and not (fn.startswith("_") and annotation == ""):
                odd[f"{name}.{fn}"] = annotation
    assert odd == {}
    assert _progress_parameters(PACKAGE / "swap.py") == {"patch": "ProgressFn | None"}  # the check sees them


def _referenced(paths) -> set[str]:
    """Every name the code at `paths` uses: names, attributes, imported names."""
    out: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(Path(path).read_text(), str(path))):
            if isinstance(node, ast.Name):
                out.add(node.id)
            elif isinstance(node, ast.Attribute):
                out.add(node.attr)
            elif isinstance(node, ast.alias):
                out.add(node.name.rpartition(".")[2])
    return out


# Reached without their name being written: the third-party adapters by getattr(adapters,
# f"{name}_rms_norm") in backends.py, the click commands through the decorator that registers them.
_REACHED_INDIRECTLY = {"liger_rms_norm", "liger_layer_norm", "quack_rms_norm", "quack_layer_norm", "patch_cmd",
                       "bench_cmd"}


def test_no_public_name_exists_only_for_tests():
    """A public function or class of the package that no package module, benchmark or example uses
    is either dead or public only for the tests (issue 10: make it private, or test it through
    the public path)."""
    library = list(PACKAGE.rglob("*.py"))
    used = _referenced(library) | _referenced([*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "examples").rglob("*.py")])
    exported = (PACKAGE / "__init__.py").read_text()
    unused = []
    for path in library:
        for node in ast.parse(path.read_text(), str(path)).body:
            if (isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_")
                    and node.name not in used and f'"{node.name}"' not in exported
                    and node.name not in _REACHED_INDIRECTLY):
                unused.append(f"{_module_name(path)}.{node.name}")
    assert unused == []


def test_the_cli_lists_come_from_their_registries():
    """--impl, --dtype and bench's --modes offer what the defining registry holds (issue 10: the
    command line kept an impl list of its own once)."""
    import click

    from normswap.backends import BACKENDS
    from normswap.bench import MODES
    from normswap.cli import cli
    from normswap.dtypes import RUN_DTYPES, STORE_DTYPES

    seen = set()
    for name, command in cli.commands.items():
        for param in command.params:
            if isinstance(param.type, click.Choice) and param.name in ("impl", "dtype"):
                expected = BACKENDS if param.name == "impl" else (STORE_DTYPES if name == "convert" else RUN_DTYPES)
                assert tuple(param.type.choices) == expected, (name, param.name)
                seen.add(param.name)
            if (name, param.name) in (("bench", "impls"), ("bench", "modes")):
                listed = BACKENDS if param.name == "impls" else MODES
                assert all(item in param.help for item in listed), (name, param.name)
                seen.add(param.name)
    modes = next(p for p in cli.commands["bench"].params if p.name == "modes")
    assert modes.default == ",".join(MODES)
    assert seen == {"impl", "dtype", "impls", "modes"}
