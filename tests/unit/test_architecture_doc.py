"""docs/architecture.md is true to the package: its folder tree lists every module and package
of mfotel/ (one line each), nothing the page names is gone (`metrics_server.py` was), its
floors stack every part above the parts it imports, and its table of MindSpore / mindformers
importers is the one the source shows."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import mfotel
from tests.support.paths import ROOT

PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = Path(mfotel.__file__).resolve().parent
#: an entry of the tree: indentation, then a module (`x.py`) or a package (`x/`)
ENTRY = re.compile(r"^( *)([\w.]+\.py|\w+/)(?=\s|$)")
#: a Python file named anywhere on the page: `callback.py`, `integrations/mindformers.py`
NAMED = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")


def tree_block(text: str) -> str:
    """The fenced block that starts with `mfotel/`."""
    match = re.search(r"^```\n(mfotel/\n.*?)^```", text, re.M | re.S)
    assert match, "docs/architecture.md has no ``` block starting with `mfotel/`"
    return match.group(1)


def listed(block: str) -> list[str]:
    """The paths the tree lists, relative to the repository (`mfotel/endpoint/server.py`,
    `mfotel/endpoint/` for a package); continuation lines and `# comments` are skipped."""
    paths: list[str] = []
    stack: list[tuple[int, str]] = []   # (indentation, folder) of the open folders
    for line in block.splitlines():
        match = ENTRY.match(line)
        if not match:
            continue
        indent, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(folder for _, folder in stack) + name
        paths.append(path)
        if name.endswith("/"):
            stack.append((indent, name))
    return paths


def modules() -> set[str]:
    """Every module and package of mfotel/ as the tree writes it (a package's __init__.py is
    its folder's line)."""
    found = {"mfotel/"}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).as_posix()
        found.add(relative.removesuffix("__init__.py") if path.name == "__init__.py"
                  else relative)
    return found


def test_the_tree_parser_follows_indentation():
    block = ("mfotel/\n  a.py        one\n              more of a's line\n  pkg/        a package\n"
             "    b.py      two\n    sub/      three\n      c.py    four\n  d.py        five\n"
             "  # a comment\n")
    assert listed(block) == ["mfotel/", "mfotel/a.py", "mfotel/pkg/", "mfotel/pkg/b.py",
                             "mfotel/pkg/sub/", "mfotel/pkg/sub/c.py", "mfotel/d.py"]


def test_every_module_of_the_package_is_on_the_page_once():
    paths = listed(tree_block(PAGE.read_text()))
    repeated = sorted({p for p in paths if paths.count(p) > 1})
    assert not repeated, f"listed twice: {repeated}"
    # the mfotel/__init__.py line stands for the package itself
    shown = {p.removesuffix("__init__.py") if p == "mfotel/__init__.py" else p for p in paths}
    missing = sorted(modules() - shown)
    assert not missing, f"docs/architecture.md does not list: {missing}"
    gone = sorted(shown - modules())
    assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"
    assert len(paths) > 90


def test_every_python_file_the_page_names_exists():
    """A name anywhere on the page (`callback.py`, `integrations/mindformers.py`,
    `tests/unit/test_core_imports.py`) is a file of the repository or of mfotel/."""
    repository = set(subprocess.run(["git", "ls-files", "--cached", "--others",
                                     "--exclude-standard", "*.py"], cwd=ROOT, check=True,
                                    capture_output=True, text=True).stdout.split())
    in_package = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    names = set(NAMED.findall(PAGE.read_text()))
    assert {"callback.py", "integrations/mindformers.py",
            "tests/unit/test_core_imports.py"} <= names

    def exists(name: str) -> bool:
        if "/" in name:
            return name in repository or name in in_package \
                or any(p.endswith("/" + name) for p in in_package)
        return any(p.rsplit("/", 1)[-1] == name for p in in_package)

    unknown = sorted(n for n in names if not exists(n))
    assert not unknown, f"docs/architecture.md names files that do not exist: {unknown}"


def framework_table(text: str) -> dict[str, str]:
    """The page's table of MindSpore / mindformers importers: module path -> what it imports."""
    section = text.split("## Which modules import MindSpore and mindformers", 1)[1]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for module in re.findall(r"`([\w/]+\.py)`", cells[0]):
                rows[module] = cells[1]
    return rows


def test_the_framework_table_names_exactly_the_modules_that_import_mindspore_or_mindformers():
    """Read as tests/unit/test_core_imports.py reads imports (function level included)."""
    from tests.unit.test_core_imports import FRAMEWORKS, MODULES, imports
    table = framework_table(PAGE.read_text())
    found: dict[str, set[str]] = {}
    for i in imports():
        top = i.target.split(".")[0]
        if top in FRAMEWORKS:
            path = MODULES[i.importer].relative_to(PACKAGE).as_posix()
            found.setdefault(path, set()).add(top)
    assert {"callback.py", "cells.py", "integrations/mindformers.py"} <= set(found)
    direct = {module: imports for module, imports in table.items() if "through" not in imports}
    assert set(direct) == set(found), (set(found) - set(direct), set(direct) - set(found))
    for module, frameworks in found.items():
        assert all(name in table[module] for name in frameworks), (module, table[module])


def floors_table(text: str) -> dict[str, int]:
    """The page's floors: part as the tree writes it (`cli.py`, `node/`) -> its floor."""
    section = text.split("## Floors", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, int] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].isdigit():
            for name in re.findall(r"`([\w.]+/?)`", cells[1]):
                assert name not in rows, f"{name} is on two floors"
                rows[name] = int(cells[0])
    return rows


def test_the_floors_stack_every_part_above_the_parts_it_imports():
    """The page's floors are a true picture of the imports: each part of mfotel/ (a top-level
    folder or module) on one floor, and every import, function level included, runs down to a
    lower floor (tests/unit/test_core_imports.py proves there is a way to stack them)."""
    from tests.unit.test_core_imports import MODULES, internal, part, part_graph

    def as_written(name: str) -> str:
        module = "mfotel" if name == "__init__" else f"mfotel.{name}"
        return f"{name}/" if MODULES[module].name == "__init__.py" and name != "__init__" \
            else f"{name}.py"

    table = floors_table(PAGE.read_text())
    parts = {as_written(part(m)) for m in MODULES}
    assert set(table) == parts, (sorted(parts - set(table)), sorted(set(table) - parts))
    assert sorted(set(table.values())) == list(range(1, max(table.values()) + 1))
    up = [f"{as_written(a)} (floor {table[as_written(a)]}) imports {as_written(b)} "
          f"(floor {table[as_written(b)]})"
          for a, targets in part_graph(internal()).items() for b in targets
          if table[as_written(a)] <= table[as_written(b)]]
    assert not up, "docs/architecture.md, Floors: imports that do not run down:\n" + \
        "\n".join(sorted(up))
