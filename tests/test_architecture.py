"""The house's import rules that import-linter does not check, read from the source with `ast` (tfmis, its tests,
benchmarks and tools): one import path per name (a name is imported from the module that defines it, or from a
package's `__init__`, which is that package's interface), no private name used across modules, and no import circle
among tfmis's modules, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for folder in ("tfmis", "tests", "benchmarks", "tools") for p in sorted((ROOT / folder).rglob("*.py"))]


def module_file(module: str) -> Path | None:
    """The file of a tfmis module (None for a package: its `__init__` re-exports by design)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    return path if path.is_file() else None


def imported_names(path: Path) -> dict[str, str]:
    """The names a module imports at its top level from tfmis modules: name -> the module it takes it from."""
    names = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tfmis"):
            names.update({a.asname or a.name: node.module for a in node.names})
    return names


def tfmis_imports(path: Path):
    """(line, module, name) of every `from tfmis... import name` in the file, in functions too."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tfmis"):
            for alias in node.names:
                yield node.lineno, node.module, alias.name


def test_every_name_is_imported_from_the_module_that_defines_it():
    """`from tfmis.a.b import N` where tfmis.a.b only imports N from elsewhere is a second import path (a
    compatibility re-export): the import names the defining module instead."""
    cache: dict[str, dict[str, str]] = {}
    second_paths = []
    for path in SOURCES:
        for line, module, name in tfmis_imports(path):
            file = module_file(module)
            if file is None:
                continue
            if module not in cache:
                cache[module] = imported_names(file)
            if name in cache[module]:
                where = cache[module][name]
                second_paths.append(f"{path.relative_to(ROOT)}:{line}: {name} from {module} (defined in {where})")
    assert not second_paths, "\n".join(second_paths)


def test_no_private_name_is_imported_or_read_from_another_module():
    """No `from tfmis.x import _name` and no `module._name` on an imported tfmis module: what another module uses
    is public (and named so)."""
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("tfmis"))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tfmis"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {alias.name} from {node.module}")
                    package = ROOT / node.module.replace(".", "/")
                    if (package / f"{alias.name}.py").is_file() or (package / alias.name).is_dir():
                        modules.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in modules:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: reads {ast.unparse(node)}")
    assert not found, "\n".join(found)


def module_imports() -> dict[str, set[str]]:
    """Each tfmis module's tfmis imports, inside functions too (a package's submodule importing the package is not
    counted: that is its `__init__`'s interface)."""
    files = {}
    for path in sorted((ROOT / "tfmis").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.add(node.module)
                targets.update(f"{node.module}.{a.name}" for a in node.names)
        edges[module] = {t for t in targets if t in files and t != module and not module.startswith(t + ".")}
    return edges


def test_no_two_modules_import_each_other_even_inside_functions():
    """No import circle among tfmis's modules, counting the imports inside functions (which import-linter's layers
    see too, but not between two modules of one layer): a circle means two modules share a concept that belongs
    in one of them, or below both."""
    edges = module_imports()
    circles, done = [], set()
    for start in edges:
        seen = reach(edges, start)  # a circle when `start` reaches itself back
        if start in seen and start not in done:
            circle = {m for m in seen if start in reach(edges, m)} | {start}
            done |= circle
            circles.append(sorted(circle))
    assert not circles, circles


def reach(edges: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in edges[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen
