"""The library's layers (docs/engine.md, "Layout"): each module imports only from its own layer or
the ones below, no import circle anywhere, and algorithms use the trainer's public surface only."""

import ast
from pathlib import Path

import pytest

import pfl_tasks.algorithms  # noqa: F401  (registers every algorithm)
from pfl_tasks.algorithms.registry import ALGORITHMS
from pfl_tasks.engine.executor import LocalTrainer
from pfl_tasks.code_deps import ROOT

# lowest first; a module may import from its own layer and those below it
LAYERS = [
    ("pfl_tasks.errors", "pfl_tasks.files", "pfl_tasks.code_deps"),
    ("pfl_tasks.config", "pfl_tasks.grid", "pfl_tasks.numerics"),
    ("pfl_tasks.data",),
    ("pfl_tasks.nets",),
    ("pfl_tasks.engine",),
    ("pfl_tasks.algorithms",),
    ("pfl_tasks.selection", "pfl_tasks.stats"),
    ("pfl_tasks.store_process", "pfl_tasks.tracking", "pfl_tasks.outputs"),
    ("pfl_tasks.runs",),
    ("pfl_tasks.training", "pfl_tasks.reports", "pfl_tasks.estimate", "pfl_tasks.tuning"),
    ("flows",),
    ("bench",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in ("pfl_tasks", "flows", "bench") for p in (ROOT / package).rglob("*.py")}


def imports(path: Path) -> set[str]:
    """The project modules a file imports, anywhere in it (inside functions too); a relative
    import (which the layer check could misread) is refused."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path}:{node.lineno}: a relative import"
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


# what an algorithm may read of its trainer (LocalTrainer's docstring)
SURFACE = {"net", "task", "local", "device", "n_clients", "fit", "scan", "samples", "rng"}


def trainer_attributes(path: Path) -> set[str]:
    """The attributes a module reads of a name `trainer`, `getattr(trainer, "x")` included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer":
            found.add(node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" \
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "trainer":
            found.add(node.args[1].value if isinstance(node.args[1], ast.Constant) else "<computed>")
    return found


def test_algorithms_use_only_the_trainers_public_surface():
    """What an algorithm reads of its `trainer` is its public surface: its samples through
    `samples()`, its random draws through named streams (`rng`), never a private field."""
    assert SURFACE <= {name for name in dir(LocalTrainer) if not name.startswith("_")} | {"net", "task", "local",
                                                                                          "device"}
    used = {path.stem: trainer_attributes(path) - SURFACE for path in (ROOT / "pfl_tasks/algorithms").glob("*.py")}
    assert {name: attrs for name, attrs in used.items() if attrs} == {}
    assert "fit" in trainer_attributes(ROOT / "pfl_tasks/algorithms/ditto.py")  # the check reads them


def declared_streams() -> dict[str, int]:
    """Every stream's number by name: the engine's, and those the registered algorithms declare."""
    from pfl_tasks.engine import streams

    engine = [key for key in vars(streams).values() if isinstance(key, streams.StreamKey)]
    keys = engine + [key for cls in ALGORITHMS.values() for key in cls.streams]
    assert len({key.name for key in keys}) == len(set(keys)), "one name, two numbers"
    return {key.name: key.number for key in keys}


def test_the_named_streams_are_the_numbers_the_draws_always_used():
    """Naming the streams changed no draw: each name is the literal its draws used before
    (Ditto's and FedRep's second fit 1, FedCR's noise 7, ...). A new stream takes a new name."""
    assert declared_streams() == {"local": 0, "ditto/personal": 1, "fedrep/head": 1, "lp_proj/local": 0,
                                  "evaluation": 0xE7A1, "federation/sample": 0x5A3, "federation/dropout": 0xD209,
                                  "fedcr/noise": 7, "fedcr/encoder": 0xFEDC, "l2sgd/communicate": 0x125,
                                  "lp_proj/projection": 0x9A0}


def test_the_engine_names_no_algorithm():
    """A new method is a module of its own, never an engine edit: no file of `engine/` names a
    registered algorithm, in code, strings or comments ("local" is also the word for local work)."""
    import re

    names = ({cls.name for cls in ALGORITHMS.values()} | {cls.__name__ for cls in ALGORITHMS.values()}
             | {"learn2pfed", "kNN-Per", "Local-only"}) - {"local"}
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names))) + r")\b", re.IGNORECASE)
    found = {f"{path.name}:{n}": m.group(0) for path in sorted((ROOT / "pfl_tasks/engine").glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) for m in pattern.finditer(line)}
    assert len(names) > 30 and found == {}


def test_the_library_imports_its_own_modules_where_code_deps_reads_them():
    """`code_deps` reads a file's module-level imports only, so a module of `pfl_tasks/` that
    imported another inside a function would change runs' numbers without restaging them:
    every project import of the library is at module level (a third party's may be lazy)."""
    from pfl_tasks.code_deps import _imported

    lazy = {str(path.relative_to(ROOT)): sorted(str(p.relative_to(ROOT)) for p in everywhere - _imported(path))
            for name, path in MODULES.items() if name.startswith("pfl_tasks")
            if (everywhere := {MODULES[m] for m in imports(path) - {name}}) - _imported(path)}
    assert lazy == {}


def test_a_parse_that_collides_with_another_thread_s_is_retried(monkeypatch):
    """CPython 3.11 fails a parse that another thread's parse interleaves with (a SystemError,
    "AST constructor recursion depth mismatch"): a run's identity retries it, and finds the
    same imports."""
    import ast

    from pfl_tasks import code_deps

    expected = code_deps.run_code(code_deps.SELECTION)
    real, failed = ast.parse, []

    def colliding(*args, **kwargs):
        if len(failed) < 2:
            failed.append(1)
            raise SystemError("AST constructor recursion depth mismatch (before=1, after=2)")
        return real(*args, **kwargs)

    monkeypatch.setattr(code_deps.ast, "parse", colliding)
    assert code_deps.run_code(code_deps.SELECTION) == expected and len(failed) == 2
