"""benchmarks.tools.search_load: the rates from a fake run, the CPU accounting, the probe, one real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from benchmarks.tools import search_load as load
from benchmarks.tools import search_load_probe as probe

T0 = 1000.0


def _trial(state: str, start: float, complete: float | None) -> dict:
    return {"state": state, "start": start, "complete": complete}


def _event(t: float, wall: float, cpu: float, name: str, main: bool = True) -> list:
    return [t, wall, cpu, name, main]


def _cpu(busy: float, total: float, **parts: float) -> dict:
    return {"busy": busy, "total": total, "workers": 0.0, "postgres": 0.0, "mlflow_server": 0.0, "grpc_proxy": 0.0,
            **parts}


def _fake_run(track: bool = True) -> dict:
    """A 30 s window with 4 trials done inside it (and trials outside it that must not count)."""
    trials = [_trial("COMPLETE", T0 - 2, T0 - 1),  # finished before the window
              *(_trial("COMPLETE", T0 + 5 * i, T0 + 5 * i + 2) for i in range(1, 5)),  # 4 inside, 2 s each
              _trial("FAIL", T0 + 10, T0 + 11), _trial("RUNNING", T0 + 29, None),
              _trial("COMPLETE", T0 + 29, T0 + 31)]  # finished after the window
    events = [_event(T0 - 5, 9.0, 9.0, "storage:get_all_trials"),  # before the window: ignored
              *(_event(T0 + i, 0.010, 0.004, "storage:set_trial_user_attr") for i in range(8)),
              _event(T0 + 3, 0.0, 0.0, "storage:get_heartbeat_interval"),  # a setting, no storage access
              _event(T0 + 4, 0.006, 0.002, "storage:record_heartbeat", main=False),
              *(_event(T0 + i, 0.050, 0.010, "mlflow:POST /api/2.0/mlflow/runs/create") for i in range(4))]
    cpu = (_cpu(0, 0), _cpu(busy=3000, total=6000, workers=12.0, postgres=2.0, mlflow_server=4.0))
    db = {"optuna": {"statements": 40, "xacts": 12, "commits": 8, "exec_ms": 2.0,
                     "top": [{"query": "BEGIN", "calls": 12, "ms": 0.1}]},
          "mlflow": {"statements": 20, "xacts": 8, "exec_ms": 4.0, "top": []}}
    return load.summarize(name="fake", workers=2, track=track, grpc=False, window=(T0, T0 + 30), trials=trials,
                          events=events, cpu=cpu, db=db, cores=2)


def test_rates_from_a_fake_run_count_only_the_window():
    run = _fake_run()
    assert run["completed"] == 4 and run["failed"] == 1
    assert run["trials_per_min"] == pytest.approx(60 * 4 / 30)
    assert run["trial_s_mean"] == pytest.approx(2.0)
    s = run["storage"]
    assert s["calls_per_trial"] == pytest.approx(8 / 4)  # the setting getter and the pre-window call left out
    assert s["heartbeat_thread_calls_per_trial"] == pytest.approx(1 / 4)
    assert s["wall_ms_per_trial"] == pytest.approx(1000 * 8 * 0.010 / 4)
    assert s["client_cpu_ms_per_trial"] == pytest.approx(1000 * (8 * 0.004 + 0.002) / 4)
    assert s["worker_time_share"] == pytest.approx(8 * 0.010 / (2 * 30))
    assert (s["statements_per_trial"], s["transactions_per_trial"]) == (10, 3)
    assert s["round_trips_per_trial"] == 11  # 40 statements + 4 pre-pings (12 transactions, 8 of them COMMITted)
    assert s["top_statements"] == [{"query": "BEGIN", "per_trial": 3.0, "ms_mean": pytest.approx(0.1 / 12)}]
    m = run["mlflow"]
    assert m["requests_per_trial"] == 1 and m["wall_ms_per_trial"] == pytest.approx(50)
    assert m["statements_per_trial"] == 5
    cpu = run["cpu"]
    assert cpu["machine_busy"] == 0.5 and cpu["machine_busy_cores"] == 1.0
    assert cpu["workers_s_per_trial"] == 3.0 and cpu["postgres_s_per_trial"] == 0.5
    # the machine was busy 1 core x 30 s = 30 CPU s, the measured processes used 18
    assert cpu["others_s_per_trial"] == pytest.approx((30 - 18) / 4)
    assert _fake_run(track=False)["mlflow"] is None


def test_ceilings_say_how_many_worker_cores_saturate_each_shared_part():
    ce = load.ceilings(_fake_run())
    assert ce["workers_trials_per_min_per_core"] == pytest.approx(60 / 3.0)
    assert ce["postgres"] == {"trials_per_min_per_core": pytest.approx(120), "worker_cores_to_saturate": 6.0}
    assert ce["mlflow_server"]["worker_cores_to_saturate"] == pytest.approx(3.0)
    assert ce["grpc_proxy"] is None  # did not run


def test_no_trial_in_the_window_gives_nan_rates_not_an_error():
    run = load.summarize(name="empty", workers=1, track=False, grpc=False, window=(T0, T0 + 10), trials=[],
                         events=[], cpu=(_cpu(0, 0), _cpu(10, 20)), db={}, cores=2)
    assert run["completed"] == 0 and run["trials_per_min"] == 0
    assert run["storage"]["calls_per_trial"] != run["storage"]["calls_per_trial"]  # nan
    assert "n/a" in load.markdown({"machine": {"cores": 2}, "options": {"model": "tiny-llama"}, "command": "x",
                                   "latency": {}, "runs": [{**run, "ceilings": load.ceilings(run)}]})


def test_markdown_table_has_one_row_per_run_with_its_numbers():
    run = _fake_run()
    run["ceilings"], run["others_top"] = load.ceilings(run), [{"command": "pytest", "cpu_s": 11.5}]
    text = load.markdown({"machine": {"cores": 2}, "options": {"model": "tiny-llama"}, "command": "python -m x",
                          "latency": {"select_1_ms": 0.02}, "runs": [run]})
    row = next(line for line in text.splitlines() if line.startswith("| 2 | direct | on |"))
    assert "| 8.0 |" in row and "| 2.00 |" in row and "50%" in row
    assert "pytest 11.5 s" in text  # the others' CPU is named
    assert "`BEGIN`" in text and "POST /api/2.0/mlflow/runs/create" in text


def test_db_delta_counts_new_and_grown_statements():
    before = {"statements": {"1": ("SELECT a", 5, 1.0), "2": ("SELECT b", 3, 1.0)}, "xacts": 10}
    after = {"statements": {"1": ("SELECT a", 9, 3.0), "2": ("SELECT b", 3, 1.0), "3": ("INSERT c", 7, 0.7),
                            "4": ("COMMIT", 2, 0.01)}, "xacts": 25}
    d = load.db_delta(before, after)
    assert d["statements"] == 13 and d["xacts"] == 15 and d["exec_ms"] == pytest.approx(2.71)
    assert d["commits"] == 2
    assert [q["query"] for q in d["top"]] == ["INSERT c", "SELECT a", "COMMIT"]


def test_split_workers_over_machines():
    assert load.split_workers(8, 2) == [4, 4]
    assert load.split_workers(5, 2) == [3, 2]
    assert load.split_workers(1, 2) == [1]


def test_process_tree_cpu_and_the_others():
    table = {1: (0, 1.0, "init"), 10: (1, 2.0, "mlflow"), 11: (10, 3.0, "uvicorn"), 12: (11, 0.5, "python"),
             20: (1, 7.0, "pytest")}
    assert load.tree_cpu(table, 10) == 5.5 and load.tree_cpu(table, 99) == 0
    later = {**table, 11: (10, 4.0, "uvicorn"), 20: (1, 9.5, "pytest"), 30: (1, 1.0, "new")}
    others = load.other_processes({"table": table, "roots": [10]}, {"table": later, "roots": [10]})
    assert others == [{"command": "pytest", "cpu_s": 2.5}]  # ours (10-12) and the one born inside left out


def test_own_process_cpu_is_read_from_proc():
    busy, total = load.machine_cpu()
    assert 0 < busy <= total
    start = load.proc_table()[os.getpid()][1]
    sum(i * i for i in range(3_000_000))  # ~0.2 s of CPU
    assert load.proc_table()[os.getpid()][1] > start


def test_running_tells_live_processes_from_zombies_and_gone_ones():
    assert load.running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while load.running(child.pid) and time.monotonic() < deadline:  # exits, not reaped yet: a zombie
        time.sleep(0.05)
    assert not load.running(child.pid) and Path(f"/proc/{child.pid}").exists()
    child.wait()
    assert not load.running(child.pid)


# --------------------------------------------------------------------------- the probe
def _store_class():
    class Store:
        def get_all_trials(self):
            return self.get_trial()  # nested: part of the outer call

        def get_trial(self):
            return 1

        def _private(self):
            return 2

    return Store


def test_probe_records_outermost_storage_calls_with_their_thread(monkeypatch):
    monkeypatch.setattr(probe, "EVENTS", [])
    cls = _store_class()
    probe.patch_storage_class(cls)
    probe.patch_storage_class(cls)  # twice: wrapped once
    store = cls()
    assert store.get_all_trials() == 1 and store._private() == 2
    thread = threading.Thread(target=store.get_trial)
    thread.start()
    thread.join()
    assert [(e[3], e[4]) for e in probe.EVENTS] == [("storage:get_all_trials", True), ("storage:get_trial", False)]
    assert all(e[1] >= 0 and e[2] >= 0 for e in probe.EVENTS)


def test_probe_names_mlflow_requests_by_method_and_endpoint(monkeypatch):
    monkeypatch.setattr(probe, "EVENTS", [])
    module = types.SimpleNamespace(http_request=lambda host_creds, endpoint, method, **kw: (endpoint, method))
    probe.patch_rest_module(module)
    assert module.http_request("creds", "/api/2.0/mlflow/runs/get", "GET") == ("/api/2.0/mlflow/runs/get", "GET")
    module.http_request(host_creds="c", endpoint="/api/2.0/mlflow/runs/create", method="POST")
    assert [e[3] for e in probe.EVENTS] == ["mlflow:GET /api/2.0/mlflow/runs/get",
                                            "mlflow:POST /api/2.0/mlflow/runs/create"]


def test_probe_patches_a_watched_module_when_it_is_imported_and_dumps_its_events(monkeypatch, tmp_path):
    (tmp_path / "fake_probe_store.py").write_text("class Store:\n    def get_trial(self):\n        return 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(probe, "STORAGE_CLASSES", {"fake_probe_store": "Store"})
    monkeypatch.setattr(probe, "EVENTS", [])
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setenv(probe.PROBE_ENV, str(tmp_path))
    monkeypatch.setattr(probe.signal, "signal", lambda *a: None)
    probe.install()
    probe.install()  # once only
    assert sum(getattr(f, "_sipit_probe", False) for f in sys.meta_path) == 1
    sys.modules.pop("fake_probe_store", None)
    import fake_probe_store

    try:
        assert fake_probe_store.Store().get_trial() == 7
    finally:
        sys.modules.pop("fake_probe_store", None)
    assert [e[3] for e in probe.EVENTS] == ["storage:get_trial"]
    assert (tmp_path / f"ready-{os.getpid()}").exists()  # search_load signals this pid for the events
    probe.dump()
    saved = json.loads(next(tmp_path.glob("probe-*.json")).read_text())
    assert [e[3] for e in saved["events"]] == ["storage:get_trial"]


# --------------------------------------------------------------------------- one real run
def test_one_worker_for_a_few_seconds_on_postgres(tmp_path):
    """PostgreSQL + the CLI's worker, a 5 s window (trials of ~0.75 s, gradient order): trials are counted
    and the storage's statements seen."""
    code = load.main(["--workers", "1", "--tracking", "off", "--grpc", "none", "--window", "5", "--warmup", "1",
                      "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "search_load.json").read_text())
    (run,) = report["runs"]
    assert run["completed"] >= 3 and run["probed_processes"] == 1
    assert run["storage"]["calls_per_trial"] >= 5  # create, params, user attributes, state, reads
    assert run["storage"]["statements_per_trial"] > run["storage"]["calls_per_trial"]  # BEGIN/COMMIT + queries
    assert run["cpu"]["postgres_s_per_trial"] > 0 and report["latency"]["select_1_ms"] > 0
    assert "| 1 | direct | off |" in (tmp_path / "search_load.md").read_text()
