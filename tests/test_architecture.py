"""The house rules, checked on the source: dependencies run orchestrator -> trainer -> checkpointing,
and modules stay small.

    pytest tests/test_architecture.py

Every ``.py`` file is parsed with ``ast`` (nothing is imported), so an import inside a function
counts as much as one at the top. No Ray, no torch, no process group: it runs in a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Packages that must work without Ray and without the orchestrator (torchrun, tests, tools).
LOWER = ("trainer", "checkpointing")
UPHILL = ("orchestrator", "ray")
MAX_LINES = 600


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
    """The controller computes valid world sizes from trainer.parallel_dims: importing it must not
    import the model or the code that parallelizes it."""
    by_name = {module_name(p): p for p in modules("trainer")}
    seen, todo = set(), ["trainer.parallel_dims"]
    while todo:
        name = todo.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        todo += [n for _, n in imported(by_name[name], top_level_only=True)]
    assert not seen & {"trainer.model", "trainer.parallelize"}, sorted(seen)


def test_the_exporter_names_the_controllers_phases():
    """trainer.metrics lists the etrain_phase label values itself (it cannot import
    orchestrator.phase); they must be the controller's phases, in order."""
    from orchestrator.phase import ORDER, Phase
    from trainer.metrics import PHASES

    assert PHASES == tuple(p.value for p in ORDER if p is not Phase.PENDING)


@pytest.mark.parametrize("path", modules("trainer", "checkpointing", "orchestrator"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_are_small(path: Path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines (at most {MAX_LINES}): split it by job"
