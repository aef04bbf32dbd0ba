"""Timing probe of the search's storage and tracking calls, for ``benchmarks.tools.search_load``.

Loaded as ``sitecustomize`` into the worker processes of a load run (search_load copies this file
into a folder on their ``PYTHONPATH``), so ``python -m benchmarks.search`` runs unchanged. When
Optuna's cached RDB storage (``optuna.storages._cached_storage``), its gRPC storage proxy client
(``optuna.storages._grpc.client``) or MLflow's REST layer (``mlflow.utils.rest_utils``) is imported,
their calls are wrapped: each outermost call is recorded as ``[start (unix s), wall s, thread CPU s,
name, main thread?]``. Nothing is recorded unless ``$SIPIT_LOAD_PROBE_DIR`` is set; then the process
writes ``ready-<pid>`` there and, on SIGUSR1 (sent by search_load when its window ends), its events
so far to ``probe-<pid>.json``; on SIGUSR2 every thread's stack goes to its stderr (a process that does
not stop). Standard library only at import time.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import threading
import time

PROBE_ENV = "SIPIT_LOAD_PROBE_DIR"
STORAGE_CLASSES = {"optuna.storages._cached_storage": "_CachedStorage",
                   "optuna.storages._grpc.client": "GrpcStorageProxy"}
REST_MODULE = "mlflow.utils.rest_utils"
PRIVATE_CALLS = ("_get_stale_trial_ids",)  # called from outside the class (optuna.storages.fail_stale_trials)

EVENTS: list[list] = []
_local = threading.local()


def _timed(kind: str, name_of, fn):
    """``fn`` recording its outermost calls (nested calls of the same kind are part of the outer one)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_local, kind, 0)
        if depth:
            return fn(*args, **kwargs)
        setattr(_local, kind, 1)
        start, wall, cpu = time.time(), time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(_local, kind, 0)
            EVENTS.append([start, time.perf_counter() - wall, time.thread_time() - cpu,
                           f"{kind}:{name_of(args, kwargs)}", threading.current_thread() is threading.main_thread()])

    wrapper.__sipit_probe__ = True
    return wrapper


def patch_storage_class(cls) -> None:
    """Wrap every public method the class defines (the BaseStorage API the study calls)."""
    for name, value in list(vars(cls).items()):
        if (name.startswith("_") and name not in PRIVATE_CALLS) or not callable(value) \
                or getattr(value, "__sipit_probe__", False):
            continue
        setattr(cls, name, _timed("storage", lambda a, k, n=name: n, value))


def _rest_name(args, kwargs) -> str:
    endpoint = kwargs.get("endpoint", args[1] if len(args) > 1 else "?")
    method = kwargs.get("method", args[2] if len(args) > 2 else "?")
    return f"{method} {endpoint}"


def patch_rest_module(module) -> None:
    """Wrap ``http_request`` (every MLflow tracking REST call goes through it, looked up in the module)."""
    if not getattr(module.http_request, "__sipit_probe__", False):
        module.http_request = _timed("mlflow", _rest_name, module.http_request)


def _after_import(name: str, module) -> None:
    if name in STORAGE_CLASSES:
        patch_storage_class(getattr(module, STORAGE_CLASSES[name]))
    elif name == REST_MODULE:
        patch_rest_module(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Find the watched modules with the other finders, patch them right after they execute."""

    _sipit_probe = True

    def find_spec(self, fullname, path, target=None):
        if fullname not in STORAGE_CLASSES and fullname != REST_MODULE:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "_sipit_probe", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader, exec_module = spec.loader, spec.loader.exec_module

                def exec_and_patch(module, exec_module=exec_module):
                    exec_module(module)
                    _after_import(fullname, module)

                loader.exec_module = exec_and_patch
                return spec
        return None


def dump(*_signal_args) -> None:
    """Write the events so far to ``probe-<pid>.json`` (atomically); the SIGUSR1 handler."""
    folder = os.environ.get(PROBE_ENV)
    if not folder:
        return
    record = {"pid": os.getpid(), "argv": sys.argv, "dumped_at": time.time(), "events": list(EVENTS)}
    path = os.path.join(folder, f"probe-{os.getpid()}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)


def install() -> None:
    """Patch what is imported already, watch for the rest, dump on SIGUSR1. Only when ``$SIPIT_LOAD_PROBE_DIR`` is set."""
    if not os.environ.get(PROBE_ENV) or any(getattr(f, "_sipit_probe", False) for f in sys.meta_path):
        return  # off, or installed already (as sitecustomize, and now imported under its own name)
    for name in (*STORAGE_CLASSES, REST_MODULE):
        if name in sys.modules:
            _after_import(name, sys.modules[name])
    sys.meta_path.insert(0, _PatchOnImport())
    signal.signal(signal.SIGUSR1, dump)
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a stuck process's stacks, into its log
    with open(os.path.join(os.environ[PROBE_ENV], f"ready-{os.getpid()}"), "w"):
        pass  # this pid has the handler: search_load signals only these


install()
