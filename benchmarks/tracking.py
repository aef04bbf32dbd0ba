"""MLflow logging of a benchmark run: one parent run, one nested run per attack.

Default store: ``sqlite:///<repo>/mlflow/mlflow.db`` with artifacts in ``<repo>/mlflow/artifacts``
(git-ignored; see mlflow/README.md for opening the dashboard), so a bare
``python -m benchmarks.run`` needs no server. Any other tracking URI (another sqlite file, a
``http://127.0.0.1:PORT`` server) works too; for an sqlite URI the artifacts go to an
``artifacts/`` folder next to the database file.

Everything goes through an explicit :class:`mlflow.MlflowClient` (no global active run), so a
run that is interrupted is closed with status FAILED by :meth:`Tracker.fail` and never left
RUNNING. Telemetry is switched off (``MLFLOW_DISABLE_TELEMETRY=true``: this machine has no
internet).

Before any run is written, :func:`check_store` probes the store with a short timeout (an HTTP
server's ``/health``, an sqlite file's write lock, a database connection), so a wrong URI is one
clear error within seconds instead of minutes of silent retries; MLflow's own HTTP retries are
bounded here (3 retries, about 7 s, unless the ``MLFLOW_HTTP_REQUEST_*`` variables say otherwise).
A new sqlite store is created and migrated in a temporary file next to it and moved into place
in one step (:func:`create_sqlite_store`), so an interruption never leaves a half-migrated
database. Every message that shows a URI goes through :func:`redact` (no passwords in output).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import sqlite3
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# MLflow's defaults retry an unreachable server for ~250 s (7 retries, backoff factor 2) in silence.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STORE_DIR = REPO_ROOT / "mlflow"
DEFAULT_EXPERIMENT = "sipit-bench"
PACKAGES = ("torch", "transformers", "tokenizers", "mlflow", "numpy", "scipy", "bitsandbytes", "gguf", "sipit-bench")
MAX_PARAM_CHARS = 6000
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
NOTE_TAG = "mlflow.note.content"  # the experiment's description in MLflow's UI (markdown)
NOTE_HEADING = "### How to read this dashboard (sipit-bench)"  # marks a description as ours: only ours is rewritten
VIEW_KEY = "sipit-vs-head"  # the saved runs-table view: ``#/experiments/<id>?viewStateShareKey=sipit-vs-head``
VIEW_TAG_PREFIX = "mlflow.sharedViewState."  # where MLflow's UI keeps a shared view of an experiment
#: The attacks, strongest-known first, whose rates the saved view puts side by side (absent ones stay empty).
VIEW_ATTACKS = ("sipit", "softmax-head", "softmax-head-adaptive", "inverse-head")
#: The rates compared per attack (``<attack>.<rate>``): all are fractions in [0, 1].
VIEW_RATES = ("token_accuracy", "exact_match")
PROMPTS_ARTIFACT = "prompts.csv"  # the rows of a run's dataset input (tracking.prompts_frame)
VIEW_EXTRA = ("utility.ppl_rel_increase", "margins.median_noise_norm", "margins.median_half_delta")


CHECK_TIMEOUT = 5.0
_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/:@\s]*):[^@\s/]*@")


class TrackingError(RuntimeError):
    """The tracking store cannot be reached or written."""


def redact(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` URL in it replaced by ``***``."""
    return _CREDENTIALS.sub(r"\g<head>:***@", str(text))


def describe_error(err: BaseException) -> str:
    """``Type: first line of the message``, credentials redacted: an error fit for a one-line message."""
    lines = str(err).strip().splitlines()
    return redact(f"{type(err).__name__}: {lines[0] if lines else ''}")


def default_tracking_uri() -> str:
    return f"sqlite:///{DEFAULT_STORE_DIR / 'mlflow.db'}"


def sqlite_path(uri: str) -> Path | None:
    """The database file of an ``sqlite:///`` URI (None for other schemes)."""
    if not uri.startswith("sqlite:"):
        return None
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else Path(uri[len("sqlite://"):])


