"""The life of one run, the same for the training and the Learn2pFed flows: one writer at a
time, resume from its checkpoint, MLflow tracking, progress, checkpoints before logging, final
outputs, and a failure path that leaves nothing RUNNING and nothing half-written.

    with Run(paths, identity, tracking, seed, total=rounds, unit="round") as run:
        state = ... run.resumed ...             # None, or the checkpoint to resume from
        run.track(experiment, params, tags)
        run.snapshot = lambda: {...}            # the checkpoint of the state between steps
        diverged = run.play(start, every, advance, save, checkpoint_every, history, summary)
        if diverged is not None:                # (step, what is not finite)
            return run.diverged(*diverged, curve)
        run.finish(final, curve, artifacts)

`play` stops between spans on SIGTERM/SIGHUP/SIGINT, or when `stop_runs` asks it to (runs on
other threads than the main one, which get no signal of their own).

`unit` ("round", "epoch") is also the step key of the history records. On an exception or
signal the run saves `snapshot()` if the state is consistent, marks its MLflow run FAILED
(KILLED for a signal) with the reason, and re-raises. A first signal finishes the step under
way; a second stops at once. After a signal no store is waited for: a store call that waits is
given up (while steps remain), and the KILLED mark gets a 5 s try.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pfl_tasks.config import TrackingConfig
from pfl_tasks.engine.checkpoint import load_checkpoint, save_checkpoint
from pfl_tasks.errors import CheckpointError, OutputLockedError, RunStopped, TrackingError
from pfl_tasks.files import OutputLock, check_output_dir, remove_stale_temporaries
from pfl_tasks.outputs import headline, pin, pinned_run, progress, write_dvc_outputs
from pfl_tasks.selection import tracked_series
from pfl_tasks.store_process import StoreClient
from pfl_tasks.tracking import MlflowRun, flatten, retrying, stored_run, tracking_uri


CONSOLE = "PFL_CONSOLE"
IDENTITY_TAG = "run_identity"  # config hash @ platform: a finished run another identical one may log into  # "runs": a line per finished run instead of one per evaluation


@dataclass(frozen=True)
class RunPaths:
    checkpoint: Path
    metrics: Path
    curve: Path
    lock: Path

    @classmethod
    def of(cls, root: Path, experiment: str, run_name: str, seed: int) -> RunPaths:
        return cls(
            checkpoint=root / "models" / experiment / run_name / f"seed-{seed}" / "checkpoint.pt",
            metrics=root / "metrics" / experiment / run_name / f"seed-{seed}.json",
            curve=root / "plots" / experiment / run_name / f"seed-{seed}.csv",
            lock=root / ".locks" / experiment / run_name / f"seed-{seed}.lock",
        )

    def check_writable(self) -> None:
        """Every output's folder is, or can be made as, a writable folder (OutputPathError)."""
        for path in (self.checkpoint, self.metrics, self.curve, self.lock):
            check_output_dir(path.parent)


# the identity keys `--on-config-change resume` may continue under: when to evaluate and
# checkpoint (the budget, `federation.rounds`, is no part of an identity). Every other key (the
# clients and their data, the model, the algorithm, local training, the numeric code) decides
# the trained state: a run continued under another would be neither configuration's run.
RESUMABLE = frozenset({"experiment.federation.eval_every", "experiment.federation.checkpoint_every"})


def resume_point(path: Path, identity: dict, total: int, on_config_change: str) -> dict | None:
    """The checkpoint to resume from, None to start fresh; raises on foreign/corrupt files and
    on a checkpoint no `on_config_change` but restart may continue."""
    if not path.exists():
        return None
    ckpt = load_checkpoint(path, {k: identity[k] for k in ("experiment", "algorithm")})
    problem, unresumable = checkpoint_problem(ckpt, identity, total)
    if problem is None:
        return ckpt
    if on_config_change == "restart":
        print(f"{path}: {problem}; starting afresh")
        return None
    if unresumable is not None:
        raise CheckpointError(f"{path}: cannot resume: {unresumable}. Pass --on-config-change restart to start afresh.")
    if on_config_change == "resume":
        print(f"{path}: {problem}; resuming anyway (--on-config-change resume)", file=sys.stderr)
        return ckpt
    raise CheckpointError(
        f"{path}: {problem}. Pass --on-config-change restart to discard it, "
        "or --on-config-change resume to continue from it anyway."
    )


