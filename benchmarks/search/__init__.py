"""Optuna search for the cheapest defence that makes the model non-invertible, over many workers.

    python -m benchmarks.search --storage search.journal --study demo --n-trials 30 --workers 2

The command line and :func:`run_search` are in :mod:`benchmarks.search.cli` (its docstring is the
manual); each job has its module: ``study`` (configuration, study creation), ``storage`` (storage,
heartbeats, stale-trial retry, outages), ``worker`` (the worker loop), ``trial`` (one trial),
``space`` (the families, the draw and the measurement of one setting), ``processes`` (worker
subprocesses), ``runs`` (MLflow runs), ``report`` (the report), ``errors`` (how a search stops short).

The public names below are re-exported here and imported on first use, so that
``python -m benchmarks.search`` guards Ctrl-C (benchmarks.startup) before the heavy imports.
"""

from __future__ import annotations

import importlib

#: public name -> the module of this package that defines it
_EXPORTS = {
    "run_search": "cli", "main": "cli", "build_parser": "cli",
    "SearchUsageError": "errors", "SearchAborted": "errors", "SearchInterrupted": "errors",
    "make_config": "study", "check_same_config": "study", "create_study": "study",
    "open_storage": "storage", "requeue": "storage", "STORAGE_ENV": "storage",
    "PARENT_ATTR": "runs",
    "worker_process": "processes", "run_worker_processes": "processes",
    "run_worker": "worker",
    "trial_context": "trial",
    "write_report": "report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