def artifact_root(uri: str) -> str | None:
    """Where a new experiment stores artifacts: next to an sqlite file; the server's choice otherwise."""
    path = sqlite_path(uri)
    return (path.parent / "artifacts").resolve().as_uri() if path is not None else None


def check_store(uri: str, timeout: float = CHECK_TIMEOUT) -> None:
    """Raise :class:`TrackingError` within about ``timeout`` seconds if the store at ``uri`` is unusable."""
    scheme = urlparse(uri).scheme
    try:
        if scheme in ("http", "https"):
            _check_http(uri, timeout)
        elif scheme == "sqlite":
            _check_sqlite(sqlite_path(uri), timeout)
        elif scheme and scheme != "file":
            _check_database(uri, timeout)
    except Exception as err:  # noqa: BLE001 - any failure of the probe means "cannot track"
        reason = str(err) if isinstance(err, TrackingError) else describe_error(err)
        raise TrackingError(f"cannot use MLflow tracking store {redact(uri)!r}: {redact(reason)}") from None


def _check_http(uri: str, timeout: float) -> None:
    """A tracking server answers ``/health`` (any HTTP answer below 500 means something is there)."""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            return
    except urllib.error.HTTPError as err:
        if err.code < 500:
            return
        reason = f"HTTP {err.code}"
    except (OSError, ValueError) as err:
        reason = str(getattr(err, "reason", err))
    raise TrackingError(f"no MLflow server answers within {timeout:.0f}s ({reason}): start it, or fix --tracking-uri")


def _check_sqlite(path: Path, timeout: float) -> None:
    """The folder can hold the file, and the file (if there) is an sqlite database we may write."""
    folder = path.parent
    if folder.exists() and not folder.is_dir():
        raise TrackingError(f"{folder} is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    if path.exists() and not path.is_file():
        raise TrackingError(f"{path} is not a file")
    if not path.exists():
        probe = folder / f".{path.name}.probe-{os.getpid()}"
        try:
            probe.touch()
        except OSError as err:
            raise TrackingError(f"cannot create files in {folder} ({err.strerror})") from None
        probe.unlink()
        return
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=timeout, isolation_level=None)) as conn:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
    except sqlite3.Error as err:
        raise TrackingError(f"{path} cannot be written ({err})") from None


def _check_database(uri: str, timeout: float) -> None:
    """One connection to a database store (PostgreSQL, MySQL) with a connect timeout."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": max(1, int(timeout))})
    try:
        with engine.connect():
            pass
    finally:
        engine.dispose()


def create_sqlite_store(path: Path) -> None:
    """Create and migrate a new MLflow sqlite store at ``path`` atomically (temp file, then a hard link).

    Interrupted at any point, ``path`` either does not exist or is a complete store; when another
    process created it meanwhile, theirs is kept (``os.link`` never replaces a file).
    """
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    tmp = path.with_name(f".{path.name}.creating-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        store = SqlAlchemyStore(f"sqlite:///{tmp}", artifact_root(f"sqlite:///{path}"))
        store.engine.dispose()
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def open_store(uri: str) -> None:
    """Probe the store at ``uri`` (see :func:`check_store`); create a missing sqlite store atomically."""
    check_store(uri)
    db = sqlite_path(uri)
    if db is not None and not db.exists():
        try:
            create_sqlite_store(db)
        except Exception as err:  # noqa: BLE001
            raise TrackingError(f"cannot create MLflow store {db}: {describe_error(err)}") from None


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


@functools.cache
def git_commit() -> str:
    """The repository's HEAD commit, with ``+dirty`` when tracked files differ from it, read once per
    process: the code a process runs is the code it loaded, so a sweep's later settings keep the
    commit of the first even when HEAD moves while they run."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested config -> flat ``a.b`` keys with string values (MLflow params)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[name] = text[:MAX_PARAM_CHARS]
    return out


