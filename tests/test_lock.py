"""The committed `dvc.lock` matches the tree: a fresh clone's `dvc repro` reruns no stage for a
code, params or command change, and so reuses the committed tuning and results.

DVC itself decides (`dvc status`). A fresh clone lacks only what DVC's cache holds (partitions,
checkpoints): those paths are not git's, and their absence is not the lock's fault."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_tracked(root: Path) -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    return set(out.splitlines())


def stale_stages(root: Path) -> dict[str, list[str]]:
    """Per stage, what `dvc status` says would rerun it on a fresh clone of `root`'s tree: a
    changed command, params, or a dep or out that git holds (a folder: any file under it)."""
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    out = subprocess.run([str(Path(sys.executable).parent / "dvc"), "status", "--json"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    tracked = git_tracked(root)

    def in_git(path: str) -> bool:
        return path in tracked or any(t.startswith(path.rstrip("/") + "/") for t in tracked)

    stale = {}
    for stage, changes in json.loads(out.stdout or "{}").items():
        reasons = []
        for change in changes:
            if isinstance(change, str):  # "changed command", "always changed"
                reasons.append(change)
                continue
            for kind, paths in change.items():
                if kind == "changed params":
                    reasons += [f"params {key}" for file in paths.values() for key in file]
                else:
                    reasons += [f"{path} {status}" for path, status in paths.items() if in_git(path)]
        if reasons:
            stale[stage] = reasons
    return stale


def test_the_committed_lock_matches_the_tree():
    stale = stale_stages(REPO)
    assert not stale, ("dvc.lock does not match the tree; a fresh clone's `make run` reruns "
                       f"{sorted(stale)}: rerun them (dvc repro) and commit the lock. {stale}")


def test_a_code_edit_after_the_lock_is_caught(tmp_path):
    """The check fails on a tree whose code moved past its lock, as at d31529e (an indent in
    fpfc.py and an import order in optim.py, committed after the recommit)."""
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(tmp_path / "clone")], check=True)
    clone = tmp_path / "clone"
    optim = clone / "pfl_tasks" / "engine" / "optim.py"
    optim.write_text(optim.read_text() + "\n")
    stale = stale_stages(clone)
    for stage in ("tune-mnist", "train-mnist", "tune-poly1", "learn2pfed-poly1", "compare"):
        assert "pfl_tasks/engine/optim.py modified" in stale.get(stage, []), (stage, stale)
