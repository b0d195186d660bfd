"""`make run`: dvc.yaml from params.yaml (`flows.dvc_yaml`), then `dvc repro` with one Prefect
server for all its stages, bound to 127.0.0.1, whose UI shows the rounds live; the server
stops when `dvc repro` ends, fails or is interrupted. With PREFECT_API_URL already set, the
stages report there instead.

    python -m flows.repro [dvc repro arguments, e.g. train-digits-ditto or --dry]
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from flows.environment import local_defaults

if __name__ == "__main__":  # --help answers before Prefect and MLflow load, which read their settings then
    local_defaults()
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)

import psutil

from flows.stage import die_with, prefect_api, stage_main
from flows.dvc_yaml import write_dvc_yaml
from pfl_tasks.errors import RunStopped
from pfl_tasks.files import OutputLock
from pfl_tasks.runs import CONSOLE

LOCK = Path(".locks/make-run.lock")


def repro(dvc_args: list[str]) -> int:
    """`dvc repro`'s exit status. It and its stages stay in this process group, so that whatever
    reaches `make run`'s group reaches them: Ctrl-C stops each stage cleanly (this process then
    only waits for them), and a kill -9 of the group kills them all. A SIGTERM to this process
    alone is passed on to them. `dvc repro` also dies with this process (a parent-death signal),
    and one `make run` at a time runs in a checkout."""
    with OutputLock(LOCK, "this checkout's pipeline", doing="run by another `make run`") as lock:
        write_dvc_yaml()
        with prefect_api(ui=True) as url:
            print(f"Prefect UI (every stage's flow runs, live): {url.removesuffix('/api')}", flush=True)
            env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   CONSOLE: os.environ.get(CONSOLE, "runs")}  # a line per run, not per evaluation
            proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", *dvc_args], env=env,
                                    preexec_fn=die_with(os.getpid()), pass_fds=[lock.fileno()])  # it holds the lock too
            try:
                return proc.wait()
            except KeyboardInterrupt:  # the terminal's SIGINT reached the stages too: each stops cleanly
                _wait_for(proc)
                raise
            except RunStopped:  # a SIGTERM to this process alone
                for child in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.terminate()  # each stage marks its runs KILLED and exits
                _wait_for(proc)
                raise


def _wait_for(proc: subprocess.Popen, seconds: float = 60) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(seconds)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    status = 0

    def work() -> None:
        nonlocal status
        status = repro(args)

    return stage_main("make run", work) or status


if __name__ == "__main__":
    sys.exit(main())