def checkpoint_problem(ckpt: dict, identity: dict, total: int) -> tuple[str | None, str | None]:
    """Why a run of `identity` and `total` steps may not simply continue `ckpt`: (problem,
    unresumable), both None when it may; `unresumable` when only a restart may (a checkpoint of
    another federation, data, model, training or code, or past `total`)."""
    problem = unresumable = None
    if ckpt["round"] > total:
        problem = unresumable = f"it is at step {ckpt['round']}, beyond the configured {total}"
    elif ckpt["config_hash"] != identity["config_hash"]:
        old, new = flatten(json.loads(ckpt["config"])), flatten(json.loads(identity["config"]))
        changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
        problem = f"configuration changed ({', '.join(changed)})"
        fixed = [f"{key} {old.get(key, '(unset)')} -> {new.get(key, '(unset)')}" for key in changed
                 if key not in RESUMABLE]
        if fixed:
            unresumable = f"its clients, data, model, training or code differ from this run's ({'; '.join(fixed)})"
    elif "platform" in identity and ckpt.get("platform") != identity["platform"]:
        problem = (f"it was computed on {ckpt.get('platform', 'an unrecorded platform')}, this run computes on "
                   f"{identity['platform']} (the numbers would mix both)")
    return problem, unresumable


def platforms_run(ckpt: dict, current: str) -> list[str]:
    """The platforms (`engine.device.describe`) a resumed run has computed on, in order: one,
    unless it was resumed on another with --on-config-change resume."""
    earlier = ckpt.get("platforms") or [ckpt.get("platform", "")]
    return earlier + ([current] if current != earlier[-1] else [])


def mixed_platform_tags(platforms: list[str]) -> dict[str, str]:
    """`platform.<fact>` tags for the facts that changed along a run's platforms, such as
    `platform.numerics: portable, then native`: its numbers mix them."""
    facts = [dict(fact.split(" ", 1) for fact in platform.split(", ") if " " in fact) for platform in platforms]
    tags = {}
    for key in dict.fromkeys(key for one in facts for key in one):
        values = [one.get(key, "unrecorded") for one in facts]
        if len(set(values)) > 1:
            tags[f"platform.{key}"] = ", then ".join(v for i, v in enumerate(values) if i == 0 or v != values[i - 1])
    return tags


_UNDER_WAY: set[Run] = set()  # this process's runs, for `stop_runs`
_UNDER_WAY_LOCK = threading.Lock()


def stop_runs(signum: int) -> None:
    """Ask every run under way in this process to stop after its step under way, as signal
    `signum` asks the main thread's run."""
    with _UNDER_WAY_LOCK:
        runs = list(_UNDER_WAY)
    for run in runs:
        run.request_stop(signum)


# MLflow gets a run's records in batches, at most this often between checkpoints (a store call
# costs about as much as a small round; what it has not had yet is in the next checkpoint)
LOG_EVERY_S = 2.0


