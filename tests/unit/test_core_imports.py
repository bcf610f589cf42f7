"""Imports run one way: from the optional parts into the core, never back.

Two kinds of proof. At run time: the core imports without MindSpore or mindformers, and a run
with the defaults loads no optional part. From the source: every import statement of the
package is read with `ast` wherever it stands (module level, inside a function, under
`TYPE_CHECKING`, `import_module("...")` with a literal name), so an import hidden in a
function cannot hide a cycle or a core module reaching into an optional part.
"""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import mfotel
from tests.support.paths import ROOT

#: Who may import MindSpore or mindformers (a name and everything under it), and where:
#: "module" anywhere; "function" only inside functions, so that importing the module costs
#: nothing and works without the framework. Every other module imports neither.
FRAMEWORK_IMPORTERS = {
    "mfotel.callback": "module",         # OTelMonitor, the MindSpore adapter
    "mfotel.cells": "module",            # TrainOneStepWithGradNorm
    "mfotel.mindspore_reads": "function",  # the rank after init(), the lr a step used
    "mfotel.actions.lr_scale": "function",  # scales the optimizer's learning rate in place
    "mfotel.cli": "function",            # `mfotel demo`'s last-scrape callback
    "mfotel.demo": "function",           # the demo trains a real network
    "mfotel.integrations": "module",     # mindformers registration, bridge, YAML check
}
FRAMEWORKS = ("mindspore", "mindformers")

#: The optional parts: loaded only when a run's settings or a command need them. Everything
#: else in the package is the core (a new top-level module is core until listed here).
OPTIONAL = ("actions", "alerting", "cluster", "dashboards", "demo", "integrations", "localstack",
            "logs", "node", "simulation", "ui", "assets", "cli", "__main__")

#: The only imports from the core into an optional part: what a run's assembly (and the
#: telemetry it builds) attach when the run's settings ask for them. Each must stand inside a
#: function (or under TYPE_CHECKING), never at module level, so a run without them never
#: loads them.
ATTACHMENTS = {
    ("mfotel.run_parts", "mfotel.actions.engine"): "`actions:` rules act on the run",
    ("mfotel.run_parts", "mfotel.alerting.fastpage"): "`alertmanager_url`: the NaN fast page",
    ("mfotel.run_parts", "mfotel.cluster.rank_setup"): "`file_sd` targets, multi-rank set-up",
    ("mfotel.run_parts", "mfotel.ui"): "the live page (`prometheus.ui`, on by default)",
    ("mfotel.telemetry", "mfotel.cluster.otlp"): "`otlp.endpoint`: the OTLP push",
}

#: Modules only the named modules may import: the demo sits on top of everything.
IMPORTED_ONLY_BY = {
    "mfotel.demo": ("mfotel.cli", "mfotel.demo"),
    "mfotel.cli": ("mfotel.__main__",),
}

#: config/ is a leaf: it imports nothing of mfotel but the metric contract (pure data).
CONFIG_LEAF_MAY_IMPORT = ("mfotel.config", "mfotel.contract")

#: Import cycles known and being removed elsewhere (an entry that is no longer a cycle fails:
#: delete it). None left: assets.py imports alerting/rules.py, not the other way.
KNOWN_CYCLES: tuple[set[str], ...] = ()

PACKAGE = Path(mfotel.__file__).resolve().parent


@dataclass(frozen=True)
class Import:
    importer: str   # the importing module, e.g. mfotel.config.check
    target: str     # the module imported, resolved (relative imports, `from pkg import mod`)
    where: str      # "module", "function" or "type" (under `if TYPE_CHECKING:`)
    line: int

    def __str__(self) -> str:
        return f"{self.importer} -> {self.target} ({self.where} level, line {self.line})"


