"""Real services for the distributed tests: a throwaway PostgreSQL cluster and an ``mlflow server``.

Both listen on 127.0.0.1 only, on a free port, and are torn down by their fixtures. PostgreSQL
comes from Debian's ``postgresql`` package, installed with apt when it is missing (as CI does for
any service it needs); the server refuses to run as root, so the cluster belongs to the
unprivileged ``postgres`` system user (created by the package) and every server command runs
through ``runuser``.
"""

from __future__ import annotations

import glob
import os
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
SERVICE_USER = "postgres"


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
    """The newest installed PostgreSQL server's bin folder; installs Debian's package when none is."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "postgresql"], check=True,
                       env=env, timeout=900, stdout=subprocess.DEVNULL)
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise RuntimeError("PostgreSQL is not installed and apt-get did not install it")
    return Path(found[-1]).parent


class PostgresCluster:
    """initdb in a temporary folder, one server on 127.0.0.1:<free port>, password auth over TCP."""

    def __init__(self) -> None:
        self.bin = postgres_bin_dir()
        # /tmp, not $TMPDIR: the service user must be able to reach the folder (a TMPDIR under /root is not)
        self.root = Path(tempfile.mkdtemp(prefix="sipit-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.port = free_port()
        shutil.chown(self.root, user=SERVICE_USER)
        pwfile = self.root / "pw"
        pwfile.write_text(PG_PASSWORD + "\n")
        shutil.chown(pwfile, user=SERVICE_USER)
        self._as_service(["initdb", "-D", str(self.data), "-U", PG_USER, f"--pwfile={pwfile}", "-E", "UTF8",
                          "--auth-host=scram-sha-256", "--auth-local=trust", "--no-sync"])
        pwfile.unlink()

    def _as_service(self, argv: list[str], timeout: float = 60) -> None:
        subprocess.run(["runuser", "-u", SERVICE_USER, "--", str(self.bin / argv[0]), *argv[1:]], check=True,
                       timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=200"
        self._as_service(["pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-l", str(self.root / "server.log"),
                          "-o", options, "start"], timeout=90)

    def stop(self) -> None:
        self._as_service(["pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-m", "fast", "stop"], timeout=90)

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