def finite_metrics(metrics: dict) -> dict[str, float]:
    """Numeric, finite entries only (MLflow rejects NaN in some stores; absent is clearer)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


def view_columns() -> list[str]:
    """The runs-table columns of the saved view, in order: per rate, every attack's column side by side
    (``sipit.token_accuracy``, ``softmax-head.token_accuracy``, ...), then the utility cost and the margins."""
    metrics = [f"{attack}.{rate}" for rate in VIEW_RATES for attack in VIEW_ATTACKS] + list(VIEW_EXTRA)
    return ["attributes.`Dataset`", "tags.`defense`"] + [f"metrics.`{key}`" for key in metrics]


def dashboard_view() -> dict:
    """MLflow UI state of the saved view (what the UI's Share button stores): the comparison columns."""
    columns = view_columns()
    widths = {c: 200 if c.startswith("metrics.") else 150 for c in columns if not c.startswith("attributes.")}
    return {"selectedColumns": columns, "columnOrder": columns, "columnWidths": widths, "orderByKey": "attributes.start_time",
            "orderByAsc": False, "compareRunsMode": "TABLE", "runListHidden": False, "viewMaximized": False,
            "hideEmptyCharts": True}


def dashboard_note(experiment_id: str) -> str:
    """The experiment's description (markdown): what is in it and how to read the comparison."""
    view = f"#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
    heads = ", ".join(f"`{a}.token_accuracy`" for a in VIEW_ATTACKS)
    return f"""{NOTE_HEADING}

**SipIt vs the classification heads:** open the saved view **[SipIt vs heads]({view})**: one row per
run, the columns {heads} side by side, then `exact_match` the same way, the utility cost and the
margins. (By hand: *Columns* -> *Metrics*, tick the same names.)

**Runs.** One parent run per `python -m benchmarks.run`, named `<defence>-<config hash>`, with one
nested run per attack (expand the row). A sweep (`--sigma-rel 0.01,1,10`) is one `sweep-<hash>`
parent with one run per setting under it (those carry the same metrics, and their attacks under
them). Tag `config_hash`: equal hashes are the same configuration.

**Metric names: `<attack>.<rate>`** on the parent run (the attack's own nested run carries the same
`<rate>` without the prefix). Attacks: `sipit` (exact inversion, or its noise-aware decoder),
`softmax-head` (classifier trained on clean states), `softmax-head-adaptive` (trained on the
defended states), `inverse-head`, `bruteforce`.
- `token_accuracy`: fraction of prompt tokens recovered at their position, 0..1; `_se` its
  prompt-clustered standard error, `_upper95` a one-sided 95% upper bound; `_chance` the rate at which
  the attack's output hits the *other* prompts' tokens (what reading nothing would score), `_excess_upper95`
  a one-sided 95% upper bound of the accuracy above that chance level.
- `exact_match`: fraction of prompts recovered whole, 0..1 (same `_se`, `_upper95`).
- `bag_f1`: bag-of-tokens F1 ignoring order, 0..1; other rates (e.g. `span_recall`, private spans
  leaked verbatim) are fractions 0..1 too; `seconds_per_prompt`: wall seconds;
  `candidates_per_position`: candidate tokens tried per position.
- `utility.ppl_rel_increase`: the defence's cost, relative perplexity increase of the served model
  (0.05 = +5%); `utility.continued_*` the same for inference continued from the exposed states;
  `utility.top1_agreement`: fraction of next-token argmaxes unchanged.
- `margins.median_half_delta` vs `margins.median_noise_norm`: L2 norms in the attacked layer's
  state space; noise below Delta/2 guarantees nearest-neighbour recovery.

**Sweeps:** the sweep run's *Model metrics* tab plots every rate against the setting index
(x = step); `sweep.<parameter>` is the swept value at that step (choose it as the x axis in the
chart settings). `sweep.png` (artifact) draws the same curves with error bars.

**Per run:** the prompt set is the run's *dataset* (Dataset column; its rows, texts and token ids,
in the artifact `{PROMPTS_ARTIFACT}`); artifacts `report.html` (truth vs each attack's recovery per
prompt), `results.json`, `per_prompt.csv`, `per_position.csv` and the plots.
"""


def prompts_frame(prompts: list[dict]):
    """A pandas DataFrame of a prompt set: ``prompt`` (index), ``kind``, ``text``, ``n_tokens``,
    ``token_ids`` (JSON list) and, where marked, ``private_spans`` (JSON list)."""
    import pandas as pd

    return pd.DataFrame([{"prompt": int(p["index"]), "kind": str(p.get("kind", "")), "text": str(p["text"]),
                          "n_tokens": len(p["ids"]), "token_ids": json.dumps([int(t) for t in p["ids"]]),
                          "private_spans": json.dumps(list(p.get("spans") or []))} for p in prompts])


def sweep_step_metrics(setting: dict, results: dict) -> dict[str, float]:
    """What a sweep's parent run logs at a setting's step: the swept numeric values as ``sweep.<key>``
    and the setting's flat metrics (``<attack>.<rate>``, ``utility.*``, ...)."""
    from benchmarks.run_outputs import flat_metrics

    values = {f"sweep.{k}": v for k, v in setting.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**values, **flat_metrics(results)}


class Tracker:
    """A parent MLflow run with nested attack runs, closed FINISHED or FAILED."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT):
        import mlflow
        from mlflow import MlflowClient

        self.uri = tracking_uri or default_tracking_uri()
        open_store(self.uri)
        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=artifact_root(self.uri))
            else:
                self.experiment_id = found.experiment_id
            tags = {} if found is None else found.tags
            if EXPERIMENT_KIND[0] not in tags:
                # MLflow 3's UI shows GenAI pages unless told this is classic model work: the runs table.
                self.client.set_experiment_tag(self.experiment_id, *EXPERIMENT_KIND)
            self._describe_experiment(tags)
        except Exception as err:  # noqa: BLE001 - any store failure means "cannot track"
            raise TrackingError(f"cannot use MLflow tracking store {redact(self.uri)!r}: {describe_error(err)}") from None
        self._mlflow = mlflow
        self.parent_id: str | None = None
        self.open_runs: list[str] = []

    def _describe_experiment(self, tags: dict) -> None:
        """The description (:func:`dashboard_note`) and the saved view (:func:`dashboard_view`); a
        description someone else wrote is left as it is, an older one of ours is brought up to date."""
        note = dashboard_note(self.experiment_id)
        current = tags.get(NOTE_TAG)
        if current != note and (current is None or current.startswith(NOTE_HEADING)):
            self.client.set_experiment_tag(self.experiment_id, NOTE_TAG, note)
        view = json.dumps(dashboard_view())
        if tags.get(VIEW_TAG_PREFIX + VIEW_KEY) != view:
            self.client.set_experiment_tag(self.experiment_id, VIEW_TAG_PREFIX + VIEW_KEY, view)

    # ------------------------------------------------------------------------------ runs
    def start_parent(self, run_name: str, params: dict, tags: dict) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags={k: str(v) for k, v in tags.items()})
        self.parent_id = run.info.run_id
        self.open_runs.append(self.parent_id)
        self.log_params(self.parent_id, params)
        return self.parent_id

    def start_child(self, run_name: str, params: dict) -> str:
        if self.parent_id is None:
            raise RuntimeError("start the parent run first")
        run = self.client.create_run(
            self.experiment_id, run_name=run_name, tags={"mlflow.parentRunId": self.parent_id, "attack": run_name}
        )
        self.open_runs.append(run.info.run_id)
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict) -> None:
        from mlflow.entities import Param

        flat = [Param(k, v) for k, v in sorted(flatten(params).items())]
        for i in range(0, len(flat), 100):
            self.client.log_batch(run_id, params=flat[i : i + 100])

    def log_metrics(self, run_id: str, metrics: dict, step: int = 0) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in sorted(finite_metrics(metrics).items())]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def log_artifacts(self, run_id: str, paths: list[Path], artifact_path: str | None = None) -> None:
        for path in paths:
            if Path(path).is_file():
                self.client.log_artifact(run_id, str(path), artifact_path)

    def log_prompts(self, run_id: str, prompts: list[dict], name: str, source: dict) -> None:
        """The prompt set as the run's dataset input (context ``eval``): :func:`prompts_frame` of
        ``prompts`` (dicts with ``index``, ``kind``, ``text``, ``ids``, optional ``spans``); ``source``
        says where it came from (the --prompts option, seed, tokenizer...). MLflow keeps a dataset's
        name, digest, schema and row count, not its rows: those go into the artifact ``prompts.csv``,
        which the dataset's source names."""
        import mlflow.data
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.entities import DatasetInput, InputTag

        frame = prompts_frame(prompts)
        self.client.log_text(run_id, frame.to_csv(index=False), PROMPTS_ARTIFACT)
        tags = {**{k: str(v) for k, v in source.items()}, "artifact": PROMPTS_ARTIFACT}
        dataset = mlflow.data.from_pandas(frame, name=name, source=CodeDatasetSource(tags))
        self.client.log_inputs(run_id, [DatasetInput(dataset._to_mlflow_entity(),
                                                     [InputTag("mlflow.data.context", "eval")])])

    def log_sweep_step(self, run_id: str, step: int, setting: dict, results: dict) -> None:
        """A sweep's parent run at ``step`` (the setting's index): :func:`sweep_step_metrics`, so the
        run's charts draw every rate against the setting. The first step also logs the prompt set
        (every setting attacks the same prompts) as the sweep run's dataset input."""
        self.log_metrics(run_id, sweep_step_metrics(setting, results), step=step)
        prompts = results.get("prompts") or []
        if step == 0 and prompts:
            c = results.get("config", {})
            rows = [{"index": p["index"], "kind": p.get("kind"), "text": p["truth_text"], "ids": p["truth_ids"],
                     "spans": p.get("spans")} for p in prompts]
            self.log_prompts(run_id, rows, f"prompts-{Path(str(c.get('prompts'))).name}-{len(rows)}x{c.get('length')}",
                             {"prompts": c.get("prompts"), "length": c.get("length"),
                              "seed": (results.get("seeds") or {}).get("prompts"), "tokenizer": c.get("model")})

    def set_tag(self, run_id: str, key: str, value) -> None:
        self.client.set_tag(run_id, key, str(value))

    def finish(self, run_id: str) -> None:
        self.client.set_terminated(run_id, status="FINISHED")
        if run_id in self.open_runs:
            self.open_runs.remove(run_id)

    def fail(self, reason: str = "") -> None:
        """Mark every run still open (children first) as FAILED."""
        for run_id in reversed(list(self.open_runs)):
            try:
                if reason:
                    self.client.set_tag(run_id, "failure", reason[:5000])
                self.client.set_terminated(run_id, status="FAILED")
            except Exception:  # noqa: BLE001 - best effort while failing
                pass
            self.open_runs.remove(run_id)

    def close_orphan(self, run_id: str, reason: str) -> int:
        """Mark ``run_id`` and its nested runs FAILED (tag ``failure``: ``reason``) where they are still RUNNING:
        the runs of a command that was killed outright (benchmarks.out_dir). Returns how many it closed."""
        from mlflow.exceptions import MlflowException

        try:
            runs = [self.client.get_run(run_id)] + self.client.search_runs(
                [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
        except MlflowException:
            return 0  # deleted, or another store
        closed = 0
        for run in runs:
            if run.info.status == "RUNNING":
                self.client.set_tag(run.info.run_id, "failure", reason[:5000])
                self.client.set_terminated(run.info.run_id, status="FAILED")
                closed += 1
        return closed

    def run_url(self) -> str:
        parsed = urlparse(self.uri)
        base = self.uri if parsed.scheme in ("http", "https") else "http://127.0.0.1:5000"
        return f"{base}/#/experiments/{self.experiment_id}/runs/{self.parent_id}"
