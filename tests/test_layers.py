"""The library's layers (README, "Architecture"): each module imports only from its own layer or
the ones below, no import circle anywhere, and algorithms use the trainer's public surface only."""

import ast
from pathlib import Path

import pytest

from pfl_tasks.engine.executor import LocalTrainer
from pfl_tasks.imports import ROOT

# lowest first; a module may import from its own layer and those below it
LAYERS = [
    ("pfl_tasks.errors", "pfl_tasks.files", "pfl_tasks.imports"),
    ("pfl_tasks.config", "pfl_tasks.grid"),
    ("pfl_tasks.data",),
    ("pfl_tasks.nets",),
    ("pfl_tasks.engine",),
    ("pfl_tasks.algorithms",),
    ("pfl_tasks.selection", "pfl_tasks.stats"),
    ("pfl_tasks.tracking", "pfl_tasks.outputs"),
    ("pfl_tasks.runs",),
    ("pfl_tasks.training", "pfl_tasks.reports"),
    ("flows",),
    ("bench",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in ("pfl_tasks", "flows", "bench") for p in (ROOT / package).rglob("*.py")}


def imports(path: Path) -> set[str]:
    """The project modules a file imports, anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                     for alias in node.names]
        found |= {name for name in names if name in MODULES}
    return found


GRAPH = {name: imports(path) - {name} for name, path in MODULES.items()}


def layer(module: str) -> int:
    matches = [(len(prefix), i) for i, group in enumerate(LAYERS) for prefix in group
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1] if matches else -1


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer(m) < 0 and m not in ("pfl_tasks",)] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_goes_up_a_layer(module):
    upward = sorted(m for m in GRAPH[module] if layer(m) > layer(module))
    assert upward == [], f"{module} (layer {layer(module)}) imports {upward} from above it"


def test_no_import_circle():
    state, circles = {}, []

    def visit(module, path):
        state[module] = "open"
        for other in sorted(GRAPH[module]):
            if state.get(other) == "open":
                circles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The check itself: an engine module importing an algorithm is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from pfl_tasks.algorithms.base import Algorithm\n")
    assert "pfl_tasks.algorithms.base" in imports(bad)
    assert layer("pfl_tasks.algorithms.base") > layer("pfl_tasks.engine.federation")


def trainer_attributes(path: Path) -> set[str]:
    return {node.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer"}


def test_algorithms_use_only_the_trainers_public_surface():
    """What an algorithm reads of its `trainer` is documented on `LocalTrainer`: its samples
    through `samples()`, its random draws through named streams (`rng`), never a private field."""
    import torch

    from pfl_tasks.config import LocalConfig
    from pfl_tasks.data import ClientSplit
    from pfl_tasks.engine.executor import SequentialTrainer

    split = ClientSplit(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), torch.tensor([0, 2]), torch.tensor([2, 2]))
    trainer = SequentialTrainer(torch.nn.Linear(2, 2), "classification", split, torch.arange(2), LocalConfig(), 0, 0)
    public = {name for name in [*vars(trainer), *dir(LocalTrainer)] if not name.startswith("_")}
    used = {path.stem: trainer_attributes(path) - public for path in (ROOT / "pfl_tasks/algorithms").glob("*.py")}
    assert {name: attrs for name, attrs in used.items() if attrs} == {}
    assert "fit" in trainer_attributes(ROOT / "pfl_tasks/algorithms/ditto.py")  # the check reads them
