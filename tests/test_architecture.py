"""The house rules, checked on the source: dependencies run orchestrator -> trainer -> checkpointing
(no import runs uphill), no modules import each other in a circle, the rooms of every folder (its modules
and subfolders) stand on each other without a loop (no import runs back up), no private name (``_x``) is
imported from another module, modules stay small (at most 500 lines) and folders uncrowded (at most 15
modules at their top) in trainer/, checkpointing/, orchestrator/ and etrain/. Each rule is a function over
files, tested on planted violations too. Circles and back-up imports count every import: at the top, inside
a function, or under ``if TYPE_CHECKING:``.

    pytest tests/test_architecture.py

Every ``.py`` file is parsed with ``ast`` (nothing is imported), so an import inside a function
counts as much as one at the top. No Ray, no torch, no process group: it runs in a second.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
# Packages that must work without Ray and without the orchestrator (torchrun, tests, tools).
LOWER = ("trainer", "checkpointing")
UPHILL = ("orchestrator", "ray")
MAX_LINES = 500
MAX_MODULES = 15  # modules at the top of one folder
HOUSE = ("trainer", "checkpointing", "orchestrator", "etrain")


def modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, *, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``: ``import x``, ``from x import y``
    (relative ones resolved), and ``importlib.import_module("x")`` / ``__import__("x")`` with a
    literal name. With ``top_level_only``, only the imports that run when the module is imported."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            out.append((node.lineno, name))
            if top_level_only:  # ``from . import x`` loads the submodule x
                out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def test_trainer_and_checkpointing_never_import_ray_or_the_orchestrator():
    bad = [f"{p.relative_to(ROOT)}:{line}: imports {name}"
           for p in modules(*LOWER) for line, name in imported(p)
           if name.split(".")[0] in UPHILL]
    assert not bad, "imports that run uphill (orchestrator -> trainer -> checkpointing):\n" + "\n".join(bad)


def test_checkpointing_never_imports_the_trainer():
    bad = [f"{p.relative_to(ROOT)}:{line}: imports {name}"
           for p in modules("checkpointing") for line, name in imported(p)
           if name.split(".")[0] == "trainer"]
    assert not bad, "checkpointing knows nothing of the trainer:\n" + "\n".join(bad)


def test_sizing_a_run_loads_no_model_code():
    """The controller computes valid world sizes from trainer.parallel.dims: importing it must not
    import the model or the code that parallelizes it."""
    by_name = {module_name(p): p for p in modules("trainer")}
    seen, todo = set(), ["trainer.parallel.dims"]
    while todo:
        name = todo.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        todo += [n for _, n in imported(by_name[name], top_level_only=True)]
    assert not seen & {"trainer.models.decoder.model", "trainer.parallel.parallelize"}, sorted(seen)


def test_the_exporter_names_the_controllers_phases():
    """trainer.observe.metrics lists the etrain_phase label values itself (it cannot import
    orchestrator.phase); they must be the controller's phases, in order."""
    from orchestrator.phase import ORDER, Phase
    from trainer.observe.metrics import PHASES

    assert PHASES == tuple(p.value for p in ORDER if p is not Phase.PENDING)


def long_modules(paths: list[Path], limit: int = MAX_LINES) -> list[str]:
    return [f"{p.relative_to(ROOT)} has {n} lines (at most {limit}): split it by job"
            for p in paths if (n := len(p.read_text().splitlines())) > limit]


def _runtime_imports(path: Path, known: set[str], *, type_checking: bool = False) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of the imports of ``path`` (``if TYPE_CHECKING:`` blocks left out unless
    ``type_checking``), ``from pkg import sub`` resolved to the submodule ``pkg.sub`` where that is a module of
    ``known``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = set() if type_checking else {
        id(n) for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
        for n in ast.walk(node)}
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            subs = [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in known]
            out += [(node.lineno, sub, []) for sub in subs]
            if len(subs) < len(node.names):
                out.append((node.lineno, name, [a.name for a in node.names if f"{name}.{a.name}" not in known]))
    return out


