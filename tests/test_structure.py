"""The package's shape: its folders are the stages of the data flow, each imported from outside only through its
face, no stage reaching up; no module takes another's private names; nothing imports in a circle, benchmarks
included; the action grammar is spelled out in one module; slivers are merged into their importer; the
benchmarks use only public faces; the types users receive are exported; the README's table names every folder.

Every module is parsed with ``ast``; imports anywhere in a module count, inside functions too. The checks are
run on a small package written to a temporary folder as well, so they are known to find what they look for.
"""

from __future__ import annotations

import ast
import re
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import remat

REPOSITORY = Path(__file__).resolve().parents[1]
SOURCE = REPOSITORY / "src" / "remat"
BENCHMARKS = REPOSITORY / "benchmarks"

# The stages, lowest first (docs/architecture.md). "" is the package's own face, `remat`: above every stage it
# gathers, below the harness and the command line, which use it as users do.
LAYERS = (
    "core", "chains", "meters", "checkpointing", "planning", "runtime", "profiling", "dynamic", "fitting",
    "integrations", "", "bench", "cli",
)  # fmt: skip
MAX_TOP_LEVEL = 12  # entries at the top of src/remat besides its face
SLIVER_LINES = 60  # a module shorter than this with one importer belongs in that importer
LONG_LINES = 800  # a module longer than this is worth a look (a warning, not a failure)
GRAMMAR_OWNER = "remat.core.actions"
ACTION_PREFIX = re.compile(r"^(selective|compress|partition|segment|memory_poor|nested|checkpoint\+compress|"
                           r"recompute\+compress):")  # fmt: skip
PUBLIC_ALIASES = {"remat.policies"}  # importable paths that are not files (set in remat/__init__.py)


