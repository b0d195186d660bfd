"""`make run`: dvc.yaml from params.yaml (`flows.stages`), then `dvc repro` with one Prefect
server for all its stages, bound to 127.0.0.1, whose UI shows the rounds live; the server
stops when `dvc repro` ends, fails or is interrupted. With PREFECT_API_URL already set, the
stages report there instead.

    python -m flows.repro [dvc repro arguments, e.g. train-digits-ditto or --dry]
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import flows  # noqa: F401  (environment defaults)
from flows.stage import prefect_api, stage_main
from flows.stages import write_dvc_yaml
from pfl_tasks.runs import CONSOLE


def repro(dvc_args: list[str]) -> int:
    """`dvc repro`'s exit status. It runs in a process group of its own, so that an interrupt
    (Ctrl-C, SIGTERM) stops it and its stage processes cleanly, all of them before the
    server."""
    write_dvc_yaml()
    with prefect_api(ui=True) as url:
        print(f"Prefect UI (every stage's flow runs, live): {url.removesuffix('/api')}", flush=True)
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               CONSOLE: os.environ.get(CONSOLE, "runs")}  # a line per run, not per evaluation
        proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", *dvc_args], env=env, start_new_session=True)
        try:
            return proc.wait()
        except BaseException:  # KeyboardInterrupt, or RunStopped on SIGTERM
            os.killpg(proc.pid, signal.SIGTERM)  # each stage marks its runs KILLED and exits
            deadline = time.monotonic() + 60
            with contextlib.suppress(ProcessLookupError):
                while time.monotonic() < deadline:
                    os.killpg(proc.pid, 0)  # raises once every process of the group is gone
                    time.sleep(0.2)
            raise


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    status = 0

    def work() -> None:
        nonlocal status
        status = repro(args)

    return stage_main("make run", work) or status


if __name__ == "__main__":
    sys.exit(main())