def _module_name(path: Path) -> str:
    parts = ["mfotel", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(base: str, name: str) -> str:
    """`from base import name`: the submodule when `name` is one, else the module `base`."""
    return f"{base}.{name}" if f"{base}.{name}" in MODULES else base


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        is_package = MODULES[module].name == "__init__.py"
        self.package = module if is_package else module.rpartition(".")[0]
        self.where = "module"
        self.found: list[Import] = []

    def _add(self, target: str, node: ast.AST) -> None:
        self.found.append(Import(self.module, target, self.where, getattr(node, "lineno", 0)))

    def _relative(self, level: int, name: str | None) -> str:
        parts = self.package.split(".")
        base = ".".join(parts[:len(parts) - (level - 1)])
        return f"{base}.{name}" if name else base

    def _inside(self, where: str, node: ast.AST) -> None:
        saved, self.where = self.where, (where if self.where == "module" else self.where)
        self.generic_visit(node)
        self.where = saved

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._inside("function", node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._inside("function", node)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._inside("function", node)

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        saved, self.where = self.where, "type"
        for child in node.body:
            self.visit(child)
        self.where = saved
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._relative(node.level, node.module) if node.level else node.module or ""
        for alias in node.names:
            self._add(_resolve(base, alias.name), node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else \
            func.attr if isinstance(func, ast.Attribute) else ""
        first = node.args[0] if node.args else None
        if name == "import_module" and isinstance(first, ast.Constant) \
                and isinstance(first.value, str):
            text = first.value
            dots = len(text) - len(text.lstrip("."))
            self._add(self._relative(dots, text[dots:]) if dots else text, node)
        self.generic_visit(node)


def all_imports() -> Iterator[Import]:
    for module, path in MODULES.items():
        visitor = _Imports(module)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        yield from visitor.found


@functools.cache
def imports() -> list[Import]:
    """Every import of the package, read once a process when a test first asks (not at
    collection: each xdist worker collects the suite)."""
    return list(dict.fromkeys(all_imports()))  # `from m import a, b`: one edge


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def part(module: str) -> str:
    """The top-level part of mfotel a module belongs to (`mfotel.config.keys` -> config)."""
    return module.split(".")[1] if module.count(".") else "__init__"


def is_core(module: str) -> bool:
    return part(module) not in OPTIONAL


def internal() -> list[Import]:
    return [i for i in imports() if _under(i.target, "mfotel") and i.target in MODULES]


def runtime_cycles(imports: list[Import]) -> list[set[str]]:
    """The strongly connected components (more than one module) of the import graph, function
    level imports included (a latent cycle is one call away from an import error)."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.where != "type" and i.target != i.importer:
            graph.setdefault(i.importer, set()).add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan; the package is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


# ---------------------------------------------------------------- the source
def test_the_scan_sees_function_level_and_dynamic_imports():
    """The scanner itself: a lazy import, a TYPE_CHECKING import and an import_module."""
    found = {(i.importer, i.target, i.where) for i in imports()}
    assert ("mfotel.demo.command", "mindspore.train", "function") in found
    assert ("mfotel.callback", "mindspore.train", "module") in found
    assert any(i.importer == "mfotel.telemetry" and i.where == "type" for i in imports())
    assert ("mfotel.run_parts", "mfotel.alerting.fastpage", "function") in found
    dynamic = _Imports("mfotel.run_parts")
    dynamic.visit(ast.parse("def attach():\n    import_module('.alerting.fastpage', __package__)"))
    assert [(i.target, i.where) for i in dynamic.found] == [("mfotel.alerting.fastpage",
                                                             "function")]
    assert len(MODULES) > 60 and all(part(m) for m in MODULES)


def test_core_never_imports_an_optional_part_but_its_attachments():
    bad = [str(i) for i in internal() if is_core(i.importer) and not is_core(i.target)
           and ((i.importer, i.target) not in ATTACHMENTS or i.where == "module")]
    assert not bad, "the core imports optional parts:\n" + "\n".join(bad)


def test_every_attachment_is_still_used():
    """The allow-list stays as small as the code: an entry nothing imports any more goes."""
    used = {(i.importer, i.target) for i in internal()}
    assert not set(ATTACHMENTS) - used, set(ATTACHMENTS) - used


def test_config_is_a_leaf():
    bad = [str(i) for i in internal() if _under(i.importer, "mfotel.config")
           and not any(_under(i.target, allowed) for allowed in CONFIG_LEAF_MAY_IMPORT)]
    assert not bad, "config/ imports other parts of mfotel:\n" + "\n".join(bad)


def test_demo_and_cli_sit_on_top():
    bad = [str(i) for i in internal() for target, importers in IMPORTED_ONLY_BY.items()
           if _under(i.target, target) and not any(_under(i.importer, m) for m in importers)]
    assert not bad, "\n".join(bad)


def test_only_the_documented_modules_import_mindspore_or_mindformers():
    bad = []
    for i in imports():
        if i.target.split(".")[0] not in FRAMEWORKS:
            continue
        allowed = next((where for prefix, where in FRAMEWORK_IMPORTERS.items()
                        if _under(i.importer, prefix)), None)
        if allowed is None or (allowed == "function" and i.where == "module"):
            bad.append(str(i))
    assert not bad, "undocumented MindSpore/mindformers imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    cycles = runtime_cycles(internal())
    unknown = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not unknown, f"import cycles (function-level imports included): {unknown}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"no longer cycles, delete them from KNOWN_CYCLES: {gone}"


def part_graph(imports: list[Import]) -> dict[str, set[str]]:
    """The parts each part imports (function level included, TYPE_CHECKING not)."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.where != "type" and part(i.importer) != part(i.target):
            graph.setdefault(part(i.importer), set()).add(part(i.target))
    return graph


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each part's floor: 1 above the highest floor it imports (1: it imports no other part).
    The graph must have no cycle."""
    found: dict[str, int] = {}

    def floor(name: str) -> int:
        if name not in found:
            found[name] = 1 + max((floor(t) for t in graph.get(name, ())), default=0)
        return found[name]

    for name in {*graph, *(t for targets in graph.values() for t in targets)}:
        floor(name)
    return found


def test_no_import_runs_back_up_between_the_parts():
    """No folder mixes floors: the parts of mfotel/ (each top-level folder or module) import
    one way, so they stack into floors (docs/architecture.md, "Floors"). A folder holding both
    a module of the bottom and one of the top (the simulator beside OTLP, the node agent
    beside the mindformers subclass) makes a cycle here."""
    graph = part_graph(internal())
    cycles = runtime_cycles([Import(a, b, "module", 0) for a, targets in graph.items()
                             for b in targets])
    back = [str(i) for i in internal() for c in cycles
            if i.where != "type" and {part(i.importer), part(i.target)} <= c
            and part(i.importer) != part(i.target)]
    assert not cycles, f"parts importing each other {cycles}:\n" + "\n".join(back)


def test_floors_stack_each_part_above_what_it_imports():
    graph = {"cli": {"callback", "config"}, "callback": {"config"}, "config": set()}
    assert floors(graph) == {"config": 1, "callback": 2, "cli": 3}


def test_the_cycle_finder_finds_a_latent_cycle():
    """A cycle closed by a function-level import is found; a TYPE_CHECKING one is not."""
    imports = [Import("a", "b", "module", 1), Import("b", "c", "module", 1),
               Import("c", "a", "function", 9), Import("c", "d", "type", 3),
               Import("d", "c", "module", 1)]
    assert runtime_cycles(imports) == [{"a", "b", "c"}]


# ---------------------------------------------------------------- at run time
BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mindspore", "mindformers"):
            raise ImportError(f"{name} is blocked for this test")
sys.meta_path.insert(0, Block())
import mfotel, mfotel.cli, mfotel.config, mfotel.telemetry, mfotel.instruments, mfotel.logs.parse
import mfotel.alerting.rules, mfotel.actions.engine, mfotel.actions.control
import mfotel.cluster.discovery, mfotel.alerting.receiver, mfotel.node.instrument
import mfotel.simulation.run
import mfotel.ui, mfotel.checks, mfotel.localstack.alerting
cfg = mfotel.parse_config({"step_interval": 5})
assert cfg.step_interval == 5
try:
    mfotel.OTelMonitor
except ImportError as exc:
    print("callback needs mindspore:", exc)
assert mfotel.cli.main(["rules", "--out", sys.argv[1], "--check"]) == 0
print("ok")
"""


def test_core_imports_without_mindspore():
    rules_dir = ROOT / "prometheus" / "rules"
    done = subprocess.run([sys.executable, "-c", BLOCK, str(rules_dir)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "ok"
    assert "callback needs mindspore: mindspore" in done.stdout


CORE_MODULES = sorted(m for m in MODULES if is_core(m) and m != "mfotel")


@pytest.mark.parametrize("with_framework", [False, True], ids=["pure", "with-mindspore"])
def test_core_never_imports_the_optional_parts(with_framework):
    """Importing every core module loads no optional part (MindSpore's modules too, when
    asked: the callback and the cells)."""
    needs_framework = {m for m in CORE_MODULES if any(
        i.importer == m and i.target.split(".")[0] in FRAMEWORKS and i.where == "module"
        for i in imports())}
    modules = [m for m in CORE_MODULES if with_framework or m not in needs_framework]
    code = ("import sys\n"
            + "".join(f"import {name}\n" for name in modules)
            + "print(' '.join(sorted({m for m in sys.modules if m.startswith('mfotel.')})))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert set(modules) <= loaded
    assert {"mfotel.callback", "mfotel.cells"} <= loaded if with_framework else \
        not loaded & {"mfotel.callback", "mfotel.cells"}
    optional = sorted(m for m in loaded if not is_core(m))
    assert not optional, f"core imported optional parts: {optional}"


def test_a_run_configured_without_optional_parts_never_loads_them(tmp_path):
    """A real training run with the defaults (endpoint on, no file_sd, actions, OTLP or fast
    path) loads none of the optional subpackages but the demo that drives it and the live page
    (on by default: `prometheus.ui`)."""
    from mfotel.localstack.servers import free_port
    code = ("import sys\n"
            "from mfotel.demo.training import run_demo\n"
            f"run_demo(steps=4, port={free_port()}, linger_seconds=0, "
            "output={'console': False})\n"
            "print(' '.join(sorted({m.split('.')[1] for m in sys.modules "
            "if m.startswith('mfotel.')})))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert "callback" in loaded
    assert "ui" in loaded
    assert not loaded & (set(OPTIONAL) - {"demo", "ui"}), loaded
