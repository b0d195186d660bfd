"""Register the pipeline's deployments with a Prefect server and run their flow runs.

    prefect server start --host 127.0.0.1                                     # the UI
    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.serve           # in the repo root

Deployments (`flow.serve` semantics: this process polls the server and runs each flow run in
a subprocess here, next to the data, checkpoints and DVC cache; no work pool to set up):
- `pfl-repro/nightly`: `dvc repro` on a cron schedule (`--cron`, default 02:00 daily);
- `pfl-sweep/sweep`: algorithms x seeds of an experiment under overrides (run it from the UI
  with "Custom run"; `--sweep-cron` schedules its defaults);
- `pfl-pipeline/params-file`: every stage of a params file, e.g. `params-fmnist.yaml`.
Default parameters are validated against the params files before anything is registered.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from flows.environment import local_defaults
from flows.precheck import pin_numerics_first

if __name__ == "__main__":  # before Prefect and MLflow load: they read their settings then
    local_defaults()

import psutil

from pfl_tasks.config import SweepConfig
from pfl_tasks.errors import ConfigError

# the default run's benchmark, a short one: what "Custom run" starts from in the UI
DEFAULT_SWEEP = SweepConfig(name="mnist-sweep", experiment="mnist", algorithms=["fedavg", "ditto", "fedrep"],
                            seeds=[0, 1, 2], overrides={"federation.rounds": 20})


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cron", default="0 2 * * *", help="schedule of pfl-repro/nightly")
    parser.add_argument("--sweep", default=DEFAULT_SWEEP.model_dump_json(), help="the sweep's default parameters, JSON")
    parser.add_argument("--sweep-cron", help="schedule of pfl-sweep/sweep (default: none, run from the UI)")
    parser.add_argument("--params-file", default="params-fmnist.yaml", help="default of pfl-pipeline/params-file")
    parser.add_argument("--only", nargs="+", choices=["nightly", "sweep", "params-file"], help="serve just these")
    return parser


def sweep_option(text: str) -> SweepConfig:
    """--sweep's JSON as a SweepConfig; a ConfigError in one line naming its first problem."""
    from pydantic import ValidationError

    try:
        return SweepConfig.model_validate_json(text)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ConfigError(f"--sweep{f' {where}' if where else ''}: {first['msg']} (the sweep's JSON, e.g. "
                          f"{DEFAULT_SWEEP.model_dump_json(exclude_defaults=True)})") from None


if __name__ == "__main__":  # --help and a command-line error answer before Prefect and MLflow load
    first = arguments().parse_args()
    try:
        sweep = sweep_option(first.sweep)
    except ConfigError as err:
        print(f"serve failed: {err}", file=sys.stderr)
        sys.exit(2)
    pin_numerics_first("serve", sweep.params_path, [sweep.experiment])
    pin_numerics_first("serve", first.params_file)
    # its flow runs inherit these: params.yaml's, which the nightly dvc repro computes under
    pin_numerics_first("serve", "params.yaml")

from flows.pipeline import pipeline_flow, repro_flow
from flows.stage import check_prefect_api
from flows.sweep import checked_sweep_params, sweep_flow
from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import load_params


def deployments(cron: str, sweep: SweepConfig, sweep_cron: str | None, params_file: str) -> dict:
    checked_sweep_params(sweep)
    validate_params(load_params(params_file))
    return {
        "nightly": repro_flow.to_deployment(
            name="nightly", cron=cron, description="dvc repro: reruns the stale stages of dvc.yaml"),
        "sweep": sweep_flow.to_deployment(
            name="sweep", cron=sweep_cron, parameters={"sweep": sweep.model_dump()},
            description="algorithms x seeds of one experiment, under dotted overrides of params.yaml"),
        "params-file": pipeline_flow.to_deployment(
            name="params-file", parameters={"params_path": params_file},
            description="every stage of one params file, in one process"),
    }


def stop_at_once_if_the_server_died(signum: int, frame) -> None:
    """Ctrl-C. While the Prefect server answers, Prefect's own shutdown (it pauses the schedules).
    When the server has died, that shutdown would wait on it for good: say so in one line, stop
    the flow runs this process started (SIGTERM, then at most 30 s) and exit."""
    try:
        check_prefect_api()
    except ConfigError as err:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not start this again
        os.write(2, f"serve stopped at Ctrl-C, its schedules left as they were: {err}\n".encode())
        runs = psutil.Process().children(recursive=True)
        for run in runs:
            with contextlib.suppress(psutil.NoSuchProcess):
                run.terminate()
        _, alive = psutil.wait_procs(runs, timeout=30)
        for run in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                run.kill()
        os._exit(128 + signum)
    signal.default_int_handler(signum, frame)


def main(argv: list[str] | None = None) -> int:
    from prefect import serve

    args = arguments().parse_args(argv)
    try:
        chosen = deployments(args.cron, sweep_option(args.sweep), args.sweep_cron, args.params_file)
        check_prefect_api()
    except (ValueError, ConfigError) as err:
        print(f"serve failed: {err}", file=sys.stderr)
        return 2
    # asyncio.run installs no handler over it; and Ctrl-C works where a shell started this with SIGINT ignored
    signal.signal(signal.SIGINT, stop_at_once_if_the_server_died)
    serve(*(d for name, d in chosen.items() if not args.only or name in args.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