def _import_graph(paths: list[Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module of the house: the line}: every import, wherever it stands (at the top,
    inside a function, under ``if TYPE_CHECKING:``)."""
    known = {module_name(p) for p in paths}
    return {module_name(p): {m: line for line, m, _ in reversed(_runtime_imports(p, known, type_checking=True))
                             if m in known and m != module_name(p)}
            for p in paths}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of nodes that reach each other (Tarjan), those of more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def private_imports(paths: list[Path]) -> list[str]:
    """``from other_module import _name``: a private name used outside the module that defines it."""
    known = {module_name(p) for p in paths}
    return [f"{p.relative_to(ROOT)}:{line}: imports {mod}.{n}"
            for p in paths for line, mod, names in _runtime_imports(p, known)
            if mod in known and mod != module_name(p)
            for n in names if n.startswith("_") and not n.startswith("__")]


def import_circles(paths: list[Path]) -> list[list[str]]:
    """The groups of modules that import each other in a loop, counting every import (inside functions and
    under ``if TYPE_CHECKING:`` too)."""
    return _strongly_connected({m: set(deps) for m, deps in _import_graph(paths).items()})


def _room(module: str, folder: str) -> str | None:
    """The room of ``folder`` (a package, dotted; "" for the house) that ``module`` stands in: the child module
    or subfolder of ``folder`` it is or lies under; None outside ``folder`` and for the folder's own
    ``__init__``."""
    prefix = folder + "." if folder else ""
    if not module.startswith(prefix) or module == folder:
        return None
    return module[len(prefix):].split(".")[0]


def back_up_imports(paths: list[Path]) -> list[str]:
    """Imports that run back up: in every folder, its rooms (the modules and subfolders at its top) must
    import each other without a loop, so that each room stands on the ones below it. Every import counts
    (inside functions and under ``if TYPE_CHECKING:`` too); an import of a folder's ``__init__`` is an import
    of the folder, not of a room in it. Each import between two rooms of one loop is listed."""
    graph = _import_graph(paths)
    folders = {""} | {module_name(p) for p in paths if p.name == "__init__.py"}
    by_module = {module_name(p): p for p in paths}
    out = []
    for folder in sorted(folders):
        rooms: dict[str, set[str]] = {}
        edges: dict[tuple[str, str], list[str]] = {}
        for mod, deps in graph.items():
            src = _room(mod, folder)
            if src is None:
                continue
            for dep, line in deps.items():
                dst = _room(dep, folder)
                if dst is None or dst == src:
                    continue
                rooms.setdefault(src, set()).add(dst)
                edges.setdefault((src, dst), []).append(f"{by_module[mod].relative_to(ROOT)}:{line}: imports {dep}")
        for loop in _strongly_connected(rooms):
            where = folder.replace(".", "/") + "/" if folder else "the house"
            out.append(f"rooms of {where} that import each other: {', '.join(loop)}")
            out += ["    " + e for (a, b), es in sorted(edges.items()) if a in loop and b in loop for e in es]
    return out


def crowded_folders(paths: list[Path], limit: int = MAX_MODULES) -> list[str]:
    """Folders with more than ``limit`` modules at their top (``__init__.py`` aside): time for rooms."""
    counts: dict[Path, int] = {}
    for p in paths:
        if p.name != "__init__.py":
            counts[p.parent] = counts.get(p.parent, 0) + 1
    return [f"{d.relative_to(ROOT)}/ has {n} modules at its top (at most {limit}): give it rooms"
            for d, n in sorted(counts.items()) if n > limit]


def test_modules_are_small():
    assert not long_modules(modules(*HOUSE)), "\n".join(long_modules(modules(*HOUSE)))


def test_no_private_name_is_imported_from_another_module():
    bad = private_imports(modules(*HOUSE))
    assert not bad, "private names used outside their module (make them public, or move the code):\n" + \
        "\n".join(bad)


def test_no_folder_is_crowded():
    assert not crowded_folders(modules(*HOUSE)), "\n".join(crowded_folders(modules(*HOUSE)))


def test_no_import_runs_back_up():
    bad = back_up_imports(modules(*HOUSE))
    assert not bad, "imports that run back up (move what both rooms need below them):\n" + "\n".join(bad)


def test_no_modules_import_each_other_in_a_circle():
    circles = import_circles(modules(*HOUSE))
    assert not circles, "modules that import each other (move what both need below them):\n" + \
        "\n".join(" <-> ".join(c) for c in circles)


def raw_section_readers(paths: list[Path], sections: tuple[str, ...] = ("elastic", "recovery"),
                        owner: str = "orchestrator/config.py") -> list[str]:
    """Code that reads the orchestrator's raw sections (``raw["elastic"]``, ``raw.get("elastic")``) anywhere
    but in the module that parses them once into typed values."""
    out = []
    for p in paths:
        if str(p.relative_to(ROOT)) == owner:
            continue
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            key = None
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                key = node.slice.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                key = node.args[0].value
            if key in sections:
                out.append(f"{p.relative_to(ROOT)}:{node.lineno}: reads the raw [{key}] table")
    return out


def test_only_the_config_module_reads_the_raw_elastic_and_recovery_tables():
    bad = raw_section_readers(modules(*HOUSE))
    assert not bad, "read the typed value instead (RunSpec.sharing, ElasticConfig, RecoveryConfig):\n" + "\n".join(bad)


def missing_named_files(doc: Path) -> list[str]:
    """The paths of this repository a document names in backquotes (``trainer/loop.py``,
    ``orchestrator/service/policy.py: decide``, ``checkpointing/storage/``) that do not exist."""
    names = re.findall(r"`((?:orchestrator|trainer|checkpointing|etrain|tests|bench|docs|deploy|examples)/[^`<>:\s]*)",
                       doc.read_text())
    return sorted({n for n in names if not (ROOT / n).exists()})


def test_the_architecture_page_names_files_that_exist():
    """docs/architecture.md's tables and "How to extend" entries name the files to touch: each one exists."""
    doc = ROOT / "docs" / "architecture.md"
    assert len(re.findall(r"`(?:orchestrator|trainer|checkpointing)/", doc.read_text())) > 50
    assert not missing_named_files(doc), missing_named_files(doc)


def test_each_rule_catches_a_planted_violation(tmp_path, monkeypatch):
    """A throwaway house under tmp_path breaking each rule once: every rule names its violation."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    pkg = tmp_path / "checkpointing"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from checkpointing.b import _secret\nimport orchestrator.run\n")
    (pkg / "b.py").write_text("from . import a\n_secret = 1\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
                              + "y = 1\n" * (MAX_LINES + 1))
    paths = sorted(pkg.rglob("*.py"))
    assert private_imports(paths) == ["checkpointing/a.py:1: imports checkpointing.b._secret"]
    assert import_circles(paths) == [["checkpointing.a", "checkpointing.b"]]  # c's TYPE_CHECKING import is none
    assert long_modules(paths) == [f"checkpointing/c.py has {MAX_LINES + 4} lines (at most {MAX_LINES}): split it "
                                   "by job"]
    uphill = [name for p in paths for _, name in imported(p) if name.split(".")[0] in UPHILL]
    assert uphill == ["orchestrator.run"]


def test_circles_and_back_up_imports_count_every_import(tmp_path, monkeypatch):
    """A circle closed only under ``if TYPE_CHECKING:`` is a circle; an import inside a function from a room
    back up to a room above it runs back up; a folder of 16 modules is crowded."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    pkg = tmp_path / "orchestrator"
    (pkg / "room").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "room" / "__init__.py"):
        init.write_text("")
    (pkg / "top.py").write_text("from .room.low import x\n")
    (pkg / "room" / "low.py").write_text("x = 1\n\ndef f():\n    from ..top import y\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import E\n")
    (pkg / "e.py").write_text("from .d import D\n")
    paths = sorted(pkg.rglob("*.py"))
    assert import_circles(paths) == [["orchestrator.d", "orchestrator.e"], ["orchestrator.room.low", "orchestrator.top"]]
    assert back_up_imports(paths) == [
        "rooms of orchestrator/ that import each other: d, e",
        "    orchestrator/d.py:3: imports orchestrator.e",
        "    orchestrator/e.py:1: imports orchestrator.d",
        "rooms of orchestrator/ that import each other: room, top",
        "    orchestrator/room/low.py:4: imports orchestrator.top",
        "    orchestrator/top.py:1: imports orchestrator.room.low",
    ]
    assert crowded_folders(paths) == []
    (pkg / "e.py").write_text("from .d import D\n\ndef f(raw, spec):\n    return raw.get(\"elastic\", {}), spec.config[\"recovery\"]\n")
    (tmp_path / "arch.md").write_text("see `orchestrator/e.py: f`, `orchestrator/room/` and `trainer/gone.py`\n")
    assert missing_named_files(tmp_path / "arch.md") == ["trainer/gone.py"]
    assert raw_section_readers(sorted(pkg.rglob("*.py"))) == ["orchestrator/e.py:4: reads the raw [elastic] table",
                                                              "orchestrator/e.py:4: reads the raw [recovery] table"]
    for i in range(MAX_MODULES + 1 - 3):  # top.py, d.py and e.py stand there already
        (pkg / f"m{i}.py").write_text("")
    assert crowded_folders(sorted(pkg.rglob("*.py"))) == [
        f"orchestrator/ has {MAX_MODULES + 1} modules at its top (at most {MAX_MODULES}): give it rooms"]
