"""Screenshots of the dashboard with headless Chromium: the runs table with the SipIt vs head columns,
a sweep run's charts, and a run's report.html.

    .venv/bin/python -m benchmarks.run --model tiny-llama --n-prompts 3 --length 8 --defense noise \\
        --sigma-rel 0.01,1,10 --attacks sipit,softmax-head,inverse-head --utility-tokens 64 \\
        --tracking-uri sqlite:////tmp/shots/mlflow.db --out /tmp/shots/sweep
    .venv/bin/python -m benchmarks.tools.screenshots --tracking-uri sqlite:////tmp/shots/mlflow.db \\
        --report /tmp/shots/sweep/<config hash>/report.html --out docs

It starts the server mlflow/README.md documents (127.0.0.1, a free port, one worker, no job runner)
on the sqlite store, waits for ``/health``, and drives Chromium (Debian's ``chromium``; ``--no-sandbox``
because this runs as root in a container) over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: no websocket library needed): it opens each page, closes MLflow's
assistant panel if it opened, waits until the page shows what the picture is for, and captures it.

- ``mlflow-dashboard.png``: the experiment's saved view ``sipit-vs-head`` (benchmarks.tracking writes
  it as the experiment tag ``mlflow.sharedViewState.sipit-vs-head``; the UI loads it from
  ``?viewStateShareKey=sipit-vs-head``): per rate, every attack's column side by side.
- ``mlflow-sweep-charts.png``: the newest sweep run's *Model metrics* tab, its charts filtered to
  ``token_accuracy`` (one chart per attack, x = setting index).
- ``mlflow-run.png``: the newest single run's overview with its nested attack runs and dataset.
- ``report-html.png``: ``--report`` (a run's report.html), the top of the page.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import base64
import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.tracking import DEFAULT_EXPERIMENT, VIEW_KEY, sqlite_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(db: Path, log_path: Path, timeout: float = 120):
    """The server of mlflow/README.md on ``db`` (sqlite file): yields its base URL, stops it after."""
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{db}",
           "--artifacts-destination", str(db.parent / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no mlflow server on {base} after {timeout:.0f}s (log: {log_path})")
            time.sleep(0.5)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=10)


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fd 3: commands in, fd 4: replies out)."""

    def __init__(self, width: int = 1400, height: int = 900, binary: str | None = None):
        binary = binary or shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
        if binary is None:
            raise RuntimeError("no chromium: apt-get install -y chromium")
        self.width, self.height = width, height
        self.profile = tempfile.mkdtemp(prefix="sipit-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                "--remote-debugging-pipe", f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
                "about:blank"]
        # bash (dash takes one-digit fds only) moves the pipe ends to the fds Chromium expects (3: commands in, 4: replies out)
        self.proc = subprocess.Popen(
            ["/bin/bash", "-c", f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}', binary, *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(to_chrome_r, from_chrome_w),
            start_new_session=True)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next_id = 0
        self.session = None
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def send(self, method: str, params: dict | None = None, *, session: bool = True, timeout: float = 60) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                    raise TimeoutError(f"chromium did not answer {method} in {timeout:.0f}s")
                chunk = os.read(self._from_chrome, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails'].get('text')}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 60, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never showed {what or expression} in {timeout:.0f}s")
            time.sleep(0.5)

    def open(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete'", what="a loaded page")

    def resize(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def screenshot(self, path: Path, full_height: int | None = None) -> Path:
        """The viewport (or the page's top ``full_height`` pixels) as a PNG."""
        params: dict = {"format": "png"}
        if full_height:
            height = min(full_height, int(self.evaluate("document.documentElement.scrollHeight")))
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": self.width, "height": height, "scale": 1})
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", params)["data"]))
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close", session=False, timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for fd in (self._to_chrome, self._from_chrome):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)


# JavaScript run in the page
CLOSE_ASSISTANT = """(() => {
  const b = document.querySelector('[data-component-id="mlflow.assistant.chat_panel.close"]');
  if (b) { b.click(); return true; } return false; })()"""
SHOWS = "document.body && document.body.innerText.includes({text})"
HEADER_SHOWS = "[...document.querySelectorAll('.ag-header')].some(h => h.innerText.includes({text}))"
# the charts filter takes a regex: each attack's accuracy, the swept value and the utility cost, per step
CHART_FILTER = r"^((sipit|softmax-head|inverse-head)\.token_accuracy|sweep\..*|utility\.continued_ppl_rel_increase)$"
ML = "workflowType=machine_learning"  # the UI's "Model training" side (a fresh browser starts on GenAI)
PLOTS = "document.querySelectorAll('.js-plotly-plot .scatterlayer .trace').length >= {n}"


def type_into(browser: Chromium, selector: str, text: str) -> None:
    """Put ``text`` in the input ``selector`` the way React notices (native setter + input event)."""
    browser.evaluate(f"""(() => {{
      const el = document.querySelector({json.dumps(selector)});
      const set = Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set;
      set.call(el, {json.dumps(text)}); el.dispatchEvent(new Event('input', {{bubbles: true}})); }})()""")


def settle(browser: Chromium, seconds: float = 2.0) -> None:
    """Close the assistant panel if it opened; give the page a moment to lay out after that."""
    time.sleep(seconds)
    if browser.evaluate(CLOSE_ASSISTANT):
        time.sleep(1.0)


def newest_runs(db: Path, experiment: str) -> tuple[str, str | None, str | None]:
    """(experiment id, newest sweep run id, newest top-level single run id) in the store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no experiment {experiment!r} in {db}")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=500)
    sweep = next((r.info.run_id for r in runs if r.data.tags.get("kind") == "sweep"), None)
    single = next((r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags
                   and r.data.tags.get("kind") != "sweep"), None)
    return exp.experiment_id, sweep, single


def take(db: Path, out: Path, report: Path | None, experiment: str = DEFAULT_EXPERIMENT, width: int = 1400,
         height: int = 900, log=print) -> list[Path]:
    """Every screenshot of the module docstring that the store (and ``report``) allow; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    experiment_id, sweep, single = newest_runs(db, experiment)
    written = []
    with tempfile.TemporaryDirectory() as tmp, mlflow_server(db, Path(tmp) / "server.log") as base:
        browser = Chromium(width, height)
        try:
            browser.open(f"{base}/#/experiments/{experiment_id}/runs?{ML}&viewStateShareKey={VIEW_KEY}")
            browser.wait_for(HEADER_SHOWS.format(text=json.dumps("sipit.token_accuracy")), what="the comparison columns")
            settle(browser, 4)
            written.append(browser.screenshot(out / "mlflow-dashboard.png"))
            log(f"wrote {written[-1]}")
            if sweep:
                browser.resize(width, height + 200)  # two rows of charts
                browser.open(f"{base}/#/experiments/{experiment_id}/runs/{sweep}/model-metrics?{ML}")
                browser.wait_for(PLOTS.format(n=1), what="the sweep run's charts")
                settle(browser)
                search = "input[placeholder*='earch']"
                if browser.evaluate(f"!!document.querySelector({json.dumps(search)})"):
                    type_into(browser, search, CHART_FILTER)
                    time.sleep(3)
                written.append(browser.screenshot(out / "mlflow-sweep-charts.png"))
                log(f"wrote {written[-1]}")
            browser.resize(width, height)
            if single:
                browser.open(f"{base}/#/experiments/{experiment_id}/runs/{single}?{ML}")
                browser.wait_for(SHOWS.format(text=json.dumps("Datasets")), what="the run page")
                settle(browser, 4)
                written.append(browser.screenshot(out / "mlflow-run.png"))
                log(f"wrote {written[-1]}")
            if report is not None:
                browser.open(report.resolve().as_uri())
                time.sleep(1)
                written.append(browser.screenshot(out / "report-html.png", full_height=2 * height))
                log(f"wrote {written[-1]}")
        finally:
            browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.screenshots", description=__doc__.split("\n\n")[0])
    p.add_argument("--tracking-uri", required=True, help="sqlite:////path/mlflow.db (artifacts in artifacts/ next to it)")
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT)
    p.add_argument("--report", type=Path, default=None, help="a run's report.html")
    p.add_argument("--out", type=Path, default=Path("docs"))
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=900)
    args = p.parse_args(argv)
    db = sqlite_path(args.tracking_uri)
    if db is None or not db.is_file():
        p.error(f"--tracking-uri must name an existing sqlite store (got {args.tracking_uri!r})")
    take(db, args.out, args.report, args.experiment, args.width, args.height)
    return 0


if __name__ == "__main__":
    sys.exit(main())
