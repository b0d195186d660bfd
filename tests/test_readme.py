"""The README's and the reference pages' instructions work: the documented MLflow search filters
against a small store, the CLI commands shown with `MLFLOW_TRACKING_URI`, the worked example of an
algorithm (docs/engine.md), the params template for your own data; every command, flag, params
file, path and link they name exists; and the README stays task-first (short, no diary, dates only
as citations of bench/results/ files, which its index lists)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
RESULTS = REPO / "bench" / "results"
RESULTS_INDEX = RESULTS / "README.md"
PAGES = [README, *DOCS]  # what the command, path and link checks read


def documented_filters() -> list[str]:
    text = README.read_text()
    block = re.search(r"<!-- mlflow-filters -->\n```text\n(.*?)```", text, re.S)
    assert block, "README lost its block of MLflow filters"
    return [line for line in block.group(1).splitlines() if line.strip()]


# run name, its entry under `algorithms` (`mu: 1` an int, as YAML and `--set mu=0.1,1` read it), test accuracy
RUNS = (("fedavg", {}, 0.7), ("fedprox", {"mu": 0.1}, 0.75), ("ditto", {}, 0.9),
        ("ditto_mu1", {"algorithm": "ditto", "mu": 1}, 0.85))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """Finished runs of `mnist`, one a grid's variant, tagged and with params logged by the
    training flow's code."""
    from conftest import tiny_params
    from pfl_tasks.algorithms import build, hyper_parameters
    from pfl_tasks.config import parse_params
    from pfl_tasks.tracking import MlflowRun, flatten, run_tags

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    exp = parse_params(tiny_params()).experiment("tiny").model_copy(update={"name": "mnist"})
    for run_name, raw, acc in RUNS:
        run = MlflowRun(uri, "mnist", f"{run_name}-seed0", None)
        tags = run_tags(exp, "classification", "p", run_name, build(run_name, raw).name, "c", "d", "h", "s", "")
        run.log_params_and_tags(flatten({"algorithm": hyper_parameters(run_name, raw)}), tags)
        run.log_metrics({"selected/test/personalized/acc_mean": acc}, step=0)
        run.finish()
    return uri


# what each filter of the README's block selects from RUNS: a filter added there needs its line here
DOCUMENTED_SELECTS = {
    "tags.algorithm = 'ditto' AND metrics.\"selected/test/personalized/acc_mean\" > 0.8": ["ditto", "ditto_mu1"],
    "tags.algorithm LIKE 'fed%'": ["fedavg", "fedprox"],
    "tags.variant = 'ditto_mu1'": ["ditto_mu1"],
    "tags.variant = 'ditto' AND params.\"algorithm.mu\" = '0.1'": ["ditto"],  # one setting of one variant
    "params.\"algorithm.mu\" = '1.0' AND tags.seed = '0'": ["ditto_mu1"],
    "attributes.status = 'FINISHED' AND tags.experiment = 'mnist'": ["ditto", "ditto_mu1", "fedavg", "fedprox"],
}


