"""The package's layers import one way: symm -> kernels -> runtime -> ops -> float8 -> nn ->
{parallel, compile} -> integrations -> {bench, demo, cli, doctor}; config is importable by all.

Read from the source (ast), not by importing: every import counts, lazy ones inside functions too,
and importlib calls with a literal module name (or an f-string's literal prefix) count as imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "asynctp"

# lower imports from higher never; same rank: only within one package
RANK = {
    "config": 0,
    "symm": 1,
    "kernels": 2,
    "runtime": 3,
    "ops": 4,
    "float8": 5,
    "nn": 6,
    "parallel": 7,
    "compile": 7,
    "integrations": 8,
    "bench": 9,
    "demo": 9,
    "cli": 9,
    "doctor": 9,
    "__main__": 10,
    "": 10,  # asynctp/__init__.py: the public API, re-exporting every layer
}
PUBLIC_API_FROM = 8  # `import asynctp` (the public API) only from this rank up

# importlib with a module name: lazy loading where importing at the top would cost or cycle
IMPORTLIB_ALLOWED = {
    "asynctp/__init__.py": "asynctp.compile loads inductor (about a second): loaded on first attribute access",
    "asynctp/cli.py": "each subcommand's module (bench, demo) is loaded only when the command line names it",
}
# known import-direction violations: (importer, imported package) -> why it is still there
ALLOWED: dict[tuple[str, str], str] = {}
# private names imported across layers: (importer, name) -> why it is still there
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {}


def _module_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _layer(module: str) -> str:
    """asynctp.runtime.pipeline -> "runtime"; asynctp -> ""; asynctp.cli -> "cli"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _literal_prefix(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value).rstrip(".")
    return None


def _imports(path: Path) -> tuple[list[tuple[str, list[str]]], bool]:
    """([(imported module, names taken from it)], whether importlib is called with a name)."""
    module = _module_of(path)
    is_package = path.name == "__init__.py"
    found: list[tuple[str, list[str]]] = []
    uses_importlib = False
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                uses_importlib = True
                target = _literal_prefix(node.args[0])
                if target is not None and target.startswith("asynctp"):
                    found.append((target, []))
    return [(name, names) for name, names in found if name == "asynctp" or name.startswith("asynctp.")], uses_importlib


def _targets(name: str, names: list[str]) -> list[str]:
    """The modules an import reaches: `from asynctp import ops` reaches asynctp.ops."""
    if name == "asynctp":
        return [f"asynctp.{n}" if n in RANK and n else "asynctp" for n in names] or ["asynctp"]
    return [name]


def test_every_package_has_a_layer():
    layers = {_layer(_module_of(p)) for p in _module_files()}
    assert layers <= set(RANK), f"packages without a layer in RANK: {sorted(layers - set(RANK))}"


def test_imports_point_down_the_layers():
    wrong = []
    for path in _module_files():
        src = _layer(_module_of(path))
        for name, names in _imports(path)[0]:
            for target in _targets(name, names):
                dst = _layer(target)
                if dst == src or dst == "config" or (src, dst) in ALLOWED or (_rel(path), dst) in ALLOWED:
                    continue
                if dst == "":
                    if RANK[src] < PUBLIC_API_FROM:
                        wrong.append(f"{_rel(path)} imports the public API (asynctp)")
                elif RANK[dst] >= RANK[src]:
                    wrong.append(f"{_rel(path)} ({src or 'asynctp'}) imports {target} ({dst})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(set(wrong)))


def test_config_imports_nothing_of_asynctp():
    assert _imports(PACKAGE / "config.py")[0] == []


def test_no_private_names_across_layers():
    wrong = []
    for path in _module_files():
        src = _layer(_module_of(path))
        for name, names in _imports(path)[0]:
            if _layer(name) != src:
                wrong += [f"{_rel(path)}: from {name} import {n}" for n in names
                          if n.startswith("_") and n != "__version__" and (_rel(path), n) not in PRIVATE_ALLOWED]
    assert not wrong, "private names imported from another layer:\n" + "\n".join(wrong)


def test_kernels_never_import_torch_distributed():
    """kernels/ is Triton and plain torch: what a GEMM waits on is handed to it as tensors."""
    offenders = []
    for path in (PACKAGE / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{_rel(path)}: {m}" for m in mods if m.startswith("torch.distributed")]
    assert not offenders, offenders


def test_importlib_only_where_listed():
    users = {_rel(p) for p in _module_files() if _imports(p)[1]}
    assert users <= set(IMPORTLIB_ALLOWED), f"importlib with module names outside the list: {sorted(users - set(IMPORTLIB_ALLOWED))}"
    stale = set(IMPORTLIB_ALLOWED) - users
    assert not stale, f"listed but no longer using importlib (remove from IMPORTLIB_ALLOWED): {sorted(stale)}"


def _private_attributes(path: Path) -> set[str]:
    """Private attributes a module defines: methods `def _x` of its classes, `self._x = ...`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            names |= {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_private_attributes_across_layers():
    """`ws._ops` from runtime/ is another layer's private state: ask that layer for a method."""
    defined: dict[str, set[str]] = {}
    for path in _module_files():
        defined.setdefault(_layer(_module_of(path)), set()).update(_private_attributes(path))
    wrong = []
    for path in _module_files():
        src = _layer(_module_of(path))
        others = set().union(*(names for layer, names in defined.items() if layer != src)) - defined.get(src, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in others and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                wrong.append(f"{_rel(path)}:{node.lineno}: .{node.attr}")
    assert not wrong, "private attributes of another layer used:\n" + "\n".join(wrong)