class Run:
    def __init__(self, paths: RunPaths, identity: dict, tracking: TrackingConfig, seed: int, *,
                 total: int, unit: str, on_config_change: str = "refuse"):
        self.paths, self.identity, self.tracking, self.seed = paths, identity, tracking, seed
        self.total, self.unit, self.on_config_change = total, unit, on_config_change
        self.label = f"{identity['experiment']}/{identity['algorithm']}/seed{seed}"
        self.resumed: dict | None = None
        self.tracker: MlflowRun | None = None
        self.snapshot: Callable[[], dict] | None = None
        self.logged_through: int | None = -1  # the last step whose record MLflow holds (None: ask it)
        self.done = 0  # steps completed
        self.bar = None
        self.summary = ""  # the latest `note`
        self.started = self._logged_at = time.monotonic()
        self._consistent = True
        self._stop: int | None = None
        self._lock = OutputLock(paths.lock, self.label)
        self._handlers: dict[int, object] = {}

    # ------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> Run:
        self.paths.check_writable()
        self._lock.__enter__()
        try:
            remove_stale_temporaries(self.paths.checkpoint, self.paths.metrics, self.paths.curve)
            self.resumed = resume_point(self.paths.checkpoint, self.identity, self.total, self.on_config_change)
            if self.resumed is not None:
                self.done = self.resumed["round"]
                self.identity["platforms"] = platforms_run(self.resumed, self.identity.get("platform", ""))
        except BaseException:
            self._lock.__exit__()
            raise
        if threading.current_thread() is threading.main_thread():
            self._handlers = {sig: signal.signal(sig, self._on_signal)
                              for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
        with _UNDER_WAY_LOCK:
            _UNDER_WAY.add(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.bar is not None:
                self.bar.close()
            if exc is not None and not isinstance(exc, OutputLockedError):  # else its outputs are another's now
                self._fail(exc)
        finally:
            with _UNDER_WAY_LOCK:
                _UNDER_WAY.discard(self)
            for sig, handler in self._handlers.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
            self._lock.__exit__()
        if exc is None and self._stop is not None:  # a signal during the last step: stop the stage too
            raise RunStopped(self._stop)

    def _on_signal(self, signum, frame) -> None:
        if self._stop is not None:
            raise RunStopped(signum)
        self.request_stop(signum)

    def request_stop(self, signum: int) -> None:
        if self._stop is not None:
            return
        self._stop = signum
        print(f"{self.label}: {signal.Signals(signum).name}: stopping after this {self.unit} "
              "(again to stop at once)", file=sys.stderr, flush=True)

    def _stopping(self) -> None:
        """Called while a store call waits (a locked or unreachable store): after a stop request
        it gives the call up, while steps remain (MLflow gets their records on resume); a run
        whose steps are all done completes its record, unless a second signal stops it."""
        if self._stop is not None and self.done < self.total:
            raise RunStopped(self._stop)

    def _fail(self, exc: BaseException) -> None:
        status = "KILLED" if isinstance(exc, (RunStopped, KeyboardInterrupt)) else "FAILED"
        where = f"during {self.unit} {self.done + 1}"
        if self.snapshot is not None and self._consistent:
            try:
                payload = self.snapshot()
                save_checkpoint(self.paths.checkpoint, payload)
                where = f"at {self.unit} {payload['round']} (checkpointed)"
            except (Exception, RunStopped) as err:
                print(f"{self.label}: could not checkpoint on failure: {err!r}", file=sys.stderr)
        if self.tracker is None:
            return
        try:  # a store that just failed, or a stop request, gets a short last try
            self.tracker.finish(status, f"{type(exc).__name__} {where}: {exc}",
                                bound=5.0 if isinstance(exc, TrackingError) or self._stop is not None else None)
        except (Exception, RunStopped) as err:
            print(f"{self.label}: MLflow run {self.tracker.run_id} left RUNNING, not marked {status} ({err}); "
                  "a rerun resumes it", file=sys.stderr)

    # ------------------------------------------------------------------------- during the run
    def track(self, experiment: str, params: dict[str, str], tags: dict[str, str]) -> None:
        """Open (or resume) the MLflow run, tagged from its creation with this output and
        process (a checkpoint written under another `budget` continues as a new run, with its
        history: each budget's numbers stay in their own run); fail the RUNNING runs of this
        output whose process on this host is dead; and find the last record MLflow already holds (a killed run may have logged past its
        checkpoint), so that `log` sends each once. A record's last key is logged last."""
        run_id = self.resumed.get("mlflow_run_id") if self.resumed else self._retrained_run()
        if run_id and self.resumed and self.resumed.get("budget", self.total) != self.total:
            print(f"{self.label}: continuing the {self.resumed['budget']}-{self.unit} run (MLflow run {run_id}, "
                  f"which keeps its numbers) to {self.total} {self.unit}s as a new MLflow run")
            run_id = None
        key = {"experiment": self.identity["experiment"], "variant": self.identity["algorithm"],
               "seed": str(self.seed), "host": socket.gethostname()}
        mine = {**key, "pid": str(os.getpid())}
        self.tracker = MlflowRun(self.tracking.mlflow_uri, experiment, f"{self.identity['algorithm']}-seed{self.seed}",
                                 run_id, self.tracking.retry_seconds, tags=mine, stopping=self._stopping)
        if self.tracker.to_resume:
            self.tracker.resume(mine)
        self.tracker.fail_stale_runs(key, "its process died (found RUNNING by a later run of the same output)")
        mixed = mixed_platform_tags(self.identity.get("platforms", []))
        self.tracker.log_params_and_tags(params, {**tags, **mixed, IDENTITY_TAG: self.identity_tag()})
        history = self.resumed.get("history", []) if self.resumed else []
        if history:
            self.logged_through = self._stored_through(history)
        elif run_id is not None:  # retrained into its finished run: MLflow holds the records up to its end
            self.logged_through = None

    def _stored_through(self, history: list[dict]) -> int:
        """The last step whose record MLflow holds: the last at which it holds the last key of
        the last record (a record's keys are logged in order)."""
        return self.tracker.last_step(list(tracked_series(history[-1]))[-1])

    def identity_tag(self) -> str:
        return f"{self.identity['config_hash']}@{self.identity.get('platform', '')}"

    def _retrained_run(self) -> str | None:
        """When a run that finished lost its checkpoint (a deleted `models/`), the MLflow run its
        metrics file names, if that run finished under this identity and platform: retrained
        bit-identically, the run logs into it (nothing twice) instead of adding a second
        FINISHED run of the output."""
        try:
            outcome = json.loads(self.paths.metrics.read_text())
        except (OSError, ValueError):
            return None
        run_id = pinned_run(outcome) if isinstance(outcome, dict) and outcome.get("status") == "finished" else None
        if run_id is None:
            return None
        run = retrying(lambda: stored_run(StoreClient(tracking_uri(self.tracking.mlflow_uri)), run_id), "get run",
                       self.tracking.retry_seconds, stopping=self._stopping)
        if run is None or run.data.tags.get(IDENTITY_TAG) != self.identity_tag():
            return None
        print(f"{self.label}: its checkpoint is gone; retraining into MLflow run {run_id}, which finished under "
              "the same config, data, code and platform")
        return run_id

    def spans(self, start: int, every: int) -> Iterator[tuple[int, int]]:
        """Steps `start` to `total` as spans [first, stop) that end at the multiples of `every`
        (and at `total`), with a progress bar; a requested stop is honoured between spans."""
        return self._walk(start, lambda step: (step // every + 1) * every)

    def _walk(self, start: int, following: Callable[[int], int]) -> Iterator[tuple[int, int]]:
        self.bar = progress(self.label, self.total, start, self.unit)
        first = start
        while first < self.total:
            if self._stop is not None:
                raise RunStopped(self._stop)
            stop = min(following(first), self.total)
            yield first, stop
            self.done = stop
            self.bar.update(stop - first)
            first = stop

    def play(self, start: int, every: int, advance: Callable[[int, int], tuple[int, str] | None],
             save: Callable[[Path, int, dict], None], checkpoint_every: int, history: list[dict],
             summary: Callable[[int], str | None]) -> tuple[int, str] | None:
        """The run's steps from `start` to `total`, in `spans` of `every`. Each span: `advance(first,
        stop)` changes the state (no failure checkpoint meanwhile) and returns (step, problem) when
        the state stopped being finite at `step`; then `save(path, stop, snapshot())` at the
        multiples of `checkpoint_every` and at `total`, MLflow gets the `history` records it has
        not had (after the checkpoint; batched, at most every LOG_EVERY_S seconds between
        checkpoints), and the progress bar and log the span's `summary(stop)`,
        if any. The (step, problem) of a diverged run, for `diverged`; None when every step ran."""
        for first, stop in self.spans(start, every):
            with self.mutating():
                problem = advance(first, stop)
            if problem is not None:  # the state is not finite: no failure checkpoint over the last good one
                self._consistent = False
                return problem
            checkpointed = stop % checkpoint_every == 0 or stop == self.total
            if checkpointed:
                save(self.paths.checkpoint, stop, self.snapshot())
            if checkpointed or time.monotonic() - self._logged_at >= LOG_EVERY_S:
                self.log(history)
            line = summary(stop)
            if line is not None:
                self.note(line, at=stop)
        return None

    @contextlib.contextmanager
    def mutating(self) -> Iterator[None]:
        """The state is being changed in place: no failure checkpoint from in here."""
        self._consistent = False
        yield
        self._consistent = True
        self._lock.verify()  # before anything of the step is written

    def note(self, summary: str, at: int | None = None) -> None:
        """The latest metrics on the progress bar, and a log line when `at` names the step (with
        PFL_CONSOLE=runs, as `make run` sets it, only the run's last one, when it finishes)."""
        self.bar.set_postfix_str(summary, refresh=False)
        self.summary = summary
        if at is not None and os.environ.get(CONSOLE) != "runs":
            self.bar.write(f"{self.label} {self.unit} {at}: {summary}")

    def log(self, history: list[dict]) -> None:
        """Send MLflow the records it has not had yet (after any checkpoint due: a rerun then
        finds them in the checkpoint), as `tracked_series`."""
        if self.logged_through is None:  # a run retrained into its MLflow run: ask it what it holds
            if not history:
                return
            self.logged_through = self._stored_through(history)
        self.tracker.log_records([tracked_series(r) for r in history if r[self.unit] > self.logged_through], self.unit)
        self._logged_at = time.monotonic()
        if history:
            self.logged_through = max(self.logged_through, history[-1][self.unit])

    def finish(self, final: dict[str, float], curve: list[dict], artifacts: Callable[[Path], None]) -> None:
        """Every final metric and `artifacts(dir)`'s files to MLflow, FINISHED; then the curve
        and the DVC metrics (the `headline` of `final`, pinned to the MLflow run: what reports
        read for this output, and what says the run finished), last: a kill before them leaves
        a run that the rerun finishes again (logging no final metric twice), never a kept run
        that MLflow shows RUNNING."""
        self._lock.verify()
        if self.tracker.last_step(next(iter(final))) < self.total:
            self.tracker.log_metrics(final, step=self.total)
        with tempfile.TemporaryDirectory() as tmp:
            artifacts(Path(tmp))
            self.tracker.log_artifacts(Path(tmp))
        self.tracker.finish()
        self._lock.verify()
        write_dvc_outputs(self.paths.metrics, self.paths.curve,
                          {"status": "finished", **headline(final), **pin(self.tracker.run_id)}, curve)
        if os.environ.get(CONSOLE) == "runs":
            print(f"{self.label}: {self.total} {self.unit}s in {time.monotonic() - self.started:.0f} s, "
                  f"{self.summary}", flush=True)

    def diverged(self, at: int, reason: str, curve: list[dict]) -> dict:
        """A NaN or infinity in the state at step `at`: a failed run, never a result. The DVC
        metrics say so (`status: diverged`), MLflow marks the run FAILED with the step and reason
        (tag `diverged_at`), and the last checkpoint stays, from before the divergence."""
        self._lock.verify()
        record = {"status": "diverged", "diverged_at": at, "reason": reason, **pin(self.tracker.run_id)}
        self.tracker.set_tag("diverged_at", str(at))
        self.tracker.finish("FAILED", f"diverged at {self.unit} {at}: {reason}")
        self._lock.verify()
        write_dvc_outputs(self.paths.metrics, self.paths.curve, record, curve)
        print(f"{self.label}: diverged at {self.unit} {at}: {reason}; a failed run, not a result", file=sys.stderr)
        return record
