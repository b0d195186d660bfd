"""The project's source files a run imports, read from the import statements: a run's code
deps (its DVC stage's) and the code part of its identity (its checkpoint's).

A run's numbers come from the round runtime (`pfl_tasks/engine/federation.py` and
`pfl_tasks/engine/rounds.py`: config, data, nets and engine), the selection rules that pick its
reported round (`pfl_tasks/selection.py`) and its own algorithm's module with what that
imports, the algorithm base among it (`numeric_code`). The training loop, MLflow store, run
outputs, reports and flows around them are plumbing: an edit there changes no number, so it
restarts no run. The algorithm package
imports every other algorithm's module only to register it by name, and those modules cannot
change this run's numbers either.
"""

from __future__ import annotations

import ast
import hashlib
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pfl_tasks", "flows")
REGISTRATION = ROOT / "pfl_tasks" / "algorithms" / "__init__.py"
ROUND_RUNTIME = (ROOT / "pfl_tasks" / "engine" / "federation.py", ROOT / "pfl_tasks" / "engine" / "rounds.py")
SELECTION = ROOT / "pfl_tasks" / "selection.py"  # which evaluation a run reports
# CPython 3.11's AST conversion keeps its recursion depth per process: two threads parsing at once
# (runs side by side computing their identities) fail with "AST constructor recursion depth
# mismatch". Our parses hold a lock; another library's parse in another thread can still collide,
# and the parse is retried (it has no side effects).
PARSING = threading.Lock()
PARSE_TRIES = 5


def _module_file(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_level(body: list[ast.stmt]):
    """A module's statements that run when it is imported: not those inside functions or classes."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            yield from _module_level(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                                     + [s for h in getattr(node, "handlers", []) for s in h.body])


def _imported(path: Path) -> set[Path]:
    """The project files one file's module-level import statements name (a package's
    `__init__` with each of its modules). An import inside a function (the CLI's sweep path)
    is not a run's."""
    tree = _parse(path)
    names = []
    for node in _module_level(tree.body):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        if name.split(".")[0] in PACKAGES:
            parts = name.split(".")
            found |= {f for i in range(1, len(parts) + 1) if (f := _module_file(".".join(parts[:i])))}
    return found


def _parse(path: Path) -> ast.Module:
    source = path.read_text()
    with PARSING:
        for attempt in range(PARSE_TRIES):
            try:
                return ast.parse(source, str(path))
            except SystemError:  # another thread's parse collided (see PARSING)
                if attempt == PARSE_TRIES - 1:
                    raise


def run_code(*entries: Path) -> list[Path]:
    """Every project file reachable from `entries` by imports, skipping the algorithm package's
    registration imports and the registration file itself (a list of imports: adding an
    algorithm there changes no other's numbers); relative to the repository root, sorted."""
    seen, todo = set(), [Path(e).resolve() for e in entries]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path != REGISTRATION:
            todo += _imported(path)
        else:
            todo += [f for f in _imported(path) if f.parent != path.parent or f.stem in ("base", "registry")]
    return sorted(p.relative_to(ROOT) for p in seen - {REGISTRATION})


def numeric_code(*algorithm_files: Path) -> list[Path]:
    """What can change the numbers of runs of these algorithm modules: the round runtime, the
    selection rules and the modules, with everything they import."""
    return run_code(*ROUND_RUNTIME, SELECTION, *algorithm_files)


def code_hash(files: list[Path]) -> str:
    """Hash of these files' names and contents: a checkpoint from other code is not resumed."""
    digest = hashlib.sha256()
    for rel in files:
        digest.update(str(rel).encode() + b"\0" + (ROOT / rel).read_bytes())
    return digest.hexdigest()[:16]
