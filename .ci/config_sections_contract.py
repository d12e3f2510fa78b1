"""An import-linter contract type: each stage reads only the configuration sections it declares.

Registered in pyproject.toml (``[tool.importlinter] contract_types``) as ``config_sections``. It lives
here, outside the package, because only ``lint-imports`` needs it: tests/unit/test_layers.py puts
``.ci/`` on PYTHONPATH when it runs the contracts (which is how ``make lint`` runs them too).

What counts as a read, found in the source with :mod:`ast` (no module of the package is imported but
the configuration itself, whose :class:`FlywheelConfig` says which fields are sections):

- ``<c>.<section>`` and ``getattr(<c>, "<section>")``, where ``<c>`` is the configuration: a name
  ``cfg`` or ``config`` (unless annotated with another type in its function), any name annotated
  with ``FlywheelConfig`` or assigned from ``load_config(...)``, an attribute ``.cfg`` / ``.config``
  of anything (``self.cfg``, ``run.cfg``), or a call of one of the module's functions annotated to
  return ``FlywheelConfig``;
- top-level fields that are not sections (``home``, ``warehouse``, ...) are free to read;
- a section handed on (``run_gate(cfg.gate)``, or the whole ``cfg`` to an engine) is read where its
  attribute is taken; an engine that receives the whole configuration is a stage of this contract in
  its own right.

Options: ``stages`` lines ``"<module>: <section>, <section>"`` (a package covers its submodules; the
longest prefix governs), ``unrestricted`` modules that may read every section (the faces that compose
stages, and the configuration itself), and ``config_class`` (dotted path of the root model). A read of
an undeclared section breaks the contract, as does a read by a module that is neither a declared
stage nor unrestricted; a declared section nobody reads any more is a warning (narrow the line).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from importlinter import Contract, ContractCheck, fields, output

CONFIG_NAMES = frozenset({"cfg", "config"})


@dataclass(frozen=True)
class Read:
    module: str
    section: str
    path: str
    line: int
    text: str


# --- finding reads in one module (pure) -------------------------------------------------------------


class _ReadFinder(ast.NodeVisitor):
    """Attribute reads of section names on the configuration object, scope by scope."""

    def __init__(self, sections: frozenset[str], config_type: str) -> None:
        self.sections = sections
        self.config_type = config_type
        self.scopes: list[dict[str, bool]] = [{}]
        self.found: list[tuple[str, int, str]] = []
        self.returning: set[str] = set()  # the module's functions annotated to return the configuration

    def visit_Module(self, node: ast.Module) -> None:
        self.returning = {f.name for f in ast.walk(node) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                          and f.returns is not None and self._annotated(f.returns)}
        self.generic_visit(node)

    def _is_config(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
            return node.id in CONFIG_NAMES
        if isinstance(node, ast.Call):
            func = node.func
            return (func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)) in self.returning
        return isinstance(node, ast.Attribute) and node.attr in CONFIG_NAMES

    def _annotated(self, annotation: ast.expr) -> bool:
        return self.config_type in ast.unparse(annotation)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p)]
        # every parameter shadows the outer name: annotated ones are the configuration when annotated so,
        # unannotated ones when named like it (``def f(cfg)``)
        scope = {p.arg: self._annotated(p.annotation) if p.annotation is not None else p.arg in CONFIG_NAMES
                 for p in params}
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        # a class body's names (a field ``cfg: int``) are the class's, not the module's: its methods do not
        # see them as bare names
        self.scopes.append({})
        for child in node.body:
            self.visit(child)
        self.scopes.pop()
        for child in (*node.bases, *node.keywords, *node.decorator_list):
            self.visit(child)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if isinstance(node.target, ast.Name):
            self.scopes[-1][node.target.id] = self._annotated(node.annotation)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        call = node.value
        if isinstance(call, ast.Call) and ast.unparse(call.func).split(".")[-1] == "load_config":
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.scopes[-1][target.id] = True
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in self.sections and self._is_config(node.value):
            self.found.append((node.attr, node.lineno, ast.unparse(node)))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
            obj, name = node.args[0], node.args[1]
            if isinstance(name, ast.Constant) and name.value in self.sections and self._is_config(obj):
                self.found.append((str(name.value), node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def find_reads(source: str, sections: Iterable[str], config_type: str = "FlywheelConfig") -> list[tuple[str, int, str]]:
    """``(section, line, expression)`` of every read of a section on the configuration in ``source``."""
    finder = _ReadFinder(frozenset(sections), config_type)
    finder.visit(ast.parse(source))
    return finder.found


# --- the declared map (pure) ------------------------------------------------------------------------


def parse_stage_line(line: str) -> tuple[str, frozenset[str]]:
    """``"flywheel.gate: gate, policy"`` -> ``("flywheel.gate", {"gate", "policy"})``."""
    module, sep, rest = line.partition(":")
    if not sep or not module.strip():
        raise ValueError(f"not '<module>: <section>, ...': {line!r}")
    return module.strip(), frozenset(s.strip() for s in rest.split(",") if s.strip())


def governing(module: str, prefixes: Iterable[str]) -> str | None:
    """The longest of ``prefixes`` that is ``module`` or a package above it."""
    matches = [p for p in prefixes if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def judge(reads: Iterable[Read], declared: dict[str, frozenset[str]], unrestricted: Iterable[str],
          sections: frozenset[str]) -> tuple[list[str], list[str]]:
    """``(violations, warnings)`` of ``reads`` against the declared map; a violation is a line of what
    breaks, then a line of where."""
    free = list(unrestricted)
    violations = [f"{stage} declares {', '.join(sorted(extra))}, which is no section of the configuration\n"
                  "(pyproject.toml, the config-sections contract)"
                  for stage, secs in sorted(declared.items()) if (extra := secs - sections)]
    used: dict[str, set[str]] = {stage: set() for stage in declared}
    for r in reads:
        if governing(r.module, free):
            continue
        stage = governing(r.module, declared)
        where = f"{r.text} at {r.path}:{r.line}"
        if stage is None:
            violations.append(f"{r.module} reads {r.text}: it is on no line of the map, so it may read no section\n"
                              f"{where}")
        elif r.section not in declared[stage]:
            violations.append(f"{r.module} reads {r.text}: {stage} may read only "
                              f"{', '.join(sorted(declared[stage]))}\n{where}")
        else:
            used[stage].add(r.section)
    warnings = [f"{stage} declares {', '.join(sorted(stale))} but reads none of it: narrow its line"
                for stage, secs in sorted(declared.items()) if (stale := (secs & sections) - used[stage])]
    return violations, warnings


# --- the contract -----------------------------------------------------------------------------------


def _module_files(root_package: str) -> Iterator[tuple[str, Path, str]]:
    """``(module, file, file as shown)`` of every module of the root package, found where it imports from."""
    spec = importlib.util.find_spec(root_package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{root_package} is not an importable package")
    root = Path(next(iter(spec.submodule_search_locations)))
    for path in sorted(root.rglob("*.py")):
        parts = [root_package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path, path.relative_to(root.parent).as_posix()


def _sections(config_class: str) -> frozenset[str]:
    from pydantic import BaseModel

    module, _, name = config_class.rpartition(".")
    model = getattr(importlib.import_module(module), name)
    return frozenset(f for f, info in model.model_fields.items()
                     if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel))


class ConfigSectionsContract(Contract):
    """Each stage reads only the sections of the configuration that its ``stages`` line declares."""

    type_name = "config_sections"

    stages = fields.ListField(subfield=fields.StringField())
    unrestricted = fields.ListField(subfield=fields.StringField(), required=False, default=[])
    config_class = fields.StringField(required=False, default="flywheel.config.FlywheelConfig")

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        roots: list[str] = self.session_options["root_packages"]
        sections = _sections(str(self.config_class))
        config_type = str(self.config_class).rpartition(".")[2]
        declared = dict(parse_stage_line(line) for line in self.stages)  # type: ignore[attr-defined]
        reads = [Read(module, section, shown, line, text)
                 for root in roots for module, path, shown in _module_files(root)
                 for section, line, text in find_reads(path.read_text(), sections, config_type)]
        violations, warnings = judge(reads, declared, self.unrestricted, sections)  # type: ignore[arg-type]
        return ContractCheck(kept=not violations, warnings=warnings, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for violation in check.metadata["violations"]:
            what, where = violation.split("\n", 1)
            output.print_error(f"- {what}", bold=False)
            output.indent_cursor()
            output.print(where)
        output.new_line()