@pytest.mark.parametrize("filter_string", documented_filters())
def test_documented_filter_is_accepted_and_selects_the_runs_it_says(store, filter_string, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # as the README sets it (never mlflow.set_tracking_uri:
                                                      # it sets this variable for the rest of the process)
    runs = mlflow.search_runs(experiment_names=["mnist"], filter_string=filter_string)
    assert filter_string in DOCUMENTED_SELECTS, "a new README filter: add what it selects to DOCUMENTED_SELECTS"
    assert sorted(name.removesuffix("-seed0") for name in runs["tags.mlflow.runName"]) == DOCUMENTED_SELECTS[filter_string]


@pytest.mark.parametrize("filter_string, selected", [
    ("tags.algorithm = 'ditto'", ["ditto-seed0", "ditto_mu1-seed0"]),  # a grid's variants too
    ("tags.variant = 'ditto_mu1'", ["ditto_mu1-seed0"]),
    ("params.\"algorithm.mu\" = '1.0'", ["ditto_mu1-seed0"]),  # params.yaml's int 1, logged as a float
    ("params.\"algorithm.mu\" = '0.1'", ["ditto-seed0", "fedprox-seed0"]),  # ditto's default, logged too
])
def test_filters_select_by_algorithm_variant_and_canonical_params(store, filter_string, selected, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    runs = mlflow.search_runs(experiment_names=["mnist"], filter_string=filter_string)
    assert sorted(runs["tags.mlflow.runName"]) == selected


def test_documented_cli_reads_the_tracking_uri(store):
    env = {**os.environ, "MLFLOW_TRACKING_URI": store}
    mlflow = [sys.executable, "-m", "mlflow"]
    found = subprocess.run([*mlflow, "experiments", "search"], env=env, capture_output=True, text=True, check=True)
    assert "mnist" in found.stdout
    experiment_id = re.search(r"^\s*(\d+)\s+mnist", found.stdout, re.M).group(1)
    runs = subprocess.run([*mlflow, "runs", "list", "--experiment-id", experiment_id], env=env,
                          capture_output=True, text=True, check=True)
    listed = [line for line in runs.stdout.splitlines() if "FINISHED" in line or re.search(r"[0-9a-f]{32}", line)]
    assert len(listed) == len(RUNS)


def test_worked_example_of_an_algorithm_registers_and_does_its_job(digits6):
    """FedBABU from docs/engine.md: registered by its module alone; its head never leaves its
    initialization while the body trains, and its clients are evaluated fine-tuned."""
    from conftest import run_rounds, tiny_federation
    from pfl_tasks.algorithms import ALGORITHMS
    from pfl_tasks.nets import head_keys

    code = re.search(r"<!-- worked-example -->\n```python\n(.*?)```", (REPO / "docs" / "engine.md").read_text(), re.S)
    assert code, "docs/engine.md lost its worked example"
    try:
        exec(compile(code.group(1), "docs/engine.md (worked example)", "exec"), {"__name__": "fedbabu_example"})
        assert "fedbabu" in ALGORITHMS
        fed = tiny_federation(digits6, "fedbabu", hp={})
        start = fed.initial_state()
        state = run_rounds(fed, start, 0, 3)
        before, after = start.server["global"], state.server["global"]
        head = head_keys(after)
        for k in head:  # the average of identical rows: equal to rounding
            torch.testing.assert_close(after[k], before[k], rtol=1e-6, atol=1e-7)
        assert min((after[k] - before[k]).abs().max() for k in set(after) - head) > 1e-3
        evaluation = fed.evaluate(state).metrics["val"]
        assert not torch.equal(evaluation["personalized"]["loss"], evaluation["global"]["loss"])  # fine-tuned
    finally:
        ALGORITHMS.pop("fedbabu", None)


# ----------------------------------------------------------------------------- the params template
def own_params() -> dict:
    block = re.search(r"<!-- own-params -->\n```yaml\n(.*?)```", README.read_text(), re.S)
    assert block, "README lost its params template for your own data"
    return yaml.safe_load(block.group(1))


def test_own_data_template_is_a_valid_params_file():
    """The README's complete params file for your own data loads, with every method's
    hyper-parameters, as `flows.pipeline --params own-params.yaml` would load it."""
    from pfl_tasks.algorithms import validate_params
    from pfl_tasks.config import parse_params

    params = validate_params(parse_params(own_params()))
    assert any(d.source.name == "file" for d in params.datasets.values())
    for name in params.tuning:
        assert name in params.experiments


def test_own_data_moved_into_params_yaml_keeps_its_experiment():
    """"Into DVC", step 2, as written: the own file's `datasets`, `experiments`, `tuning` and
    `tables` entries moved into params.yaml, with the defaults `flows.dvc_yaml` asks for listed
    under `algorithms`, train the experiment the own file trained: its budget, its lr, its model."""
    from pfl_tasks.algorithms import hyper_parameters, validate_params
    from pfl_tasks.config import parse_params

    own, merged = own_params(), yaml.safe_load((REPO / "params.yaml").read_text())
    for section in ("datasets", "experiments", "tuning", "tables"):
        merged[section] = {**merged.get(section, {}), **own.get(section, {})}
    for name in own["experiments"]:
        for run in own["experiments"][name]["algorithms"]:
            merged["algorithms"].setdefault(run, hyper_parameters(run, {}))
    before, after = parse_params(own), validate_params(parse_params(merged))
    for name in own["experiments"]:
        was, now = before.experiment(name), after.experiment(name)
        assert now.model_dump(exclude={"engine", "hyper"}) == was.model_dump(exclude={"engine", "hyper"})
        assert ({run: hyper_parameters(run, hp) for run, hp in now.hyper.items()}
                == {run: hyper_parameters(run, hp) for run, hp in was.hyper.items()})


# ----------------------------------------------------------------------------- task-first README
MAX_README_LINES = 450
MAX_README_DATES = 5
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
CITED_DATE = re.compile(r"bench/results/(\d{4}-\d{2}-\d{2})[\w.-]*")
# words of a diary, not of a description of what the project does
DIARY = [
    "that evening", "that morning", "that afternoon", "that night", "that day", "later that", "earlier that",
    "used to", "at midday", "at noon", "in the morning", "in the afternoon", "in the evening", "at night",
    "the night before", "the day before", "this section used to", "yesterday", "today", "tonight",
]
DIARY_PATTERNS = [
    (re.compile(r"\bnow\b", re.I), "'now'"),
    (re.compile(r"\blater\b", re.I), "'later'"),
    (re.compile(r"\b\d{1,2}h\d{2}\b"), "a time of day"),
    (re.compile(r"\bat \d{1,2}:\d{2}\b"), "a time of day"),
    (re.compile(r"\b\d+ (?:tests )?passed\b"), "a test count"),
    (re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"), "a commit hash"),
]


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move reference material into docs/"


def test_readme_opens_its_quickstart_with_the_two_fresh_machine_commands():
    quickstart = README.read_text().split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", quickstart, re.S).group(1).splitlines()
    assert [line.split()[:2] for line in block[:2]] == [["make", "run"], ["make", "test"]]


def test_readme_dates_only_cite_measurement_files():
    text = README.read_text()
    dates = DATE.findall(text)
    cited = CITED_DATE.findall(text)
    assert len(dates) <= MAX_README_DATES, f"README.md has {len(dates)} dates; at most {MAX_README_DATES}"
    assert sorted(dates) == sorted(cited), (
        f"a date outside a bench/results/ citation: {sorted(set(dates) - set(cited)) or dates}")


@pytest.mark.parametrize("page", [*PAGES, RESULTS_INDEX], ids=lambda p: str(p.relative_to(REPO)))
def test_no_diary(page):
    text = page.read_text()
    lowered = text.lower()
    found = [word for word in DIARY if re.search(rf"\b{re.escape(word)}\b", lowered)]
    found += [f"{what}: {m.group(0)!r}" for pattern, what in DIARY_PATTERNS for m in pattern.finditer(text)]
    assert not found, f"{page.relative_to(REPO)}: write what the project does, not when: {found}"


# ----------------------------------------------------------------------------- commands, flags, paths
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`\n]+)`")


def code_of(page: Path) -> list[str]:
    """The page's commands and code: its fenced blocks (continued lines joined, one entry per
    line) and its inline code spans."""
    text = page.read_text()
    pieces = []
    for block in FENCE.findall(text):
        pieces += block.replace("\\\n", " ").splitlines()
    pieces += INLINE.findall(FENCE.sub("", text))
    return pieces


def all_code() -> list[tuple[str, str]]:
    return [(str(page.relative_to(REPO)), piece) for page in PAGES for piece in code_of(page)]


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


MODULE = re.compile(r"python -m ((?:flows|bench)(?:\.\w+)+)((?:\s+[^#&|;]*)?)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def module_file(module: str) -> Path:
    return REPO / (module.replace(".", "/") + ".py")


def test_every_make_command_names_a_makefile_target():
    targets = make_targets()
    wrong = [(where, piece) for where, piece in all_code()
             for target in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", piece) if target not in targets]
    assert not wrong, f"no such Makefile target (targets: {sorted(targets)}): {wrong}"


def test_every_python_module_command_names_a_module_and_its_flags():
    wrong = []
    for where, piece in all_code():
        for module, rest in MODULE.findall(piece):
            path = module_file(module)
            if not path.is_file():
                wrong.append((where, f"python -m {module}: no {path.relative_to(REPO)}"))
                continue
            source = path.read_text()
            for flag in FLAG.findall(rest):
                if flag != "--help" and f'"{flag}"' not in source:
                    wrong.append((where, f"python -m {module} {flag}: not an option of {path.relative_to(REPO)}"))
        for args in re.findall(r"BENCH_ARGS=\"([^\"]*)\"", piece):  # make bench's options are bench.run's
            source = (REPO / "bench" / "run.py").read_text()
            wrong += [(where, f"BENCH_ARGS {flag}: not an option of bench/run.py")
                      for flag in FLAG.findall(args) if f'"{flag}"' not in source]
    assert not wrong, wrong


def test_every_params_file_named_exists():
    named = {(str(page.relative_to(REPO)), name) for page in PAGES
             for name in re.findall(r"(?<![\w./-])(params(?:-[\w.-]+)?\.yaml)", page.read_text())}
    missing = [(where, name) for where, name in sorted(named) if not (REPO / name).is_file()]
    assert not missing, missing


SOURCE_PATH = re.compile(r"^(?:(?:pfl_tasks|flows|tests|bench|docs|\.ci)/[\w./-]+"
                         r"|Makefile|dvc\.yaml|dvc\.lock|pytest\.ini|requirements[\w-]*\.txt)(?:::(\w+))?$")


def test_every_source_path_named_exists():
    """Code spans naming a file of the project (`pfl_tasks/…`, `tests/test_x.py::test_name`,
    `bench/results/<file>`, …) name one that exists, and a test named after `::` is in its file."""
    wrong = []
    for where, piece in all_code():
        for token in piece.split():
            token = token.strip("(),;:'\"")
            if token.endswith("/") and token.count("/") == 1:
                token = token.rstrip("/")
            match = SOURCE_PATH.match(token)
            if not match:
                continue
            path = REPO / token.split("::")[0]
            if not path.exists():
                wrong.append((where, token))
            elif match.group(1) and not re.search(rf"^\s*def {match.group(1)}\b", path.read_text(), re.M):
                wrong.append((where, f"{token}: no such test"))
    assert not wrong, f"no such file or test: {wrong}"


def test_every_library_name_named_exists():
    """Dotted names such as `pfl_tasks.code_deps.numeric_code` name a module, and an attribute
    defined in it."""
    wrong = []
    for where, piece in all_code():
        for dotted in re.findall(r"(?<![\w.])(pfl_tasks(?:\.\w+)+)", piece):
            parts = dotted.split(".")
            for n in range(len(parts), 0, -1):  # the longest prefix that is a module or package
                base = REPO.joinpath(*parts[:n])
                source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
                if source.is_file():
                    break
            else:
                wrong.append((where, dotted))
                continue
            rest = parts[n:]
            if rest and not re.search(rf"^\s*(?:def |class )?{rest[0]}\b", source.read_text(), re.M):
                wrong.append((where, dotted))
    assert not wrong, f"no such module or name: {wrong}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    heading = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M)}


@pytest.mark.parametrize("page", [*PAGES, RESULTS_INDEX], ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(page):
    wrong = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            wrong.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            wrong.append(f"{target}: no heading with that anchor")
    assert not wrong, f"{page.relative_to(REPO)}: {wrong}"


# ----------------------------------------------------------------------------- bench/results index
def measurement_files() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir()
                  if p.is_file() and p.name != "README.md" and not re.search(r"-quick\.", p.name))


def test_results_index_lists_every_measurement_file():
    """One row per measurement in bench/results/README.md, naming each of its files (`stem.md`,
    then `.json`, `.png` on the same row)."""
    rows = [line for line in RESULTS_INDEX.read_text().splitlines() if line.startswith("| 20")]
    unlisted = []
    for path in measurement_files():
        stem, ext = path.name.split(".", 1)
        row = next((r for r in rows if f"`{stem}." in r.split("|")[2]), None)
        if row is None or not (f"`{path.name}`" in row or f"`.{ext}`" in row):
            unlisted.append(path.name)
    assert not unlisted, f"add a row to bench/results/README.md for: {unlisted}"


def test_results_index_and_pages_cite_files_that_exist():
    index = RESULTS_INDEX.read_text()
    named = set(re.findall(r"`(\d{4}-\d{2}-\d{2}[\w.-]*\.(?:md|json|jsonl|png))`", index))
    for page in PAGES:
        named |= set(re.findall(r"bench/results/(\d{4}-\d{2}-\d{2}[\w.-]*\.(?:md|json|jsonl|png))", page.read_text()))
    missing = sorted(name for name in named if not (RESULTS / name).is_file())
    assert not missing, f"cited but not in bench/results/: {missing}"