@dataclass
class Package:
    """The modules of a package on disk: dotted name -> file, with what each imports."""

    root: Path
    files: dict[str, Path] = field(default_factory=dict)
    trees: dict[str, ast.Module] = field(default_factory=dict)

    @classmethod
    def read(cls, root: Path, name: str | None = None) -> Package:
        package = cls(root)
        for path in sorted(root.rglob("*.py")):
            parts = (name or root.name, *path.relative_to(root).with_suffix("").parts)
            dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            package.files[dotted] = path
            package.trees[dotted] = ast.parse(path.read_text(), filename=str(path))
        return package

    def is_package(self, name: str) -> bool:
        return self.files[name].name == "__init__.py"

    def folder(self, name: str) -> str:
        """The folder (package) module ``name`` is in: itself for a face."""
        return name if self.is_package(name) else name.rpartition(".")[0]

    def absolute(self, importer: str, node: ast.ImportFrom) -> str:
        """The dotted module a ``from ... import`` statement in ``importer`` names."""
        if not node.level:
            return node.module or ""
        base = importer.split(".")
        if not self.is_package(importer):
            base = base[:-1]
        base = base[: len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def module_of(self, dotted: str) -> str | None:
        """The longest prefix of ``dotted`` that is a module of the package."""
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in self.files:
                return candidate
        return None

    def exports(self, face: str) -> set[str]:
        """The names a face lists in ``__all__``: literal strings, and those of the module-level tuples, lists and
        dicts (their keys) it unpacks (a face that imports its names on first use lists them so)."""
        assigned = {
            target.id: node.value
            for node in self.trees[face].body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        if "__all__" not in assigned:
            return set()
        names: set[str] = set()
        for part in ast.walk(assigned["__all__"]):
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                names.add(part.value)
            elif isinstance(part, ast.Name) and part.id in assigned:
                value = assigned[part.id]
                items = value.keys if isinstance(value, ast.Dict) else getattr(value, "elts", [])
                names |= {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
        return names

    def imports(self, name: str) -> Iterator[Import]:
        """Every import in module ``name``, wherever it is (functions included)."""
        for node in ast.walk(self.trees[name]):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.split(".")[0]
                    yield Import(alias.name, "", local, alias.name if alias.asname else local, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                source = self.absolute(name, node)
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    yield Import(source, alias.name, alias.asname or alias.name, full, node.lineno)

    def target(self, imp: Import) -> str | None:
        """The module of the package an import reaches: a submodule taken by name counts as that submodule."""
        full = f"{imp.source}.{imp.taken}" if imp.taken else imp.source
        return full if full in self.files else self.module_of(imp.source)


@dataclass(frozen=True)
class Import:
    """``import source`` (``taken`` empty) or ``from source import taken``, binding ``local`` to ``bound``."""

    source: str
    taken: str
    local: str
    bound: str
    line: int


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def stage_of(name: str) -> str:
    """The stage (top folder) of a module of remat; "" for the package's own face."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


# ----------------------------------------------------------------------------------------------- the checks


def private_imports(package: Package) -> list[str]:
    """Private names one module of the package takes from another: imported, or read off an imported module."""
    found = []
    for name in package.files:
        bound: dict[str, str] = {}  # local name -> module of the package it stands for
        for imp in package.imports(name):
            target = package.module_of(imp.source)
            if target is None:
                continue
            if imp.taken and is_private(imp.taken) and target != name:
                found.append(f"{name}:{imp.line} imports {imp.source}.{imp.taken}")
            if imp.bound in package.files:
                bound[imp.local] = imp.bound
        for node in ast.walk(package.trees[name]):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                chain = dotted_name(node.value)
                if chain and chain[0] in bound:
                    module = package.module_of(".".join([bound[chain[0]], *chain[1:]]))
                    if module is not None and module != name:
                        found.append(f"{name}:{node.lineno} reads {'.'.join(chain)}.{node.attr}")
    return found


def dotted_name(node: ast.expr) -> list[str] | None:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        head = dotted_name(node.value)
        return head + [node.attr] if head is not None else None
    return None


def import_graph(*packages: Package) -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports (a name taken from a package counts as its submodule
    when it is one)."""
    graph: dict[str, set[str]] = {}
    everything = Package(Path("."))
    for package in packages:
        everything.files.update(package.files)
        everything.trees.update(package.trees)
    for name in everything.files:
        graph[name] = set()
        for imp in everything.imports(name):
            target = everything.target(imp)
            if target is not None and target != name:
                graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted. A face
    importing its own folder's modules is how a face works, not a circle with them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_violations(package: Package, layers: tuple[str, ...] = LAYERS) -> list[str]:
    """Imports that reach a stage above the importer's (rule 1 of docs/architecture.md)."""
    found = []
    for name in package.files:
        for imp in package.imports(name):
            target = package.target(imp)
            if target is None or target == name:
                continue
            here, there = stage_of(name), stage_of(target)
            if here not in layers or there not in layers:
                stray = here if here not in layers else there
                found.append(f"{name}:{imp.line} -> {target}: {stray!r} is not a stage of {layers}")
            elif layers.index(there) > layers.index(here):
                found.append(f"{name}:{imp.line} imports {target}, a stage above its own ({there!r} over {here!r})")
    return found


def face_violations(package: Package) -> list[str]:
    """Imports of a folder's inner module from outside the folder, or of a name its face does not export
    (rule 2): a module imports modules of its own folder and of the folders that contain it, and from any other
    folder only what the face lists in ``__all__``."""
    found = []
    for name in package.files:
        home = package.folder(name)
        for imp in package.imports(name):
            source = package.module_of(imp.source)
            if source is None:
                continue
            if package.is_package(source) and source == imp.source:
                inside = home == source or home.startswith(source + ".")
                if imp.taken and not inside and imp.taken not in package.exports(source):
                    found.append(f"{name}:{imp.line} takes {imp.taken!r} from {source}, which does not export it")
                continue
            folder = package.folder(source)
            if not (home == folder or home.startswith(folder + ".")):
                found.append(f"{name}:{imp.line} imports {source} from outside its folder: import {folder}")
    return found


def slivers(package: Package, graph: dict[str, set[str]]) -> list[str]:
    """Modules (not faces) under :data:`SLIVER_LINES` lines that one module imports: merge them there."""
    importers = {m: {i for i, targets in graph.items() if m in targets} for m in package.files}
    return sorted(
        f"{m} ({len(package.files[m].read_text().splitlines())} lines, imported by {next(iter(importers[m]))} only)"
        for m in package.files
        if not package.is_package(m)
        and len(package.files[m].read_text().splitlines()) < SLIVER_LINES
        and len(importers[m]) == 1
    )


def long_modules(package: Package) -> dict[str, int]:
    lengths = {name: len(path.read_text().splitlines()) for name, path in package.files.items()}
    return {name: n for name, n in lengths.items() if n > LONG_LINES}


def grammar_outside_owner(package: Package, owner: str = GRAMMAR_OWNER) -> list[str]:
    """Action texts written out, or action prefixes tested, outside the module that owns the grammar (rule 3):
    string literals starting ``selective:``, ``segment:``... (docstrings aside) and ``startswith``/
    ``removeprefix`` calls with a kind's name."""
    found: dict[tuple[str, int], str] = {}  # one finding a line, a prefix test before the literal it tests
    kinds = {"selective", "compress", "partition", "segment", "memory_poor", "nested"}
    for name, tree in package.trees.items():
        if name == owner:
            continue
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
        }  # fmt: skip
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("startswith", "removeprefix", "endswith"):
                    for arg in node.args:
                        for value in arg.elts if isinstance(arg, ast.Tuple) else [arg]:
                            text = value.value if isinstance(value, ast.Constant) else None
                            if isinstance(text, str) and text.rstrip(":") in kinds:
                                found[(name, node.lineno)] = f"{name}:{node.lineno} tests the prefix {text!r}"
                            if isinstance(value, ast.Name) and value.id.endswith("PREFIX"):
                                found[(name, node.lineno)] = f"{name}:{node.lineno} tests the prefix {value.id}"
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and ACTION_PREFIX.match(node.value)
            ):
                found.setdefault((name, node.lineno), f"{name}:{node.lineno} writes {node.value!r}")
    return [found[key] for key in sorted(found)]


def public_modules(package: Package) -> set[str]:
    """What code outside the package may import: the faces, and the modules a face exports by name."""
    faces = {m for m in package.files if package.is_package(m)}
    exported = {f"{face}.{n}" for face in faces for n in package.exports(face)}
    return faces | {m for m in exported if m in package.files} | PUBLIC_ALIASES


def non_public_imports(users: Package, package: Package) -> list[str]:
    """Imports of ``package``'s inner modules by ``users`` (the benchmarks), which use only its public faces."""
    public = public_modules(package)
    found = []
    for name in users.files:
        for imp in users.imports(name):
            if not imp.source.startswith(package.root.name):
                continue
            module = imp.source if imp.source in public else package.module_of(imp.source)
            if imp.source not in public and module is not None and module not in public:
                found.append(f"{name}:{imp.line} imports {imp.source}: use {package.folder(module)} instead")
    return found


# ----------------------------------------------------------------------------------------------- tests


def test_no_module_takes_a_private_name_from_another() -> None:
    found = private_imports(Package.read(SOURCE))
    assert not found, "make these names public (documented) where they live, or move them: " + "; ".join(found)


def test_the_stages_import_downwards_only() -> None:
    found = layer_violations(Package.read(SOURCE))
    assert not found, "a stage imports only its own folder and the stages below it: " + "; ".join(found)


def test_other_folders_are_imported_through_their_faces() -> None:
    found = face_violations(Package.read(SOURCE))
    assert not found, "export the name from the folder's __init__.py and import it from there: " + "; ".join(found)


def test_imports_form_no_circle_benchmarks_included() -> None:
    found = circles(import_graph(Package.read(SOURCE), Package.read(BENCHMARKS)))
    assert not found, "modules that import each other (function-level imports included): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_slivers_are_merged_into_their_importer_and_long_modules_are_flagged() -> None:
    package = Package.read(SOURCE)
    found = slivers(package, import_graph(package))
    assert not found, f"modules under {SLIVER_LINES} lines with a single importer; merge them there: {found}"
    for name, lines in long_modules(package).items():
        warnings.warn(f"{name} has {lines} lines: does it hold one concept?", stacklevel=1)


def test_the_action_grammar_is_spelled_out_in_one_module() -> None:
    found = grammar_outside_owner(Package.read(SOURCE))
    assert not found, f"ask {GRAMMAR_OWNER}.Action what an action is instead: " + "; ".join(found)


def test_the_package_top_level_is_its_stages() -> None:
    entries = sorted(p.name for p in SOURCE.iterdir() if p.name not in ("__init__.py", "__pycache__"))
    assert len(entries) <= MAX_TOP_LEVEL, f"{len(entries)} entries at the top of src/remat: {entries}"
    assert set(entries) == {s for s in LAYERS if s}, f"the top of src/remat is not the stages {LAYERS}: {entries}"


def test_benchmarks_use_only_public_faces() -> None:
    found = non_public_imports(Package.read(BENCHMARKS), Package.read(SOURCE))
    assert not found, "benchmarks measure what users get: " + "; ".join(found)


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    for folder in ("low", "high", "low/inner"):
        (root / folder).mkdir(parents=True)
    files = {
        "__init__.py": "from .high import api\n",
        "a.py": "from .b import helper\n\n\ndef _hidden() -> None:\n    pass\n",
        "b.py": "def helper() -> None:\n    from .a import _hidden\n",
        "low/__init__.py": "from .parts import exported\n\n__all__ = ['exported']\n",
        "low/parts.py": (
            "from ..high import api\n\n\ndef exported() -> None:\n    pass\n\n\ndef inner() -> None:\n    pass\n"
        ),
        "low/inner/__init__.py": "",
        "low/inner/deep.py": "from ..parts import inner\n" + "x = 1\n" * SLIVER_LINES,
        "high/__init__.py": "from .api import api\n\n__all__ = ['api']\n",
        "high/api.py": (
            "from ..low import exported, inner\nfrom ..low.parts import exported as again\nfrom . import tiny\n"
            "import pkg.b\nimport pkg.b as bee\n\npkg.b._x = bee._y = 0\n"
            "if 'x'.startswith('selective:'):\n    kind = f'segment:{1}'\n\n\ndef api() -> None:\n    pass\n"
        ),
        "high/tiny.py": "y = 2\n",
    }
    for relative, text in files.items():
        (root / relative).write_text(textwrap.dedent(text))
    package = Package.read(root)
    assert sorted(private_imports(package)) == [
        "pkg.b:2 imports pkg.a._hidden",
        "pkg.high.api:7 reads bee._y",
        "pkg.high.api:7 reads pkg.b._x",
    ]
    graph = import_graph(package)
    assert circles(graph) == [["pkg.a", "pkg.b"], ["pkg.high.api", "pkg.low", "pkg.low.parts"]]
    assert layer_violations(package, ("low", "high", "")) == [
        "pkg.a:1 -> pkg.b: 'a' is not a stage of ('low', 'high', '')",
        "pkg.b:2 -> pkg.a: 'b' is not a stage of ('low', 'high', '')",
        "pkg.high.api:4 -> pkg.b: 'b' is not a stage of ('low', 'high', '')",
        "pkg.high.api:5 -> pkg.b: 'b' is not a stage of ('low', 'high', '')",
        "pkg.low.parts:1 imports pkg.high.api, a stage above its own ('high' over 'low')",
    ]
    assert face_violations(package) == [
        "pkg.high.api:1 takes 'inner' from pkg.low, which does not export it",
        "pkg.high.api:2 imports pkg.low.parts from outside its folder: import pkg.low",
    ]
    assert slivers(package, graph) == [
        "pkg.a (5 lines, imported by pkg.b only)",
        "pkg.high.tiny (1 lines, imported by pkg.high.api only)",
    ]
    assert grammar_outside_owner(package, "pkg.a") == [
        "pkg.high.api:8 tests the prefix 'selective:'",
        "pkg.high.api:9 writes 'segment:'",
    ]
    users = Package(tmp_path / "bench")
    users.files["bench.run"] = tmp_path / "run.py"
    users.trees["bench.run"] = ast.parse(
        "import pkg.high\nfrom pkg.low.parts import exported\nfrom pkg.high import api\n"
    )
    assert non_public_imports(users, package) == ["bench.run:2 imports pkg.low.parts: use pkg.low instead"]


# ----------------------------------------------------------------------------------------------- exports


def test_the_types_users_receive_are_exported() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    costs = remat.profile(model, torch.randn(2, 4), repeats=1)
    plan = remat.plan(costs, "full")
    handle = remat.apply(model, plan)
    try:
        assert isinstance(handle, remat.RematHandle)
        with remat.measure() as report:
            model(torch.randn(2, 4)).sum().backward()
        assert isinstance(report, remat.MemoryReport) and report.activation_bytes > 0
        assert isinstance(remat.simulate(costs, plan.actions), remat.Simulation)
    finally:
        handle.remove()
    assert {"RematHandle", "MemoryReport", "Simulation", "StepSpec"} <= set(remat.__all__)


def _readme_folders() -> set[str]:
    """The folders the README's "What is inside" table names (backticked ``name/``)."""
    text = (REPOSITORY / "README.md").read_text()
    section = text.split("## What is inside", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return {name for row in rows for name in re.findall(r"`([\w/]+)/`", row)}


def test_the_readme_table_names_every_folder() -> None:
    named = _readme_folders()
    stages = {p.name for p in SOURCE.iterdir() if (p / "__init__.py").exists()}
    assert stages <= named, f"README.md's 'What is inside' table does not name: {sorted(stages - named)}"
    missing = {n for n in named if not any(p.is_dir() for p in SOURCE.rglob(n))}
    assert not missing, f"the README names folders that do not exist: {sorted(missing)}"
