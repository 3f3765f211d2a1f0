"""import-linter contract types of tfmis (pyproject.toml, [tool.importlinter] contract_types), run by `lint-imports`.

`machine_probes`: a module reads the machine only through `tfmis.hardware`. import-linter sees imports, not file
reads, so this contract parses the source of every module it covers (`ast`) and reports, with file and line:

- a string constant that is a /proc or /sys path ("/proc/self/status", f"/proc/{pid}/stat", "/sys/fs/cgroup"),
  docstrings and other bare string statements left out, so that prose may name the files;
- `os.cpu_count`, `os.process_cpu_count`, `multiprocessing.cpu_count`, `os.sched_getaffinity` or `os.sysconf`
  (used or imported by name): the CPU count they give ignores the cgroup CPU quota, and the other probes belong
  in one place.

Configuration (a [[tool.importlinter.contracts]] entry):

    type = "machine_probes"
    modules = ["tfmis"]                  # packages whose modules are scanned (and all their descendants)
    allowed_modules = ["tfmis.hardware"]  # modules that may probe the machine
    broken_contract_guidance = "..."     # optional, printed after the findings

`lint-imports` puts the current directory first on sys.path, so run from the repository's root it imports this
module as `tools.lint_contracts` (a fresh clone with `pip install -e .` needs nothing else).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from pathlib import Path

from grimp import ImportGraph
from importlinter.application import contract_utils, output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck
from importlinter.domain.helpers import module_expressions_to_modules

MACHINE_PATH = re.compile(r"^/(proc|sys)(/|$)")
PROBE_MODULES = {"os", "multiprocessing"}
PROBE_FUNCTIONS = {"cpu_count", "process_cpu_count", "sched_getaffinity", "sysconf"}
FIX = "read it through tfmis.hardware (add a function there if none fits)"


def machine_probes(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, what) of each machine probe in Python `source`, in line order (see the module's docstring).

    Example:
        >>> machine_probes('import os\\n"/proc in a docstring"\\nn = os.cpu_count()\\nopen(f"/proc/{n}/stat")\\n')
        [(3, 'os.cpu_count'), (4, 'the /proc path f"/proc/..."')]
    """
    tree = ast.parse(source, filename)
    prose = {  # docstrings and other bare strings: prose, not code
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    found = []
    for node in ast.walk(tree):  # breadth first: an f-string comes before its parts
        if isinstance(node, ast.JoinedStr):
            prose.update(id(part) for part in node.values)
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and MACHINE_PATH.match(first.value):
                root = MACHINE_PATH.match(first.value).group(0).rstrip("/")
                found.append((node.lineno, f'the {root} path f"{first.value}..."'))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            match = MACHINE_PATH.match(node.value)
            if match:
                found.append((node.lineno, f'the {match.group(0).rstrip("/")} path "{node.value}"'))
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in PROBE_FUNCTIONS
            and isinstance(node.value, ast.Name)
            and node.value.id in PROBE_MODULES
        ):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module in PROBE_MODULES:
            for alias in node.names:
                if alias.name in PROBE_FUNCTIONS:
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
    return sorted(found)


def module_file(name: str) -> Path | None:
    """The source file of module `name` (dotted), found without importing anything (as grimp finds the package)."""
    root, *rest = name.split(".")
    spec = importlib.util.find_spec(root)
    if spec is None or not spec.submodule_search_locations:
        return Path(spec.origin) if spec is not None and spec.origin and not rest else None
    base = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


class MachineProbeContract(Contract):
    """Only `allowed_modules` may probe the machine (/proc or /sys paths, CPU counts, sysconf) within `modules`."""

    type_name = "machine_probes"

    modules = fields.ListField(subfield=fields.ModuleExpressionField())
    allowed_modules = fields.ListField(subfield=fields.ModuleExpressionField(), required=False)
    broken_contract_guidance = fields.TextField(required=False)

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        scanned = module_expressions_to_modules(graph, self.modules, as_packages=True, raise_if_unmatched=True)
        allowed = module_expressions_to_modules(graph, self.allowed_modules or [], raise_if_unmatched=True)
        probes = []
        for name in sorted({m.name for m in scanned} - {m.name for m in allowed}):
            path = module_file(name)
            if path is None:  # a namespace package: no source of its own
                continue
            output.verbose_print(verbose, f"Scanning {name} ({path}) for machine probes...")
            shown = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else str(path)
            for line, what in machine_probes(path.read_text(encoding="utf-8"), str(path)):
                probes.append({"module": name, "file": shown, "line": line, "probe": what})
        return ContractCheck(kept=not probes, metadata={"probes": probes})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for probe in check.metadata["probes"]:
            output.print_error(
                f"{probe['file']}:{probe['line']}: {probe['probe']} probes the machine in {probe['module']}: {FIX}",
                bold=False,
            )
        output.new_line()
        contract_utils.render_broken_contract_guidance(self.broken_contract_guidance)
