"""A real Prometheus (and promtool) on loopback for the dashboard and alert tests.

Debian's ``prometheus`` package gives both (``.ci/run`` installs it where missing). Everything
here listens on 127.0.0.1 only, and every wait is bounded by a deadline.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from support.subproc import ROOT, child_env

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MISSING = "Debian's prometheus package is not installed (apt-get install prometheus; .ci/run does)"
ALERTS_FILE = ROOT / "docs/grafana/drama3-patches-alerts.yaml"
DASHBOARD_FILE = ROOT / "docs/grafana/drama3-patches.json"


def promtool(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # loopback only: the URLs are ours
        return json.loads(r.read(1 << 22))


def rules_with_for(overrides: dict[str, str]) -> dict:
    """The documented alert rules, each ``for:`` replaced where ``overrides`` names the alert
    (the expressions, labels and annotations untouched)."""
    rules = yaml.safe_load(ALERTS_FILE.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") in overrides:
                rule["for"] = overrides[rule["alert"]]
    return rules


class Prometheus:
    """``prometheus`` on a loopback port with ``jobs`` ({job: "127.0.0.1:port"}) scraped and
    ``rules`` loaded, both at ``interval``; stopped by :meth:`stop`."""

    def __init__(self, workdir: Path, jobs: dict[str, str], rules: dict, interval: str = "1s") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
            "rule_files": [str(workdir / "rules.yaml")],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                               for job, target in jobs.items()],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.ready_s = None

    def wait_ready(self, timeout: float = 30) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}: {self.log_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - self.started
                        return self.ready_s
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"prometheus not ready within {timeout} s: {self.log_text()}")

    def alerts(self) -> list[dict]:
        return get_json(f"{self.url}/api/v1/alerts")["data"]["alerts"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` gives now; raises for a query Prometheus rejects."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        return get_json(url)["data"]["result"]

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


# -- the scraped side: vLLM's /metrics in a process of its own --------------------------------------

SERVE = """
import socket, sys
import uvicorn
from fastapi import FastAPI
from vllm.entrypoints.serve.instrumentator.metrics import attach_router

app = FastAPI()
attach_router(app)
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
"""

# A process of the deployment: its patches settle (the engine writes its report), then it stays
# until its stdin closes.
WRITER = """
import sys
import d3p_target, drama3_patches
drama3_patches.status()
print("ready", flush=True)
sys.stdin.read()
"""


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            line = proc.stdout.readline()
            if line:
                return line.strip()
            break
    proc.kill()
    proc.wait(10)
    raise AssertionError(f"child gave no line within {timeout} s (exit {proc.returncode}): {stderr_of(proc)}")


def stderr_of(proc: subprocess.Popen) -> str:
    proc.errfile.seek(0)
    return proc.errfile.read()[-3000:]


def spawn(code: str, env: dict, pythonpath=()) -> subprocess.Popen:
    """``python -c code`` in a fresh interpreter (read its first line with :func:`first_line`)."""
    errfile = tempfile.TemporaryFile("w+")  # not a pipe: one nobody reads could fill and stall the child
    proc = subprocess.Popen([sys.executable, "-c", code], env=child_env(env, list(pythonpath)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errfile, text=True, cwd=os.getcwd())
    proc.errfile = errfile
    return proc


def end_child(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    proc.stdout.close()
    proc.errfile.close()


# -- the dashboard's queries ----------------------------------------------------------------------

def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expression) of every panel target and query variable of the dashboard."""
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    out = [(f"panel {panel['title']!r} {t['refId']}", t["expr"])
           for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":  # Grafana's label_values(SERIES, LABEL): the label's values on SERIES
            series, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"]).groups()
            out.append((f"variable {v['name']}", f"group by ({label}) ({series})"))
    return out


def grafana_substituted(expr: str, rate_interval: str = "1m") -> str:
    """``expr`` with the dashboard's variables as Grafana fills them: "All" for the multi-value
    ones, each other variable's default, ``$__rate_interval`` given."""
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    values = {"__rate_interval": rate_interval}
    for v in dashboard["templating"]["list"]:
        if v.get("includeAll"):
            values[v["name"]] = v.get("allValue", ".*")
        elif v["type"] == "custom":
            values[v["name"]] = v["current"]["value"]
        elif v["type"] == "constant":
            values[v["name"]] = v["query"]
    for name in sorted(values, key=len, reverse=True):  # $sample_rate before a shorter prefix
        expr = expr.replace(f"${name}", values[name])
    assert "$" not in expr, expr
    return expr


class Pages:
    """A loopback HTTP server that answers its n-th GET with ``pages[min(n, last)]`` (text format)."""

    def __init__(self, pages: list[str]) -> None:
        import http.server
        import threading

        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                body = pages[min(served.gets, len(pages) - 1)].encode()
                served.gets += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.gets = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
