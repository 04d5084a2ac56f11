"""validate's ``/metrics`` scrape (``tools/validate/metrics.py``) against a stand-in server.

The stand-in serves a page in vLLM's shape (prometheus_client's text format: vLLM's own series,
this project's, and the python/process collectors') and, on other paths, what a broken server
could send: a page larger than the bound, a page that is not the format, an error status.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from drama3_patches.tools.validate import metrics
from drama3_patches.tools.validate.outdir import OutFolder

PAGE = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="drama3"} 2.0
# HELP drama3_patches_patch_state Patch state per process role: 1 for the state the patch is in, else 0.
# TYPE drama3_patches_patch_state gauge
drama3_patches_patch_state{host="n1",patch="preemption-host-copy",rank="0",role="worker",stage="0",state="applied"} 1.0
drama3_patches_patch_state{host="n1",patch="preemption-host-copy",rank="1",role="worker",stage="0",state="applied"} 1.0
drama3_patches_patch_state{host="n1",patch="preemption-host-copy",rank="1",role="worker",stage="0",state="failed"} 0.0
# HELP drama3_patches_events_total Runtime events the patches counted (preemptions, resumes, checks).
# TYPE drama3_patches_events_total counter
drama3_patches_events_total{event="preemptions",host="n1",rank="0",role="worker",stage="0"} 3.0
drama3_patches_events_total{event="preemptions",host="n1",rank="1",role="worker",stage="0"} 3.0
drama3_patches_events_total{event="resumes",host="n1",rank="1",role="worker",stage="0"} 2.0
# HELP process_open_fds Number of open file descriptors.
# TYPE process_open_fds gauge
process_open_fds 42.0
"""


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body, status = {"/metrics": (PAGE, 200), "/huge/metrics": ("x" * 5000, 200),
                        "/garbage/metrics": ("drama3_patches_x{ 1\n", 200),
                        "/down/metrics": ("no", 503)}.get(self.path, ("missing", 404))
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def out(tmp_path):
    """validate's output folder, as validate makes it (written through its descriptor)."""
    folder = OutFolder(tmp_path / "out")
    folder.create()
    yield folder
    folder.close()


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_save_writes_the_page_and_returns_this_projects_samples(server, out):
    got = metrics.save(server, out)
    assert "error" not in got
    assert (out / "metrics.txt").read_text() == PAGE and got["file"] == str(out / "metrics.txt")
    samples = got["samples"]
    assert {s.name for s in samples} == {"drama3_patches_patch_state", "drama3_patches_events_total"}
    assert len(samples) == 6
    assert metrics.total(samples, "drama3_patches_events_total", event="preemptions") == 6
    assert metrics.total(samples, "drama3_patches_events_total", event="preemptions", rank="1") == 3
    applied = [s.labels["rank"] for s in samples if s.name == "drama3_patches_patch_state"
               and s.labels["patch"] == "preemption-host-copy" and s.labels["state"] == "applied" and s.value == 1]
    assert applied == ["0", "1"]


def test_a_page_over_the_bound_is_not_read_whole(server, out, monkeypatch):
    monkeypatch.setattr(metrics, "MAX_PAGE_BYTES", 4096)
    got = metrics.save(server + "/huge", out)
    assert got["samples"] == [] and got["file"] is None and "over 4096 bytes" in got["error"]
    assert not (out / "metrics.txt").exists()


def test_a_page_that_is_not_prometheus_text_is_kept_and_said(server, out):
    got = metrics.save(server + "/garbage", out)
    assert got["samples"] == [] and got["error"].startswith("not a Prometheus page")
    assert (out / "metrics.txt").read_text() == "drama3_patches_x{ 1\n"


@pytest.mark.parametrize("path, why", [("/down", "503"), ("/nowhere", "404")])
def test_a_server_that_does_not_answer_200_is_an_error_line(server, out, path, why):
    got = metrics.save(server + path, out)
    assert got["samples"] == [] and why in got["error"]


def test_an_unreachable_server_is_an_error_line(out):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    got = metrics.save(f"http://127.0.0.1:{port}", out, timeout=5)
    assert got["samples"] == [] and "Connection refused" in got["error"]
