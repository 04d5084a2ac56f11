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


def get_json(url: str, timeout: float = 5, limit: int = 1 << 22) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # loopback only: the URLs are ours
        body = r.read(limit + 1)
    if len(body) > limit:
        raise AssertionError(f"{url[:200]}: an answer over {limit} bytes")
    return json.loads(body)


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
        self.interval = interval
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

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """The result of ``expr`` now (or at ``at``, seconds since the epoch); raises for a query
        Prometheus rejects."""
        params = {"query": expr} | ({} if at is None else {"time": f"{at:.3f}"})
        return get_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode(params))["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """``expr`` over [start, end] every ``step`` seconds, as a Grafana panel asks for it."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        url = f"{self.url}/api/v1/query_range?" + urllib.parse.urlencode(params)
        return get_json(url, timeout=30, limit=1 << 26)["data"]["result"]  # a run's points: megabytes

    def rules(self) -> list[dict]:
        return [r for g in get_json(f"{self.url}/api/v1/rules")["data"]["groups"] for r in g["rules"]]

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


# -- a run of validate scraped while it serves (tests/e2e/test_validate.py, tests/hardware) --------

SCRAPE_S = 2  # 1 s scrapes time out on a loaded CPU host (scrape_timeout cannot exceed the interval)
PANEL_POINTS = 1000  # Grafana's maxDataPoints for a panel about 1000 pixels wide
# The dashboard queries a healthy run leaves without a series, and why.
EMPTY_BY_DESIGN = {
    "panel 'Reports gone, skipped, remote; collector errors' B":
        "'> 0' keeps only the skip reasons with files, and a healthy report folder has none skipped",
    "panel 'Speech streams completed and aborted per second' B":
        "vLLM-Omni writes a reason's series at its first aborted stream, and the run aborts none",
}
# vLLM-Omni's audio series behind the dashboard's listener panels (their totals at the end)
AUDIO_TOTALS = ("vllm_omni:audio_ttfp_s_count", "vllm_omni:audio_rtf_count", "vllm_omni:audio_underrun_s_count",
                "vllm_omni:audio_frames_total", "vllm_omni:speech_stream_completed_total")
JOB = "vllm"


def version() -> str:
    done = subprocess.run([PROMETHEUS, "--version"], capture_output=True, text=True, timeout=30)
    return (done.stdout or done.stderr).splitlines()[0]


def grafana_step(start: float, end: float, scrape_s: int = SCRAPE_S) -> int:
    """``$__interval`` in whole seconds for a panel over [start, end]: the range over the panel's
    points, not below the data source's scrape interval."""
    return max(scrape_s, int(-(-(end - start) // PANEL_POINTS)))


def grafana_rate_interval(step_s: int, scrape_s: int = SCRAPE_S) -> str:
    """Grafana's ``$__rate_interval``: max($__interval + scrape interval, 4 x scrape interval)."""
    return f"{max(step_s + scrape_s, 4 * scrape_s)}s"


def raw(p: Prometheus, series: str, start: float, end: float) -> list[tuple[float, float]]:
    """Every scraped sample of ``series`` in [start, end], the series' values added per scrape."""
    window = int(end - start) + 1
    added: dict[float, float] = {}
    params = {"query": f"{series}[{window}s]", "time": f"{end:.3f}"}
    for result in get_json(f"{p.url}/api/v1/query?" + urllib.parse.urlencode(params), 30, 1 << 26)["data"]["result"]:
        for t, v in result["values"]:
            added[float(t)] = added.get(float(t), 0.0) + float(v)
    return sorted(added.items())


def steps(counts: list, sums: list) -> list[dict]:
    """A histogram's scrapes as the observations each added: ``after`` observations were in by
    then, ``added`` of them new, adding ``sum`` (one request's value where ``added`` is 1)."""
    sums = dict(sums)
    out, before, sum_before = [], 0.0, 0.0
    for t, c in counts:
        if c > before:
            out.append({"t": t, "after": int(c), "added": int(c - before), "sum": sums.get(t, 0.0) - sum_before})
        before, sum_before = c, sums.get(t, sum_before)
    return out


def observation(events: list[dict], k: int) -> float | None:
    """The k-th observation's value (1-based) where its scrape added it alone, else None."""
    for e in events:
        if e["after"] - e["added"] < k <= e["after"]:
            return e["sum"] if e["added"] == 1 else None
    return None


class Around:
    """A Prometheus scraping ``target`` (validate's ``--port`` on loopback) every ``SCRAPE_S`` with
    the documented rules loaded, started before the run and, after it, asked what a Grafana
    dashboard over the run would show: ``record`` (JSON), also written to ``workdir/record.json``.
    Nothing here fails the run: a Prometheus missing or failing is recorded as ``error``."""

    def __init__(self, workdir: Path, target: str) -> None:
        self.workdir, self.target = workdir, target
        self.record: dict = {"target": target}
        self.p: Prometheus | None = None

    def __enter__(self) -> Around:
        if PROMETHEUS is None:
            self.record["error"] = MISSING
            return self
        self.began = time.time()
        try:
            self.record["version"] = version()
            self.p = Prometheus(self.workdir, {JOB: self.target}, rules_with_for({}), interval=f"{SCRAPE_S}s")
            self.record["ready_s"] = self.p.wait_ready()
        except Exception as exc:  # recorded: the run goes on without its scrapes
            self.record["error"] = f"prometheus did not start: {exc}"
        return self

    def __exit__(self, *exc) -> None:
        if self.p is None:
            return
        try:
            if "error" not in self.record:
                self._collect(time.time())
        except Exception as exc:  # recorded for the tests that read it
            self.record["error"] = f"{type(exc).__name__}: {exc}\n{self.p.log_text()}"
        finally:
            self.p.stop()
            (self.workdir / "record.json").write_text(json.dumps(self.record, indent=1))

    def _collect(self, now: float) -> None:
        p, rec = self.p, self.record
        up = [t for t, v in raw(p, f'up{{job="{JOB}"}}', self.began, now) if v == 1]
        rec["scrapes"] = len(raw(p, f'up{{job="{JOB}"}}', self.began, now))
        if not up:
            rec["error"] = f"{self.target} was never up in {now - self.began:.0f} s\n{p.log_text()}"
            return
        # after the server stopped, a query at 'now' sees stale series: ask at its last scrape
        first, last = up[0], up[-1]
        step = grafana_step(first, last)
        rec |= {"up": len(up), "first_up": first, "last_up": last, "step_s": step,
                "rate_interval": grafana_rate_interval(step), "panels": {}, "totals": {}}
        for where, expr in dashboard_queries():
            filled = grafana_substituted(expr, rec["rate_interval"])
            result = p.query_range(filled, first, last, step)
            values = [float(v) for r in result for _, v in r["values"]]
            finite = [v for v in values if v == v and abs(v) != float("inf")]
            rec["panels"][where] = {"expr": filled, "series": len(result), "finite": len(finite),
                                    "above_0": sum(v > 0 for v in finite), "max": max(finite, default=None),
                                    "labels": [r["metric"] for r in result][:8]}
        for name in AUDIO_TOTALS:
            got = p.query(f"sum({name})", at=last)
            rec["totals"][name] = float(got[0]["value"][1]) if got else None
        rec["rules"] = {r["name"]: {"health": r["health"], "state": r.get("state"), "error": r.get("lastError", "")}
                        for r in p.rules()}
        counts = raw(p, "vllm_omni:audio_underrun_s_count", first, last)
        sums = raw(p, "vllm_omni:audio_underrun_s_sum", first, last)
        rec["underrun_steps"] = steps(counts, sums)
