"""The house's import rules that import-linter does not check, read from the source with `ast` (tfmis, its tests,
benchmarks and tools): one import path per name (a name is imported from the module that defines it, or from a
package's `__init__`, which is that package's interface) and no private name used across modules."""

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
