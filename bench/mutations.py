"""Mutation check of the accounting tests (`tests/test_costs.py`): each mutant drops one thing
the compute and communication columns rest on, and the tests must fail on it.

Mutants, each in a copy of the tree:
- every key of every message an algorithm's `client_update` sends up the wire (the dict that is,
  or is named by, the first item of its returned pair), removed;
- every call of the engine that counts a pass (`_record_pass()`, `record_pass()` in
  `pfl_tasks/engine/executor.py`), removed.

    python -m bench.mutations            # writes bench/results/<date>-mutations.{md,json}
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.paths import result_stem

REPO = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_costs.py"]


def message_dicts(tree: ast.Module) -> list[ast.Dict]:
    """The message dicts of every `client_update` in a module."""
    found = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "client_update"):
        named = {t.id: node.value for node in ast.walk(fn) if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name) and isinstance(node.value, ast.Dict)}
        for ret in (n for n in ast.walk(fn) if isinstance(n, ast.Return)):
            if isinstance(ret.value, ast.Tuple) and ret.value.elts:
                first = ret.value.elts[0]
                first = named.get(first.id, first) if isinstance(first, ast.Name) else first
                if isinstance(first, ast.Dict) and first not in found:
                    found.append(first)
    return found


def message_mutants(path: Path) -> list[tuple[str, str]]:
    """(what was dropped, the mutated module's source) for each message key."""
    out = []
    for i, d in enumerate(message_dicts(ast.parse(path.read_text()))):
        for j, key in enumerate(d.keys):
            if not isinstance(key, ast.Constant):
                continue
            tree = ast.parse(path.read_text())
            target = message_dicts(tree)[i]
            del target.keys[j], target.values[j]
            out.append((f"{path.stem}: message key '{key.value}' (line {key.lineno})", ast.unparse(tree)))
    return out


def counting_mutants(path: Path) -> list[tuple[str, str]]:
    """(what was dropped, the mutated module's source) for each call that counts a pass."""
    calls = [n for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
             and getattr(n.value.func, "attr", getattr(n.value.func, "id", "")) in ("_record_pass", "record_pass")]
    out = []
    for call in calls:
        lines = path.read_text().splitlines(keepends=True)
        indent = lines[call.lineno - 1][: len(lines[call.lineno - 1]) - len(lines[call.lineno - 1].lstrip())]
        lines[call.lineno - 1] = f"{indent}pass\n"
        out.append((f"{path.stem}: pass count at line {call.lineno}", "".join(lines)))
    return out


def caught(copy: Path, relative: str, source: str) -> bool:
    original = (copy / relative).read_text()
    (copy / relative).write_text(source)
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS],
                              cwd=copy, capture_output=True, text=True)
        return done.returncode != 0
    finally:
        (copy / relative).write_text(original)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    files = {f"pfl_tasks/algorithms/{p.name}": message_mutants(p)
             for p in sorted((REPO / "pfl_tasks/algorithms").glob("*.py"))}
    files["pfl_tasks/engine/executor.py"] = counting_mutants(REPO / "pfl_tasks/engine/executor.py")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(REPO, copy, ignore=lambda folder, names: [n for n in names if Path(folder) == REPO
                                                                  and n not in ("pfl_tasks", "tests", "flows")])
        for relative, mutants in files.items():
            for what, source in mutants:
                rows.append({"mutant": what, "caught": caught(copy, relative, source)})
                print(f"{'caught' if rows[-1]['caught'] else 'MISSED'}: {what}", flush=True)
    stamp = datetime.date.today().isoformat()
    missed = [r["mutant"] for r in rows if not r["caught"]]
    lines = [f"# Mutation check of the accounting tests ({stamp})", "",
             f"`python -m bench.mutations`: {len(rows)} mutants, each dropping one message key of an algorithm's "
             f"`client_update` or one pass count of the engine; {len(rows) - len(missed)} caught by "
             f"{', '.join(TESTS)}, {len(missed)} missed.", "", "| mutant | caught |", "|---|---|"]
    lines += [f"| {r['mutant']} | {'yes' if r['caught'] else 'NO'} |" for r in rows]
    stem = result_stem("mutations")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(f"{len(rows) - len(missed)} of {len(rows)} mutants caught -> bench/results/{stamp}-mutations.md")
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
