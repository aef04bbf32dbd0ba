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
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from urllib.parse import urlparse

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STORE_DIR = REPO_ROOT / "mlflow"
DEFAULT_EXPERIMENT = "sipit-bench"
PACKAGES = ("torch", "transformers", "tokenizers", "mlflow", "numpy", "scipy", "bitsandbytes", "gguf", "sipit-bench")
MAX_PARAM_CHARS = 6000
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


class TrackingError(RuntimeError):
    """The tracking store cannot be reached or written."""


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


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_commit() -> str:
    """The repository's HEAD commit, with ``+dirty`` when tracked files differ from it."""
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


class Tracker:
    """A parent MLflow run with nested attack runs, closed FINISHED or FAILED."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT):
        import mlflow
        from mlflow import MlflowClient

        self.uri = tracking_uri or default_tracking_uri()
        db = sqlite_path(self.uri)
        try:
            if db is not None:
                db.parent.mkdir(parents=True, exist_ok=True)
                if not os.access(db.parent, os.W_OK) or (db.exists() and not os.access(db, os.W_OK)):
                    raise PermissionError(f"{db} (or its folder) is not writable")
            self.client = MlflowClient(tracking_uri=self.uri)
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=artifact_root(self.uri))
            else:
                self.experiment_id = found.experiment_id
            if found is None or EXPERIMENT_KIND[0] not in found.tags:
                # MLflow 3's UI shows GenAI pages unless told this is classic model work: the runs table.
                self.client.set_experiment_tag(self.experiment_id, *EXPERIMENT_KIND)
        except Exception as err:  # noqa: BLE001 - any store failure means "cannot track"
            raise TrackingError(f"cannot use MLflow tracking store {self.uri!r}: {type(err).__name__}: {err}") from err
        self._mlflow = mlflow
        self.parent_id: str | None = None
        self.open_runs: list[str] = []

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

    def run_url(self) -> str:
        parsed = urlparse(self.uri)
        base = self.uri if parsed.scheme in ("http", "https") else "http://127.0.0.1:5000"
        return f"{base}/#/experiments/{self.experiment_id}/runs/{self.parent_id}"
